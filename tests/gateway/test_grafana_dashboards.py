"""deploy/grafana: the dashboards hold to Grafana's own dashboard schema, and the provisioning and
Prometheus files the compose profile ``monitoring`` mounts point at what it starts.

No Grafana daemon runs here (no Docker engine on this machine), so each dashboard is checked
against the schema Grafana publishes as its npm package ``@grafana/schema`` (the ``Dashboard``
type, classic JSON model): the dashboard becomes a TypeScript object literal of that type and
the TypeScript compiler (both pinned in web/package-lock.json, installed by ``make setup``)
must accept it. Object literals get excess-property checks, so a misspelt field fails as a
wrong type does (the negative cases below prove it). That every metric a dashboard names is
exported by a real worker or gateway is tests/gateway/test_console_http.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import yaml
from grafana_queries import (
    DASHBOARDS,
    GRAFANA,
    ROOT,
    dashboard,
    metric_names,
    queries,
    schema_errors,
)


def test_there_is_a_dashboard() -> None:
    assert [p.name for p in DASHBOARDS] == ["tokenfleet.json"]


def test_dashboards_hold_to_grafanas_dashboard_schema(tmp_path: Path) -> None:
    good = {p.stem: dashboard(p) for p in DASHBOARDS}
    misspelt = dict(good["tokenfleet"], titel="x")  # a field the schema does not have
    wrong_type = json.loads(json.dumps(good["tokenfleet"]))
    wrong_type["panels"][1]["gridPos"]["h"] = "8"  # a string where a number goes
    assert schema_errors(good, tmp_path / "good") == ""
    assert "'\"titel\"' does not exist in type 'Dashboard'" in schema_errors(
        {"bad": misspelt}, tmp_path / "misspelt"
    )
    assert "not assignable to type 'number'" in schema_errors(
        {"bad": wrong_type}, tmp_path / "wrong"
    )


def test_metric_names_are_read_out_of_promql() -> None:
    expr = (
        'histogram_quantile(0.95, sum by (le, model_name) (rate(a:b_bucket{model_name=~"$m"}'
        '[5m]))) / max by (x) (c_total{s="d e"}) and on(x) label_values(up, job)'
    )
    assert metric_names(expr) == {"a:b_bucket", "c_total", "up"}
    assert metric_names('60 * max by (q) (rate(x_total{y="z"}[1m]))') == {"x_total"}


def test_every_panel_queries_tokenfleet_metrics_through_the_datasource_variable() -> None:
    for path in DASHBOARDS:
        data = dashboard(path)
        names = set().union(*(metric_names(q) for q in queries(data)))
        assert names and all(n.startswith("tokenfleet") for n in names), names
        for panel in data["panels"]:
            if panel["type"] != "row":
                assert panel["datasource"] == {"type": "prometheus", "uid": "${datasource}"}
        ids = [p["id"] for p in data["panels"]]
        assert len(ids) == len(set(ids))


def test_provisioning_and_prometheus_point_at_what_the_profile_starts() -> None:
    (source,) = yaml.safe_load((GRAFANA / "provisioning/datasources/prometheus.yaml").read_text())[
        "datasources"
    ]
    assert (source["type"], source["url"]) == ("prometheus", "http://prometheus:9090")
    (provider,) = yaml.safe_load((GRAFANA / "provisioning/dashboards/tokenfleet.yaml").read_text())[
        "providers"
    ]
    assert provider["options"]["path"] == "/etc/grafana/dashboards"
    scrape = yaml.safe_load((ROOT / "deploy/prometheus/prometheus.yml").read_text())
    jobs = {job["job_name"]: job for job in scrape["scrape_configs"]}
    (workers,) = jobs["tokenfleet-workers"]["dns_sd_configs"]
    assert (workers["names"], workers["port"]) == (["worker"], 9400)
    assert jobs["tokenfleet-gateway"]["static_configs"] == [{"targets": ["gateway:8000"]}]
