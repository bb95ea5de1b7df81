"""Building a cache from a plan: the samples read once through the prefix, stored in RAM or on a device.

A ``ram`` build reads in worker processes when the data set is large enough for that to pay, stores
fixed-shape fields as (n, ...) tensors and the others ragged (``stores.py``), and hands back the
wrapped dataset (``wrapped.py``) as a :class:`Prepared`, with what it froze (NOTE [ Fresh caches ]).
"""

from __future__ import annotations

import copy
import math
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any

import torch
from torch.utils.data import DataLoader, default_collate

from .. import shm
from ..exceptions import CandidateInfeasible, ShapeChanged, StaleCacheWarning
from ..machine import SHM_DIR, shm_free_bytes, usable_cpu_count
from ..shm import CACHE_SHM_FRACTION
from . import node
from .filling import (
    EMPTY,
    Completing,
    FillCounts,
    Filler,
    FillingBatches,
    FillingSamples,
    NodePlace,
    Picked,
    filling_wrapper,
)
from .node import Spec
from .split import (
    CachePlan,
    PrefixView,
    apply_field,
    fingerprint,
    probe_indices,
    prove,
    rng_preserved,
    stale_reason,
    wrap_table,
)
from .stores import (
    RAGGED_KINDS,
    ProgressFn,
    as_ragged,
    fill,
    fmt_bytes,
    is_ragged,
    log,
    mismatch,
    stack,
    tensor_types,
)
from .wrapped import Unbatched, already_collated, wrap_fields

STAGING_BYTES = 64 * 2**20
"""Samples are gathered on the CPU in chunks of about this size before a copy to the device."""

RAGGED_HEADROOM = 1.25
"""A ragged buffer is reserved this much above the estimate; pages never written take no memory."""

TABLE_READ_ROWS = 64
"""Rows of a Hugging Face table read at a time while its images are cached."""

PARALLEL_BUILD_SAMPLES = 512
"""A ram build reads samples in worker processes (one per usable CPU, at most MAX_BUILD_WORKERS)
from this many samples on: below it, starting them costs more than the decoding they share."""

MAX_BUILD_WORKERS = 8
"""Most worker processes a build reads with: reading files does not scale much further."""

BUILD_CHUNK = 32
"""Samples a build worker hands back at a time."""

BUILD_PREFETCH = 4
"""Chunks each build worker keeps ready (fewer where /dev/shm cannot hold them)."""


class Freshness:
    """What a build froze, and the dataset it froze it from."""

    def __init__(self, dataset: Any, plan: CachePlan) -> None:
        try:  # held weakly where it can be: a cache does not keep its dataset alive
            self.ref: Callable[[], Any] = weakref.ref(dataset)
        except TypeError:
            self.ref = lambda: dataset
        self.plan = plan
        self.warned = False

    def reason(self) -> str | None:
        dataset = self.ref()
        if dataset is None:
            return None  # the dataset is gone: nothing can read the cache through it any more
        return stale_reason(dataset, self.plan)


@dataclass(frozen=True)
class Prepared:
    """A dataset ready to be loaded with one strategy."""

    dataset: Any
    strategy: str
    collate_fn: Callable[[Any], Any] | None = None
    build_s: float = 0.0
    """Seconds the cache build took (the original build's figure when a build is reused)."""
    nbytes: int = 0
    """Bytes the cache holds."""
    detail: str = ""
    """What was cached and what still runs per sample."""
    shared: bool = False
    """Whether a ``ram`` cache is in /dev/shm; else in private memory, which only forked workers read
    without a copy (NOTE [ Shared memory ] 4 in shm.py)."""
    freshness: Freshness | None = field(default=None, repr=False, compare=False)

    def loader_parts(
        self, collate_fn: Callable[[Any], Any] | None = None
    ) -> tuple[Any, Callable[[Any], Any] | None]:
        """(dataset, collate_fn) to hand to a DataLoader, given the user's ``collate_fn`` (or None).

        Without one: the fastest path (whole batches gathered by index where the cache can, with a
        pass-through collate). With one: the user's function receives exactly the list of samples
        the original dataset would give (same types: ints stay ints), built from a batched gather
        unbound into samples, or per sample where the cache runs a random rest per sample.
        A cache filled by the loading pass (``fill="pass"``) gives the wrapper that fills it until it
        is complete, and the built cache's wrapper from then on (NOTE [ Filling caches ]).
        """
        dataset = self.dataset
        if isinstance(dataset, FillingSamples) and dataset.filler.counts().complete:
            dataset = dataset.cached
        plain = all(t is torch.Tensor for t in getattr(dataset, "subclasses", (None,)))
        if collate_fn is default_collate and plain:
            # torch's own, as a DataLoader holds it when given none: a batched gather is what it would
            # give (the proof compared the two), so the samples are not unbound to be stacked again.
            # A tensor subclass is left to it: its own stack may keep the subclass, a gather does not.
            collate_fn = None
        if collate_fn is None:
            return dataset, self.collate_fn
        if self.collate_fn is None or not hasattr(dataset, "__getitems__"):
            return dataset, collate_fn
        return Unbatched(dataset), collate_fn

    def gathers_batches(self, collate_fn: Callable[[Any], Any] | None) -> bool:
        """Whether a loader given ``collate_fn`` gets each batch from this cache by one gather, with
        nothing left to run per sample."""
        plan = self.freshness.plan if self.freshness is not None else None
        return (plan is not None and plan.suffix is None and plan.table is None
                and self.loader_parts(collate_fn)[1] is already_collated)

    def fill_counts(self) -> FillCounts:
        """How far the cache is filled: samples stored, those it cannot hold, and why filling stopped
        early, if it did. A built cache (and ``none``) is complete from the start; one filled by the
        loading pass (``fill="pass"``) completes when every sample was loaded once."""
        if isinstance(self.dataset, FillingSamples):
            return self.dataset.filler.counts()
        try:
            n = len(self.dataset)
        except TypeError:  # a stream (strategy "none"): nothing to fill
            n = 0
        return FillCounts(n, 0, n)

    def filled_fraction(self) -> float:
        """The share of the samples the cache holds (1.0 for a built cache)."""
        counts = self.fill_counts()
        return counts.filled / counts.total if counts.total else 1.0

    def stale_reason(self) -> str | None:
        """What changed since the cache was built (a frozen step's parameter, the raw data), or None.

        Cheap enough for every epoch start (see NOTE [ Fresh caches ]). A stale cache must not be
        used: call ``prepare`` again, which rebuilds it.
        """
        return self.freshness.reason() if self.freshness is not None else None

    def check_fresh(self) -> bool:
        """True while the cache matches its dataset; else warns (once, StaleCacheWarning) and False."""
        reason = self.stale_reason()
        if reason is None:
            return True
        if self.freshness is not None and not self.freshness.warned:
            self.freshness.warned = True
            warnings.warn(stale_message(self.strategy, reason), StaleCacheWarning, stacklevel=2)
        return False


def stale_message(strategy: str, reason: str) -> str:
    return (
        f"the pretransform={strategy!r} cache no longer matches its dataset: {reason}; it is rebuilt"
        " when the next loader is made (prepare), and a loader made before the change still serves"
        " the old samples"
    )


def build(
    dataset: Any, plan: CachePlan, strategy: str, *, device: torch.device, memory_budget_bytes: int | None,
    progress: ProgressFn | None,
) -> Prepared:
    """The cache of ``plan`` for ``strategy`` (``ram`` or ``device``), built now.

    A ``ram`` build stops when it outgrows ``memory_budget_bytes`` (None: no ceiling); a ``device``
    build is sized by the plan's fixed shapes, checked against the device budget before.
    """
    t0 = time.perf_counter()
    shared = False
    if strategy == "ram":
        wrapped, held, shared = _build_ram(dataset, plan, memory_budget_bytes, progress)
    else:
        wrapped, held = _build_device(dataset, plan, device)
    plan.real_bytes = held
    # What the cache froze is the state the build left: a frozen step that counts its own calls
    # has counted the build's, and only a change after this point makes the cache stale.
    plan.fingerprint = fingerprint(dataset, plan)
    detail = plan.detail
    if is_ragged(plan.layout) or plan.table is not None:
        detail += f" ({fmt_bytes(held)} held, {fmt_bytes(plan.estimate().total)} estimated)"
    cached_batches = hasattr(wrapped, "__getitems__") and not getattr(wrapped, "returns_samples", False)
    return Prepared(
        dataset=wrapped,
        strategy=strategy,
        collate_fn=already_collated if cached_batches else None,
        build_s=time.perf_counter() - t0,
        nbytes=held,
        detail=detail,
        shared=shared,
        freshness=Freshness(dataset, plan),
    )


def fill_in_pass(dataset: Any, plan: CachePlan, *, memory_budget_bytes: int | None) -> Prepared:
    """A ``ram`` cache for ``plan`` allocated now and filled by the pass that loads the samples
    (NOTE [ Filling caches ]). Raises ``CandidateInfeasible`` when it cannot fit the budget, or when
    the filling wrapper does not reproduce the dataset on the probes.
    """
    t0 = time.perf_counter()
    if plan.source is not None:
        view = PrefixView(plan.source, plan.prefix, plan.field)
    else:  # whole samples: read from a shallow copy, so that the stored cache does not keep the
        try:  # user's dataset alive (reuse.py)
            view = PrefixView(copy.copy(dataset), (), None)
        except Exception as err:  # noqa: BLE001 - slots, properties, odd classes
            raise CandidateInfeasible(
                f"pretransform='ram' (fill='pass'): the dataset could not be copied to read its samples"
                f" later ({type(err).__name__}: {err}); build the cache before use (fill='build')"
            ) from err
    expected = plan.estimate()
    fixed = sum(
        plan.length * math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        for kind, shape, dtype in plan.layout if kind not in RAGGED_KINDS
    )
    capacity = 0
    if is_ragged(plan.layout):
        capacity = int(RAGGED_HEADROOM * (expected.mean + expected.spread) * plan.length)
        if memory_budget_bytes is not None:
            capacity = min(capacity, memory_budget_bytes - fixed)
    if memory_budget_bytes is not None and expected.total > memory_budget_bytes:
        raise CandidateInfeasible(
            f"a cache would need ~{fmt_bytes(expected.total)} ({expected.describe()}), over the memory"
            f" budget of {fmt_bytes(memory_budget_bytes)}"
        )
    # In /dev/shm where it can spare the space, so that worker processes fill it; otherwise in
    # private memory, which only this process and its threads fill (``measure.build_loader``).
    shared = in_shm(fixed + capacity)
    indices = probe_indices(plan.length)
    probes = Picked(view, indices)
    place = _node_place(dataset, plan)
    # A cache kept for the node was made after this proof, by this code on these samples (its key).
    if place is None or not place.found:
        if not prove(dataset, plan, indices, _filling(probes, plan, len(indices), capacity, share=False)):
            raise CandidateInfeasible(
                "pretransform='ram' (fill='pass'): the cache filled while loading gave other samples"
                " than the dataset on the probes; build it before use (fill='build')"
            )
        plan.fingerprint = fingerprint(dataset, plan)  # what the cache freezes is what it is now
    wrapped = _filling(view, plan, plan.length, capacity, share=shared, node=place)
    reserved = fixed + capacity
    where = "" if shared else f" in private memory, {SHM_DIR} could not spare it"
    if wrapped.filler.node is not None:
        shared = True
        counts = wrapped.filler.counts()
        where = f" in {wrapped.filler.node.path}, shared by the node: {counts.filled} of {counts.total} there"
    detail = f"{plan.detail}; filled as samples are loaded ({fmt_bytes(reserved)} reserved{where})"
    return Prepared(
        dataset=wrapped,
        strategy="ram",
        collate_fn=already_collated if isinstance(wrapped, FillingBatches) else None,
        build_s=time.perf_counter() - t0,
        nbytes=reserved,
        detail=detail,
        shared=shared,
        freshness=Freshness(dataset, plan),
    )


class _NodePlace:
    """Where the node cache of a plan is found or made (NOTE [ Node caches ]), called with the
    regions the cache needs; ``found``: whether one with its key is on the node already."""

    def __init__(self, dataset: Any, plan: CachePlan) -> None:
        plan.fingerprint = fingerprint(dataset, plan)  # again after a proof, which reads the probes
        self.key, self.lineage = node.key_of(plan, dataset), node.lineage_of(dataset)
        self.detail = plan.detail
        self.found = node.exists(self.key)

    def __call__(self, specs: list[Spec], variable: set[str]) -> node.NodeFile | None:
        return node.place(self.key, specs, lineage=self.lineage, detail=self.detail, variable=variable)


def _node_place(dataset: Any, plan: CachePlan) -> _NodePlace | None:
    return _NodePlace(dataset, plan) if node.enabled() else None


def _filling(
    view: Any, plan: CachePlan, n: int, capacity: int, *, share: bool, node: NodePlace | None = None
) -> FillingSamples:
    filler = Filler(view, plan.layout, n, tensor_types(plan.probe[0]), capacity_bytes=capacity, share=share,
                    node=node)
    return filling_wrapper(filler, wrap_fields(filler.fields, plan.layout, plan), plan.suffix, plan.field)


def complete_filling(prepared: Prepared) -> Prepared:
    """``prepared`` (filled by the loading pass) with every sample it can hold stored now, in worker
    processes where that pays as a build does; its ``build_s`` then says how long that took."""
    wrapper = prepared.dataset
    if not isinstance(wrapper, FillingSamples) or wrapper.filler.counts().stopped is not None:
        return prepared  # built; or filling stopped, and what is missing is served from the source
    t0 = time.perf_counter()
    flags = wrapper.filler.flags
    missing = torch.nonzero(flags == EMPTY).flatten().tolist()
    if missing:
        for _ in _read(Completing(wrapper, missing), len(missing), in_process=not prepared.shared):
            pass
    return replace(prepared, build_s=prepared.build_s + time.perf_counter() - t0)


def build_seconds(dataset: Any, plan: CachePlan) -> float:
    """Seconds a build of ``plan`` would take: a few samples read through the prefix, times the length."""
    source = plan.source if plan.source is not None else dataset
    indices = probe_indices(plan.length)
    with rng_preserved():
        t0 = time.perf_counter()
        for i in indices:
            apply_field(plan.prefix, source[i], plan.field)
        per_sample = (time.perf_counter() - t0) / len(indices)
    return per_sample * plan.length


def _build_ram(
    dataset: Any, plan: CachePlan, budget: int | None, progress: ProgressFn | None
) -> tuple[Any, int, bool]:
    """The wrapped dataset over a cache, the bytes it holds, and whether it is in /dev/shm: there
    when it takes at most CACHE_SHM_FRACTION of its free space, else in private memory (NOTE [ Shared
    memory ] 4 in shm.py). A /dev/shm that another process fills meanwhile fails the build with
    torch's error, which the search takes as the candidate's (``measure.map_loader_error``)."""
    expected = plan.estimate()
    capacity = int(RAGGED_HEADROOM * (expected.mean + expected.spread) * plan.length)
    share = in_shm(ram_reserve_bytes(plan))
    if plan.table is not None:
        wrapped = wrap_table(
            plan, _read(plan.source, plan.length, expected.mean), share=share, capacity_bytes=capacity,
            budget_bytes=budget, progress=progress,
        )
        return wrapped, sum(c.nbytes for c in wrapped.fields), share
    source = plan.source if plan.source is not None else dataset
    with rng_preserved():
        while True:
            try:
                fields, held = fill(
                    _read(PrefixView(source, plan.prefix, plan.field), plan.length, expected.mean),
                    plan.layout, plan.length, subclasses=tensor_types(plan.probe[0]), share=share,
                    capacity_bytes=capacity, budget_bytes=budget, progress=progress,
                )
                break
            except ShapeChanged as err:
                # The probes all had one shape, a later sample another: the same samples, stored
                # ragged (per sample, as proven; only the batched gather is lost). Read once more;
                # each pass makes at least one more field ragged, so this ends.
                log.info("%s: storing field(s) %s ragged and reading the samples again", err, err.fields)
                plan.layout = as_ragged(plan.layout, err.fields)
    return wrap_fields(fields, plan.layout, plan), held, share


def ram_reserve_bytes(plan: CachePlan) -> int:
    """Bytes a ``ram`` build of ``plan`` reserves: its size where fixed (or once built), the ragged
    buffers' headroom above the estimate otherwise."""
    if plan.real_bytes is not None:
        return plan.real_bytes
    expected = plan.estimate()
    if is_ragged(plan.layout) or plan.table is not None:
        return int(RAGGED_HEADROOM * (expected.mean + expected.spread) * plan.length)
    return expected.total


def in_shm(nbytes: int) -> bool:
    """Whether a cache of ``nbytes`` goes to /dev/shm (NOTE [ Shared memory ] 4 in shm.py)."""
    free = shm_free_bytes()
    return free is None or nbytes <= CACHE_SHM_FRACTION * free  # None: no /dev/shm to fill (macOS)


def _read(view: Any, n: int, sample_bytes: float = 0.0, *, in_process: bool = False) -> Iterator[Any]:
    """``view[0], view[1], ...``: in this process (``in_process``, or too few samples to share), or in
    order from worker processes.

    The build is one pass of decoding over the whole data set; on a machine with several CPUs the
    workers share it (the prefix is deterministic, so where it runs changes nothing). The samples
    they hand back pass through /dev/shm: as many workers and chunks in flight as its free space
    holds (``sample_bytes`` each), none where not even one chunk fits.
    """
    workers = min(MAX_BUILD_WORKERS, usable_cpu_count())
    prefetch = BUILD_PREFETCH
    chunk_bytes = int(sample_bytes * BUILD_CHUNK)
    free = shm_free_bytes()
    while workers > 1 and not shm.fits(shm.worker_bytes(workers, prefetch, chunk_bytes), free):
        if prefetch > 1:
            prefetch //= 2
        else:
            workers -= 1
    if in_process or n < PARALLEL_BUILD_SAMPLES or workers < 2:
        if hasattr(view, "__getitems__"):  # a table: rows read a batch at a time
            for start in range(0, n, TABLE_READ_ROWS):
                yield from view.__getitems__(list(range(start, min(n, start + TABLE_READ_ROWS))))
        else:
            for i in range(n):
                yield view[i]
        return
    loader = DataLoader(
        view, batch_size=BUILD_CHUNK, num_workers=workers, collate_fn=_shared_list, prefetch_factor=prefetch
    )
    for chunk in loader:
        yield from chunk


def _shared_list(samples: list[Any]) -> list[Any]:
    """A build worker's chunk, its tensors moved to shared memory here: a /dev/shm too full for them
    then fails the build with torch's error, where in the queue's feeder thread it would be lost and
    the build would wait for ever (NOTE [ Shared memory ] 2 in shm.py)."""
    return shm.share_tensors(samples)


def _build_device(dataset: Any, plan: CachePlan, device: torch.device) -> tuple[Any, int]:
    """Fixed-shape fields on ``device``, staged on the CPU in chunks of STAGING_BYTES."""
    layout, n = plan.layout, plan.length
    source = plan.source if plan.source is not None else dataset
    fields = [torch.empty((n, *shape), dtype=dtype, device=device) for _, shape, dtype in layout]
    row_bytes = sum(f[0].numel() * f.element_size() for f in fields)
    chunk = max(1, STAGING_BYTES // max(1, row_bytes))
    with rng_preserved():
        for start in range(0, n, chunk):
            indices = range(start, min(n, start + chunk))
            rows = [apply_field(plan.prefix, source[i], plan.field) for i in indices]
            is_seq = isinstance(rows[0], (tuple, list))
            for i, row in zip(indices, rows, strict=True):
                if (reason := mismatch(layout, row, is_seq)) is not None:
                    raise CandidateInfeasible(
                        f"sample {i}: {reason}; the layout was planned from a few samples"
                    )
            for data, column in zip(fields, stack(rows, layout, torch.device("cpu")), strict=True):
                data[start : start + len(rows)].copy_(column)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return wrap_fields(fields, layout, plan), sum(f.numel() * f.element_size() for f in fields)
