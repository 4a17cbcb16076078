"""The usage of every billed request this worker served, kept until a gateway acknowledges it.

Why: a gateway that dies mid-stream never writes the usage rows of the requests it was carrying,
but the worker still knows what it generated for them. So each request that carries a billing
identity (workers/wire/generate.py `Billing`) is recorded here when it ends (finished,
cancelled, or abandoned because its channel closed), with that identity and the engine's usage.
The gateway acknowledges a request once its usage row is committed.

Ownership: an entry is *owned* by the channel that carried its request while that channel is
open (its gateway will acknowledge it); when the channel closes, or for a request that did not
come over a channel, the entry is an *orphan*. Any gateway replica bills orphans (status
`gateway_lost`; `usage_events.request_id` is unique, so a row the dead gateway did commit is never
doubled) and then acknowledges them.

Durability: an append-only JSON-lines file of `record` and `ack` lines, replayed at start (every
replayed entry is an orphan: no channel owns it any more). Writes are not fsync'd: a killed process
loses nothing the kernel has, and a worker crash loses only entries its gateway still holds. The
file is rewritten with the open entries once acknowledged lines dominate it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import orjson

log = logging.getLogger(__name__)
COMPACT_AFTER_LINES = 4096  # rewrite the file when this many lines hold fewer open entries


@dataclass
class LedgerEntry:
    request_id: str
    billing: dict[str, Any]  # the gateway's Billing, verbatim
    usage: dict[str, int]  # prompt_tokens, cached_tokens, completion_tokens
    finish_reason: str | None
    finished_at: float = field(default_factory=time.time)  # epoch seconds

    def to_json(self) -> dict[str, Any]:
        return {"request_id": self.request_id, "billing": self.billing, "usage": self.usage,
                "finish_reason": self.finish_reason, "finished_at": self.finished_at}

    @classmethod
    def from_json(cls, raw: dict[str, Any]) -> LedgerEntry:
        return cls(str(raw["request_id"]), dict(raw["billing"]), dict(raw["usage"]), raw.get("finish_reason"),
                   float(raw["finished_at"]))


class UsageLedger:
    """Entries by request id, each with its owner (an open channel) or none (an orphan). Used from
    the worker's event loop only."""

    def __init__(self, path: Path | None = None) -> None:
        self._path = path
        self._entries: dict[str, LedgerEntry] = {}
        self._owners: dict[str, object] = {}  # request id -> the open channel that will acknowledge it
        self._lines = 0
        if path is not None:
            path.parent.mkdir(parents=True, exist_ok=True)
            self._replay(path)

    # -- recording --------------------------------------------------------------------------------
    def record(self, entry: LedgerEntry, owner: object | None) -> None:
        """Keep `entry` until acknowledged; `owner` is the open channel whose gateway will ack it."""
        self._entries[entry.request_id] = entry
        if owner is not None:
            self._owners[entry.request_id] = owner
        self._append({"record": entry.to_json()})

    def release(self, owner: object) -> int:
        """`owner`'s channel closed: its unacknowledged entries become orphans. Returns how many."""
        released = [rid for rid, o in self._owners.items() if o is owner]
        for rid in released:
            del self._owners[rid]
        return len(released)

    def acknowledge(self, request_ids: list[str]) -> int:
        """Forget these entries (their usage rows are committed). Unknown ids are ignored."""
        known = [rid for rid in request_ids if rid in self._entries]
        for rid in known:
            del self._entries[rid]
            self._owners.pop(rid, None)
        if known:
            self._append({"ack": known})
            self._maybe_compact()
        return len(known)

    # -- reading ----------------------------------------------------------------------------------
    def orphans(self, limit: int = 1000) -> list[LedgerEntry]:
        """Entries no open channel will acknowledge, oldest first."""
        found = []
        for rid, entry in self._entries.items():
            if rid not in self._owners:
                found.append(entry)
                if len(found) == limit:
                    break
        return found

    def get(self, request_id: str) -> LedgerEntry | None:
        return self._entries.get(request_id)

    @property
    def num_orphans(self) -> int:
        return len(self._entries) - len(self._owners)

    @property
    def num_open(self) -> int:
        return len(self._entries)

    # -- the file ---------------------------------------------------------------------------------
    def _append(self, line: dict[str, Any]) -> None:
        if self._path is None:
            return
        with self._path.open("ab") as handle:
            handle.write(orjson.dumps(line) + b"\n")
        self._lines += 1

    def _replay(self, path: Path) -> None:
        if not path.exists():
            return
        with path.open("rb") as handle:
            for number, raw in enumerate(handle, 1):
                self._lines += 1
                try:
                    line = orjson.loads(raw)
                    if "record" in line:
                        entry = LedgerEntry.from_json(line["record"])
                        self._entries[entry.request_id] = entry
                    else:
                        for rid in line["ack"]:
                            self._entries.pop(rid, None)
                except (orjson.JSONDecodeError, KeyError, TypeError, ValueError):
                    log.warning("usage ledger %s: unreadable line %d skipped (a torn last write?)", path, number)
        if self._entries:
            log.info("usage ledger %s: %d unacknowledged requests to be billed", path, len(self._entries))
        self._maybe_compact()

    def _maybe_compact(self) -> None:
        """Rewrite the file with only the open entries once it is mostly acknowledged lines."""
        if self._path is None or self._lines < COMPACT_AFTER_LINES or self._lines < 4 * len(self._entries):
            return
        temporary = self._path.with_suffix(".compacting")
        with temporary.open("wb") as handle:
            for entry in self._entries.values():
                handle.write(orjson.dumps({"record": entry.to_json()}) + b"\n")
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self._path)
        self._lines = len(self._entries)
        with contextlib.suppress(OSError):
            directory = os.open(self._path.parent, os.O_RDONLY)
            try:
                os.fsync(directory)
            finally:
                os.close(directory)
