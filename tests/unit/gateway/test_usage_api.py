"""`/v1/usage`, `/admin/v1/usage` and `/admin/v1/prices` on the real gateway app (no workers needed)."""

from __future__ import annotations

import csv
import io
from decimal import Decimal
from pathlib import Path

import pytest
import pytest_asyncio

from accounting.api_keys import create_key
from accounting.db import create_db_engine, session_factory, upgrade_database
from gateway.app import create_app
from gateway.settings import GatewaySettings
from tests.unit.accounting.test_billing import ACME_M1_COST, MONTH, seed

pytestmark = pytest.mark.asyncio
ADMIN = {"Authorization": "Bearer k"}


def seed_keys(url: str) -> dict[str, dict[str, str]]:
    """The seeded January (see test_billing.seed) plus one key per tenant: tenant → auth headers."""
    engine = create_db_engine(url)
    upgrade_database(engine)
    with session_factory(engine).begin() as session:
        seed(session)
        keys = {name: create_key(session, name)[1] for name in ("acme", "globex")}
    engine.dispose()
    return {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}


@pytest_asyncio.fixture
async def gateway(aiohttp_client, tmp_path: Path):
    """(client, tenant name → auth headers)."""
    auth = seed_keys(f"sqlite:///{tmp_path}/tollway.db")
    settings = GatewaySettings(home=tmp_path, worker_urls="http://127.0.0.1:9", admin_key="k")
    return await aiohttp_client(create_app(settings)), auth


async def test_a_tenant_sees_only_its_own_usage(gateway) -> None:
    client, auth = gateway
    response = await client.get("/v1/usage", params={"month": MONTH}, headers=auth["acme"])
    assert response.status == 200, await response.text()
    body = await response.json()
    assert body["tenant"] == "acme" and {m["tenant"] for m in body["models"]} == {"acme"}
    assert Decimal(body["total"]["cost"]) == ACME_M1_COST
    globex = await (await client.get("/v1/usage", params={"month": MONTH}, headers=auth["globex"])).json()
    assert {m["tenant"] for m in globex["models"]} == {"globex"} and globex["total"]["cost"] is None
    # Asking for another tenant is refused; naming one's own tenant is harmless.
    response = await client.get("/v1/usage", params={"month": MONTH, "tenant": "globex"}, headers=auth["acme"])
    assert response.status == 403 and (await response.json())["error"]["param"] == "tenant"
    response = await client.get("/v1/usage", params={"month": MONTH, "tenant": "acme"}, headers=auth["acme"])
    assert response.status == 200
    for headers in ({}, {"Authorization": "Bearer tw-not-a-key"}, ADMIN):
        assert (await client.get("/v1/usage", params={"month": MONTH}, headers=headers)).status == 401


async def test_admin_sees_all_and_can_filter(gateway) -> None:
    client, auth = gateway
    body = await (await client.get("/admin/v1/usage", params={"month": MONTH}, headers=ADMIN)).json()
    assert {m["tenant"] for m in body["models"]} == {"acme", "globex"} and len(body["days"]) == 5
    body = await (await client.get("/admin/v1/usage", params={"month": MONTH, "tenant": "globex"},
                                   headers=ADMIN)).json()
    assert {m["tenant"] for m in body["models"]} == {"globex"}
    response = await client.get("/admin/v1/usage", params={"month": MONTH, "tenant": "nobody"}, headers=ADMIN)
    assert response.status == 404
    for headers in ({}, auth["acme"]):
        assert (await client.get("/admin/v1/usage", params={"month": MONTH}, headers=headers)).status == 401


async def test_formats(gateway) -> None:
    client, auth = gateway
    response = await client.get("/v1/usage", params={"month": MONTH, "format": "csv"}, headers=auth["acme"])
    assert response.status == 200 and response.content_type == "text/csv"
    assert "attachment" in response.headers["Content-Disposition"]
    rows = list(csv.DictReader(io.StringIO(await response.text())))
    assert [(r["tenant"], r["model"], Decimal(r["cost"])) for r in rows] == [("acme", "m1", ACME_M1_COST)]
    response = await client.get("/admin/v1/usage", params={"month": MONTH, "format": "csv", "daily": "true"},
                                headers=ADMIN)
    assert len(list(csv.DictReader(io.StringIO(await response.text())))) == 5
    response = await client.get("/v1/usage", params={"month": MONTH, "format": "html"}, headers=auth["acme"])
    page = await response.text()
    assert response.content_type == "text/html" and page.count('<rect class="bar"') == 3 and "globex" not in page


@pytest.mark.parametrize("params", [{}, {"month": "2026-13"}, {"month": "01-2026"},
                                    {"month": MONTH, "format": "pdf"}, {"month": MONTH, "daily": "true"}])
async def test_bad_queries_are_400(gateway, params: dict[str, str]) -> None:
    client, auth = gateway
    for path, headers in (("/v1/usage", auth["acme"]), ("/admin/v1/usage", ADMIN)):
        response = await client.get(path, params=params, headers=headers)
        assert response.status == 400, await response.text()
        error = (await response.json())["error"]
        assert error["type"] == "invalid_request_error" and error["param"] in ("month", "format", "daily")


async def test_prices(gateway) -> None:
    client, auth = gateway
    price = {"model": "m3", "input_per_mtok": "1.5", "cached_input_per_mtok": 0.75, "output_per_mtok": 6,
             "batch_discount": "0.5", "effective_from": "2026-02-01"}
    response = await client.post("/admin/v1/prices", json=price, headers=ADMIN)
    assert response.status == 201, await response.text()
    assert await response.json() == {
        "id": 3, "model": "m3", "input_per_mtok": "1.5", "cached_input_per_mtok": "0.75", "output_per_mtok": "6",
        "batch_discount": "0.5", "effective_from": "2026-02-01T00:00:00+00:00", "effective_to": None}
    listed = await (await client.get("/admin/v1/prices", params={"model": "m1"}, headers=ADMIN)).json()
    assert [p["effective_to"] for p in listed["data"]] == ["2026-01-15T00:00:00+00:00", None]
    assert len((await (await client.get("/admin/v1/prices", headers=ADMIN)).json())["data"]) == 3
    for bad, param in (({**price, "input_per_mtok": "-1"}, "input_per_mtok"), ({**price, "batch_discount": 2}, "batch_discount"),
                       ({**price, "effective_from": "2026-01-01"}, "effective_from"),
                       ({**price, "effective_from": "soon"}, "effective_from"), ({**price, "model": ""}, "model"),
                       ({**price, "colour": "red"}, "colour"),
                       ({k: v for k, v in price.items() if k != "output_per_mtok"}, "output_per_mtok")):
        response = await client.post("/admin/v1/prices", json=bad, headers=ADMIN)
        assert response.status == 400, bad
        assert (await response.json())["error"]["param"] == param, bad
    assert (await client.post("/admin/v1/prices", json=price, headers=auth["acme"])).status == 401
    assert (await client.get("/admin/v1/prices", headers=auth["acme"])).status == 401


async def test_routes_are_in_the_openapi_document(gateway) -> None:
    client, _ = gateway
    paths = (await (await client.get("/openapi.json")).json())["paths"]
    assert paths["/v1/usage"]["get"]["summary"].startswith("Your tenant's usage report")
    assert {"get", "post"} <= set(paths["/admin/v1/prices"]) and "get" in paths["/admin/v1/usage"]
