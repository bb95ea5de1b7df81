"""Where the per-sample transform runs: ``none`` (per sample, in the workers), ``ram``, ``device``.

Interface used by the rest of the package (keep these names and shapes):

- ``strategies(dataset, *, cuda, memory_budget_bytes, device_memory_budget_bytes) -> dict[str, str|None]``
  every strategy name mapped to ``None`` when usable for this dataset, or the reason it is refused.
- ``prepare(dataset, strategy, *, device) -> Prepared``: the wrapped dataset (built once per process
  and dataset, then reused), the collate function to use with it, the build time and the cache size.
- ``holds_cuda_tensors(dataset) -> bool``: samples already live on an accelerator (no workers then).

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
# 3. Proof: every plan is checked before use. The wrapped dataset built from the probe samples must
#    return exactly ``dataset[i]`` (and, without a suffix, exactly the default-collated batch) under
#    the same seed. A reordered plan that fails falls back to the plain prefix, which falls back to
#    caching whole samples (only if ``dataset[i]`` itself is proven deterministic), which falls back to
#    a refusal. Nothing is ever cached on an unproven claim.
# The proof is only as good as its probes: hidden randomness that rarely shows (say, one call in a
# thousand), or that draws from outside Python's, NumPy's and torch's RNGs, can escape it.
"""

from __future__ import annotations

import contextlib
import copy
import random
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info
from torch.utils.data._utils.collate import default_collate

from .exceptions import CandidateInfeasible, ConfigurationError

try:  # torchvision is a dependency, NumPy comes with it; both are used only when present
    import numpy as np
except ImportError:  # pragma: no cover
    np = None  # type: ignore[assignment]

STRATEGIES = ("none", "ram", "device")

PROBE_SAMPLES = 8
"""Samples read to plan, prove and size a cache: enough to see a varying shape, cheap on every run."""

CHECK_SAMPLES = 4
"""Of the probe samples, how many the end-to-end proof compares (under each of CHECK_SEEDS)."""

PROBE_SEEDS = (0, 1, 12345)
"""RNG states under which a step must give identical outputs to count as deterministic."""

CHECK_SEEDS = (7, 2024)
"""Seeds under which the cached pipeline must reproduce ``dataset[i]`` exactly."""

STAGING_BYTES = 64 * 2**20
"""Samples are gathered on the CPU in chunks of about this size before a copy to the device."""

_DETERMINISTIC = frozenset(
    {
        "ToTensor",
        "PILToTensor",
        "ToImage",
        "ToDtype",
        "ConvertImageDtype",
        "Normalize",
        "Resize",
        "CenterCrop",
        "Grayscale",
        "Pad",
        "ToPureTensor",
    }
)
"""torchvision steps whose output depends on their input only."""

_PER_PIXEL = frozenset(
    {"ToTensor", "PILToTensor", "ToImage", "ToDtype", "ConvertImageDtype", "Normalize", "ToPureTensor"}
)
"""Deterministic steps that map each pixel on its own: they commute with selecting pixels."""

_SELECTING = frozenset({"RandomHorizontalFlip", "RandomVerticalFlip", "RandomCrop"})
"""Random steps that only select (and move) pixels: they commute with per-pixel steps."""

_RANDOM = frozenset(
    {
        "ColorJitter",
        "GaussianBlur",
        "GaussianNoise",
        "AutoAugment",
        "RandAugment",
        "TrivialAugmentWide",
        "AugMix",
        "ElasticTransform",
        "MixUp",
        "CutMix",
        "JPEG",
    }
)
"""torchvision steps that are random without a Random* name."""


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


# --------------------------------------------------------------------------------------- helpers


def _fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


def _name(step: Any) -> str:
    return type(step).__name__


def _is_torchvision(step: Any) -> bool:
    # Exact torchvision classes only: a user's subclass may add randomness, so it gets probed.
    return type(step).__module__.startswith("torchvision.transforms")


def _known_random(step: Any) -> bool:
    name = _name(step)
    return name.startswith("Random") or (_is_torchvision(step) and name in _RANDOM)


@contextlib.contextmanager
def _rng_preserved() -> Iterator[None]:
    """Leave Python's, NumPy's and torch's CPU RNG states as they were, whatever runs inside."""
    torch_state = torch.default_generator.get_state()
    py_state = random.getstate()
    np_state = np.random.get_state() if np is not None else None
    try:
        yield
    finally:
        torch.default_generator.set_state(torch_state)
        random.setstate(py_state)
        if np is not None:
            np.random.set_state(np_state)


def _seed(seed: int) -> None:
    # The CPU generator only: seeding CUDA would touch state this module cannot restore.
    torch.default_generator.manual_seed(seed)
    random.seed(seed)
    if np is not None:
        np.random.seed(seed)


def _same(a: Any, b: Any) -> bool:
    """Exact equality of samples: tensors by dtype, shape and value; PIL images by bytes."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return (
            isinstance(a, torch.Tensor)
            and isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and bool(torch.equal(a.detach().cpu(), b.detach().cpu()))
        )
    if np is not None and (isinstance(a, np.ndarray) or isinstance(b, np.ndarray)):
        return (
            isinstance(a, np.ndarray)
            and isinstance(b, np.ndarray)
            and a.dtype == b.dtype
            and bool(np.array_equal(a, b))
        )
    if hasattr(a, "tobytes") and hasattr(a, "mode") and hasattr(a, "size"):  # PIL.Image
        return (
            type(a) is type(b)
            and a.mode == b.mode
            and a.size == b.size
            and a.tobytes() == b.tobytes()
        )
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and bool(a == b)


def _deterministic(fn: Callable[[Any], Any], inputs: Sequence[Any]) -> bool:
    """Whether ``fn`` gives identical outputs for ``inputs`` under every state in PROBE_SEEDS."""
    with _rng_preserved():
        first: list[Any] | None = None
        for seed in PROBE_SEEDS:
            _seed(seed)
            outs = [fn(copy.deepcopy(x)) for x in inputs]  # a copy: the step may work in place
            if first is None:
                first = outs
            elif not all(map(_same, first, outs)):
                return False
    return True


def _apply(steps: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for step in steps:
        x = step(x)
    return x


# ---------------------------------------------------------------------------- per-sample steps


class _Chain:
    """The random suffix: steps applied in order (picklable, for worker processes)."""

    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = tuple(steps)

    def __call__(self, x: Any) -> Any:
        return _apply(self.steps, x)

    def __repr__(self) -> str:
        return ", ".join(repr(s) if isinstance(s, (_PadFill, _PadMode)) else _name(s) for s in self.steps)


class _PadFill:
    """Constant padding in the mapped space: ``fill`` is the original fill mapped per channel."""

    def __init__(self, ltrb: tuple[int, int, int, int], fill: torch.Tensor) -> None:
        self.ltrb = ltrb
        self.fill = fill

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        left, top, right, bottom = self.ltrb
        *lead, h, w = img.shape
        out = torch.empty((*lead, h + top + bottom, w + left + right), dtype=img.dtype)
        out.copy_(self.fill.to(img.dtype).view(-1, 1, 1).expand_as(out))
        out[..., top : top + h, left : left + w] = img
        return out.as_subclass(type(img))

    def __repr__(self) -> str:
        return f"Pad({list(self.ltrb)}, fill={[round(float(v), 4) for v in self.fill]})"


class _PadMode:
    """Reflect/edge/symmetric padding: copies pixel values, so it commutes with per-pixel steps."""

    def __init__(self, pad: Callable[..., Any], padding: list[int], mode: str) -> None:
        self.pad = pad
        self.padding = padding
        self.mode = mode

    def __call__(self, img: Any) -> Any:
        return self.pad(img, self.padding, padding_mode=self.mode)

    def __repr__(self) -> str:
        return f"Pad({self.padding}, {self.mode})"


def _ltrb(padding: Any) -> tuple[int, int, int, int]:
    """torchvision's padding argument (int, or 1, 2 or 4 values) as (left, top, right, bottom)."""
    if isinstance(padding, int):
        return (padding,) * 4
    p = [int(v) for v in padding]
    if len(p) == 1:
        return (p[0],) * 4
    if len(p) == 2:
        return (p[0], p[1], p[0], p[1])
    if len(p) == 4:
        return (p[0], p[1], p[2], p[3])
    raise ValueError(f"padding={padding!r}")


def _unpadded_crop(step: Any, mapped_input: Any, moved_after: list[Any]) -> list[Any] | None:
    """``step`` (a RandomCrop) as [padding in the mapped space, the same crop unpadded], or None."""
    if step.pad_if_needed or isinstance(step.fill, dict):
        return None  # data-dependent padding, or per-type fills: not worth the risk, keep it as is
    crop = type(step)(step.size, padding=None, fill=step.fill, padding_mode=step.padding_mode)
    if step.padding is None:
        return [step]
    if "v2" in type(step).__module__:
        import torchvision.transforms.v2.functional as F2

        left, right, top, bottom = step.padding  # v2 stores [left, right, top, bottom]
        ltrb, pad = (left, top, right, bottom), F2.pad
    else:
        import torchvision.transforms.functional as F1

        ltrb, pad = _ltrb(step.padding), F1.pad
    if step.padding_mode != "constant":
        return [_PadMode(pad, list(ltrb), step.padding_mode), crop]
    # One pixel of fill in the original space, carried through the moved steps, gives the fill to
    # use in the mapped space (bit for bit what those steps make of it).
    corner = _apply(moved_after, pad(mapped_input, [1], fill=step.fill, padding_mode="constant"))
    if not (isinstance(corner, torch.Tensor) and corner.dim() == 3):
        return None
    return [_PadFill(ltrb, corner[:, 0, 0].clone()), crop]


# ------------------------------------------------------------------------------------- planning


@dataclass
class _Plan:
    """How to cache one dataset (see NOTE [ Pre-transform split ])."""

    reason: str | None
    """Why nothing can be cached; None when a cache can be built."""
    source: Any = None
    """Raw samples: a shallow copy of the dataset without its transform; None: the dataset itself.
    Never the dataset itself, which the stored plan must not keep alive."""
    prefix: tuple[Callable[[Any], Any], ...] = ()
    suffix: _Chain | None = None
    field: int | None = None
    """Which field of a tuple sample the transform applies to; None: the sample itself."""
    probe: tuple[Any, ...] = ()
    """The probe samples through the prefix: the per-sample layout and the memory estimate."""
    detail: str = ""
    transform: Any = None
    length: int = 0


def _transform_steps(transform: Any) -> list[Any]:
    steps = getattr(transform, "transforms", None)
    if _name(transform) == "Compose" and isinstance(steps, (list, tuple)):
        return [s for step in steps for s in _transform_steps(step)]
    return [transform]


def _raw_source(dataset: Any) -> Any | None:
    """A shallow copy of ``dataset`` that returns untransformed samples; None if none can be made."""
    try:
        raw = copy.copy(dataset)
        raw.transform = None
        joint = getattr(dataset, "transforms", None)
        if joint is not None:
            from torchvision.datasets.vision import StandardTransform

            if not isinstance(joint, StandardTransform):
                return None  # a joint (image, target) transform: not a pipeline on one field
            raw.transforms = StandardTransform(None, joint.target_transform)
    except Exception:  # noqa: BLE001 - slots, properties, odd classes: then the sample is the unit
        return None
    return raw


def _apply_field(prefix: Sequence[Callable[[Any], Any]], sample: Any, field: int | None) -> Any:
    if field is None:
        return _apply(prefix, sample)
    out = list(sample)
    out[field] = _apply(prefix, out[field])
    return type(sample)(out)


def _layout(samples: Sequence[Any]) -> tuple[list[tuple[str, Any, Any]], str | None]:
    """Per field: (kind, shape, dtype) shared by ``samples``; or the reason they cannot be stored."""
    first = samples[0]
    fields = list(first) if isinstance(first, (tuple, list)) else [first]
    layout: list[tuple[str, Any, Any]] = []
    for k, value in enumerate(fields):
        if isinstance(value, torch.Tensor):
            layout.append(("tensor", tuple(value.shape), value.dtype))
        elif isinstance(value, bool):
            layout.append(("bool", (), torch.bool))
        elif isinstance(value, int):
            layout.append(("int", (), torch.int64))
        elif isinstance(value, float):
            layout.append(("float", (), torch.float64))
        else:
            where = f"field {k} of each sample" if isinstance(first, (tuple, list)) else "each sample"
            return [], (
                f"{where} is a {type(value).__name__} where it would be cached; only tensors, ints"
                " and floats are cached"
            )
    for sample in samples[1:]:
        reason = _mismatch(layout, sample, isinstance(first, (tuple, list)))
        if reason:
            return [], f"{reason} (variable-size samples cannot share one contiguous cache)"
    return layout, None


def _mismatch(layout: list[tuple[str, Any, Any]], sample: Any, is_seq: bool) -> str | None:
    fields = list(sample) if is_seq else [sample]
    if len(fields) != len(layout):
        return f"samples have {len(layout)} and {len(fields)} fields"
    for k, ((kind, shape, dtype), value) in enumerate(zip(layout, fields, strict=True)):
        if kind == "tensor":
            if not isinstance(value, torch.Tensor):
                return f"field {k} is a tensor in one sample and a {type(value).__name__} in another"
            if tuple(value.shape) != shape or value.dtype != dtype:
                return (
                    f"field {k} is {tuple(value.shape)} {value.dtype} in one sample and"
                    f" {shape} {dtype} in another"
                )
        elif not _NUMBER_CHECKS[kind](value):
            return f"field {k} is a {kind} in one sample and a {type(value).__name__} in another"
    return None


_NUMBER_CHECKS: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, float),
}


def _probe_indices(n: int) -> list[int]:
    m = min(PROBE_SAMPLES, n)
    if m <= 1:
        return [0]
    return sorted({round(k * (n - 1) / (m - 1)) for k in range(m)})


def _prove(dataset: Any, plan: _Plan, indices: Sequence[int]) -> bool:
    """Whether the wrapped dataset built from the probes reproduces ``dataset`` exactly."""
    layout, reason = _layout(plan.probe)
    if reason:
        return True  # nothing will be built; the refusal carries the reason
    wrapped = _wrap(_store(plan.probe, layout, torch.device("cpu"), share=False), layout, plan)
    k = min(CHECK_SAMPLES, len(indices))
    with _rng_preserved():
        for seed in CHECK_SEEDS:
            for j in range(k):
                _seed(seed + j)
                expected = dataset[indices[j]]
                _seed(seed + j)
                if not _same(wrapped[j], expected):
                    return False
            if hasattr(wrapped, "__getitems__"):
                # A batch draws its random numbers sample after sample, as the original does.
                _seed(seed)
                expected_batch = default_collate([dataset[i] for i in indices[:k]])
                _seed(seed)
                if not _same(wrapped.__getitems__(list(range(k))), expected_batch):
                    return False
    return True


def _split(
    dataset: Any, steps: list[Any], raw: Any, indices: list[int], field: int | None
) -> list[_Plan]:
    """Candidate plans for a transform pipeline, best first (see NOTE [ Pre-transform split ])."""
    inputs = [raw[i] if field is None else raw[i][field] for i in indices]
    values = list(inputs)
    lead = 0
    for step in steps:
        if _known_random(step):
            break
        known = _is_torchvision(step) and _name(step) in _DETERMINISTIC
        if not known and not _deterministic(step, values):
            break
        values = [step(x) for x in values]
        lead += 1
    plans: list[tuple[list[Any], list[Any]]] = []  # (prefix, suffix)

    # Reordering: selecting steps, then per-pixel steps that can move ahead of them.
    selecting: list[tuple[int, Any]] = []
    moved: list[tuple[int, Any]] = []
    stop = lead
    for k in range(lead, len(steps)):
        step, name = steps[k], _name(steps[k])
        if _is_torchvision(step) and name in _SELECTING:
            selecting.append((k, step))
        elif _is_torchvision(step) and name in _PER_PIXEL and selecting:
            moved.append((k, step))
        else:
            break
        stop = k + 1
    if moved:
        suffix: list[Any] | None = []
        for k, step in selecting:
            if _name(step) != "RandomCrop":
                suffix.append(step)  # type: ignore[union-attr]
                continue
            before = [s for j, s in moved if j < k]
            after = [s for j, s in moved if j > k]
            try:
                parts = _unpadded_crop(step, _apply(before, values[0]), after)
            except Exception:  # noqa: BLE001 - an unusual fill or image type: no reordering then
                parts = None
            if parts is None:
                suffix = None
                break
            suffix.extend(parts)  # type: ignore[union-attr]
        if suffix is not None:
            plans.append((steps[:lead] + [s for _, s in moved], suffix + steps[stop:]))
    if lead:
        plans.append((steps[:lead], steps[lead:]))

    out = []
    for prefix, rest in plans:
        probe = tuple(_apply_field(prefix, raw[i], field) for i in indices)
        suffix_chain = _Chain(rest) if rest else None
        detail = f"cached: {', '.join(_name(s) for s in prefix)}; per sample: " + (
            repr(suffix_chain) if suffix_chain else "nothing (batches gathered by index)"
        )
        out.append(
            _Plan(None, raw, tuple(prefix), suffix_chain, field, probe, detail, length=len(dataset))
        )
    if not out:
        first = steps[0]
        why = (
            "is random"
            if _known_random(first)
            else "is not proven deterministic (its output changed under different random states)"
        )
        out.append(
            _Plan(
                f"the transform {why} from its first step ({_name(first)}): nothing deterministic"
                " to cache"
            )
        )
    return out


def _plan(dataset: Any) -> _Plan:
    """Decide how ``dataset`` can be cached (see NOTE [ Pre-transform split ])."""
    if isinstance(dataset, IterableDataset):
        return _Plan("IterableDataset: an unbounded stream is never pre-cached")
    try:
        n = len(dataset)
    except TypeError:
        return _Plan("dataset has no __len__")
    if n == 0:
        return _Plan("the dataset is empty")
    indices = _probe_indices(n)
    transform = getattr(dataset, "transform", None)
    reasons: list[str] = []
    try:
        raw = _raw_source(dataset) if transform is not None else None
        if raw is not None:
            field = 0 if isinstance(raw[indices[0]], (tuple, list)) else None
            if not _deterministic(lambda i: raw[i], indices):
                reasons.append("dataset[i] without its transform is random: nothing to cache")
            else:
                for plan in _split(dataset, _transform_steps(transform), raw, indices, field):
                    if plan.reason is not None:
                        reasons.append(plan.reason)
                    elif (layout_reason := _layout(plan.probe)[1]) is not None:
                        reasons.append(layout_reason)
                    elif _prove(dataset, plan, indices):
                        plan.transform = transform
                        return plan
        # The whole sample as the unit, when dataset[i] itself is deterministic.
        if _deterministic(lambda i: dataset[i], indices):
            probe = tuple(dataset[i] for i in indices)
            plan = _Plan(None, None, probe=probe, detail="cached: whole samples", length=n)
            if (layout_reason := _layout(plan.probe)[1]) is not None:
                reasons.insert(0, layout_reason)
            elif _prove(dataset, plan, indices):
                plan.transform = transform
                return plan
    except Exception as err:  # noqa: BLE001 - the `none` measurement raises the user's error itself
        return _Plan(f"reading samples to plan a cache raised {type(err).__name__}: {err}")
    if reasons:
        return _Plan(reasons[0])
    return _Plan(
        "dataset[i] changed under different random states and its transform could not be split:"
        " nothing deterministic to cache"
    )


# ------------------------------------------------------------------------------------ the cache


class _CachedSamples(Dataset[Any]):
    """Samples whose deterministic prefix was applied once; the random suffix runs per sample."""

    def __init__(
        self,
        fields: tuple[torch.Tensor, ...],
        layout: list[tuple[str, Any, Any]],
        is_seq: type | None,
        field: int | None,
        suffix: _Chain | None,
        subclasses: tuple[type, ...],
    ) -> None:
        self.fields = fields
        self.kinds = tuple(kind for kind, _, _ in layout)
        self.is_seq = is_seq
        self.field = field
        self.suffix = suffix
        self.subclasses = subclasses

    def __len__(self) -> int:
        return int(self.fields[0].shape[0])

    def __getitem__(self, index: int) -> Any:
        values: list[Any] = []
        for k, (data, kind) in enumerate(zip(self.fields, self.kinds, strict=True)):
            if kind == "tensor":
                # A copy: the suffix (or the caller) may work in place, and the cache is shared.
                x: Any = data[index].clone().as_subclass(self.subclasses[k])
                if self.suffix is not None and (self.field is None or self.field == k):
                    x = self.suffix(x)
                values.append(x)
            else:
                values.append(data[index].item())
        return self.is_seq(values) if self.is_seq is not None else values[0]


class _CachedBatches(_CachedSamples):
    """Fully cached samples: a batch is gathered with one indexing operation per field."""

    def __getitems__(self, indices: list[int]) -> Any:
        index = torch.as_tensor(indices, dtype=torch.long, device=self.fields[0].device)
        batch = [_gather(data, index) for data in self.fields]
        # As default_collate gives it: a list of fields for sequence samples, else the tensor.
        return batch if self.is_seq is not None else batch[0]


class _CachedCropFlipBatches(_CachedSamples):
    """A suffix of RandomCrop (padding constant, or none) and/or RandomHorizontalFlip, batched.

    The random numbers are drawn sample after sample with torchvision's own calls and order (the
    crop's two offsets, then the flip's coin), so a batch equals the per-sample pipeline under one
    seed (the plan's proof checks it); the pixel work is a fill, one window copy per sample, and
    one flip for the whole batch.
    """

    def __init__(
        self, *args: Any, fill: torch.Tensor | None, ltrb: tuple[int, ...], crop: Any, flip: Any
    ) -> None:
        super().__init__(*args)
        self.fill, self.ltrb, self.crop, self.flip = fill, ltrb, crop, flip

    def __getitems__(self, indices: list[int]) -> Any:
        k = self.field or 0
        data = self.fields[k]
        c, h, w = data.shape[1:]
        left, top, right, bottom = self.ltrb
        hp, wp = h + top + bottom, w + left + right
        th, tw = self.crop.size if self.crop is not None else (h, w)
        tops, lefts, flips = [], [], []
        for _ in indices:
            y = x = 0
            if self.crop is not None and (hp != th or wp != tw):
                y = int(torch.randint(0, hp - th + 1, size=(1,)).item())
                x = int(torch.randint(0, wp - tw + 1, size=(1,)).item())
            tops.append(y)
            lefts.append(x)
            flips.append(self.flip is not None and bool(torch.rand(1) < self.flip.p))
        index = torch.as_tensor(indices, dtype=torch.long)
        images = data.index_select(0, index)
        if self.fill is not None:  # the padded images, filled with the mapped fill
            padded = torch.empty((len(indices), c, hp, wp), dtype=data.dtype)
            padded.copy_(self.fill.to(data.dtype).view(1, c, 1, 1).expand_as(padded))
            padded[:, :, top : top + h, left : left + w] = images
            images = padded
        # One gather: per-sample rows and columns of the crop window, columns reversed when flipped.
        rows = torch.tensor(tops).view(-1, 1) + torch.arange(th)
        step = 1 - 2 * torch.tensor(flips, dtype=torch.long).view(-1, 1)
        cols = torch.tensor(lefts).view(-1, 1) + (tw - 1) * (step < 0) + step * torch.arange(tw)
        batch_i = torch.arange(len(indices)).view(-1, 1, 1, 1)
        out = _empty_batch(data, (len(indices), c, th, tw))
        torch.index_select(images.flatten(), 0, (
            ((batch_i * c + torch.arange(c).view(1, -1, 1, 1)) * hp + rows.view(-1, 1, th, 1)) * wp
            + cols.view(-1, 1, 1, tw)
        ).flatten(), out=out.view(-1))
        batch = [out if j == k else _gather(f, index) for j, f in enumerate(self.fields)]
        return batch if self.is_seq is not None else batch[0]


def _crop_flip(suffix: _Chain | None) -> dict[str, Any] | None:
    """The batched crop/flip arguments when ``suffix`` is exactly [Pad?, RandomCrop?, Flip?] (v1)."""
    if suffix is None:
        return None
    steps: list[Any] = list(suffix.steps)
    args: dict[str, Any] = {"fill": None, "ltrb": (0, 0, 0, 0), "crop": None, "flip": None}
    if steps and isinstance(steps[0], _PadFill):
        args["fill"], args["ltrb"] = steps[0].fill, steps[0].ltrb
        steps = steps[1:]
        if not steps or type(steps[0]) is not _v1("RandomCrop"):
            return None
    if steps and type(steps[0]) is _v1("RandomCrop"):
        crop = steps.pop(0)
        if crop.padding is not None or crop.pad_if_needed:
            return None
        args["crop"] = crop
    if steps and type(steps[0]) is _v1("RandomHorizontalFlip"):
        args["flip"] = steps.pop(0)
    return args if not steps and (args["crop"] or args["flip"]) else None


def _v1(name: str) -> Any:
    import torchvision.transforms as T

    return getattr(T, name)


def _empty_batch(data: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """An uninitialised batch; in a worker process, in shared memory, as default_collate does."""
    if get_worker_info() is None or data.device.type != "cpu":
        return torch.empty(shape, dtype=data.dtype, device=data.device)
    numel = 1
    for d in shape:
        numel *= d
    storage = data._typed_storage()._new_shared(numel, device=data.device)
    return data.new(storage).resize_(shape)


def _gather(data: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``data[index]``; in a worker process, straight into shared memory, as default_collate does,
    so the batch is not copied once more to be sent to the main process."""
    if get_worker_info() is None or data.device.type != "cpu":
        return data.index_select(0, index)
    out = _empty_batch(data, (len(index), *data.shape[1:]))
    return torch.index_select(data, 0, index, out=out)


class _Unbatched(Dataset[Any]):
    """A batched cache whose batches are unbound into the samples the original dataset gives.

    For a user's ``collate_fn``: one gather per batch (random numbers drawn sample after sample,
    as the original does), then each sample as ``dataset[i]`` would be (tensor fields as views of
    the batch, number fields as Python numbers).
    """

    def __init__(self, batches: _CachedSamples) -> None:
        self.batches = batches

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        cached = self.batches
        batch = cached.__getitems__(indices)  # type: ignore[attr-defined]
        fields = batch if cached.is_seq is not None else [batch]
        columns: list[list[Any]] = []
        for k, (data, kind) in enumerate(zip(fields, cached.kinds, strict=True)):
            if kind == "tensor":
                columns.append([x.as_subclass(cached.subclasses[k]) for x in data.unbind(0)])
            else:
                columns.append(data.tolist())
        if cached.is_seq is None:
            return columns[0]
        return [cached.is_seq(values) for values in zip(*columns, strict=True)]


def _already_collated(batch: Any) -> Any:
    """The collate function for ``_CachedBatches``: the batch arrives collated."""
    return batch


def _store(
    samples: Sequence[Any], layout: list[tuple[str, Any, Any]], device: torch.device, share: bool
) -> tuple[torch.Tensor, ...]:
    is_seq = isinstance(samples[0], (tuple, list))
    out = []
    for k, (_, _, dtype) in enumerate(layout):
        column = [s[k] if is_seq else s for s in samples]
        if isinstance(column[0], torch.Tensor):
            data = torch.stack([c.detach().cpu().as_subclass(torch.Tensor) for c in column])
        else:
            data = torch.tensor(column, dtype=dtype)
        data = data.to(device)
        out.append(data.share_memory_() if share else data)
    return tuple(out)


def _wrap(fields: tuple[torch.Tensor, ...], layout: list[tuple[str, Any, Any]], plan: _Plan) -> Any:
    first = plan.probe[0]
    is_seq = type(first) if isinstance(first, (tuple, list)) else None
    fs = list(first) if is_seq else [first]
    subclasses = tuple(type(v) if isinstance(v, torch.Tensor) else torch.Tensor for v in fs)
    args = (fields, layout, is_seq, plan.field, plan.suffix, subclasses)
    crop_flip = _crop_flip(plan.suffix)
    if crop_flip is not None and fields[plan.field or 0].dim() == 4:
        return _CachedCropFlipBatches(*args, **crop_flip)
    return _CachedSamples(*args) if plan.suffix is not None else _CachedBatches(*args)


def _build(dataset: Any, plan: _Plan, strategy: str, device: torch.device) -> Prepared:
    """Apply the prefix to every sample, into one contiguous tensor per field."""
    t0 = time.perf_counter()
    layout, _ = _layout(plan.probe)
    n = plan.length
    target = torch.device("cpu") if strategy == "ram" else device
    is_seq = isinstance(plan.probe[0], (tuple, list))
    source = plan.source if plan.source is not None else dataset
    fields = []
    for _, shape, dtype in layout:
        data = torch.empty((n, *shape), dtype=dtype, device=target)
        fields.append(data.share_memory_() if strategy == "ram" else data)
    row_bytes = sum(f[0].numel() * f.element_size() for f in fields)
    chunk = n if target.type == "cpu" else max(1, STAGING_BYTES // max(1, row_bytes))
    with _rng_preserved():
        for start in range(0, n, chunk):
            rows = []
            for i in range(start, min(n, start + chunk)):
                sample = _apply_field(plan.prefix, source[i], plan.field)
                reason = _mismatch(layout, sample, is_seq)
                if reason:
                    raise CandidateInfeasible(
                        f"sample {i}: {reason}; the estimate saw {len(plan.probe)} equal samples, but"
                        " variable-size samples cannot share one contiguous cache"
                    )
                if target.type == "cpu":
                    for data, value in zip(fields, sample if is_seq else [sample], strict=True):
                        data[i] = value
                else:
                    rows.append(sample)
            if rows:
                staged = _store(rows, layout, torch.device("cpu"), share=False)
                for data, column in zip(fields, staged, strict=True):
                    data[start : start + len(rows)].copy_(column)
    if target.type == "cuda":
        torch.cuda.synchronize(target)
    wrapped = _wrap(tuple(fields), layout, plan)
    return Prepared(
        dataset=wrapped,
        strategy=strategy,
        collate_fn=_already_collated if hasattr(wrapped, "__getitems__") else None,
        build_s=time.perf_counter() - t0,
        nbytes=sum(f.numel() * f.element_size() for f in fields),
        detail=plan.detail,
    )


def _estimate(plan: _Plan) -> int:
    """Bytes a cache would need: the probes' size per sample times the length (exact if all match)."""
    layout, _ = _layout(plan.probe)
    per_sample = 0
    for _, shape, dtype in layout:
        numel = 1
        for d in shape:
            numel *= d
        per_sample += numel * torch.empty((), dtype=dtype).element_size()
    return per_sample * plan.length


def estimate_build_s(dataset: Dataset[Any]) -> float | None:
    """Seconds a cache build would take: a few samples read and pre-transformed, times the length.

    ``None`` when the dataset cannot be cached at all. Like the memory estimate, it assumes the
    probed samples are typical; a dataset whose early samples are cached by the OS reads faster here.
    """
    plan = _plan_for(dataset)
    if plan.reason is not None:
        return None
    source = plan.source if plan.source is not None else dataset
    indices = _probe_indices(plan.length)
    with _rng_preserved():
        t0 = time.perf_counter()
        for i in indices:
            _apply_field(plan.prefix, source[i], plan.field)
        per_sample = (time.perf_counter() - t0) / len(indices)
    return per_sample * plan.length


# ------------------------------------------------------------------------- reuse, weakly keyed

_lock = threading.Lock()
_plans: dict[int, tuple[weakref.ref[Any], _Plan]] = {}
_builds: dict[tuple[int, str, str], tuple[weakref.ref[Any], _Plan, Prepared]] = {}


def _forget(key_id: int) -> None:
    with _lock:
        _plans.pop(key_id, None)
        for key in [k for k in _builds if k[0] == key_id]:
            del _builds[key]


def _weak(dataset: Any) -> weakref.ref[Any] | None:
    """A weak reference that drops the dataset's plans and caches when it is collected."""
    key_id = id(dataset)
    try:
        return weakref.ref(dataset, lambda _: _forget(key_id))
    except TypeError:
        return None  # not weakly referenceable: plans and builds are then not reused


def _fresh(dataset: Any, plan: _Plan) -> bool:
    """A stored plan still describes ``dataset`` (same transform object, same length)."""
    return getattr(dataset, "transform", None) is plan.transform and len(dataset) == plan.length


def _plan_for(dataset: Any) -> _Plan:
    with _lock:
        entry = _plans.get(id(dataset))
    if entry is not None and entry[0]() is dataset and _fresh(dataset, entry[1]):
        return entry[1]
    plan = _plan(dataset)
    ref = _weak(dataset) if plan.reason is None else None
    if ref is not None:
        with _lock:
            _plans[id(dataset)] = (ref, plan)
    return plan


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
    cache needs is estimated from them as bytes per sample times ``len(dataset)``; that is exact for
    fixed-size samples, but variable-size ones the probes did not see make ``prepare`` refuse later.
    """
    reasons: dict[str, str | None] = {"none": None}
    plan = _plan_for(dataset)
    budgets = {
        "ram": (memory_budget_bytes, "memory budget"),
        "device": (device_memory_budget_bytes, "device memory budget"),
    }
    for strategy, (budget, what) in budgets.items():
        if strategy == "device" and not cuda:
            reasons[strategy] = "needs CUDA"
        elif plan.reason is not None:
            reasons[strategy] = plan.reason
        elif budget is not None and _estimate(plan) > budget:
            reasons[strategy] = (
                f"a cache would need ~{_fmt_bytes(_estimate(plan))} (estimated from"
                f" {len(plan.probe)} samples), over the {what} of {_fmt_bytes(budget)}"
            )
        else:
            reasons[strategy] = None
    return reasons


def prepare(dataset: Dataset[Any], strategy: str, *, device: torch.device) -> Prepared:
    """The dataset to load with ``strategy``; a cache is built once per process and dataset.

    ``ram`` caches on the CPU in shared memory (forked workers read it without a copy); ``device``
    caches on ``device`` (``num_workers=0``; a CPU device is accepted as a stand-in). A second call
    for the same dataset object, strategy and device returns the first build while the dataset is
    alive (and its ``transform`` and length are unchanged). Raises ``ConfigurationError`` for an
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
    plan = _plan_for(dataset)
    if entry is not None and entry[0]() is dataset and entry[1] is plan:
        return entry[2]
    if plan.reason is not None:
        raise CandidateInfeasible(f"pretransform={strategy!r}: {plan.reason}")
    prepared = _build(dataset, plan, strategy, device)
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
