"""Decoded images cached once, of their own sizes: image folders, in-memory images, Hugging Face tables.

Every test compares against the user's own pipeline under the same seeds, value for value, through
real DataLoaders with real worker processes where it matters.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from PIL import Image
from test_pretransform import _worker_uss  # the same USS measurement as the fixed-shape cache's
from torch.utils.data import DataLoader, Dataset, get_worker_info
from torchvision.datasets import ImageFolder

from autotune import pretransform as pt
from autotune.exceptions import CandidateInfeasible, StaleCacheWarning
from autotune.pretransform.stores import RaggedColumn
from autotune.workloads import photo_table, write_photo_folder

CPU = torch.device("cpu")
MEAN, STD = (0.485, 0.456, 0.406), (0.229, 0.224, 0.225)


@pytest.fixture(autouse=True)
def _fresh_builds() -> Iterator[None]:
    pt.clear_builds()
    yield
    pt.clear_builds()


def write_mixed_folder(root: Path, n: int = 24) -> Path:
    """PNG (lossless) files of varying sizes in RGB, grayscale (L) and RGBA, in two classes."""
    rng = np.random.default_rng(0)
    for k in range(2):
        (root / f"c{k}").mkdir(parents=True)
    for i in range(n):
        h, w = (int(v) for v in rng.integers(36, 80, 2))
        pixels = rng.integers(0, 256, (h, w, 4), dtype=np.uint8)
        mode = ("RGB", "L", "RGBA")[i % 3]
        Image.fromarray(pixels, "RGBA").convert(mode).save(root / f"c{i % 2}" / f"{i:03d}.png")
    return root


def seeded(dataset: Any, indices: range) -> list[Any]:
    out = []
    for i in indices:
        torch.manual_seed(i)
        out.append(dataset[i])
    return out


def same(a: Any, b: Any) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and type(a) is type(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, Image.Image):
        return isinstance(b, Image.Image) and (a.mode, a.size, a.tobytes()) == (b.mode, b.size, b.tobytes())
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def loader_batches(dataset: Any, collate: Any = None, workers: int = 2, n: int = 3) -> list[Any]:
    torch.manual_seed(11)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=workers, collate_fn=collate)
    return [batch for _, batch in zip(range(n), loader, strict=False)]


PIPELINES = {
    # Random from the first step: only the decoded image is cached, the whole pipeline runs on it.
    "v1-random-resized-crop": lambda: T.Compose(
        [T.RandomResizedCrop(32), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    ),
    # A fixed resize first (still of varying size), cached with ToTensor moved ahead of the crop.
    "v1-resize-then-crop": lambda: T.Compose([T.Resize(40), T.RandomCrop(32), T.ToTensor()]),
    # v2 on tensors: ToImage cached (uint8 tv_tensors.Image of its own size), the rest per sample.
    "v2-to-image-first": lambda: v2.Compose(
        [v2.ToImage(), v2.RandomResizedCrop(32, antialias=True), v2.ToDtype(torch.float32, scale=True)]
    ),
    # Entirely fixed: decoded, resized and cropped once, batches gathered by index.
    "v1-fixed": lambda: T.Compose([T.Resize(36), T.CenterCrop(32), T.ToTensor()]),
}


@pytest.mark.parametrize("make", PIPELINES.values(), ids=PIPELINES.keys())
def test_an_image_folder_is_cached_and_gives_exactly_its_own_samples(tmp_path: Path, make: Any) -> None:
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=make())
    assert pt.strategies(ds, cuda=False)["ram"] is None
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert all(map(same, seeded(prepared.dataset, range(len(ds))), seeded(ds, range(len(ds)))))
    # Through DataLoaders with two forked workers each, seeded alike: the same batches.
    got = loader_batches(prepared.dataset, prepared.collate_fn)
    assert all(map(same, got, loader_batches(ds)))


def test_grayscale_and_rgba_files_are_cached_as_the_loader_returns_them(tmp_path: Path) -> None:
    seen: list[Any] = []

    def record(img: Any) -> Any:  # a step of the user's random rest: what does it receive?
        seen.append(img)
        return img

    ds = ImageFolder(
        str(write_mixed_folder(tmp_path / "images")),
        transform=T.Compose([T.RandomResizedCrop(24), T.Lambda(record), T.PILToTensor()]),
    )
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: decoded samples; per sample: RandomResizedCrop, Lambda")
    column = prepared.dataset.fields[0]
    assert isinstance(column, RaggedColumn) and column.flat.is_shared()
    # ImageFolder's default loader converts every file to RGB; the cache holds exactly that.
    for i, (path, _) in enumerate(ds.samples):
        with Image.open(path) as original:
            expected = original.convert("RGB")
        cached = column.get(i)
        assert cached.mode == "RGB" and cached.tobytes() == expected.tobytes()
    seen.clear()
    prepared.dataset[1]  # a grayscale file
    assert isinstance(seen[0], Image.Image) and seen[0].mode == "RGB"


def test_ragged_cache_size_is_the_decoded_pixels(tmp_path: Path) -> None:
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(8))
    prepared = pt.prepare(ds, "ram", device=CPU)
    pixels = 0
    for path, _ in ds.samples:
        with Image.open(path) as img:
            pixels += img.width * img.height * 3
    # Pixels, offsets (n + 1 int64), shapes (n x 4 int64), targets (n int64).
    n = len(ds)
    assert prepared.nbytes == pixels + 8 * (n + 1) + 32 * n + 8 * n
    assert "held" in prepared.detail and "estimated" in prepared.detail


class EncodedPhotos(Dataset[tuple[Any, int]]):
    """JPEG bytes in memory, decoded per read (as a dataset over a zip or a database would)."""

    def __init__(self, n: int, transform: Any = None, size: tuple[int, int] = (180, 260)) -> None:
        rng = np.random.default_rng(1)
        self.blobs = []
        for _ in range(n):
            h, w = (int(v) for v in rng.integers(size[0], size[1], 2))
            buffer = io.BytesIO()
            Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(buffer, "JPEG")
            self.blobs.append(buffer.getvalue())
        self.transform = transform

    def __len__(self) -> int:
        return len(self.blobs)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img: Any = Image.open(io.BytesIO(self.blobs[index])).convert("RGB")
        if self.transform is not None:
            img = self.transform(img)
        return img, index % 7


class VaryingTensors(Dataset[Any]):
    """uint8 CHW tensors of their own sizes, already in memory, with a v2 pipeline."""

    def __init__(self, n: int, transform: Any) -> None:
        gen = torch.Generator().manual_seed(0)
        self.images = [
            torch.randint(0, 256, (3, 20 + i % 9, 30 - i % 7), dtype=torch.uint8, generator=gen)
            for i in range(n)
        ]
        self.transform = transform

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Any:
        img = self.images[index]
        return self.transform(img) if self.transform is not None else img


def test_decoded_in_memory_images_are_cached_when_decoding_is_the_cost(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Whether decoding is the cost is timed (the least of three timings); a loaded machine can tip
    # any threshold, so the thresholds are set where these JPEGs always pass them: the subject here
    # is the decoded cache itself, exactly the dataset's samples.
    from autotune.pretransform import sources

    monkeypatch.setattr(sources, "MIN_DECODE_S", 0.0)
    monkeypatch.setattr(sources, "MIN_DECODE_SHARE", 0.0)
    ds = EncodedPhotos(40, transform=T.Compose([T.RandomResizedCrop(32), T.ToTensor()]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: decoded samples")
    assert all(map(same, seeded(prepared.dataset, range(40)), seeded(ds, range(40))))


def test_uint8_tensors_of_varying_shapes_are_stored_ragged() -> None:
    transform = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip()])
    ds = VaryingTensors(30, transform)
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: ToDtype; per sample: RandomHorizontalFlip (")
    assert isinstance(prepared.dataset.fields[0], RaggedColumn)
    assert all(map(same, seeded(prepared.dataset, range(30)), seeded(ds, range(30))))


def test_workers_read_the_ragged_cache_without_copying_it(no_leaked_children: None) -> None:
    ds = EncodedPhotos(400, transform=T.Compose([T.RandomResizedCrop(16), T.ToTensor()]), size=(200, 300))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.nbytes > 50 * 2**20  # ~60 MiB of decoded pixels
    shared = _worker_uss(prepared, worker_init_fn=None)
    # The control: workers that copy the ragged column show it in their own memory.
    copied = _worker_uss(prepared, worker_init_fn=_copy_columns)
    assert all(uss < 0.25 * prepared.nbytes for uss in shared), (shared, prepared.nbytes)
    assert all(uss > 0.9 * prepared.nbytes for uss in copied), (copied, prepared.nbytes)


def _copy_columns(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    fields = info.dataset.fields
    info.dataset.fields = tuple(f.clone() for f in fields)  # RaggedColumn.clone: private copies


def test_decoded_images_over_the_budget_are_refused_with_the_figures(tmp_path: Path) -> None:
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(16))
    reason = pt.strategies(ds, cuda=False, memory_budget_bytes=100_000)["ram"]
    # The estimate is the probes' mean size times the length, with their range and spread.
    assert reason is not None
    assert reason.startswith("a cache would need ~")
    assert "(estimated from 8 samples of " in reason and ", mean " in reason and ", spread " in reason
    assert reason.endswith("over the memory budget of 97.7 KiB")
    assert pt.strategies(ds, cuda=False, memory_budget_bytes=2**30)["ram"] is None
    # A build that outgrows its budget stops there, with the real figures.
    with pytest.raises(CandidateInfeasible, match=r"outgrew the memory budget of 48\.8 KiB after \d+ of 24"):
        pt.prepare(ds, "ram", device=CPU, memory_budget_bytes=50_000)


def test_a_build_stops_at_the_budget_its_caller_passes_and_no_other(tmp_path: Path) -> None:
    from autotune.measure import MeasureLimits, measure
    from autotune.space import Candidate

    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(16))
    assert pt.strategies(ds, cuda=False, memory_budget_bytes=100_000)["ram"] is not None
    # The budget strategies() checked is not remembered: a build has the ceiling it is given, here none.
    assert pt.prepare(ds, "ram", device=CPU).nbytes > 100_000
    pt.clear_builds()
    # The search hands its measurements the cache budget with their other limits.
    limits = MeasureLimits(window_s=0.05, min_batches=2, max_batches=4, cache_budget_bytes=50_000)
    with pytest.raises(CandidateInfeasible, match=r"outgrew the memory budget of 48\.8 KiB"):
        measure(ds, Candidate(batch_size=8, pretransform="ram"), limits=limits)


def test_a_user_collate_fn_gets_pil_images_when_the_pipeline_gives_them(tmp_path: Path) -> None:
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(16))
    prepared = pt.prepare(ds, "ram", device=CPU)

    def sizes(samples: list[Any]) -> list[tuple[str, tuple[int, int], int]]:
        return [(type(img).__name__, img.size, label) for img, label in samples]

    dataset, collate = prepared.loader_parts(sizes)
    got = loader_batches(dataset, collate, workers=0)
    assert got == loader_batches(ds, sizes, workers=0)
    assert got[0][0] == ("Image", (16, 16), got[0][0][2])


def test_build_reports_progress(tmp_path: Path) -> None:
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(8))
    calls: list[tuple[int, int]] = []
    pt.prepare(ds, "ram", device=CPU, progress=lambda done, total: calls.append((done, total)))
    assert calls[-1] == (24, 24)


def test_the_device_strategy_refuses_images_of_their_own_sizes(tmp_path: Path) -> None:
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(8))
    reason = pt.strategies(ds, cuda=True)["device"]
    assert reason is not None and "cached in RAM only" in reason
    with pytest.raises(CandidateInfeasible, match="cached in RAM only"):
        pt.prepare(ds, "device", device=CPU)


# ------------------------------------------------------------------------------ Hugging Face tables


def hf_table(tmp_path: Path, n: int = 40) -> Any:
    pytest.importorskip("datasets", reason="the Hugging Face path needs the datasets package")
    return photo_table(write_photo_folder(tmp_path / "photos", n=n, classes=4, min_size=40, max_size=90))


def hf_transform(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    crop = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToTensor()])
    return {"pixel_values": [crop(img) for img in batch["image"]], "label": batch["label"]}


@pytest.mark.parametrize("how", ["set_transform", "with_transform"])
def test_a_hugging_face_table_caches_its_decoded_images(tmp_path: Path, how: str) -> None:
    table = hf_table(tmp_path)
    if how == "set_transform":
        table.set_transform(hf_transform)
    else:
        table = table.with_transform(hf_transform)
    assert pt.strategies(table, cuda=False)["ram"] is None
    prepared = pt.prepare(table, "ram", device=CPU)
    assert prepared.detail.startswith("cached: decoded images (image); per sample: the table's transform")
    assert prepared.collate_fn is None  # the default collate stacks the transform's output
    assert all(map(same, seeded(prepared.dataset, range(40)), seeded(table, range(40))))
    got = loader_batches(prepared.dataset)
    assert all(map(same, got, loader_batches(table)))


def test_the_users_table_transform_still_runs_per_access(tmp_path: Path) -> None:
    table = hf_table(tmp_path, n=16)
    calls: list[int] = []

    def counting(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
        calls.append(len(batch["image"]))
        return hf_transform(batch)

    table.set_transform(counting)
    prepared = pt.prepare(table, "ram", device=CPU)
    calls.clear()
    list(DataLoader(prepared.dataset, batch_size=8))
    assert calls == [8, 8]  # one call per batch, as the table's own __getitems__ makes


def test_a_table_without_image_columns_is_refused(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets", reason="the Hugging Face path needs the datasets package")
    table = datasets.Dataset.from_dict({"x": [1, 2, 3]})
    table.set_transform(lambda b: b)
    reason = pt.strategies(table, cuda=False)["ram"]
    assert reason == "the table has no Image column to decode: nothing worth caching"


# ------------------------------------------------------------------------- a cache never outlives it


class Squares(Dataset[tuple[Any, int]]):
    """40x40 RGB images made from the index, returned as PIL through ``transform``."""

    def __init__(self, n: int, transform: Any) -> None:
        rng = np.random.default_rng(2)
        self.data = rng.integers(0, 256, (n, 40, 40, 3), dtype=np.uint8)
        self.transform = transform

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        img: Any = Image.fromarray(self.data[index])
        return (self.transform(img) if self.transform is not None else img), index % 3


class Brighten:
    """A deterministic step whose state the training loop changes (an epoch counter)."""

    def __init__(self) -> None:
        self.epoch = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.epoch


def test_progressive_resizing_rebuilds_the_cache_with_the_new_size() -> None:
    ds = Squares(32, T.Compose([T.Resize(16), T.ToTensor()]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.dataset[0][0].shape == (3, 16, 16) and prepared.stale_reason() is None
    assert prepared.check_fresh()
    ds.transform.transforms[0].size = 24  # what a progressive-resizing recipe does between epochs
    assert ds[0][0].shape == (3, 24, 24)
    reason = prepared.stale_reason()
    assert reason == "step 0 (Resize) changed (size: 16 -> 24)"
    with pytest.warns(StaleCacheWarning, match=r"step 0 \(Resize\) changed \(size: 16 -> 24\)"):
        assert not prepared.check_fresh()
    assert not prepared.check_fresh()  # warned once; still stale
    # A fresh loader (prepare runs whenever one is made) serves the new size, value for value.
    with pytest.warns(StaleCacheWarning, match="Resize"):
        rebuilt = pt.prepare(ds, "ram", device=CPU)
    assert rebuilt is not prepared and rebuilt.stale_reason() is None
    for got, expected in zip(DataLoader(rebuilt.dataset, batch_size=8, collate_fn=rebuilt.collate_fn),
                             DataLoader(ds, batch_size=8), strict=True):
        assert got[0].shape == (8, 3, 24, 24) and torch.equal(got[0], expected[0])


def test_a_stateful_step_in_the_cache_is_seen_when_it_changes() -> None:
    step = Brighten()
    ds = Squares(16, T.Compose([T.ToTensor(), step]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: ToTensor, Brighten")
    step.epoch = 1
    assert prepared.stale_reason() == "step 1 (Brighten) changed (epoch: 0 -> 1)"
    with pytest.warns(StaleCacheWarning, match=r"step 1 \(Brighten\) changed \(epoch: 0 -> 1\)"):
        rebuilt = pt.prepare(ds, "ram", device=CPU)
    assert torch.equal(rebuilt.dataset[3][0], ds[3][0])


def test_a_step_that_runs_per_sample_is_not_frozen() -> None:
    # The random rest is the user's own objects: changing it needs no rebuild, and causes none.
    ds = Squares(16, T.Compose([T.ToTensor(), T.RandomHorizontalFlip()]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    ds.transform.transforms[1].p = 1.0
    assert prepared.stale_reason() is None
    assert torch.equal(prepared.dataset[2][0], ds[2][0])


def test_files_changing_under_the_cache_make_it_stale(tmp_path: Path) -> None:
    root = write_mixed_folder(tmp_path / "images")
    ds = ImageFolder(str(root), transform=T.RandomResizedCrop(8))
    prepared = pt.prepare(ds, "ram", device=CPU)
    path = Path(ds.samples[5][0])
    Image.new("RGB", (50, 50), (1, 2, 3)).save(path)  # the file is replaced by another image
    assert prepared.stale_reason() == f"the files changed ({path})"
    ds.samples.append(ds.samples[0])  # the samples list grows
    assert prepared.stale_reason() == "the dataset changed (length: 24 -> 25)"


def _joined_folders(tmp_path: Path, transforms: list[Any]) -> Any:
    """Two folders joined as A, B, A (a dataset repeated, as scripts lengthen short epochs)."""
    from torch.utils.data import ConcatDataset

    a = ImageFolder(str(write_mixed_folder(tmp_path / "a", n=12)), transform=transforms[0])
    b = ImageFolder(str(write_mixed_folder(tmp_path / "b", n=10)), transform=transforms[-1])
    return ConcatDataset([a, b, a])


def test_folders_joined_with_one_transform_are_cached_exactly(tmp_path: Path) -> None:
    shared = T.Compose([T.Resize(32), T.CenterCrop(32), T.ToTensor(), T.Normalize(MEAN, STD),
                        T.RandomHorizontalFlip()])
    ds = _joined_folders(tmp_path, [shared])
    assert pt.strategies(ds, cuda=False)["ram"] is None
    assert pt.reads_alike_anywhere(ds)  # torch's ConcatDataset over torchvision's folders
    prepared = pt.prepare(ds, "ram", device=CPU)
    # The shared pipeline is split as one folder's is: the fixed steps cached, the flip per sample.
    assert prepared.detail.endswith("per sample: RandomHorizontalFlip")
    assert all(map(same, seeded(prepared.dataset, range(len(ds))), seeded(ds, range(len(ds)))))
    got = loader_batches(prepared.dataset, prepared.collate_fn, n=4)
    assert all(map(same, got, loader_batches(ds, n=4)))


def test_joined_folders_changing_under_the_cache_make_it_stale(tmp_path: Path) -> None:
    shared = T.Compose([T.Resize(20), T.CenterCrop(20), T.ToTensor()])
    ds = _joined_folders(tmp_path, [shared])
    prepared = pt.prepare(ds, "ram", device=CPU)
    path = Path(ds.datasets[1].samples[3][0])  # a file of the second folder only
    Image.new("RGB", (50, 50), (1, 2, 3)).save(path)
    assert prepared.stale_reason() == f"the files changed ({path})"
    ds = _joined_folders(tmp_path / "again", [shared])
    prepared = pt.prepare(ds, "ram", device=CPU)
    shared.transforms[0].size = 24  # the shared Resize, frozen in the cache
    assert "step 0 (Resize) changed (size: 20 -> 24)" in (prepared.stale_reason() or "")
    shared.transforms[0].size = 20
    assert prepared.stale_reason() is None
    ds.datasets[0].transform = T.Compose([T.Resize(20), T.CenterCrop(20), T.ToTensor()])  # one part's
    assert "the transform changed" in (prepared.stale_reason() or "")


def test_joined_folders_with_their_own_transforms_cache_only_what_is_fixed(tmp_path: Path) -> None:
    fixed = [T.Compose([T.Resize(20), T.CenterCrop(20), T.ToTensor()]),
             T.Compose([T.Resize(16), T.CenterCrop(16), T.Resize(20), T.ToTensor()])]
    ds = _joined_folders(tmp_path, fixed)
    prepared = pt.prepare(ds, "ram", device=CPU)  # deterministic samples: cached whole
    assert prepared.detail == "cached: whole samples"
    assert all(map(same, (prepared.dataset[i] for i in range(len(ds))), (ds[i] for i in range(len(ds)))))
    fixed[1].transforms[0].size = 12  # the second folder's own Resize
    assert "(Resize) changed (size: 16 -> 12)" in (prepared.stale_reason() or "")
    random = _joined_folders(tmp_path / "random", [T.RandomResizedCrop(8), T.RandomResizedCrop(8)])
    reason = pt.strategies(random, cuda=False)["ram"]
    assert reason is not None and "could not be split" in reason


class MostlySquare(Dataset[Any]):
    """Float images whose probed samples (every 4th or so) are 20x20 and the others 21x19."""

    def __init__(self, n: int = 30) -> None:
        probes = set(pt.split.probe_indices(n))
        gen = torch.Generator().manual_seed(0)
        self.images = [
            torch.rand((3, 20, 20) if i in probes else (3, 21, 19), generator=gen) for i in range(n)
        ]
        self.transform = T.Normalize(MEAN, STD)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, index: int) -> Any:
        return self.transform(self.images[index]) if self.transform is not None else self.images[index]


def test_shapes_the_probes_did_not_see_are_stored_ragged() -> None:
    ds = MostlySquare()
    assert pt.strategies(ds, cuda=False)["ram"] is None  # the probes all look alike
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert isinstance(prepared.dataset.fields[0], RaggedColumn)
    assert all(map(same, (prepared.dataset[i] for i in range(30)), (ds[i] for i in range(30))))


@pytest.mark.parametrize("kind", ["folder", "table"])
def test_a_build_reads_in_worker_processes_and_stores_the_same(
    tmp_path: Path, kind: str, monkeypatch: pytest.MonkeyPatch, no_leaked_children: None
) -> None:
    if kind == "folder":
        ds: Any = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.RandomResizedCrop(8))
    else:
        ds = hf_table(tmp_path, n=24)
        ds.set_transform(hf_transform)
    serial = pt.prepare(ds, "ram", device=CPU)
    pt.clear_builds()
    monkeypatch.setattr(pt.build, "PARALLEL_BUILD_SAMPLES", 8)  # 24 samples: read by two workers
    monkeypatch.setattr(pt.build, "BUILD_CHUNK", 5)
    parallel = pt.prepare(ds, "ram", device=CPU)
    assert parallel is not serial and parallel.nbytes == serial.nbytes
    for a, b in zip(serial.dataset.fields, parallel.dataset.fields, strict=True):
        parts = zip(a.tensors(), b.tensors(), strict=True) if isinstance(a, RaggedColumn) else [(a, b)]
        assert all(torch.equal(x, y) for x, y in parts)


class CountingOffset:
    """A deterministic step that counts its own calls (as a logging or profiling step might)."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.calls += 1
        return x + 1.0


def test_a_step_counting_the_builds_own_calls_does_not_make_the_cache_stale() -> None:
    ds = Squares(16, T.Compose([T.ToTensor(), CountingOffset()]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: ToTensor, CountingOffset")
    assert prepared.stale_reason() is None and pt.prepare(ds, "ram", device=CPU) is prepared
    ds[0]  # the user's own pipeline runs the step once more: its state changed after the build
    reason = prepared.stale_reason()
    found = re.fullmatch(r"step 1 \(CountingOffset\) changed \(calls: (\d+) -> (\d+)\)", reason or "")
    assert found is not None and int(found[2]) == int(found[1]) + 1, reason


def test_measure_runs_a_decoded_cache_candidate(tmp_path: Path) -> None:
    from autotune.measure import MeasureLimits, measure
    from autotune.space import Candidate

    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images")), transform=T.Compose(
        [T.RandomResizedCrop(16), T.ToTensor()]))
    limits = MeasureLimits(window_s=0.05, min_batches=2, max_batches=4)
    m = measure(ds, Candidate(batch_size=8, num_workers=1, pretransform="ram"), limits=limits)
    assert m.samples > 0 and m.cache_bytes > 0 and m.build_s > 0
