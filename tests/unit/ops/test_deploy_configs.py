"""ops/deploy: the configs parse, Grafana queries only metrics the code exports, Prometheus scrapes
the gateway with the admin key and the workers, compose holds every part of a deployment, publishes
nothing but the clients' entry point beyond the host's loopback, and keeps every replica's durable
state (a gateway's usage spool, a worker's $TOLLWAY_HOME) on a named volume of its own."""

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
                                   "kv_utilization": 0.0, "cache": {}, "preemptions": 0,
                                   "speculative": {"mode": "ngram", "drafted_tokens": 0, "accepted_tokens": 0,
                                                   "verifications": 0, "acceptance_rate": 0.0,
                                                   "mean_accepted_length": 0.0}})
    worker.finished.labels(reason="stop")
    return family_names(gateway.registry) | family_names(worker.registry)


def test_grafana_queries_only_exported_metrics_and_covers_the_issue() -> None:
    dashboard = json.loads((DEPLOY / "grafana" / "dashboards" / "tollway.json").read_text())
    exprs = [t["expr"] for panel in dashboard["panels"] for t in panel["targets"]]
    used = {name for expr in exprs for name in re.findall(r"\btollway_[a-z_]+", expr)}
    exported = exported_metric_names()
    assert used and used <= exported, f"not exported: {sorted(used - exported)}"
    titles = " ".join(panel["title"].lower() for panel in dashboard["panels"])
    for topic in ("requests / s", "first token", "cache hit ratio", "kv blocks", "per tenant", "rejections",
                  "speculative decoding: acceptance rate"):
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
    assert all(service["networks"]["default"]["aliases"] == ["gateway"] for service in gateways(compose).values())
    workers = {name for name in compose["services"] if name.startswith("worker-")}
    assert {t.split(":")[0] for t in worker["static_configs"][0]["targets"]} == workers
    assert set(compose["x-tollway-env"]["TOLLWAY_WORKER_URLS"].replace("http://", "").replace(":8100", "")
               .split(",")) == workers


def test_compose_has_every_part_of_a_deployment_and_its_files_exist() -> None:
    compose = load_yaml("compose.yaml")
    services = compose["services"]
    assert {"gateway-0", "gateway-1", "nginx", "worker-0", "worker-1", "batch-worker", "batch-beat", "redis", "postgres",
            "prometheus", "grafana", "jaeger", "otel-collector"} <= set(services)
    assert len(gateways(compose)) >= 2  # replicas
    assert all(gateway["environment"]["TOLLWAY_OTLP_ENDPOINT"] == "http://otel-collector:4318"
               for gateway in gateways(compose).values())
    env = compose["x-tollway-env"]
    assert env["TOLLWAY_WORKER_SECRET"].startswith("${TOLLWAY_WORKER_SECRET:?")  # one secret for every container
    for service in services.values():
        for volume in service.get("volumes", []):
            source = volume.split(":")[0]
            if source.startswith("./"):
                assert (DEPLOY / source).exists(), source
    assert (REPO_ROOT / services["gateway-0"]["build"]["dockerfile"]).is_file()
    collector = load_yaml("otel-collector.yaml")
    pipeline = collector["service"]["pipelines"]["traces"]
    assert "otlp" in pipeline["receivers"] and set(pipeline["exporters"]) <= set(collector["exporters"])
    assert collector["receivers"]["otlp"]["protocols"]["http"]["endpoint"].endswith(":4318")
    for name in ("grafana/provisioning/datasources/prometheus.yaml", "grafana/provisioning/dashboards/tollway.yaml"):
        assert load_yaml(name)["apiVersion"] == 1


def gateways(compose: dict) -> dict[str, dict]:
    return {name: service for name, service in compose["services"].items() if name.startswith("gateway-")}


def tollway_home() -> str:
    [home] = re.findall(r"^ENV TOLLWAY_HOME=(\S+)$", (DEPLOY / "Dockerfile").read_text(), re.MULTILINE)
    return home


def named_mounts(compose: dict, service: dict) -> dict[str, str]:
    """Target → named volume of a service's volume mounts (bind mounts of ./files left out)."""
    mounts = {}
    for volume in service.get("volumes", []):
        source, target = volume.split(":")[:2]
        if not source.startswith(("./", "/")):
            assert source in compose["volumes"], f"{source} is not a declared named volume"
            mounts[target] = source
    return mounts


def test_only_the_entry_point_is_published_beyond_the_hosts_loopback() -> None:
    """nginx (the clients' port) alone listens on every interface; the observability UIs
    (Prometheus, Jaeger, Grafana) answer on the host's 127.0.0.1 only, and the rest (workers,
    PostgreSQL, Redis, the collector) publish nothing."""
    services = load_yaml("compose.yaml")["services"]
    for name, service in services.items():
        for port in service.get("ports", []):
            mapping = str(port if not isinstance(port, dict) else f"{port.get('host_ip', '')}:{port['published']}")
            if name != "nginx":
                assert mapping.startswith("127.0.0.1:"), f"{name} publishes {mapping} on every interface"
    for name in ("prometheus", "jaeger", "grafana"):
        assert all(str(port).startswith("127.0.0.1:") for port in services[name].get("ports", []))
    for name in ("postgres", "redis", "otel-collector", "worker-0", "worker-1", *gateways({"services": services})):
        assert "ports" not in services[name], name


def test_durable_state_lives_on_named_volumes_one_per_replica() -> None:
    """A gateway's usage spool (rows not yet in PostgreSQL) and a worker's $TOLLWAY_HOME survive a
    container's re-creation, and no two replicas share one (a spool has one writer)."""
    compose = load_yaml("compose.yaml")
    home = tollway_home()
    spools = [named_mounts(compose, gateway).get(f"{home}/spool") for gateway in gateways(compose).values()]
    assert None not in spools and len(set(spools)) == len(spools) >= 2
    workers = [service for name, service in compose["services"].items() if name.startswith("worker-")]
    homes = [named_mounts(compose, worker).get(home) for worker in workers]
    assert None not in homes and len(set(homes)) == len(homes) >= 2
    assert all(named_mounts(compose, worker)[f"{home}/models"] == "models" for worker in workers)
    assert all(named_mounts(compose, gateway)[f"{home}/files"] == "files" for gateway in gateways(compose).values())
    assert "files" in named_mounts(compose, compose["services"]["batch-worker"]).values()
    dockerfile = (DEPLOY / "Dockerfile").read_text()  # mount points exist in the image, owned by its user
    assert all(f"{home}/{folder}" in dockerfile for folder in ("models", "files", "spool"))
    assert "chown -R tollway " + home in dockerfile


def test_the_dockerfile_copies_every_package() -> None:
    dockerfile = (DEPLOY / "Dockerfile").read_text()
    packages = re.search(r'include = \[(.*?)\]', (REPO_ROOT / "pyproject.toml").read_text()).group(1)
    for package in re.findall(r'"(\w+)\*"', packages):
        assert f"COPY {package} {package}" in dockerfile, package
    assert Path(DEPLOY / "nginx.conf").read_text().count("proxy_buffering off") == 1
