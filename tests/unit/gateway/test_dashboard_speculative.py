"""The dashboard's speculative decoding panel (issue 23): one row per worker that speculates, from
the `speculative` figures of its /internal/info; a note when none does."""

from __future__ import annotations

from gateway.observability.dashboard_render import DashboardData, panel
from gateway.observability.live_stats import Window
from tests.unit.gateway.test_dashboard import Dom


def data(workers: list[dict]) -> DashboardData:
    window = Window(60, 0, 0, 0, 0, 0, None, None)
    return DashboardData(window, window, [0] * 10, workers, "2026-11", [])


def worker(url: str, speculative: dict | None) -> dict:
    info = {"running": 1, "waiting": 0} | ({"speculative": speculative} if speculative is not None else {})
    return {"url": url, "healthy": True, "model": "m", "in_flight": 0, "info": info}


def test_one_row_per_speculating_worker_with_its_acceptance() -> None:
    spec = {"mode": "ngram", "drafted_tokens": 1200, "accepted_tokens": 900, "verifications": 300,
            "acceptance_rate": 0.75, "mean_accepted_length": 3.0}
    dom = Dom(panel(data([worker("http://w1", spec), worker("http://w2", {**spec, "mode": "off"}),
                          worker("http://w3", None),
                          worker("http://w4", {**spec, "drafted_tokens": 0, "accepted_tokens": 0})])))
    rows = dom.with_class("speculative")
    assert [r["data-url"] for r in rows] == ["http://w1", "http://w4"]  # w2 is off, w3 predates speculation
    text = dom.text["speculative"]
    assert "ngram" in text and "1,200" in text and "900" in text and "75.0 %" in text and "3.00" in text
    assert "speculative-off" not in {e.get("id") for e in dom.elements}


def test_a_note_when_no_worker_speculates() -> None:
    dom = Dom(panel(data([worker("http://w1", None)])))
    assert not dom.with_class("speculative") and "TOLLWAY_SPECULATIVE" in dom.text["speculative-off"]
