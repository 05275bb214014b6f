"""deploy/k8s, validated offline: every file parses, every object has its kind's required fields,
references resolve (ConfigMap, Secret, Deployment, TriggerAuthentication), the settings it sets
are ones tokenfleet accepts, and KEDA's triggers name the streams and consumer group the code
uses for exactly the priorities the scaled Deployment serves (batch: from zero), each stream's
lag summed with its queue's tenant backlog (a KEDA ``redis`` list trigger) by the ScaledObject's
scalingModifiers formula, which scales per queue on the sum over tenants as the stream's lagCount
says. The same holds for cluster/keda-cluster.yaml, keda.yaml for a Redis Cluster (hash-tagged
names, KEDA's redis-cluster-streams and redis-cluster triggers), which must scale exactly as
keda.yaml does."""

from __future__ import annotations

import ast
import math
import operator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tokenfleet.shared.keys import CONSUMER_GROUP, Keys
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.worker_settings import parse_priorities

K8S = Path(__file__).resolve().parent.parent / "deploy" / "k8s"
# KEDA files: path under K8S -> (stream trigger type, list trigger type, whether names are
# cluster-mode ones)
KEDA_FILES = {
    "keda.yaml": ("redis-streams", "redis", False),
    "cluster/keda-cluster.yaml": ("redis-cluster-streams", "redis-cluster", True),
}
# what a mode changes
CONNECTION_FIELDS = {"address", "addresses", "databaseIndex", "stream", "listName"}
REQUIRED = {  # kind -> dotted paths every object of that kind must have
    "ConfigMap": ["metadata.name", "data"],
    "Secret": ["metadata.name", "stringData"],
    "Deployment": ["metadata.name", "spec.selector.matchLabels", "spec.template.spec.containers"],
    "Service": ["metadata.name", "spec.selector", "spec.ports"],
    "ScaledObject": ["metadata.name", "spec.scaleTargetRef.name", "spec.triggers"],
    "TriggerAuthentication": ["metadata.name", "spec.secretTargetRef"],
}
API_VERSIONS = {
    "ConfigMap": "v1",
    "Secret": "v1",
    "Service": "v1",
    "Deployment": "apps/v1",
    "ScaledObject": "keda.sh/v1alpha1",
    "TriggerAuthentication": "keda.sh/v1alpha1",
}


def _get(obj: dict[str, Any], path: str) -> Any:
    for part in path.split("."):
        if not isinstance(obj, dict) or part not in obj:
            return None
        obj = obj[part]
    return obj


def _load(name: str) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all((K8S / name).read_text()) if d is not None]


def _objects() -> list[dict[str, Any]]:
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    return [obj for name in kustomization["resources"] for obj in _load(name)]


def _by_kind(kind: str) -> dict[str, dict[str, Any]]:
    return {o["metadata"]["name"]: o for o in _objects() if o["kind"] == kind}


def _env(deployment: dict[str, Any]) -> dict[str, str]:
    """What the worker container sees: the ConfigMap and Secret it loads, then its own env."""
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    env: dict[str, str] = {}
    for source in container.get("envFrom", []):
        if "configMapRef" in source:
            env.update(_by_kind("ConfigMap")[source["configMapRef"]["name"]]["data"])
        if "secretRef" in source:
            env.update(_by_kind("Secret")[source["secretRef"]["name"]]["stringData"])
    env.update({e["name"]: e.get("value", "<from field>") for e in container.get("env", [])})
    return env


def test_every_listed_file_is_used_and_every_object_is_complete() -> None:
    listed = set(yaml.safe_load((K8S / "kustomization.yaml").read_text())["resources"])
    assert listed == {p.name for p in K8S.glob("*.yaml")} - {"kustomization.yaml"}
    objects = _objects()
    assert {o["kind"] for o in objects} == set(REQUIRED)
    for obj in objects:
        assert obj["apiVersion"] == API_VERSIONS[obj["kind"]], obj["metadata"]
        for path in REQUIRED[obj["kind"]]:
            assert _get(obj, path), f"{obj['kind']} {obj['metadata'].get('name')}: no {path}"


def test_deployments_select_their_pods_and_load_existing_settings() -> None:
    for name, dep in _by_kind("Deployment").items():
        labels = dep["spec"]["template"]["metadata"]["labels"]
        assert dep["spec"]["selector"]["matchLabels"].items() <= labels.items(), name
        env = _env(dep)  # KeyError here: a ConfigMap or Secret that does not exist
        tokenfleet_env = {k: v for k, v in env.items() if k.startswith("TOKENFLEET_")}
        tokenfleet_env["REDIS_URL"] = env["REDIS_URL"]
        Settings.from_env(tokenfleet_env)  # SettingsError: a misspelt or malformed setting
    services = _by_kind("Service").values()
    for svc in services:
        assert any(
            svc["spec"]["selector"].items() <= d["spec"]["template"]["metadata"]["labels"].items()
            for d in _by_kind("Deployment").values()
        ), svc["metadata"]["name"]


def _scaled(
    name: str, keda_file: str = "keda.yaml"
) -> tuple[dict[str, Any], dict[str, Any], dict[str, str]]:
    """The ScaledObject ``name`` of ``keda_file``, the Deployment it scales, and its env."""
    [so] = [
        o for o in _load(keda_file) if o["kind"] == "ScaledObject" and o["metadata"]["name"] == name
    ]
    dep = _by_kind("Deployment")[so["spec"]["scaleTargetRef"]["name"]]
    return so, dep, _env(dep)


def _formula(so: dict[str, Any], values: dict[str, float]) -> float:
    """The ScaledObject's scalingModifiers formula evaluated with ``values`` per trigger name
    (its expressions here are also Python's: names, + and /, max)."""
    formula = so["spec"]["advanced"]["scalingModifiers"]["formula"]
    return _evaluate(ast.parse(formula, mode="eval").body, values)


_OPS = {
    ast.Add: operator.add,
    ast.Sub: operator.sub,
    ast.Mult: operator.mul,
    ast.Div: operator.truediv,
}


def _evaluate(node: ast.AST, values: dict[str, float]) -> float:
    """Numbers, trigger names, + - * / and max(...): nothing else of a formula is evaluated
    (no eval: a formula is data)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, int | float):
        return float(node.value)
    if isinstance(node, ast.Name):
        return float(values[node.id])
    if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
        return _OPS[type(node.op)](_evaluate(node.left, values), _evaluate(node.right, values))
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "max":
        return max(_evaluate(a, values) for a in node.args)
    raise AssertionError(f"unexpected part of a KEDA formula: {ast.dump(node)}")


@pytest.mark.parametrize("keda_file", sorted(KEDA_FILES))
@pytest.mark.parametrize("name", ["tokenfleet-worker", "tokenfleet-worker-batch"])
def test_keda_scales_on_the_lag_plus_tenant_backlog_of_the_queues_the_workers_serve(
    name: str, keda_file: str
) -> None:
    stream_type, list_type, cluster = KEDA_FILES[keda_file]
    so, _dep, env = _scaled(name, keda_file)
    model = env.get("TOKENFLEET_MODEL_NAME", "default")
    keys = Keys(env["TOKENFLEET_KEY_PREFIX"], cluster=cluster, lane=model)  # (a cluster: its lane)
    priorities = parse_priorities(env.get("TOKENFLEET_PRIORITIES"))
    auths = {
        o["metadata"]["name"] for o in _load(keda_file) if o["kind"] == "TriggerAuthentication"
    }
    lag_of: dict[str, tuple[str, int]] = {}  # stream -> (trigger name, lagCount)
    backlog_of: dict[str, str] = {}  # list -> trigger name
    for trigger in so["spec"]["triggers"]:
        meta = trigger["metadata"]
        assert trigger["authenticationRef"]["name"] in auths
        if trigger["type"] == list_type:  # LLEN of a queue's tenant backlog
            backlog_of[meta["listName"]] = trigger["name"]
            continue
        assert trigger["type"] == stream_type
        assert meta["consumerGroup"] == CONSUMER_GROUP
        assert int(meta["lagCount"]) > 0  # the XINFO GROUPS lag: what status --json reports
        assert "pendingEntriesCount" not in meta and "streamLength" not in meta
        lag_of[meta["stream"]] = (trigger["name"], int(meta["lagCount"]))
    served = {keys.stream(model, p) for p in priorities}
    assert set(lag_of) == served, f"{name} scales on {set(lag_of)} but serves {served}"
    assert set(backlog_of) == {keys.tenant_backlog(model, p) for p in priorities}
    names = [t["name"] for t in so["spec"]["triggers"]]
    assert len(set(names)) == len(names)
    modifiers = so["spec"]["advanced"]["scalingModifiers"]
    target = float(modifiers["target"])
    assert modifiers.get("metricType", "AverageValue") == "AverageValue"
    for p in priorities:
        lag_name, lag_count = lag_of[keys.stream(model, p)]
        backlog_name = backlog_of[keys.tenant_backlog(model, p)]
        for waiting in (0, 1, lag_count, lag_count + 1, 5 * lag_count + 3):
            for in_streams in {0, waiting // 2, waiting}:  # wherever they wait
                values = dict.fromkeys(names, 0.0)
                values[lag_name] = in_streams
                values[backlog_name] = waiting - in_streams
                # replicas = ceil(formula / target): one per lagCount waiting in this queue
                replicas = math.ceil(_formula(so, values) / target - 1e-9)
                assert replicas == math.ceil(waiting / lag_count), (p, waiting, in_streams)


@pytest.mark.parametrize("keda_file", sorted(KEDA_FILES))
def test_a_request_waiting_in_a_tenant_queue_wakes_the_batch_pool_from_zero(
    keda_file: str,
) -> None:
    so, _dep, env = _scaled("tokenfleet-worker-batch", keda_file)
    modifiers = so["spec"]["advanced"]["scalingModifiers"]
    activation = float(modifiers.get("activationTarget", "0"))
    names = [t["name"] for t in so["spec"]["triggers"]]
    for name in names:  # one request, in the stream or in a tenant queue: above activation
        assert _formula(so, dict.fromkeys(names, 0.0) | {name: 1.0}) > activation
    assert _formula(so, dict.fromkeys(names, 0.0)) <= activation  # nothing waits: back to 0
    assert all(t["name"] != "" for t in so["spec"]["triggers"])
    assert {p.label for p in parse_priorities(env["TOKENFLEET_PRIORITIES"])} == {
        Priority.BATCH.label
    }


def test_the_batch_pool_scales_to_zero_and_serves_only_batch() -> None:
    so, _dep, env = _scaled("tokenfleet-worker-batch")
    assert so["spec"]["minReplicaCount"] == 0
    assert [p.label for p in parse_priorities(env["TOKENFLEET_PRIORITIES"])] == ["batch"]
    interactive, _, ienv = _scaled("tokenfleet-worker")
    assert interactive["spec"]["minReplicaCount"] >= 1
    assert "batch" not in ienv["TOKENFLEET_PRIORITIES"]


def test_the_trigger_authentication_reads_an_existing_secret_key() -> None:
    secrets = _by_kind("Secret")
    for auth in _by_kind("TriggerAuthentication").values():
        for ref in auth["spec"]["secretTargetRef"]:
            assert ref["key"] in secrets[ref["name"]]["stringData"]


def test_the_cluster_keda_file_scales_as_keda_yaml_on_the_cluster() -> None:
    """Only the connection (addresses, no db) and the stream names (hash-tagged) differ."""
    variants = {str(p.relative_to(K8S)) for p in K8S.glob("*/**/*.yaml")}
    assert variants == set(KEDA_FILES) - {"keda.yaml"}  # no file here goes unchecked
    base, cluster = _load("keda.yaml"), _load("cluster/keda-cluster.yaml")
    assert [(o["kind"], o["metadata"]) for o in cluster] == [
        (o["kind"], o["metadata"]) for o in base
    ]
    for b, c in zip(base, cluster, strict=True):
        assert c["apiVersion"] == API_VERSIONS[c["kind"]]
        if c["kind"] != "ScaledObject":
            assert c == b  # the TriggerAuthentication: the same Secret key
            continue
        assert {**c["spec"], "triggers": None} == {**b["spec"], "triggers": None}
        for bt, ct in zip(b["spec"]["triggers"], c["spec"]["triggers"], strict=True):
            bm, cm = bt["metadata"], ct["metadata"]
            assert bt["name"] == ct["name"]
            assert ct["type"] == {"redis-streams": "redis-cluster-streams"}.get(
                bt["type"], "redis-cluster"
            )
            assert "address" not in cm and "databaseIndex" not in cm
            for address in cm["addresses"].split(","):
                host, _, port = address.rpartition(":")
                assert host and port.isdigit(), address
            field = "stream" if "stream" in bm else "listName"
            prefix, tail = bm[field].split(":", 1)
            model = tail.split(":")[1]  # q|tlen:MODEL:LEVEL, in the model's lane on a cluster
            assert cm[field] == f"{{{prefix}|{model}}}:{tail}"
            assert {k: v for k, v in cm.items() if k not in CONNECTION_FIELDS} == {
                k: v for k, v in bm.items() if k not in CONNECTION_FIELDS
            }
            assert ct["authenticationRef"] == bt["authenticationRef"]
