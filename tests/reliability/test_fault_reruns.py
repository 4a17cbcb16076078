"""Fault tests written with the features they test, re-run here so the reliability tier is one
suite: gateway SIGKILL under load (metering), a Celery worker SIGKILLed mid-batch, and quota-store
failover (Redis unreachable, open and closed policy, recovery by itself). Imported, not copied:
pytest collects them again in this module, under this module's marks."""

from __future__ import annotations

import pytest

from tests.integration.test_batch_jobs import test_a_killed_celery_worker_loses_and_repeats_nothing
from tests.integration.test_quota_failover import (
    prefix,
    test_admissions_return_to_redis_by_themselves,
    test_closed_mode_refuses_while_redis_is_unreachable,
    test_open_mode_falls_back_to_local_limits,
)
from tests.integration.test_quotas_and_metering_cluster import (
    cluster_env,
    test_metering_survives_a_gateway_sigkill,
)

pytestmark = [pytest.mark.reliability, pytest.mark.services]
# Its own module marks it asyncio module-wide; here the mark goes on the function itself.
test_metering_survives_a_gateway_sigkill = pytest.mark.asyncio(test_metering_survives_a_gateway_sigkill)

__all__ = [
    "cluster_env",
    "prefix",
    "test_a_killed_celery_worker_loses_and_repeats_nothing",
    "test_admissions_return_to_redis_by_themselves",
    "test_closed_mode_refuses_while_redis_is_unreachable",
    "test_metering_survives_a_gateway_sigkill",
    "test_open_mode_falls_back_to_local_limits",
]
