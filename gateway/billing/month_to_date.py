"""The quota stores' budget source: a tenant's spend this month before the store knew of it.

`gateway/quotas/store.py` seeds a month's budget counter once per scope (and again whenever Redis
lost its keys) from `MonthToDate`, which reads usage_events and this gateway's usage spool off the
event loop (accounting/month_to_date.py). A scope that is not a tenant has nothing to seed.
"""

from __future__ import annotations

import asyncio

from aiohttp import web

from accounting.month_to_date import month_to_date_tokens
from gateway.quotas.admission import tenant_of_scope
from gateway.state import SESSIONS, WRITER

SEED_TIMEOUT_S = 10.0


class MonthToDate:
    def __init__(self, app: web.Application) -> None:
        self._app = app  # its database and usage writer are set up after the quota store

    async def __call__(self, scope: str, month: int) -> int | None:
        tenant_id = tenant_of_scope(scope)
        if tenant_id is None:
            return None
        sessions, writer = self._app[SESSIONS], self._app[WRITER]

        def read() -> int:
            with sessions() as session:
                return month_to_date_tokens(session, tenant_id, month, writer.spooled())

        async with asyncio.timeout(SEED_TIMEOUT_S):
            return await asyncio.to_thread(read)
