"""Raw-source adapters: how to read a sample without its transform, and what identifies the raw data.

- Vision datasets (torchvision's ``VisionDataset``, ``DatasetFolder``/``ImageFolder``, and any dataset
  with a ``transform`` attribute applied to one field): a shallow copy with ``transform=None`` gives
  the sample as the transform would receive it (ImageFolder's default loader: a decoded PIL image,
  converted to RGB), the target transform still applied. A torch ``ConcatDataset`` of them that share
  one transform object: the concatenation of those copies.
- Hugging Face ``datasets.Dataset`` with a transform set by ``set_transform``/``with_transform``: the
  same table in the plain Python format gives each row with its ``Image`` columns decoded, and the
  user's transform runs on the cached rows as the table's formatter would run it.

Each adapter also names what identifies its raw data for the freshness check (NOTE [ Fresh caches ]):
the files behind a folder, a table's own fingerprint.
"""

from __future__ import annotations

import copy
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .fresh import Part, concatenated, file_stats, listed_paths, value_part

MIN_DECODE_S = 50e-6
"""A raw read faster than this per sample (an in-memory array made an image) is not worth caching."""

MIN_DECODE_SHARE = 0.3
"""The raw read's share of a sample's time above which caching decoded samples alone is offered."""


@dataclass(frozen=True)
class Source:
    """Where a plan reads raw samples."""

    raw: Any
    """``raw[i]``: sample ``i`` without the transform (only field ``field`` of it, for tuples)."""
    steps: list[Any]
    """The transform pipeline, flattened."""
    decodes: bool
    """Reading a raw sample decodes a file (a DatasetFolder): caching raw samples alone pays."""


def transform_steps(transform: Any) -> list[Any]:
    steps = getattr(transform, "transforms", None)
    if type(transform).__name__ == "Compose" and isinstance(steps, (list, tuple)):
        return [s for step in steps for s in transform_steps(step)]
    return [transform]


def transform_of(dataset: Any) -> Any:
    """The transform ``dataset`` applies: its ``transform``; for a ``ConcatDataset``, the one transform
    object all its datasets share, or None where they differ."""
    joined = concatenated(dataset)
    if joined is None:
        return getattr(dataset, "transform", None)
    found = {id(t): t for t in map(transform_of, joined)}
    return next(iter(found.values())) if len(found) == 1 else None


def transforms_of(dataset: Any) -> list[Any]:
    """Every transform ``dataset`` applies, each once: one, or one per dataset a ``ConcatDataset``
    joins (None for a dataset without one)."""
    joined = concatenated(dataset)
    if joined is None:
        return [getattr(dataset, "transform", None)]
    return list({id(t): t for d in joined for t in transforms_of(d)}.values())


def vision_source(dataset: Any) -> Source | None:
    """A shallow copy of ``dataset`` that returns untransformed samples; None if none can be made.

    A ``ConcatDataset`` whose datasets share one transform (the same folder joined several times, a
    train and a validation folder made with one pipeline): the concatenation of their copies."""
    transform = transform_of(dataset)
    if transform is None:
        return None
    joined = concatenated(dataset)
    if joined is not None:
        return _joined_source(dataset.datasets, joined, transform)
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
    from torchvision.datasets import DatasetFolder

    return Source(raw, transform_steps(transform), isinstance(dataset, DatasetFolder))


def _joined_source(datasets: list[Any], joined: list[Any], transform: Any) -> Source | None:
    from torch.utils.data import ConcatDataset

    made: dict[int, Source] = {}
    for d in joined:
        if (source := vision_source(d)) is None:
            return None
        made[id(d)] = source
    raw: ConcatDataset[Any] = ConcatDataset([made[id(d)].raw for d in datasets])
    return Source(raw, transform_steps(transform), all(s.decodes for s in made.values()))


READ_ALIKE_ANYWHERE = ("DatasetFolder", "CIFAR10", "MNIST", "SVHN", "STL10", "FakeData")
"""torchvision's dataset classes whose ``__getitem__`` holds nothing open between reads: an image
file opened and closed per sample (with torchvision's own loader), or arrays loaded at construction."""


def reads_alike_anywhere(dataset: Any) -> bool:
    """Whether reading samples of ``dataset`` in the main process changes nothing its worker
    processes read later, so that a cache may be planned there although the user's workers serve.

    A dataset of the user's own may open a handle on its first read (an HDF5 or LMDB file) that
    forked workers would then share, as torch warns against: torch never reads a sample in the main
    process when workers are given, and neither does the loader, except for these torchvision
    classes and ``TensorDataset``, with their own ``__getitem__`` and loader.
    """
    import torchvision.datasets as tvd
    from torch.utils.data import TensorDataset

    joined = concatenated(dataset)  # torch's own __getitem__ finds the dataset and reads it there
    if joined is not None:
        return all(map(reads_alike_anywhere, joined))
    owner = next((c for c in type(dataset).__mro__ if "__getitem__" in vars(c)), None)
    if owner is TensorDataset:
        return True
    if owner is None or not owner.__module__.startswith("torchvision.datasets."):
        return False
    if not issubclass(owner, tuple(getattr(tvd, name) for name in READ_ALIKE_ANYWHERE)):
        return False
    loader = getattr(dataset, "loader", None)
    return loader is None or loader in (tvd.folder.default_loader, tvd.folder.pil_loader)


def file_parts(dataset: Any) -> list[Part]:
    """The files a dataset lists (``fresh.listed_paths``), each by its size and modification time; a
    message names the one changed."""
    paths = listed_paths(dataset)
    if not paths:
        return []
    stats = file_stats(paths)
    return [Part("the files", tuple((path, (size, mtime), "") for path, size, mtime in stats))]


def unlisted_reads(dataset: Any, opened: list[str]) -> str | None:
    """Why ``dataset`` cannot be cached when reading its probes opened the files ``opened`` (NOTE
    [ Fresh caches ] 4): one it does not list; ``None`` where it lists every one."""
    if not opened:
        return None
    listed = {os.path.abspath(p) for p in listed_paths(dataset)}
    unlisted = [p for p in opened if p not in listed]
    if not unlisted:
        return None
    more = f" and {len(unlisted) - 1} more" if len(unlisted) > 1 else ""
    return (f"its samples read files it does not list ({unlisted[0]}{more}): a file rewritten between"
            " epochs could not be seen, so nothing is cached (list the paths in an attribute, as"
            " ImageFolder's samples do, to have them checked)")


# ---------------------------------------------------------------------------- Hugging Face tables


def is_table(dataset: Any) -> bool:
    """A Hugging Face ``datasets.Dataset`` (without importing ``datasets`` when it is not one)."""
    return type(dataset).__module__.startswith("datasets.") and hasattr(dataset, "_format_type")


@dataclass(frozen=True)
class Table:
    """A Hugging Face table split into what is cached and what still runs per access."""

    raw: Any
    """The table in the plain Python format: rows with their images decoded."""
    images: tuple[str, ...]
    """Columns with a decoding ``Image`` feature."""
    columns: tuple[str, ...]
    transform: Callable[[dict[str, list[Any]]], Any] | None


def table_source(dataset: Any) -> tuple[Table | None, str | None]:
    """How to cache a Hugging Face table's decoded images; or the reason it cannot be done."""
    import datasets

    features = dataset.features
    images = tuple(
        name for name, f in features.items() if isinstance(f, datasets.Image) and f.decode
    )
    if not images:
        return None, "the table has no Image column to decode: nothing worth caching"
    fmt = dataset.format
    if fmt["type"] not in (None, "python", "custom"):
        return None, (
            f"the table's format is {fmt['type']!r}; only the Python format and a transform set by"
            " set_transform/with_transform are cached"
        )
    if fmt["columns"] is not None and list(fmt["columns"]) != list(dataset.column_names):
        return None, "the table's format selects columns; only whole rows are cached"
    transform = fmt.get("format_kwargs", {}).get("transform") if fmt["type"] == "custom" else None
    table = Table(dataset.with_format(None), images, tuple(dataset.column_names), transform)
    return table, None


def table_identity(dataset: Any) -> list[Part]:
    fmt = dataset.format
    transform = fmt.get("format_kwargs", {}).get("transform")
    return [
        value_part("the table", length=len(dataset), fingerprint=dataset._fingerprint),
        value_part("the table's format", type=fmt["type"], columns=fmt["columns"], transform=transform),
    ]
