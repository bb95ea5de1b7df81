"""A cache never outlives an input of the code it froze (NOTE [ Fresh caches ]).

The dataset's attributes, its class attributes, the module globals its code and its frozen steps
name, and functions named by global name: change one, and the next use of the cache says what changed
and serves samples built from the new value. Leave them alone, and the cache is never called stale.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision.transforms as T
from test_pretransform_images import Squares  # 40x40 RGB images through ``transform``
from torch.utils.data import DataLoader, Dataset

import autotune
from autotune import pretransform as pt
from autotune.exceptions import StaleCacheWarning
from autotune.pretransform.fresh import reseeds_global_rng
from autotune.space import Candidate

CPU = torch.device("cpu")
THIS = sys.modules[__name__]

GAIN = 1.0
"""A transform parameter held in a module global, read by ``Gain``."""


def brighten(x: torch.Tensor) -> torch.Tensor:
    """A global function a step calls by name; a test replaces it."""
    return x + 0.5


digest = hashlib.md5()
"""A module global whose state cannot be fingerprinted, named as a method is (``h.digest()``)."""


@pytest.fixture(autouse=True)
def _fresh_builds() -> Iterator[None]:
    pt.clear_builds()
    yield
    pt.clear_builds()


class Scaled(Dataset[tuple[torch.Tensor, int]]):
    """Deterministic samples (cached whole) that read an attribute, a class attribute and a global."""

    offset = 0.0

    def __init__(self, n: int = 64) -> None:
        self.base = torch.arange(n * 4, dtype=torch.float32).view(n, 4)
        self.scale = 1.0
        self.reads = 0

    def __len__(self) -> int:
        return len(self.base)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.reads += 1  # its own bookkeeping: assigned by its own code, not an input
        return self.base[index] * self.scale + self.offset, index % 3


class Gain:
    """A deterministic user step whose parameter is a module global."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * GAIN


class Levels:
    """A deterministic user step whose parameter is a class attribute."""

    factor = 1.0

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor


class Brightened:
    """A deterministic user step that calls a global function by name."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return brighten(x)


def assert_serves_the_dataset(prepared: pt.Prepared, ds: Any) -> None:
    loader = DataLoader(prepared.dataset, batch_size=16, collate_fn=prepared.collate_fn)
    for got, expected in zip(loader, DataLoader(ds, batch_size=16), strict=True):
        assert torch.equal(got[0], expected[0]) and torch.equal(got[1], expected[1])


def test_a_dataset_attribute_its_code_reads_makes_the_cache_stale() -> None:
    ds = Scaled()
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail == "cached: whole samples" and prepared.stale_reason() is None
    ds.scale = 2.0  # what a training loop does between epochs
    assert prepared.stale_reason() == "the dataset's attributes changed (scale: 1.0 -> 2.0)"
    with pytest.warns(StaleCacheWarning, match=r"attributes changed \(scale: 1\.0 -> 2\.0\)"):
        rebuilt = pt.prepare(ds, "ram", device=CPU)
    assert rebuilt is not prepared and rebuilt.stale_reason() is None
    assert_serves_the_dataset(rebuilt, ds)


def test_a_class_attribute_makes_the_cache_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = Scaled()
    prepared = pt.prepare(ds, "ram", device=CPU)
    monkeypatch.setattr(Scaled, "offset", 1.0)
    assert prepared.stale_reason() == "the dataset's class attributes changed (Scaled.offset: 0.0 -> 1.0)"
    with pytest.warns(StaleCacheWarning, match=r"Scaled\.offset"):
        assert_serves_the_dataset(pt.prepare(ds, "ram", device=CPU), ds)


@pytest.mark.parametrize(
    ("step", "change", "reason"),
    [
        (Gain, lambda mp: mp.setattr(THIS, "GAIN", 2.0),
         "the globals step 1 (Gain)'s code reads changed (test_pretransform_fresh.GAIN: 1.0 -> 2.0)"),
        (Levels, lambda mp: mp.setattr(Levels, "factor", 2.0),
         "step 1 (Levels)'s class attributes changed (Levels.factor: 1.0 -> 2.0)"),
        (Brightened, lambda mp: mp.setattr(THIS, "brighten", lambda x: x + 1.0),
         "the globals step 1 (Brightened)'s code reads changed (test_pretransform_fresh.brighten: "),
    ],
    ids=["module-global", "class-attribute", "global-function-replaced"],
)
def test_what_a_frozen_step_reads_makes_the_cache_stale(
    step: Any, change: Any, reason: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    ds = Squares(40, T.Compose([T.ToTensor(), step()]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail.startswith(f"cached: ToTensor, {step.__name__}; per sample: nothing")
    change(monkeypatch)
    found = prepared.stale_reason()
    assert found is not None and found.startswith(reason), found
    with pytest.warns(StaleCacheWarning, match=rf"step 1 \({step.__name__}\)"):
        rebuilt = pt.prepare(ds, "ram", device=CPU)
    assert_serves_the_dataset(rebuilt, ds)  # every sample built with the new value


def test_a_global_a_lambda_step_reads_makes_the_cache_stale(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = Squares(24, T.Compose([T.ToTensor(), T.Lambda(lambda x: x * GAIN)]))
    prepared = pt.prepare(ds, "ram", device=CPU)
    monkeypatch.setattr(THIS, "GAIN", 3.0)
    found = prepared.stale_reason()
    assert found is not None and found.startswith("step 1 (Lambda) changed (lambd"), found


def test_the_drop_in_rebuilds_a_stale_cache_at_the_next_epoch() -> None:
    ds = Scaled(96)
    loader = autotune.DataLoader.configured(ds, Candidate(16, pretransform="ram"), device="cpu")
    first = torch.cat([x for x, _ in loader])
    ds.scale = 3.0
    with warnings.catch_warnings():
        # The drop-in rebuilds the cache for its next epoch and serves nothing stale: no warning.
        warnings.simplefilter("error", StaleCacheWarning)
        second = torch.cat([x for x, _ in loader])
    assert torch.equal(second, 3.0 * first)
    assert torch.equal(second, torch.stack([ds[i][0] for i in range(96)]))


class Bookkeeping(Dataset[torch.Tensor]):
    """Deterministic samples whose code keeps state of its own: a read counter, a memo, a handle
    opened on first use, a statistics object. None of it is an input of the samples."""

    def __init__(self, path: Path, n: int = 48) -> None:
        self.path = path
        self.handle: Any = None
        self.memo: dict[int, torch.Tensor] = {}
        self.stats = _Stats()
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        self.calls += 1
        self.stats.reads += 1
        if self.handle is None:
            self.handle = open(self.path, "rb")  # noqa: SIM115 - held open, as datasets over one file do
        if index not in self.memo:
            self.handle.seek(index)
            self.memo[index] = torch.full((3,), float(self.handle.read(1)[0]))
        return self.memo[index].clone()


class _Stats:
    def __init__(self) -> None:
        self.reads = 0


def test_an_unchanged_dataset_is_never_called_stale(tmp_path: Path) -> None:
    path = tmp_path / "bytes.bin"
    path.write_bytes(bytes(range(48)))
    ds = Bookkeeping(path)
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.detail == "cached: whole samples"
    vision = Squares(40, T.Compose([T.ToTensor(), Gain()]))
    cached_vision = pt.prepare(vision, "ram", device=CPU)
    with warnings.catch_warnings():
        warnings.simplefilter("error", StaleCacheWarning)
        for _ in range(3):  # epochs: over the cache, with worker processes, and over the originals
            for p in (prepared, cached_vision):
                list(DataLoader(p.dataset, batch_size=8, collate_fn=p.collate_fn, num_workers=2))
            list(DataLoader(ds, batch_size=8))
            list(DataLoader(vision, batch_size=8))
            assert prepared.stale_reason() is None and cached_vision.stale_reason() is None
        assert pt.prepare(ds, "ram", device=CPU) is prepared  # reused: no rebuild
        assert pt.prepare(vision, "ram", device=CPU) is cached_vision
    ds.handle.close()


class Counted(Scaled):
    """Counts every sample read, and every read of a large attribute's bytes."""

    def __init__(self) -> None:
        super().__init__(n=8192)
        self.getitem_calls = 0

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.getitem_calls += 1
        return super().__getitem__(index)


def test_the_staleness_check_reads_no_sample(monkeypatch: pytest.MonkeyPatch) -> None:
    ds = Counted()
    prepared = pt.prepare(ds, "ram", device=CPU)
    reads = ds.getitem_calls
    copies: list[int] = []
    real = torch.Tensor.numpy

    def counting(self: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
        copies.append(self.numel())
        return real(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "numpy", counting)
    for _ in range(10):  # one check per epoch start
        assert prepared.stale_reason() is None
    assert ds.getitem_calls == reads  # not one sample read
    # The 128 KiB base tensor is compared by a sample of its elements, never copied whole.
    assert copies and max(copies) < ds.base.numel() * ds.base.element_size()
    ds.base.view(-1).numpy()[0] += 1.0  # a write in place that torch's version counter does not see
    assert prepared.stale_reason() == "the dataset's attributes changed (base)"


class FromFile(Dataset[tuple[torch.Tensor, int]]):
    """Deterministic samples read through a file handle opened at construction: the handle's state
    (the file behind it) cannot be fingerprinted cheaply."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - closed by the test

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        self.file.seek(index)
        return torch.full((2,), float(self.file.read(1)[0])), 0


class Lookup:
    """A deterministic step that reads its table through a file handle."""

    def __init__(self, path: Path) -> None:
        self.file = open(path, "rb")  # noqa: SIM115 - closed by the test

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        self.file.seek(0)
        return x + self.file.read(1)[0]


def test_an_input_that_cannot_be_fingerprinted_is_not_cached(tmp_path: Path) -> None:
    path = tmp_path / "table.bin"
    path.write_bytes(bytes(range(32)))
    ds = FromFile(path)
    reason = pt.strategies(ds, cuda=False)["ram"]
    assert reason == (
        "dataset[i] reads file, a BufferedReader (the dataset's attributes), whose state cannot be"
        " fingerprinted cheaply: a change to it could not be seen, so it is not cached"
    )
    # A step that reads one is left out of the prefix: the cache stops before it.
    step = Lookup(path)
    pictures = Squares(24, T.Compose([T.ToTensor(), step]))
    prepared = pt.prepare(pictures, "ram", device=CPU)
    assert prepared.detail.startswith("cached: ToTensor; per sample: Lookup")
    assert_serves_the_dataset(prepared, pictures)
    ds.file.close()
    step.file.close()


class Hashed(Dataset[tuple[torch.Tensor, int]]):
    """Deterministic samples whose label is a hash: the code names ``digest`` as a method only."""

    def __len__(self) -> int:
        return 32

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        label = hashlib.md5(str(index).encode()).digest()[0] % 3
        return torch.full((2,), float(index)), label


class ReadsTheGlobal(Hashed):
    """The same, reading the module global ``digest`` itself."""

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(index)), digest.copy().digest()[0] % 3


def test_an_attribute_named_like_a_global_is_not_a_read_of_the_global() -> None:
    # ``h.digest()`` reads no global: the module's ``digest`` (an opaque hash object) is no input.
    ds = Hashed()
    assert pt.strategies(ds, cuda=False)["ram"] is None
    assert_serves_the_dataset(pt.prepare(ds, "ram", device=CPU), ds)
    # Read as a global, it is an input whose state cannot be seen: not cached.
    reason = pt.strategies(ReadsTheGlobal(), cuda=False)["ram"]
    assert reason is not None, "an opaque global the code reads must refuse the cache"
    assert reason.startswith("dataset[i] reads test_pretransform_fresh.digest, a HASH"), reason


class ReadsFiles(Dataset[torch.Tensor]):
    """Sample i is the number in ``root/{i}.txt`` through a deterministic transform; with
    ``listed``, the dataset keeps the list of its paths, as ImageFolder keeps ``samples``."""

    def __init__(self, root: Path, n: int, listed: bool) -> None:
        self.root = str(root)
        self.n = n
        if listed:
            self.paths = [str(root / f"{i}.txt") for i in range(n)]
        self.transform = T.Lambda(lambda x: x * 2)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        path = self.paths[i] if hasattr(self, "paths") else f"{self.root}/{i}.txt"
        with open(path) as f:
            x = torch.tensor([float(f.read())])
        return self.transform(x) if self.transform is not None else x


def _write_values(root: Path, n: int, value: float) -> None:
    import os
    import time

    for i in range(n):
        (root / f"{i}.txt").write_text(str(value + i))
    later = time.time_ns() + 1_000_000_000  # a rewrite always shows in the modification time
    for i in range(n):
        os.utime(root / f"{i}.txt", ns=(later, later))


def test_files_a_dataset_reads_without_listing_them_keep_it_uncached(tmp_path: Path) -> None:
    # The files are found by what the probes open: a path made from the index cannot be checked at
    # each epoch, so a rewritten file would be served stale. Such a dataset is not cached.
    _write_values(tmp_path, 24, 1.0)
    reason = pt.strategies(ReadsFiles(tmp_path, 24, listed=False), cuda=False)["ram"]
    assert reason is not None and "read files it does not list" in reason and "0.txt" in reason


def test_a_listed_file_rewritten_between_epochs_makes_the_cache_stale(tmp_path: Path) -> None:
    _write_values(tmp_path, 24, 1.0)
    ds = ReadsFiles(tmp_path, 24, listed=True)
    prepared = pt.prepare(ds, "ram", device=CPU)
    assert prepared.stale_reason() is None
    _write_values(tmp_path, 24, 100.0)
    found = prepared.stale_reason()
    assert found is not None and "files" in found
    with pytest.warns(StaleCacheWarning):
        rebuilt = pt.prepare(ds, "ram", device=CPU)
    assert torch.equal(torch.cat([rebuilt.dataset[i] for i in range(24)]),
                       torch.tensor([2.0 * (100.0 + i) for i in range(24)]))


class _SeedsInAHelper(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return self._draw(i)

    def _draw(self, i: int) -> torch.Tensor:
        with torch.random.fork_rng():
            torch.manual_seed(i)
            return torch.rand(2)


class _DrawsOnly(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.rand(2) + i  # draws from the global RNG, never sets it


def test_a_dataset_that_sets_the_global_random_state_per_sample_is_found_from_its_code() -> None:
    import torchvision

    # torchvision's FakeData seeds torch per index and restores the state after.
    assert reseeds_global_rng(torchvision.datasets.FakeData(size=4))
    assert reseeds_global_rng(_SeedsInAHelper())  # in a method __getitem__ calls
    assert not reseeds_global_rng(_DrawsOnly())
    assert not reseeds_global_rng(torch.utils.data.TensorDataset(torch.zeros(4)))
    assert not reseeds_global_rng([1, 2, 3])  # a list's __getitem__ is C code
