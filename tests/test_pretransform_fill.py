"""A ``ram`` cache filled by the pass that loads the samples (``prepare(..., fill="pass")``).

Every sample is compared with the user's own dataset under the same seeds, filled or not, through
real DataLoaders: in the main process, with forked and spawned worker processes, and with threads.
Raw reads are counted in shared memory, so that a read in any worker process counts.
"""

from __future__ import annotations

import gc
import mmap
import multiprocessing
import os
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from test_faults import _leaked_shm, _shm_entries  # the /dev/shm checks the fault tests use
from test_pretransform import AUGMENTED, DETERMINISTIC, MEAN, STD, FakeCifar, cifar_train, same
from test_pretransform_images import VaryingTensors, seeded
from torch.utils.data import DataLoader, Dataset

from autotune import pretransform as pt
from autotune.exceptions import CandidateInfeasible, ConfigurationError, StaleCacheWarning
from autotune.pretransform.filling import FillingSamples
from autotune.pretransform.split import probe_indices, prove
from autotune.pretransform.stores import POPULATE_AHEAD_BYTES, FilledColumn, copy_rows, populate, shared_empty
from autotune.threads import ThreadDataLoader

CPU = torch.device("cpu")
N = 256


@pytest.fixture(autouse=True)
def _fresh_builds() -> Iterator[None]:
    pt.clear_builds()
    yield
    pt.clear_builds()


class Counted(FakeCifar):
    """FakeCifar that counts the reads of each sample in shared memory (every worker's count)."""

    def __init__(self, n: int = N, transform: Any = None, odd: tuple[int, ...] = ()) -> None:
        super().__init__(n, transform)
        self.counts = torch.zeros(n, dtype=torch.int64).share_memory_()
        self.odd = odd
        """Indices whose image is 30x30, not 32x32: a shape the probes never showed."""

    def __getitem__(self, index: int) -> tuple[Any, int]:
        # Through __setitem__ by name: the freshness check then sees the counter as bookkeeping.
        self.counts.__setitem__(index, self.counts[index] + 1)
        if index in self.odd:
            img = self.data[index][:30, :30]
            return (self.transform(img) if self.transform is not None else img), self.targets[index]
        return super().__getitem__(index)


def epoch(dataset: Any, collate: Any = None, *, seed: int, workers: int = 0, ctx: str | None = None,
          batch_size: int = 32) -> list[Any]:
    """One shuffled epoch; the same seed gives the same order and the same workers' seeds."""
    torch.manual_seed(seed)
    loader = DataLoader(
        dataset, batch_size=batch_size, shuffle=True, num_workers=workers, collate_fn=collate,
        multiprocessing_context=ctx if workers else None, generator=torch.Generator().manual_seed(seed),
    )
    return list(loader)


def reads_of(ds: Counted, fn: Any) -> tuple[Any, torch.Tensor]:
    """``fn()`` and the samples it read from ``ds`` (raw or whole), per index."""
    before = ds.counts.clone()
    out = fn()
    return out, ds.counts - before


# ------------------------------------------------------------------------------ the same samples


@pytest.mark.parametrize("make", [*DETERMINISTIC.values(), *AUGMENTED.values()],
                         ids=[*(f"det-{k}" for k in DETERMINISTIC), *(f"aug-{k}" for k in AUGMENTED)])
def test_a_filling_cache_gives_the_datasets_own_samples_filled_or_not(make: Any) -> None:
    ds = Counted(transform=make())
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert isinstance(prepared.dataset, FillingSamples)
    assert prepared.filled_fraction() == 0.0 and "filled as samples are loaded" in prepared.detail
    # Per sample under seeds: a first read fills, a second reads the cache; both are the dataset's.
    first = seeded(prepared.dataset, range(0, N, 3))
    assert 0 < prepared.filled_fraction() < 1
    assert all(map(same, first, seeded(ds, range(0, N, 3))))
    assert all(map(same, seeded(prepared.dataset, range(0, N, 3)), first))
    # Whole epochs in the main process: the first fills the rest, the next read the cache only.
    for e in range(3):
        got, reads = reads_of(ds, lambda e=e: epoch(prepared.dataset, prepared.collate_fn, seed=e))
        assert all(map(same, got, epoch(ds, seed=e)))
        assert int(reads.sum()) == (N - len(range(0, N, 3)) if e == 0 else 0)
    assert prepared.fill_counts().complete and prepared.filled_fraction() == 1.0


def test_a_cache_says_whether_each_batch_is_one_gather() -> None:
    # Nothing left per sample and torch's collate: one gather a batch, filled or not.
    plain = pt.prepare(FakeCifar(transform=DETERMINISTIC["totensor-normalize"]()), "ram", device=CPU,
                       fill="pass")
    assert plain.gathers_batches(torch.utils.data.default_collate)
    assert not plain.gathers_batches(lambda batch: batch)  # the user's collate gets samples
    # A random rest runs per sample.
    augmented = pt.prepare(FakeCifar(transform=cifar_train()), "ram", device=CPU, fill="pass")
    assert not augmented.gathers_batches(torch.utils.data.default_collate)


def test_the_proof_harness_passes_for_the_filling_wrapper_before_and_after_filling() -> None:
    ds = FakeCifar(transform=cifar_train())
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    indices = probe_indices(len(ds))
    plan = prepared.freshness.plan  # type: ignore[union-attr]
    wrapped = prepared.dataset
    # prove() reads item j as dataset[indices[j]]: a view of the whole filling cache at the probes.
    view = _At(wrapped, indices)
    assert prove(ds, plan, indices, view)  # unfilled: each sample stored as it is read
    assert all(wrapped.filler.flag(i) == 1 for i in indices[:4])
    assert prove(ds, plan, indices, view)  # filled: read from the cache, batches gathered


class _At(Dataset[Any]):
    """Item ``j`` of ``wrapped`` at ``indices[j]``, batches included."""

    def __init__(self, wrapped: Any, indices: list[int]) -> None:
        self.wrapped, self.indices = wrapped, indices

    def __len__(self) -> int:
        return len(self.indices)

    def __getitem__(self, j: int) -> Any:
        return self.wrapped[self.indices[j]]

    def __getitems__(self, js: list[int]) -> Any:
        return self.wrapped.__getitems__([self.indices[j] for j in js])


def test_forked_workers_fill_the_cache_the_main_process_reads(no_leaked_children: None) -> None:
    ds = Counted(transform=cifar_train())
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    for e in range(3):
        got, reads = reads_of(ds, lambda e=e: epoch(prepared.dataset, prepared.collate_fn, seed=e, workers=2))
        # Each sample read once in the first epoch (by the worker that loaded it), never after.
        assert reads.tolist() == [1 if e == 0 else 0] * N
        assert all(map(same, got, epoch(ds, seed=e, workers=2)))
        # What the workers wrote is the main process's cache: complete, and read without a raw read.
        assert prepared.fill_counts().complete
    main, reads = reads_of(ds, lambda: seeded(prepared.dataset, range(N)))
    assert int(reads.sum()) == 0 and all(map(same, main, seeded(ds, range(N))))


def test_a_complete_cache_is_the_built_cache(no_leaked_children: None) -> None:
    ds = FakeCifar(transform=cifar_train())
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert prepared.loader_parts()[0] is prepared.dataset  # still filling
    epoch(prepared.dataset, prepared.collate_fn, seed=0, workers=2)
    built = pt.prepare(FakeCifar(transform=cifar_train()), "ram", device=CPU)
    dataset, collate = prepared.loader_parts()
    # Complete: the loader gets the built cache's own wrapper (the batched crop/flip gather).
    assert dataset is prepared.dataset.cached and type(dataset) is type(built.dataset)
    assert collate is built.collate_fn
    assert prepared.nbytes == built.nbytes
    assert all(map(same, epoch(dataset, collate, seed=5), epoch(built.dataset, built.collate_fn, seed=5)))
    # With the user's own collate function: the samples the dataset gives, unbound from the batch.
    mine, mine_collate = prepared.loader_parts(list)
    assert all(map(same, epoch(mine, mine_collate, seed=6), epoch(ds, list, seed=6)))


def test_thread_workers_fill_different_samples_at_once() -> None:
    ds = Counted(transform=DETERMINISTIC["totensor-normalize"]())
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    expected = list(DataLoader(ds, batch_size=16))
    for e in range(2):
        loader = ThreadDataLoader(prepared.dataset, batch_size=16, worker_threads=3,
                                  collate_fn=prepared.collate_fn)
        got, reads = reads_of(ds, lambda loader=loader: list(loader))
        assert reads.tolist() == [1 if e == 0 else 0] * N
        assert all(map(same, got, expected))
    assert prepared.fill_counts().complete


def test_spawned_workers_receive_the_shared_cache_and_fill_it(monkeypatch: pytest.MonkeyPatch) -> None:
    # Decoded tensors of their own sizes: the spawned workers need the buffers and the lock. A cache
    # private to the process (a node cache's lock is a file, tested in test_pretransform_node.py).
    monkeypatch.setenv("AUTOTUNE_NODE_CACHE", "off")
    transform = v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip()])
    ds = VaryingTensors(24, transform)
    before = _shm_entries()
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert isinstance(prepared.dataset.fields[0], FilledColumn)
    got = epoch(prepared.dataset, prepared.collate_fn, seed=3, workers=2, ctx="spawn", batch_size=1)
    # Forked workers seed their RNGs as spawned ones do: the same flips.
    assert all(map(same, got, epoch(ds, seed=3, workers=2, ctx="fork", batch_size=1)))
    assert prepared.fill_counts().complete  # the spawned workers' writes, seen here
    # Their spans and shapes too: the main process reads every sample from what they stored.
    assert all(map(same, seeded(prepared.dataset, range(24)), seeded(ds, range(24))))
    # The lock went to the spawned workers as a named semaphore: its name is in /dev/shm while the
    # cache lives (so the check below can fail), and gone once it is dropped. (Other processes on a
    # shared machine make entries of their own meanwhile: only this process's count.)
    ours = {f"sem.{prepared.dataset.filler.lock._semlock.name.lstrip('/')}"}
    assert ours <= set(_leaked_shm(before))
    del prepared, got
    pt.clear_builds()
    gc.collect()
    assert not _ours(_leaked_shm(before), ours)


def _ours(entries: list[str], names: set[str]) -> list[str]:
    """The /dev/shm entries among ``entries`` this process made: ``names``, or torch's ``torch_<pid>_``."""
    return [e for e in entries if e in names or e.startswith(f"torch_{os.getpid()}_")]


# --------------------------------------------------------------------------- two writers, one sample


def _store_all(wrapper: FillingSamples, order: list[int]) -> None:
    for i in order:
        wrapper._stored(i)


def _race(wrapper: FillingSamples, how: str) -> None:
    """Two writers storing every sample in the same order, so that most samples are written twice
    at about the same moment (two iterators over one cache; an epoch never does this)."""
    order = list(range(len(wrapper)))
    if how == "threads":
        runners: list[Any] = [threading.Thread(target=_store_all, args=(wrapper, order)) for _ in range(2)]
    else:
        ctx = multiprocessing.get_context("fork")
        runners = [ctx.Process(target=_store_all, args=(wrapper, order)) for _ in range(2)]
    for r in runners:
        r.start()
    for r in runners:
        r.join(timeout=60)
        assert not r.is_alive()
    if how == "processes":
        assert all(r.exitcode == 0 for r in runners)


@pytest.mark.parametrize("how", ["processes", "threads"])
def test_the_same_fixed_shape_sample_stored_twice_at_once_is_right(
    how: str, no_leaked_children: None
) -> None:
    ds = FakeCifar(transform=DETERMINISTIC["resize-centercrop"]())
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    _race(prepared.dataset, how)
    assert prepared.fill_counts().complete
    assert all(map(same, seeded(prepared.dataset, range(N)), seeded(ds, range(N))))


@pytest.mark.parametrize("how", ["processes", "threads"])
def test_the_same_ragged_sample_stored_twice_at_once_is_right(how: str, no_leaked_children: None) -> None:
    ds = VaryingTensors(60, v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip()]))
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    _race(prepared.dataset, how)
    counts = prepared.fill_counts()
    # Both writers may reserve space for the same sample (the loser's copy is wasted): where that
    # happened often enough to fill the buffer, filling stopped and the rest comes from the source.
    assert counts.complete or (counts.stopped is not None and "full" in counts.stopped), counts
    assert counts.filled > len(ds) // 2, counts
    assert all(map(same, seeded(prepared.dataset, range(60)), seeded(ds, range(60))))
    # Every sample has its own space: a copy written by the writer that lost is never pointed at.
    column = prepared.dataset.fields[0]
    spans = sorted(map(tuple, column.spans.tolist()))
    assert all(stop <= start for (_, stop), (start, _) in zip(spans, spans[1:], strict=False))


# ------------------------------------------------------------------------------ batches of small rows


class Rows(Dataset[Any]):
    """Rows already in memory, as a TensorDataset gives them, counting reads; ``odd`` rows come in
    another dtype (a row the probes never showed), ``subclass`` wraps the features in a tv_tensor."""

    def __init__(self, n: int = N, odd: tuple[int, ...] = (), subclass: bool = False) -> None:
        gen = torch.Generator().manual_seed(0)
        self.x, self.y = torch.randn((n, 8), generator=gen), torch.randint(0, 10, (n,), generator=gen)
        self.counts = torch.zeros(n, dtype=torch.int64)
        self.odd, self.subclass = odd, subclass

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        self.counts.__setitem__(index, self.counts[index] + 1)
        x = self.x[index].double() if index in self.odd else self.x[index]
        return (v2.functional.to_image(x[None]) if self.subclass else x), self.y[index]


def test_a_batch_stores_its_missing_rows_at_once_and_each_row_once() -> None:
    ds = Rows(odd=(5,))
    assert 5 not in probe_indices(N)
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    dataset, collate = prepared.loader_parts(torch.utils.data.default_collate)
    assert collate is prepared.collate_fn  # torch's own collate: batches are gathered, not restacked
    batches = [[4, 5, 6, 4], [7, 8, 9], [4, 5, 6, 4]]  # a sampler drawing with replacement repeats rows
    for batch in batches:
        got, reads = reads_of(ds, lambda batch=batch: collate(dataset.__getitems__(batch)))
        assert same(got, torch.utils.data.default_collate([ds[i] for i in batch]))
    # The row of another dtype is served from the source every time (the batch per sample then);
    # every other row was read once, by the batch that stored it.
    assert reads.nonzero().flatten().tolist() == [5] and int(reads[5]) == 1
    flags = prepared.dataset.filler.flags
    assert flags[[4, 6, 7, 8, 9]].tolist() == [1] * 5 and int(flags[5]) == 2
    assert prepared.fill_counts().filled == 5


_FIRST_FILL_IN_A_FORK = """
import os, sys, torch
from torch.utils.data import Dataset
from autotune import pretransform as pt

class Rows(Dataset):
    def __init__(self):
        self.x = torch.randn((512, 8))
    def __len__(self):
        return len(self.x)
    def __getitem__(self, i):
        return self.x[i], i % 10

dataset = pt.prepare(Rows(), "ram", device=torch.device("cpu"), fill="pass").loader_parts(None)[0]
empty = [i for i in range(512) if dataset.filler.flag(i) == 0][:32]
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # as a forked worker: its first batch, which stores its rows
    before = set(sys.modules)
    dataset.__getitems__(empty + empty[:4])
    os.write(write, " ".join(sorted(set(sys.modules) - before)).encode() + b"\\n")
    os._exit(0)
os.waitpid(pid, 0)
print("imported:", os.read(read, 65536).decode().strip(), dataset.filler.counts().filled)
"""


def test_a_forked_workers_first_batch_stores_its_rows_without_importing_anything() -> None:
    # A module imported on a worker's first batch is imported by every worker, each on its own CPU
    # time (np.unique imports numpy.ma: ~35 ms a worker, a third of a second for 16 on 2 CPUs), in a
    # fresh interpreter, as the user's script has, where no test imported it before.
    proc = subprocess.run([sys.executable, "-c", _FIRST_FILL_IN_A_FORK], capture_output=True, text=True,
                          timeout=300, cwd=Path(__file__).resolve().parents[1])
    assert proc.returncode == 0, proc.stderr[-3000:]
    imported, filled = proc.stdout.split("imported:")[-1].rsplit(" ", 1)
    assert imported.strip() == ""
    assert int(filled) >= 32  # the child's rows are in the parent's cache: the fill really ran


def test_a_subclassed_row_reaches_torchs_collate_as_the_dataset_gives_it() -> None:
    ds = Rows(subclass=True)
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    dataset, collate = prepared.loader_parts(torch.utils.data.default_collate)
    assert collate is torch.utils.data.default_collate  # its stack decides the type, not a gather
    for _ in range(2):  # storing, then cached
        got = collate(dataset.__getitems__([3, 1, 2]))
        assert same(got, torch.utils.data.default_collate([ds[i] for i in [3, 1, 2]]))
        assert type(got[0]) is type(torch.utils.data.default_collate([ds[3]])[0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("width", [3, 1024])  # below MEMCPY_FROM for the batch, and above it
def test_rows_copied_at_once_are_the_rows_given(dtype: torch.dtype, width: int) -> None:
    dst = torch.zeros((100, width), dtype=dtype)
    rows = np.array([7, 2, 50, 99])
    values = [torch.full((width,), i, dtype=dtype) for i in range(4)]
    values[1] = values[1].clone().as_subclass(type(v2.functional.to_image(torch.zeros(1, 1))))
    if dtype.is_floating_point:
        values[2] = values[2].clone().requires_grad_()
    copy_rows(dst, rows, values, "tensor")
    assert not dst.requires_grad and type(dst) is torch.Tensor
    assert [int(dst[r, -1]) for r in rows] == [0, 1, 2, 3]
    assert int(dst.count_nonzero()) == 3 * width
    numbers = torch.zeros(10, dtype=torch.float64)
    copy_rows(numbers, np.array([1, 3]), [0.5, 2.0], "float")
    assert numbers.tolist() == [0, 0.5, 0, 2.0, 0, 0, 0, 0, 0, 0]


# ------------------------------------------------------------------------------ decoded images


def test_forked_workers_fill_a_ragged_cache_of_decoded_images(
    tmp_path: Path, no_leaked_children: None
) -> None:
    from test_pretransform_images import write_mixed_folder
    from torchvision.datasets import ImageFolder

    transform = T.Compose([T.RandomResizedCrop(24), T.RandomHorizontalFlip(), T.ToTensor()])
    ds = ImageFolder(str(write_mixed_folder(tmp_path / "images", n=40)), transform=transform)
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert prepared.detail.startswith("cached: decoded samples")
    for e in range(2):
        got = epoch(prepared.dataset, prepared.collate_fn, seed=e, workers=2, batch_size=8)
        assert all(map(same, got, epoch(ds, seed=e, workers=2, batch_size=8)))
    assert prepared.fill_counts().complete
    # The pixels stored are the decoded files, as a build stores them.
    built = pt.prepare(ImageFolder(ds.root, transform=transform), "ram", device=CPU)
    assert all(
        a.get(i).tobytes() == b.get(i).tobytes()
        for a, b in [(prepared.dataset.fields[0], built.dataset.fields[0])] for i in range(len(ds))
    )


class Growing(VaryingTensors):
    """uint8 images: the probes (and only they) are small, so the estimate is far short."""

    def __init__(self, n: int = 40) -> None:
        super().__init__(n, v2.Compose([v2.ToDtype(torch.float32, scale=True), v2.RandomHorizontalFlip()]))
        probes = set(probe_indices(n))
        gen = torch.Generator().manual_seed(0)
        self.images = [
            torch.randint(0, 256, (3, 8 + i % 3, 8) if i in probes else (3, 24, 24), dtype=torch.uint8,
                          generator=gen)
            for i in range(n)
        ]


def test_a_ragged_buffer_that_fills_up_stops_filling_and_serves_the_rest_from_the_source() -> None:
    ds = Growing()
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    for _ in range(2):
        assert all(map(same, seeded(prepared.dataset, range(len(ds))), seeded(ds, range(len(ds)))))
    counts = prepared.fill_counts()
    assert 0 < counts.filled < counts.total and not counts.complete
    assert counts.stopped is not None and "ragged buffer is full" in counts.stopped
    column = prepared.dataset.fields[0]
    assert int(column.cursor[0]) * 4 <= column.capacity_bytes  # never past what was reserved
    assert prepared.loader_parts()[0] is prepared.dataset  # incomplete: it stays the filling wrapper


def test_the_memory_budget_bounds_the_ragged_buffer() -> None:
    ds = VaryingTensors(60, v2.Compose([v2.ToDtype(torch.float32, scale=True)]))
    plenty = pt.prepare(ds, "ram", device=CPU, fill="pass")
    need = plenty.freshness.plan.estimate().total  # type: ignore[union-attr]
    pt.clear_builds()
    tight = pt.prepare(ds, "ram", device=CPU, fill="pass", memory_budget_bytes=need + 1)
    assert tight.nbytes <= need + 1 < plenty.nbytes
    assert all(map(same, seeded(tight.dataset, range(60)), seeded(ds, range(60))))
    with pytest.raises(CandidateInfeasible, match=r"over the memory budget of 1\.0 KiB"):
        pt.prepare(VaryingTensors(60, ds.transform), "ram", device=CPU, fill="pass", memory_budget_bytes=1024)


# --------------------------------------------------------------------------------- what can go wrong


def test_a_sample_of_another_shape_is_served_from_the_source_every_time() -> None:
    # Index 5 is 30x30 where the probes were all 32x32 (a build would store it ragged).
    ds = Counted(64, transform=T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]), odd=(5,))
    assert 5 not in probe_indices(64)
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    for _ in range(2):
        got, reads = reads_of(ds, lambda: seeded(prepared.dataset, range(64)))
        assert all(map(same, got, seeded(ds, range(64))))
    assert reads.nonzero().flatten().tolist() == [5]  # the second pass read that sample alone
    counts = prepared.fill_counts()
    assert (counts.filled, counts.unstorable, counts.complete) == (63, 1, False)
    # A user's collate function receives it as the dataset gives it, in a batch of cached samples.
    dataset, collate = prepared.loader_parts(list)
    batch = collate(dataset.__getitems__([4, 5, 6]))
    assert all(map(same, batch, [ds[4], ds[5], ds[6]]))


def test_a_change_after_filling_makes_the_cache_stale() -> None:
    ds = FakeCifar(transform=T.Compose([T.ToTensor(), T.Normalize(MEAN, STD)]))
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    epoch(prepared.dataset, prepared.collate_fn, seed=0)
    assert prepared.fill_counts().complete and prepared.stale_reason() is None
    ds.transform.transforms[1].std = (0.5, 0.5, 0.5)
    reason = prepared.stale_reason()
    assert reason is not None and reason.startswith("step 1 (Normalize) changed (std:")
    with pytest.warns(StaleCacheWarning, match="Normalize"):
        again = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert again is not prepared and again.filled_fraction() == 0.0
    assert all(map(same, seeded(again.dataset, range(8)), seeded(ds, range(8))))


def test_prepare_returns_the_same_filling_cache_and_a_build_completes_it() -> None:
    ds = Counted(transform=cifar_train())
    filling = pt.prepare(ds, "ram", device=CPU, fill="pass")
    seeded(filling.dataset, range(10))
    assert pt.prepare(ds, "ram", device=CPU, fill="pass") is filling  # however far it is filled
    (built, reads) = reads_of(ds, lambda: pt.prepare(ds, "ram", device=CPU))
    # The blocking call stores what is missing into the same memory, reading only those samples.
    assert built.dataset is filling.dataset and built.fill_counts().complete
    assert reads[:10].sum() == 0 and reads[10:].tolist() == [1] * (N - 10)
    assert pt.prepare(ds, "ram", device=CPU, fill="pass") is built


def test_fill_is_checked_and_named() -> None:
    ds = FakeCifar(transform=cifar_train())
    with pytest.raises(ConfigurationError, match=r"fill='lazy' is not a way to fill a cache; use 'build'"):
        pt.prepare(ds, "ram", device=CPU, fill="lazy")
    with pytest.raises(ConfigurationError, match=r"use fill='build' with pretransform='device'"):
        pt.prepare(ds, "device", device=CPU, fill="pass")
    assert pt.prepare(ds, "none", device=CPU, fill="pass").fill_counts().complete


def test_a_dropped_filling_cache_leaves_no_shared_memory(
    no_leaked_children: None, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("AUTOTUNE_NODE_CACHE", "off")  # a cache private to the process: its segments
    before = _shm_entries()
    ds = VaryingTensors(40, v2.Compose([v2.ToDtype(torch.float32, scale=True)]))
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    epoch(prepared.dataset, prepared.collate_fn, seed=0, workers=2, ctx="fork", batch_size=1)
    assert prepared.fill_counts().complete
    mapped = _mapped_segments()
    assert len(mapped) >= 5  # flags, state, buffer, spans, shapes, cursor: this check can fail
    del prepared
    pt.clear_builds()
    gc.collect()
    assert not _ours(_leaked_shm(before), set())
    assert not (mapped & _mapped_segments())  # unmapped too: their memory is back


def _mapped_segments() -> set[str]:
    """The torch shared-memory segments this process maps (unlinked ones show as '(deleted)')."""
    with open(f"/proc/{os.getpid()}/maps") as maps:
        return {line.split()[-2] for line in maps if "/torch_" in line}


def test_a_deep_copy_reads_the_cache_and_stores_nothing_ragged() -> None:
    import copy

    ds = VaryingTensors(20, v2.Compose([v2.ToDtype(torch.float32, scale=True)]))
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    seeded(prepared.dataset, range(10))
    clone = copy.deepcopy(prepared.dataset)  # the lock cannot be copied: the copy stores nothing
    assert all(map(same, seeded(clone, range(20)), seeded(ds, range(20))))
    assert int(np.count_nonzero(clone.filler.flags.numpy() == 1)) == 10


def _minor_faults() -> int:
    with open("/proc/self/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[7])  # minflt, field 10 of proc(5)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="madvise populate is Linux's")
def test_a_populated_buffer_is_written_without_a_fault_a_page_and_keeps_its_bytes() -> None:
    # NOTE [ Populating a cache's pages ]: the pages are mapped ahead in one call, so the writes
    # that follow fault (nearly) none of them, and populating changes no byte.
    numel = 32 << 20
    flat = shared_empty(numel, torch.uint8)
    if not populate(flat):
        pytest.skip("this kernel has no MADV_POPULATE_WRITE (Linux 5.14+)")
    assert not bool(flat.any())
    before = _minor_faults()
    flat.numpy()[:] = 7
    assert _minor_faults() - before < numel // mmap.PAGESIZE // 20
    assert bool((flat == 7).all())
    assert not populate(flat[::2])  # not contiguous: left to fault as it is written
    assert not populate(flat, 10, 10)


def test_a_ragged_column_populates_ahead_of_its_writes_only() -> None:
    col = FilledColumn.empty(4, torch.uint8, 64 << 20, "ragged", torch.Tensor, share=True)
    sample = torch.arange(200, dtype=torch.uint8)
    start = col.reserve(sample.numel())
    col.write(start, sample)
    assert torch.equal(col.flat[start : start + 200], sample)
    if col._populated < col.flat.numel():  # populated: a chunk ahead of the write, not the whole buffer
        assert col._populated == start + POPULATE_AHEAD_BYTES
