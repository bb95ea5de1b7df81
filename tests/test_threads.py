"""Thread workers: every configuration delivers every sample once, errors and stops leave no thread."""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset

from autotune.exceptions import ConfigurationError, WorkerFailed
from autotune.machine import detect_machine
from autotune.measure import CandidateLoader, MeasureLimits, build_loader, measure
from autotune.space import Candidate, build_space
from autotune.threads import THREAD_NAME_PREFIX, ThreadDataLoader

FAST = MeasureLimits(window_s=0.2, min_batches=3, batch_timeout_s=10, trial_timeout_s=30)


def _worker_threads() -> list[str]:
    return [t.name for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


@pytest.fixture
def no_thread_left() -> Any:
    """Fail the test if a thread worker outlives it (a hung one is given its release first)."""
    assert _worker_threads() == [], "a thread worker from an earlier test is still running"
    yield
    deadline = time.monotonic() + 5
    while _worker_threads() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert _worker_threads() == []


class Indexed(Dataset):
    """Sample i is (a tensor holding i, i % 3); ``slow`` maps indices to a delay in seconds."""

    def __init__(self, n: int = 37, slow: dict[int, float] | None = None) -> None:
        self.n, self.slow = n, slow or {}

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        if i >= self.n:
            raise IndexError(i)
        if i in self.slow:
            time.sleep(self.slow[i])
        return torch.full((4,), float(i)), i % 3


class FailsInThreads(Indexed):
    """Sample 5 raises, but only when a thread worker loads it."""

    def __getitem__(self, i: int) -> Any:
        if i == 5 and threading.current_thread().name.startswith(THREAD_NAME_PREFIX):
            raise ValueError("sample 5 is corrupt")
        return super().__getitem__(i)


class HangsInThreads(Indexed):
    """A thread worker that loads sample 3 waits until ``release`` is set (at most a minute)."""

    def __init__(self) -> None:
        super().__init__(64)
        self.release = threading.Event()

    def __getitem__(self, i: int) -> Any:
        if i == 3 and threading.current_thread().name.startswith(THREAD_NAME_PREFIX):
            self.release.wait(60)
        return super().__getitem__(i)


def _indices(batch: Any) -> list[int]:
    return [int(v) for v in batch[0][:, 0].tolist()]


# ------------------------------------------------------------------------ every configuration

_SPACE = build_space(detect_machine(), batch_size=[1, 3, 8], dataset_len=37, cuda=False,
                     pretransforms=("none", "ram"), max_workers=0, thread_workers=True,
                     in_order_choices=(True, False))
_THREADED = [c for c in _SPACE.grid() if c.threaded]


def test_the_space_produces_thread_configurations_of_every_kind() -> None:
    assert {c.num_workers for c in _THREADED} == set(range(1, _SPACE.max_threads + 1))
    assert {c.in_order for c in _THREADED} == {True, False}
    assert {c.pretransform for c in _THREADED} == {"none", "ram"}
    assert not any(c.persistent_workers for c in _THREADED)


def test_every_thread_configuration_delivers_every_sample_once_per_epoch(no_thread_left: None) -> None:
    data = Indexed()
    for c in _THREADED:
        loader = build_loader(data, c, shuffle=True, seed=1)
        assert isinstance(loader, ThreadDataLoader) and loader.num_workers == 0
        assert loader.worker_threads == c.num_workers and loader.in_order == c.in_order
        for _ in range(2):
            seen = [i for batch in loader for i in _indices(batch)]
            assert sorted(seen) == list(range(len(data))), c.label()
        assert _worker_threads() == [], c.label()  # each epoch's threads end with it


def test_in_order_keeps_the_sampler_order_and_out_of_order_lets_a_straggler_fall_behind(
    no_thread_left: None,
) -> None:
    data = Indexed(32, slow={0: 0.5})
    ordered = ThreadDataLoader(data, batch_size=4, worker_threads=2, prefetch_per_thread=2)
    assert [i for b in ordered for i in _indices(b)] == list(range(32))
    unordered = ThreadDataLoader(data, batch_size=4, worker_threads=2, prefetch_per_thread=2,
                                 in_order=False)
    batches = [_indices(b) for b in unordered]
    # The batch holding the slow sample comes after batches that were sent to the threads later.
    assert batches[0] != [0, 1, 2, 3]
    assert sorted(i for b in batches for i in b) == list(range(32))


def test_the_loaders_collate_fn_and_getitems_are_used(no_thread_left: None) -> None:
    class Batched(Indexed):
        calls = 0

        def __getitems__(self, indices: list[int]) -> list[Any]:
            Batched.calls += 1
            return [self[i] for i in indices]

    def as_dict(samples: list[Any]) -> dict[str, Any]:
        return {"x": torch.stack([x for x, _ in samples]), "n": len(samples)}

    loader = ThreadDataLoader(Batched(), batch_size=8, collate_fn=as_dict, worker_threads=2)
    batches = list(loader)
    assert [b["n"] for b in batches] == [8, 8, 8, 8, 5]
    assert Batched.calls == 5


# ------------------------------------------------------------------------ errors and stops


def test_an_error_in_a_thread_is_raised_in_the_caller_with_the_threads_traceback(
    no_thread_left: None,
) -> None:
    loader = ThreadDataLoader(FailsInThreads(), batch_size=4, worker_threads=3)
    with pytest.raises(ValueError, match=r"(?s)Caught ValueError in DataLoader thread worker \d.*"
                                         r"Traceback.*sample 5 is corrupt") as info:
        list(loader)
    assert "__getitem__" in str(info.value)  # the thread's own frames, not the caller's
    assert _worker_threads() == []


def test_a_thread_that_raises_fails_its_candidate_with_the_reason(no_thread_left: None) -> None:
    c = Candidate(4, 2, False, 2, False, worker_kind="thread")
    # The dataset's own error, as from worker processes: the search records it as the reason.
    with pytest.raises(ValueError, match="sample 5 is corrupt"):
        measure(FailsInThreads(), c, limits=FAST, shuffle=False)
    assert _worker_threads() == []


@pytest.mark.parametrize("how", ["exhausted", "closed", "collected", "break"])
def test_no_thread_outlives_its_iterator(how: str, no_thread_left: None) -> None:
    loader = ThreadDataLoader(Indexed(64), batch_size=2, worker_threads=4, prefetch_per_thread=1)
    it = iter(loader)
    next(it)
    assert len(_worker_threads()) == 4
    if how == "exhausted":
        list(it)
    elif how == "closed":
        it.close()
    elif how == "collected":
        del it
        gc.collect()
    else:
        for _ in loader:
            break
        del it
    deadline = time.monotonic() + 3
    while _worker_threads() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert _worker_threads() == []


def test_ctrl_c_while_waiting_for_a_batch_stops_every_thread(no_thread_left: None, ctrl_c: None) -> None:
    main = threading.main_thread().ident
    assert main is not None
    loader = ThreadDataLoader(Indexed(64, slow={i: 0.2 for i in range(64)}), batch_size=4,
                              worker_threads=2)
    timer = threading.Timer(0.5, lambda: signal.pthread_kill(main, signal.SIGINT))
    timer.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            for _ in loader:
                pass
    finally:
        timer.cancel()
    assert _worker_threads() == []


def test_a_hung_thread_times_out_the_batch_and_is_left_only_until_it_returns(
    no_thread_left: None, caplog: pytest.LogCaptureFixture
) -> None:
    data = HangsInThreads()
    loader = ThreadDataLoader(data, batch_size=4, worker_threads=2, timeout=0.5)
    t0 = time.monotonic()
    try:
        with caplog.at_level(logging.WARNING, logger="autotune.threads"), pytest.raises(
                RuntimeError, match=r"DataLoader timed out after 0.5 seconds"):
            list(loader)
        assert time.monotonic() - t0 < 10
        # A thread cannot be killed: the one inside the dataset is left, as a daemon, and said so.
        left = [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]
        assert len(left) == 1 and left[0].daemon
        assert "still inside the dataset" in caplog.text
    finally:
        data.release.set()  # its call returns; it takes no new work and ends (no_thread_left)


# ------------------------------------------------------------------------------ the loader


def test_thread_loader_arguments_are_checked_with_the_fix() -> None:
    class Stream(IterableDataset):
        def __iter__(self) -> Any:
            yield from range(3)

    with pytest.raises(ConfigurationError, match=r"needs a map-style dataset.*IterableDataset"):
        ThreadDataLoader(Stream())
    with pytest.raises(ConfigurationError, match=r"num_workers=2: .*worker_threads="):
        ThreadDataLoader(Indexed(), num_workers=2)
    with pytest.raises(ConfigurationError, match=r"prefetch_factor=4 does not apply.*prefetch_per_thread"):
        ThreadDataLoader(Indexed(), prefetch_factor=4)
    with pytest.raises(ConfigurationError, match=r"worker_threads=0 must be a positive integer"):
        ThreadDataLoader(Indexed(), worker_threads=0)


def test_the_builder_makes_the_loader_the_candidate_describes() -> None:
    threaded = Candidate(8, 3, False, 4, False, worker_kind="thread", in_order=False)
    loader = build_loader(Indexed(), threaded, drop_last=True)
    assert isinstance(loader, ThreadDataLoader) and loader.drop_last
    assert (loader.worker_threads, loader.prefetch_per_thread, loader.in_order) == (3, 4, False)
    with pytest.raises(ConfigurationError, match=r"num_workers=2 cannot be combined with the tuned thread"):
        build_loader(Indexed(), threaded, num_workers=2)
    process = build_loader(Indexed(), Candidate(8, 2, False, 2, True, in_order=False))
    # torch's own loader, only without its too-many-workers advice (the search measures that)
    assert type(process) is CandidateLoader and process.num_workers == 2 and not process.in_order


# ------------------------------------------------------------ data that must stay in-process


class CudaStandIn(Indexed):
    """A CPU stand-in for a dataset holding CUDA tensors: worker processes fail on it exactly as they
    fail to share CUDA storage, threads (in the main process) load it."""

    def __getitem__(self, i: int) -> Any:
        from torch.utils.data import get_worker_info

        if get_worker_info() is not None:
            raise RuntimeError("_share_filename_: only available on CPU")
        return super().__getitem__(i)


def test_a_cuda_holding_dataset_gets_thread_workers(no_thread_left: None, no_leaked_children: None) -> None:
    data = CudaStandIn(256)
    with pytest.raises(WorkerFailed, match="_share_filename_"):
        measure(data, Candidate(8, 2, False, 2, False), limits=FAST)
    m = measure(data, Candidate(8, 2, False, 2, False, worker_kind="thread"), limits=FAST)
    assert m.batches >= FAST.min_batches
    # The space the caller builds for such data: no worker processes, thread workers searched.
    space = build_space(detect_machine(), batch_size=8, dataset_len=256, cuda=False, max_workers=0,
                        thread_workers=True)
    assert space.max_workers == 0 and space.max_threads > 0
    assert any(c.threaded for c in space.grid())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_dataset_of_real_cuda_tensors_loads_through_threads_with_pinning(no_thread_left: None) -> None:
    from torch.utils.data import TensorDataset

    data = TensorDataset(torch.arange(64, device="cuda").float().view(-1, 1))
    with pytest.raises(RuntimeError, match="_share_filename_|CUDA"):
        list(DataLoader(data, batch_size=8, num_workers=2))
    loader = ThreadDataLoader(data, batch_size=8, worker_threads=2, in_order=False)
    got = sorted(int(v) for (b,) in loader for v in b.view(-1).tolist())
    assert got == list(range(64))
    pinned = ThreadDataLoader(Indexed(16), batch_size=8, worker_threads=2, pin_memory=True)
    assert all(b[0].is_pinned() for b in pinned)


def test_a_pool_stopped_from_one_of_its_own_threads_stops_cleanly(no_thread_left: None) -> None:
    # The iterator's finaliser runs wherever the garbage collector runs, one of the pool's own threads
    # included: stopping must not try to join the thread it runs in.
    from autotune.threads import _Pool

    errors: list[BaseException] = []
    holder: list[_Pool] = []

    def fetch(index: int) -> int:
        if index == 1:
            try:
                holder[0].stop()
            except BaseException as err:  # noqa: BLE001 - recorded for the assertion below
                errors.append(err)
        return index

    pool = _Pool(fetch, None, threads=3)
    holder.append(pool)
    for seq in range(3):
        pool.tasks.put((seq, seq))
    deadline = time.monotonic() + 5
    while pool.alive() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert errors == [] and not pool.alive()


def test_a_dataset_that_exits_in_a_thread_does_not_end_the_callers_program(no_thread_left: None) -> None:
    class Exits(Indexed):
        def __getitem__(self, i: int) -> Any:
            if i == 2:
                raise SystemExit(3)
            return super().__getitem__(i)

    with pytest.raises(RuntimeError, match=r"thread worker \d ended with SystemExit"):
        list(ThreadDataLoader(Exits(), batch_size=2, worker_threads=2))


def test_thread_workers_that_vanish_fail_the_candidate() -> None:
    from autotune.measure import map_loader_error

    mapped = map_loader_error(RuntimeError("DataLoader thread workers exited unexpectedly with batches"
                                           " still to load"))
    assert isinstance(mapped, WorkerFailed) and "thread workers exited" in str(mapped)


@pytest.mark.parametrize("kind", ["threads", "processes"])
def test_an_iterator_whose_sampler_ran_out_resumes_when_it_has_more(kind: str) -> None:
    # A stretch that continues on the same inner loader (NOTE [ Continuing a stretch ]): its sampler
    # stops at a limit, the iterator serves what it sent, and once the limit is raised the workers
    # get work again and serve the rest in order.
    from autotune.feed import Feed, FeedSampler
    from autotune.supervise import resume_sampling, stop_iterator

    sampler = FeedSampler(Feed(iter([[i, i + 1] for i in range(0, 20, 2)]), 10), limit=3)
    ds = torch.arange(20)
    if kind == "threads":
        loader: Any = ThreadDataLoader(ds, batch_sampler=sampler, worker_threads=2)
    else:
        loader = DataLoader(ds, batch_sampler=sampler, num_workers=2)
    it = iter(loader)
    try:
        got = [next(it).tolist() for _ in range(3)]
        sampler.limit = 10
        resume_sampling(it)
        got += [next(it).tolist() for _ in range(7)]
    finally:
        stop_iterator(it)
    assert got == [[i, i + 1] for i in range(0, 20, 2)]
