"""The operations docs are true to /metrics: the Grafana dashboard, the alert rules and the table of
metric names in docs/operations.md name only series the server exports, and the table lists all.

The exported names are read from real scrapes: the simulated backend, and the openai backend over
fake upstreams (its per-upstream series).
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml
from litestar.testing import TestClient
from prometheus_client.parser import text_string_to_metric_families

from batchgen.core.service import BatchService
from batchgen.server.app import create_app
from batchgen.server.settings import ServerSettings
from tests.conftest import in_process_app
from tests.core.test_openai_upstream import FakeFleet

DOCS = Path(__file__).resolve().parents[2] / "docs"
METRIC_NAME = re.compile(r"\bbatchgen_[a-z_]+\b")


def _scrape(app: Any) -> tuple[set[str], set[str]]:
    """(family names, sample names) of one app's /metrics."""
    with TestClient(app, timeout=30) as client:
        client.get("/health")  # one routed request, so the HTTP histogram has series
        families = list(text_string_to_metric_families(client.get("/metrics").text))
    return {family.name for family in families}, {
        sample.name for family in families for sample in family.samples
    }


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> tuple[set[str], set[str]]:
    simulated = _scrape(
        in_process_app(tmp_path_factory.mktemp("simulated"), "--webhook-url", "http://127.0.0.1:9/")
    )
    settings = ServerSettings(storage_path=tmp_path_factory.mktemp("openai"), backend="openai")
    service = BatchService(settings.service_settings(), FakeFleet(2).backend())
    upstreams = _scrape(create_app(settings, service))
    return simulated[0] | upstreams[0], simulated[1] | upstreams[1]


def _grafana_expressions() -> list[str]:
    dashboard = json.loads((DOCS / "grafana" / "batchgen-dashboard.json").read_text())
    expressions = [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]
    expressions += [
        variable["query"] for variable in dashboard["templating"]["list"] if variable["type"] == "query"
    ]
    assert all(expression.strip() for expression in expressions)
    return expressions


def test_the_grafana_dashboard_names_only_exported_series(exported: tuple[set[str], set[str]]) -> None:
    _, samples = exported
    expressions = _grafana_expressions()
    used = {name for expression in expressions for name in METRIC_NAME.findall(expression)}
    assert used - samples == set()
    assert {"batchgen_generated_tokens_total", "batchgen_slots_active", "batchgen_upstream_in_flight"} <= used


def test_the_alert_rules_name_only_exported_series(exported: tuple[set[str], set[str]]) -> None:
    _, samples = exported
    rules = yaml.safe_load((DOCS / "prometheus" / "alerts.yml").read_text())
    alerts = {rule["alert"]: rule for group in rules["groups"] for rule in group["rules"]}
    assert set(alerts) == {"BatchGenIntakeNearlyFull", "BatchGenBackendUnhealthy"}
    for rule in alerts.values():
        assert METRIC_NAME.findall(rule["expr"]) and set(METRIC_NAME.findall(rule["expr"])) <= samples
        assert rule["labels"]["severity"] and rule["annotations"]["summary"]
    intake = alerts["BatchGenIntakeNearlyFull"]["expr"]
    assert "batchgen_intake_capacity" in intake and "> 0.8" in intake
    assert "batchgen_backend_healthy == 0" in alerts["BatchGenBackendUnhealthy"]["expr"]


def test_the_metrics_table_lists_every_exported_family(exported: tuple[set[str], set[str]]) -> None:
    families, samples = exported
    operations = (DOCS / "operations.md").read_text()
    table = {
        match.group(1)
        for match in re.finditer(r"^\| `(batchgen_[a-z_]+)` \|", operations, flags=re.MULTILINE)
    }
    counters = {f"{name}_total" for name in families if f"{name}_total" in samples}
    documented_families = {name.removesuffix("_total") if name in counters else name for name in table}
    # a replica's own series are scraped from real replicas in tests/server/test_replica_servers.py
    replica_series = {name for name in table if name.startswith("batchgen_replica_")}
    assert documented_families - replica_series == families
    mentioned = set(METRIC_NAME.findall(operations))
    assert mentioned - samples - families - replica_series == set(), (
        "docs/operations.md names a series /metrics does not have"
    )
