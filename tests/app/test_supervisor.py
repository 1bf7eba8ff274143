"""How many gateway processes ``phasegate serve`` starts by default: the cgroup's CPU quota
(v2 ``cpu.max``, v1 CFS quota over period), rounded up, else the cores it may run on.
The cgroup trees here are folders laid out as the kernel shows them."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from app.process.supervisor import cpu_quota, default_processes


def lay(root: Path, files: dict[str, str]) -> None:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)


def test_cgroup_v2_quota_of_the_process_own_cgroup(tmp_path: Path) -> None:
    lay(tmp_path, {"proc": "0::/kubepods/pod1\n", "fs/kubepods/pod1/cpu.max": "150000 100000\n"})
    assert cpu_quota(tmp_path / "fs", tmp_path / "proc") == 1.5


def test_cgroup_v2_in_a_container_reads_its_root(tmp_path: Path) -> None:
    lay(tmp_path, {"proc": "0::/\n", "fs/cpu.max": "200000 100000\n"})
    assert cpu_quota(tmp_path / "fs", tmp_path / "proc") == 2.0


def test_cgroup_v2_without_a_quota(tmp_path: Path) -> None:
    lay(tmp_path, {"proc": "0::/\n", "fs/cpu.max": "max 100000\n"})
    assert cpu_quota(tmp_path / "fs", tmp_path / "proc") is None


def test_cgroup_v1_cfs_quota(tmp_path: Path) -> None:
    lay(
        tmp_path,
        {
            "proc": "4:memory:/docker/abc\n2:cpu,cpuacct:/docker/abc\n0::/\n",
            "fs/cpu,cpuacct/docker/abc/cpu.cfs_quota_us": "300000\n",
            "fs/cpu,cpuacct/docker/abc/cpu.cfs_period_us": "100000\n",
        },
    )
    assert cpu_quota(tmp_path / "fs", tmp_path / "proc") == 3.0


def test_cgroup_v1_unlimited_and_no_cgroup_at_all(tmp_path: Path) -> None:
    lay(tmp_path, {"proc": "1:cpu:/\n", "fs/cpu/cpu.cfs_quota_us": "-1\n", "fs/cpu/cpu.cfs_period_us": "100000\n"})
    assert cpu_quota(tmp_path / "fs", tmp_path / "proc") is None
    assert cpu_quota(tmp_path / "nothing", tmp_path / "no-proc-file") is None


@pytest.mark.parametrize(("quota", "wanted"), [(0.2, 1), (1.0, 1), (1.5, 2), (2.0, 2), (64.0, None)])
def test_the_default_rounds_the_quota_up_within_the_cores(quota: float, wanted: int | None) -> None:
    cores = len(os.sched_getaffinity(0))
    expected = min(wanted, cores) if wanted is not None else cores
    assert default_processes(quota) == expected


def test_without_a_quota_the_default_is_the_cores_this_process_may_use() -> None:
    if cpu_quota() is not None:
        pytest.skip("this machine's cgroup sets a CPU quota")
    assert default_processes() == len(os.sched_getaffinity(0))
