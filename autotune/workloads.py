"""Synthetic workloads for the command line, the tests and the benchmarks.

A :class:`Workload` is a dataset, a training step and the batch size it usually runs with. Every
dataset here is made from a seed, in memory or in a folder the caller gives; nothing is downloaded.
Each stands for a kind of loader bottleneck:

- ``cifar10-like``: CIFAR-10-shaped images decoded from uint8 arrays with the usual augmentation;
  per-sample CPU work in the transform, so workers help up to the core count.
- ``latency``: every sample waits on simulated remote storage; workers help far past the core count.
- ``tensor``: an in-memory tensor dataset and a tiny model; overhead-bound, workers only hurt.
- image folders (:func:`write_image_folder`, :func:`imagefolder_workload`): real encoded files,
  decoded per sample, as with ``torchvision.datasets.ImageFolder`` over a photo collection;
  :func:`write_photo_folder` writes images of varying sizes, and :func:`photo_table` reads such a
  folder as a Hugging Face table with an ``Image`` column.
- CIFAR-10 files (:func:`write_cifar10_files`, :class:`CIFAR10Files`): torchvision's on-disk
  CIFAR-10 format, read back with torchvision's own reader.

Everything a DataLoader worker touches (datasets, transforms) is module-level and picklable.
"""

from __future__ import annotations

import math
import os
import pickle
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torchvision
from PIL import Image
from torch import nn
from torch.nn import functional as F
from torch.utils.data import Dataset, TensorDataset
from torchvision import transforms

from .exceptions import ConfigurationError

CIFAR_MEAN = (0.4914, 0.4822, 0.4465)
"""Per-channel mean of the real CIFAR-10 training set, which every CIFAR recipe normalises by."""

CIFAR_STD = (0.2470, 0.2435, 0.2616)
"""Per-channel standard deviation of the real CIFAR-10 training set."""

IMAGENET_MEAN = (0.485, 0.456, 0.406)
"""Per-channel mean of ImageNet: what photo folders are usually normalised by."""

IMAGENET_STD = (0.229, 0.224, 0.225)
"""Per-channel standard deviation of ImageNet."""

CIFAR10_CLASSES = (
    "airplane",
    "automobile",
    "bird",
    "cat",
    "deer",
    "dog",
    "frog",
    "horse",
    "ship",
    "truck",
)
"""The real CIFAR-10 label names, so printed class names read as they would on the real set."""

DEFAULT_LATENCY_S = 0.005
"""Simulated per-sample read latency: a small object fetched from network storage nearby."""

IMAGE_FORMATS = {"JPEG": ".jpg", "PNG": ".png"}
"""Formats :func:`write_image_folder` writes, with the file extension each gets."""

JPEG_QUALITY = 90
"""Quality of the written JPEG files: typical of photo collections; decoding barely depends on it."""

_GEN_CHUNK = 1024
"""Images generated per vectorised step: keeps the float32 temporaries around 12 MiB at 32x32."""


@dataclass(frozen=True)
class Workload:
    """A dataset, the training step that consumes it, and the batch size it usually runs with."""

    name: str
    dataset: Dataset[Any]
    step: Callable[[Any], Any] | None
    """Called with a collated batch already on the device; ``None``: loading alone is measured."""
    batch_size: int
    description: str


# --------------------------------------------------------------------------------------------------
# Synthetic images

# NOTE [ Synthetic images ]
# Each image is a flat background of a random colour with one Gaussian blob whose colour is set by
# the class, plus uniform noise of +-16 grey levels. Colour survives random crops and flips, so the
# label can be read off the image and a model has something real to learn (SmallCNN reaches about 60 %
# held-out accuracy within a few epochs of 2000 images): training on these data behaves like training,
# not like fitting noise. Generation is vectorised in chunks, channel-first so the per-channel
# broadcast runs over contiguous memory; 50 000 32x32 images take about a second.


def _class_palette(classes: int) -> np.ndarray:
    """(classes, 3) float32 RGB colours, hues evenly spaced around the colour wheel."""
    hues = np.arange(classes, dtype=np.float64) / classes
    rgb = np.stack([0.5 + 0.5 * np.cos(2 * np.pi * (hues + k / 3)) for k in range(3)], axis=1)
    return (rgb * 200 + 28).astype(np.float32)


def synthetic_images(
    n: int, *, size: int = 32, classes: int = 10, seed: int = 0, balanced: bool = False
) -> tuple[np.ndarray, np.ndarray]:
    """``n`` images as an (n, size, size, 3) uint8 array and their int64 labels, from ``seed``.

    See NOTE [ Synthetic images ]. With ``balanced``, every class gets ``n // classes`` or one more
    images (in shuffled order), so each class is present whenever ``n >= classes``.
    """
    rng = np.random.default_rng(seed)
    balanced_labels = np.arange(n) % classes
    labels = rng.permutation(balanced_labels) if balanced else rng.integers(0, classes, size=n)
    palette = _class_palette(classes)
    background = rng.uniform(40, 200, size=(n, 3)).astype(np.float32)
    centre_y = rng.uniform(0.25, 0.75, size=n).astype(np.float32) * size
    centre_x = rng.uniform(0.25, 0.75, size=n).astype(np.float32) * size
    radius = rng.uniform(0.12, 0.28, size=n).astype(np.float32) * size
    axis = np.arange(size, dtype=np.float32) + 0.5
    out = np.empty((n, size, size, 3), dtype=np.uint8)
    for start in range(0, n, _GEN_CHUNK):
        stop = min(n, start + _GEN_CHUNK)
        chunk = slice(start, stop)
        gy = np.exp(-(((axis[None, :] - centre_y[chunk, None]) / radius[chunk, None]) ** 2))
        gx = np.exp(-(((axis[None, :] - centre_x[chunk, None]) / radius[chunk, None]) ** 2))
        blob = (gy[:, :, None] * gx[:, None, :])[:, None]  # (k, 1, H, W)
        delta = palette[labels[chunk]] - background[chunk]  # (k, 3)
        img = blob * delta[:, :, None, None]  # (k, 3, H, W)
        img += background[chunk, :, None, None] - 16
        noise = np.frombuffer(rng.bytes((stop - start) * 3 * size * size), dtype=np.uint8)
        img += noise.reshape(stop - start, 3, size, size) >> 3  # uniform 0..31
        np.clip(img, 0, 255, out=img)
        out[chunk] = img.transpose(0, 2, 3, 1)
    return out, labels.astype(np.int64)


def _check_count(name: str, value: int, minimum: int, fix: str) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ConfigurationError(f"{name}={value!r} must be an integer >= {minimum}; {fix}")


class CIFAR10Like(torchvision.datasets.VisionDataset):
    """A CIFAR-10-shaped dataset made from a seed; it behaves like ``torchvision.datasets.CIFAR10``.

    ``data`` is an (n, 32, 32, 3) uint8 array and ``targets`` a list of ints in 0..9; a sample is
    ``Image.fromarray(data[i])`` passed through ``transform``, and its target through
    ``target_transform``. The same ``n`` and ``seed`` give the same images and labels.
    """

    def __init__(
        self,
        n: int = 50_000,
        *,
        seed: int = 0,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
    ) -> None:
        super().__init__(None, transform=transform, target_transform=target_transform)
        _check_count("n", n, 1, "pass the number of images to generate, e.g. n=50_000.")
        self.seed = seed
        self.data, labels = synthetic_images(n, size=32, classes=len(CIFAR10_CLASSES), seed=seed)
        self.targets: list[int] = labels.tolist()
        self.classes = list(CIFAR10_CLASSES)
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def __getitem__(self, index: int) -> tuple[Any, Any]:
        img: Any = Image.fromarray(self.data[index])
        target: Any = self.targets[index]
        if self.transform is not None:
            img = self.transform(img)
        if self.target_transform is not None:
            target = self.target_transform(target)
        return img, target

    def __len__(self) -> int:
        return len(self.data)

    def extra_repr(self) -> str:
        return f"Seed: {self.seed}"


def cifar_train_transform() -> transforms.Compose:
    """The standard CIFAR-10 training augmentation: pad-and-crop, flip, to tensor, normalise."""
    return transforms.Compose(
        [
            transforms.RandomCrop(32, padding=4),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(CIFAR_MEAN, CIFAR_STD),
        ]
    )


# --------------------------------------------------------------------------------------------------
# Models and training steps


class SmallCNN(nn.Module):
    """A small CNN (about 5k parameters) for images of any size, sized so the loader matters.

    Two stride-2 3x3 conv layers (16 and 32 channels) with ReLU, global average pooling and a linear
    classifier. A training step on 64 images of 32x32 takes a few ms on one CPU core: about what a
    small model's step costs on a GPU, where data loading, not the model, decides the speed (the
    case this project is for). A bigger model makes every loader look alike.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 3) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(in_channels, 16, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.Conv2d(16, 32, 3, stride=2, padding=1),
            nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1),
        )
        self.classifier = nn.Sequential(nn.Flatten(), nn.Linear(32, num_classes))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.features(x))


class TrainStep:
    """One SGD step on an ``(inputs, targets)`` batch: forward, cross-entropy, backward, update.

    The model is moved to ``device`` once, here. A call returns ``None`` rather than the loss as a
    Python float, because reading it would make the host wait for the device on every step; the loss
    of the last step stays available, on the device, as ``last_loss``.
    """

    def __init__(self, model: nn.Module, *, device: str | torch.device = "cpu", lr: float = 0.01) -> None:
        if not (isinstance(lr, (int, float)) and lr > 0 and math.isfinite(lr)):
            raise ConfigurationError(f"lr={lr!r} must be a positive finite number, e.g. lr=0.01.")
        self.device = torch.device(device)
        self.model = model.to(self.device)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=lr, momentum=0.9)
        self.last_loss: torch.Tensor | None = None

    def __call__(self, batch: Any) -> None:
        inputs, targets = batch[0], batch[1]
        # A no-op when the batch is already on the device, as the measurement delivers it.
        inputs = inputs.to(self.device, non_blocking=True)
        targets = targets.to(self.device, non_blocking=True)
        self.model.train()
        self.optimizer.zero_grad(set_to_none=True)
        loss = F.cross_entropy(self.model(inputs), targets)
        loss.backward()
        self.optimizer.step()
        self.last_loss = loss.detach()

    def __repr__(self) -> str:
        return f"TrainStep({type(self.model).__name__}, device={str(self.device)!r})"


def make_train_step(model: nn.Module, *, device: str | torch.device = "cpu", lr: float = 0.01) -> TrainStep:
    """A training step for ``model`` (moved to ``device`` once): see :class:`TrainStep`."""
    return TrainStep(model, device=device, lr=lr)


def _seeded_model(factory: Callable[[], nn.Module], seed: int) -> nn.Module:
    """Build a model with weights drawn from ``seed``, leaving the global torch RNG as it was."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return factory()


# --------------------------------------------------------------------------------------------------
# The registered workloads


def cifar10_workload(n: int = 50_000, *, seed: int = 0, device: str = "cpu") -> Workload:
    """CIFAR-10-shaped images with the standard augmentation, training :class:`SmallCNN`."""
    dataset = CIFAR10Like(n, seed=seed, transform=cifar_train_transform())
    model = _seeded_model(SmallCNN, seed)
    return Workload(
        name="cifar10-like",
        dataset=dataset,
        step=make_train_step(model, device=device),
        batch_size=64,
        description=(
            f"{n} synthetic 32x32 CIFAR-10-like images, RandomCrop + flip + ToTensor + Normalize"
            f" per sample, a small CNN trained on {device}"
        ),
    )


class LatencyDataset(Dataset[tuple[torch.Tensor, int]]):
    """Simulated remote storage: each sample waits ``delay_s`` seconds, then is made from its index.

    A sample is a (3, 32, 32) float32 tensor in [0, 1) drawn from a generator seeded with the index,
    and the target ``index % 10``. The wait uses no CPU, so many workers per core keep scaling.
    """

    def __init__(self, n: int = 4096, *, delay_s: float = DEFAULT_LATENCY_S) -> None:
        _check_count("n", n, 1, "pass the number of samples, e.g. n=4096.")
        if not (isinstance(delay_s, (int, float)) and delay_s >= 0 and math.isfinite(delay_s)):
            raise ConfigurationError(
                f"delay_s={delay_s!r} must be a finite number of seconds >= 0; use 0 for no delay."
            )
        self.n = n
        self.delay_s = float(delay_s)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not -self.n <= index < self.n:
            raise IndexError(f"index {index} is out of range for a dataset of {self.n} samples")
        index %= self.n
        if self.delay_s:
            time.sleep(self.delay_s)
        gen = torch.Generator().manual_seed(index)
        return torch.rand((3, 32, 32), generator=gen), index % 10

    def __repr__(self) -> str:
        return f"LatencyDataset(n={self.n}, delay_s={self.delay_s})"


def latency_workload(n: int = 4096, *, delay_s: float = DEFAULT_LATENCY_S) -> Workload:
    """Samples behind a simulated ``delay_s`` storage latency, and no training step."""
    return Workload(
        name="latency",
        dataset=LatencyDataset(n, delay_s=delay_s),
        step=None,
        batch_size=32,
        description=(
            f"{n} small tensors, each behind a simulated {delay_s * 1000:g} ms storage read;"
            " no training step (the batch is only moved to the device)"
        ),
    )


def tensor_workload(n: int = 20_000, *, features: int = 64, seed: int = 0, device: str = "cpu") -> Workload:
    """An in-memory ``TensorDataset`` and a tiny MLP: overhead-bound, workers only add cost.

    Features are standard normal float32; labels (int64, 10 classes) come from a fixed random linear
    map of the features, so the MLP has something to learn.
    """
    _check_count("n", n, 1, "pass the number of rows, e.g. n=20_000.")
    _check_count("features", features, 1, "pass the number of features per row, e.g. features=64.")
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn((n, features), generator=gen)
    teacher = torch.randn((features, 10), generator=gen)
    y = (x @ teacher).argmax(dim=1)
    model = _seeded_model(
        lambda: nn.Sequential(nn.Linear(features, 64), nn.ReLU(inplace=True), nn.Linear(64, 10)),
        seed,
    )
    return Workload(
        name="tensor",
        dataset=TensorDataset(x, y),
        step=make_train_step(model, device=device),
        batch_size=256,
        description=(f"{n} x {features} float32 rows already in memory, a 2-layer MLP trained on {device}"),
    )


WORKLOADS: dict[str, Callable[..., Workload]] = {
    "cifar10-like": cifar10_workload,
    "latency": latency_workload,
    "tensor": tensor_workload,
}
"""The built-in workloads by name; each factory takes keyword arguments and returns a Workload."""


def get_workload(name: str, **kwargs: Any) -> Workload:
    """The built-in workload ``name`` (see :data:`WORKLOADS`), built with ``kwargs``."""
    try:
        factory = WORKLOADS[name]
    except (KeyError, TypeError):
        raise ConfigurationError(f"unknown workload {name!r}; use one of {sorted(WORKLOADS)}.") from None
    return factory(**kwargs)


# --------------------------------------------------------------------------------------------------
# Image folders


def _refuse_non_empty(path: Path, what: str) -> None:
    if path.exists() and (not path.is_dir() or any(path.iterdir())):
        raise FileExistsError(
            f"{what} {str(path)!r} already exists and is not an empty folder; pass a new or empty"
            " folder, so no existing file is overwritten or mixed into the data."
        )


def write_image_folder(
    root: str | os.PathLike[str],
    *,
    n: int = 1000,
    classes: int = 10,
    size: int = 64,
    fmt: str = "JPEG",
    seed: int = 0,
) -> Path:
    """Write ``n`` encoded images as ``root/class_<k>/img_<i>.jpg`` (or ``.png``); return ``root``.

    The layout is the one ``torchvision.datasets.ImageFolder`` reads. Classes get equal shares (give
    or take one) so every class folder holds an image; ``k`` is zero-padded when there are more than
    ten classes, so ImageFolder's alphabetical class order is ``k``'s order. ``root`` must be new or
    empty.
    """
    key = fmt.upper() if isinstance(fmt, str) else fmt
    if key not in IMAGE_FORMATS:
        raise ConfigurationError(
            f"fmt={fmt!r} is not a supported image format; use one of {sorted(IMAGE_FORMATS)}"
            " (e.g. fmt='PNG' for lossless files)."
        )
    _check_count("classes", classes, 1, "pass the number of class folders, e.g. classes=10.")
    _check_count("n", n, classes, f"every one of the {classes} classes needs at least one image.")
    _check_count("size", size, 8, "pass the image side length in pixels, e.g. size=64.")
    root = Path(root).expanduser()
    _refuse_non_empty(root, "root")
    images, labels = synthetic_images(n, size=size, classes=classes, seed=seed, balanced=True)
    save = _image_saver(root, key, classes, n)
    for i, (img, label) in enumerate(zip(images, labels, strict=True)):
        save(i, int(label), img)
    return root


def _image_saver(root: Path, fmt: str, classes: int, n: int) -> Callable[[int, int, np.ndarray], None]:
    """Make the class folders under ``root``; return ``save(i, label, pixels)`` writing image ``i``."""
    width = len(str(classes - 1))
    dirs = [root / f"class_{k:0{width}d}" for k in range(classes)]
    for d in dirs:
        d.mkdir(parents=True, exist_ok=True)
    ext = IMAGE_FORMATS[fmt]
    options: dict[str, Any] = {"quality": JPEG_QUALITY} if fmt == "JPEG" else {}
    digits = len(str(n - 1))

    def save(i: int, label: int, pixels: np.ndarray) -> None:
        Image.fromarray(pixels).save(dirs[label] / f"img_{i:0{digits}d}{ext}", format=fmt, **options)

    return save


def write_photo_folder(
    root: str | os.PathLike[str],
    *,
    n: int = 2000,
    classes: int = 10,
    min_size: int = 120,
    max_size: int = 320,
    fmt: str = "JPEG",
    seed: int = 0,
) -> Path:
    """Like :func:`write_image_folder`, but each image has its own height and width in
    ``min_size..max_size`` (drawn from ``seed``), as in a folder of photos: what a decoded-image
    cache must store ragged. ``root`` must be new or empty; returns ``root``.
    """
    key = fmt.upper() if isinstance(fmt, str) else fmt
    if key not in IMAGE_FORMATS:
        raise ConfigurationError(
            f"fmt={fmt!r} is not a supported image format; use one of {sorted(IMAGE_FORMATS)}."
        )
    _check_count("classes", classes, 1, "pass the number of class folders, e.g. classes=10.")
    _check_count("n", n, classes, f"every one of the {classes} classes needs at least one image.")
    _check_count("min_size", min_size, 8, "pass the smallest side length in pixels, e.g. 120.")
    _check_count("max_size", max_size, min_size, f"pass a largest side length >= min_size={min_size}.")
    root = Path(root).expanduser()
    _refuse_non_empty(root, "root")
    rng = np.random.default_rng(seed)
    heights = rng.integers(min_size, max_size + 1, size=n)
    widths = rng.integers(min_size, max_size + 1, size=n)
    labels = rng.permutation(np.arange(n) % classes)
    save = _image_saver(root, key, classes, n)
    palette = _class_palette(classes)
    for i in range(n):
        h, w, label = int(heights[i]), int(widths[i]), int(labels[i])
        # One square synthetic image of the class's colour (NOTE [ Synthetic images ]), cut to h x w.
        side = max(h, w)
        img, _ = synthetic_images(1, size=side, classes=classes, seed=seed * 100_003 + i)
        tint = (palette[label] - palette.mean(axis=0)) * 0.5
        save(i, label, np.clip(img[0, :h, :w].astype(np.float32) + tint, 0, 255).astype(np.uint8))
    return root


def photo_table(root: str | os.PathLike[str]) -> Any:
    """The images under ``root`` (an ImageFolder layout) as a Hugging Face ``datasets.Dataset``.

    Columns ``image`` (an ``Image`` feature, decoded on access) and ``label`` (the class index, in
    ImageFolder's order). Needs the ``datasets`` package.
    """
    try:
        import datasets
    except ImportError as err:  # pragma: no cover - the dev extras install it
        raise ImportError("photo_table needs Hugging Face datasets: pip install datasets") from err
    folder = torchvision.datasets.ImageFolder(str(Path(root).expanduser()))
    paths = [path for path, _ in folder.samples]
    labels = [label for _, label in folder.samples]
    features = datasets.Features({"image": datasets.Image(), "label": datasets.Value("int64")})
    return datasets.Dataset.from_dict({"image": paths, "label": labels}, features=features)


def imagefolder_transform(size: int = 32) -> transforms.Compose:
    """The usual photo training augmentation at ``size``: random resized crop, flip, normalise."""
    return transforms.Compose(
        [
            transforms.RandomResizedCrop(size),
            transforms.RandomHorizontalFlip(),
            transforms.ToTensor(),
            transforms.Normalize(IMAGENET_MEAN, IMAGENET_STD),
        ]
    )


def imagefolder_workload(
    root: str | os.PathLike[str], *, size: int = 32, device: str = "cpu", seed: int = 0
) -> Workload:
    """``ImageFolder`` over ``root`` with :func:`imagefolder_transform`, training :class:`SmallCNN`.

    The name says the format of the files found (``imagefolder-jpeg``, ``imagefolder-png``).
    """
    path = Path(root).expanduser()
    if not path.is_dir():
        raise FileNotFoundError(
            f"image folder {str(path)!r} does not exist; point at a folder of class sub-folders, or"
            " make a synthetic one with autotune.workloads.write_image_folder(root)."
        )
    _check_count("size", size, 8, "pass the crop side length in pixels, e.g. size=32.")
    dataset = torchvision.datasets.ImageFolder(str(path), transform=imagefolder_transform(size))
    suffix = Path(dataset.samples[0][0]).suffix.lower().lstrip(".")
    kind = {"jpg": "jpeg", "jpeg": "jpeg"}.get(suffix, suffix)
    model = _seeded_model(lambda: SmallCNN(num_classes=len(dataset.classes)), seed)
    return Workload(
        name=f"imagefolder-{kind}",
        dataset=dataset,
        step=make_train_step(model, device=device),
        batch_size=64,
        description=(
            f"{len(dataset)} {kind.upper()} files in {len(dataset.classes)} classes under {path},"
            f" decoded and RandomResizedCrop({size}) + flip + normalise per sample, a small CNN"
            f" trained on {device}"
        ),
    )


# --------------------------------------------------------------------------------------------------
# CIFAR-10 in torchvision's on-disk format

_CIFAR_TRAIN_FILES = tuple(name for name, _ in torchvision.datasets.CIFAR10.train_list)
_CIFAR_TEST_FILES = tuple(name for name, _ in torchvision.datasets.CIFAR10.test_list)
_CIFAR_META_FILE = str(torchvision.datasets.CIFAR10.meta["filename"])


def _cifar_batch(images: np.ndarray, labels: np.ndarray, batch_label: str) -> dict[str, Any]:
    # Like the real files: one row per image, the R, G and B 32x32 planes one after the other.
    return {
        "batch_label": batch_label,
        "labels": [int(v) for v in labels],
        "data": np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), 3072)),
        "filenames": [f"synthetic_{batch_label.replace(' ', '_')}_{i}.png" for i in range(len(images))],
    }


def write_cifar10_files(
    root: str | os.PathLike[str], *, n_train: int = 1000, n_test: int = 200, seed: int = 0
) -> Path:
    """Write synthetic CIFAR-10 in torchvision's format under ``root/cifar-10-batches-py``.

    The five ``data_batch_*`` files share ``n_train`` images, ``test_batch`` holds ``n_test``, and
    ``batches.meta`` the label names. The pickles use the string keys torchvision's reader looks up
    (``data``, ``labels``, ``label_names``), as the real files do once loaded with
    ``encoding="latin1"``. Read them with :class:`CIFAR10Files`: their checksums are not the real
    ones. The ``cifar-10-batches-py`` folder must be new or empty. Returns ``root``.
    """
    _check_count("n_train", n_train, 1, "pass the number of training images, e.g. n_train=1000.")
    _check_count("n_test", n_test, 0, "pass the number of test images, e.g. n_test=200.")
    root = Path(root).expanduser()
    folder = root / CIFAR10Files.base_folder
    _refuse_non_empty(folder, "CIFAR-10 folder")
    images, labels = synthetic_images(n_train + n_test, size=32, classes=10, seed=seed)
    folder.mkdir(parents=True, exist_ok=True)
    batches: dict[str, dict[str, Any]] = {}
    parts = np.array_split(np.arange(n_train), len(_CIFAR_TRAIN_FILES))
    for k, (name, idx) in enumerate(zip(_CIFAR_TRAIN_FILES, parts, strict=True)):
        batches[name] = _cifar_batch(images[idx], labels[idx], f"training batch {k + 1} of 5")
    test = slice(n_train, n_train + n_test)
    batches[_CIFAR_TEST_FILES[0]] = _cifar_batch(images[test], labels[test], "testing batch 1 of 1")
    batches[_CIFAR_META_FILE] = {
        "label_names": list(CIFAR10_CLASSES),
        "num_cases_per_batch": len(parts[0]),
        "num_vis": 3072,
    }
    for name, content in batches.items():
        with open(folder / name, "wb") as f:
            pickle.dump(content, f, protocol=2)
    return root


class CIFAR10Files(torchvision.datasets.CIFAR10):
    """``torchvision.datasets.CIFAR10`` that checks only that its files exist, and never downloads.

    torchvision verifies the md5 sums of the real CIFAR-10 files, which files written by
    :func:`write_cifar10_files` cannot match; everything else (reading, decoding, transforms) is
    torchvision's own code. Real CIFAR-10 files are read just as well.
    """

    def __init__(
        self,
        root: str | os.PathLike[str],
        train: bool = True,
        transform: Callable[..., Any] | None = None,
        target_transform: Callable[..., Any] | None = None,
        download: bool = False,
    ) -> None:
        path = Path(root).expanduser()
        self._require_files(path)
        super().__init__(
            path,
            train=train,
            transform=transform,
            target_transform=target_transform,
            download=download,
        )

    @classmethod
    def _expected_files(cls) -> list[str]:
        names = [name for name, _ in cls.train_list + cls.test_list]
        return [*names, str(cls.meta["filename"])]

    @classmethod
    def _require_files(cls, root: Path) -> None:
        folder = root / cls.base_folder
        if not folder.is_dir():
            raise FileNotFoundError(
                f"CIFAR-10 folder {str(folder)!r} does not exist; write synthetic files with"
                f" autotune.workloads.write_cifar10_files({str(root)!r}), or get the real data with"
                f" torchvision.datasets.CIFAR10({str(root)!r}, download=True)."
            )
        missing = [name for name in cls._expected_files() if not (folder / name).is_file()]
        if missing:
            raise FileNotFoundError(
                f"CIFAR-10 folder {str(folder)!r} lacks {missing}; write a complete synthetic set"
                f" into an empty folder with autotune.workloads.write_cifar10_files(root), or get"
                f" the real data with torchvision.datasets.CIFAR10(root, download=True)."
            )

    def _check_integrity(self) -> bool:
        folder = Path(self.root) / self.base_folder
        return all((folder / name).is_file() for name in self._expected_files())

    def _load_meta(self) -> None:
        with open(Path(self.root) / self.base_folder / str(self.meta["filename"]), "rb") as f:
            data = pickle.load(f, encoding="latin1")
        self.classes = data[self.meta["key"]]
        self.class_to_idx = {name: i for i, name in enumerate(self.classes)}

    def download(self) -> None:
        """Never downloads: raises FileNotFoundError, saying how to get the data, if files lack."""
        self._require_files(Path(self.root))
