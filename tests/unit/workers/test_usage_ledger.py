"""The worker's usage ledger: billed requests' usage kept until acknowledged, orphans when their
channel closes, and the file that carries unacknowledged usage across a worker restart."""

from __future__ import annotations

from pathlib import Path

import orjson

from workers.server import ledger as ledger_module
from workers.server.ledger import LedgerEntry, UsageLedger

BILLING = {"tenant_id": 1, "key_id": 2, "model": "m", "batch_id": None, "started_at": "2026-11-23T00:00:00+00:00"}


def entry(request_id: str, completion: int = 3) -> LedgerEntry:
    return LedgerEntry(request_id, dict(BILLING), {"prompt_tokens": 5, "cached_tokens": 0,
                                                   "completion_tokens": completion}, "length")


def test_owned_entries_are_not_orphans_until_their_channel_closes() -> None:
    ledger = UsageLedger()
    channel_a, channel_b = object(), object()
    ledger.record(entry("r1"), channel_a)
    ledger.record(entry("r2"), channel_b)
    ledger.record(entry("r3"), None)  # e.g. the HTTP transport: nobody will acknowledge it on a channel
    assert [e.request_id for e in ledger.orphans()] == ["r3"] and ledger.num_orphans == 1
    assert ledger.release(channel_a) == 1
    assert {e.request_id for e in ledger.orphans()} == {"r1", "r3"} and ledger.num_open == 3
    assert ledger.acknowledge(["r1", "r3", "never-seen"]) == 2
    assert ledger.orphans() == [] and ledger.num_open == 1  # r2 still waits for channel b's ack
    assert ledger.acknowledge(["r2"]) == 1 and ledger.num_open == 0


def test_unacknowledged_usage_survives_a_restart_as_orphans(tmp_path: Path) -> None:
    path = tmp_path / "ledger" / "worker.jsonl"
    ledger = UsageLedger(path)
    channel = object()
    for i in range(4):
        ledger.record(entry(f"r{i}", completion=i), channel)
    ledger.acknowledge(["r0", "r2"])
    with path.open("ab") as handle:
        handle.write(b'{"record": {"request_id": "torn"')  # a write cut short by the kill
    restarted = UsageLedger(path)
    orphans = {e.request_id: e for e in restarted.orphans()}
    assert set(orphans) == {"r1", "r3"}  # no channel owns anything after a restart
    assert orphans["r3"].usage["completion_tokens"] == 3 and orphans["r3"].billing == BILLING


def test_the_file_is_compacted_once_acknowledged_lines_dominate(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.setattr(ledger_module, "COMPACT_AFTER_LINES", 10)
    path = tmp_path / "worker.jsonl"
    ledger = UsageLedger(path)
    for i in range(8):
        ledger.record(entry(f"r{i}"), None)
        if i != 5:
            ledger.acknowledge([f"r{i}"])
    lines = [orjson.loads(raw) for raw in path.read_bytes().splitlines()]
    recorded = [line["record"]["request_id"] for line in lines if "record" in line]
    assert len(lines) < 15 and not {"r0", "r1", "r2", "r3"} & set(recorded)  # 15 were written; rewritten since
    assert [e.request_id for e in UsageLedger(path).orphans()] == ["r5"]
