"""Usage reports and prices over HTTP.

- `GET /admin/v1/usage?month=YYYY-MM[&tenant=NAME][&format=json|csv|html][&daily=true]` (admin key)
- `GET /v1/usage?month=YYYY-MM[&format=...]` (a tenant's API key): the key's own tenant only, always.
  A `tenant` parameter naming another tenant is refused (403), never honoured.
- `GET /admin/v1/prices[?model=M]`, `POST /admin/v1/prices` (admin key)

Views are thin, like `gateway.auth.admin_api`: the report is built in a worker thread by
`accounting.reports` and rendered by `accounting.report_render`.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web
from sqlalchemy.orm import Session

from accounting import prices, report_render, reports
from accounting.tenants import AccountingError
from gateway.api.body import read_json_object
from gateway.api.errors import ApiError, invalid
from gateway.api.transactions import in_transaction
from gateway.auth.guards import CALLER, admin, tenant

FORMATS = ("json", "csv", "html")
PRICE_FIELDS = ("model", "input_per_mtok", "cached_input_per_mtok", "output_per_mtok", "batch_discount",
                "effective_from")


def _report_query(request: web.Request) -> tuple[str, str, bool]:
    """(month, format, daily) from the query string, validated before any database work."""
    month = request.query.get("month")
    if not month:
        raise invalid("'month' (YYYY-MM) is required", "month")
    try:
        reports.parse_month(month)
    except AccountingError as exc:
        raise invalid(str(exc), "month") from exc
    fmt = request.query.get("format", "json")
    if fmt not in FORMATS:
        raise invalid(f"'format' must be one of {', '.join(FORMATS)}", "format")
    daily = request.query.get("daily", "false").lower()
    if daily not in ("true", "false", "1", "0"):
        raise invalid("'daily' must be true or false", "daily")
    if daily in ("true", "1") and fmt != "csv":
        raise invalid("'daily' applies to format=csv only", "daily")
    return month, fmt, daily in ("true", "1")


async def _report_response(request: web.Request, tenant: str | None) -> web.Response:
    month, fmt, daily = _report_query(request)
    report = await in_transaction(request, lambda s: reports.usage_report(s, month, tenant),
                                  not_found_param="tenant")
    if fmt == "csv":
        name = f"usage-{month}{'-' + tenant if tenant else ''}{'-daily' if daily else ''}.csv"
        return web.Response(text=report_render.to_csv(report, daily=daily), content_type="text/csv",
                            headers={"Content-Disposition": f'attachment; filename="{name}"'})
    if fmt == "html":
        return web.Response(text=report_render.to_html(report), content_type="text/html")
    return web.Response(text=report_render.to_json(report), content_type="application/json")


@admin
async def admin_usage(request: web.Request) -> web.Response:
    """Usage report of a month (every tenant, or ?tenant=NAME) as json, csv or html."""
    return await _report_response(request, request.query.get("tenant") or None)


@tenant
async def tenant_usage(request: web.Request) -> web.Response:
    """Your tenant's usage report of a month (?month=YYYY-MM) as json, csv or html."""
    caller = request[CALLER]
    asked = request.query.get("tenant")
    # The tenant comes from the key, only: naming any other tenant is refused outright.
    if asked is not None and asked != caller.tenant_name:
        raise ApiError(403, "an API key can only read its own tenant's usage", param="tenant",
                       code="forbidden_tenant")
    return await _report_response(request, caller.tenant_name)


@admin
async def list_prices(request: web.Request) -> web.Response:
    """List model prices per 1M tokens with their periods, optionally ?model=M."""
    model = request.query.get("model")
    rows = await in_transaction(request, lambda s: [prices.price_to_dict(p) for p in prices.list_prices(s, model)])
    return web.json_response({"object": "list", "data": rows})


@admin
async def set_price(request: web.Request) -> web.Response:
    """Set a model's prices per 1M tokens; the previous price ends where this one starts.

    Body: {model, input_per_mtok, cached_input_per_mtok, output_per_mtok, batch_discount?=0,
    effective_from?=now}; prices as decimal strings (exact) or JSON numbers, effective_from ISO 8601.
    """
    body = await read_json_object(request)
    unknown = set(body) - set(PRICE_FIELDS)
    if unknown:
        raise invalid(f"unknown fields: {', '.join(sorted(unknown))}", sorted(unknown)[0])
    missing = [f for f in PRICE_FIELDS[:4] if body.get(f) is None]
    if missing:
        raise invalid(f"'{missing[0]}' is required", missing[0])
    when = body.get("effective_from")
    if when is not None and not isinstance(when, str):
        raise invalid("'effective_from' must be an ISO 8601 date or datetime string", "effective_from")

    def work(session: Session) -> dict[str, Any]:
        start = prices.parse_when(when) if when is not None else None
        price = prices.set_price(
            session, body["model"], input_per_mtok=body["input_per_mtok"],
            cached_input_per_mtok=body["cached_input_per_mtok"], output_per_mtok=body["output_per_mtok"],
            batch_discount=body.get("batch_discount") or 0, effective_from=start)
        return prices.price_to_dict(price)

    return web.json_response(await in_transaction(request, work), status=201)


def add_routes(router: web.UrlDispatcher) -> None:
    """Register the usage and price routes."""
    router.add_get("/admin/v1/usage", admin_usage)
    router.add_get("/v1/usage", tenant_usage)
    router.add_get("/admin/v1/prices", list_prices)
    router.add_post("/admin/v1/prices", set_price)
