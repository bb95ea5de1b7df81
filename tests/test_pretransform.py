"""The pre-transform strategies: a cache changes where the work runs, never what a sample is."""

from __future__ import annotations

import contextlib
import gc
import random
import time
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import psutil
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from PIL import Image
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info
from torchvision.datasets import VisionDataset

from autotune import pretransform as pt
from autotune.exceptions import CandidateInfeasible, ConfigurationError, StaleCacheWarning
from autotune.measure import MeasureLimits, measure
from autotune.space import Candidate

CPU = torch.device("cpu")
MEAN, STD = (0.4914, 0.4822, 0.4465), (0.2470, 0.2435, 0.2616)
N = 512


class FakeCifar(VisionDataset):
    """CIFAR10 as torchvision serves it: uint8 HWC images returned as PIL, int targets."""

    def __init__(self, n: int = N, transform: Any = None, seed: int = 0) -> None:
        super().__init__(root="", transform=transform)
        rng = np.random.default_rng(seed)
        self.data = rng.integers(0, 256, (n, 32, 32, 3), dtype=np.uint8)
        self.targets = rng.integers(0, 10, n).tolist()
        self.reads = 0

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, index: int) -> tuple[Any, int]:
        self.reads += 1
        img: Any = Image.fromarray(self.data[index])
        if self.transform is not None:
            img = self.transform(img)
        return img, self.targets[index]


class AddNoise:
    """A transform with hidden randomness: not in any known list, nothing in its name says so."""

    def __call__(self, x: Any) -> Any:
        if isinstance(x, Image.Image):
            return Image.fromarray(np.asarray(x) ^ int(torch.randint(0, 2, ())))
        return x + 0.01 * torch.rand(x.shape)


class Offset:
    """An unknown but deterministic transform: it may join the prefix once proven."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1.0


class BigTensors(Dataset[tuple[torch.Tensor, int]]):
    """Deterministic float samples of 48 KiB each, without a ``transform``: the sample is the unit."""

    def __init__(self, n: int) -> None:
        self.base = torch.arange(n * 3 * 64 * 64, dtype=torch.int64).remainder(251).to(torch.uint8)
        self.base = self.base.view(n, 3, 64, 64)

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.base[index].float() / 255.0, index % 10


class RandomSamples(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.rand(3)


class Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


class NoLen(Dataset[int]):
    def __getitem__(self, index: int) -> int:
        return index


def cifar_train() -> T.Compose:
    return T.Compose(
        [T.RandomCrop(32, padding=4), T.RandomHorizontalFlip(), T.ToTensor(), T.Normalize(MEAN, STD)]
    )


DETERMINISTIC = {
    "totensor-normalize": lambda: T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]),
    "resize-centercrop": lambda: T.Compose([T.Resize(40), T.CenterCrop(32), T.ToTensor()]),
    "v2": lambda: v2.Compose(
        [v2.ToImage(), v2.ToDtype(torch.float32, scale=True), v2.Normalize(MEAN, STD)]
    ),
}

AUGMENTED = {
    "v1": cifar_train,
    "v2": lambda: v2.Compose(
        [
            v2.RandomCrop(32, padding=4),
            v2.RandomHorizontalFlip(),
            v2.ToImage(),
            v2.ToDtype(torch.float32, scale=True),
            v2.Normalize(MEAN, STD),
        ]
    ),
    "v1-reflect": lambda: T.Compose(
        [
            T.RandomCrop(32, padding=(2, 4), padding_mode="reflect"),
            T.RandomHorizontalFlip(),
            T.ToTensor(),
            T.Normalize(MEAN, STD),
        ]
    ),
}


@pytest.fixture(autouse=True)
def _fresh_builds() -> Iterator[None]:
    pt.clear_builds()
    yield
    pt.clear_builds()


def same(a: Any, b: Any) -> bool:
    """Exact equality of samples or batches (tensors by dtype, shape and every value)."""
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(map(same, a, b))
    return type(a) is type(b) and a == b


def samples_under_seed(dataset: Any) -> list[Any]:
    out = []
    for i in range(len(dataset)):
        torch.manual_seed(i)
        out.append(dataset[i])
    return out


@pytest.mark.parametrize("make", DETERMINISTIC.values(), ids=DETERMINISTIC.keys())
def test_ram_gives_exactly_the_original_samples_and_batches(make: Any) -> None:
    ds = FakeCifar(transform=make())
    assert pt.strategies(ds, cuda=False)["ram"] is None
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.nbytes == N * (3 * 32 * 32 * 4 + 8) and prepared.build_s > 0  # images, targets
    assert all(map(same, samples_under_seed(prepared.dataset), samples_under_seed(ds)))
    # Nothing random is left: whole batches are gathered by index, already collated.
    assert prepared.collate_fn is not None and "per sample: nothing" in prepared.detail
    cached = DataLoader(prepared.dataset, batch_size=64, collate_fn=prepared.collate_fn)
    for got, expected in zip(cached, DataLoader(ds, batch_size=64), strict=True):
        assert same(got, expected)
        assert got[1].dtype == torch.int64  # CIFAR10-style int targets stay int64


@pytest.mark.parametrize("make", AUGMENTED.values(), ids=AUGMENTED.keys())
def test_augmented_cifar_pipeline_is_reordered_and_reproduces_the_original(make: Any) -> None:
    ds = FakeCifar(transform=make())
    prepared = pt.prepare(ds, "ram", device=CPU)
    # Crop and flip only select pixels, so ToTensor/Normalize move ahead of them into the cache;
    # the crop's padding stays per sample, in the normalised space.
    assert prepared.detail.startswith("cached: To")
    assert "Normalize; per sample: Pad(" in prepared.detail
    # A v1 crop/flip suffix runs batched (numbers drawn sample after sample, as the original does);
    # other suffixes run per sample under the default collate.
    assert (prepared.collate_fn is not None) == (make is cifar_train)
    # Value for value under the same seed, for every sample (padding included) ...
    assert all(map(same, samples_under_seed(prepared.dataset), samples_under_seed(ds)))
    # ... and through real DataLoaders with two worker processes each seeded the same way.
    loaders = []
    for dataset, collate in ((ds, None), (prepared.dataset, prepared.collate_fn)):
        torch.manual_seed(123)
        loader = DataLoader(
            dataset, batch_size=64, shuffle=True, num_workers=2, collate_fn=collate
        )
        loaders.append([batch for _, batch in zip(range(4), loader, strict=False)])
    assert all(map(same, *loaders))


def test_padding_fill_is_the_fill_mapped_through_totensor_and_normalize() -> None:
    prepared = pt.prepare(FakeCifar(transform=cifar_train()), "ram", device=CPU)
    pad = prepared.dataset.suffix.steps[0]
    # fill=0 in pixel space becomes (0/255 - mean) / std per channel after ToTensor + Normalize.
    expected = (torch.zeros(3) - torch.tensor(MEAN)) / torch.tensor(STD)
    torch.testing.assert_close(pad.fill, expected, rtol=0, atol=1e-6)


def test_cached_augmentation_still_varies_across_epochs() -> None:
    prepared = pt.prepare(FakeCifar(transform=cifar_train()), "ram", device=CPU)
    loader = DataLoader(
        prepared.dataset, batch_size=N, shuffle=False, collate_fn=prepared.collate_fn
    )
    first, second = next(iter(loader))[0], next(iter(loader))[0]
    # 512 samples drawing identical crops and flips twice would be a 1 in 162**512 event.
    assert not torch.equal(first, second)


def test_cached_flip_rate_is_about_half() -> None:
    ds = FakeCifar(n=250, transform=T.Compose([T.RandomHorizontalFlip(), T.ToTensor()]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: ToTensor; per sample: RandomHorizontalFlip")
    plain = [T.ToTensor()(Image.fromarray(img)) for img in ds.data]
    flips = draws = 0
    for _ in range(8):
        for i, reference in enumerate(plain):
            out = prepared.dataset[i][0]
            flipped = torch.equal(out, reference.flip(-1))
            assert flipped or torch.equal(out, reference)
            flips += flipped
            draws += 1
    # 2000 fair draws: mean 1000, sd 22.4; the bound is 9 sd away, never crossed by chance.
    assert 0.4 < flips / draws < 0.6


def test_hidden_randomness_is_never_cached() -> None:
    first = FakeCifar(transform=T.Compose([T.ToTensor(), AddNoise(), T.Normalize(MEAN, STD)]))
    prepared = pt.prepare(first, "ram", device=CPU)
    # Probed under several RNG states, AddNoise is found random: it stops the prefix, and so does
    # everything after it (Normalize is not moved across a step that is not a pure selection).
    assert prepared.detail == "cached: ToTensor; per sample: AddNoise, Normalize"
    assert not torch.equal(prepared.dataset[0][0], prepared.dataset[0][0])

    leading = FakeCifar(transform=T.Compose([T.ToTensor(), T.RandomHorizontalFlip(), AddNoise()]))
    assert "AddNoise" in pt.prepare(leading, "ram", device=CPU).detail.split("per sample:")[1]

    random_first = FakeCifar(transform=T.Compose([AddNoise(), T.ToTensor()]))
    reason = pt.strategies(random_first, cuda=False)["ram"]
    assert reason is not None and "first step (AddNoise)" in reason
    with pytest.raises(CandidateInfeasible, match=r"first step \(AddNoise\)"):
        pt.prepare(random_first, "ram", device=CPU)


def test_a_random_first_step_is_refused_with_its_name() -> None:
    ds = FakeCifar(transform=T.Compose([T.ColorJitter(0.4), T.ToTensor()]))
    reason = pt.strategies(ds, cuda=False)["ram"]
    assert reason == (
        "the transform is random from its first step (ColorJitter): nothing deterministic to cache"
    )


def test_an_unknown_step_joins_the_prefix_once_proven_deterministic() -> None:
    ds = FakeCifar(transform=T.Compose([T.ToTensor(), Offset(), T.Lambda(lambda x: x * 2)]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith("cached: ToTensor, Offset, Lambda; per sample: nothing")
    assert all(map(same, samples_under_seed(prepared.dataset), samples_under_seed(ds)))


def test_workers_read_the_shared_cache_without_copying_it(no_leaked_children: None) -> None:
    ds = BigTensors(2048)
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.nbytes == 2048 * 3 * 64 * 64 * 4 + 2048 * 8  # 96 MiB of images, then targets
    assert all(field.is_shared() for field in prepared.dataset.fields)
    shared = _worker_uss(prepared, worker_init_fn=None)
    # A control with the same measurement: workers that copy the cache show it in their USS.
    copied = _worker_uss(prepared, worker_init_fn=_copy_cache)
    # Each worker reads half the batches; a private copy would show ~100 % (control) or >= 50 %.
    assert all(uss < 0.25 * prepared.nbytes for uss in shared), (shared, prepared.nbytes)
    assert all(uss > 0.9 * prepared.nbytes for uss in copied), (copied, prepared.nbytes)


def _copy_cache(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.fields = tuple(field.clone() for field in info.dataset.fields)


def _worker_uss(prepared: pt.Prepared, worker_init_fn: Any) -> list[int]:
    loader = DataLoader(
        prepared.dataset,
        batch_size=64,
        shuffle=True,
        num_workers=2,
        collate_fn=prepared.collate_fn,
        multiprocessing_context="fork",
        persistent_workers=True,
        worker_init_fn=worker_init_fn,
    )
    before = {p.pid for p in psutil.Process().children()}
    iterator = iter(loader)
    for _ in iterator:  # a whole epoch: every cached row is read by one of the workers
        pass
    workers = [p for p in psutil.Process().children() if p.pid not in before]
    assert len(workers) == 2
    uss = [p.memory_full_info().uss for p in workers]
    iterator._shutdown_workers()  # type: ignore[attr-defined]
    del iterator, loader
    psutil.wait_procs(workers, timeout=10)
    return uss


def test_a_too_small_memory_budget_refuses_ram() -> None:
    ds = FakeCifar(transform=T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]))
    reasons = pt.strategies(ds, cuda=False, memory_budget_bytes=2**20)
    assert reasons["ram"] == (
        "a cache would need ~6.0 MiB (estimated from 8 samples), over the memory budget of 1.0 MiB"
    )
    assert pt.strategies(ds, cuda=False, memory_budget_bytes=2**30)["ram"] is None


def test_prepare_builds_once_per_dataset_and_lets_it_go() -> None:
    ds = FakeCifar(transform=cifar_train())
    first = pt.prepare(ds, "ram", device=CPU)
    reads = ds.reads
    second = pt.prepare(ds, "ram", device=CPU)
    assert second is first and ds.reads == reads  # reused: not one sample read again
    assert pt.prepare(FakeCifar(transform=cifar_train()), "ram", device=CPU) is not first
    # The store holds the dataset weakly: once the user drops it, the cache goes too.
    cache = weakref.ref(first.dataset)
    del ds, first, second
    gc.collect()
    assert cache() is None


def test_a_new_transform_on_the_same_dataset_is_a_new_build() -> None:
    ds = FakeCifar(transform=T.Compose([T.ToTensor()]))
    first = pt.prepare(ds, "ram", device=CPU)
    ds.transform = T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)])
    with pytest.warns(StaleCacheWarning, match=r"no longer matches its dataset: the transform changed"):
        second = pt.prepare(ds, "ram", device=CPU)
    assert second is not first and "Normalize" in second.detail


def test_an_unknown_strategy_names_the_value_the_choices_and_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"pretransform='gpu' .* one of \('none', 'ram'"):
        pt.prepare(FakeCifar(), "gpu", device=CPU)


@pytest.mark.parametrize(
    ("dataset", "reason"),
    [
        (Stream(), "IterableDataset: an unbounded stream is never pre-cached"),
        (NoLen(), "dataset has no __len__"),
        (RandomSamples(), "dataset[i] changed under different random states"),
    ],
)
def test_what_cannot_be_cached_is_refused_with_a_reason(dataset: Any, reason: str) -> None:
    reasons = pt.strategies(dataset, cuda=True)
    assert reasons["none"] is None
    assert reasons["ram"] is not None and reasons["ram"].startswith(reason)
    with pytest.raises(CandidateInfeasible, match=reason.replace("[", r"\[").split(":")[0]):
        pt.prepare(dataset, "ram", device=CPU)


def test_device_needs_cuda() -> None:
    assert pt.strategies(BigTensors(8), cuda=False)["device"] == "needs CUDA"


def test_a_deterministic_dataset_without_transform_is_cached_whole() -> None:
    ds = BigTensors(64)
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail == "cached: whole samples"
    assert all(map(same, (prepared.dataset[i] for i in range(64)), (ds[i] for i in range(64))))


def test_samples_that_are_not_tensors_or_numbers_are_refused() -> None:
    class Named(Dataset[tuple[torch.Tensor, str]]):
        def __len__(self) -> int:
            return 4

        def __getitem__(self, index: int) -> tuple[torch.Tensor, str]:
            return torch.zeros(2), f"file{index}.png"

    reason = pt.strategies(Named(), cuda=False)["ram"]
    assert reason is not None and reason.startswith("field 1 of each sample is a str")


@contextlib.contextmanager
def rng_left_alone() -> Iterator[None]:
    """Asserts that what runs inside leaves torch's, Python's and NumPy's process-wide generators
    where it found them (seeded here)."""

    def seed() -> None:
        torch.manual_seed(5)
        random.seed(5)
        np.random.seed(5)

    seed()
    expected = (torch.rand(1), random.random(), np.random.rand())
    seed()
    yield
    assert (torch.rand(1), random.random(), np.random.rand()) == expected


def test_planning_leaves_the_users_objects_and_rng_alone() -> None:
    transform = cifar_train()
    steps = list(transform.transforms)
    ds = FakeCifar(transform=transform)
    with rng_left_alone():
        pt.strategies(ds, cuda=False)
        pt.prepare(ds, "ram", device=CPU)
    assert ds.transform is transform and transform.transforms == steps
    assert transform.transforms[0].padding == 4


class _DrawsForNothing(Dataset):
    """Deterministic samples from an item method that draws from every process-wide generator (a
    random step whose chance is 0): planning proves them deterministic and caches them whole."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        skip = torch.rand(1).item() < 0.0 or random.random() < 0.0 or np.random.rand() < 0.0
        return torch.full((2,), float(-index if skip else index)), index % 10


def test_planning_a_whole_sample_cache_leaves_the_rng_alone() -> None:
    # Its probe samples read outside the proof moved the user's generator: a drop-in with
    # num_workers=0 then shuffled its first epoch unlike torch's loader with the same seed.
    with rng_left_alone():
        assert pt.strategies(_DrawsForNothing(), cuda=False)["ram"] is None  # cached whole: it reads probes


def test_device_strategy_on_a_cpu_stand_in_gathers_batches_by_index() -> None:
    # No GPU here: the device path runs with device=cpu, standing in for the accelerator.
    ds = FakeCifar(transform=DETERMINISTIC["totensor-normalize"]())
    prepared = pt.prepare(ds, "device", device=CPU)
    assert prepared.strategy == "device" and prepared.collate_fn is not None
    cached = DataLoader(prepared.dataset, batch_size=64, collate_fn=prepared.collate_fn)
    assert all(map(same, cached, DataLoader(ds, batch_size=64)))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_device_strategy_caches_on_the_gpu() -> None:
    ds = FakeCifar(transform=cifar_train())
    assert pt.strategies(ds, cuda=True)["device"] is None
    prepared = pt.prepare(ds, "device", device=torch.device("cuda"))
    assert all(field.is_cuda for field in prepared.dataset.fields)
    assert pt.holds_cuda_tensors(prepared.dataset)
    torch.manual_seed(0)
    got = prepared.dataset[3]
    torch.manual_seed(0)
    expected = ds[3]
    assert torch.equal(got[0].cpu(), expected[0]) and got[1] == expected[1]


def test_measure_runs_a_ram_candidate_and_reports_the_build() -> None:
    ds = FakeCifar(transform=cifar_train())
    limits = MeasureLimits(window_s=0.05, min_batches=2, max_batches=4)
    t0 = time.perf_counter()
    m = measure(ds, Candidate(batch_size=64, pretransform="ram"), limits=limits)
    assert m.samples > 0 and m.cache_bytes == N * (3 * 32 * 32 * 4 + 8) and m.build_s > 0
    assert time.perf_counter() - t0 < 60


def describe(samples: list[Any]) -> dict[str, Any]:
    """A user's collate_fn that returns a dict and records exactly what it was given."""
    return {
        "types": [tuple(type(v).__name__ for v in s) for s in samples],
        "images": torch.stack([s[0] for s in samples]),
        "labels": [s[1] for s in samples],
    }


@pytest.mark.parametrize(
    "make", [DETERMINISTIC["totensor-normalize"], cifar_train], ids=["whole", "crop-flip"]
)
def test_a_users_collate_fn_receives_the_original_samples_under_a_cache(make: Any) -> None:
    ds = FakeCifar(n=96, transform=make())
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.collate_fn is not None  # the batched path, which would bypass the user's function
    dataset, collate = prepared.loader_parts(describe)
    assert collate is describe
    batches = []
    for data, fn in ((ds, describe), (dataset, collate)):
        torch.manual_seed(3)
        batches.append(list(DataLoader(data, batch_size=32, shuffle=True, collate_fn=fn)))
    for got, expected in zip(*batches, strict=True):
        assert got["types"] == expected["types"] == [("Tensor", "int")] * 32  # ints stay ints
        assert got["labels"] == expected["labels"]
        assert torch.equal(got["images"], expected["images"])
    # Without a user collate_fn, the fast batched path is kept.
    assert prepared.loader_parts(None) == (prepared.dataset, prepared.collate_fn)
    assert pt.prepare(ds, "none", device=CPU).loader_parts(describe) == (ds, describe)
