"""Describing datasets and samples: their structure (types, shapes, dtypes), never their values.

Used by the messages of the pre-flight checks and by the workload fingerprint of the profile key.
Imports no torch: a profile is read without it.
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from typing import Any

MAX_ITEMS = 16
"""Items of a list, tuple or dict sample described one by one; longer ones are summarised by length."""

MAX_DEPTH = 6
"""Nesting depth a sample is described to."""


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
