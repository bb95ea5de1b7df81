"""A ``ram`` cache filled by the pass that loads the samples, not by a build before it.

# NOTE [ Filling caches ]
# ``prepare(dataset, "ram", fill="pass")`` allocates the cache and returns at once. Each sample is
# stored the first time any process loads it (as tf.data's ``cache()`` fills on the first pass), so
# the first epoch costs little more than an uncached one does and the next reads the cache.
# 1. Storage: the fields a build makes (stores.py), allocated in shared memory before any worker
#    starts: fixed-shape fields as (n, ...) tensors, ragged ones as a flat buffer with a (start, stop)
#    span and a shape per sample (``FilledColumn``). Pages never written take no memory. A flag per
#    sample, also shared: EMPTY, FILLED, or UNSTORABLE (it does not fit the layout the probes gave).
#    Where /dev/shm cannot spare the space, all of it is in private memory instead, filled by this
#    process and its threads only (NOTE [ Shared memory ] 4 in shm.py).
# 2. Loading sample i: FILLED, the built cache's own wrapper reads it. EMPTY, the raw sample goes
#    through the prefix exactly as a build reads it (``PrefixView``), a copy is written to its place
#    and the flag set, and the sample in hand goes on through the random suffix: the original
#    pipeline, with the suffix drawing what it draws either way (the plan's proof showed the prefix
#    draws none that change the suffix's). Reading it back from the cache instead would cost a second
#    copy, a large share of a sample where decoding is cheap. A batch stores its missing samples
#    first, then is gathered as a built cache gathers it; with no ragged field it stores them at once,
#    one copy per field and one fence for the batch (``Filler.store_rows``): per sample, the checks
#    and the fence cost more than a row of a few dozen numbers takes to load. UNSTORABLE, or once
#    filling stopped (5.), the sample comes from the source the same way. Nothing here saves or
#    restores RNG states: in thread workers that would undo draws made meanwhile by other threads.
# 3. Two writers of one sample (two iterators over one cache, never one epoch): a fixed-shape row has
#    one place and both write the same bytes (the prefix is deterministic; a build relies on that too,
#    reading in worker processes), so any interleaving leaves the right value, and a reader trusts a
#    row only after its flag. A ragged sample needs space: the shared cursor is advanced under a
#    multiprocessing lock (held for microseconds, acquired with a timeout), the data copied outside it,
#    and the span, shape and flag recorded under it only if no other writer recorded the sample first
#    (a duplicate's space is wasted, never read). Writers put a memory fence between the data and the
#    flag, readers between the flag and the data (``_fence``): x86-64 keeps stores in order anyway,
#    weakly ordered CPUs (ARM) do not.
# 4. Processes: forked workers inherit it all. Spawned ones (and forkserver's) receive the tensors as
#    handles to the same shared memory (torch's reductions for ``ForkingPickler``) and the lock as a
#    named semaphore; a lock made under the fork context cannot travel that way, so the first time the
#    cache is pickled for a spawned process its lock is replaced by a spawn-context one (named in
#    /dev/shm until the cache is dropped). Processes forked before the swap stop storing ragged
#    samples (their lock is no longer the one in use; a shared generation number tells them). Pickled
#    any other way (a copy), the lock stays behind: the copy reads what is filled and stores no ragged
#    sample.
# 5. Limits: the ragged buffer is sized from the plan's estimate (RAGGED_HEADROOM over the probes' mean
#    plus spread), within the memory budget. When a sample does not fit, filling stops: the rest is
#    served from the source, and the cache stays incomplete (``Prepared.fill_counts``, never wrong).
#    So it does when the lock is not acquired within FILL_LOCK_TIMEOUT_S (a process killed holding it).
# 6. Complete: once every flag is FILLED, ``Prepared.loader_parts`` hands out the built cache's wrapper
#    itself, a built cache in every respect. What the cache froze is fingerprinted when it is allocated
#    (NOTE [ Fresh caches ]); a change after that, before or after a sample was filled, shows in
#    ``Prepared.stale_reason``. Frozen code that changes its own state on every call (a step counting
#    its calls) shows as stale once the main process fills a sample, as it does after a build once the
#    original pipeline runs.
"""

from __future__ import annotations

import contextlib
import math
import multiprocessing
import threading
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from multiprocessing.context import get_spawning_popen
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset
from torch.utils.data._utils.collate import default_collate

from .node import Spec
from .steps import Chain
from .stores import (
    MAX_NDIM,
    MEMCPY_FROM,
    RAGGED_KINDS,
    FilledColumn,
    Layout,
    as_tensor,
    copy_into,
    copy_rows,
    fitting,
    mismatch,
    populate,
    shared_empty,
)

EMPTY, FILLED, UNSTORABLE = 0, 1, 2
"""A sample's flag: not stored yet, stored, or one the layout cannot hold (served from the source)."""

FILL_LOCK_TIMEOUT_S = 5.0
"""Longest wait for the ragged allocation lock, held for microseconds: past it, its holder died."""

_STOP, _GENERATION = 0, 1
"""Entries of the shared state: why filling stopped (a _STOPPED key, 0 while it goes on), and which
lock is in use (NOTE [ Filling caches ], 4.)."""

_STOPPED = {
    1: "the ragged buffer is full (the estimate from a few samples was short)",
    2: f"the fill lock was not acquired within {FILL_LOCK_TIMEOUT_S:g} s (a process died holding it)",
}
_FULL, _LOCK_LOST = 1, 2


@dataclass(frozen=True)
class FillCounts:
    """How far a cache filled by the loading pass is: samples stored, samples it cannot hold."""

    filled: int
    unstorable: int
    """Samples that do not fit the layout the probes gave: served from the source every time."""
    total: int
    stopped: str | None = None
    """Why filling stopped before the end (the rest is served from the source); None otherwise."""

    @property
    def complete(self) -> bool:
        """Every sample is stored: the cache is a built cache from now on."""
        return self.filled == self.total


def _fence() -> None:
    """A full memory fence from two lock round trips: nothing before the call passes the first
    release, nothing after it precedes the second acquire, and a release is ordered before a later
    acquire (x86-64, and ARMv8's release/acquire). A few microseconds at most."""
    lock = threading.Lock()  # a new one: a module-level lock held at a fork would deadlock the child
    for _ in range(2):
        lock.acquire()
        lock.release()


NodePlace = Callable[[list[Spec], set[str]], Any]
"""Gives a node cache's tensors for the regions asked (``node.place``), or None."""


def _private(specs: Sequence[Spec], share: bool) -> dict[str, torch.Tensor]:
    """The regions of a cache private to this process (in shared memory with ``share``): the data
    left unwritten, the bookkeeping zeroed (a ragged sample's shape row is written whole)."""
    out = {}
    for name, numel, dtype in specs:
        if name.startswith(("flat", "field")):
            out[name] = shared_empty(numel, dtype) if share else torch.empty(numel, dtype=dtype)
        else:
            t = torch.zeros(numel, dtype=dtype)
            out[name] = t.share_memory_() if share else t
    return out


class Filler:
    """The shared part of a cache filled by the loading pass: fields, flags, ragged space, lock."""

    def __init__(
        self, view: Any, layout: Layout, n: int, subclasses: Sequence[type], *, capacity_bytes: int,
        share: bool, node: NodePlace | None = None,
    ) -> None:
        self.view = view
        """``view[i]``: sample ``i`` through the prefix, what a build stores (``PrefixView``)."""
        self.layout = layout
        self.n = n
        ragged = [k for k, (kind, _, _) in enumerate(layout) if kind in RAGGED_KINDS]
        specs: list[Spec] = [("flags", n, torch.uint8), ("state", 2, torch.int64)]
        for k, (_, shape, dtype) in enumerate(layout):
            if k in ragged:
                itemsize = torch.empty((), dtype=dtype).element_size()
                specs += [(f"flat{k}", max(1, capacity_bytes // len(ragged) // itemsize), dtype),
                          (f"spans{k}", 2 * n, torch.int64), (f"shapes{k}", MAX_NDIM * n, torch.int64),
                          (f"cursor{k}", 1, torch.int64)]
            else:
                specs.append((f"field{k}", n * math.prod(shape), dtype))
        self.node = node(specs, {f"flat{k}" for k in ragged}) if node is not None else None
        """The node cache these fields live in (NOTE [ Node caches ]); None: this process's own."""
        made = self.node.tensors if self.node is not None else _private(specs, share)
        fresh = self.node is None or self.node.created
        self.fields: list[Any] = []
        for k, (kind, shape, _) in enumerate(layout):
            if k in ragged:
                spans, shapes = made[f"spans{k}"].view(n, 2), made[f"shapes{k}"].view(n, MAX_NDIM)
                self.fields.append(
                    FilledColumn(made[f"flat{k}"], spans, shapes, made[f"cursor{k}"], kind, subclasses[k]))
            else:
                data = made[f"field{k}"]
                # Every row will be written, in any order, or read: mapped at once, not a page per
                # fault (NOTE [ Populating a cache's pages ]; a node cache another process made is
                # mapped for reading, so that its rows are not marked written again).
                populate(data, write=fresh)
                self.fields.append(data.view(n, *shape))
        self.ragged = tuple(ragged)
        self.flags, self.state = made["flags"], made["state"]
        if self.node is not None:
            self.lock: Any = self.node.lock if ragged else None
            self.lock_spawns = True
        else:
            # The start method in force, else the platform's default, read without fixing it for the
            # user.
            method = multiprocessing.get_start_method(allow_none=True)
            method = method or multiprocessing.get_all_start_methods()[0]
            self.lock = multiprocessing.get_context(method).Lock() if ragged else None
            self.lock_spawns = method != "fork"
            """Whether ``lock`` may be pickled for a spawned process (NOTE [ Filling caches ], 4.)."""
        self.generation = 0
        self._views()

    def _views(self) -> None:
        # NumPy views of the shared flags and state: a read or write costs ~0.1 us, not a torch call.
        self._flags = self.flags.numpy()
        self._state = self.state.numpy()

    def __getstate__(self) -> dict[str, Any]:
        lock = self._travelling_lock()  # first: it may move this cache to a new lock generation
        state = {k: v for k, v in self.__dict__.items() if k not in ("_flags", "_state")}
        state["lock"] = lock
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()

    def _travelling_lock(self) -> Any:
        """The lock to pickle with the cache: for a spawned process one that can go there, else none."""
        if self.lock is None or get_spawning_popen() is None:
            return None
        if not self.lock_spawns:
            old = self.lock
            if not old.acquire(timeout=FILL_LOCK_TIMEOUT_S):
                return None
            try:  # under the old lock: a process holding it either finished or sees the new generation
                self.lock = multiprocessing.get_context("spawn").Lock()
                self.lock_spawns = True
                self.generation += 1
                self._state[_GENERATION] = self.generation
            finally:
                old.release()
        return self.lock

    # -- reading -----------------------------------------------------------------------------------

    def flag(self, index: int) -> int:
        return int(self._flags[index])

    def all_filled(self, indices: Sequence[int]) -> bool:
        return bool((self._flags[np.asarray(indices, dtype=np.int64)] == FILLED).all())

    def counts(self) -> FillCounts:
        filled = int(np.count_nonzero(self._flags == FILLED))
        unstorable = int(np.count_nonzero(self._flags == UNSTORABLE))
        return FillCounts(filled, unstorable, self.n, _STOPPED.get(int(self._state[_STOP])))

    # -- storing -----------------------------------------------------------------------------------

    def store(self, index: int, sample: Any) -> bool:
        """Store sample ``index`` (``view[index]``); whether it is stored now (by this call or another)."""
        is_seq = isinstance(sample, (tuple, list))
        if mismatch(self.layout, sample, is_seq) is not None:
            self._flags[index] = UNSTORABLE  # every writer finds the same: no lock needed
            return False
        values = list(sample) if is_seq else [sample]
        if not self.ragged:
            for k, value in enumerate(values):
                self._put(k, index, value)
            _fence()
            self._flags[index] = FILLED
            return True
        tensors = {k: as_tensor(values[k], self.layout[k][0]) for k in self.ragged}
        starts = self._reserve(tensors)
        if starts is None:
            return False
        for k, value in enumerate(values):
            if k in tensors:
                self.fields[k].write(starts[k], tensors[k])
            else:
                self._put(k, index, value)
        _fence()
        with self._locked() as held:
            if not held:
                return False
            if self._flags[index] == EMPTY:  # else another writer recorded it first: this copy unused
                for k, t in tensors.items():
                    self.fields[k].record(index, starts[k], t)
                _fence()
                self._flags[index] = FILLED
        return self.flag(index) == FILLED

    def store_rows(self, indices: Sequence[int]) -> bool:
        """Store what ``indices`` miss of a cache with no ragged field, each field in one copy for the
        batch and one fence for all (``store`` costs ~20 us a sample, more than a row of a few dozen
        numbers takes to load); whether all of ``indices`` are stored now."""
        wanted = np.asarray(indices, dtype=np.int64)
        # A batch may repeat an index. Not np.unique: its first call imports numpy.ma, and in a
        # worker forked from a parent that never made that call, that import costs each worker
        # ~35 ms of CPU on its first batch (16 workers on 2 CPUs: a third of a second of the first
        # stretch's start-up, counted again for every epoch in the score of workers that start anew).
        missing = np.fromiter(dict.fromkeys(wanted[self._flags[wanted] == EMPTY].tolist()), dtype=np.int64)
        if len(missing):
            samples = [self.view[int(i)] for i in missing]
            is_seq = isinstance(samples[0], (tuple, list))
            fits = fitting(self.layout, samples, is_seq)
            if not all(fits):
                self._flags[missing[[not f for f in fits]]] = UNSTORABLE  # as ``store`` marks it
                samples = [s for s, f in zip(samples, fits, strict=True) if f]
                missing = missing[fits]
            if samples:
                columns = [list(c) for c in zip(*samples, strict=True)] if is_seq else [samples]
                for k, column in enumerate(columns):
                    copy_rows(self.fields[k], missing, column, self.layout[k][0])
                _fence()
                self._flags[missing] = FILLED
        if bool((self._flags[wanted] == FILLED).all()):
            _fence()
            return True
        return False

    def _put(self, k: int, index: int, value: Any) -> None:
        """Field ``k`` of sample ``index``, in its fixed-shape row."""
        if isinstance(value, torch.Tensor) and value.device.type == "cpu" and value.numel() >= MEMCPY_FROM:
            copy_into(self.fields[k][index], value)
        else:
            self.fields[k][index] = value

    def _reserve(self, tensors: dict[int, torch.Tensor]) -> dict[int, int] | None:
        with self._locked() as held:
            if not held or self._state[_STOP]:
                return None
            if not all(self.fields[k].fits(t.numel()) for k, t in tensors.items()):
                self._state[_STOP] = _FULL
                return None
            return {k: self.fields[k].reserve(t.numel()) for k, t in tensors.items()}

    @contextlib.contextmanager
    def _locked(self) -> Iterator[bool]:
        """Hold the allocation lock now in use; yields False where this process cannot (filling then
        stops for it: a copy without the lock, a lock replaced since the fork, or a timeout)."""
        while True:
            lock = self.lock
            if lock is None or self._state[_GENERATION] != self.generation:
                yield False
                return
            if not lock.acquire(timeout=FILL_LOCK_TIMEOUT_S):
                self._state[_STOP] = _LOCK_LOST
                yield False
                return
            if lock is self.lock and self._state[_GENERATION] == self.generation:
                break
            lock.release()  # replaced by another thread of this process meanwhile: take the new one
        try:
            yield True
        finally:
            lock.release()

    def stopped(self) -> bool:
        """Whether this process stores no more ragged samples (fixed-shape ones never stop)."""
        return bool(self.ragged) and (
            self.lock is None or bool(self._state[_STOP]) or self._state[_GENERATION] != self.generation
        )


class FillingSamples(Dataset[Any]):
    """The dataset handed to the DataLoader while the cache fills (NOTE [ Filling caches ]).

    ``cached`` is the wrapper a build makes, over the filler's fields: it reads every stored sample.
    """

    def __init__(self, filler: Filler, cached: Any, suffix: Chain | None, field: int | None) -> None:
        self.filler = filler
        self.cached = cached
        self.suffix = suffix
        self.field = field

    def __len__(self) -> int:
        return self.filler.n

    @property
    def fields(self) -> tuple[Any, ...]:
        return tuple(self.filler.fields)

    def __getitem__(self, index: int) -> Any:
        n = self.filler.n
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a cache of {n} samples")
        index %= n
        filler = self.filler
        if filler.flag(index) == EMPTY and not filler.stopped():
            sample = filler.view[index]
            filler.store(index, sample)  # a copy: the sample in hand goes on as the pipeline's own
            return self._through_suffix(sample)
        if self._stored(index):
            return self.cached[index]
        return self._through_suffix(filler.view[index])

    def _stored(self, index: int) -> bool:
        """Whether sample ``index`` is stored, storing it now when it is not yet."""
        filler = self.filler
        flag = filler.flag(index)
        if flag == EMPTY and not filler.stopped():
            sample = filler.view[index]
            if filler.store(index, sample):
                return True
            flag = filler.flag(index)
        if flag == FILLED:
            _fence()
            return True
        return False

    def _through_suffix(self, sample: Any) -> Any:
        """A sample not stored: the prefix's output through the random suffix, the original pipeline."""
        if self.suffix is None:
            return sample
        if self.field is None:
            return self.suffix(sample)
        out = list(sample)
        out[self.field] = self.suffix(out[self.field])
        return type(sample)(out)


class FillingBatches(FillingSamples):
    """``FillingSamples`` over a cache that gathers whole batches: a batch stores its missing samples,
    then is gathered as a built cache gathers it (or, with a sample the cache cannot hold, made per
    sample and collated as the default collate does)."""

    @property
    def is_seq(self) -> Any:
        return self.cached.is_seq

    @property
    def kinds(self) -> tuple[str, ...]:
        return tuple(self.cached.kinds)

    @property
    def subclasses(self) -> tuple[type, ...]:
        return tuple(self.cached.subclasses)

    def ready(self, indices: Sequence[int]) -> bool:
        """Store what ``indices`` miss; whether all of them are stored now."""
        filler = self.filler
        if filler.all_filled(indices):
            _fence()
            return True
        if not filler.ragged:
            return filler.store_rows(indices)
        stored = [self._stored(i) for i in indices]
        return all(stored)

    def __getitems__(self, indices: list[int]) -> Any:
        if self.ready(indices):
            return self.cached.__getitems__(indices)
        return default_collate([self[i] for i in indices])


def filling_wrapper(filler: Filler, cached: Any, suffix: Chain | None, field: int | None) -> Any:
    """The dataset to load while ``filler`` fills ``cached`` (batched where the cache is)."""
    kind = FillingBatches if hasattr(cached, "__getitems__") else FillingSamples
    return kind(filler, cached, suffix, field)


class Picked(Dataset[Any]):
    """``view[indices[j]]`` as item ``j``: a cache over a few samples (the proof's probes)."""

    def __init__(self, view: Any, indices: Sequence[int]) -> None:
        self.view, self.indices = view, list(indices)

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> Any:
        return self.view[self.indices[j]]


class Completing(Dataset[Any]):
    """Item ``j`` stores sample ``missing[j]`` and gives None: a blocking pass that completes a cache
    filled so far by loading (worker processes write straight into the shared fields)."""

    def __init__(self, wrapper: FillingSamples, missing: Sequence[int]) -> None:
        self.wrapper, self.missing = wrapper, list(missing)

    def __len__(self) -> int:
        return len(self.missing)

    def __getitem__(self, j: int) -> None:
        self.wrapper._stored(self.missing[j])
