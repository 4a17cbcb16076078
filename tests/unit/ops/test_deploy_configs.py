"""ops/deploy: the configs parse, Grafana queries only metrics the code exports, Prometheus scrapes
the gateway with the admin key and the workers, and compose holds every part of a deployment."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from prometheus_client import CollectorRegistry

from gateway.observability.metrics import GatewayMetrics, StateCollector
from tests.conftest import REPO_ROOT
from workers.server.metrics import make_metrics

DEPLOY = REPO_ROOT / "ops" / "deploy"
HISTOGRAM_SUFFIXES = ("_bucket", "_count", "_sum")


def load_yaml(name: str) -> dict:
    return yaml.safe_load((DEPLOY / name).read_text())


def family_names(registry: CollectorRegistry) -> set[str]:
    """Every series name a registry can expose (counters with _total, histograms with their suffixes)."""
    names = set()
    for family in registry.collect():
        names.add(family.name)
        if family.type == "counter":
            names.add(family.name + "_total")
        if family.type == "histogram":
            names.update(family.name + suffix for suffix in HISTOGRAM_SUFFIXES)
    return names


def exported_metric_names() -> set[str]:
    gateway = GatewayMetrics()
    gateway.registry.register(StateCollector({}))  # type: ignore[arg-type]
    worker = make_metrics(lambda: {"running": 0, "waiting": 0, "blocks": {"total": 1, "free": 1, "used": 0,
                                                                            "evictable": 0},
                                   "kv_utilization": 0.0, "cache": {}, "preemptions": 0})
    worker.finished.labels(reason="stop")
    return family_names(gateway.registry) | family_names(worker.registry)


def test_grafana_queries_only_exported_metrics_and_covers_the_issue() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tollway.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\btollway_[a-z_]+", expr)}
    exported = exported_metric_names()
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("requests / s", "first token", "cache hit ratio", "kv blocks", "per tenant", "rejections"):
        assert topic in titles
    assert len({panel["id"] for panel in dashboard["panels"]}) == len(dashboard["panels"])
    assert all(t["datasource"]["uid"] == "prometheus" for panel in dashboard["panels"] for t in panel["targets"])


def test_prometheus_scrapes_every_gateway_with_the_admin_key_and_every_worker() -> None:
    config = load_yaml("prometheus.yml")
    jobs = {job["job_name"]: job for job in config["scrape_configs"]}
    gateway, worker = jobs["tollway-gateway"], jobs["tollway-worker"]
    assert gateway["authorization"]["credentials_file"] == "/run/secrets/admin_key"
    assert gateway["dns_sd_configs"][0]["names"] == ["gateway"]  # every replica
    compose = load_yaml("compose.yaml")
    workers = {name for name in compose["services"] if name.startswith("worker-")}
    assert {t.split(":")[0] for t in worker["static_configs"][0]["targets"]} == workers
    assert set(compose["x-tollway-env"]["TOLLWAY_WORKER_URLS"].replace("http://", "").replace(":8100", "")
               .split(",")) == workers


def test_compose_has_every_part_of_a_deployment_and_its_files_exist() -> None:
    compose = load_yaml("compose.yaml")
    services = compose["services"]
    assert {"gateway", "nginx", "worker-0", "worker-1", "batch-worker", "batch-beat", "redis", "postgres",
            "prometheus", "grafana", "jaeger", "otel-collector"} <= set(services)
    assert services["gateway"]["deploy"]["replicas"] >= 2
    assert services["gateway"]["environment"]["TOLLWAY_OTLP_ENDPOINT"] == "http://otel-collector:4318"
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source
    assert (REPO_ROOT / services["gateway"]["build"]["dockerfile"]).is_file()
    collector = load_yaml("otel-collector.yaml")
    pipeline = collector["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"] and set(pipeline["exporters"]) <= set(collector["exporters"])
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    for name in ("grafana/provisioning/datasources/prometheus.yaml", "grafana/provisioning/dashboards/tollway.yaml"):
        assert load_yaml(name)["apiVersion"] == 1


def test_the_dockerfile_copies_every_package() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    packages = re.search(r'include = \[(.*?)\]', (REPO_ROOT / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert f"COPY {package} {package}" in dockerfile, package
    assert Path(DEPLOY / "nginx.conf").read_text().count("proxy_buffering off") == 1
