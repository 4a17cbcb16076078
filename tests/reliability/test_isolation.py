"""Tenant isolation on every tenant-scoped route (files, batches, usage, the completions cache
namespace), admin routes closed to tenant keys, and API keys absent from every log."""

from __future__ import annotations

import json
from datetime import UTC, datetime

import pytest
import requests

from tests.integration.test_batch_jobs import upload
from tests.reliability.conftest import FakeStack
from tests.reliability.stack import ADMIN_KEY, chat_body, headers, leaked_keys

pytestmark = pytest.mark.reliability
LINE = {"custom_id": "1", "method": "POST", "url": "/v1/chat/completions", "body": chat_body("secret of a")}


def call(stack: FakeStack, method: str, path: str, key: str, **kwargs) -> requests.Response:
    return requests.request(method, f"{stack.url}{path}", headers=headers(key), timeout=30, **kwargs)


def test_files_and_batches_of_one_tenant_are_404_to_another(fake_stack: FakeStack) -> None:
    a, b = fake_stack.keys["a"], fake_stack.keys["b"]
    file_id = upload(fake_stack.url, a, (json.dumps(LINE) + "\n").encode())
    batch = call(fake_stack, "POST", "/v1/batches", a, json={"input_file_id": file_id,
                 "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert batch.status_code == 200, batch.text
    batch_id = batch.json()["id"]
    assert call(fake_stack, "GET", f"/v1/files/{file_id}", a).status_code == 200  # the owner sees it
    for method, path in [("GET", f"/v1/files/{file_id}"), ("GET", f"/v1/files/{file_id}/content"),
                         ("DELETE", f"/v1/files/{file_id}"), ("GET", f"/v1/batches/{batch_id}"),
                         ("POST", f"/v1/batches/{batch_id}/cancel")]:
        response = call(fake_stack, method, path, b)
        assert response.status_code == 404, (method, path, response.status_code)
        assert "secret of a" not in response.text and "in.jsonl" not in response.text
    stolen = call(fake_stack, "POST", "/v1/batches", b, json={"input_file_id": file_id,
                  "endpoint": "/v1/chat/completions", "completion_window": "24h"})
    assert stolen.status_code == 404, stolen.text
    for path in ["/v1/files", "/v1/batches"]:
        listing = call(fake_stack, "GET", path, b)
        assert listing.status_code == 200 and listing.json()["data"] == [], listing.text
    assert call(fake_stack, "GET", f"/v1/files/{file_id}", a).status_code == 200  # b's DELETE did nothing


def test_usage_shows_only_the_callers_tenant(fake_stack: FakeStack) -> None:
    a, b = fake_stack.keys["a"], fake_stack.keys["b"]
    for _ in range(3):
        assert call(fake_stack, "POST", "/v1/chat/completions", a, json=chat_body()).status_code == 200
    month = datetime.now(UTC).strftime("%Y-%m")
    mine = call(fake_stack, "GET", f"/v1/usage?month={month}", a).json()
    assert "a" in json.dumps(mine) and mine != {}
    for query in ["", "&tenant=a", "&tenant_id=1"]:
        theirs = call(fake_stack, "GET", f"/v1/usage?month={month}{query}", b)
        assert theirs.status_code in (200, 400, 403), theirs.text
        if theirs.status_code == 200:
            text = theirs.text
            assert '"a"' not in text and "requests\": 3" not in text, text[:300]
    csv = call(fake_stack, "GET", f"/v1/usage?month={month}&format=csv", b).text
    assert not any(line.startswith("a,") for line in csv.splitlines())


def test_the_cache_namespace_is_the_tenant_whatever_the_client_sends(fake_stack: FakeStack) -> None:
    body = {**chat_body("shared system prompt " * 5), "namespace": "a", "user": "a"}
    before = dict(fake_stack.cluster.worker_info()["cache"])
    for key in (fake_stack.keys["a"], fake_stack.keys["b"]):
        assert call(fake_stack, "POST", "/v1/chat/completions", key, json=body).status_code == 200
    after = fake_stack.cluster.worker_info()["cache"]
    grown = [ns for ns, stats in after.items() if stats != before.get(ns)]
    assert len(grown) == 2  # two tenants, two namespaces, whatever the body said


ADMIN_ROUTES = [("GET", "/admin/v1/tenants"), ("POST", "/admin/v1/tenants"), ("GET", "/admin/v1/tenants/a"),
                ("PATCH", "/admin/v1/tenants/b"), ("GET", "/admin/v1/keys"), ("POST", "/admin/v1/keys"),
                ("POST", "/admin/v1/keys/1/revoke"), ("DELETE", "/admin/v1/keys/2"),
                ("POST", "/admin/v1/keys/1/rotate"), ("GET", "/admin/v1/usage?month=2026-01"),
                ("GET", "/admin/v1/prices"), ("POST", "/admin/v1/prices")]


@pytest.mark.parametrize(("method", "path"), ADMIN_ROUTES)
def test_admin_routes_refuse_tenant_keys(fake_stack: FakeStack, method: str, path: str) -> None:
    body = {"name": "evil", "tenant": "a", "disabled": True, "model": "m", "input": 0, "cached_input": 0,
            "output": 0}
    response = call(fake_stack, method, path, fake_stack.keys["a"], json=body)
    assert response.status_code in (401, 403), (path, response.status_code)
    assert call(fake_stack, method, path, "", json=body).status_code == 401


def test_tenant_keys_still_work_and_no_key_is_in_any_log(fake_stack: FakeStack) -> None:
    # Runs last in this module: every request above (and the fixture's) has been logged by now.
    for key in fake_stack.keys.values():
        assert call(fake_stack, "POST", "/v1/chat/completions", key, json=chat_body()).status_code == 200
    assert call(fake_stack, "GET", "/admin/v1/tenants", ADMIN_KEY).status_code == 200
    assert leaked_keys(fake_stack.home, [*fake_stack.keys.values()]) == {}
