"""Planning and proof: how a dataset can be cached, checked before anything is cached.

See NOTE [ Pre-transform split ] in ``__init__.py`` for the rules, and NOTE [ Fresh caches ] in
``fresh.py`` for what a plan records of what it freezes.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, IterableDataset
from torch.utils.data._utils.collate import default_collate

from . import sources
from .fresh import (
    Part,
    dataset_parts,
    difference,
    identity_part,
    opaque_reason,
    opened_files,
    step_parts,
    value_part,
)
from .steps import (
    DETERMINISTIC,
    PER_PIXEL,
    SELECTING,
    Chain,
    apply_steps,
    is_torchvision,
    known_random,
    step_name,
    unpadded_crop,
)
from .stores import Estimate, Layout, estimate, fill, layout_of, tensor_types
from .wrapped import CachedRows, wrap_fields

PROBE_SAMPLES = 8
"""Samples read to plan, prove and size a cache: enough to see a varying shape, cheap on every run."""

CHECK_SAMPLES = 4
"""Of the probe samples, how many the end-to-end proof compares (under each of CHECK_SEEDS)."""

PROBE_SEEDS = (0, 1, 12345)
"""RNG states under which a step must give identical outputs to count as deterministic."""

CHECK_SEEDS = (7, 2024)
"""Seeds under which the cached pipeline must reproduce ``dataset[i]`` exactly."""

DECODE_TIMINGS = 3
"""Times the probes' raw read and full sample are timed to decide whether decoding is the cost."""


@dataclass
class CachePlan:
    """How to cache one dataset (see NOTE [ Pre-transform split ])."""

    reason: str | None
    """Why nothing can be cached; None when a cache can be built."""
    source: Any = None
    """Raw samples: a shallow copy of the dataset without its transform; None: the dataset itself.
    Never the dataset itself, which the stored plan must not keep alive."""
    prefix: tuple[Callable[[Any], Any], ...] = ()
    suffix: Chain | None = None
    field: int | None = None
    """Which field of a tuple sample the transform applies to; None: the sample itself."""
    probe: tuple[Any, ...] = ()
    """The probe samples through the prefix: the per-sample layout and the memory estimate."""
    detail: str = ""
    length: int = 0
    table: sources.Table | None = None
    """For a Hugging Face table: what is cached and the transform that still runs per access."""
    frozen: tuple[tuple[str, Any], ...] = ()
    """(label, step) of the user's steps whose parameters the cache froze (the prefix, and steps
    the plan rebuilt)."""
    fingerprint: tuple[Part, ...] = ()
    real_bytes: int | None = None
    """What a build of this plan held, once one was made (the estimate is then replaced by it)."""
    layout: Layout = dataclasses.field(default_factory=list)

    def estimate(self) -> Estimate:
        if self.table is not None:  # only the image columns are stored ragged
            images = tuple(tuple(row[c] for c in self.table.images) for row in self.probe)
            return estimate(images, self.layout, self.length)
        return estimate(self.probe, self.layout, self.length)


# ------------------------------------------------------------------------------------ randomness


@contextlib.contextmanager
def rng_preserved() -> Iterator[None]:
    """Leave Python's, NumPy's and torch's CPU RNG states as they were, whatever runs inside."""
    torch_state = torch.default_generator.get_state()
    py_state = random.getstate()
    np_state = np.random.get_state()
    try:
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        random.setstate(py_state)
        np.random.set_state(np_state)


def _seed(seed: int) -> None:
    # The CPU generator only: seeding CUDA would touch state this module cannot restore.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


def same(a: Any, b: Any) -> bool:
    """Exact equality of samples: tensors by dtype, shape and value; PIL images by bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and bool(np.array_equal(a, b))
        )
    if hasattr(a, "tobytes") and hasattr(a, "mode") and hasattr(a, "size"):  # PIL.Image
        return (
            hasattr(b, "tobytes")
            and hasattr(b, "mode")
            and a.mode == b.mode
            and a.size == b.size
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _deterministic(fn: Callable[[Any], Any], inputs: Sequence[Any]) -> bool:
    """Whether ``fn`` gives identical outputs for ``inputs`` under every state in PROBE_SEEDS."""
    with rng_preserved():
        first: list[Any] | None = None
        for seed in PROBE_SEEDS:
            _seed(seed)
            outs = [fn(copy.deepcopy(x)) for x in inputs]  # a copy: the step may work in place
            if first is None:
                first = outs
            elif not all(map(same, first, outs)):
                return False
    return True


# ------------------------------------------------------------------------------------------ proof


def apply_field(prefix: Sequence[Callable[[Any], Any]], sample: Any, field: int | None) -> Any:
    if field is None:
        return apply_steps(prefix, sample)
    out = list(sample)
    out[field] = apply_steps(prefix, out[field])
    return type(sample)(out)


class PrefixView(Dataset[Any]):
    """``source[i]`` through the prefix: what a build stores (module-level, for worker processes)."""

    def __init__(self, source: Any, prefix: Sequence[Callable[[Any], Any]], field: int | None) -> None:
        self.source, self.prefix, self.field = source, tuple(prefix), field

    def __len__(self) -> int:
        return len(self.source)

    def __getitem__(self, index: int) -> Any:
        return apply_field(self.prefix, self.source[index], self.field)


def probe_indices(n: int) -> list[int]:
    m = min(PROBE_SAMPLES, n)
    if m <= 1:
        return [0]
    return sorted({round(k * (n - 1) / (m - 1)) for k in range(m)})


def wrap_probes(plan: CachePlan) -> Any:
    """The wrapped dataset over the probe samples only (what the proof runs)."""
    if plan.table is not None:
        return wrap_table(plan, plan.probe, share=False)
    fields, _ = fill(
        plan.probe, plan.layout, len(plan.probe), subclasses=tensor_types(plan.probe[0]), share=False
    )
    return wrap_fields(fields, plan.layout, plan)


def wrap_table(plan: CachePlan, rows: Any, *, share: bool, **fill_kwargs: Any) -> CachedRows:
    """A table's cached rows: images in ragged columns, the other columns as plain lists."""
    table = plan.table
    if table is None:
        raise TypeError("wrap_table needs a plan made for a Hugging Face table")
    rows = list(rows) if isinstance(rows, tuple) else rows
    images: dict[str, Any] = {}
    others: dict[str, list[Any]] = {c: [] for c in table.columns if c not in table.images}

    def image_rows() -> Iterator[tuple[Any, ...]]:
        for row in rows:
            for c in others:
                others[c].append(row[c])
            yield tuple(row[c] for c in table.images)

    layout = [("pil", None, torch.uint8)] * len(table.images)
    fields, _ = fill(
        image_rows(),
        layout,
        len(rows) if isinstance(rows, list) else plan.length,  # the probes, or the whole table read
        subclasses=(torch.Tensor,) * len(layout),
        share=share,
        **fill_kwargs,
    )
    images = dict(zip(table.images, fields, strict=True))
    return CachedRows(table.columns, images, others, table.transform, len(fields[0]))


def prove(dataset: Any, plan: CachePlan, indices: Sequence[int], wrapped: Any = None) -> bool:
    """Whether the wrapped dataset built from the probes (``wrap_probes``, or ``wrapped``: item ``j``
    standing for ``dataset[indices[j]]``) reproduces ``dataset`` exactly."""
    if wrapped is None:
        wrapped = wrap_probes(plan)
    k = min(CHECK_SAMPLES, len(indices))
    with rng_preserved():
        for seed in CHECK_SEEDS:
            for j in range(k):
                _seed(seed + j)
                expected = dataset[indices[j]]
                _seed(seed + j)
                if not same(wrapped[j], expected):
                    return False
            if hasattr(wrapped, "__getitems__"):
                # A batch draws its random numbers sample after sample, as the original does.
                _seed(seed)
                if getattr(wrapped, "returns_samples", False):
                    expected_batch = dataset.__getitems__(list(indices[:k]))
                else:
                    expected_batch = default_collate([dataset[i] for i in indices[:k]])
                _seed(seed)
                if not same(wrapped.__getitems__(list(range(k))), expected_batch):
                    return False
    return True


# --------------------------------------------------------------------------------------- planning


def _decode_worth_caching(dataset: Any, source: sources.Source, indices: Sequence[int]) -> bool:
    """Whether caching raw samples alone (nothing of the transform) saves enough to offer."""
    if source.decodes:
        return True
    raw_s = full_s = float("inf")
    with rng_preserved():
        for _ in range(DECODE_TIMINGS):  # the least of each: a busy machine only ever adds time
            t0 = time.perf_counter()
            for i in indices:
                source.raw[i]
            t1 = time.perf_counter()
            for i in indices:
                dataset[i]
            t2 = time.perf_counter()
            raw_s, full_s = min(raw_s, (t1 - t0) / len(indices)), min(full_s, (t2 - t1) / len(indices))
    return raw_s >= sources.MIN_DECODE_S and raw_s >= sources.MIN_DECODE_SHARE * full_s


def _split(dataset: Any, source: sources.Source, indices: list[int], field: int | None) -> list[CachePlan]:
    """Candidate plans for a transform pipeline, best first (see NOTE [ Pre-transform split ])."""
    steps, raw = source.steps, source.raw
    inputs = [raw[i] if field is None else raw[i][field] for i in indices]
    values = list(inputs)
    lead = 0
    unseen = None
    for k, step in enumerate(steps):
        if known_random(step):
            break
        known = is_torchvision(step) and step_name(step) in DETERMINISTIC
        if not known and not _deterministic(step, values):
            break
        # A step whose inputs cannot be fingerprinted is not frozen: the prefix stops before it.
        if (unseen := opaque_reason(step_parts(_label(k, step), step), _label(k, step))) is not None:
            break
        values = [step(x) for x in values]
        lead += 1
    plans: list[tuple[list[Any], list[Any]]] = []  # (prefix, suffix)

    # Reordering: selecting steps, then per-pixel steps that can move ahead of them.
    selecting: list[tuple[int, Any]] = []
    moved: list[tuple[int, Any]] = []
    stop = lead
    for k in range(lead, len(steps)):
        step, name = steps[k], step_name(steps[k])
        if is_torchvision(step) and name in SELECTING:
            selecting.append((k, step))
        elif is_torchvision(step) and name in PER_PIXEL and selecting:
            moved.append((k, step))
        else:
            break
        stop = k + 1
    if moved:
        suffix: list[Any] = []
        for k, step in selecting:
            if step_name(step) != "RandomCrop":
                suffix.append(step)
                continue
            before = [s for j, s in moved if j < k]
            after = [s for j, s in moved if j > k]
            try:
                parts = unpadded_crop(step, apply_steps(before, values[0]), after)
            except Exception:  # noqa: BLE001 - an unusual fill or image type: no reordering then
                parts = None
            if parts is None:
                break
            suffix.extend(parts)
        else:
            plans.append((steps[:lead] + [s for _, s in moved], suffix + steps[stop:]))
    if lead or _decode_worth_caching(dataset, source, indices):
        plans.append((steps[:lead], steps[lead:]))  # with no lead: the decoded samples alone

    out = []
    for prefix, rest in plans:
        probe = tuple(apply_field(prefix, raw[i], field) for i in indices)
        suffix_chain = Chain(rest) if rest else None
        cached = ", ".join(step_name(s) for s in prefix) or "decoded samples"
        detail = f"cached: {cached}; per sample: " + (
            repr(suffix_chain) if suffix_chain else "nothing (batches gathered by index)"
        )
        frozen = _labelled([s for s in steps if not any(s is r for r in rest)], steps)
        out.append(
            CachePlan(None, raw, tuple(prefix), suffix_chain, field, probe, detail, length=len(dataset),
                 frozen=frozen)
        )
    if not out:
        first = steps[0]
        if unseen is not None:
            out.append(CachePlan(f"the transform's {unseen}"))
            return out
        why = (
            "is random"
            if known_random(first)
            else "is not proven deterministic (its output changed under different random states)"
        )
        out.append(
            CachePlan(
                f"the transform {why} from its first step ({step_name(first)}): nothing deterministic"
                " to cache"
            )
        )
    return out


def _layout_reason(plan: CachePlan) -> str | None:
    """Lay out ``plan``'s probes; the reason they cannot be stored, or None."""
    if plan.reason is not None:
        return plan.reason
    layout, reason = layout_of(plan.probe)
    plan.layout = layout
    return reason


def make_cache_plan(dataset: Any) -> CachePlan:
    """Decide how ``dataset`` can be cached (see NOTE [ Pre-transform split ]); a dataset whose
    samples read files it does not list is not (NOTE [ Fresh caches ] 4). The samples it reads leave
    the process-wide random states as they were: a sample that draws from them without its value
    showing it (a random step that did nothing) proves deterministic, and the reads of its probe
    would otherwise move the user's shuffle (NOTE [ The drop-in's contract ] in loader.py)."""
    with opened_files() as opened, rng_preserved():
        plan = _make_cache_plan(dataset)
    # A table is fingerprinted whole (its own fingerprint), whatever files it reads.
    if (plan.reason is None and plan.table is None
            and (reason := sources.unlisted_reads(dataset, opened.paths)) is not None):
        return CachePlan(reason)
    return plan


def _make_cache_plan(dataset: Any) -> CachePlan:
    if isinstance(dataset, IterableDataset):
        return CachePlan("IterableDataset: an unbounded stream is never pre-cached")
    try:
        n = len(dataset)
    except TypeError:
        return CachePlan("dataset has no __len__")
    if n == 0:
        return CachePlan("the dataset is empty")
    indices = probe_indices(n)
    reasons: list[str] = []
    try:
        if sources.is_table(dataset):
            return _table_plan(dataset, indices, n)
        if (unseen := opaque_reason(dataset_parts(dataset), "dataset[i]")) is not None:
            return CachePlan(unseen)
        source = sources.vision_source(dataset)
        if source is not None:
            raw = source.raw
            field = 0 if isinstance(raw[indices[0]], (tuple, list)) else None
            if not _deterministic(lambda i: raw[i], indices):
                reasons.append("dataset[i] without its transform is random: nothing to cache")
            else:
                for plan in _split(dataset, source, indices, field):
                    if (reason := _layout_reason(plan)) is not None:
                        reasons.append(reason)
                    elif prove(dataset, plan, indices):
                        plan.fingerprint = fingerprint(dataset, plan)
                        return plan
        # The whole sample as the unit, when dataset[i] itself is deterministic.
        if _deterministic(lambda i: dataset[i], indices):
            probe = tuple(dataset[i] for i in indices)
            plan = CachePlan(None, None, probe=probe, detail="cached: whole samples", length=n)
            every = [s for t in sources.transforms_of(dataset) if t is not None
                     for s in sources.transform_steps(t)]
            plan.frozen = _labelled(every, every)
            frozen_parts = [p for label, step in plan.frozen for p in step_parts(label, step)]
            if (reason := opaque_reason(frozen_parts, "the whole sample's transform")) is not None:
                reasons.insert(0, reason)
            elif (reason := _layout_reason(plan)) is not None:
                reasons.insert(0, reason)  # the whole sample's layout says most
            elif prove(dataset, plan, indices):
                plan.fingerprint = fingerprint(dataset, plan)
                return plan
    except Exception as err:  # noqa: BLE001 - the `none` measurement raises the user's error itself
        return CachePlan(f"reading samples to plan a cache raised {type(err).__name__}: {err}")
    if reasons:
        return CachePlan(reasons[0])
    return CachePlan(
        "dataset[i] changed under different random states and its transform could not be split:"
        " nothing deterministic to cache"
    )


def _table_plan(dataset: Any, indices: list[int], n: int) -> CachePlan:
    table, reason = sources.table_source(dataset)
    if table is None:
        return CachePlan(reason)
    probe = tuple(table.raw[i] for i in indices)
    what = ", ".join(table.images)
    per = "the table's transform" if table.transform is not None else "nothing"
    plan = CachePlan(
        None, table.raw, probe=probe, length=n, table=table,
        detail=f"cached: decoded images ({what}); per sample: {per}",
        layout=[("pil", None, torch.uint8)] * len(table.images),
    )
    for row in probe:
        for c in table.images:
            layout_reason = layout_of([row[c]])[1]
            if layout_reason:
                return CachePlan(f"column {c!r}: {layout_reason.replace('each sample', 'its image')}")
    if not prove(dataset, plan, indices):
        return CachePlan(
            "the table's transform gave different outputs on cached rows than on the table's own"
            " (it may depend on more than the row's values): nothing cached"
        )
    plan.fingerprint = fingerprint(dataset, plan)
    return plan


def fingerprint(dataset: Any, plan: CachePlan) -> tuple[Part, ...]:
    """What ``plan`` freezes of ``dataset``, now (see NOTE [ Fresh caches ])."""
    if plan.table is not None:
        return tuple(sources.table_identity(dataset))
    transforms = sources.transforms_of(dataset)
    steps = [s for t in transforms if t is not None for s in sources.transform_steps(t)]
    transform = transforms[0] if len(transforms) == 1 else tuple(transforms)
    parts = [identity_part("the transform", transform=transform, steps=tuple(steps))]
    for label, step in plan.frozen:
        parts += step_parts(label, step)
    parts += [value_part("the dataset", length=len(dataset)), *dataset_parts(dataset)]
    return (*parts, *sources.file_parts(dataset))


def _labelled(frozen: Sequence[Any], steps: Sequence[Any]) -> tuple[tuple[str, Any], ...]:
    """Each frozen step with its place in the pipeline, for staleness messages."""
    return tuple((_label(next(k for k, s in enumerate(steps) if s is step), step), step) for step in frozen)


def _label(k: int, step: Any) -> str:
    return f"step {k} ({step_name(step)})"


def stale_reason(dataset: Any, plan: CachePlan) -> str | None:
    """What changed in ``dataset`` since ``plan`` was made; None when nothing it froze did."""
    try:
        now = fingerprint(dataset, plan)
    except Exception as err:  # noqa: BLE001 - a dataset that cannot be fingerprinted now is not fresh
        return f"the dataset could not be fingerprinted ({type(err).__name__}: {err})"
    return difference(plan.fingerprint, now)
