"""The built-in dashboard's HTML: one self-contained page (inline CSS, SVG and a little JS, no CDN).

`page()` is the whole document; `panel()` the live part, which the page's script fetches again
every `REFRESH_MS` and swaps in (so the server renders everything, once, in one place). Stable DOM
for tests and scripts: `#tile-<name> .value` per headline number, `tr.worker` per worker,
`tr.speculative` per worker that speculates (`data-url`), `tr.tenant` per tenant and model, `section.trace` per trace with one `div.span-row` per span
(`data-name`, `data-service`), and `body[data-refreshed]` counting the script's refreshes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from html import escape
from typing import Any

from gateway.observability.live_stats import Window

REFRESH_MS = 5000
SERVICE_COLOURS = {"tollway-gateway": "#4e79a7", "tollway-worker": "#f28e2b", "engine": "#59a14f"}
STYLE = """
body{font:14px/1.4 system-ui,sans-serif;margin:0;background:#f6f7f9;color:#1f2328}
header{background:#1f2328;color:#fff;padding:10px 20px;display:flex;gap:16px;align-items:center}
header h1{font-size:18px;margin:0;flex:1} header form{margin:0} header button{cursor:pointer}
main{padding:16px 20px} h2{font-size:15px;margin:22px 0 8px}
.tiles{display:flex;gap:12px;flex-wrap:wrap}
.tile{background:#fff;border:1px solid #d0d7de;border-radius:6px;padding:10px 14px;min-width:150px}
.tile .label{color:#57606a;font-size:12px} .tile .value{font-size:26px;font-weight:600}
.tile .note{color:#57606a;font-size:11px}
table{border-collapse:collapse;background:#fff;border:1px solid #d0d7de}
th,td{padding:4px 10px;border-bottom:1px solid #eaeef2;text-align:right} th:first-child,td:first-child{text-align:left}
.kv{display:inline-flex;width:220px;height:12px;border:1px solid #8c959f;vertical-align:middle}
.kv span{display:block;height:100%} .used{background:#cf222e} .evictable{background:#d4a72c} .free{background:#2da44e}
.trace{background:#fff;border:1px solid #d0d7de;border-radius:6px;margin:0 0 10px;padding:8px 12px}
.trace h3{font-size:13px;margin:0 0 6px} .span-row{display:flex;align-items:center;height:18px;font-size:12px}
.span-name{box-sizing:border-box;width:300px;flex:none;white-space:nowrap;overflow:hidden;text-overflow:ellipsis}
.span-track{position:relative;flex:1;height:12px;background:#f6f8fa}
.span-bar{position:absolute;top:0;height:12px;min-width:2px;border-radius:2px}
.span-ms{width:80px;text-align:right;color:#57606a} .error{color:#cf222e} .muted{color:#57606a}
"""
SCRIPT = """
(function(){
  var refreshes = 0;
  async function refresh(){
    try {
      var r = await fetch('/admin/dashboard/panel', {credentials: 'same-origin', cache: 'no-store'});
      if (r.status === 401) { location.reload(); return; }
      if (!r.ok) return;
      document.getElementById('panel').innerHTML = await r.text();
      refreshes += 1;
      document.body.dataset.refreshed = String(refreshes);
      document.getElementById('updated').textContent = new Date().toLocaleTimeString();
    } catch (e) { /* the gateway is restarting: try again next time */ }
  }
  setInterval(refresh, Number(document.body.dataset.refreshMs));
})();
"""


@dataclass
class DashboardData:
    minute: Window  # the last 60 s of this gateway process
    five_minutes: Window
    requests_series: list[int]  # per second, oldest first
    workers: list[dict[str, Any]]  # url, healthy, model, in_flight, info (the worker's /internal/info)
    month: str
    tenants: list[dict[str, Any]]  # tenant, model, requests, prompt/cached/completion tokens, cost
    traces: list[list[dict[str, Any]]] = field(default_factory=list)  # spans of each trace, root first
    tracing_on: bool = False


def _number(value: float | None, digits: int = 1, suffix: str = "") -> str:
    return "–" if value is None else f"{value:,.{digits}f}{suffix}"


def _tile(name: str, label: str, value: str, note: str) -> str:
    return (f'<div class="tile" id="tile-{name}"><div class="label">{escape(label)}</div>'
            f'<div class="value">{escape(value)}</div><div class="note">{escape(note)}</div></div>')


def _sparkline(series: list[int], width: int = 360, height: int = 60) -> str:
    top = max(series) or 1
    step = width / max(len(series) - 1, 1)
    points = " ".join(f"{i * step:.1f},{height - v / top * (height - 4) - 2:.1f}" for i, v in enumerate(series))
    return (f'<svg id="requests-sparkline" width="{width}" height="{height}" viewBox="0 0 {width} {height}" '
            f'role="img" aria-label="requests per second, last {len(series)} s"><rect width="100%" height="100%" '
            f'fill="#fff" stroke="#d0d7de"/><polyline fill="none" stroke="#4e79a7" stroke-width="1.5" '
            f'points="{points}"/><text x="4" y="12" font-size="10" fill="#57606a">max {top}/s</text></svg>')


def _tiles(data: DashboardData) -> str:
    m, five = data.minute, data.five_minutes
    ttft = f"p95 {_number(five.ttft_p95_s and five.ttft_p95_s * 1e3, 0, ' ms')}, last 5 min"
    return '<div class="tiles">' + "".join((
        _tile("request-rate", "Requests / s", _number(m.requests_per_s, 2), f"{m.requests} in the last minute"),
        _tile("ttft", "TTFT p50", _number(five.ttft_p50_s and five.ttft_p50_s * 1e3, 0, " ms"), ttft),
        _tile("tokens-per-second", "Output tokens / s", _number(m.completion_tokens_per_s, 1),
              f"{m.completion_tokens:,} in the last minute"),
        _tile("cache-hit-ratio", "Prefix cache hit ratio",
              _number(five.cache_hit_ratio and five.cache_hit_ratio * 100, 1, " %"),
              f"{five.cached_tokens:,} of {five.prompt_tokens:,} prompt tokens, 5 min"),
        _tile("errors", "Errors", str(m.errors), "non-2xx answers, last minute"),
    )) + "</div>" + _sparkline(data.requests_series)


def _kv_bar(blocks: dict[str, int]) -> str:
    total = blocks.get("total") or 1
    parts = "".join(f'<span class="{kind}" style="width:{blocks.get(kind, 0) / total * 100:.2f}%" '
                    f'title="{kind} {blocks.get(kind, 0)}"></span>' for kind in ("used", "evictable", "free"))
    return f'<span class="kv">{parts}</span>'


def _workers(workers: list[dict[str, Any]]) -> str:
    rows = []
    for w in workers:
        info = w.get("info") or {}
        blocks = info.get("blocks") or {}
        cache = (info.get("cache") or {}).values()
        hit, miss = sum(s.get("hit_tokens", 0) for s in cache), sum(s.get("miss_tokens", 0) for s in cache)
        used = blocks.get("used", 0) / blocks["total"] * 100 if blocks.get("total") else None
        rows.append(
            f'<tr class="worker" data-url="{escape(w["url"])}"><td>{escape(w["url"])}</td>'
            f'<td class="{"" if w["healthy"] else "error"}">{"up" if w["healthy"] else "down"}</td>'
            f'<td>{escape(str(w.get("model") or "–"))}</td><td>{w["in_flight"]}</td>'
            f'<td>{info.get("running", "–")}</td><td>{info.get("waiting", "–")}</td>'
            f'<td class="kv-used">{_number(used, 1, " %")}</td><td>{_kv_bar(blocks) if blocks else "–"}</td>'
            f'<td>{_number(hit / (hit + miss) * 100 if hit + miss else None, 1, " %")}</td></tr>')
    head = ("<tr><th>worker</th><th>state</th><th>model</th><th>in flight (here)</th><th>running</th>"
            "<th>waiting</th><th>KV used</th><th>KV blocks: used / evictable / free</th><th>cache hit (life)</th></tr>")
    return f'<table id="workers">{head}{"".join(rows)}</table>'


def _speculative(workers: list[dict[str, Any]]) -> str:
    """Speculative decoding per worker that runs it (the `speculative` of its /internal/info, since start)."""
    rows = []
    for w in workers:
        spec = (w.get("info") or {}).get("speculative") or {}
        if spec.get("mode", "off") == "off":
            continue
        drafted = spec.get("drafted_tokens", 0)
        rate = spec.get("acceptance_rate") if drafted else None
        rows.append(
            f'<tr class="speculative" data-url="{escape(w["url"])}"><td>{escape(w["url"])}</td>'
            f'<td>{escape(str(spec["mode"]))}</td><td>{drafted:,}</td><td>{spec.get("accepted_tokens", 0):,}</td>'
            f'<td class="acceptance">{_number(rate and rate * 100, 1, " %")}</td>'
            f'<td class="mean-length">{_number(spec.get("mean_accepted_length") if drafted else None, 2)}</td></tr>')
    if not rows:
        return '<p class="muted" id="speculative-off">No worker speculates (<code>TOLLWAY_SPECULATIVE</code>).</p>'
    head = ("<tr><th>worker</th><th>drafter</th><th>drafted tokens</th><th>accepted</th><th>acceptance</th>"
            "<th>mean accepted length</th></tr>")
    return f'<table id="speculative">{head}{"".join(rows)}</table>'


def _scheduling(workers: list[dict[str, Any]]) -> str:
    """Each worker's tenants as its fair scheduler sees them (workers/engine/fairness.py), furthest behind first."""
    rows = []
    for w in workers:
        info = w.get("info") or {}
        tenants = info.get("tenants") or {}
        for tenant, s in sorted(tenants.items(), key=lambda item: item[1].get("counter", 0)):
            rows.append(
                f'<tr class="tenant-scheduling"><td>{escape(w["url"])}</td><td>{escape(tenant)}</td>'
                f'<td>{escape(str(info.get("scheduling", "–")))}</td><td>{_number(s.get("weight"), 2, "")}</td>'
                f'<td>{_number(s.get("counter"), 0, "")}</td><td>{s.get("waiting", 0)}</td><td>{s.get("running", 0)}</td>'
                f'<td>{s.get("input_tokens", 0):,}</td><td>{s.get("output_tokens", 0):,}</td></tr>')
    if not rows:
        return '<p class="muted" id="scheduling-empty">No tenant has been served by a worker yet.</p>'
    head = ("<tr><th>worker</th><th>tenant</th><th>policy</th><th>weight</th><th>virtual tokens</th><th>waiting</th>"
            "<th>running</th><th>input tokens</th><th>output tokens</th></tr>")
    return f'<table id="scheduling">{head}{"".join(rows)}</table>'


def _tenants(month: str, rows: list[dict[str, Any]]) -> str:
    if not rows:
        return f'<p class="muted" id="tenants-empty">No usage in {escape(month)} yet.</p>'
    body = "".join(
        f'<tr class="tenant"><td>{escape(r["tenant"])}</td><td>{escape(r["model"])}</td><td>{r["requests"]:,}</td>'
        f'<td>{r["prompt_tokens"]:,}</td><td>{r["cached_tokens"]:,}</td><td>{r["completion_tokens"]:,}</td>'
        f'<td>{escape(r["cost"])}</td></tr>' for r in rows)
    head = ("<tr><th>tenant</th><th>model</th><th>requests</th><th>prompt tokens</th><th>cached</th>"
            "<th>completion tokens</th><th>cost</th></tr>")
    return f'<table id="tenants">{head}{body}</table>'


def _depths(spans: list[dict[str, Any]]) -> dict[str, int]:
    parents = {s["span_id"]: s["parent_id"] for s in spans}
    depths: dict[str, int] = {}
    for span in spans:
        depth, parent, hops = 0, span["parent_id"], 0
        while parent in parents and hops < 64:
            depth, parent, hops = depth + 1, parents[parent], hops + 1
        depths[span["span_id"]] = depth
    return depths


def _trace(spans: list[dict[str, Any]]) -> str:
    root = spans[0]
    start = min(s["start_ns"] for s in spans)
    total = max(max(s["end_ns"] for s in spans) - start, 1)
    depths = _depths(spans)
    rows = []
    for s in sorted(spans, key=lambda s: (s["start_ns"], depths[s["span_id"]])):
        service = "engine" if s["name"].startswith("engine.") else s["service"]
        left, width = (s["start_ns"] - start) / total * 100, (s["end_ns"] - s["start_ns"]) / total * 100
        rows.append(
            f'<div class="span-row" data-name="{escape(s["name"])}" data-service="{escape(service)}">'
            f'<div class="span-name" style="padding-left:{depths[s["span_id"]] * 12}px" title="{escape(s["name"])}">'
            f'{escape(s["name"])}</div><div class="span-track"><div class="span-bar" style="left:{left:.2f}%;'
            f'width:{width:.2f}%;background:{SERVICE_COLOURS.get(service, "#8c959f")}"></div></div>'
            f'<div class="span-ms">{(s["end_ns"] - s["start_ns"]) / 1e6:,.2f} ms</div></div>')
    attributes = root["attributes"]
    usage = (f'{attributes.get("gen_ai.usage.input_tokens", "–")} in / '
             f'{attributes.get("gen_ai.usage.output_tokens", "–")} out, '
             f'{attributes.get("tollway.cache.cached_tokens", "–")} cached')
    status = attributes.get("http.response.status_code", "")
    return (f'<section class="trace" data-trace-id="{root["trace_id"]}"><h3>{escape(root["name"])} '
            f'<span class="{"error" if str(status)[:1] in "45" else "muted"}">{escape(str(status))}</span> '
            f'<span class="muted">{total / 1e6:,.1f} ms · {escape(usage)} · '
            f'{escape(str(attributes.get("tollway.tenant.name", "")))} · trace {root["trace_id"]}</span></h3>'
            f'{"".join(rows)}</section>')


def _traces(data: DashboardData) -> str:
    if not data.tracing_on:
        return ('<p class="muted" id="traces-off">Tracing is off. Set <code>TOLLWAY_TRACING=1</code> (or '
                '<code>TOLLWAY_OTLP_ENDPOINT</code>) on the gateway and the workers to see request waterfalls.</p>')
    if not data.traces:
        return '<p class="muted" id="traces-empty">No traced request yet.</p>'
    legend = " ".join(f'<span style="color:{c}">■</span> {escape(n)}' for n, c in SERVICE_COLOURS.items())
    return f'<p class="muted">{legend}</p>' + "".join(_trace(spans) for spans in data.traces)


def panel(data: DashboardData) -> str:
    return (f"<h2>This gateway, live</h2>{_tiles(data)}<h2>Workers</h2>{_workers(data.workers)}"
            f"<h2>Speculative decoding (since each worker started)</h2>{_speculative(data.workers)}"
            f"<h2>Tenants on the workers (fair scheduling)</h2>{_scheduling(data.workers)}"
            f"<h2>Usage this month ({escape(data.month)}, every tenant)</h2>{_tenants(data.month, data.tenants)}"
            f"<h2>Recent traces</h2>{_traces(data)}")


def page(data: DashboardData) -> str:
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>tollway dashboard</title>'
            f'<meta name="viewport" content="width=device-width, initial-scale=1"><style>{STYLE}</style></head>'
            f'<body data-refresh-ms="{REFRESH_MS}" data-refreshed="0"><header><h1>tollway</h1>'
            f'<span>updated <span id="updated">now</span>, every {REFRESH_MS // 1000} s</span>'
            f'<form method="post" action="/admin/dashboard/logout"><button>Log out</button></form></header>'
            f'<main id="panel">{panel(data)}</main><script>{SCRIPT}</script></body></html>')


def login_page(error: str | None = None) -> str:
    message = f'<p class="error" id="login-error">{escape(error)}</p>' if error else ""
    return (f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>tollway dashboard: log in</title>'
            f'<style>{STYLE}</style></head><body><header><h1>tollway</h1></header><main>'
            f'<h2>Admin key</h2>{message}<form method="post" action="/admin/dashboard/login">'
            f'<input type="password" name="key" autocomplete="current-password" size="60" '
            f'placeholder="tw-admin-… (TOLLWAY_ADMIN_KEY or $TOLLWAY_HOME/admin.key)" autofocus> '
            f'<button>Open the dashboard</button></form></main></body></html>')
