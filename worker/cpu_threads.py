"""How many CPUs this process may use: the worker's default for torch's threads.

torch's own default counts the machine's cores (or the affinity mask), not a container's CPU
limit: a worker in a pod limited to 2 CPUs on a 64-core node would start 64 threads and be
throttled. ``usable_cpus()`` is the affinity mask's size, capped by the cgroup CPU quota
(cgroup v2 ``cpu.max``, v1 ``cpu.cfs_quota_us`` / ``cpu.cfs_period_us``) rounded up.
"""

from __future__ import annotations

import math
import os
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")


def cgroup_cpu_quota(root: Path = CGROUP_ROOT) -> float | None:
    """CPUs the cgroup's quota allows (e.g. 1.5), or None without a quota or a readable one."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # v2: "max 100000"
        if quota == "max":
            return None
        return int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:  # v1
        quota_us = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period_us = int((root / "cpu" / "cpu.cfs_period_us").read_text())
    except (OSError, ValueError):
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus(root: Path = CGROUP_ROOT) -> int:
    """CPUs this process may run on (at least 1): see the module docstring."""
    if hasattr(os, "sched_getaffinity"):
        count = len(os.sched_getaffinity(0))
    else:  # macOS, Windows
        count = os.cpu_count() or 1
    quota = cgroup_cpu_quota(root)
    if quota is not None:
        count = min(count, math.ceil(quota))
    return max(1, count)
