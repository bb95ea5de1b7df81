"""Where cached samples live: one contiguous tensor per fixed-shape field, one ragged column per field
whose samples have their own sizes (decoded images), both in shared memory for the ``ram`` strategy.

A layout says, per field of a sample, how it is stored: ``tensor`` (one shape and dtype for every
sample: an (n, *shape) tensor), ``int``/``float``/``bool`` (an (n,) tensor, read back as Python
numbers), and the ragged kinds ``ragged`` (tensors of one dtype and their own shapes), ``pil`` (PIL
images, stored as their uint8 HWC pixels) and ``ndarray`` (NumPy arrays of their own shapes).
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import math
import mmap
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from ..exceptions import CandidateInfeasible, ShapeChanged

log = logging.getLogger("autotune.pretransform")

RAGGED_KINDS = frozenset({"ragged", "pil", "ndarray"})
"""Kinds stored as one flat buffer plus offsets and shapes."""

PIL_MODES = {"RGB": 3, "RGBA": 4, "L": 0}
"""PIL modes whose pixels round-trip exactly through a uint8 array (value: channels, 0 for none)."""

MAX_NDIM = 4
"""Most dimensions a ragged sample may have (images: 2 or 3)."""

GROWTH = 1.5
"""Factor a ragged buffer grows by when the estimate was short (in private memory, pages never written
cost nothing)."""

PROGRESS_EVERY_S = 5.0
"""A build logs its progress (and calls the progress callback) at most this often."""

Layout = list[tuple[str, Any, Any]]
"""Per field: (kind, shape or None, torch dtype)."""

ProgressFn = Callable[[int, int], None]
"""Called with (samples done, samples in all) while a cache is built."""


def fmt_bytes(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{int(n)} B"


# ------------------------------------------------------------------------------------------ layout


def _kind_of(value: Any) -> tuple[str, Any, Any] | None:
    if isinstance(value, torch.Tensor):
        return ("tensor", tuple(value.shape), value.dtype)
    if isinstance(value, Image.Image):
        return ("pil", None, torch.uint8)
    if isinstance(value, np.ndarray) and value.dtype.kind in "biuf":
        return ("ndarray", None, torch.from_numpy(np.empty(0, dtype=value.dtype)).dtype)
    if isinstance(value, bool):
        return ("bool", (), torch.bool)
    if isinstance(value, int):
        return ("int", (), torch.int64)
    if isinstance(value, float):
        return ("float", (), torch.float64)
    return None


def layout_of(samples: Sequence[Any]) -> tuple[Layout, str | None]:
    """How ``samples`` would be stored, field by field; or the reason they cannot be."""
    first = samples[0]
    is_seq = isinstance(first, (tuple, list))
    layout: Layout = []
    for k, value in enumerate(list(first) if is_seq else [first]):
        found = _kind_of(value)
        if found is None:
            where = f"field {k} of each sample" if is_seq else "each sample"
            return [], (
                f"{where} is a {type(value).__name__} where it would be cached; only tensors, PIL"
                " images, NumPy arrays, ints and floats are cached"
            )
        layout.append(found)
    # A tensor field whose probes differ in shape (same dtype) is stored ragged.
    for k, (kind, _, dtype) in enumerate(layout):
        column = [s[k] if is_seq else s for s in samples]
        tensors = all(isinstance(v, torch.Tensor) and v.dtype == dtype for v in column)
        if kind == "tensor" and tensors and len({tuple(v.shape) for v in column}) > 1:
            layout[k] = ("ragged", None, dtype)
    for sample in samples:
        reason = mismatch(layout, sample, is_seq)
        if reason:
            return [], reason
    return layout, None


def mismatch(layout: Layout, sample: Any, is_seq: bool) -> str | None:
    """Why ``sample`` does not fit ``layout``; None when it does."""
    fields = list(sample) if is_seq else [sample]
    if len(fields) != len(layout):
        return f"samples have {len(layout)} and {len(fields)} fields"
    for k, ((kind, shape, dtype), value) in enumerate(zip(layout, fields, strict=True)):
        if kind in ("tensor", "ragged"):
            if not isinstance(value, torch.Tensor):
                return f"field {k} is a tensor in one sample and a {type(value).__name__} in another"
            if value.dtype != dtype or (kind == "tensor" and tuple(value.shape) != shape):
                what = f"{tuple(value.shape)} {value.dtype}" if kind == "tensor" else str(value.dtype)
                was = f"{shape} {dtype}" if kind == "tensor" else str(dtype)
                return (
                    f"field {k} is {what} in one sample and {was} in another (variable-size samples"
                    " cannot share one contiguous cache)"
                )
            if value.dim() > MAX_NDIM:
                return f"field {k} has {value.dim()} dimensions; ragged samples have at most {MAX_NDIM}"
        elif kind == "pil":
            if not isinstance(value, Image.Image):
                return f"field {k} is a PIL image in one sample and a {type(value).__name__} in another"
            if value.mode not in PIL_MODES:
                return (
                    f"field {k} is a PIL image in mode {value.mode!r}; only {sorted(PIL_MODES)} images"
                    " are cached (convert them in the loader, as ImageFolder's default loader does)"
                )
        elif kind == "ndarray":
            if not isinstance(value, np.ndarray) or torch.from_numpy(value[:0]).dtype != dtype:
                return f"field {k} is an array of {dtype} in one sample and {type(value).__name__} in another"
        elif not _NUMBER_CHECKS[kind](value):
            return f"field {k} is a {kind} in one sample and a {type(value).__name__} in another"
    return None


def fitting(layout: Layout, samples: Sequence[Any], is_seq: bool) -> list[bool]:
    """Per sample, whether it fits a layout of fixed-shape fields (``mismatch`` gives None): checked a
    field at a time where all of them fit, the common case, at a fraction of ``mismatch``'s cost."""
    if is_seq:
        whole = all(isinstance(s, (tuple, list)) and len(s) == len(layout) for s in samples)
    else:
        whole = len(layout) == 1
    if whole:
        columns = list(zip(*samples, strict=True)) if is_seq else [samples]
        if all(_column_fits(field, column) for field, column in zip(layout, columns, strict=True)):
            return [True] * len(samples)
    return [mismatch(layout, s, is_seq) is None for s in samples]


def _column_fits(field: tuple[str, Any, Any], column: Sequence[Any]) -> bool:
    kind, shape, dtype = field
    if kind == "tensor":
        return all(isinstance(v, torch.Tensor) and v.dtype == dtype and v.shape == shape for v in column)
    return kind in _NUMBER_CHECKS and all(map(_NUMBER_CHECKS[kind], column))


_NUMBER_CHECKS: dict[str, Callable[[Any], bool]] = {
    "bool": lambda v: isinstance(v, bool),
    "int": lambda v: isinstance(v, int) and not isinstance(v, bool),
    "float": lambda v: isinstance(v, float),
}


def is_ragged(layout: Layout) -> bool:
    return any(kind in RAGGED_KINDS for kind, _, _ in layout)


def tensor_types(sample: Any) -> tuple[type, ...]:
    """Per field of ``sample``: its tensor subclass (a tv_tensors.Image, say), torch.Tensor otherwise."""
    fields = list(sample) if isinstance(sample, (tuple, list)) else [sample]
    return tuple(type(v) if isinstance(v, torch.Tensor) else torch.Tensor for v in fields)


# -------------------------------------------------------------------------------------- estimates


@dataclass(frozen=True)
class Estimate:
    """Bytes a cache needs, from the probe samples: exact for fixed shapes, a mean for ragged ones."""

    per_sample: tuple[int, ...]
    """Bytes of each probe sample."""
    length: int

    @property
    def mean(self) -> float:
        return statistics.fmean(self.per_sample)

    @property
    def spread(self) -> float:
        return statistics.pstdev(self.per_sample) if len(self.per_sample) > 1 else 0.0

    @property
    def total(self) -> int:
        return math.ceil(self.mean * self.length)

    def describe(self) -> str:
        """How the estimate was made, for a refusal message."""
        n = len(self.per_sample)
        if self.spread == 0:
            return f"estimated from {n} samples"
        return (
            f"estimated from {n} samples of {fmt_bytes(min(self.per_sample))} to"
            f" {fmt_bytes(max(self.per_sample))}, mean {fmt_bytes(self.mean)}, spread"
            f" {fmt_bytes(self.spread)}"
        )


def _nbytes(value: Any, kind: str, dtype: Any) -> int:
    if kind in ("tensor", "ragged"):
        return int(value.numel() * value.element_size())
    if kind == "pil":
        return value.width * value.height * max(1, PIL_MODES[value.mode])
    if kind == "ndarray":
        return int(value.nbytes)
    return int(torch.empty((), dtype=dtype).element_size())


def estimate(samples: Sequence[Any], layout: Layout, length: int) -> Estimate:
    is_seq = isinstance(samples[0], (tuple, list))
    sizes = []
    for s in samples:
        fields = list(s) if is_seq else [s]
        sizes.append(sum(_nbytes(v, kind, dt) for v, (kind, _, dt) in zip(fields, layout, strict=True)))
    return Estimate(tuple(sizes), length)


# ------------------------------------------------------------------------------------------ ragged


def shared_empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A 1-D tensor in fresh shared memory. torch reserves the segment's whole size in /dev/shm when
    it creates it (so that a write never finds it full), but a page is zeroed and mapped only when
    first written or populated (NOTE [ Populating a cache's pages ])."""
    base = torch.empty(0, dtype=dtype)
    storage = base._typed_storage()._new_shared(max(1, numel), device=base.device)
    return base.new(storage)[:numel]


# NOTE [ Populating a cache's pages ]
# A cache's buffer is fresh memory: the first write to each 4 KiB page faults, and the kernel (on a
# virtual machine, the hypervisor too) finds, zeroes and maps a page for it, one page at a time. That
# costs more than the copy itself, for a decoded photo about as much as its load. Populated
# POPULATE_AHEAD_BYTES ahead by madvise(MADV_POPULATE_WRITE) (Linux 5.14+), the pages cost a fraction
# of that, so the epoch that fills the cache pays little more than its copies
# (benchmarks/scripts/fill.py measures that epoch against one without the cache). A ragged column is
# written at a cursor that only moves forward, so the space ahead of each writer's last write is
# populated a chunk at a time (a little past what it may use, never the whole headroom); rows of
# fixed shape land anywhere and every one of them will be written, so their field is populated whole
# when it is allocated. Populating changes no byte, it only does ahead what the writes would; where
# the call is missing (another OS, an older kernel) the pages fault one at a time as before.

POPULATE_AHEAD_BYTES = 8 << 20
"""Bytes of a ragged buffer populated at once ahead of a write (NOTE [ Populating a cache's pages ])."""

_MADV_POPULATE_READ, _MADV_POPULATE_WRITE = 22, 23
"""Linux's madvise advice that maps a range's pages readable, or writable, now
(include/uapi/asm-generic/mman-common.h)."""

_madvise: Any = None
"""libc's madvise once looked up; False where there is none or the kernel refused the advice."""


def populate(t: torch.Tensor, start: int = 0, stop: int | None = None, *, write: bool = True) -> bool:
    """Map the pages of elements ``start`` to ``stop`` of the contiguous CPU tensor ``t`` for writing
    now (NOTE [ Populating a cache's pages ]); whether that was done (else its writes fault them).
    ``write=False``: for reading, as a process does that maps a cache another one filled (a file
    mapping's pages are then not marked written)."""
    global _madvise
    if _madvise is None:
        _madvise = False
        if sys.platform.startswith("linux"):
            with contextlib.suppress(OSError, AttributeError):
                fn = ctypes.CDLL(None, use_errno=True).madvise
                fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
                _madvise = fn
    stop = t.numel() if stop is None else min(stop, t.numel())
    if _madvise is False or t.device.type != "cpu" or not t.is_contiguous() or stop <= start:
        return False
    size = t.element_size()
    first = t.data_ptr() + start * size
    page = first & ~(mmap.PAGESIZE - 1)
    advice = _MADV_POPULATE_WRITE if write else _MADV_POPULATE_READ
    if _madvise(page, first + (stop - start) * size - page, advice) != 0:
        if ctypes.get_errno() in (errno.EINVAL, errno.ENOSYS):
            _madvise = False  # a kernel without the advice: never asked again
        return False
    return True


class RaggedColumn:
    """Samples of their own shapes: one flat buffer, offsets into it, and each sample's shape.

    ``get(i)`` gives sample ``i`` as it was stored: a tensor (of ``subclass``), a PIL image, or a
    NumPy array, always a private copy (the buffer is shared with the workers and must not change).
    """

    def __init__(
        self,
        flat: torch.Tensor,
        offsets: torch.Tensor,
        shapes: torch.Tensor,
        kind: str,
        subclass: type = torch.Tensor,
    ) -> None:
        self.flat, self.offsets, self.shapes, self.kind, self.subclass = flat, offsets, shapes, kind, subclass

    def __len__(self) -> int:
        return int(self.shapes.shape[0])

    @property
    def nbytes(self) -> int:
        used = int(self.offsets[-1]) * self.flat.element_size()
        return used + sum(t.numel() * t.element_size() for t in (self.offsets, self.shapes))

    def tensors(self) -> tuple[torch.Tensor, ...]:
        """The stored data: the used part of the buffer, the offsets and the shapes."""
        return (self.flat[: int(self.offsets[-1])], self.offsets, self.shapes)

    def clone(self) -> RaggedColumn:
        """A private copy (a control for tests of memory sharing)."""
        flat, offsets, shapes = (t.clone() for t in self.tensors())
        return RaggedColumn(flat, offsets, shapes, self.kind, self.subclass)

    def span(self, index: int) -> tuple[int, int]:
        """Where sample ``index`` (in range, not negative) lies in the flat buffer."""
        start, stop = self.offsets[index : index + 2].tolist()
        return start, stop

    def get(self, index: int) -> Any:
        n = len(self)
        if not -n <= index < n:
            raise IndexError(f"index {index} is out of range for a cache of {n} samples")
        index %= n
        start, stop = self.span(index)
        shape = [d for d in self.shapes[index].tolist() if d >= 0]
        view = self.flat[start:stop].view(shape)
        if self.kind == "pil":
            return Image.fromarray(view.numpy().copy())
        if self.kind == "ndarray":
            return view.numpy().copy()
        return view.clone().as_subclass(self.subclass)


class FilledColumn(RaggedColumn):
    """A ragged column filled in any order, by several processes (NOTE [ Filling caches ]).

    Each sample has its (start, stop) in the flat buffer and its shape; ``cursor`` (shared) is where
    the next sample's space begins. Space is reserved under the filler's lock (``reserve``), written
    outside it (``write``), and the sample recorded under it again (``record``). A sample's span and
    shape mean something only once the filler's flag says it is filled.
    """

    def __init__(
        self, flat: torch.Tensor, spans: torch.Tensor, shapes: torch.Tensor, cursor: torch.Tensor,
        kind: str, subclass: type = torch.Tensor,
    ) -> None:
        super().__init__(flat, spans, shapes, kind, subclass)
        self.spans, self.cursor = spans, cursor
        self._views()

    def _views(self) -> None:
        # NumPy views of the shared bookkeeping: an element read or written costs ~0.1 us, where a
        # torch indexing call costs ~5 us, several of them a sample. Never pickled: a pickled array
        # is a copy, and a spawned worker's writes must reach the shared tensors.
        self._cursor, self._spans, self._shapes = self.cursor.numpy(), self.spans.numpy(), self.shapes.numpy()
        self._populated = 0
        """Elements of ``flat`` up to which this process populated the pages (NOTE [ Populating a
        cache's pages ])."""

    def __getstate__(self) -> dict[str, Any]:
        return {k: v for k, v in self.__dict__.items()
                if k not in ("_cursor", "_spans", "_shapes", "_populated")}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._views()

    @classmethod
    def empty(
        cls, n: int, dtype: torch.dtype, capacity_bytes: int, kind: str, subclass: type, share: bool
    ) -> FilledColumn:
        itemsize = torch.empty((), dtype=dtype).element_size()
        numel = max(1, capacity_bytes // itemsize)
        flat = shared_empty(numel, dtype) if share else torch.empty(numel, dtype=dtype)
        spans = torch.zeros((n, 2), dtype=torch.int64)
        shapes = torch.full((n, MAX_NDIM), -1, dtype=torch.int64)
        cursor = torch.zeros(1, dtype=torch.int64)
        if share:
            spans, shapes, cursor = spans.share_memory_(), shapes.share_memory_(), cursor.share_memory_()
        return cls(flat, spans, shapes, cursor, kind, subclass)

    def span(self, index: int) -> tuple[int, int]:
        start, stop = self._spans[index]
        return int(start), int(stop)

    @property
    def nbytes(self) -> int:
        used = int(self.cursor[0]) * self.flat.element_size()
        return used + sum(t.numel() * t.element_size() for t in (self.spans, self.shapes))

    @property
    def capacity_bytes(self) -> int:
        """Bytes the flat buffer can hold (in shared memory all reserved; in private memory, pages
        never written take none)."""
        return self.flat.numel() * self.flat.element_size()

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.flat[: int(self.cursor[0])], self.spans, self.shapes)

    def clone(self) -> FilledColumn:
        flat, spans, shapes = (t.clone() for t in self.tensors())
        return FilledColumn(flat, spans, shapes, self.cursor.clone(), self.kind, self.subclass)

    def fits(self, numel: int) -> bool:
        return int(self._cursor[0]) + numel <= self.flat.numel()

    def reserve(self, numel: int) -> int:
        """Space for ``numel`` more items (that ``fits``): where it starts. Under the lock."""
        start = int(self._cursor[0])
        self._cursor[0] = start + numel
        return start

    def write(self, start: int, value: torch.Tensor) -> None:
        stop = start + value.numel()
        if stop > self._populated:  # the pages ahead mapped in one call (NOTE [ Populating ...])
            ahead = max(stop, start + POPULATE_AHEAD_BYTES // self.flat.element_size())
            done = populate(self.flat, max(start, self._populated), ahead)
            self._populated = ahead if done else self.flat.numel()
        copy_into(self.flat[start:stop], value)

    def record(self, index: int, start: int, value: torch.Tensor) -> None:
        """Sample ``index`` lies at ``start`` with ``value``'s shape. Under the lock."""
        self._spans[index] = start, start + value.numel()
        self._shapes[index] = (*value.shape, *(-1,) * (MAX_NDIM - value.dim()))


MEMCPY_FROM = 32768
"""Elements from which ``copy_into`` copies through NumPy: torch's grain size for its intra-op threads;
a smaller copy runs on one thread, and ``copy_`` costs less than the conversions there."""


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst`` (on the CPU) takes ``src``'s values, same number of elements, by a plain memory copy.

    Not ``Tensor.copy_``: above a few ten thousand elements (one decoded photo) it hands the copy to
    torch's OpenMP threads, and on a machine whose cores are busy their spinning makes each such call
    take milliseconds where the copy itself takes microseconds (benchmarks/results/spin/SPIN.md). A
    dtype NumPy lacks, or a cast, falls back to ``copy_``.
    """
    if src.numel() >= MEMCPY_FROM:
        try:
            np.copyto(dst.numpy(), src.detach().numpy().reshape(dst.shape), casting="no")
            return
        except (TypeError, RuntimeError, ValueError):
            pass
    dst.copy_(src.reshape(dst.shape))


def copy_rows(dst: torch.Tensor, rows: np.ndarray, values: Sequence[Any], kind: str) -> None:
    """Rows ``rows`` of ``dst`` (on the CPU, fixed-shape kind ``kind``) take ``values``, one each: one
    stack and one indexed copy for them all, where a row assignment each costs ~8 us, most of a small
    sample's whole load. Through NumPy, on one thread, whatever the size: torch's indexed copy hands
    even a few rows to its OpenMP threads, and in a loop whose step leaves them asleep, waking them
    costs milliseconds a batch where the copy takes tens of microseconds (``copy_into`` says more).
    Torch only where NumPy cannot (bfloat16). Nothing is written before every value converted."""
    try:
        out = dst.numpy()
        if kind == "tensor":
            array = np.stack([v.detach().numpy() for v in values])
        else:
            array = np.asarray(values, dtype=out.dtype)
        if array.dtype != out.dtype:
            raise TypeError(f"{array.dtype} is not {out.dtype}")
        out[rows] = array.reshape(len(rows), *out.shape[1:])
        return
    except (TypeError, RuntimeError, ValueError):
        pass  # a dtype NumPy lacks (bfloat16), a tensor it cannot view (conjugated)
    if kind == "tensor":
        plain = all(type(v) is torch.Tensor and not v.requires_grad for v in values)
        block = torch.stack(list(values) if plain else [v.detach().as_subclass(torch.Tensor) for v in values])
    else:
        block = torch.tensor(values, dtype=dst.dtype)
    dst[torch.from_numpy(rows)] = block


def as_tensor(value: Any, kind: str) -> torch.Tensor:
    if kind == "pil":
        return torch.from_numpy(np.array(value))  # a writable copy of the pixels
    if kind == "ndarray":
        return torch.from_numpy(np.ascontiguousarray(value))
    return value.detach().cpu().as_subclass(torch.Tensor)


class _RaggedWriter:
    """Appends samples, in index order, to a growing shared buffer."""

    def __init__(self, n: int, dtype: torch.dtype, capacity_bytes: int, share: bool) -> None:
        self.share = share
        self.itemsize = torch.empty((), dtype=dtype).element_size()
        self.flat = self._alloc(max(1, capacity_bytes // self.itemsize), dtype)
        self.offsets = torch.zeros(n + 1, dtype=torch.int64)
        self.shapes = torch.full((n, MAX_NDIM), -1, dtype=torch.int64)
        self.used = 0

    def _alloc(self, numel: int, dtype: torch.dtype) -> torch.Tensor:
        return shared_empty(numel, dtype) if self.share else torch.empty(numel, dtype=dtype)

    def put(self, i: int, value: torch.Tensor) -> None:
        numel = value.numel()
        if self.used + numel > self.flat.numel():
            grown = self._alloc(max(int(self.flat.numel() * GROWTH), self.used + numel), self.flat.dtype)
            grown[: self.used].copy_(self.flat[: self.used])
            self.flat = grown
        self.flat[self.used : self.used + numel].copy_(value.reshape(-1))
        self.used += numel
        self.offsets[i + 1] = self.used
        self.shapes[i, : value.dim()] = torch.tensor(value.shape, dtype=torch.int64)

    def column(self, kind: str, subclass: type) -> RaggedColumn:
        offsets, shapes = self.offsets, self.shapes
        if self.share:
            offsets, shapes = offsets.share_memory_(), shapes.share_memory_()
        return RaggedColumn(self.flat, offsets, shapes, kind, subclass)


# ------------------------------------------------------------------------------------------- fill


def _shape_only(layout: Layout, sample: Any, is_seq: bool) -> tuple[int, ...]:
    """Fixed-shape tensor fields of ``sample`` that differ from ``layout`` in shape alone."""
    fields = list(sample) if is_seq else [sample]
    if len(fields) != len(layout):
        return ()
    return tuple(
        k
        for k, ((kind, shape, dtype), v) in enumerate(zip(layout, fields, strict=True))
        if kind == "tensor" and isinstance(v, torch.Tensor) and v.dtype == dtype and tuple(v.shape) != shape
    )


def fill(
    samples: Iterable[Any],
    layout: Layout,
    n: int,
    *,
    subclasses: Sequence[type],
    share: bool,
    capacity_bytes: int = 0,
    budget_bytes: int | None = None,
    progress: ProgressFn | None = None,
) -> tuple[list[Any], int]:
    """Store ``n`` samples on the CPU, fixed fields as (n, *shape) tensors and ragged ones as columns.

    Returns (fields, bytes held). With ``budget_bytes``, stops as soon as the samples stored so far
    outgrow it (CandidateInfeasible with the figures). ``capacity_bytes``: the expected ragged size.
    """
    is_seq = None
    fixed: dict[int, torch.Tensor] = {}
    writers: dict[int, _RaggedWriter] = {}
    ragged = [k for k, (kind, _, _) in enumerate(layout) if kind in RAGGED_KINDS]
    for k, (kind, shape, dtype) in enumerate(layout):
        if kind in RAGGED_KINDS:
            writers[k] = _RaggedWriter(n, dtype, capacity_bytes // max(1, len(ragged)), share)
        else:
            data = torch.empty((n, *shape), dtype=dtype)
            fixed[k] = data.share_memory_() if share else data
    fixed_row = sum(int(t[0].numel() * t.element_size()) for t in fixed.values()) if n else 0
    t0 = last = time.perf_counter()
    count = 0
    for i, sample in enumerate(samples):
        if is_seq is None:
            is_seq = isinstance(sample, (tuple, list))
        reason = mismatch(layout, sample, is_seq)
        if reason:
            message = f"sample {i}: {reason}; the layout was planned from a few samples"
            changed = _shape_only(layout, sample, is_seq)
            if changed and mismatch(as_ragged(layout, changed), sample, is_seq) is None:
                raise ShapeChanged(message, changed)
            raise CandidateInfeasible(message)
        for k, value in enumerate(list(sample) if is_seq else [sample]):
            kind = layout[k][0]
            if k in writers:
                writers[k].put(i, as_tensor(value, kind))
            else:
                fixed[k][i] = value
        count = i + 1
        if budget_bytes is not None and writers:
            held = count * fixed_row + sum(w.used * w.itemsize for w in writers.values())
            if held > budget_bytes:
                raise CandidateInfeasible(
                    f"the cache outgrew the memory budget of {fmt_bytes(budget_bytes)} after {count} of"
                    f" {n} samples ({fmt_bytes(held)} so far); the estimate from a few samples was"
                    " short, so this data set does not fit"
                )
        now = time.perf_counter()
        if now - last >= PROGRESS_EVERY_S:
            last = now
            log.info("building the cache: %d/%d samples, %.0f s", count, n, now - t0)
            if progress is not None:
                progress(count, n)
    if count != n:
        raise CandidateInfeasible(f"the source gave {count} samples where {n} were expected")
    if progress is not None:
        progress(n, n)
    fields: list[Any] = []
    for k in range(len(layout)):
        if k in writers:
            fields.append(writers[k].column(layout[k][0], subclasses[k]))
        else:
            fields.append(fixed[k])
    return fields, nbytes(fields)


def as_ragged(layout: Layout, fields: Sequence[int]) -> Layout:
    """``layout`` with ``fields`` stored ragged (their samples turned out to vary in shape)."""
    return [
        ("ragged", None, dtype) if k in fields else (kind, shape, dtype)
        for k, (kind, shape, dtype) in enumerate(layout)
    ]


def nbytes(fields: Sequence[Any]) -> int:
    return sum(
        f.nbytes if isinstance(f, RaggedColumn) else int(f.numel() * f.element_size()) for f in fields
    )


def stack(samples: Sequence[Any], layout: Layout, device: torch.device) -> tuple[torch.Tensor, ...]:
    """Fixed-shape samples as one tensor per field on ``device`` (a staging copy for the device cache)."""
    is_seq = isinstance(samples[0], (tuple, list))
    out = []
    for k, (_, _, dtype) in enumerate(layout):
        column = [s[k] if is_seq else s for s in samples]
        if isinstance(column[0], torch.Tensor):
            data = torch.stack([c.detach().cpu().as_subclass(torch.Tensor) for c in column])
        else:
            data = torch.tensor(column, dtype=dtype)
        out.append(data.to(device))
    return tuple(out)
