"""The workload fingerprint and the profile key: what makes two tuning runs the same question.

A profile is keyed by :func:`profile_key` over two fingerprints: the machine's
(:meth:`autotune.machine.MachineInfo.fingerprint`) and the workload's (:func:`workload_fingerprint`):
the dataset's type, length and sample structure, its transform, the step, the device and the
arguments the user holds fixed. Both are plain JSON, readable in a stored profile.

Imports no torch, Optuna or SQLAlchemy: a cache hit keys the workload and reads a file, no more.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import sys
import types
from collections.abc import Mapping
from typing import Any

from .describe import MAX_DEPTH, dataset_length, describe_sample, jsonable, qualname, strip_addresses

KEY_LENGTH = 16
"""Hex characters of the profile key: 64 bits, ample for the profiles of one user or fleet."""


def workload_fingerprint(
    dataset: Any,
    *,
    step: Any = None,
    device: str = "cpu",
    fixed: Mapping[str, Any] | None = None,
    read_sample: bool = True,
) -> dict[str, Any]:
    """A readable description of what is being loaded, the same in every process for the same workload.

    Cheap: it reads one sample (``dataset[0]``, or the first item of an iterable dataset), or, with
    ``read_sample=False``, none: then the dataset's own attributes describe it (their types, and the
    shapes and dtypes of its arrays; see :func:`describe_attributes`). Memory addresses are stripped
    from reprs, and the step is identified by its qualified name plus a hash of its compiled code, so
    editing the step's body gives a new key. Errors raised by the dataset itself are not caught.
    """
    length = dataset_length(dataset)
    sample = (describe_sample(_first_sample(dataset, length)) if read_sample
              else {"attributes": describe_attributes(dataset)})
    return {
        "dataset": qualname(type(dataset)),
        "len": length,
        "sample": sample,
        "transform": _transform_repr(dataset),
        "step": _step_identity(step),
        "device": str(device),
        "fixed": jsonable(dict(fixed)) if fixed else {},
    }


def describe_attributes(dataset: Any) -> dict[str, Any]:
    """The dataset's instance attributes, described without reading a sample: numbers, short strings
    and paths as they are; arrays and tensors by shape and dtype; sequences by type and length; other
    objects by type. Private attributes are left out."""
    out: dict[str, Any] = {}
    for name, value in sorted(getattr(dataset, "__dict__", {}).items()):
        if name.startswith("_") or callable(value):
            continue
        if isinstance(value, (bool, int, float)) or (isinstance(value, str) and len(value) <= 200):
            out[name] = value
        elif hasattr(value, "shape") and hasattr(value, "dtype"):
            out[name] = {"shape": [int(d) for d in value.shape], "dtype": str(value.dtype)}
        elif isinstance(value, (list, tuple, dict)):
            out[name] = {"type": type(value).__name__, "len": len(value)}
        else:
            out[name] = {"type": qualname(type(value))}
    return out


def profile_key(machine_fp: Mapping[str, Any], workload_fp: Mapping[str, Any]) -> str:
    """A short hex key, stable across processes and runs: sha256 over canonical JSON of both."""
    text = json.dumps(
        {"machine": machine_fp, "workload": workload_fp},
        sort_keys=True, separators=(",", ":"), ensure_ascii=True, default=str,
    )
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:KEY_LENGTH]


def _first_sample(dataset: Any, length: int | None) -> Any:
    if length == 0:
        return None
    if length is not None and hasattr(dataset, "__getitem__"):
        return dataset[0]
    if hasattr(dataset, "__iter__"):
        # An iterable dataset: take its first item and let the iterator go.
        return next(iter(dataset), None)
    return None


def _transform_repr(dataset: Any) -> str | None:
    # Wrappers such as Subset keep the transform on the dataset they wrap; a ConcatDataset on each
    # of the datasets it joins.
    for _ in range(MAX_DEPTH):
        transform = getattr(dataset, "transform", None)
        if transform is not None:
            return strip_addresses(repr(transform))
        joined = getattr(dataset, "datasets", None)
        if isinstance(joined, (list, tuple)) and joined:
            return " + ".join(dict.fromkeys(t for t in map(_transform_repr, joined) if t)) or None
        dataset = getattr(dataset, "dataset", None)
        if dataset is None:
            break
    return None


def _step_identity(step: Any) -> dict[str, Any] | None:
    """Qualified name plus a hash of the compiled code (see NOTE [ Step identity ])."""
    # NOTE [ Step identity ]
    # A function is named by module.qualname and hashed over its bytecode, constants and names, so
    # the same step gives the same key in every process and an edited step gives a new one. A bound
    # method, an nn.Module or another callable object is named by its class (an instance has no
    # stable identity), hashed over the code of the method that runs (the method, forward, __call__).
    if step is None:
        return None
    if isinstance(step, functools.partial):
        inner = _step_identity(step.func) or {}
        return {"name": f"functools.partial({inner.get('name')})", "code": inner.get("code")}
    if inspect.ismethod(step):
        func = step.__func__
        return {
            "name": f"{qualname(type(step.__self__))}.{func.__name__}",
            "code": _function_digest(func),
        }
    if inspect.isfunction(step) or inspect.isbuiltin(step) or isinstance(step, type):
        return {"name": qualname(step), "code": _function_digest(step)}
    cls = type(step)
    torch = sys.modules.get("torch")  # not imported here: a step that is a Module imported it
    is_module = torch is not None and isinstance(step, torch.nn.Module)
    runs = getattr(cls, "forward" if is_module else "__call__", None)
    return {"name": qualname(cls), "code": _function_digest(runs)}


def _function_digest(func: Any) -> str | None:
    code = getattr(func, "__code__", None)
    if not isinstance(code, types.CodeType):
        return None
    return _code_digest(code)


def _code_digest(code: types.CodeType) -> str:
    h = hashlib.sha256()
    h.update(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(b"\0")
        if isinstance(const, types.CodeType):
            h.update(_code_digest(const).encode())
        elif isinstance(const, frozenset):
            # A set literal's repr follows string hashing, which differs per process.
            h.update(repr(sorted(repr(c) for c in const)).encode())
        else:
            h.update(strip_addresses(repr(const)).encode())
    return h.hexdigest()[:KEY_LENGTH]
