"""Describing datasets and samples: their structure (types, shapes, dtypes), never their values.

Used by the messages of the pre-flight checks and by the workload fingerprint of the profile key,
with :func:`jsonable` for anything else that must become plain JSON. Imports no torch: a profile is
read without it.
"""

from __future__ import annotations

import math
import re
import sys
from collections.abc import Mapping
from typing import Any

MAX_ITEMS = 16
"""Items of a list, tuple or dict sample described one by one; longer ones are summarised by length."""

MAX_DEPTH = 6
"""Nesting depth a sample is described to."""

_ADDRESS_RE = re.compile(r"\s+at\s+0x[0-9a-fA-F]+|0x[0-9a-fA-F]{6,}")


def dataset_length(dataset: Any) -> int | None:
    """``len(dataset)``, or ``None`` for a dataset without one (an ``IterableDataset``, say)."""
    try:
        return int(len(dataset))
    except (TypeError, NotImplementedError):
        return None


def qualname(obj: Any) -> str:
    """``module.QualName`` of a class or function."""
    module = getattr(obj, "__module__", None) or "?"
    name = getattr(obj, "__qualname__", None) or getattr(obj, "__name__", None) or repr(obj)
    return f"{module}.{name}"


def strip_addresses(text: str) -> str:
    """``text`` without memory addresses (`` at 0x7f...``), which differ in every process."""
    return _ADDRESS_RE.sub("", text)


def jsonable(obj: Any) -> Any:
    """``obj`` as plain JSON values, the same in every process for the same value.

    Mappings get string keys in sorted order, tuples and sets become lists (a set sorted), a float
    that JSON cannot hold (inf, nan) becomes ``None``, a function or class its qualified name, and
    anything else its repr without memory addresses.
    """
    if obj is None or isinstance(obj, bool | int | str):
        return obj
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, Mapping):
        return {str(k): jsonable(v) for k, v in sorted(obj.items(), key=lambda kv: str(kv[0]))}
    if isinstance(obj, list | tuple):
        return [jsonable(v) for v in obj]
    if isinstance(obj, set | frozenset):
        return sorted((jsonable(v) for v in obj), key=repr)
    if callable(obj) and hasattr(obj, "__qualname__"):
        return qualname(obj)
    return strip_addresses(repr(obj))


def contains_cuda(obj: Any, depth: int = 0) -> bool:
    """Whether a sample or batch holds a tensor on a CUDA device (worker processes cannot share it)."""
    if depth > MAX_DEPTH:
        return False
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return bool(obj.is_cuda)
    if isinstance(obj, Mapping):
        return any(contains_cuda(v, depth + 1) for v in obj.values())
    if isinstance(obj, list | tuple):
        return any(contains_cuda(v, depth + 1) for v in obj)
    return False


def describe_sample(sample: Any, depth: int = 0) -> dict[str, Any]:
    """The structure of a sample: types, shapes and dtypes, never values (labels differ per sample)."""
    if depth > MAX_DEPTH:
        return {"type": qualname(type(sample))}
    if sample is None:
        return {"type": "None"}
    if isinstance(sample, bool | int | float | complex | str | bytes):
        return {"type": type(sample).__name__}
    torch = sys.modules.get("torch")  # not imported here: reading a profile needs no torch
    if torch is not None and isinstance(sample, torch.Tensor):
        return {
            "type": "tensor",
            "shape": list(sample.shape),
            "dtype": str(sample.dtype),
            "device": sample.device.type,
        }
    module = type(sample).__module__ or ""
    if module.startswith("numpy"):
        if hasattr(sample, "shape") and hasattr(sample, "dtype"):
            return {"type": "ndarray", "shape": list(sample.shape), "dtype": str(sample.dtype)}
        return {"type": type(sample).__name__}
    if module.startswith("PIL.") and hasattr(sample, "size") and hasattr(sample, "mode"):
        return {"type": "PIL.Image", "size": list(sample.size), "mode": str(sample.mode)}
    if isinstance(sample, Mapping):
        keys = sorted(sample, key=str)
        out: dict[str, Any] = {"type": "dict", "len": len(keys)}
        if len(keys) <= MAX_ITEMS:
            out["items"] = {str(k): describe_sample(sample[k], depth + 1) for k in keys}
        return out
    if isinstance(sample, tuple | list):
        out = {"type": type(sample).__name__, "len": len(sample)}
        if len(sample) <= MAX_ITEMS:
            out["items"] = [describe_sample(item, depth + 1) for item in sample]
        return out
    return {"type": qualname(type(sample))}


def sample_text(sample: Any) -> str:
    """A sample's structure for a message: ``(tensor[3, 32, 32] float32, int)``."""
    return _structure_text(describe_sample(sample))


def _structure_text(d: Mapping[str, Any]) -> str:
    kind = d["type"]
    if kind == "tensor":
        dims = ", ".join(str(n) for n in d["shape"])
        return f"tensor[{dims}] {d['dtype'].removeprefix('torch.')}"
    items = d.get("items")
    if kind == "tuple" and items is not None:
        return "(" + ", ".join(_structure_text(v) for v in items) + ")"
    if kind == "list" and items is not None:
        return "[" + ", ".join(_structure_text(v) for v in items) + "]"
    if kind == "dict" and items is not None:
        return "{" + ", ".join(f"{k!r}: {_structure_text(v)}" for k, v in items.items()) + "}"
    return str(kind).rsplit(".", 1)[-1]
