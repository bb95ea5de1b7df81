"""A ``ram`` cache that outlives the process: one file per cache, mapped by every process on the node.

# NOTE [ Node caches ]
# A cache filled by the loading pass (NOTE [ Filling caches ]) keeps its fields, flags and ragged
# bookkeeping in one file that every process on the node maps, so the next run on the same data,
# and the other ranks of this one, read what is already there and fill only the rest.
# 1. Key: a digest of what the cache froze, as the staleness check fingerprints it (the transform's
#    frozen steps and their parameters, the dataset's code, class and instance attributes, the files
#    it lists by size and modification time), of the probe samples' bytes through the prefix, the
#    length and layout, and the versions of autotune and of the libraries that decode (torch,
#    torchvision, PIL, NumPy). Tensors and arrays the dataset holds are hashed whole (up to
#    KEY_HASH_BYTES each; past it, an even sample of their elements, as the staleness check compares
#    them). Code is hashed by its bytecode, constants and names. Two datasets that differ in length,
#    in a probe, or in the code or parameters of what the cache froze never share a key; a changed
#    dataset gets a new key, so a stale file is never read, and the file of the same dataset's
#    earlier key is removed (``lineage``: the dataset's class and folder, for datasets read from
#    files). A file is made only after its maker proved the filling wrapper on these probes, so a
#    process that finds one needs no proof of its own.
# 2. Place: a folder in /dev/shm (tmpfs: memory, no writeback), else, where /dev/shm cannot spare it,
#    a folder under the profile cache directory (a file on disk, read through the page cache).
#    Chosen by measurement (benchmarks/scripts/node.py, "Where a cache lives", a CIFAR-10-sized
#    cache): a file in /dev/shm fills as fast as torch's anonymous shared memory; a file on disk
#    fills slower and unevenly, as the writeback of its pages (and of the last one's) competes, and
#    writes the whole cache to the disk; a new process reads either at memory speed. The disk folder
#    is the fallback for containers whose /dev/shm is 64 MiB, where it still spares every process
#    the refill.
#    A file on disk is kept only for the boot it was made in: pages written back out of order by a
#    crash could leave a flag without its data, so a file from another boot is removed.
# 3. Layout of a file: a header (MAGIC, then JSON: key, boot, regions, what was cached), then each
#    region page-aligned. A file is made under a temporary name, reserved whole with posix_fallocate
#    (so that a full /dev/shm fails here, never with SIGBUS in a write), its header written, and
#    linked to its name (``os.link``: of two processes making one key, one wins, the other opens
#    the winner's). Torch maps the regions through ``UntypedStorage._new_shared_fd_cpu``: shared
#    storages that forked workers inherit and spawned ones receive as file descriptors.
# 4. Writers: a sample's data, a memory fence, then its flag (NOTE [ Filling caches ] 3); a process
#    killed with SIGKILL in mid-fill leaves the flag unset, and the sample is written again by the
#    next loader of it. The ragged space is reserved under ``NodeLock``: flock on a lock file beside
#    the cache (the kernel releases it when its holder dies) plus a thread lock in the process.
# 5. In use: each process that maps a cache holds a shared flock on it; eviction and stale removal
#    take only files no process holds. Budget per folder: NODE_FRACTION of the smaller of its size
#    (/dev/shm) or free disk and the memory limit (RAM, or the cgroup's); the least recently used
#    caches are evicted whole to make room. A new cache goes to /dev/shm only within the share of its
#    free space a private cache may take there (CACHE_SHM_FRACTION, NOTE [ Shared memory ] 4).
#    Where there is none, or the folder cannot be written (read-only, full), the cache is private
#    to the process, as before, with one warning.
# 6. Orphans: a folder in /dev/shm is named for its profile cache directory and names it in an OWNER
#    file. Runs made from a temporary profile directory (a benchmark's, a test harness's) delete it
#    when they end, and their caches would stay in memory until the machine restarts: dozens of
#    such runs left 19 GB of a 24 GB machine's RAM in /dev/shm. So before a new cache is made, the
#    folders of this user whose owner is gone lose the caches no process maps (``sweep_orphans``).
# AUTOTUNE_NODE_CACHE=off keeps every cache private.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import json
import logging
import os
import re
import shutil
import sys
import threading
import time
import types
import warnings
import weakref
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import PIL
import psutil
import torch
from PIL import Image

from ..exceptions import AutotuneWarning
from ..machine import SHM_DIR, read_cgroup_limits, shm_free_bytes
from ..profiles import resolve_cache_dir
from ..shm import CACHE_SHM_FRACTION
from .fresh import Part, _Ref

log = logging.getLogger("autotune.pretransform")

NODE_CACHE_ENV = "AUTOTUNE_NODE_CACHE"
"""``off`` keeps every cache private to its process."""

NODE_DIR_ENV = "AUTOTUNE_NODE_CACHE_DIR"
"""One folder for every node cache, in place of the defaults (NOTE [ Node caches ] 2)."""

MAGIC = b"ATNODE01"
SCHEMA = 1
HEADER_BYTES = 1 << 16
"""Bytes at the start of a file for its header (the JSON region table)."""
ALIGN = 4096
SUFFIX = ".cache"
LOCK_SUFFIX = ".lock"
TMP_PREFIX = ".tmp-"
OWNER = "OWNER"
"""In a folder in /dev/shm: the profile cache directory it belongs to (NOTE [ Node caches ] 6)."""

NODE_FRACTION = 0.5
"""Node caches of one folder take at most this share of its space and of the memory limit."""

KEY_HASH_BYTES = 1 << 30
"""A tensor or array of the dataset up to this size is hashed whole for the key."""

STALE_TMP_S = 3600.0
"""A temporary file older than this was left by a killed maker; listing removes it."""

_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64, torch.float16, torch.bfloat16,
    torch.float32, torch.float64, torch.bool, torch.complex64, torch.complex128)}


class NodeCacheWarning(AutotuneWarning):
    """A node cache could not be used; the cache is private to this process instead."""


_warned: set[str] = set()


def _warn_once(what: str, message: str) -> None:
    if what not in _warned:
        _warned.add(what)
        warnings.warn(message, NodeCacheWarning, stacklevel=4)


def enabled() -> bool:
    return os.environ.get(NODE_CACHE_ENV, "").strip().lower() not in ("off", "0", "false", "no")


def folders(cache_dir: str | os.PathLike[str] | None = None) -> list[Path]:
    """Where node caches live, in order of preference: a folder in /dev/shm named for the profile
    cache directory (so that two cache directories never share caches), and one under it; or the one
    folder ``AUTOTUNE_NODE_CACHE_DIR`` names."""
    chosen = os.environ.get(NODE_DIR_ENV, "")
    if chosen:
        return [Path(chosen).expanduser().absolute()]
    base = resolve_cache_dir(cache_dir)
    tag = hashlib.sha256(str(base).encode()).hexdigest()[:12]
    out = []
    if os.path.isdir(SHM_DIR):
        out.append(Path(SHM_DIR) / f"{_shm_prefix()}{tag}")
    out.append(base / "node-caches")
    return out


def _shm_prefix() -> str:
    """How this user's folders in /dev/shm are named, before their tag."""
    return f"autotune-{os.getuid() if hasattr(os, 'getuid') else 0}-"


def sweep_orphans() -> list[str]:
    """Remove the caches no process maps from this user's folders in /dev/shm whose profile cache
    directory is gone, and the folders left empty (NOTE [ Node caches ] 6). Returns the caches
    removed."""
    removed: list[str] = []
    try:
        names = [n for n in os.listdir(SHM_DIR) if n.startswith(_shm_prefix())]
    except OSError:
        return removed
    for name in names:
        folder = Path(SHM_DIR) / name
        try:
            owner = (folder / OWNER).read_text().strip()
        except OSError:
            continue  # no owner named (made before owners were): whose it is cannot be told
        if not owner or os.path.exists(owner):
            continue
        for entry in entries_in(folder):
            if _remove_unused(Path(entry.path), f"its profile cache directory {owner} is gone"):
                removed.append(entry.path)
        with contextlib.suppress(OSError):
            if not any(n.endswith(SUFFIX) or n.startswith(TMP_PREFIX) for n in os.listdir(folder)):
                shutil.rmtree(folder, ignore_errors=True)
    return removed


def boot_id() -> str:
    with contextlib.suppress(OSError):
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()
    return "unknown"


# -------------------------------------------------------------------------------------------- key


def key_of(plan: Any, dataset: Any) -> str:
    """The digest naming ``plan``'s cache of ``dataset`` (NOTE [ Node caches ] 1)."""
    h = hashlib.sha256()
    _feed(h, ("schema", SCHEMA, _version("autotune"), torch.__version__, _version("torchvision"),
              PIL.__version__, np.__version__))
    _feed(h, (type(dataset).__module__, type(dataset).__qualname__, plan.length, plan.field))
    _feed(h, tuple((kind, shape, str(dtype)) for kind, shape, dtype in plan.layout))
    _feed(h, tuple(_step_text(step) for step in plan.prefix))
    for sample in plan.probe:
        _feed_sample(h, sample)
    _feed(h, plan.fingerprint)
    return h.hexdigest()[:40]


def lineage_of(dataset: Any) -> str | None:
    """The dataset's class and folder, for a dataset read from files: a new key of the same lineage
    means the dataset changed, and its earlier file is stale. None for data held in memory."""
    root = getattr(dataset, "root", None)
    if not isinstance(root, (str, os.PathLike)):
        return None
    text = f"{type(dataset).__module__}.{type(dataset).__qualname__}:{os.path.abspath(os.fspath(root))}"
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _version(name: str) -> str:
    return str(getattr(sys.modules.get(name), "__version__", ""))


_ADDRESS = re.compile(r" at 0x[0-9a-fA-F]+")


def _step_text(step: Any) -> str:
    return f"{type(step).__module__}.{type(step).__qualname__}:{_ADDRESS.sub('', repr(step))}"


def _feed_sample(h: Any, sample: Any) -> None:
    for value in (sample if isinstance(sample, (tuple, list)) else [sample]):
        if isinstance(value, torch.Tensor):
            t = value.detach().cpu().contiguous()
            _feed(h, ("tensor", tuple(t.shape), str(t.dtype)))
            h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
        elif isinstance(value, Image.Image):
            _feed(h, ("image", value.mode, value.size))
            h.update(value.tobytes())
        elif isinstance(value, np.ndarray):
            _feed(h, ("ndarray", value.shape, value.dtype.str))
            h.update(np.ascontiguousarray(value).tobytes())
        else:
            _feed(h, ("value", repr(value)))


_PLAIN = (bool, int, str, bytes, type(None))


def _feed(h: Any, value: Any) -> None:
    """Hash a snapshot (fresh.Snapshot's values, Parts) the same way in every process."""
    if isinstance(value, tuple) and all(type(v) in _PLAIN for v in value):
        h.update(f"plain:{value!r};".encode())  # labels, paths: one repr, not an update per item
    elif value is None or isinstance(value, (bool, int, str, complex, range)):
        h.update(f"{type(value).__name__}:{value!r};".encode())
    elif isinstance(value, float):
        h.update(f"float:{value.hex()};".encode())
    elif isinstance(value, bytes):
        h.update(b"bytes:%d;" % len(value) + value)
    elif isinstance(value, Part):
        _feed(h, ("part", value.label, tuple((name, snap) for name, snap, _ in value.attrs)))
    elif isinstance(value, (tuple, list)):
        h.update(b"(")
        for v in value:
            _feed(h, v)
        h.update(b")")
    elif isinstance(value, dict):
        _feed(h, tuple(sorted((repr(k), v) for k, v in value.items())))
    elif isinstance(value, _Ref):
        _feed_ref(h, value.obj)
    else:
        h.update(f"{type(value).__qualname__}:{_ADDRESS.sub('', repr(value))};".encode())


def _feed_ref(h: Any, obj: Any) -> None:
    if isinstance(obj, types.CodeType):
        _feed(h, ("code", obj.co_qualname, obj.co_code, obj.co_names, obj.co_varnames,
                  tuple(c if not isinstance(c, (frozenset, set)) else tuple(sorted(map(repr, c)))
                        for c in obj.co_consts)))
    elif isinstance(obj, types.ModuleType):
        _feed(h, ("module", obj.__name__))
    elif isinstance(obj, torch.Tensor):
        t = obj.detach()
        _feed(h, ("tensor", tuple(t.shape), str(t.dtype), t.device.type))
        whole = t.device.type == "cpu" and t.layout == torch.strided
        if whole and t.numel() * t.element_size() <= KEY_HASH_BYTES:
            h.update(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    elif isinstance(obj, np.ndarray):
        _feed(h, ("ndarray", obj.shape, obj.dtype.str))
        if not obj.dtype.hasobject and obj.nbytes <= KEY_HASH_BYTES:
            h.update(np.ascontiguousarray(obj).view(np.uint8).reshape(-1).data)
    else:
        kind = obj if isinstance(obj, type) else type(obj)
        name = getattr(obj, "__qualname__", None) if callable(obj) else None
        _feed(h, ("ref", kind.__module__, kind.__qualname__, name))


# ----------------------------------------------------------------------------------------- regions


@dataclass(frozen=True)
class Region:
    name: str
    offset: int
    numel: int
    dtype: str


Spec = tuple[str, int, torch.dtype]
"""(name, elements, dtype) of one region a cache asks for."""


def _layout(specs: Sequence[Spec]) -> tuple[list[Region], int]:
    regions, offset = [], HEADER_BYTES
    for name, numel, dtype in specs:
        size = max(1, numel) * torch.empty((), dtype=dtype).element_size()
        regions.append(Region(name, offset, numel, str(dtype).removeprefix("torch.")))
        offset += -(-size // ALIGN) * ALIGN
    return regions, offset


def _map(fd: int, size: int) -> torch.UntypedStorage:
    # torch's own mapping of a shared file by descriptor, as its worker processes receive storages:
    # it keeps a duplicate of ``fd`` and is pickled to spawned processes as one.
    return torch.UntypedStorage._new_shared_fd_cpu(fd, size)  # type: ignore[attr-defined]


def _views(storage: torch.UntypedStorage, regions: Iterable[Region]) -> dict[str, torch.Tensor]:
    whole = torch.empty(0, dtype=torch.uint8).set_(storage)
    out = {}
    for r in regions:
        dtype = _DTYPES[r.dtype]
        size = max(1, r.numel) * torch.empty((), dtype=dtype).element_size()
        out[r.name] = whole[r.offset : r.offset + size].view(dtype)[: r.numel]
    return out


# ------------------------------------------------------------------------------------------- lock


class NodeLock:
    """The ragged allocation lock of a node cache: flock on a file (released by the kernel when its
    holder dies) and a thread lock, so that threads of one process exclude each other too. Pickled,
    it is its path. Each process opens its own descriptor (a forked child sharing its parent's open
    file would share its flock): a child forgets its parent's at the fork."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._reset()
        _locks.add(self)

    def _reset(self) -> None:
        self._fd = -1
        self._thread = threading.Lock()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"])  # type: ignore[misc]

    def acquire(self, timeout: float = -1) -> bool:
        deadline = time.monotonic() + (timeout if timeout >= 0 else 1e9)
        if not self._thread.acquire(timeout=timeout):
            return False
        try:  # under the thread lock: one descriptor per process, locked by one thread at a time
            if self._fd < 0:
                self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
            while True:
                try:
                    fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    return True
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        break
                    time.sleep(0.0005)
        except OSError:
            pass
        self._thread.release()
        return False

    def release(self) -> None:
        with contextlib.suppress(OSError):
            fcntl.flock(self._fd, fcntl.LOCK_UN)
        self._thread.release()


_locks: weakref.WeakSet[NodeLock] = weakref.WeakSet()


def _forget_parents_locks() -> None:
    for lock in list(_locks):
        if lock._fd >= 0:
            with contextlib.suppress(OSError):
                os.close(lock._fd)
        lock._reset()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_parents_locks)


# ------------------------------------------------------------------------------------------- file


@dataclass
class NodeFile:
    """One mapped node cache: its path, tensors per region, and whether this process made it."""

    path: str
    key: str
    tensors: dict[str, torch.Tensor]
    created: bool
    lock: NodeLock

    def __getstate__(self) -> dict[str, Any]:
        # A copy for another process: the paths; the tensors travel in the cache's own fields.
        return {"path": self.path, "key": self.key, "tensors": {}, "created": False, "lock": self.lock}


def exists(key: str, cache_dir: Any = None) -> bool:
    """Whether a node cache of ``key`` is on the node (made, whatever its fill)."""
    return enabled() and any(read_header(_path(f, key)) is not None for f in folders(cache_dir))


def place(
    key: str, specs: Sequence[Spec], *, lineage: str | None, detail: str, cache_dir: Any = None,
    variable: Iterable[str] = (),
) -> NodeFile | None:
    """The node cache ``key`` with ``specs``' regions: the one on the node if there is one (its
    regions named in ``variable`` may be larger or smaller, as it was made), else a new one where the
    budget allows; None where no node cache can be used (then the caller keeps a private one)."""
    if not enabled():
        return None
    variable = frozenset(variable)
    regions, size = _layout(specs)
    for folder in folders(cache_dir):
        found = _open(folder, key, specs, variable)
        if found is not None:
            return found
    sweep_orphans()  # what runs from deleted profile directories left in memory goes first
    owner = None if os.environ.get(NODE_DIR_ENV, "") else str(resolve_cache_dir(cache_dir))
    for folder in folders(cache_dir):
        if not _room(folder, size):
            continue
        made = _create(folder, key, regions, size, lineage, detail, variable,
                       owner if _in_shm(folder) else None)
        if made is not None:
            return made
    log.info("autotune: no node folder can hold a cache of %d bytes; it is private to this process", size)
    return None


def _path(folder: Path, key: str) -> Path:
    return folder / f"{key}{SUFFIX}"


def read_header(path: str | os.PathLike[str]) -> dict[str, Any] | None:
    try:
        with open(path, "rb") as f:
            head = f.read(HEADER_BYTES)
    except OSError:
        return None
    if not head.startswith(MAGIC):
        return None
    try:
        length = int.from_bytes(head[len(MAGIC) : len(MAGIC) + 8], "little")
        meta = json.loads(head[len(MAGIC) + 8 : len(MAGIC) + 8 + length])
    except (ValueError, UnicodeDecodeError):
        return None
    return meta if isinstance(meta, dict) and meta.get("schema") == SCHEMA else None


def _open(folder: Path, key: str, specs: Sequence[Spec], variable: frozenset[str]) -> NodeFile | None:
    path = _path(folder, key)
    meta = read_header(path)
    if meta is None:
        if path.exists():
            _remove_unused(path, "its header cannot be read")
        return None
    regions = [Region(**r) for r in meta["regions"]]
    wanted = {name: (numel, str(dtype).removeprefix("torch.")) for name, numel, dtype in specs}
    have = {r.name: (r.numel, r.dtype) for r in regions}
    fits = have.keys() == wanted.keys() and all(
        have[n][1] == wanted[n][1] and (n in variable or have[n][0] == wanted[n][0]) for n in wanted)
    if meta.get("key") != key or not fits or (meta.get("boot") != boot_id() and not _in_shm(folder)):
        _remove_unused(path, "it was made for other samples, another layout or before a reboot")
        return None
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError as err:
        _warn_once(str(folder), f"the node cache {path} cannot be opened ({err}); this process keeps a"
                   " private cache")
        return None
    try:
        size = os.fstat(fd).st_size
        if size < meta["size"]:
            return None
        fcntl.flock(fd, fcntl.LOCK_SH)
        storage = _map(fd, meta["size"])
    except OSError:
        return None
    finally:
        os.close(fd)  # the mapping keeps a duplicate, and with it the shared flock (``in_use``)
    with contextlib.suppress(OSError):
        os.utime(path)  # used now: least-recent use is read from the modification time
    return NodeFile(str(path), key, _views(storage, regions), False, NodeLock(str(path) + LOCK_SUFFIX))


def _create(
    folder: Path, key: str, regions: list[Region], size: int, lineage: str | None, detail: str,
    variable: frozenset[str], owner: str | None = None,
) -> NodeFile | None:
    """``owner``: the profile cache directory the folder belongs to, named in it (NOTE [ Node
    caches ] 6)."""
    try:
        folder.mkdir(parents=True, exist_ok=True, mode=0o700)
        if owner is not None and not (folder / OWNER).exists():
            (folder / OWNER).write_text(owner + "\n")
    except OSError as err:
        _warn_once(str(folder), f"the node cache folder {folder} cannot be made ({err}); caches there"
                   " stay private to each process")
        return None
    tmp = folder / f"{TMP_PREFIX}{key}-{os.getpid()}-{threading.get_ident()}"
    path = _path(folder, key)
    fd = -1
    try:
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        os.posix_fallocate(fd, 0, size)  # reserved now: a full folder fails here, never in a write
        meta = {"schema": SCHEMA, "key": key, "boot": boot_id(), "size": size, "lineage": lineage,
                "detail": detail, "created": time.time(), "regions": [r.__dict__ for r in regions]}
        text = json.dumps(meta).encode()
        if len(MAGIC) + 8 + len(text) > HEADER_BYTES:
            raise OSError(errno.E2BIG, "the cache's header is too large")
        os.pwrite(fd, MAGIC + len(text).to_bytes(8, "little") + text, 0)
        fcntl.flock(fd, fcntl.LOCK_SH)
        try:
            os.link(tmp, path)  # of two makers of one key, one links; the other opens the winner's
        except FileExistsError:
            return _open(folder, key, [(r.name, r.numel, _DTYPES[r.dtype]) for r in regions], variable)
        storage = _map(fd, size)  # keeps a duplicate of ``fd``, and with it the shared flock
    except OSError as err:
        _warn_once(str(folder), f"the node cache folder {folder} cannot hold a cache ({err}); caches"
                   " there stay private to each process")
        return None
    finally:
        if fd >= 0:
            os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(tmp)
    if lineage is not None:
        for entry in entries_in(folder):
            if entry.lineage == lineage and entry.key != key:
                _remove_unused(Path(entry.path), "its dataset or transform changed")
    return NodeFile(str(path), key, _views(storage, regions), True, NodeLock(str(path) + LOCK_SUFFIX))


# --------------------------------------------------------------------------------- budget, entries


@dataclass(frozen=True)
class Entry:
    """A node cache as ``autotune cache list`` shows it."""

    path: str
    key: str
    bytes: int
    """Bytes it takes in its folder (pages reserved)."""
    last_used: float
    filled: int
    total: int
    detail: str
    lineage: str | None
    in_use: bool


def entries_in(folder: Path) -> list[Entry]:
    out: list[Entry] = []
    try:
        names = sorted(os.listdir(folder))
    except OSError:
        return out
    now = time.time()
    for name in names:
        path = folder / name
        if name.startswith(TMP_PREFIX):
            with contextlib.suppress(OSError):
                if now - path.stat().st_mtime > STALE_TMP_S:
                    path.unlink()
            continue
        if not name.endswith(SUFFIX):
            continue
        meta = read_header(path)
        try:
            st = path.stat()
        except OSError:
            continue
        if meta is None:
            continue
        filled, total = _fill_counts(path, meta)
        out.append(Entry(str(path), str(meta.get("key")), st.st_blocks * 512, st.st_mtime, filled, total,
                         str(meta.get("detail", "")), meta.get("lineage"), _in_use(path)))
    return out


def entries(cache_dir: Any = None) -> list[Entry]:
    """Every node cache of this profile cache directory, most recently used first."""
    found = [e for folder in folders(cache_dir) for e in entries_in(folder)]
    return sorted(found, key=lambda e: -e.last_used)


def _fill_counts(path: Path, meta: dict[str, Any]) -> tuple[int, int]:
    flags = next((r for r in meta["regions"] if r["name"] == "flags"), None)
    if flags is None:
        return 0, 0
    try:
        data = np.fromfile(path, dtype=np.uint8, count=flags["numel"], offset=flags["offset"])
    except (OSError, ValueError):
        return 0, int(flags["numel"])
    return int(np.count_nonzero(data == 1)), int(flags["numel"])


@contextlib.contextmanager
def _unmapped(path: Path) -> Iterator[bool]:
    """Whether no process maps the cache at ``path`` (none holds its shared flock), holding it so
    while the block runs (a process that opens it meanwhile waits for nothing: it maps a new file)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)


def _in_use(path: Path) -> bool:
    with _unmapped(path) as free:
        return not free and path.exists()


def _remove_unused(path: Path, why: str) -> bool:
    """Remove the cache at ``path`` unless a process maps it; whether it was removed."""
    with _unmapped(path) as free:
        if not free:
            return False
        with contextlib.suppress(OSError):
            os.unlink(path)
            with contextlib.suppress(OSError):
                os.unlink(str(path) + LOCK_SUFFIX)
            log.info("autotune: removed the node cache %s: %s", path, why)
            return True
    return False


def _in_shm(folder: Path) -> bool:
    return str(folder).startswith(SHM_DIR + os.sep)


def budget_bytes(folder: Path) -> int | None:
    """Bytes the node caches of ``folder`` may take (NOTE [ Node caches ] 5); None: unknown."""
    limits = read_cgroup_limits()
    memory = int(psutil.virtual_memory().total)
    if limits.memory_limit_bytes is not None:
        memory = min(memory, limits.memory_limit_bytes)
    probe = folder if folder.exists() else folder.parent
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        st = os.statvfs(probe)
    except OSError:
        return None
    space = st.f_blocks * st.f_frsize if _in_shm(folder) else st.f_bavail * st.f_frsize + _used(folder)
    return int(NODE_FRACTION * min(space, memory))


def _used(folder: Path) -> int:
    return sum(e.bytes for e in entries_in(folder))


def _room(folder: Path, need: int) -> bool:
    """Whether ``folder`` can take a new cache of ``need`` bytes, evicting the least recently used
    caches no process maps to make room."""
    budget = budget_bytes(folder)
    if budget is None or need > budget:
        return False
    held = entries_in(folder)
    used = sum(e.bytes for e in held)
    for entry in sorted(held, key=lambda e: e.last_used):
        if used + need <= budget:
            break
        if not entry.in_use and _remove_unused(Path(entry.path), "least recently used, to make room"):
            used -= entry.bytes
    if used + need > budget:
        return False
    if _in_shm(folder):  # as a private cache goes there: leaving the rest to the workers' batches
        free = shm_free_bytes()
        return free is not None and need <= CACHE_SHM_FRACTION * free
    return True


def clear(cache_dir: Any = None) -> list[Entry]:
    """Remove every node cache of this cache directory; a process mapping one keeps its memory until
    it exits. Returns the caches removed."""
    removed = []
    for entry in entries(cache_dir):
        with contextlib.suppress(OSError):
            os.unlink(entry.path)
            removed.append(entry)
        with contextlib.suppress(OSError):
            os.unlink(entry.path + LOCK_SUFFIX)
    for folder in folders(cache_dir):
        if _in_shm(folder):
            with contextlib.suppress(OSError):
                if not any(n for n in os.listdir(folder) if not n.endswith(LOCK_SUFFIX) and n != OWNER):
                    shutil.rmtree(folder, ignore_errors=True)
    return removed
