"""The synthetic workloads: shapes, determinism, picklability, files on disk, and clear errors."""

from __future__ import annotations

import pickle
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image
from torch.utils.data import DataLoader, Dataset

from autotune import workloads as wl
from autotune.workloads import (
    CIFAR10_CLASSES,
    WORKLOADS,
    CIFAR10Files,
    CIFAR10Like,
    LatencyDataset,
    SmallCNN,
    TrainStep,
    Workload,
    cifar10_workload,
    get_workload,
    imagefolder_workload,
    latency_workload,
    make_train_step,
    synthetic_images,
    tensor_workload,
    write_cifar10_files,
    write_image_folder,
)


def _first_batch(dataset: Dataset[Any], batch_size: int, num_workers: int = 0) -> Any:
    loader = DataLoader(dataset, batch_size=batch_size, num_workers=num_workers)
    it = iter(loader)
    try:
        return next(it)
    finally:
        del it  # shuts the workers down now, not at garbage collection


def _params(model: torch.nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


# ---------------------------------------------------------------------------------------------------
# CIFAR-10-like


def test_cifar10_like_has_cifar10s_layout() -> None:
    ds = CIFAR10Like(100, seed=3)
    assert len(ds) == 100
    assert ds.data.shape == (100, 32, 32, 3) and ds.data.dtype == np.uint8
    assert isinstance(ds.targets, list) and all(type(t) is int for t in ds.targets)
    assert set(ds.targets) <= set(range(10))
    assert ds.classes == list(CIFAR10_CLASSES)
    img, target = ds[7]
    # Without a transform a sample is the PIL image of the stored array, as in torchvision's CIFAR10.
    assert isinstance(img, Image.Image) and img.size == (32, 32) and img.mode == "RGB"
    np.testing.assert_array_equal(np.asarray(img), ds.data[7])
    assert target == ds.targets[7]


def test_cifar10_like_applies_both_transforms() -> None:
    ds = CIFAR10Like(20, transform=wl.cifar_train_transform(), target_transform=lambda t: t + 100)
    img, target = ds[0]
    assert img.shape == (3, 32, 32) and img.dtype == torch.float32
    assert target == ds.targets[0] + 100


def test_cifar10_like_is_deterministic_by_seed() -> None:
    a, b, c = CIFAR10Like(64, seed=1), CIFAR10Like(64, seed=1), CIFAR10Like(64, seed=2)
    np.testing.assert_array_equal(a.data, b.data)
    assert a.targets == b.targets
    assert not np.array_equal(a.data, c.data)


def test_synthetic_images_use_the_whole_range_and_balance_on_request() -> None:
    images, labels = synthetic_images(200, size=16, classes=7, seed=0, balanced=True)
    assert images.shape == (200, 16, 16, 3) and labels.dtype == np.int64
    assert np.bincount(labels, minlength=7).tolist() == [29, 29, 29, 29, 28, 28, 28]
    # Not a constant or saturated picture: normalisation statistics stay meaningful.
    assert 60 < images.mean() < 190 and images.std() > 20


def test_cifar10_workload_batch_and_step() -> None:
    w = cifar10_workload(128, seed=0)
    assert (w.name, w.batch_size) == ("cifar10-like", 64)
    x, y = _first_batch(w.dataset, w.batch_size)
    assert x.shape == (64, 3, 32, 32) and x.dtype == torch.float32
    assert y.shape == (64,) and y.dtype == torch.int64
    assert isinstance(w.step, TrainStep)
    before = _params(w.step.model)
    assert w.step((x, y)) is None  # no loss.item(): that would wait for the device every step
    after = _params(w.step.model)
    assert any(not torch.equal(p, q) for p, q in zip(before, after, strict=True))
    assert w.step.last_loss is not None and torch.isfinite(w.step.last_loss)


def test_workload_model_weights_follow_the_seed_and_keep_the_global_rng() -> None:
    state = torch.get_rng_state()
    a, b, c = (cifar10_workload(16, seed=s).step for s in (0, 0, 1))
    # Building a workload must not move the user's random stream (shuffling, dropout, ...).
    assert torch.equal(torch.get_rng_state(), state)
    assert isinstance(a, TrainStep) and isinstance(b, TrainStep) and isinstance(c, TrainStep)
    pa, pb, pc = _params(a.model), _params(b.model), _params(c.model)
    assert all(torch.equal(p, q) for p, q in zip(pa, pb, strict=True))
    assert not all(torch.equal(p, q) for p, q in zip(pa, pc, strict=True))


def test_small_cnn_is_small_and_takes_any_image_size() -> None:
    model = SmallCNN(num_classes=5)
    # Small enough that a step costs a few ms on one core (see the class docstring).
    assert 2_000 <= sum(p.numel() for p in model.parameters()) <= 10_000
    for size in (17, 32, 64):
        assert model(torch.zeros(2, 3, size, size)).shape == (2, 5)


def test_the_class_is_visible_in_each_image() -> None:
    # NOTE [ Synthetic images ]: the blob's colour is the class's palette colour. Decoding it (the
    # pixel farthest from the background median, then the nearest palette colour) recovers the label,
    # so a model trained on these images has something real to learn. (SmallCNN reaches about 60 %
    # held-out accuracy after four epochs of 640 images; too slow for a unit test on a shared CPU.)
    images, labels = synthetic_images(500, seed=0)
    pixels = images.reshape(500, -1, 3).astype(np.float32)
    background = np.median(pixels, axis=1, keepdims=True)
    farthest = np.abs(pixels - background).sum(axis=2).argmax(axis=1)
    colour = pixels[np.arange(500), farthest]
    palette = wl._class_palette(10)
    decoded = np.abs(colour[:, None] - palette[None]).sum(axis=2).argmin(axis=1)
    assert (decoded == labels).mean() > 0.9


# ---------------------------------------------------------------------------------------------------
# Latency and tensor workloads


def test_latency_dataset_sleeps_then_returns_a_sample_made_from_the_index(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    slept: list[float] = []
    monkeypatch.setattr(wl.time, "sleep", slept.append)
    ds = LatencyDataset(50, delay_s=0.02)
    x, y = ds[13]
    assert slept == [0.02]
    assert x.shape == (3, 32, 32) and x.dtype == torch.float32 and y == 3
    assert torch.equal(x, ds[13][0]) and not torch.equal(x, ds[14][0])
    assert torch.equal(ds[-1][0], ds[49][0])
    with pytest.raises(IndexError, match="index 50 is out of range"):
        ds[50]


def test_latency_workload_has_no_step_and_batches_of_32() -> None:
    w = latency_workload(64, delay_s=0.0)
    assert (w.name, w.batch_size, w.step) == ("latency", 32, None)
    x, y = _first_batch(w.dataset, w.batch_size)
    assert x.shape == (32, 3, 32, 32) and y.tolist() == [i % 10 for i in range(32)]


def test_tensor_workload_batch_step_and_seed() -> None:
    w = tensor_workload(1000, features=16, seed=0)
    assert (w.name, w.batch_size) == ("tensor", 256)
    x, y = _first_batch(w.dataset, w.batch_size)
    assert x.shape == (256, 16) and x.dtype == torch.float32
    assert y.shape == (256,) and y.dtype == torch.int64
    assert isinstance(w.step, TrainStep)
    before = _params(w.step.model)
    w.step((x, y))
    assert any(not torch.equal(p, q) for p, q in zip(before, _params(w.step.model), strict=True))
    again = tensor_workload(1000, features=16, seed=0).dataset
    assert torch.equal(again.tensors[0], w.dataset.tensors[0])  # type: ignore[attr-defined]


def test_registry_builds_each_workload_by_name() -> None:
    assert sorted(WORKLOADS) == ["cifar10-like", "latency", "tensor"]
    small: dict[str, dict[str, Any]] = {
        "cifar10-like": {"n": 16},
        "latency": {"n": 16, "delay_s": 0.0},
        "tensor": {"n": 16},
    }
    for name, kwargs in small.items():
        w = get_workload(name, **kwargs)
        assert isinstance(w, Workload) and w.name == name and len(w.dataset) == 16  # type: ignore[arg-type]


def test_unknown_workload_names_the_known_ones() -> None:
    with pytest.raises(ValueError, match=r"unknown workload 'imagenet'.*'cifar10-like'.*'tensor'"):
        get_workload("imagenet")


@pytest.mark.parametrize(
    ("factory", "message"),
    [
        (lambda: CIFAR10Like(0), r"n=0 must be an integer >= 1"),
        (lambda: LatencyDataset(10, delay_s=-1), r"delay_s=-1 must be a finite number"),
        (lambda: tensor_workload(10, features=0), r"features=0 must be an integer >= 1"),
        (lambda: make_train_step(SmallCNN(), lr=0), r"lr=0 must be a positive finite number"),
    ],
)
def test_bad_arguments_are_named(factory: Callable[[], object], message: str) -> None:
    with pytest.raises(ValueError, match=message):
        factory()


# ---------------------------------------------------------------------------------------------------
# Image folders


def test_image_folder_is_read_by_imagefolder(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path / "imgs", n=30, classes=3, size=40)
    ds = torchvision.datasets.ImageFolder(str(root))
    assert ds.classes == ["class_0", "class_1", "class_2"] and len(ds) == 30
    assert [ds.targets.count(k) for k in range(3)] == [10, 10, 10]
    img, _ = ds[0]
    assert img.size == (40, 40)
    with Image.open(ds.samples[0][0]) as f:
        assert f.format == "JPEG"


def test_png_folder_holds_exactly_the_generated_pixels(tmp_path: Path) -> None:
    root = write_image_folder(tmp_path, n=24, classes=12, size=16, fmt="png", seed=5)
    ds = torchvision.datasets.ImageFolder(str(root))
    # Zero-padded class folders keep ImageFolder's alphabetical order equal to the class number.
    assert ds.classes[:3] == ["class_00", "class_01", "class_02"] and len(ds.classes) == 12
    images, labels = synthetic_images(24, size=16, classes=12, seed=5, balanced=True)
    for path, target in ds.samples:
        i = int(Path(path).stem.split("_")[1])
        assert path.endswith(".png") and target == labels[i]
        with Image.open(path) as f:
            np.testing.assert_array_equal(np.asarray(f.convert("RGB")), images[i])


def test_image_folder_errors(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match=r"fmt='GIF' is not a supported.*\['JPEG', 'PNG'\]"):
        write_image_folder(tmp_path / "a", fmt="GIF")
    with pytest.raises(ValueError, match=r"n=2 must be an integer >= 3.*3 classes"):
        write_image_folder(tmp_path / "b", n=2, classes=3)
    (tmp_path / "c").mkdir()
    (tmp_path / "c" / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match=r"not an empty folder; pass a new or empty folder"):
        write_image_folder(tmp_path / "c", n=4, classes=2)
    assert sorted(p.name for p in (tmp_path / "c").iterdir()) == ["keep.txt"]
    with pytest.raises(FileNotFoundError, match=r"does not exist.*write_image_folder"):
        imagefolder_workload(tmp_path / "missing")


@pytest.mark.parametrize(("fmt", "name"), [("JPEG", "imagefolder-jpeg"), ("PNG", "imagefolder-png")])
def test_imagefolder_workload_trains_at_the_requested_size(tmp_path: Path, fmt: str, name: str) -> None:
    root = write_image_folder(tmp_path, n=20, classes=4, size=64, fmt=fmt)
    w = imagefolder_workload(root, size=48)
    assert (w.name, w.batch_size) == (name, 64)
    x, y = _first_batch(w.dataset, 8)
    assert x.shape == (8, 3, 48, 48) and x.dtype == torch.float32 and y.dtype == torch.int64
    assert isinstance(w.step, TrainStep)
    before = _params(w.step.model)
    w.step((x, y))
    assert any(not torch.equal(p, q) for p, q in zip(before, _params(w.step.model), strict=True))
    assert w.step.model(x).shape == (8, 4)  # one output per class folder


# ---------------------------------------------------------------------------------------------------
# CIFAR-10 files


def test_cifar10_files_read_back_exactly_what_was_written(tmp_path: Path) -> None:
    root = write_cifar10_files(tmp_path, n_train=23, n_test=7, seed=4)
    images, labels = synthetic_images(30, size=32, classes=10, seed=4)
    train, test = CIFAR10Files(root), CIFAR10Files(root, train=False)
    np.testing.assert_array_equal(train.data, images[:23])
    np.testing.assert_array_equal(test.data, images[23:])
    assert train.targets == labels[:23].tolist() and test.targets == labels[23:].tolist()
    assert train.classes == list(CIFAR10_CLASSES)
    img, target = CIFAR10Files(root, transform=wl.cifar_train_transform())[5]
    assert img.shape == (3, 32, 32) and target == labels[5]


def test_cifar10_files_have_the_real_layout(tmp_path: Path) -> None:
    folder = write_cifar10_files(tmp_path, n_train=10, n_test=2) / "cifar-10-batches-py"
    assert sorted(p.name for p in folder.iterdir()) == sorted(
        [f"data_batch_{k}" for k in range(1, 6)] + ["test_batch", "batches.meta"]
    )
    with open(folder / "data_batch_1", "rb") as f:
        batch = pickle.load(f, encoding="latin1")
    assert batch["data"].shape == (2, 3072) and batch["data"].dtype == np.uint8
    # Row-major channel planes: the first 1024 bytes of a row are the red channel.
    np.testing.assert_array_equal(
        batch["data"][0, :1024], CIFAR10Files(folder.parent).data[0, ..., 0].ravel()
    )
    # torchvision's own class checks the md5 sums of the real files, so it refuses these.
    with pytest.raises(RuntimeError, match="not found or corrupted"):
        torchvision.datasets.CIFAR10(str(folder.parent))


def test_cifar10_files_never_download_and_name_what_is_missing(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError, match=r"cifar-10-batches-py' does not exist.*write_cifar10"):
        CIFAR10Files(tmp_path, download=True)
    write_cifar10_files(tmp_path, n_train=5, n_test=1)
    (tmp_path / "cifar-10-batches-py" / "test_batch").unlink()
    with pytest.raises(FileNotFoundError, match=r"lacks \['test_batch'\].*download=True"):
        CIFAR10Files(tmp_path)
    with pytest.raises(FileExistsError, match="CIFAR-10 folder .* already exists"):
        write_cifar10_files(tmp_path)


# ---------------------------------------------------------------------------------------------------
# Worker processes


def _datasets(tmp_path: Path) -> dict[str, Dataset[Any]]:
    return {
        "cifar10-like": cifar10_workload(8).dataset,
        "latency": latency_workload(8, delay_s=0.001).dataset,
        "tensor": tensor_workload(8).dataset,
        "imagefolder": imagefolder_workload(write_image_folder(tmp_path / "i", n=8, classes=2)).dataset,
        "cifar10-files": CIFAR10Files(
            write_cifar10_files(tmp_path / "c", n_train=8, n_test=1),
            transform=wl.cifar_train_transform(),
        ),
    }


@pytest.mark.usefixtures("no_leaked_children")
def test_every_dataset_pickles_and_loads_in_worker_processes(tmp_path: Path) -> None:
    # Workers started with spawn or forkserver receive the dataset pickled; these are module-level.
    for name, ds in _datasets(tmp_path).items():
        copy = pickle.loads(pickle.dumps(ds))
        assert len(copy) == len(ds), name  # type: ignore[arg-type]
        x, y = _first_batch(ds, 4, num_workers=2)
        assert x.shape[0] == 4 and y.shape == (4,), name
