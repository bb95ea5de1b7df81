"""Fingerprints of what a cache froze, so a cache never outlives it (NOTE [ Fresh caches ]).

# NOTE [ Fresh caches ]
# A cache freezes two things: the parameters of the steps it applied once (Resize's size, Normalize's
# mean, a user step's counter) and the raw samples it read (the dataset's length, its ``samples`` list,
# the files' sizes and modification times, its arrays). Both are fingerprinted when the cache is
# built: each frozen step's attributes (``vars``, recursively made comparable: numbers and strings as
# they are, small tensors and arrays by their bytes, large ones by identity and in-place version,
# functions and other objects by identity), and the raw source's identity as its adapter sees it.
# The fingerprint is taken again whenever a loader is made (``prepare``) and whenever the loader code
# asks at an epoch start (``Prepared.stale_reason``, cheap: a few attribute reads, and one ``stat`` per
# file up to STAT_FILES). On a change the stored build is dropped and rebuilt, with a warning that
# names the step and the attribute that changed. Steps that still run per sample are not frozen: they
# are the user's own objects, so a change to them shows as it would without a cache.
# Not seen: a change inside a large array or tensor that keeps its identity (a NumPy array written
# in place; a tensor's in-place writes are seen through its version counter), or a file rewritten
# with the same size and modification time.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

SMALL_VALUE_BYTES = 1 << 16
"""Tensors and arrays up to this size are compared by value; larger ones by identity and version."""

STAT_FILES = 20_000
"""Up to this many files are stat'ed for a fingerprint (about 20 ms); beyond, an even sample of them."""

LIST_ITEMS = 100_000
"""Lists up to this long are compared item by item; longer ones by identity, length and a sample."""

MAX_DEPTH = 4
"""How deep attributes of attributes are compared; deeper objects are compared by identity."""

REPR_CHARS = 60
"""How much of an old and a new value a staleness message shows."""


class _Ref:
    """An object compared by identity (kept alive, so its id cannot be reused)."""

    __slots__ = ("obj",)

    def __init__(self, obj: Any) -> None:
        self.obj = obj

    def __eq__(self, other: object) -> bool:
        return isinstance(other, _Ref) and other.obj is self.obj

    __hash__ = None  # type: ignore[assignment]


def snapshot(obj: Any, depth: int = 0) -> Any:
    """``obj`` made comparable with ``==`` now and later (see NOTE [ Fresh caches ])."""
    if obj is None or isinstance(obj, (bool, int, str, bytes, enum.Enum)):
        return obj
    if isinstance(obj, float):
        return ("float", obj.hex())  # NaN compares equal to itself this way
    if isinstance(obj, torch.Tensor):
        nbytes = obj.numel() * obj.element_size()
        if nbytes <= SMALL_VALUE_BYTES and obj.device.type == "cpu":
            return ("tensor", obj.dtype, tuple(obj.shape), obj.detach().contiguous().numpy().tobytes())
        return ("tensor", _Ref(obj), obj._version, tuple(obj.shape), obj.dtype)
    if isinstance(obj, np.ndarray):
        if obj.nbytes <= SMALL_VALUE_BYTES:
            return ("ndarray", obj.dtype.str, obj.shape, obj.tobytes())
        return ("ndarray", _Ref(obj), obj.shape, obj.dtype.str)
    if depth >= MAX_DEPTH or callable(obj) and not hasattr(obj, "__dict__"):
        return _Ref(obj)
    if isinstance(obj, (list, tuple)):
        if len(obj) > LIST_ITEMS:  # every (len // LIST_ITEMS)-th item, and who holds them
            step = -(-len(obj) // LIST_ITEMS)
            return (type(obj).__name__, _Ref(obj), len(obj), snapshot(obj[::step], depth))
        return (type(obj).__name__, tuple(snapshot(v, depth + 1) for v in obj))
    if isinstance(obj, dict):
        return ("dict", tuple((repr(k), snapshot(v, depth + 1)) for k, v in obj.items()))
    if isinstance(obj, (type, os.PathLike)) or not hasattr(obj, "__dict__"):
        return _Ref(obj) if not isinstance(obj, os.PathLike) else os.fspath(obj)
    if callable(obj) and hasattr(obj, "__code__"):  # a function: its code and what it closes over
        cells = tuple(c.cell_contents for c in (obj.__closure__ or ()))
        return ("function", _Ref(obj.__code__), snapshot(cells, depth + 1), snapshot(obj.__defaults__))
    return (type(obj).__qualname__, snapshot(vars(obj), depth + 1))


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= REPR_CHARS else text[: REPR_CHARS - 3] + "..."


@dataclass(frozen=True)
class Part:
    """One frozen thing: what it is called in a message, and its snapshot per attribute."""

    label: str
    attrs: tuple[tuple[str, Any, str], ...]
    """(attribute, snapshot, short repr of the value when fingerprinted)."""


def step_part(label: str, step: Any) -> Part:
    """A frozen step's attributes (its ``vars``; the step itself when it has none)."""
    items = vars(step).items() if hasattr(step, "__dict__") else [("value", step)]
    return Part(label, tuple((name, snapshot(v), _short(v)) for name, v in items))


def value_part(label: str, **values: Any) -> Part:
    return Part(label, tuple((name, snapshot(v), _short(v)) for name, v in values.items()))


def identity_part(label: str, **objs: Any) -> Part:
    """Objects compared by identity (tuples of them item by item): which objects, not their state."""

    def ident(v: Any) -> Any:
        return tuple(_Ref(x) for x in v) if isinstance(v, tuple) else _Ref(v)

    return Part(label, tuple((name, ident(v), _short(v)) for name, v in objs.items()))


def file_stats(paths: Sequence[str]) -> tuple[tuple[str, int, int], ...]:
    """(path, size, mtime_ns) of the files, or an even sample of STAT_FILES of them."""
    stride = max(1, -(-len(paths) // STAT_FILES))
    out = []
    for path in paths[::stride]:
        try:
            st = os.stat(path)
            out.append((path, st.st_size, st.st_mtime_ns))
        except OSError:
            out.append((path, -1, -1))
    return tuple(out)


def difference(old: Sequence[Part], new: Sequence[Part]) -> str | None:
    """What changed between two fingerprints, in words; None when nothing did."""
    for before, after in zip(old, new, strict=False):
        if before.label != after.label:
            return f"the pipeline changed ({before.label} became {after.label})"
        if before.attrs == after.attrs:
            continue
        names_before = [a[0] for a in before.attrs]
        names_after = [a[0] for a in after.attrs]
        if names_before != names_after:
            return f"{before.label} changed (its attributes {names_before} became {names_after})"
        for (name, snap_a, text_a), (_, snap_b, text_b) in zip(before.attrs, after.attrs, strict=True):
            if snap_a != snap_b:
                shown = f": {text_a} -> {text_b}" if text_a != text_b else ""
                return f"{before.label} changed ({name}{shown})"
    if len(old) != len(new):
        return f"the pipeline changed ({len(old)} frozen parts became {len(new)})"
    return None
