"""A `UsageReport` as CSV, JSON or a self-contained HTML page.

The HTML page has inline CSS and an inline SVG chart and refers to nothing outside itself (no
scripts, fonts, images or links), so it can be mailed or opened offline. The chart's DOM is stable
for tests: `svg#usage-chart` holds one `rect.bar` per day with usage (id `bar-YYYY-MM-DD`, its full
height = prompt + completion tokens), overlaid by `rect.seg-cached` (cached prompt tokens, at the
bottom) and `rect.seg-completion` (completion tokens, on top).
"""

from __future__ import annotations

import csv
import io
import json
import math
from decimal import Decimal
from html import escape

from accounting.prices import decimal_text
from accounting.reports import ModelUsage, Usage, UsageReport, report_to_dict

CSV_COLUMNS = ("month", "tenant", "model", "requests", "prompt_tokens", "cached_tokens", "completion_tokens",
               "total_tokens", "cost", "unpriced_requests")
COLOURS = {"prompt": "#4e79a7", "cached": "#a0cbe8", "completion": "#f28e2b"}
LEGEND = (("prompt", "Prompt tokens (uncached)"), ("cached", "Prompt tokens (cached)"),
          ("completion", "Completion tokens"))
# Chart geometry (SVG user units).
WIDTH, HEIGHT = 960, 380
LEFT, RIGHT, TOP, BOTTOM = 80, 20, 50, 60


def to_csv(report: UsageReport, *, daily: bool = False) -> str:
    """One row per tenant and model (or, with `daily`, per tenant, model and UTC day).

    Rows never overlap, so columns can be summed. `cost` is empty where some request had no price.
    """
    out = io.StringIO()
    columns = (*CSV_COLUMNS[:1], "day", *CSV_COLUMNS[1:]) if daily else CSV_COLUMNS
    writer = csv.DictWriter(out, fieldnames=columns, lineterminator="\n")
    writer.writeheader()
    for row in report.daily if daily else report.rows:
        values = _values(row)
        values["month"] = report.month
        if daily and row.day is not None:
            values["day"] = row.day.isoformat()
        writer.writerow(values)
    return out.getvalue()


def _values(row: ModelUsage) -> dict[str, object]:
    return {"tenant": row.tenant, "model": row.model, "requests": row.requests,
            "prompt_tokens": row.prompt_tokens, "cached_tokens": row.cached_tokens,
            "completion_tokens": row.completion_tokens, "total_tokens": row.total_tokens,
            "cost": decimal_text(row.cost) or "", "unpriced_requests": row.unpriced_requests}


def to_json(report: UsageReport) -> str:
    """The report as JSON (see `accounting.reports.report_to_dict`): decimals as exact strings."""
    return json.dumps(report_to_dict(report), indent=2) + "\n"


def _nice_step(maximum: int, ticks: int = 5) -> int:
    raw = max(maximum / ticks, 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    for factor in (1, 2, 2.5, 5, 10):
        if factor * magnitude >= raw:
            return max(int(factor * magnitude), 1)
    return int(10 * magnitude)


def _short(number: int) -> str:
    for size, suffix in ((10**9, "G"), (10**6, "M"), (10**3, "k")):
        if number >= size:
            return f"{number / size:.3g}{suffix}"
    return str(number)


def _chart(report: UsageReport) -> str:
    days = report.month_days
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM
    base = TOP + plot_h
    highest = max((d.total_tokens for d in report.days), default=0)
    step = _nice_step(highest)
    top_value = max(step * math.ceil(highest / step), step)
    slot = plot_w / len(days)
    bar_w = slot * 0.7

    def y(tokens: int) -> float:
        return base - tokens / top_value * plot_h

    parts = [f'<svg id="usage-chart" viewBox="0 0 {WIDTH} {HEIGHT}" width="{WIDTH}" height="{HEIGHT}" '
             f'role="img" aria-labelledby="chart-title">',
             f'<title id="chart-title">Daily tokens, {escape(report.month)} (UTC)</title>',
             '<g class="grid">']
    for value in range(0, top_value + 1, step):
        parts.append(f'<line x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{y(value):.1f}" y2="{y(value):.1f}"/>'
                     f'<text class="y-tick" x="{LEFT - 8}" y="{y(value) + 4:.1f}" text-anchor="end">'
                     f'{_short(value)}</text>')
    parts.append("</g><g class=\"x-ticks\">")
    for index, day in enumerate(days):
        x = LEFT + index * slot + slot / 2
        parts.append(f'<text class="x-tick" x="{x:.1f}" y="{base + 16}" text-anchor="middle">{day.day}</text>')
    parts.append('</g><g class="bars">')
    for usage in report.days:
        x = LEFT + (usage.day.day - 1) * slot + (slot - bar_w) / 2
        label = (f"{usage.day.isoformat()}: {usage.requests} requests, {usage.prompt_tokens} prompt "
                 f"({usage.cached_tokens} cached), {usage.completion_tokens} completion tokens")
        common = f'x="{x:.1f}" width="{bar_w:.1f}"'
        total_top, cached_top = y(usage.total_tokens), y(usage.cached_tokens)
        completion_h = usage.completion_tokens / top_value * plot_h
        parts.append(
            f'<rect class="bar" id="bar-{usage.day.isoformat()}" data-day="{usage.day.isoformat()}" '
            f'data-prompt="{usage.prompt_tokens}" data-cached="{usage.cached_tokens}" '
            f'data-completion="{usage.completion_tokens}" {common} y="{total_top:.1f}" '
            f'height="{base - total_top:.1f}" fill="{COLOURS["prompt"]}"><title>{escape(label)}</title></rect>'
            f'<rect class="seg-cached" {common} y="{cached_top:.1f}" height="{base - cached_top:.1f}" '
            f'fill="{COLOURS["cached"]}"/>'
            f'<rect class="seg-completion" {common} y="{total_top:.1f}" height="{completion_h:.1f}" '
            f'fill="{COLOURS["completion"]}"/>')
    parts.append("</g>")
    parts.append(f'<line class="axis" x1="{LEFT}" x2="{WIDTH - RIGHT}" y1="{base}" y2="{base}"/>'
                 f'<line class="axis" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{base}"/>'
                 f'<text class="axis-label" x="{LEFT + plot_w / 2:.1f}" y="{HEIGHT - 14}" text-anchor="middle">'
                 f'Day of {report.start:%B %Y} (UTC)</text>'
                 f'<text class="axis-label" transform="translate(18 {TOP + plot_h / 2:.1f}) rotate(-90)" '
                 f'text-anchor="middle">Tokens per day</text>')
    parts.append('<g class="legend">')
    for index, (key, text) in enumerate(LEGEND):
        x = LEFT + index * 230
        parts.append(f'<rect class="legend-swatch legend-{key}" x="{x}" y="14" width="14" height="14" '
                     f'fill="{COLOURS[key]}"/><text x="{x + 20}" y="26">{escape(text)}</text>')
    parts.append("</g>")
    if not report.days:
        parts.append(f'<text class="empty" x="{LEFT + plot_w / 2:.1f}" y="{TOP + plot_h / 2:.1f}" '
                     'text-anchor="middle">No usage in this month</text>')
    parts.append("</svg>")
    return "".join(parts)


def _requests(count: int) -> str:
    return f"{count} request" if count == 1 else f"{count} requests"


def _cost_cell(cost: Decimal | None, unpriced: int) -> str:
    if unpriced or cost is None:
        return f'<td class="num unpriced">unpriced ({unpriced} req.)</td>'
    return f'<td class="num">{escape(decimal_text(cost) or "")}</td>'


def _usage_cells(row: Usage) -> str:
    counts = (row.requests, row.prompt_tokens, row.cached_tokens, row.completion_tokens)
    return "".join(f'<td class="num">{n:,}</td>' for n in counts) + _cost_cell(row.cost, row.unpriced_requests)


HEADER = ("<th>Requests</th><th>Prompt tokens</th><th>Cached tokens</th><th>Completion tokens</th>"
          "<th>Cost</th>")
STYLE = """
body { font-family: system-ui, sans-serif; margin: 2rem; color: #222; }
h1 { font-size: 1.5rem; } h2 { font-size: 1.15rem; margin-top: 2rem; }
table { border-collapse: collapse; margin-top: .5rem; }
th, td { border: 1px solid #ccc; padding: .3rem .6rem; } th { background: #f3f3f3; text-align: left; }
td.num { text-align: right; font-variant-numeric: tabular-nums; }
td.unpriced, .warning { color: #b00020; } tr.total td { font-weight: bold; }
#usage-chart { max-width: 100%; height: auto; font-size: 12px; }
#usage-chart .grid line { stroke: #e3e3e3; } #usage-chart .axis { stroke: #333; }
#usage-chart .axis-label { font-weight: bold; }
"""


def to_html(report: UsageReport) -> str:
    """A self-contained HTML page: summary, daily token chart (inline SVG), per-model and per-day tables."""
    scope = f"tenant {report.tenant}" if report.tenant else "all tenants"
    title = f"tollway usage report {report.month} ({scope})"
    total = report.total
    rows = "".join(f"<tr><td>{escape(r.tenant)}</td><td>{escape(r.model)}</td>{_usage_cells(r)}</tr>"
                   for r in report.rows)
    days = "".join(f"<tr><td>{d.day.isoformat()}</td>{_usage_cells(d)}</tr>" for d in report.days)
    daily = "".join(f"<tr><td>{r.day.isoformat() if r.day else ''}</td><td>{escape(r.tenant)}</td>"
                    f"<td>{escape(r.model)}</td>{_usage_cells(r)}</tr>" for r in report.daily)
    warning = ""
    if report.unpriced:
        listed = ", ".join(f"{escape(r.tenant)}/{escape(r.model)} ({_requests(r.unpriced_requests)})"
                           for r in report.unpriced)
        warning = (f'<p class="warning" id="unpriced">Some requests had no price in effect, so their '
                   f"cost is unknown (not zero): {listed}. Set prices with <code>tollway prices set</code>.</p>")
    total_cost = "unknown (unpriced requests)" if total.cost is None else decimal_text(total.cost)
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<title>{escape(title)}</title>
<style>{STYLE}</style>
</head>
<body>
<h1>{escape(title)}</h1>
<p id="summary">{report.start:%Y-%m-%d} to {report.end:%Y-%m-%d} (UTC, end exclusive):
{total.requests:,} requests, {total.prompt_tokens:,} prompt tokens ({total.cached_tokens:,} cached),
{total.completion_tokens:,} completion tokens; cost {escape(str(total_cost))}.</p>
{warning}
<h2>Daily tokens</h2>
{_chart(report)}
<h2>Per model</h2>
<table id="models"><thead><tr><th>Tenant</th><th>Model</th>{HEADER}</tr></thead>
<tbody>{rows}</tbody>
<tfoot><tr class="total"><td colspan="2">Total</td>{_usage_cells(total)}</tr></tfoot></table>
<h2>Per day</h2>
<table id="days"><thead><tr><th>Day (UTC)</th>{HEADER}</tr></thead><tbody>{days}</tbody></table>
<details><summary>Per tenant, model and day</summary>
<table id="daily"><thead><tr><th>Day (UTC)</th><th>Tenant</th><th>Model</th>{HEADER}</tr></thead>
<tbody>{daily}</tbody></table></details>
</body>
</html>
"""
