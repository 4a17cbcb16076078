"""schemathesis against the gateway's own /openapi.json: ≥ 2,000 generated requests (valid and
invalid by the schema, every operation, with a tenant key and with the admin key), none answered
with a 5xx or with a response the document does not describe."""

from __future__ import annotations

import os

import pytest
import requests
import schemathesis  # a dev dependency, like pytest itself
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.generation import GenerationMode
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from tests.reliability.conftest import FakeStack
from tests.reliability.stack import ADMIN_KEY, headers

pytestmark = pytest.mark.reliability
MIN_REQUESTS = int(os.environ.get("TOLLWAY_FUZZ_REQUESTS", "2000"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_schema_conformance]
# `/readyz?model=NAME` answers 503 `not_ready` until a worker of NAME is in rotation: a documented answer
# (status_code_conformance still holds it to the document), not a server error; the fake stack serves
# one model, so a generated name is never ready.
READYZ_CHECKS = [status_code_conformance, content_type_conformance, response_schema_conformance]


def checks_for(operation, case) -> list:
    if operation.path == "/readyz" and (case.query or {}).get("model"):
        return READYZ_CHECKS
    return CHECKS


def fuzz(operation, key: str, base_url: str, session: requests.Session, examples: int,
         sent: dict[str, int]) -> None:
    """`examples` cases of `operation`, valid and invalid by the schema, each sent and checked."""
    strategy = st.one_of(operation.as_strategy(GenerationMode.POSITIVE),
                         operation.as_strategy(GenerationMode.NEGATIVE))

    @settings(max_examples=examples, deadline=None, database=None, derandomize=True,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    @given(case=strategy)
    def run(case) -> None:
        case.headers = {**(case.headers or {}), **headers(key)}
        response = case.call_and_validate(base_url=base_url, session=session, checks=checks_for(operation, case),
                                          timeout=30)
        if response.status_code >= 500:  # only readiness may answer so: a 503 for a named model not in rotation
            assert operation.path == "/readyz" and response.status_code == 503, response.text
            assert response.json()["status"] == "not_ready", response.text
        sent[operation.label] = sent.get(operation.label, 0) + 1

    run()


def test_generated_requests_get_no_5xx_and_match_the_schema(fake_stack: FakeStack) -> None:
    schema = schemathesis.openapi.from_url(f"{fake_stack.url}/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 25  # every route of the gateway is in the document
    per_operation = MIN_REQUESTS // (2 * len(operations)) + 15  # routes without inputs yield fewer
    sent: dict[str, int] = {}
    session = requests.Session()
    for key in (fake_stack.keys["a"], ADMIN_KEY):
        for operation in operations:
            fuzz(operation, key, fake_stack.url, session, per_operation, sent)
    total = sum(sent.values())
    print(f"schemathesis: {total} requests over {len(operations)} operations")
    assert total >= MIN_REQUESTS, sent
