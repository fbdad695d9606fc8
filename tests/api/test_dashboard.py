"""The Grafana dashboard and Prometheus configuration: every metric queried is one the code exports, and the
pieces name each other the way docker-compose.yml wires them."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import yaml
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvledger.json"
METRIC_NAME = re.compile(r"\b(?:kvledger_|vllm:kvledger_)[a-zA-Z0-9_:]*")
CONNECTOR_METRICS: frozenset[str] = frozenset()
"""Names the connector exports in vLLM's /metrics: none yet (issue 16 adds `vllm:kvledger_*`)."""


def _yaml(path: Path) -> Any:
    return yaml.safe_load(path.read_text())


def _panels() -> list[dict[str, Any]]:
    panels: list[dict[str, Any]] = json.loads(DASHBOARD.read_text())["panels"]
    return panels


def queried_metrics() -> set[str]:
    return {name for panel in _panels() for target in panel["targets"] for name in METRIC_NAME.findall(target["expr"])}


def exported_by_service(client: TestClient) -> set[str]:
    """Family and sample names of a real scrape (a counter `x` is queried as `x_total`, a histogram as `x_bucket`)."""
    names: set[str] = set()
    for family in text_string_to_metric_families(client.get("/metrics").text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def test_every_metric_the_dashboard_queries_is_exported(client: TestClient) -> None:
    queried = queried_metrics()
    exported = exported_by_service(client) | CONNECTOR_METRICS
    assert len(queried) >= 10, queried
    assert queried <= exported, f"queried but exported by nobody: {sorted(queried - exported)}"
    for needed in ("kvledger_blocks_held", "kvledger_live_transfers_by_phase", "kvledger_releases_total",
                   "kvledger_findings", "kvledger_release_latency_seconds_bucket"):  # fmt: skip
        assert needed in queried, f"the dashboard must show {needed}"


def test_panels_name_the_provisioned_data_source() -> None:
    sources = _yaml(DEPLOY / "grafana" / "provisioning" / "datasources" / "prometheus.yml")["datasources"]
    uids = {source["uid"] for source in sources}
    assert all(panel["datasource"]["uid"] in uids for panel in _panels())
    assert {source["url"] for source in sources} == {"http://prometheus:9090"}
    ids = [panel["id"] for panel in _panels()]
    assert len(ids) == len(set(ids)), "panel ids must be unique"


def test_compose_runs_prometheus_scraping_the_service_and_grafana_with_the_dashboard() -> None:
    services = _yaml(ROOT / "docker-compose.yml")["services"]
    mounts = {volume.split(":")[1]: ROOT / volume.split(":")[0] for volume in services["prometheus"]["volumes"]
              if volume.startswith("./")}  # fmt: skip
    config = _yaml(mounts["/etc/prometheus/prometheus.yml"])
    (job,) = config["scrape_configs"]
    assert job.get("metrics_path", "/metrics") == "/metrics"
    (target,) = [t for group in job["static_configs"] for t in group["targets"]]
    host, port = target.split(":")
    assert host in services and "--port " + port in " ".join(services[host]["command"])
    grafana = {volume.split(":")[1]: ROOT / volume.split(":")[0] for volume in services["grafana"]["volumes"]}
    provider = _yaml(grafana["/etc/grafana/provisioning"] / "dashboards" / "kvledger.yml")["providers"][0]
    assert grafana[provider["options"]["path"]] == DASHBOARD.parent
    assert services["grafana"]["depends_on"] == ["prometheus"] and services["prometheus"]["depends_on"] == ["kvledger"]
