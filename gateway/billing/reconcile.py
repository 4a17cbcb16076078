"""Billing what a dead gateway could not: the workers' orphaned usage, written as usage rows.

A worker keeps the usage of every billed request until the gateway that carried it acknowledges
the committed row (workers/server/ledger.py). When that gateway died first (SIGKILL mid-stream),
its requests become orphans. Every gateway replica's worker pool notices orphans in a worker's
`/internal/info` on its health poll (every TOLLWAY_HEALTH_INTERVAL_S, and once before the gateway
serves) and calls `OrphanBiller.bill`: each orphan becomes a usage row with status
`gateway_lost` and the engine's counts (so billed tokens ≥ what the client received, and ≤ what
the engine generated), durable through the usage writer, and is then acknowledged to the worker.

Exactly once: `usage_events.request_id` is unique and rows are inserted ON CONFLICT DO NOTHING, so
an orphan whose row the dead gateway did commit (it died between commit and ack), or one that two
replicas bill at once, stays one row.
"""

from __future__ import annotations

import asyncio
import logging
from datetime import UTC, datetime
from typing import Any

import aiohttp

from accounting.usage import UsageRecord
from accounting.usage_writer import UsageWriter
from gateway.upstream.pool import WorkerPool

log = logging.getLogger("tollway.gateway.billing")
LOST_STATUS = "gateway_lost"


def orphan_record(orphan: dict[str, Any]) -> UsageRecord:
    """The usage row of one orphan (KeyError / ValueError / TypeError when it is malformed)."""
    billing, usage = orphan["billing"], orphan["usage"]
    started = datetime.fromisoformat(billing["started_at"])
    return UsageRecord(
        request_id=str(orphan["request_id"]), tenant_id=int(billing["tenant_id"]),
        key_id=None if billing.get("key_id") is None else int(billing["key_id"]), model=str(billing["model"]),
        prompt_tokens=int(usage["prompt_tokens"]), cached_tokens=int(usage["cached_tokens"]),
        completion_tokens=int(usage["completion_tokens"]), status=LOST_STATUS,
        finish_reason=orphan.get("finish_reason"), ttft_ms=None, latency_ms=None,
        started_at=started if started.tzinfo else started.replace(tzinfo=UTC),
        finished_at=datetime.fromtimestamp(float(orphan["finished_at"]), UTC), batch_id=billing.get("batch_id"),
        route=billing.get("route"))


class OrphanBiller:
    """Bills one worker's orphans at a time (a poll waits for its own worker's turn)."""

    def __init__(self, pool: WorkerPool, writer: UsageWriter) -> None:
        self._pool, self._writer = pool, writer
        self._busy: set[str] = set()
        self.billed = 0  # rows written since start (metrics)

    async def bill(self, url: str) -> None:
        if url in self._busy:  # the previous poll's turn is still running
            return
        self._busy.add(url)
        try:
            while await self._bill_chunk(url):
                pass
        except (aiohttp.ClientError, TimeoutError) as exc:
            log.warning("could not fetch or acknowledge orphaned usage on %s (%r); retrying on the next poll",
                        url, exc)
        except Exception:  # the database (and the spool) refused: the worker keeps them, retry later
            log.exception("could not bill orphaned usage of %s; retrying on the next poll", url)
        finally:
            self._busy.discard(url)

    async def _bill_chunk(self, url: str) -> bool:
        """Bill and acknowledge one chunk of orphans; False when there were none."""
        orphans = await self._pool.orphans(url)
        if not orphans:
            return False
        records, bad = [], []
        for orphan in orphans:
            try:
                records.append(orphan_record(orphan))
            except (KeyError, ValueError, TypeError):
                bad.append(orphan)
        for orphan in bad:  # kept in the worker's log and acknowledged: they can never become rows
            log.error("orphaned usage without a usable billing identity, not billable: %r", orphan)
        await asyncio.gather(*(self._writer.write(record) for record in records))
        self.billed += len(records)
        log.warning("billed %d requests of %s whose gateway died before their rows (status %s)",
                    len(records), url, LOST_STATUS)
        await self._pool.acknowledge_orphans(url, [str(o.get("request_id")) for o in orphans])
        return True
