"""Reading deploy/grafana's dashboards: the PromQL they hold and the metric names it reads, and
the check against Grafana's dashboard schema (``@grafana/schema`` through the TypeScript
compiler, both pinned in web/package-lock.json)."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from child_process import run_command

ROOT = Path(__file__).resolve().parents[2]
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
    out = run_command(["node", str(TSC), "-p", str(tmp / "tsconfig.json")], cwd=tmp)
    return out.stdout + out.stderr if out.returncode else ""


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
