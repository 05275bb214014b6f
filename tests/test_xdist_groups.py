"""The parallel run's pieces: which tests share a worker (tests/xdist_groups.py) and the ports a
pytest-xdist worker hands out (``free_port``)."""

from __future__ import annotations

import socket
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from xdist_groups import MODELS_GROUP, TESTS, XdistGroups, group_of, groups_table

from tokenfleet.worker.devtools import local_redis
from tokenfleet.worker.devtools.local_redis import free_port, worker_port_block


def fake_item(
    path: Path, *scopes: str, groups: tuple[str, ...] = (), uses: tuple[str, ...] = ()
) -> Any:
    defs = {f"f{i}": [SimpleNamespace(scope=scope)] for i, scope in enumerate(scopes)}
    marks = [SimpleNamespace(args=(g,), kwargs={}) for g in groups]
    return SimpleNamespace(
        path=path,
        nodeid=f"{path.relative_to(TESTS.parent).as_posix()}::test",
        fixturenames=[*defs, *uses],
        _fixtureinfo=SimpleNamespace(name2fixturedefs=defs),
        iter_markers=lambda name: iter(marks if name == "xdist_group" else []),
    )


def test_the_real_model_tests_are_grouped_by_the_session_fixture_they_share() -> None:
    models = TESTS / "models"
    assert group_of(fake_item(models / "test_x.py")) == MODELS_GROUP
    assert group_of(fake_item(models / "test_y.py", "module")) == MODELS_GROUP  # not by module
    fleet = fake_item(models / "test_z.py", uses=("sdk", "fleet", "started_fleet", "hf_smollm2"))
    assert group_of(fleet) == "models-fleet"
    assert group_of(fake_item(models / "test_w.py", uses=("hf_outputs", "hf_smollm2"))) == (
        "models-hf"
    )
    # both: the fleet's group (the fleet is the costlier thing to build twice)
    both = fake_item(models / "test_v.py", uses=("started_fleet", "hf_smollm2"))
    assert group_of(both) == "models-fleet"
    # outside tests/models, these names mean nothing
    assert group_of(fake_item(TESTS / "ha" / "test_x.py", uses=("started_fleet",))) is None


def test_a_module_scoped_fixture_keeps_its_module_together() -> None:
    for scope in ("module", "class", "package"):
        assert group_of(fake_item(TESTS / "ha" / "test_x.py", "session", scope)) == "ha/test_x.py"


def test_function_and_session_fixtures_leave_a_test_free_to_go_anywhere() -> None:
    assert group_of(fake_item(TESTS / "ha" / "test_x.py", "function", "session")) is None
    assert group_of(fake_item(TESTS / "test_x.py")) is None


def test_the_table_names_each_grouped_test_and_only_those() -> None:
    items = [
        fake_item(TESTS / "a" / "test_a.py", groups=("models",)),
        fake_item(TESTS / "b" / "test_b.py"),
        fake_item(TESTS / "c" / "test_c.py", groups=("y", "x")),
    ]
    assert groups_table(items) == {
        "tests/a/test_a.py::test": "models",
        "tests/c/test_c.py::test": "x_y",
    }


def test_the_controller_reads_the_table_a_worker_wrote(tmp_path: Path) -> None:
    worker = XdistGroups(
        SimpleNamespace(workerinput={"tokenfleet_xdist_groups": str(tmp_path), "workerid": "gw1"})
    )
    worker.pytest_collection_modifyitems(
        [fake_item(TESTS / "models" / "test_m.py", groups=("models",))]
    )
    controller = XdistGroups(SimpleNamespace())
    assert controller.read_table() == {}  # no worker has started
    controller.dir = tmp_path
    assert controller.read_table() == {"tests/models/test_m.py::test": "models"}
    assert [p.name for p in tmp_path.iterdir()] == ["gw1.json"]  # no half-written file left


def test_each_worker_has_its_own_port_block_below_the_ephemeral_range(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    blocks = []
    for n in range(local_redis.PORT_BLOCKS):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{n}")
        block = worker_port_block()
        assert block is not None
        blocks.append(block)
    ports = [p for b in blocks for p in b]
    assert len(ports) == len(set(ports))  # disjoint
    assert max(ports) + 10000 < 32768  # a cluster bus port (+10000) is below it too
    assert min(ports) + 10000 > max(ports)  # and no worker hands one out
    for name in ("", "gw", f"gw{local_redis.PORT_BLOCKS}", "master"):
        monkeypatch.setenv("PYTEST_XDIST_WORKER", name)
        assert worker_port_block() is None


def test_a_worker_takes_its_ports_in_turn_and_skips_a_taken_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw3")
    monkeypatch.setattr(local_redis, "_next_in_block", {})
    block = worker_port_block()
    assert block is not None
    first = free_port()
    assert first in block
    following = block[(block.index(first) + 1) % len(block)]
    after = block[(block.index(first) + 2) % len(block)]
    with socket.socket() as held:
        held.bind(("127.0.0.1", following))
        second = free_port()
    assert second != following
    assert second in block
    assert second == after or not local_redis._bindable(after)  # the next one, unless taken


def test_outside_a_worker_the_kernel_picks(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert free_port() >= 1024
