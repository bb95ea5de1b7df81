"""The machine and the limits of the container it runs in: CPU quota, memory limit, /dev/shm.

Parsing is tested on fixture trees (cgroup v1 and v2 layouts laid out under ``tmp_path``); the real
thing where the kernel gives it here: a child cgroup with a CPU quota or a memory limit, and a small
/dev/shm in a private mount namespace. Those skip, with the reason, where they cannot be made.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import multiprocessing
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest

from autotune import machine
from autotune.fingerprint import profile_key
from autotune.machine import (
    MIB,
    RAM_ROUND_BYTES,
    detect_machine,
    memory_available_bytes,
    read_cgroup_limits,
    read_shm,
    shm_free_bytes,
    shm_size_bucket_mib,
    usable_cpu_count,
)
from autotune.space import worker_bound
from benchmarks.scripts.containers import Unavailable, child_cgroup

GIB = RAM_ROUND_BYTES
AFFINITY = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count() or 1
REPO = str(Path(__file__).resolve().parent.parent)

# mountinfo lines as the kernel writes them: a v1 host with cpu and cpuacct co-mounted (and the v2
# unified hierarchy beside it, as systemd's hybrid mode does), and a pure v2 host.
V1_MOUNTS = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
"""
V2_MOUNTS = """\
22 1 259:1 / / rw,relatime - ext4 /dev/root rw
30 22 0:26 / /sys/fs/cgroup rw,nosuid,nodev,noexec,relatime - cgroup2 cgroup2 rw,nsdelegate
"""


def _tree(tmp_path: Path, cgroup: str, mountinfo: str, files: dict[str, str | None]) -> str:
    """A root folder holding /proc/self/{cgroup,mountinfo} and the given files (None: a folder)."""
    root = tmp_path / "root"
    files = {"proc/self/cgroup": cgroup, "proc/self/mountinfo": mountinfo, **files}
    for name, text in files.items():
        path = root / name
        if text is None:
            path.mkdir(parents=True, exist_ok=True)
        else:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
    return str(root)


def _v1(path: str) -> str:
    return f"9:name=systemd:/\n4:memory:{path}\n2:cpu,cpuacct:{path}\n0::/\n"


CPU_CASES = {
    "v2 no quota": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/cpu.max": "max 100000"}, None, "v2"),
    "v2 half a CPU": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/cpu.max": "50000 100000"}, 0.5, "v2"),
    "v2 quota on a parent": (
        "0::/kubepods/pod/ctr\n", V2_MOUNTS,
        {"sys/fs/cgroup/kubepods/pod/ctr/cpu.max": "max 100000",
         "sys/fs/cgroup/kubepods/pod/cpu.max": "150000 100000"}, 1.5, "v2"),
    "v2 the smallest of child and parent": (
        "0::/a/b\n", V2_MOUNTS,
        {"sys/fs/cgroup/a/b/cpu.max": "100000 100000", "sys/fs/cgroup/a/cpu.max": "300000 100000"},
        1.0, "v2"),
    "v2 in the root cgroup": ("0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cgroup.procs": ""}, None, "v2"),
    "v1 no quota": (_v1("/app"), V1_MOUNTS, {"sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_quota_us": "-1",
                                             "sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_period_us": "100000"},
                    None, "v1"),
    "v1 two CPUs": (_v1("/app"), V1_MOUNTS, {"sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_quota_us": "200000",
                                             "sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_period_us": "100000"},
                    2.0, "v1"),
    "v1 quota on a parent": (
        _v1("/kubepods/pod/ctr"), V1_MOUNTS,
        {"sys/fs/cgroup/cpu,cpuacct/kubepods/pod/ctr/cpu.cfs_quota_us": "-1",
         "sys/fs/cgroup/cpu,cpuacct/kubepods/pod/ctr/cpu.cfs_period_us": "100000",
         "sys/fs/cgroup/cpu,cpuacct/kubepods/pod/cpu.cfs_quota_us": "25000",
         "sys/fs/cgroup/cpu,cpuacct/kubepods/pod/cpu.cfs_period_us": "50000"}, 0.5, "v1"),
    # Inside a Docker container the container's own cgroup is mounted as the hierarchy's root:
    # mountinfo's root field is /docker/<id>, and its files sit at the mount point itself.
    "v1 container view": (
        _v1("/docker/abc"),
        "32 31 0:29 /docker/abc /sys/fs/cgroup/cpu rw - cgroup cgroup rw,cpu\n",
        {"sys/fs/cgroup/cpu/cpu.cfs_quota_us": "150000", "sys/fs/cgroup/cpu/cpu.cfs_period_us": "100000"},
        1.5, "v1"),
    # Under a cgroup namespace the path is relative to the namespace, and so is the mount.
    "v2 cgroup namespace": ("0::/\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "100000 100000"}, 1.0, "v2"),
    # Seen from outside the namespace the path climbs above the mount: read at the mount point.
    "v2 path above the mount": ("0::/../../x\n", V2_MOUNTS, {"sys/fs/cgroup/cpu.max": "200000 100000"},
                                2.0, "v2"),
    "mount point with a space": (
        "0::/app\n", "30 22 0:26 / /sys/fs/cgroup\\040x rw - cgroup2 cgroup2 rw\n",
        {"sys/fs/cgroup x/app/cpu.max": "100000 100000"}, 1.0, "v2"),
    # systemd's hybrid mode: cpu is on its v1 hierarchy, the unified one has no cpu.max to read.
    "hybrid reads v1": (_v1("/app"), V1_MOUNTS,
                        {"sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_quota_us": "100000",
                         "sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_period_us": "100000",
                         "sys/fs/cgroup/unified/cpu.max": "300000 100000"}, 1.0, "v1"),
}


@pytest.mark.parametrize("case", CPU_CASES.values(), ids=list(CPU_CASES))
def test_cpu_quota_is_read_from_the_cgroup_and_its_parents(tmp_path: Path, case: tuple) -> None:
    cgroup, mountinfo, files, quota, kind = case
    root = _tree(tmp_path, cgroup, mountinfo, files)
    limits = read_cgroup_limits(root)
    assert (limits.kind, limits.cpu_quota, limits.notes) == (kind, quota, ())
    # The bound is the affinity mask cut to the quota rounded up: 1.5 CPUs keep two busy.
    expected = AFFINITY if quota is None else max(1, min(AFFINITY, math.ceil(quota)))
    assert usable_cpu_count(root) == expected
    assert detect_machine(root=root).usable_cpus == expected


MEMORY_CASES = {
    "v2 no limit": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/memory.max": "max",
                                             "sys/fs/cgroup/app/memory.current": str(GIB)}, None, None),
    # The limit is on the parent, whose usage includes its other children: what is left there binds.
    "v2 limit on a parent": (
        "0::/pod/ctr\n", V2_MOUNTS,
        {"sys/fs/cgroup/pod/ctr/memory.max": "max", "sys/fs/cgroup/pod/ctr/memory.current": str(500 * MIB),
         "sys/fs/cgroup/pod/memory.max": str(2 * GIB), "sys/fs/cgroup/pod/memory.current": str(1536 * MIB),
         "sys/fs/cgroup/pod/memory.stat": f"anon 1000\nfile 5000\ninactive_file {256 * MIB}\n"},
        2 * GIB, 2 * GIB - (1536 - 256) * MIB),
    "v2 memory.high below memory.max": (
        "0::/app\n", V2_MOUNTS,
        {"sys/fs/cgroup/app/memory.max": str(4 * GIB), "sys/fs/cgroup/app/memory.high": str(3 * GIB),
         "sys/fs/cgroup/app/memory.current": str(GIB)}, 3 * GIB, 2 * GIB),
    # The smallest headroom binds even where its level's limit is not the smallest.
    "v2 the tighter of two levels": (
        "0::/a/b\n", V2_MOUNTS,
        {"sys/fs/cgroup/a/b/memory.max": str(1 * GIB), "sys/fs/cgroup/a/b/memory.current": str(100 * MIB),
         "sys/fs/cgroup/a/memory.max": str(2 * GIB), "sys/fs/cgroup/a/memory.current": str(1800 * MIB)},
        1 * GIB, 248 * MIB),
    "v1 unlimited": (_v1("/app"), V1_MOUNTS,
                     {"sys/fs/cgroup/memory/app/memory.limit_in_bytes": "9223372036854771712",
                      "sys/fs/cgroup/memory/app/memory.usage_in_bytes": str(GIB)}, None, None),
    "v1 limit": (_v1("/app"), V1_MOUNTS,
                 {"sys/fs/cgroup/memory/app/memory.limit_in_bytes": str(GIB),
                  "sys/fs/cgroup/memory/app/memory.usage_in_bytes": str(300 * MIB),
                  "sys/fs/cgroup/memory/app/memory.stat": f"cache 1\ntotal_inactive_file {100 * MIB}\n"},
                 GIB, GIB - (300 - 100) * MIB),
    "v1 over the limit": (_v1("/app"), V1_MOUNTS,
                          {"sys/fs/cgroup/memory/app/memory.limit_in_bytes": str(GIB),
                           "sys/fs/cgroup/memory/app/memory.usage_in_bytes": str(2 * GIB)}, GIB, 0),
}


@pytest.mark.parametrize("case", MEMORY_CASES.values(), ids=list(MEMORY_CASES))
def test_memory_limit_and_what_is_left_under_it(tmp_path: Path, case: tuple) -> None:
    cgroup, mountinfo, files, limit, headroom = case
    root = _tree(tmp_path, cgroup, mountinfo, files)
    limits = read_cgroup_limits(root)
    assert (limits.memory_limit_bytes, limits.memory_headroom_bytes, limits.notes) == (limit, headroom, ())
    info = detect_machine(root=root)
    assert info.memory_limit_bytes == limit
    assert info.memory_available_bytes == min(info.ram_available_bytes, headroom if limit else 1 << 62)
    # What a cache may take now never exceeds free RAM nor what the cgroup leaves.
    assert memory_available_bytes(root) <= (headroom if limit is not None else psutil.virtual_memory().total)


def test_a_memory_limit_above_the_ram_is_no_limit(tmp_path: Path) -> None:
    above = psutil.virtual_memory().total * 2
    root = _tree(tmp_path, "0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/memory.max": str(above)})
    assert read_cgroup_limits(root).memory_limit_bytes == above  # read as it is,
    info = detect_machine(root=root)
    assert info.memory_limit_bytes is None  # but it bounds nothing, and is no other machine
    assert info.fingerprint()["memory_limit_gib"] is None


GARBAGE = {
    "v2 cpu.max": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/cpu.max": "banana"}, "cpu.max"),
    "v2 cpu.max three fields": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/cpu.max": "1 2 3"}, "cpu.max"),
    "v2 zero quota": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/cpu.max": "0 100000"}, "not positive"),
    "v1 quota": (_v1("/app"), V1_MOUNTS, {"sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_quota_us": "lots",
                                          "sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_period_us": "100000"},
                 "cpu.cfs_quota_us"),
    "v1 zero period": (_v1("/app"), V1_MOUNTS, {"sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_quota_us": "5",
                                                "sys/fs/cgroup/cpu,cpuacct/app/cpu.cfs_period_us": "0"},
                       "not positive"),
    "v2 empty memory.max": ("0::/app\n", V2_MOUNTS, {"sys/fs/cgroup/app/memory.max": ""}, "memory.max"),
    "v1 limit unreadable": (_v1("/app"), V1_MOUNTS, {"sys/fs/cgroup/memory/app/memory.limit_in_bytes": None},
                            "memory.limit_in_bytes"),
    "unreadable own cgroup": (None, V1_MOUNTS, {}, "proc/self/cgroup"),
}


@pytest.mark.parametrize("case", GARBAGE.values(), ids=list(GARBAGE))
def test_garbage_is_no_limit_and_the_reason_is_kept(tmp_path: Path, case: tuple) -> None:
    cgroup, mountinfo, files, reason = case
    root = _tree(tmp_path, cgroup or "", mountinfo, files)
    if cgroup is None:  # a folder where the file should be: reading it fails
        os.remove(os.path.join(root, "proc/self/cgroup"))
        os.mkdir(os.path.join(root, "proc/self/cgroup"))
    limits = read_cgroup_limits(root)
    assert (limits.cpu_quota, limits.memory_limit_bytes, limits.memory_headroom_bytes) == (None, None, None)
    assert any(reason in note for note in limits.notes), limits.notes
    info = detect_machine(root=root)
    assert info.usable_cpus == AFFINITY
    assert info.limit_notes == limits.notes
    assert "unreadable, taken as none" in info.limits_line()


def test_no_cgroups_at_all(tmp_path: Path) -> None:
    # Not Linux, or nothing mounted: no limits, nothing to report, and no /dev/shm either.
    root = str(tmp_path / "empty")
    os.mkdir(root)
    assert read_cgroup_limits(root) == machine.CgroupLimits()
    info = detect_machine(root=root)
    assert (info.cgroup, info.usable_cpus, info.shm_total_bytes) == ("none", AFFINITY, None)
    assert read_shm(root) is None and shm_free_bytes(root) is None
    assert "no /dev/shm" in info.limits_line()


def test_cpu_on_v2_and_memory_on_v1_is_mixed(tmp_path: Path) -> None:
    mounts = V2_MOUNTS + "35 31 0:32 / /sys/fs/cgroup/memory rw - cgroup cgroup rw,memory\n"
    root = _tree(tmp_path, "4:memory:/m\n0::/c\n", mounts,
                 {"sys/fs/cgroup/c/cpu.max": "100000 100000",
                  "sys/fs/cgroup/memory/m/memory.limit_in_bytes": str(GIB)})
    limits = read_cgroup_limits(root)
    assert (limits.kind, limits.cpu_quota, limits.memory_limit_bytes) == ("mixed", 1.0, GIB)


def test_shm_is_read_from_the_tree(tmp_path: Path) -> None:
    root = tmp_path / "root"
    (root / "dev/shm").mkdir(parents=True)
    shm = read_shm(str(root))
    st = os.statvfs(root)
    assert shm is not None and shm.path == str(root / "dev/shm")
    assert shm.total_bytes == st.f_blocks * st.f_frsize


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm on this OS")
def test_shm_free_bytes_is_read_now() -> None:
    # Every call reads the filesystem again: a file written in between shows at once.
    name = f"/dev/shm/autotune-test-{os.getpid()}"
    before = shm_free_bytes()
    try:
        with open(name, "wb") as fh:
            fh.write(b"\1" * (8 * MIB))
        after = shm_free_bytes()
    finally:
        os.unlink(name)
    assert before is not None and after is not None
    # Other processes use /dev/shm too; 8 MiB written must show, give or take a MiB of theirs.
    assert abs((before - after) - 8 * MIB) < MIB


def test_shm_bucket_is_a_power_of_two() -> None:
    assert shm_size_bucket_mib(64 * MIB) == 64
    assert shm_size_bucket_mib(63 * MIB) == 64  # a few MiB less is the same machine
    assert shm_size_bucket_mib(12 * GIB) == 16384
    assert shm_size_bucket_mib(None) is None


def _info(**changes: object) -> machine.MachineInfo:
    return dataclasses.replace(detect_machine(), **changes)  # type: ignore[arg-type]


def test_the_fingerprint_tells_limits_apart_but_not_free_amounts() -> None:
    base = _info(cpu_quota=None, memory_limit_bytes=None, shm_total_bytes=8 * GIB, shm_free_bytes=8 * GIB)

    def key(info: machine.MachineInfo) -> str:
        return profile_key(info.fingerprint(), {"dataset": "x"})

    # A quota, a memory limit, a 64 MiB /dev/shm: each is another machine, with its own profile.
    other = [dataclasses.replace(base, cpu_quota=1.0), dataclasses.replace(base, memory_limit_bytes=2 * GIB),
             dataclasses.replace(base, shm_total_bytes=64 * MIB)]
    assert len({key(base), *map(key, other)}) == 4
    # Momentary readings are not: free RAM, free /dev/shm, the headroom under a limit.
    same = [dataclasses.replace(base, ram_available_bytes=1), dataclasses.replace(base, shm_free_bytes=1),
            dataclasses.replace(base, memory_headroom_bytes=GIB),
            dataclasses.replace(base, shm_total_bytes=8 * GIB - 3 * MIB)]
    assert {key(s) for s in same} == {key(base)}
    # The memory limit is rounded as the RAM is.
    two = dataclasses.replace(base, memory_limit_bytes=2 * GIB)
    assert key(dataclasses.replace(two, memory_limit_bytes=2 * GIB + 5 * MIB)) == key(two)
    assert two.fingerprint()["memory_limit_gib"] == 2


def test_limits_line_for_the_header() -> None:
    info = _info(usable_cpus=1, logical_cpus=2, cpu_quota=1.0, memory_limit_bytes=2 * GIB,
                 memory_headroom_bytes=1536 * MIB, ram_available_bytes=20 * GIB,
                 shm_total_bytes=64 * MIB, shm_free_bytes=61 * MIB, limit_notes=())
    assert info.limits_line() == (
        "1 of 2 CPUs usable (cgroup quota 1.0), memory limit 2.0 GiB (1.5 GiB available), "
        "/dev/shm 64 MiB (61 MiB free)"
    )
    free = _info(usable_cpus=2, logical_cpus=2, cpu_quota=None, memory_limit_bytes=None,
                 memory_headroom_bytes=None, ram_available_bytes=20 * GIB,
                 shm_total_bytes=12 * GIB, shm_free_bytes=12 * GIB, limit_notes=())
    assert free.limits_line() == (
        "2 CPUs usable, no memory limit (20.0 GiB available), /dev/shm 12.0 GiB (12.0 GiB free)"
    )
    assert "(cgroup quota 1.5)" in _info(cpu_quota=1.5).limits_line()


def test_detect_machine_is_cheap() -> None:
    detect_machine()
    times = []
    for _ in range(5):
        start = time.perf_counter()
        detect_machine()
        times.append(time.perf_counter() - start)
    # A few ms here (~1 ms); the bound leaves room for a loaded CI machine.
    assert sorted(times)[2] < 0.05


# --------------------------------------------------------------------------------------------------
# The real limits, from the kernel


def _run_in(cgroup: str, code: str) -> dict:
    """Run ``code`` in a Python moved into ``cgroup`` before it starts; return the JSON it prints."""
    wrapper = 'echo $$ > "$1/cgroup.procs" && exec "$2" -c "$3"'
    proc = subprocess.run(["sh", "-c", wrapper, "sh", cgroup, sys.executable, code],
                          capture_output=True, text=True, timeout=120, env={**os.environ, "PYTHONPATH": REPO})
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


@contextlib.contextmanager
def _child_cgroup(controller: str, settings: dict[str, dict[str, str]]) -> Iterator[str]:
    """A child of this process's own cgroup for ``controller``, named after this test run.

    ``settings`` maps the cgroup version to the files to write. Removed afterwards, even when the
    test fails; skips with the reason where no such cgroup can be made.
    """
    name = f"autotune-test-{os.getpid()}-{controller}"
    try:
        with child_cgroup(controller, settings, name) as path:
            yield path
    except Unavailable as err:
        pytest.skip(str(err))
    assert not os.path.exists(path), f"test cgroup {path} left behind"


READ_MACHINE = (
    "import json; from autotune.machine import detect_machine; m = detect_machine(); "
    "print(json.dumps({'usable_cpus': m.usable_cpus, 'cpu_quota': m.cpu_quota, 'cgroup': m.cgroup, "
    "'memory_limit_bytes': m.memory_limit_bytes, 'available': m.memory_available_bytes, "
    "'fingerprint': m.fingerprint(), 'line': m.limits_line(), 'notes': m.limit_notes, "
    "'own': open('/proc/self/cgroup').read()}))"
)
SPACE_WORKERS = (
    "from autotune.machine import detect_machine; from autotune.space import build_space; "
    "print(build_space(detect_machine(), batch_size=8, dataset_len=64, cuda=False).max_workers)"
)


def test_a_real_one_cpu_quota_bounds_usable_cpus_and_the_workers() -> None:
    with _child_cgroup("cpu", {"v1": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"},
                               "v2": {"cpu.max": "100000 100000"}}) as path:
        seen = _run_in(path, READ_MACHINE)
        workers = _run_in(path, SPACE_WORKERS)
    assert os.path.basename(path) in seen["own"]  # it really ran in the test's cgroup
    assert (seen["usable_cpus"], seen["cpu_quota"], seen["notes"]) == (1, 1.0, [])
    assert seen["fingerprint"]["cpu_quota"] == 1.0
    assert "usable (cgroup quota 1.0)" in seen["line"] and seen["line"].startswith("1 ")
    # The search space takes its worker bound from it: one CPU's worth, not the box's.
    assert workers == worker_bound(1)
    assert AFFINITY == 1 or workers < worker_bound(AFFINITY)


def test_a_real_memory_limit_below_free_ram_is_read() -> None:
    limit = GIB
    if psutil.virtual_memory().available < 2 * limit:
        pytest.skip("less than 2 GiB of free RAM: a 1 GiB limit would not be below it by much")
    with _child_cgroup("memory", {"v1": {"memory.limit_in_bytes": str(limit)},
                                  "v2": {"memory.max": str(limit)}}) as path:
        seen = _run_in(path, READ_MACHINE)
    assert os.path.basename(path) in seen["own"]
    assert (seen["memory_limit_bytes"], seen["notes"]) == (limit, [])
    # What is left under the limit, not the free RAM of the box, is what a cache may take.
    assert 0 < seen["available"] <= limit
    assert seen["fingerprint"]["memory_limit_gib"] == 1
    assert "memory limit 1.0 GiB" in seen["line"]


def test_a_real_64_mib_dev_shm_is_read() -> None:
    if shutil.which("unshare") is None or not sys.platform.startswith("linux"):
        pytest.skip("needs unshare(1) from util-linux on Linux")
    code = (
        "import json, os; from autotune.machine import detect_machine, shm_free_bytes; "
        "m = detect_machine(); before = shm_free_bytes(); "
        "open('/dev/shm/autotune-test', 'wb').write(bytes(8 << 20)); "
        "print(json.dumps({'total': m.shm_total_bytes, 'free': m.shm_free_bytes, 'before': before, "
        "'after': shm_free_bytes(), 'bucket': m.fingerprint()['shm_mib'], 'line': m.limits_line()}))"
    )
    # A private mount namespace: the 64 MiB tmpfs hides /dev/shm for this child alone, and goes with it.
    script = 'mount -t tmpfs -o size=64m tmpfs /dev/shm && exec "$0" -c "$1"'
    command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, sys.executable, code]
    proc = subprocess.run(command, capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": REPO})
    if proc.returncode != 0 and not proc.stdout:
        pytest.skip(f"cannot mount a private /dev/shm here: {proc.stderr.strip()[-300:]}")
    assert proc.returncode == 0, proc.stderr
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["total"] == 64 * MIB
    assert 63 * MIB <= seen["free"] <= 64 * MIB
    assert seen["before"] - seen["after"] == 8 * MIB  # read now, not remembered
    assert seen["bucket"] == 64
    assert "/dev/shm 64 MiB (6" in seen["line"]
    assert not os.path.exists("/dev/shm/autotune-test")  # the host's /dev/shm was never touched


def _spin_then_wait(cpu_s: float, spun: Any, leave: Any) -> None:
    end = time.process_time() + cpu_s
    while time.process_time() < end:
        pass
    spun.set()
    leave.wait(60)


@contextlib.contextmanager
def _child_spun(cpu_s: float) -> Iterator[Any]:
    """A forked child that ran ``cpu_s`` CPU seconds and waits, alive, until the block ends; then it
    ends and is joined."""
    ctx = multiprocessing.get_context("fork")
    spun, leave = ctx.Event(), ctx.Event()
    child = ctx.Process(target=_spin_then_wait, args=(cpu_s, spun, leave))
    child.start()
    try:
        assert spun.wait(60)
        yield child
    finally:
        leave.set()
        child.join(60)


def test_own_cpu_counts_living_and_ended_children() -> None:
    # What this process's own workers run is not others' load (NOTE [ Others' load ]): a child's CPU
    # seconds count while it lives and after it ended. Spun by CPU time, a busy machine only slows it;
    # the kernel counts in ticks of 10 ms, hence the margin.
    before = machine.own_cpu_seconds()
    with _child_spun(0.5) as child:
        assert child.is_alive()
        assert machine.own_cpu_seconds() - before >= 0.45
    assert machine.own_cpu_seconds() - before >= 0.45


def test_others_load_is_the_usable_cpus_busy_time_less_this_process_s() -> None:
    since = machine.CpuSnapshot(at=0.0, busy_s=100.0, own_s=10.0, cpus=2)
    now = machine.CpuSnapshot(at=10.0, busy_s=118.0, own_s=20.0, cpus=2)
    assert machine.others_load(since, now) == 0.4  # (18 - 10) CPU s over 10 s and 2 CPUs
    assert machine.others_load(since, dataclasses.replace(now, busy_s=105.0)) == 0.0  # never negative
    assert machine.others_load(since, dataclasses.replace(now, at=0.5)) is None  # too short to read
    assert machine.others_load(None, now) is None
    live = machine.cpu_snapshot()
    if sys.platform.startswith("linux"):
        assert live is not None and live.cpus == len(os.sched_getaffinity(0))


def test_loading_beside_the_step_is_the_workers_share_of_a_busy_machine() -> None:
    since = machine.CpuSnapshot(at=0.0, busy_s=100.0, own_s=10.0, cpus=2, main_s=8.0)
    now = machine.CpuSnapshot(at=10.0, busy_s=119.0, own_s=20.0, cpus=2, main_s=14.0)
    # 10 CPU s run by the process tree, 6 of them by the main process: 40 % by its workers, on CPUs
    # busy 95 % of the time (NOTE [ Loading beside the step ]).
    assert machine.loading_beside_step(since, now) == 0.4
    # CPUs busy 80 % of the time: the workers ran on CPUs the step did not want.
    assert machine.loading_beside_step(since, dataclasses.replace(now, busy_s=116.0)) == 0.0
    assert machine.loading_beside_step(since, dataclasses.replace(now, at=0.5)) is None
    assert machine.loading_beside_step(dataclasses.replace(since, main_s=None), now) is None
    # Read live: a child's CPU seconds are the tree's and not the main process's.
    before = machine.cpu_snapshot()
    with _child_spun(0.5):
        pass
    after = machine.cpu_snapshot()
    if before is not None and after is not None:
        assert before.main_s is not None and after.main_s is not None
        assert (after.own_s - before.own_s) - (after.main_s - before.main_s) >= 0.45
