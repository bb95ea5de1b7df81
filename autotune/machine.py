"""What this machine is: the facts the search space and the profile key are built from.

Inside a container the box is not the budget: see the NOTE [ Container limits ] below for how the
limits this process really runs under (CPU quota, memory limit, ``/dev/shm``) are read.
"""

from __future__ import annotations

import importlib.metadata
import math
import os
import platform
import re
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch

RAM_ROUND_BYTES = 1 << 30
"""RAM enters the fingerprint rounded to whole GiB, so a few MiB of firmware reserve never splits a key."""

MIB = 1 << 20

SHM_DIR = "/dev/shm"
"""Where POSIX shared memory lives on Linux, for both of torch's sharing strategies (see the NOTE)."""

UNLIMITED_BYTES = 1 << 60
"""A cgroup v1 memory limit this large means none: the kernel writes "no limit" as ~2**63 bytes."""

# NOTE [ Container limits ]
# A container shows the host's cores and RAM; what this process may use is less, and the search must
# be bounded by that, not by the box:
# - CPUs: the affinity mask (which covers cpusets, ``taskset`` and Kubernetes' static CPU manager)
#   and the CFS quota, cgroup v2 ``cpu.max`` ("50000 100000" = 0.5 CPU, "max ..." = none) or v1
#   ``cpu.cfs_quota_us / cpu.cfs_period_us`` (-1 = none). Usable CPUs = min(mask, ceil(quota)); the
#   fractional quota is kept beside it. A quota throttles, it does not pin: 4 workers under a quota of
#   1.5 all run, and all wait.
# - Memory: v2 ``memory.max`` (and ``memory.high``, past which the kernel throttles and reclaims), v1
#   ``memory.limit_in_bytes``. What is left = limit - (usage - inactive file cache), the working set
#   as Kubernetes counts it, since cold page cache is reclaimed before the OOM killer runs.
# - Every ancestor's limit binds too, so the process's own cgroup and each parent up to the root of
#   the mounted hierarchy are read: the quota and limit are the smallest found, the headroom the
#   smallest left at any level. The cgroup is found from /proc/self/cgroup and the mount of its
#   hierarchy from /proc/self/mountinfo, whose root field says which part of the hierarchy a
#   container sees (a container's own cgroup is mounted as the root of its /sys/fs/cgroup).
# - Shared memory: torch's ``file_descriptor`` strategy (the default) and ``file_system`` strategy
#   both create segments with glibc's ``shm_open``, that is as files ``/dev/shm/torch_<pid>_...``:
#   the first unlinks the name at once (the pages still count against /dev/shm while mapped), the
#   second keeps it until torch_shm_manager removes it. Either way a DataLoader's worker batches and a
#   shared cache are bounded by the free space of /dev/shm, 64 MiB under Docker's default. Its free
#   space changes by the moment: callers read it again (:func:`shm_free_bytes`) before they use it.
# Reading never fails: a missing file is no limit (a cgroup root has no ``cpu.max``), an unreadable
# file or a value that does not parse is also taken as no limit, and the reason is kept in ``notes``.


@dataclass(frozen=True)
class CgroupLimits:
    """The CPU and memory limits of this process's cgroups, as read from the cgroup filesystem.

    ``kind`` is the cgroup version the cpu and memory controllers are on: ``"v1"``, ``"v2"``,
    ``"mixed"`` (one on each) or ``"none"`` (no cgroups: not Linux, or nothing mounted).
    ``cpu_quota`` is in CPUs (1.5 = one and a half), ``None`` without a quota.
    ``memory_headroom_bytes`` is the least left under any limit right now, ``None`` without a limit.
    ``notes`` say which files could not be read or parsed (each was taken as no limit).
    """

    kind: str = "none"
    cpu_quota: float | None = None
    memory_limit_bytes: int | None = None
    memory_headroom_bytes: int | None = None
    notes: tuple[str, ...] = ()


@dataclass(frozen=True)
class SharedMemory:
    """Size and free space of the shared-memory filesystem at ``path``, read at one moment."""

    path: str
    total_bytes: int
    free_bytes: int


@dataclass(frozen=True)
class MachineInfo:
    """This machine, as far as DataLoader tuning cares.

    ``usable_cpus`` is what this *process* may run on: its affinity mask, bounded by the cgroup CPU
    quota rounded up (``cpu_quota`` keeps the fraction). Containers and ``taskset`` restrict it, and
    it is the budget workers compete for. ``memory_limit_bytes`` is the cgroup memory limit where it
    is below the machine's RAM; :attr:`memory_available_bytes` is what a cache may take now. The
    ``shm_*`` fields describe ``/dev/shm`` (``None`` where there is none), ``cgroup`` which cgroup
    version the limits came from, and ``limit_notes`` what could not be read (taken as no limit).
    """

    usable_cpus: int
    logical_cpus: int
    physical_cores: int | None
    cpu_model: str
    ram_total_bytes: int
    ram_available_bytes: int
    accelerator: str  # "cuda" or "none"
    accelerator_name: str | None
    accelerator_count: int
    accelerator_memory_bytes: int | None
    torch_version: str
    torchvision_version: str | None
    python_version: str
    os: str
    cgroup: str = "none"
    cpu_quota: float | None = None
    memory_limit_bytes: int | None = None
    memory_headroom_bytes: int | None = None
    shm_total_bytes: int | None = None
    shm_free_bytes: int | None = None
    limit_notes: tuple[str, ...] = ()

    @property
    def has_cuda(self) -> bool:
        return self.accelerator == "cuda"

    @property
    def memory_available_bytes(self) -> int:
        """RAM this process may still take: free RAM, or less where a cgroup limit leaves less."""
        if self.memory_headroom_bytes is None:
            return self.ram_available_bytes
        return min(self.ram_available_bytes, self.memory_headroom_bytes)

    def fingerprint(self) -> dict[str, Any]:
        """The stable facts that decide which configuration is fastest (no momentary readings).

        The machine half of a profile key (:func:`autotune.fingerprint.profile_key`). A CPU quota, a
        memory limit or a /dev/shm of another size make another machine; free amounts do not.
        """
        limit = self.memory_limit_bytes
        return {
            "cpu_model": self.cpu_model,
            "usable_cpus": self.usable_cpus,
            "physical_cores": self.physical_cores,
            "ram_gib": round(self.ram_total_bytes / RAM_ROUND_BYTES),
            "cpu_quota": None if self.cpu_quota is None else round(self.cpu_quota, 2),
            "memory_limit_gib": None if limit is None else round(limit / RAM_ROUND_BYTES),
            "shm_mib": shm_size_bucket_mib(self.shm_total_bytes),
            "accelerator": self.accelerator,
            "accelerator_name": self.accelerator_name,
            "accelerator_count": self.accelerator_count,
            "torch": self.torch_version,
            "torchvision": self.torchvision_version,
            "os": self.os,
        }

    def limits_line(self) -> str:
        """One line for a person: "2 CPUs usable (cgroup quota 1.5), memory limit 2.0 GiB (...), ..."."""
        line = _limits_text(
            self.usable_cpus, self.logical_cpus, self.cpu_quota, self.memory_limit_bytes,
            self.shm_total_bytes, free=(self.memory_available_bytes, self.shm_free_bytes),
        )
        if self.limit_notes:
            line += f"; {len(self.limit_notes)} limit file(s) unreadable, taken as none"
        return line

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def fingerprint_limits(fingerprint: dict[str, Any]) -> str:
    """The limits a profile was tuned under, from its machine fingerprint (:meth:`MachineInfo.fingerprint`):
    :meth:`MachineInfo.limits_line` without the momentary free amounts, which it does not keep."""
    cpus = int(fingerprint.get("usable_cpus") or 1)
    limit = fingerprint.get("memory_limit_gib")
    shm = fingerprint.get("shm_mib")
    return _limits_text(cpus, cpus, fingerprint.get("cpu_quota"),
                        None if limit is None else int(limit) * RAM_ROUND_BYTES,
                        None if shm is None else int(shm) * MIB)


def _limits_text(usable: int, logical: int, quota: float | None, memory_limit: int | None,
                 shm_total: int | None, *, free: tuple[int, int | None] | None = None) -> str:
    """CPUs, memory and /dev/shm in one line; with ``free`` (memory, /dev/shm), what is free of each."""
    cpus = f"{usable} CPU{'' if usable == 1 else 's'} usable"
    if usable < logical:
        cpus = f"{usable} of {logical} CPUs usable"
    if quota is not None:
        cpus += f" (cgroup quota {_fmt_quota(quota)})"
    memory_free = f" ({format_bytes(free[0])} available)" if free is not None else ""
    if memory_limit is None:
        memory = f"no memory limit{memory_free}"
    else:
        memory = f"memory limit {format_bytes(memory_limit)}{memory_free}"
    if shm_total is None:
        shm = f"no {SHM_DIR}"
    else:
        shm = f"{SHM_DIR} {format_bytes(shm_total)}"
        if free is not None and free[1] is not None:
            shm += f" ({format_bytes(free[1])} free)"
    return f"{cpus}, {memory}, {shm}"


def _fmt_quota(quota: float) -> str:
    text = f"{quota:.2f}".rstrip("0")  # 1.0, 1.5, 0.25
    return text + "0" if text.endswith(".") else text


def format_bytes(n: int) -> str:
    """``64 MiB``, ``2.0 GiB``: whole MiB below a GiB, GiB to one decimal from there."""
    if n < RAM_ROUND_BYTES:
        return f"{n // MIB} MiB"
    return f"{n / RAM_ROUND_BYTES:.1f} GiB"


def shm_size_bucket_mib(total_bytes: int | None) -> int | None:
    """The size of /dev/shm for the fingerprint: the nearest power of two in MiB (64, 8192, ...).

    Configured sizes are round (64m, 1g, 8g) and the default is half the RAM: a power of two keeps a
    small /dev/shm apart from a large one without splitting keys over a few MiB.
    """
    if not total_bytes or total_bytes < MIB:
        return None if total_bytes is None else 0
    return 1 << round(math.log2(total_bytes / MIB))


# --------------------------------------------------------------------------------------------------
# cgroups


def _path(root: str, path: str) -> str:
    """``path`` (absolute, as the kernel names it) inside the tree at ``root``."""
    return os.path.join(root, path.lstrip("/"))


def _read_text(path: str, notes: list[str]) -> str | None:
    """A small file's text; ``None`` if it is missing (normal) or unreadable (noted)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as fh:
            return fh.read().strip()
    except FileNotFoundError:
        return None
    except OSError as err:
        notes.append(f"cannot read {path}: {err.strerror or err}; taken as no limit")
        return None


def _read_int(path: str, notes: list[str], *, none: str = "") -> int | None:
    """A number from a small file; ``None`` if missing, unreadable, garbled (noted) or ``none``."""
    text = _read_text(path, notes)
    if text is None or (none and text == none):
        return None
    try:
        return int(text)
    except ValueError:
        notes.append(f"{path} holds {text[:40]!r}, not a number; taken as no limit")
        return None


def _unescape(field: str) -> str:
    # mountinfo writes space, tab, newline and backslash in paths as octal escapes (\040 ...).
    return re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), field)


def _own_cgroups(root: str, notes: list[str]) -> dict[str, str]:
    """This process's cgroup per controller ("cpu", "memory"; "" for the v2 unified hierarchy)."""
    text = _read_text(_path(root, "/proc/self/cgroup"), notes)
    paths: dict[str, str] = {}
    for line in (text or "").splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if parts[0] == "0" and not controllers:
            paths[""] = path
        for name in controllers.split(","):
            if name:
                paths[name] = path
    return paths


def _cgroup_mounts(root: str, notes: list[str]) -> list[tuple[str, str, str, set[str]]]:
    """(fstype, root in the hierarchy, mount point, controllers) of every cgroup mount."""
    text = _read_text(_path(root, "/proc/self/mountinfo"), notes)
    mounts = []
    for line in (text or "").splitlines():
        pre, sep, post = line.partition(" - ")
        fields, tail = pre.split(), post.split()
        if not sep or len(fields) < 5 or len(tail) < 3 or tail[0] not in ("cgroup", "cgroup2"):
            continue
        controllers = set(tail[2].split(",")) if tail[0] == "cgroup" else set()
        mounts.append((tail[0], _unescape(fields[3]), _unescape(fields[4]), controllers))
    return mounts


def _hierarchy(
    root: str, controller: str, own: dict[str, str], mounts: list[tuple[str, str, str, set[str]]],
) -> tuple[str, list[str]]:
    """(version, this process's cgroup folder and each parent up to the mount) for ``controller``.

    The controller's v1 hierarchy if it has one, else the v2 unified hierarchy; ``("none", [])``
    when neither is mounted.
    """
    v1 = [m for m in mounts if m[0] == "cgroup" and controller in m[3]]
    v2 = [m for m in mounts if m[0] == "cgroup2"]
    if v1 and controller in own:
        version, candidates, path = "v1", v1, own[controller]
    elif v2 and "" in own:
        version, candidates, path = "v2", v2, own[""]
    else:
        return "none", []
    top, relative = _locate(path, candidates)
    top = _path(root, top)
    here = _path(top, relative)
    return version, list(_up_to(os.path.normpath(here), os.path.normpath(top)))


def _locate(path: str, mounts: list[tuple[str, str, str, set[str]]]) -> tuple[str, str]:
    """(mount point, path below it) of the cgroup ``path``, preferring a mount whose root holds it.

    A container sees its own cgroup mounted as the root (mountinfo's root field is
    ``/docker/<id>``); a path outside every mount (``/../..`` under a cgroup namespace) is read at
    the mount point, the nearest folder this process can see.
    """
    for _, mount_root, mount_point, _ in mounts:
        base = mount_root.rstrip("/")
        if path == mount_root or path.startswith(base + "/"):
            below = path[len(base):]
            return mount_point, "/" if below.startswith("/..") else below
    return mounts[0][2], "/"


def _up_to(folder: str, top: str) -> Iterator[str]:
    """``folder``, its parent, ... up to and including ``top``."""
    while True:
        yield folder
        if folder == top or not folder.startswith(top):
            return
        folder = os.path.dirname(folder)


def _cpu_quota(version: str, folder: str, notes: list[str]) -> float | None:
    if version == "v2":
        text = _read_text(os.path.join(folder, "cpu.max"), notes)
        if text is None or text.startswith("max"):
            return None
        fields = text.split()
        if len(fields) > 2 or not all(f.lstrip("-").isdigit() for f in fields):
            notes.append(f"{os.path.join(folder, 'cpu.max')} holds {text[:40]!r}; taken as no limit")
            return None
        quota, period = int(fields[0]), int(fields[1]) if len(fields) == 2 else 100_000
    else:
        v1_quota = _read_int(os.path.join(folder, "cpu.cfs_quota_us"), notes)
        v1_period = _read_int(os.path.join(folder, "cpu.cfs_period_us"), notes)
        if v1_quota is None or v1_period is None or v1_quota == -1:
            return None
        quota, period = v1_quota, v1_period
    if quota <= 0 or period <= 0:
        notes.append(f"{folder}: CPU quota {quota}/{period} is not positive; taken as no limit")
        return None
    return quota / period


def _memory(version: str, folder: str, notes: list[str]) -> tuple[int | None, int | None]:
    """(limit, headroom) of one cgroup folder: ``(None, None)`` without a limit."""
    if version == "v2":
        limits = [_read_bytes(os.path.join(folder, name), notes) for name in ("memory.max", "memory.high")]
        usage = _read_int(os.path.join(folder, "memory.current"), notes)
        cache_key = "inactive_file"
    else:
        limits = [_read_bytes(os.path.join(folder, "memory.limit_in_bytes"), notes)]
        usage = _read_int(os.path.join(folder, "memory.usage_in_bytes"), notes)
        cache_key = "total_inactive_file"
    found = [n for n in limits if n is not None]
    if not found:
        return None, None
    limit = min(found)
    if usage is None:
        return limit, limit
    cold = _stat_field(os.path.join(folder, "memory.stat"), cache_key, notes)
    return limit, max(0, limit - max(0, usage - cold))


def _read_bytes(path: str, notes: list[str]) -> int | None:
    """A memory limit in bytes, ``None`` for "max", a missing file or the v1 sentinel for none."""
    value = _read_int(path, notes, none="max")
    if value is None or value < 0 or value >= UNLIMITED_BYTES:
        return None
    return value


def _stat_field(path: str, key: str, notes: list[str]) -> int:
    for line in (_read_text(path, notes) or "").splitlines():
        name, _, value = line.partition(" ")
        if name == key and value.strip().isdigit():
            return int(value)
    return 0


def own_cgroup(controller: str, root: str = "/") -> tuple[str, str] | None:
    """(cgroup version, folder) of this process's own cgroup for ``controller`` ("cpu", "memory"), or
    ``None`` where that controller is not mounted: where a child cgroup with a limit can be made."""
    notes: list[str] = []
    version, folders = _hierarchy(root, controller, _own_cgroups(root, notes), _cgroup_mounts(root, notes))
    return (version, folders[0]) if folders else None


def read_cgroup_limits(root: str = "/") -> CgroupLimits:
    """The CPU quota and memory limit of this process's cgroup and its parents. Never raises.

    ``root`` is where the filesystem tree is read from (``/proc/self/...``, the cgroup mounts): the
    real one by default, a fixture tree in tests. See the NOTE [ Container limits ].
    """
    notes: list[str] = []
    own, mounts = _own_cgroups(root, notes), _cgroup_mounts(root, notes)
    cpu_version, cpu_folders = _hierarchy(root, "cpu", own, mounts)
    mem_version, mem_folders = _hierarchy(root, "memory", own, mounts)
    quotas = [q for q in (_cpu_quota(cpu_version, f, notes) for f in cpu_folders) if q is not None]
    levels = [_memory(mem_version, f, notes) for f in mem_folders]
    limits = [limit for limit, _ in levels if limit is not None]
    headrooms = [room for _, room in levels if room is not None]
    versions = {v for v in (cpu_version, mem_version) if v != "none"}
    kind = versions.pop() if len(versions) == 1 else ("mixed" if versions else "none")
    return CgroupLimits(
        kind=kind,
        cpu_quota=min(quotas) if quotas else None,
        memory_limit_bytes=min(limits) if limits else None,
        memory_headroom_bytes=min(headrooms) if headrooms else None,
        notes=tuple(dict.fromkeys(notes)),
    )


# --------------------------------------------------------------------------------------------------
# Readings


def _affinity_cpus() -> int:
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _bounded(cpus: int, quota: float | None) -> int:
    return cpus if quota is None else max(1, min(cpus, math.ceil(quota)))


def usable_cpu_count(root: str = "/") -> int:
    """CPUs this process may use: its affinity mask, bounded by its cgroup CPU quota rounded up."""
    return _bounded(_affinity_cpus(), read_cgroup_limits(root).cpu_quota)


def memory_available_bytes(root: str = "/") -> int:
    """RAM this process may take now: free RAM, or the least any cgroup limit leaves, if smaller."""
    headroom = read_cgroup_limits(root).memory_headroom_bytes
    available = int(psutil.virtual_memory().available)
    return available if headroom is None else min(available, headroom)


def read_shm(root: str = "/") -> SharedMemory | None:
    """Size and free space of ``/dev/shm`` now; ``None`` where there is none (macOS, Windows)."""
    path = _path(root, SHM_DIR)
    try:
        st = os.statvfs(path)
    except (OSError, AttributeError):
        return None
    return SharedMemory(path, total_bytes=st.f_blocks * st.f_frsize, free_bytes=st.f_bavail * st.f_frsize)


def shm_free_bytes(root: str = "/") -> int | None:
    """Free bytes of ``/dev/shm`` this moment: read it again right before building anything shared."""
    shm = read_shm(root)
    return None if shm is None else shm.free_bytes


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _torchvision_version() -> str | None:
    # The installed distribution's version: importing torchvision itself takes seconds.
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        return None


def detect_machine(*, root: str = "/") -> MachineInfo:
    """Read the machine now. Cheap (a few ms): safe to call on every ``tune_loader`` call.

    ``root`` is where the cgroup and /dev/shm readings come from (a fixture tree in tests).
    """
    mem = psutil.virtual_memory()
    has_cuda = torch.cuda.is_available()
    name = None
    count = 0
    gpu_mem = None
    if has_cuda:
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        name = props.name
        gpu_mem = int(props.total_memory)
    limits = read_cgroup_limits(root)
    shm = read_shm(root)
    # A limit at or above the RAM bounds nothing: no limit, for the budget and the fingerprint alike.
    memory_limit = limits.memory_limit_bytes
    if memory_limit is not None and memory_limit >= mem.total:
        memory_limit = None
    return MachineInfo(
        usable_cpus=_bounded(_affinity_cpus(), limits.cpu_quota),
        logical_cpus=os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        cpu_model=_cpu_model(),
        ram_total_bytes=int(mem.total),
        ram_available_bytes=int(mem.available),
        accelerator="cuda" if has_cuda else "none",
        accelerator_name=name,
        accelerator_count=count,
        accelerator_memory_bytes=gpu_mem,
        torch_version=str(torch.__version__),
        torchvision_version=_torchvision_version(),
        python_version=platform.python_version(),
        os=f"{platform.system()} {platform.release()}",
        cgroup=limits.kind,
        cpu_quota=limits.cpu_quota,
        memory_limit_bytes=memory_limit,
        memory_headroom_bytes=limits.memory_headroom_bytes,
        shm_total_bytes=None if shm is None else shm.total_bytes,
        shm_free_bytes=None if shm is None else shm.free_bytes,
        limit_notes=limits.notes,
    )


# NOTE [ Others' load ]
# The load a choice was measured under is the work other processes ran on the CPUs this process may
# use, not the load average: that counts this process too (a training run keeps its CPUs busy, and a
# profile stored at its end said "1.0 per CPU" of a machine nobody else used), and for a minute after
# it ends, the run before (the next run, starting on an idle machine, saw a "change" and measured its
# choice again). Over a window: the busy CPU seconds of the usable CPUs (all processes; time stolen by
# a hypervisor counts as busy) less the CPU seconds this process and its descendants ran, living and
# ended, per usable CPU and second of the window. 0: nobody else; 1: others keep every usable CPU busy.
# Live children are found through /proc/<pid>/task/<tid>/children, not by reading every process on the
# machine (NOTE [ A watchdog beside a busy step ] in supervise.py says what that scan can cost).

MIN_LOAD_WINDOW_S = 1.0
"""Others' load is read over at least this long a window: CPU times tick every 10 ms."""


@dataclass(frozen=True)
class CpuSnapshot:
    """The CPU seconds run by the usable CPUs (``busy_s``) and by this process with its descendants
    (``own_s``) at monotonic time ``at``: two of them give others' load (NOTE [ Others' load ])."""

    at: float
    busy_s: float
    own_s: float
    cpus: int
    main_s: float | None = None
    """CPU seconds run by this process alone (its threads, not its children): NOTE [ Loading beside
    the step ]."""


def _busy_seconds(times: Any) -> float:
    return sum(getattr(times, k, 0.0) for k in ("user", "nice", "system", "irq", "softirq", "steal"))


def _live_children(pid: int) -> list[int]:
    """The children of ``pid`` from its tasks' ``children`` files (Linux); none where they are not."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                out.extend(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return out


def own_cpu_seconds() -> float:
    """CPU seconds run by this process and its descendants so far, ended descendants included."""
    return _tree_cpu_seconds()[0]


def _tree_cpu_seconds() -> tuple[float, float]:
    """(``own_cpu_seconds``, the CPU seconds of this process alone), from one reading of each."""
    me = os.getpid()
    total, main, todo, seen = 0.0, 0.0, [me], set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        try:
            t = psutil.Process(pid).cpu_times()
        except psutil.Error:
            continue
        if pid == me:
            main = t.user + t.system
        total += t.user + t.system + getattr(t, "children_user", 0.0) + getattr(t, "children_system", 0.0)
        todo.extend(_live_children(pid))
    return total, main


def cpu_snapshot() -> CpuSnapshot | None:
    """The CPU times now (NOTE [ Others' load ]); ``None`` where the OS does not give them."""
    try:
        cpus = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None
        if cpus is not None:
            per_cpu = psutil.cpu_times(percpu=True)
            busy = sum(_busy_seconds(per_cpu[i]) for i in cpus if i < len(per_cpu))
        else:
            busy = _busy_seconds(psutil.cpu_times())
        count = len(cpus) if cpus is not None else (os.cpu_count() or 1)
        own, main = _tree_cpu_seconds()
        return CpuSnapshot(time.monotonic(), busy, own, max(1, count), main)
    except (OSError, psutil.Error, AttributeError):
        return None


def others_load(since: CpuSnapshot | None, now: CpuSnapshot | None = None) -> float | None:
    """The work other processes ran per usable CPU from ``since`` to ``now`` (default: this moment),
    rounded to 0.01 (NOTE [ Others' load ]); ``None`` over a window under MIN_LOAD_WINDOW_S or
    without readings."""
    now = now if now is not None else cpu_snapshot()
    if since is None or now is None or now.at - since.at < MIN_LOAD_WINDOW_S:
        return None
    others = (now.busy_s - since.busy_s) - (now.own_s - since.own_s)
    return round(max(0.0, others / (now.at - since.at) / since.cpus), 2)


# NOTE [ Loading beside the step ]
# The share of the time a loop waits for data bounds what a faster loader can win only where the
# loader's workers have CPUs of their own. Where the usable CPUs are all busy (a core taken by another
# job on a 2-CPU machine, say), the workers' decoding takes CPU time the step would otherwise run on:
# the step hardly waits, yet every step is slower by what the workers take. Over a stretch this is
# the share of this process tree's CPU seconds run outside the main process (its worker processes,
# living and ended) while the usable CPUs were busy at least SATURATED of the time; 0 where they were
# not (the workers then ran on CPUs the step did not want). A ram cache removes that work, and it is
# what the search tries there (NOTE [ Online search ] 2 in online.py).

SATURATED = 0.9
"""Usable CPUs busy this share of a window or more: whatever runs there competes for them."""


def loading_beside_step(since: CpuSnapshot | None, now: CpuSnapshot | None) -> float | None:
    """The share of this process tree's CPU run by its workers while every usable CPU was busy, 0
    where the CPUs were not, rounded to 0.01 (NOTE [ Loading beside the step ]); ``None`` over a
    window under MIN_LOAD_WINDOW_S or without readings."""
    if (since is None or now is None or since.main_s is None or now.main_s is None
            or now.at - since.at < MIN_LOAD_WINDOW_S):
        return None
    own = now.own_s - since.own_s
    if own <= 0:
        return None
    if (now.busy_s - since.busy_s) / (now.at - since.at) / since.cpus < SATURATED:
        return 0.0
    workers = max(0.0, own - (now.main_s - since.main_s))
    return round(min(1.0, workers / own), 2)
