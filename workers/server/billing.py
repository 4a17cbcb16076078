"""The worker's side of exact billing: which running requests are billed, and by whom.

A request whose generate body carries `billing` (workers/wire/generate.py) is tracked from the
moment it is accepted until the engine reports its last delta, however it ends; its usage then
goes to the ledger (workers/server/ledger.py), owned by the channel that carried it while that
channel is open. A channel that closes hands its entries over as orphans, which any gateway
fetches (`GET /internal/usage/orphans`), bills and acknowledges (`POST /internal/usage/ack`, or an
`ack` frame on its channel). Used by the real worker (fed by the engine's finished hook) and by
its test double (fed by its canned answers). Event-loop only.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from workers.server.errors import error
from workers.server.ledger import LedgerEntry, UsageLedger

MAX_ORPHANS_PER_CALL = 1000


class WorkerBilling:
    def __init__(self, ledger: UsageLedger) -> None:
        self.ledger = ledger
        self._running: dict[str, tuple[dict[str, Any], object | None]] = {}  # request id -> (billing, owner)
        self._open_channels: set[object] = set()

    # -- channels ---------------------------------------------------------------------------------
    def open_channel(self) -> object:
        """A token for a newly opened channel: the owner of the entries of requests it carries."""
        token = object()
        self._open_channels.add(token)
        return token

    def close_channel(self, token: object) -> None:
        self._open_channels.discard(token)
        self.ledger.release(token)

    # -- requests ---------------------------------------------------------------------------------
    def started(self, request_id: str, billing: dict[str, Any] | None, owner: object | None) -> None:
        if billing is not None:
            self._running[request_id] = (billing, owner)

    def refused(self, request_id: str) -> None:
        """It never ran (a 400): nothing to bill."""
        self._running.pop(request_id, None)

    def finished(self, request_id: str, usage: dict[str, int], finish_reason: str | None) -> None:
        """The request's last delta: keep its usage until a gateway acknowledges the row."""
        tracked = self._running.pop(request_id, None)
        if tracked is None:
            return
        billing, owner = tracked
        if owner not in self._open_channels:
            owner = None
        self.ledger.record(LedgerEntry(request_id, billing, dict(usage), finish_reason), owner)

    def acknowledge(self, request_ids: list[str]) -> int:
        return self.ledger.acknowledge(request_ids)

    def info(self) -> dict[str, int]:
        return {"unacknowledged": self.ledger.num_open, "orphans": self.ledger.num_orphans}


BILLING_KEY = web.AppKey("worker_billing", WorkerBilling)


async def orphans(request: web.Request) -> web.Response:
    """Usage of billed requests whose channel closed before their gateway acknowledged them."""
    try:
        limit = min(int(request.query.get("limit", MAX_ORPHANS_PER_CALL)), MAX_ORPHANS_PER_CALL)
    except ValueError:
        return error(400, "limit must be an integer")
    entries = request.app[BILLING_KEY].ledger.orphans(max(limit, 1))
    return web.json_response({"orphans": [entry.to_json() for entry in entries]})


async def acknowledge(request: web.Request) -> web.Response:
    """`{"request_ids": [...]}`: their usage rows are committed; forget them."""
    try:
        body = await request.json()
        request_ids = body["request_ids"]
        if not isinstance(request_ids, list) or not all(isinstance(r, str) for r in request_ids):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return error(400, 'the body must be {"request_ids": [strings]}')
    return web.json_response({"acknowledged": request.app[BILLING_KEY].acknowledge(request_ids)})


def setup_billing(app: web.Application, ledger: UsageLedger) -> WorkerBilling:
    app[BILLING_KEY] = billing = WorkerBilling(ledger)
    app.router.add_get("/internal/usage/orphans", orphans)
    app.router.add_post("/internal/usage/ack", acknowledge)
    return billing
