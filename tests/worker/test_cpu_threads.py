"""The worker's default thread count: the affinity mask, capped by a cgroup CPU quota."""

from __future__ import annotations

import os
from pathlib import Path

from tokenfleet.worker.cpu_threads import cgroup_cpu_quota, usable_cpus


def affinity() -> int:
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1


def test_no_cgroup_files_means_no_quota(tmp_path: Path) -> None:
    assert cgroup_cpu_quota(tmp_path) is None
    assert usable_cpus(tmp_path) == affinity()


def test_cgroup_v2_quota_caps_the_count(tmp_path: Path) -> None:
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one thread
    assert cgroup_cpu_quota(tmp_path) == 0.5
    assert usable_cpus(tmp_path) == 1
    (tmp_path / "cpu.max").write_text(f"{100000 * (affinity() + 8)} 100000\n")
    assert usable_cpus(tmp_path) == affinity()  # a quota above the mask: the mask


def test_cgroup_v1_quota(tmp_path: Path) -> None:
    (tmp_path / "cpu").mkdir()
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (tmp_path / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpu_quota(tmp_path) is None
    (tmp_path / "cpu" / "cpu.cfs_quota_us").write_text("150000\n")
    assert cgroup_cpu_quota(tmp_path) == 1.5
    assert usable_cpus(tmp_path) == min(2, affinity())
