"""WorkerSettings: flags over environment, parsing, refusals with a clear message."""

from __future__ import annotations

import pytest

from tokenfleet.shared.errors import SettingsError
from tokenfleet.shared.priority import Priority
from tokenfleet.shared.settings import Settings
from tokenfleet.worker.worker_settings import (
    ENV_VARS,
    WorkerSettings,
    parse_memory,
    parse_priorities,
)


def test_environment_then_flags() -> None:
    env = {
        "TOKENFLEET_MODEL": "/m",
        "TOKENFLEET_MAX_NUM_SEQS": "4",
        "TOKENFLEET_KV_MEMORY": "2G",
        "TOKENFLEET_PRIORITIES": "batch,critical",
        "TOKENFLEET_NAME": "gpu-0",
        "TOKENFLEET_GRACE_S": "2.5",
        "TOKENFLEET_METRICS_PORT": "9100",
    }
    ws = WorkerSettings.from_env(env, max_num_seqs=8, name=None)
    assert ws.model == "/m" and ws.max_num_seqs == 8 and ws.name == "gpu-0"
    assert ws.kv_memory_bytes == 2 * 2**30 and ws.kv_blocks is None
    assert ws.priorities == (Priority.CRITICAL, Priority.BATCH)
    assert ws.grace_s == 2.5 and ws.metrics_port == 9100
    assert ws.engine_overrides()["kv_memory_bytes"] == 2 * 2**30


def test_a_kv_size_flag_replaces_the_environments_other_kv_size() -> None:
    env = {"TOKENFLEET_MODEL": "/m", "TOKENFLEET_KV_BLOCKS": "10"}
    ws = WorkerSettings.from_env(env, kv_memory="1G")
    assert ws.kv_memory_bytes == 2**30 and ws.kv_blocks is None
    with pytest.raises(SettingsError, match="not both"):  # both from the environment
        WorkerSettings.from_env({**env, "TOKENFLEET_KV_MEMORY": "1G"})


def test_every_worker_variable_is_accepted_by_the_shared_settings() -> None:
    env = dict.fromkeys(ENV_VARS, "1")
    Settings.from_env(env)  # would raise SettingsError on an unknown TOKENFLEET_ variable


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "no model"),
        ({"model": "m", "kv_blocks": 10, "kv_memory": "1G"}, "not both"),
        ({"model": "m", "max_num_seqs": 0}, "max_num_seqs"),
        ({"model": "m", "name": "bad name"}, "worker name"),
        ({"model": "m", "priorities": "urgent"}, "unknown priority"),
        ({"model": "m", "kv_memory": "lots"}, "memory amount"),
    ],
)
def test_bad_settings_are_refused(kwargs: dict, match: str) -> None:
    with pytest.raises(SettingsError, match=match):
        WorkerSettings.from_env({}, **kwargs)


def test_parsers() -> None:
    assert parse_memory("512M") == 512 * 2**20
    assert parse_memory("1.5GiB") == int(1.5 * 2**30)
    assert parse_memory("4096") == 4096
    assert parse_priorities("") == tuple(Priority)
    assert parse_priorities("normal") == (Priority.NORMAL,)
