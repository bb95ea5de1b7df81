"""Pre-flight: the dataset, the step and the arguments checked before anything is planned or measured.

Everything here runs before a profile is looked up or a candidate is measured, so bad input fails at
once with a :class:`~autotune.exceptions.ConfigurationError` that names the value, the rule and the
fix, and what cannot work with worker processes (a dataset that cannot be pickled under ``spawn``, an
``IterableDataset`` that does not shard) is known before the search space is drawn.
"""

from __future__ import annotations

import math
import multiprocessing
import pickle
import types
from collections.abc import Sequence
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate

from . import pretransform as pt
from .describe import dataset_length, sample_text
from .exceptions import ConfigurationError

PRETRANSFORM_CHOICES = ("auto", *pt.STRATEGIES)


def check_dataset(dataset: Any, *, allow_empty: bool = False) -> int | None:
    """``len(dataset)`` checked, or ``None`` for an iterable dataset without one. An empty dataset is
    refused unless ``allow_empty`` (the drop-in accepts it, as torch does, and serves nothing)."""
    if isinstance(dataset, IterableDataset):
        return dataset_length(dataset)
    if not hasattr(dataset, "__getitem__"):
        if hasattr(dataset, "__iter__"):
            raise ConfigurationError(
                f"dataset of type {type(dataset).__name__} is iterable but not a"
                " torch.utils.data.IterableDataset; wrap it in an IterableDataset subclass, or"
                " give it __getitem__ and __len__."
            )
        raise ConfigurationError(
            f"dataset of type {type(dataset).__name__} is not a dataset: it needs __getitem__"
            " and __len__ (a map-style torch.utils.data.Dataset) or to be an IterableDataset."
        )
    n = dataset_length(dataset)
    if n is None:
        raise ConfigurationError(
            f"dataset of type {type(dataset).__name__} has __getitem__ but no __len__; add"
            " __len__, or make it an IterableDataset."
        )
    if n == 0 and not allow_empty:
        raise ConfigurationError(
            f"dataset of type {type(dataset).__name__} is empty (len 0); there is nothing to load."
        )
    return n


def check_number(name: str, value: Any, *, minimum: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(f"{name}={value!r} is not a finite number; {fix}")
    if value < minimum or (minimum == 0 and value <= 0):
        rule = "> 0" if minimum == 0 else f">= {minimum:g}"
        raise ConfigurationError(f"{name}={value!r} must be {rule}; {fix}")
    return float(value)


def resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigurationError(
            f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'."
        ) from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            f"device={device!r} but CUDA is not available on this machine; use device='cpu'."
        )
    return dev


def resolve_pretransforms(pretransform: str | Sequence[str]) -> tuple[str, ...]:
    names = [pretransform] if isinstance(pretransform, str) else list(pretransform)
    for name in names:
        if name not in PRETRANSFORM_CHOICES:
            raise ConfigurationError(
                f"pretransform={name!r} is not a pre-transform strategy; use one of"
                f" {PRETRANSFORM_CHOICES} ('auto' searches every strategy that applies)."
            )
    if "auto" in names:
        return pt.STRATEGIES
    return tuple(dict.fromkeys(names))


LOADER_SETTINGS = {
    "batch_size": "a positive integer",
    "num_workers": "a non-negative integer",
    "pin_memory": "True or False",
    "prefetch_factor": "a positive integer or None",
    "persistent_workers": "True or False",
    "in_order": "True or False",
}
"""The DataLoader settings a baseline may give, and the rule for each."""


def check_loader_settings(name: str, settings: Any) -> None:
    """Refuse DataLoader settings that torch's DataLoader would refuse, naming the value and the rule."""
    if not isinstance(settings, dict):
        raise ConfigurationError(
            f"{name}={settings!r} must be a dict of DataLoader settings, e.g. {{'num_workers': 4}}.")
    for key, value in settings.items():
        rule = LOADER_SETTINGS.get(key)
        if rule is None:
            raise ConfigurationError(
                f"{name} has {key}={value!r}; the settings it may give are {sorted(LOADER_SETTINGS)}.")
        ints = {"batch_size": 1, "num_workers": 0, "prefetch_factor": 1}
        if key in ints:
            ok = (value is None and key == "prefetch_factor") or (
                isinstance(value, int) and not isinstance(value, bool) and value >= ints[key])
        else:
            ok = isinstance(value, bool)
        if not ok:
            raise ConfigurationError(f"{name} has {key}={value!r}, which must be {rule}.")


def check_callable(name: str, value: Any, fix: str) -> None:
    if value is not None and not callable(value):
        raise ConfigurationError(f"{name}={value!r} is not callable; {fix}")


def check_collates(dataset: Any, n: int | None, batch_size: Any) -> None:
    """Collate two samples as a DataLoader would, so a dataset that cannot be batched fails now, with
    the shapes in the message, rather than under every candidate."""
    if n is None or n < 2 or isinstance(dataset, IterableDataset):
        return  # a stream is not read ahead of the search (it may be unbounded or one-shot)
    sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size or [2])
    if all(isinstance(b, int) and b <= 1 for b in sizes):
        return  # batches of one never stack two samples
    last = n - 1
    try:
        samples = [dataset[0], dataset[last]]
    except Exception as err:
        err.add_note(f"autotune: raised while reading dataset[0] and dataset[{last}] before tuning.")
        raise
    try:
        default_collate(samples)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigurationError(
            f"samples of {type(dataset).__name__} cannot be batched by default_collate: dataset[0] is"
            f" {sample_text(samples[0])} and dataset[{last}] is {sample_text(samples[1])}"
            f" ({type(err).__name__}: {first}); pass collate_fn= that pads or packs them (for"
            " sequences, torch.nn.utils.rnn.pad_sequence), give every sample the same shape and types,"
            " or use batch_size=1."
        ) from err


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _StructurePickler(pickle.Pickler):
    """Pickles everything but array data: whether a dataset can be pickled, without copying it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor | torch.UntypedStorage | torch.TypedStorage):
            return (tuple, ())
        if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            return (tuple, ())
        return NotImplemented


def start_method(context: Any = None) -> str:
    """The start method DataLoader workers will use (the loader's ``multiprocessing_context``, a
    context or its name, else the process-wide default, without fixing it)."""
    if isinstance(context, str):
        return context
    if context is not None and hasattr(context, "get_start_method"):
        return str(context.get_start_method())
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def unpicklable_reason(dataset: Any, collate_fn: Any, context: Any = None) -> str | None:
    """Why workers cannot receive the dataset (or collate_fn) under a start method that pickles them
    (``context``: the loader's multiprocessing context or its name; ``None``: the default)."""
    method = start_method(context)
    if method == "fork":
        return None  # forked workers inherit the objects; nothing is pickled
    for name, obj in (("dataset", dataset), ("collate_fn", collate_fn)):
        if obj is None:
            continue
        try:
            _StructurePickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as err:  # noqa: BLE001 - TypeError, AttributeError, PicklingError, ...
            what = f"dataset of type {type(obj).__name__}" if name == "dataset" else f"collate_fn={obj!r}"
            return (
                f"{what} cannot be pickled ({type(err).__name__}: {err}); only num_workers=0 is"
                f" searched, because the {method!r} start method sends it pickled to every worker"
                " process. Make it picklable (no locks, lambdas or open files as attributes), or use"
                " multiprocessing.set_start_method('fork') where the platform has it."
            )
    return None


def shards_by_worker(dataset: Any) -> bool:
    """Whether the dataset's ``__iter__`` calls ``get_worker_info`` (a heuristic: it reads the code)."""
    codes = [getattr(getattr(type(dataset), "__iter__", None), "__code__", None)]
    while codes:
        code = codes.pop()
        if isinstance(code, types.CodeType):
            if "get_worker_info" in code.co_names:
                return True
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False
