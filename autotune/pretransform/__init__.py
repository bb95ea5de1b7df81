"""Where the per-sample transform runs: ``none`` (per sample, in the workers), ``ram``, ``device``.

Interface used by the rest of the package (keep these names and shapes):

- ``STRATEGIES``: the strategy names, ``("none", "ram", "device")``.
- ``strategies(dataset, *, cuda, memory_budget_bytes, device_memory_budget_bytes) -> dict[str, str|None]``
  every strategy name mapped to ``None`` when usable for this dataset, or the reason it is refused.
- ``prepare(dataset, strategy, *, device, memory_budget_bytes=None, progress=None) -> Prepared``: the
  wrapped dataset (built once per process and dataset, rebuilt when what it froze changed), the
  collate function to use with it, the build time and the cache size.
- ``Prepared.loader_parts(collate_fn) -> (dataset, collate_fn)``: what to hand to a DataLoader, with
  or without the user's own collate function.
- ``Prepared.stale_reason() -> str | None`` and ``Prepared.check_fresh() -> bool``: whether the cache
  still matches the dataset (cheap; call at each epoch start), see NOTE [ Fresh caches ] in fresh.py.
- ``estimate_build_s(dataset) -> float | None``: seconds a cache build would take.
- ``clear_builds()``: drop every stored plan and cache.
- ``holds_cuda_tensors(dataset) -> bool``: samples already live on an accelerator (no workers then).

The parts: ``plan.py`` (planning and proof), ``steps.py`` (what is known about transform steps, and
the steps that run per sample), ``stores.py`` (fixed-shape and ragged storage), ``sources.py``
(raw-source adapters: vision datasets, image folders, Hugging Face tables), ``wrapped.py`` (the
datasets handed to the DataLoader), ``fresh.py`` (fingerprints of what a cache froze).

# NOTE [ Pre-transform split ]
# A sample is ``transform(raw)`` (plus untouched fields such as the target). The transform pipeline
# (a torchvision ``Compose``, v1 or v2, or one transform) is split into a deterministic prefix, applied
# once per sample when the cache is built, and a random suffix, applied per sample per epoch as before.
#
# 1. Leading prefix: steps from the start while each is known to be deterministic (ToTensor, Normalize,
#    Resize, ...) or proven so: applied to the probe samples under several RNG states, its outputs are
#    identical. A step named Random*, or otherwise known to be random, is never probed and never frozen.
# 2. Reordering: after the first random step, a run of random steps that only *select* pixels (flips,
#    RandomCrop) commutes exactly with later per-pixel steps (ToTensor, ToDtype, ConvertImageDtype,
#    Normalize): selecting then mapping each pixel equals mapping every pixel then selecting. Those
#    per-pixel steps are moved into the prefix. RandomCrop's padding is not a selection: it becomes its
#    own per-sample step in the mapped space, with the constant fill mapped through the moved steps
#    (fill=0 followed by ToTensor and Normalize pads with (0 - mean) / std per channel), and the crop
#    runs unpadded on the padded image. The crop draws its offsets from the same image size with the
#    same RNG calls, so under one seed the output is the original's, value for value.
# 3. Decoded samples: when the raw read itself is the cost (a file decoded: an ImageFolder's loader, a
#    Hugging Face ``Image`` column, or a raw read that takes a large share of a sample's time), an
#    empty prefix is a plan too: the decoded samples are cached as they are (uint8 pixels, each image
#    its own size, stored ragged) and the whole transform runs per sample on them, receiving the same
#    type as before (a PIL image, a tensor, an array).
# 4. Proof: every plan is checked before use. The wrapped dataset built from the probe samples must
#    return exactly ``dataset[i]`` (and, without a suffix, exactly the default-collated batch) under
#    the same seed. A reordered plan that fails falls back to the plain prefix, which falls back to
#    caching whole samples (only if ``dataset[i]`` itself is proven deterministic), which falls back to
#    a refusal. Nothing is ever cached on an unproven claim.
# The proof is only as good as its probes: hidden randomness that rarely shows (say, one call in a
# thousand), or that draws from outside Python's, NumPy's and torch's RNGs, can escape it.
"""

from __future__ import annotations

import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from ..exceptions import CandidateInfeasible, ConfigurationError, StaleCacheWarning
from ..machine import usable_cpu_count
from .plan import (
    Plan,
    PrefixView,
    apply_field,
    fingerprint,
    make_plan,
    probe_indices,
    rng_preserved,
    stale_reason,
    wrap_table,
)
from .stores import ProgressFn, ShapeChanged, as_ragged, fill, fmt_bytes, is_ragged, log, mismatch, stack
from .wrapped import _already_collated, _Unbatched, _wrap

__all__ = [
    "STRATEGIES",
    "Prepared",
    "clear_builds",
    "estimate_build_s",
    "holds_cuda_tensors",
    "prepare",
    "strategies",
]

STRATEGIES = ("none", "ram", "device")

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


class _Freshness:
    """What a build froze, and the dataset it froze it from (held weakly)."""

    def __init__(self, dataset: Any, plan: Plan) -> None:
        self.ref = _weak(dataset)
        self.plan = plan
        self.warned = False

    def reason(self) -> str | None:
        dataset = self.ref() if self.ref is not None else None
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
    freshness: _Freshness | None = field(default=None, repr=False, compare=False)

    def loader_parts(
        self, collate_fn: Callable[[Any], Any] | None = None
    ) -> tuple[Any, Callable[[Any], Any] | None]:
        """(dataset, collate_fn) to hand to a DataLoader, given the user's ``collate_fn`` (or None).

        Without one: the fastest path (whole batches gathered by index where the cache can, with a
        pass-through collate). With one: the user's function receives exactly the list of samples
        the original dataset would give (same types: ints stay ints), built from a batched gather
        unbound into samples, or per sample where the cache runs a random rest per sample.
        """
        if collate_fn is None:
            return self.dataset, self.collate_fn
        if self.collate_fn is None or not hasattr(self.dataset, "__getitems__"):
            return self.dataset, collate_fn
        return _Unbatched(self.dataset), collate_fn

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
            warnings.warn(_stale_message(self.strategy, reason), StaleCacheWarning, stacklevel=2)
        return False


def _stale_message(strategy: str, reason: str) -> str:
    return (
        f"the pretransform={strategy!r} cache no longer matches its dataset: {reason}; it is rebuilt"
        " when the next loader is made (prepare), and a loader made before the change still serves"
        " the old samples"
    )


# ------------------------------------------------------------------------------------------ build


def _samples(source: Any, plan: Plan) -> Iterator[Any]:
    """Every sample through the prefix, in order; read by worker processes when that pays."""
    view = PrefixView(source, plan.prefix, plan.field)
    yield from _read(view, plan.length)


def _table_rows(plan: Plan) -> Iterator[dict[str, Any]]:
    yield from _read(plan.source, plan.length)


def _read(view: Any, n: int) -> Iterator[Any]:
    """``view[0], view[1], ...``: in this process, or in order from worker processes.

    The build is one pass of decoding over the whole data set; on a machine with several CPUs the
    workers share it (the prefix is deterministic, so where it runs changes nothing).
    """
    workers = min(MAX_BUILD_WORKERS, usable_cpu_count())
    if n < PARALLEL_BUILD_SAMPLES or workers < 2:
        if hasattr(view, "__getitems__"):  # a table: rows read a batch at a time
            for start in range(0, n, TABLE_READ_ROWS):
                yield from view.__getitems__(list(range(start, min(n, start + TABLE_READ_ROWS))))
        else:
            for i in range(n):
                yield view[i]
        return
    loader = DataLoader(
        view, batch_size=BUILD_CHUNK, num_workers=workers, collate_fn=_as_list, prefetch_factor=4
    )
    for chunk in loader:
        yield from chunk


def _as_list(samples: list[Any]) -> list[Any]:
    return samples


def _subclasses(plan: Plan) -> tuple[type, ...]:
    first = plan.probe[0]
    fs = list(first) if isinstance(first, (tuple, list)) else [first]
    return tuple(type(v) if isinstance(v, torch.Tensor) else torch.Tensor for v in fs)


def _build_ram(
    dataset: Any, plan: Plan, budget: int | None, progress: ProgressFn | None
) -> tuple[Any, int]:
    """The wrapped dataset over a cache in shared memory, and the bytes it holds."""
    expected = plan.estimate()
    capacity = int(RAGGED_HEADROOM * (expected.mean + expected.spread) * plan.length)
    if plan.table is not None:
        wrapped = wrap_table(
            plan, _table_rows(plan), share=True, capacity_bytes=capacity, budget_bytes=budget,
            progress=progress,
        )
        return wrapped, sum(c.nbytes for c in wrapped.fields)
    source = plan.source if plan.source is not None else dataset
    with rng_preserved():
        try:
            fields, held = fill(
                _samples(source, plan), plan.layout, plan.length, subclasses=_subclasses(plan),
                share=True, capacity_bytes=capacity, budget_bytes=budget, progress=progress,
            )
        except ShapeChanged as err:
            # The probes all had one shape, a later sample another: the same samples, stored
            # ragged (per sample, as proven; only the batched gather is lost). Read once more.
            log.info("%s: storing field(s) %s ragged and reading the samples again", err, err.fields)
            plan.layout = as_ragged(plan.layout, err.fields)
            fields, held = fill(
                _samples(source, plan), plan.layout, plan.length, subclasses=_subclasses(plan),
                share=True, capacity_bytes=capacity, budget_bytes=budget, progress=progress,
            )
    return _wrap(fields, plan.layout, plan), held


def _build_device(dataset: Any, plan: Plan, device: torch.device) -> tuple[Any, int]:
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
    return _wrap(fields, layout, plan), sum(f.numel() * f.element_size() for f in fields)


def _build(
    dataset: Any, plan: Plan, strategy: str, device: torch.device, budget: int | None,
    progress: ProgressFn | None,
) -> Prepared:
    t0 = time.perf_counter()
    if strategy == "ram":
        wrapped, held = _build_ram(dataset, plan, budget, progress)
    else:
        wrapped, held = _build_device(dataset, plan, device)
    plan.real_bytes = held
    # What the cache froze is the state the build left: a frozen step that counts its own calls
    # has counted the build's, and only a change after this point makes the cache stale.
    plan.fingerprint = fingerprint(dataset, plan)
    expected = plan.estimate().total
    detail = plan.detail
    if is_ragged(plan.layout) or plan.table is not None:
        detail += f" ({fmt_bytes(held)} held, {fmt_bytes(expected)} estimated)"
    cached_batches = hasattr(wrapped, "__getitems__") and not getattr(wrapped, "returns_samples", False)
    return Prepared(
        dataset=wrapped,
        strategy=strategy,
        collate_fn=_already_collated if cached_batches else None,
        build_s=time.perf_counter() - t0,
        nbytes=held,
        detail=detail,
        freshness=_Freshness(dataset, plan),
    )


def estimate_build_s(dataset: Dataset[Any]) -> float | None:
    """Seconds a cache build would take: a few samples read and pre-transformed, times the length.

    ``None`` when the dataset cannot be cached at all. Like the memory estimate, it assumes the
    probed samples are typical; a dataset whose early samples are cached by the OS reads faster here.
    """
    plan, _ = _plan_for(dataset)
    if plan.reason is not None:
        return None
    source = plan.source if plan.source is not None else dataset
    indices = probe_indices(plan.length)
    with rng_preserved():
        t0 = time.perf_counter()
        for i in indices:
            apply_field(plan.prefix, source[i], plan.field)
        per_sample = (time.perf_counter() - t0) / len(indices)
    return per_sample * plan.length


# ------------------------------------------------------------------------- reuse, weakly keyed

_lock = threading.Lock()
_plans: dict[int, tuple[weakref.ref[Any], Plan]] = {}
_builds: dict[tuple[int, str, str], tuple[weakref.ref[Any], Plan, Prepared]] = {}


def _forget(key_id: int, lock: Any = _lock, plans: Any = _plans, builds: Any = _builds) -> None:
    # The stores are bound as defaults: at interpreter exit, module globals may already be None.
    with lock:
        plans.pop(key_id, None)
        for key in [k for k in builds if k[0] == key_id]:
            del builds[key]


def _weak(dataset: Any) -> weakref.ref[Any] | None:
    """A weak reference that drops the dataset's plans and caches when it is collected."""
    key_id = id(dataset)
    forget = _forget
    try:
        return weakref.ref(dataset, lambda _: forget(key_id))
    except TypeError:
        return None  # not weakly referenceable: plans and builds are then not reused


def _plan_for(dataset: Any) -> tuple[Plan, str | None]:
    """The dataset's plan, made again when what the stored one froze changed (and why it did)."""
    with _lock:
        entry = _plans.get(id(dataset))
    stale = None
    if entry is not None and entry[0]() is dataset:
        stale = stale_reason(dataset, entry[1]) if entry[1].reason is None else None
        if stale is None:
            return entry[1], None
    plan = make_plan(dataset)
    ref = _weak(dataset) if plan.reason is None else None
    if ref is not None:
        with _lock:
            _plans[id(dataset)] = (ref, plan)
    return plan, stale


def clear_builds() -> None:
    """Drop every stored cache and plan (their memory is freed once no loader uses them)."""
    with _lock:
        _plans.clear()
        _builds.clear()


# ------------------------------------------------------------------------------------ interface


def strategies(
    dataset: Dataset[Any],
    *,
    cuda: bool,
    memory_budget_bytes: int | None = None,
    device_memory_budget_bytes: int | None = None,
) -> dict[str, str | None]:
    """Every strategy mapped to ``None`` when usable for ``dataset``, else the reason it is refused.

    Cheap: it reads a few samples (PROBE_SAMPLES, through the deterministic prefix). The memory a
    cache needs is estimated from them: bytes per sample times ``len(dataset)``, exact for fixed-size
    samples, the probes' mean for samples of their own sizes (the spread is reported). Once a cache
    was built, its real size replaces the estimate; a build that outgrows ``memory_budget_bytes``
    stops and is refused with the real figures.
    """
    reasons: dict[str, str | None] = {"none": None}
    plan, _ = _plan_for(dataset)
    if plan.reason is None:
        plan.budget_bytes = memory_budget_bytes
    budgets = {
        "ram": (memory_budget_bytes, "memory budget"),
        "device": (device_memory_budget_bytes, "device memory budget"),
    }
    for strategy, (budget, what) in budgets.items():
        if strategy == "device" and not cuda:
            reasons[strategy] = "needs CUDA"
        elif plan.reason is not None:
            reasons[strategy] = plan.reason
        elif strategy == "device" and (plan.table is not None or is_ragged(plan.layout)):
            reasons[strategy] = (
                "samples of their own sizes (decoded images) are cached in RAM only; use"
                " pretransform='ram'"
            )
        elif budget is not None and (need := _needed(plan)) > budget:
            how = "measured when it was built" if plan.real_bytes is not None else plan.estimate().describe()
            reasons[strategy] = (
                f"a cache would need ~{fmt_bytes(need)} ({how}), over the {what} of {fmt_bytes(budget)}"
            )
        else:
            reasons[strategy] = None
    return reasons


def _needed(plan: Plan) -> int:
    return plan.real_bytes if plan.real_bytes is not None else plan.estimate().total


def prepare(
    dataset: Dataset[Any],
    strategy: str,
    *,
    device: torch.device,
    memory_budget_bytes: int | None = None,
    progress: ProgressFn | None = None,
) -> Prepared:
    """The dataset to load with ``strategy``; a cache is built once per process and dataset.

    ``ram`` caches on the CPU in shared memory (forked workers read it without a copy); ``device``
    caches on ``device`` (``num_workers=0``; a CPU device is accepted as a stand-in). A second call
    for the same dataset object, strategy and device returns the first build while the dataset is
    alive and nothing the cache froze has changed (NOTE [ Fresh caches ]); after a change it warns
    (StaleCacheWarning, naming what changed) and builds again. A build stops when it outgrows
    ``memory_budget_bytes`` (by default the budget last given to ``strategies``); ``progress`` is
    called with (samples done, samples in all) while it runs. Raises ``ConfigurationError`` for an
    unknown strategy and ``CandidateInfeasible`` when the dataset cannot be cached.
    """
    if strategy not in STRATEGIES:
        raise ConfigurationError(
            f"pretransform={strategy!r} is not a pre-transform strategy; use one of {STRATEGIES}"
            " ('none' runs the transform per sample as given)."
        )
    if strategy == "none":
        return Prepared(dataset=dataset, strategy="none")
    device = torch.device(device)
    key = (id(dataset), strategy, str(device) if strategy == "device" else "cpu")
    with _lock:
        entry = _builds.get(key)
    plan, stale = _plan_for(dataset)
    if entry is not None and entry[0]() is dataset:
        if entry[1] is plan:
            return entry[2]
        if stale is not None:
            warnings.warn(_stale_message(strategy, stale), StaleCacheWarning, stacklevel=2)
    if plan.reason is not None:
        raise CandidateInfeasible(f"pretransform={strategy!r}: {plan.reason}")
    if strategy == "device" and (plan.table is not None or is_ragged(plan.layout)):
        raise CandidateInfeasible(
            "pretransform='device': samples of their own sizes (decoded images) are cached in RAM"
            " only; use pretransform='ram'"
        )
    budget = memory_budget_bytes if memory_budget_bytes is not None else plan.budget_bytes
    prepared = _build(dataset, plan, strategy, device, budget if strategy == "ram" else None, progress)
    ref = _weak(dataset)
    if ref is not None:
        with _lock:
            _builds[key] = (ref, plan, prepared)
    return prepared


def _contains_cuda(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_contains_cuda(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_contains_cuda(v) for v in obj)
    return False


def holds_cuda_tensors(dataset: Dataset[Any]) -> bool:
    """Whether the first sample holds a CUDA tensor (then workers would fail to share it)."""
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - the measurement will raise the user's error properly
        return False
    return _contains_cuda(sample)
