"""The datasets a cache hands to the DataLoader in place of the user's.

Each holds the cached fields (see ``stores.py``) and the random suffix, is picklable, and gives
exactly what the user's dataset gives (see NOTE [ Pre-transform split ] in ``__init__.py``).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, get_worker_info

from .steps import Chain, PadFill
from .stores import RAGGED_KINDS, Layout, RaggedColumn, is_ragged, tensor_types


class CachedSamples(Dataset[Any]):
    """Samples whose deterministic prefix was applied once; the random suffix runs per sample.

    ``fields`` holds, per field of a sample, an (n, ...) tensor (fixed shape, or numbers) or a
    :class:`RaggedColumn` (samples of their own sizes).
    """

    def __init__(
        self,
        fields: Sequence[Any],
        layout: Layout,
        is_seq: type | None,
        field: int | None,
        suffix: Chain | None,
        subclasses: tuple[type, ...],
    ) -> None:
        self.fields = tuple(fields)
        self.kinds = tuple(kind for kind, _, _ in layout)
        self.is_seq = is_seq
        self.field = field
        self.suffix = suffix
        self.subclasses = subclasses

    def __len__(self) -> int:
        return len(self.fields[0])

    def __getitem__(self, index: int) -> Any:
        values: list[Any] = []
        for k, (data, kind) in enumerate(zip(self.fields, self.kinds, strict=True)):
            if kind == "tensor":
                # A copy: the suffix (or the caller) may work in place, and the cache is shared.
                x: Any = data[index].clone().as_subclass(self.subclasses[k])
            elif kind in RAGGED_KINDS:
                x = data.get(index)  # a private copy, as the original type
            else:
                values.append(data[index].item())
                continue
            if self.suffix is not None and (self.field is None or self.field == k):
                x = self.suffix(x)
            values.append(x)
        return self.is_seq(values) if self.is_seq is not None else values[0]


class _CachedBatches(CachedSamples):
    """Fully cached samples: a batch is gathered with one indexing operation per field."""

    def __getitems__(self, indices: list[int]) -> Any:
        index = torch.as_tensor(indices, dtype=torch.long, device=self.fields[0].device)
        batch = [_gather(data, index) for data in self.fields]
        # As default_collate gives it: a list of fields for sequence samples, else the tensor.
        return batch if self.is_seq is not None else batch[0]


class _CachedCropFlipBatches(CachedSamples):
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
        # Every index tensor lives where the cache does (the ``device`` strategy keeps it on the GPU).
        dev = data.device
        index = torch.as_tensor(indices, dtype=torch.long, device=dev)
        images = data.index_select(0, index)
        if self.fill is not None:  # the padded images, filled with the mapped fill
            padded = torch.empty((len(indices), c, hp, wp), dtype=data.dtype, device=dev)
            padded.copy_(self.fill.to(dev, data.dtype).view(1, c, 1, 1).expand_as(padded))
            padded[:, :, top : top + h, left : left + w] = images
            images = padded
        # One gather: per-sample rows and columns of the crop window, columns reversed when flipped.
        rows = torch.tensor(tops, device=dev).view(-1, 1) + torch.arange(th, device=dev)
        step = 1 - 2 * torch.tensor(flips, dtype=torch.long, device=dev).view(-1, 1)
        cols = (torch.tensor(lefts, device=dev).view(-1, 1) + (tw - 1) * (step < 0)
                + step * torch.arange(tw, device=dev))
        batch_i = torch.arange(len(indices), device=dev).view(-1, 1, 1, 1)
        out = _empty_batch(data, (len(indices), c, th, tw))
        torch.index_select(images.flatten(), 0, (
            ((batch_i * c + torch.arange(c, device=dev).view(1, -1, 1, 1)) * hp + rows.view(-1, 1, th, 1))
            * wp + cols.view(-1, 1, 1, tw)
        ).flatten(), out=out.view(-1))
        batch = [out if j == k else _gather(f, index) for j, f in enumerate(self.fields)]
        return batch if self.is_seq is not None else batch[0]


def _crop_flip(suffix: Chain | None) -> dict[str, Any] | None:
    """The batched crop/flip arguments when ``suffix`` is exactly [Pad?, RandomCrop?, Flip?] (v1)."""
    if suffix is None:
        return None
    steps: list[Any] = list(suffix.steps)
    args: dict[str, Any] = {"fill": None, "ltrb": (0, 0, 0, 0), "crop": None, "flip": None}
    if steps and isinstance(steps[0], PadFill):
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
    so the batch is not copied once more to be sent to the main process.

    On the CPU through NumPy, on one thread: torch hands a gather of more than a few ten thousand
    elements to its OpenMP threads, and in a loop whose step leaves them asleep (a sleeping or
    synchronising step), waking them costs more than the copy itself (``stores.copy_into`` says
    more). Torch where NumPy cannot (bfloat16) and off the CPU.
    """
    out = None if get_worker_info() is None or data.device.type != "cpu" else (
        _empty_batch(data, (len(index), *data.shape[1:])))
    if data.device.type == "cpu":
        try:
            src, rows = data.numpy(), index.numpy()
        except (TypeError, RuntimeError):
            pass  # a dtype NumPy lacks
        else:
            if out is None:
                return torch.from_numpy(src.take(rows, axis=0))
            np.take(src, rows, axis=0, out=out.numpy())
            return out
    if out is None:
        return data.index_select(0, index)
    return torch.index_select(data, 0, index, out=out)


class Unbatched(Dataset[Any]):
    """A batched cache whose batches are unbound into the samples the original dataset gives.

    For a user's ``collate_fn``: one gather per batch (random numbers drawn sample after sample,
    as the original does), then each sample as ``dataset[i]`` would be (tensor fields as views of
    the batch, number fields as Python numbers).
    """

    def __init__(self, batches: Any) -> None:
        self.batches = batches
        """A ``CachedSamples`` that gathers batches, or a ``FillingBatches`` filling one."""

    def __len__(self) -> int:
        return len(self.batches)

    def __getitem__(self, index: int) -> Any:
        return self.batches[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        cached = self.batches
        ready = getattr(cached, "ready", None)  # a cache still filling (NOTE [ Filling caches ])
        if ready is not None and not ready(indices):
            return [cached[i] for i in indices]  # a sample it cannot hold: per sample, as the original
        batch = cached.__getitems__(indices)
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


def already_collated(batch: Any) -> Any:
    """The collate function for ``_CachedBatches``: the batch arrives collated."""
    return batch


class CachedRows(Dataset[Any]):
    """A Hugging Face ``datasets.Dataset`` with its decoded images cached (see ``sources.py``).

    Rows are rebuilt from the cache (images from ragged columns, other columns from plain lists)
    and passed to the dataset's own transform the way its formatter does: as a batch of one row for
    ``ds[i]``, as one batch for ``ds.__getitems__(indices)``. The user's transform still runs on
    every access, so only the decoding is saved.
    """

    returns_samples = True
    """``__getitems__`` gives a list of samples (for the default collate), not a collated batch."""

    def __init__(
        self,
        columns: Sequence[str],
        images: dict[str, RaggedColumn],
        others: dict[str, list[Any]],
        transform: Callable[[dict[str, list[Any]]], Any] | None,
        length: int,
    ) -> None:
        self.columns = tuple(columns)
        self.images = images
        self.others = others
        self.transform = transform
        self.length = length

    @property
    def fields(self) -> tuple[RaggedColumn, ...]:
        return tuple(self.images.values())

    def __len__(self) -> int:
        return self.length

    def _batch(self, indices: Sequence[int]) -> dict[str, list[Any]]:
        for i in indices:
            if not -self.length <= i < self.length:
                raise IndexError(f"Invalid key: {i} is out of bounds for size {self.length}")
        return {
            c: [self.images[c].get(i) for i in indices]
            if c in self.images
            else [self.others[c][i] for i in indices]
            for c in self.columns
        }

    def __getitem__(self, index: int) -> Any:
        batch = self._batch([index])
        out = self.transform(batch) if self.transform is not None else batch
        return {key: values[0] for key, values in out.items()}

    def __getitems__(self, indices: list[int]) -> list[Any]:
        batch = self._batch(indices)
        out = self.transform(batch) if self.transform is not None else batch
        count = len(out[next(iter(out))])
        return [{key: values[j] for key, values in out.items()} for j in range(count)]


def wrap_fields(fields: Sequence[Any], layout: Layout, plan: Any) -> Any:
    """The wrapped dataset for ``plan`` over stored ``fields``: batched where the cache allows."""
    first = plan.probe[0]
    is_seq = type(first) if isinstance(first, (tuple, list)) else None
    args = (fields, layout, is_seq, plan.field, plan.suffix, tensor_types(first))
    if is_ragged(layout):
        return CachedSamples(*args)  # samples of their own sizes: nothing to batch before collate
    crop_flip = _crop_flip(plan.suffix)
    if crop_flip is not None and fields[plan.field or 0].dim() == 4:
        return _CachedCropFlipBatches(*args, **crop_flip)
    return CachedSamples(*args) if plan.suffix is not None else _CachedBatches(*args)
