"""Shared memory: what worker processes and a ``ram`` cache need of ``/dev/shm``, how torch fails when
it is full, and the fix a person can apply.

# NOTE [ Shared memory ]
# Measured with torch 2.x in a private mount namespace with a 64 MiB tmpfs on /dev/shm (Docker's
# default), batches of 16 3x224x224 float images (9.6 MB each):
# 1. Who uses it. A worker process builds each batch in a shared segment (default_collate allocates
#    it there; a batch made elsewhere is copied into one when it is sent), and the main process maps
#    it until the loop lets the batch go. At most num_workers * prefetch_factor batches are in the
#    workers' hands, plus the one the loop holds: BATCHES_HELD_BY_LOOP. With a slow step, 5 workers
#    x prefetch_factor 1 (6 batches, 58 MB) ran; 6 x 1 and 3 x 2 (7 batches, 67 MB) ran out. Thread
#    workers and num_workers=0 pass nothing through it.
# 2. Where the batch is moved to shared memory decides whether running out is seen. default_collate
#    stacks tensors straight into a shared segment in a worker, but other tensors of the batch (the
#    labels made from Python numbers, whatever a custom collate_fn returns) are moved there only
#    when the queue's feeder thread pickles them; one that fails there is lost, printed and
#    dropped, and the loader waits for the batch for ever (seen here where two workers' allocations
#    raced). :class:`SharedInWorker` moves them in the worker's own fetch, where a failure is raised
#    as the worker's error; what the loop receives is the same either way.
#    torch's ``file_system`` sharing strategy does not help: it too creates its segments with
#    shm_open in /dev/shm, and measured it fails the same way, only worse (the batch is lost in the
#    queue's feeder thread and the loader waits for its timeout). It is not searched.
# 3. How torch fails. It reserves a segment with posix_fallocate, so running out is a RuntimeError
#    "unable to allocate shared memory(shm) for file </torch_...>: No space left on device (28)"
#    (older releases: "unable to write to file </torch_...>"), raised where the batch is made: in a
#    worker (re-raised by the loader as "Caught RuntimeError in DataLoader worker process N") or in
#    the main process (a cache). The segment it names is left in /dev/shm, empty (the reservation
#    was rolled back) but never unlinked: :func:`discard_failed_segment` removes it. Code that maps
#    shared memory without reserving it first is killed by SIGBUS instead ("Bus error").
# 4. A ``ram`` cache lives in /dev/shm only when it takes at most CACHE_SHM_FRACTION of its free
#    space (then any start method's workers map it); otherwise it is built in this process's private
#    memory, which forked workers (Linux's default start method) read without a copy as well: its
#    pages are only ever read, so copy-on-write never copies them. Workers started by spawn or
#    forkserver would receive a private cache pickled, copied into /dev/shm, so they are refused for
#    it (see ``pretransform.build``). A cache the loading pass fills (NOTE [ Filling caches ]) is
#    written by whoever loads a sample: in private memory only this process and its threads fill it,
#    so worker processes do not load through it until it is full (``measure.build_loader``).
# The search estimates what a candidate needs (:func:`worker_bytes`) against the free space read
# when the space is made, so it does not pick workers blindly; what it did not foresee fails the
# candidate with its reason (``measure.map_loader_error``), never the user's loop.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch.utils.data import get_worker_info

from .machine import SHM_DIR, format_bytes, read_shm

BATCHES_HELD_BY_LOOP = 1
"""Batches in /dev/shm beyond those in the workers' hands: the one the training loop holds."""

SHM_MARGIN = 1.1
"""What workers need, times this, must fit the free space: labels, the pin-memory thread's batch and
other processes' segments take a little more than the batches alone."""

CACHE_SHM_FRACTION = 0.25
"""A ``ram`` cache goes to /dev/shm only when it takes at most this share of its free space, leaving
the rest to the batches workers pass (NOTE [ Shared memory ] 4)."""

SHM_FIX = (
    "docker run --shm-size=1g (ipc: host in docker compose; in Kubernetes, an emptyDir volume with"
    " medium: Memory mounted on /dev/shm)"
)
"""The one-line fix for a /dev/shm too small for worker processes."""

SHM_FIX_SHORT = "a larger /dev/shm (docker run --shm-size=1g) lifts it"

_FAILED_SEGMENT = re.compile(
    r"unable to (?:allocate shared memory\(shm\) for|write to) file <(/torch_[^>/]+)>")
_NO_SPACE = ("No space left on device", "(28)")


def worker_bytes(num_workers: int, prefetch_factor: int, batch_bytes: int) -> int:
    """Bytes of /dev/shm that ``num_workers`` worker processes passing batches of ``batch_bytes`` use
    at most (NOTE [ Shared memory ] 1)."""
    return (num_workers * prefetch_factor + BATCHES_HELD_BY_LOOP) * batch_bytes


def fits(need_bytes: int, free_bytes: int | None) -> bool:
    """Whether ``need_bytes`` (times SHM_MARGIN) fits ``free_bytes`` (``None``: no /dev/shm to fill)."""
    return free_bytes is None or need_bytes * SHM_MARGIN <= free_bytes


def workers_reason(num_workers: int, prefetch_factor: int, batch_bytes: int, free_bytes: int) -> str:
    """Why ``num_workers`` workers at ``prefetch_factor`` do not fit the free space of /dev/shm."""
    batches = num_workers * prefetch_factor + BATCHES_HELD_BY_LOOP
    workers = f"{num_workers} worker{'' if num_workers == 1 else 's'}"
    return (
        f"needs ~{format_bytes(worker_bytes(num_workers, prefetch_factor, batch_bytes))} of {SHM_DIR}"
        f" for {batches} batches of {format_bytes(batch_bytes)} in flight ({workers} x prefetch_factor"
        f" {prefetch_factor} + 1 held by the loop), more than the {format_bytes(free_bytes)} free;"
        f" fewer workers, prefetch_factor=1 or thread workers need less, {SHM_FIX_SHORT}"
    )


def nbytes(obj: Any) -> int:
    """Bytes of the tensors and arrays in a (nested) sample or batch: what a worker process passes."""
    size = getattr(obj, "nbytes", None)
    if isinstance(size, int) and hasattr(obj, "shape"):  # a tensor or a NumPy array
        return size
    if isinstance(obj, Mapping):
        return sum(nbytes(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return sum(nbytes(v) for v in obj)
    return 0


def exhausted(err: BaseException) -> bool:
    """Whether ``err`` is torch running out of /dev/shm, in this process or in a worker
    (NOTE [ Shared memory ] 3)."""
    text = str(err)
    if _FAILED_SEGMENT.search(text) is not None and any(s in text for s in _NO_SPACE):
        return True
    return "Bus error" in text or "SIGBUS" in text


def discard_failed_segment(err: BaseException) -> str | None:
    """Unlink the segment a failed allocation left in /dev/shm, named in ``err``; returns its path.

    The segment is empty and mapped by no one (torch rolled the reservation back and raised), so it
    is removed whichever process made it.
    """
    match = _FAILED_SEGMENT.search(str(err))
    if match is None:
        return None
    path = os.path.join(SHM_DIR, match.group(1).lstrip("/"))
    with contextlib.suppress(OSError):
        os.unlink(path)
        return path
    return None


def failure_reason(err: BaseException, where: str) -> str:
    """The reason of a candidate that ran out of /dev/shm ``where`` (e.g. "a worker process"): the
    limit and the fix first, torch's own line last."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    line = next((ln for ln in reversed(lines) if _FAILED_SEGMENT.search(ln)), lines[0] if lines else "")
    shm = read_shm()
    size = "" if shm is None else f" ({format_bytes(shm.total_bytes)})"
    return (
        f"{where} ran out of {SHM_DIR}{size}; fewer workers, prefetch_factor=1 or thread workers need"
        f" less, {SHM_FIX_SHORT} ({line[:160]})"
    )


def share_tensors(value: Any) -> Any:
    """``value`` with every CPU tensor in it (nested in lists, tuples and mappings) moved to shared
    memory in place, so that a /dev/shm too full raises here (NOTE [ Shared memory ] 2)."""
    if isinstance(value, torch.Tensor):
        if not value.is_shared() and value.device.type == "cpu" and value.layout == torch.strided:
            value.share_memory_()
    elif isinstance(value, Mapping):
        for v in value.values():
            share_tensors(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            share_tensors(v)
    return value


class SharedInWorker:
    """A collate function whose batch is moved to shared memory by the worker process that made it
    (NOTE [ Shared memory ] 2): the batch is the one ``collate`` returns, unchanged."""

    def __init__(self, collate: Callable[[Any], Any]) -> None:
        self.collate = collate

    def __call__(self, samples: Any) -> Any:
        batch = self.collate(samples)
        if get_worker_info() is not None:
            share_tensors(batch)
        return batch
