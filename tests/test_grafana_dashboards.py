"""deploy/grafana: the dashboards hold to Grafana's own dashboard schema, and the provisioning and
Prometheus files the compose profile ``monitoring`` mounts point at what it starts.

No Grafana daemon runs here (no Docker engine on this machine), so each dashboard is checked
against the schema Grafana publishes as its npm package ``@grafana/schema`` (the ``Dashboard``
type, classic JSON model): the dashboard becomes a TypeScript object literal of that type and
the TypeScript compiler (both pinned in web/package-lock.json, installed by ``make setup``)
must accept it. Object literals get excess-property checks, so a misspelt field fails as a
wrong type does (the negative cases below prove it). That every metric a dashboard names is
exported by a real worker or gateway is tests/gateway/test_console_metrics.py.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
GRAFANA = ROOT / "deploy" / "grafana"
DASHBOARDS = sorted((GRAFANA / "dashboards").glob("*.json"))
WEB = ROOT / "web" / "node_modules"
TSC = WEB / "typescript" / "bin" / "tsc"


def dashboard(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def schema_errors(dashboards: dict[str, dict[str, Any]], tmp: Path) -> str:
    """The TypeScript compiler's complaints about each dashboard as a ``Dashboard`` of
    ``@grafana/schema`` ("" when it accepts them all)."""
    if not TSC.is_file() or shutil.which("node") is None:
        pytest.fail("node and web/node_modules (make setup: npm ci in web/) check the dashboards")
    tmp.mkdir(parents=True, exist_ok=True)
    files = []
    for name, data in dashboards.items():
        source = tmp / f"{name}.ts"
        source.write_text(
            'import type { Dashboard } from "@grafana/schema";\n'
            f"export const dashboard: Dashboard = {json.dumps(data, indent=1)};\n"
        )
        files.append(source.name)
    config = {
        "compilerOptions": {
            "strict": True,
            "noEmit": True,
            "module": "esnext",
            "moduleResolution": "bundler",
            "target": "es2022",
            "skipLibCheck": True,
            "types": [],
            "baseUrl": ".",
            "paths": {"@grafana/schema": [str(WEB / "@grafana" / "schema")]},
        },
        "files": files,
    }
    (tmp / "tsconfig.json").write_text(json.dumps(config))
    out = subprocess.run(
        ["node", str(TSC), "-p", str(tmp / "tsconfig.json")],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp,
    )
    return out.stdout + out.stderr if out.returncode else ""


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


_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_BRACES = re.compile(r"\{[^{}]*\}")
_RANGE = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_NAME = re.compile(r"[A-Za-z_:][A-Za-z0-9_:]*")
_LABEL_VALUES = re.compile(r"\blabel_values\(\s*([^,()]+?)\s*,\s*[A-Za-z_]\w*\s*\)")  # Grafana's


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: identifiers outside strings, label matchers,
    ranges and grouping clauses that are not a function's name (followed by ``(``) or a
    keyword, nor a number; Grafana's ``label_values(metric, label)`` reads ``metric``."""
    text = _LABEL_VALUES.sub(r" \1 ", expr)
    text = _STRING.sub('""', text)
    text = _BRACES.sub(" ", text)
    text = _RANGE.sub(" ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for m in _NAME.finditer(text):
        rest = text[m.end() :].lstrip()
        if rest.startswith("(") or m.group() in {"and", "or", "unless", "bool", "offset"}:
            continue
        names.add(m.group())
    return names


def queries(data: dict[str, Any]) -> list[str]:
    """Every PromQL expression a dashboard holds: its panels' targets (rows' too) and its
    templating queries."""
    out = []
    for panel in data["panels"]:
        for p in [panel, *panel.get("panels", [])]:
            out += [t["expr"] for t in p.get("targets", [])]
    for var in data["templating"]["list"]:
        query = var.get("query")
        if isinstance(query, dict):
            out.append(query["query"])
    return out


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
