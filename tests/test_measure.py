"""One candidate, measured for real: figures, guards, clean shut-down."""

from __future__ import annotations

import dataclasses
import os
import subprocess
import sys
import threading
import time
import warnings
import weakref

import pytest
import torch
from torch.utils.data import Dataset, get_worker_info

from autotune.exceptions import MemoryLimitExceeded, TrialTimeout, WorkerFailed
from autotune.measure import (
    MIN_BLOCKS,
    MeasureLimits,
    batch_length,
    build_loader,
    measure,
    to_device,
)
from autotune.space import Candidate
from autotune.supervise import process_memory
from autotune.threads import THREAD_NAME_PREFIX

FAST = MeasureLimits(window_s=0.2, min_batches=3, batch_timeout_s=10, trial_timeout_s=30)


class Sleepy(Dataset):
    """Each sample waits like a read from remote storage."""

    def __init__(self, n: int = 512, delay_s: float = 0.002) -> None:
        self.n, self.delay_s = n, delay_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay_s)
        return torch.full((4,), float(i)), i % 3


class HangsInWorkers(Sleepy):
    def __getitem__(self, i: int):
        if get_worker_info() is not None and i % 7 == 3:
            time.sleep(3600)
        return super().__getitem__(i)


class ExitsInWorkers(Sleepy):
    def __getitem__(self, i: int):
        if get_worker_info() is not None:
            import os

            os._exit(3)
        return super().__getitem__(i)


class Hog(Sleepy):
    """Allocates and keeps 8 MiB per sample in whichever process loads it."""

    def __init__(self) -> None:
        super().__init__(n=10_000, delay_s=0.0)
        self.kept: list[torch.Tensor] = []

    def __getitem__(self, i: int):
        self.kept.append(torch.ones(2**21))
        return super().__getitem__(i)


@pytest.mark.parametrize("workers", [0, 2])
def test_measurement_reports_the_window(workers: int, no_leaked_children) -> None:
    c = Candidate(16, workers, False, 2 if workers else None, bool(workers))
    # Enough batches for the blocks the spread is read from, however slowly a busy machine serves.
    limits = dataclasses.replace(FAST, min_batches=MIN_BLOCKS * max(2, workers))
    m = measure(Sleepy(), c, limits=limits)
    assert m.batches >= limits.min_batches
    # What the loader produced: the batches taken, give or take the change in its queue (at most
    # workers x prefetch batches; NOTE [ Queue-corrected windows ]).
    assert m.samples == pytest.approx(m.batches * 16, abs=16 * (1 + workers * 2))
    assert m.samples_per_s == pytest.approx(m.samples / m.window_s)
    assert 0.0 <= m.busy <= 1.0 and 0.0 <= m.wait_fraction <= 1.0
    # Without a step the consumer only waits: nearly all the window is waiting.
    assert m.wait_fraction > 0.5
    assert m.startup_s > 0 and m.peak_memory_bytes > 0
    # The window's own batches say how well its rate is known (NOTE [ Evidence from batches ]).
    assert m.log_se is not None and 0.0 < m.log_se < 0.5


def test_busy_counts_the_step() -> None:
    def step(batch):
        time.sleep(0.01)

    m = measure(Sleepy(delay_s=0.0), Candidate(8), step=step, limits=FAST)
    # The step sleeps at least 10 ms per batch, so the window's busy share holds at least that much.
    assert m.step_ms >= 9.0
    assert m.busy >= 0.9 * 0.01 * m.batches / m.window_s
    assert m.busy + m.wait_fraction <= 1.0 + 1e-6


def test_the_users_step_error_propagates_unchanged(no_leaked_children) -> None:
    class Boom(Exception):
        pass

    def step(batch):
        raise Boom("bad step")

    with pytest.raises(Boom, match="bad step"):
        measure(Sleepy(), Candidate(8, 2, False, 2, False), step=step, limits=FAST)


def test_a_hanging_worker_is_a_timeout_and_leaves_no_process(no_leaked_children) -> None:
    limits = MeasureLimits(window_s=0.5, min_batches=3, batch_timeout_s=1.5, trial_timeout_s=20)
    t0 = time.monotonic()
    with pytest.raises(TrialTimeout):
        measure(HangsInWorkers(), Candidate(4, 2, False, 2, False), limits=limits)
    assert time.monotonic() - t0 < 15


def test_a_worker_that_exits_fails_the_candidate(no_leaked_children) -> None:
    with pytest.raises(WorkerFailed, match="DataLoader worker"):
        measure(ExitsInWorkers(), Candidate(4, 2, False, 2, False), limits=FAST)


def test_the_memory_guard_stops_a_growing_process(no_leaked_children) -> None:
    limit = process_memory() + 200 * 2**20
    limits = MeasureLimits(window_s=30, min_batches=3, max_batches=10_000, memory_limit_bytes=limit)
    with pytest.raises(MemoryLimitExceeded, match="over the memory budget"):
        measure(Hog(), Candidate(4), limits=limits)


def test_alike_workers_are_counted_from_one_read(no_leaked_children) -> None:
    # A loader's workers are alike: the figure read from two of them and counted for each stays
    # within what reading every one gives (each worker's pages are its own and the ones it shares).
    with warnings.catch_warnings():  # torch's warning about more workers than CPUs
        warnings.simplefilter("ignore")
        it = iter(torch.utils.data.DataLoader(Sleepy(64, delay_s=0.0), batch_size=4, num_workers=3))
    next(it)
    pids = {int(w.pid) for w in it._workers}
    every, alike = process_memory(children=pids), process_memory(children=pids, alike=True)
    del it
    mine = process_memory(children=set())
    assert mine < alike and 0.8 * (every - mine) < alike - mine < 1.25 * (every - mine)


def test_torch_threads_are_restored() -> None:
    before = torch.get_num_threads()
    seen = []
    measure(Sleepy(delay_s=0), Candidate(8, torch_threads=1), step=lambda b: seen.append(
        torch.get_num_threads()), limits=FAST)
    assert set(seen) == {1}
    assert torch.get_num_threads() == before


def test_batches_move_to_the_device_whatever_their_structure() -> None:
    batch = {"x": torch.ones(2, 3), "meta": ["a", "b"], "pair": (torch.zeros(2), 3)}
    moved = to_device(batch, torch.device("cpu"))
    assert moved["meta"] == ["a", "b"] and moved["pair"][1] == 3
    assert batch_length(batch, 99) == 2
    assert batch_length(["a", "b", "c"], 99) == 3


@pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs /dev/shm (Linux)")
def test_segments_of_dead_workers_are_removed_and_live_ones_kept() -> None:
    from autotune.supervise import SHM_DIR, remove_orphan_segments

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    orphan = os.path.join(SHM_DIR, f"torch_{dead.pid}_12345_1")
    mine = os.path.join(SHM_DIR, f"torch_{os.getpid()}_12345_1")
    for path in (orphan, mine):
        with open(path, "wb") as fh:
            fh.write(b"x")
    try:
        # A worker killed between creating a batch's segment and unlinking it leaves it behind.
        assert remove_orphan_segments({dead.pid, os.getpid()}) == [os.path.basename(orphan)]
        assert not os.path.exists(orphan) and os.path.exists(mine)
    finally:
        for path in (orphan, mine):
            if os.path.exists(path):
                os.unlink(path)


def test_the_time_limit_holds_while_the_step_runs_python(no_leaked_children) -> None:
    # The watchdog needs the GIL back after every file it reads; a step that runs Python holds it
    # (NOTE [ A watchdog beside a busy step ]). A 6 s step is cut short soon after the 0.5 s limit.
    def step(batch) -> None:
        end = time.monotonic() + 6.0
        while time.monotonic() < end:
            pass

    limits = MeasureLimits(window_s=30, min_batches=3, max_batches=10_000, trial_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(TrialTimeout, match="time limit"):
        measure(Sleepy(delay_s=0), Candidate(8, 2, False, 2, False), step=step, limits=limits)
    assert time.monotonic() - t0 < 3.0


# Code that runs under the file name of the standard library's socket module: to the measurement it looks
# like the main process receiving a batch's file descriptor from a worker.
_HANDOVER_SOURCE = """
def handover(seconds, log):
    import time
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass
    log.append("done")
"""


def test_the_watchdog_waits_for_a_descriptor_handover_to_finish(no_leaked_children) -> None:
    import signal
    import socket

    namespace: dict = {}
    exec(compile(_HANDOVER_SOURCE, socket.__file__, "exec"), namespace)
    log: list[str] = []
    child_handler = signal.getsignal(signal.SIGCHLD)

    def step(batch) -> None:
        namespace["handover"](3.0, log)  # the trial's time limit passes early in it

    limits = MeasureLimits(window_s=30, min_batches=3, max_batches=10_000, trial_timeout_s=0.5)
    t0 = time.monotonic()
    with pytest.raises(TrialTimeout, match="time limit"):
        measure(Sleepy(delay_s=0), Candidate(8), step=step, limits=limits)
    # Interrupted only once the hand-over was over, and promptly then.
    assert log == ["done"]
    assert time.monotonic() - t0 < 15
    assert signal.getsignal(signal.SIGCHLD) is child_handler


def _open_slowly(log: list) -> object:
    import tempfile

    f = tempfile.NamedTemporaryFile()  # noqa: SIM115 - kept open on purpose: the test is about who closes it
    log.append(f.name)
    end = time.monotonic() + 0.2
    while time.monotonic() < end:
        pass
    return f


def test_files_held_by_an_interrupted_step_are_closed_at_once(no_leaked_children) -> None:
    import gc
    import warnings

    opened: list[str] = []

    def step(batch) -> None:
        # Like the DataLoader's open-file probe after a failed read: files kept only by a list that
        # is being built when the trial's time limit passes.
        [_open_slowly(opened) for _ in range(20)]

    limits = MeasureLimits(window_s=30, min_batches=3, max_batches=10_000, trial_timeout_s=0.5)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        with pytest.raises(TrialTimeout):
            measure(Sleepy(delay_s=0), Candidate(8), step=step, limits=limits)
        assert opened and not all(os.path.exists(name) for name in opened)
        gc.collect()
    assert [str(w.message) for w in seen if issubclass(w.category, ResourceWarning)] == []
    assert not any(os.path.exists(name) for name in opened)


# ------------------------------------------------------------------------------ thread workers


class HangsInThreads(Sleepy):
    """A thread worker that loads sample 7 waits until ``release`` is set (at most a minute)."""

    def __init__(self) -> None:
        super().__init__(n=256, delay_s=0.0)
        self.release = threading.Event()

    def __getitem__(self, i: int):
        if i == 7 and threading.current_thread().name.startswith(THREAD_NAME_PREFIX):
            self.release.wait(60)
        return super().__getitem__(i)


@pytest.mark.parametrize("in_order", [True, False])
def test_thread_workers_are_measured_by_the_same_protocol(in_order: bool) -> None:
    c = Candidate(16, 2, False, 2, False, worker_kind="thread", in_order=in_order)
    m = measure(Sleepy(), c, limits=FAST)
    assert m.batches >= FAST.min_batches and m.samples == pytest.approx(m.batches * 16, abs=16)
    assert m.wait_fraction > 0.5 and m.peak_memory_bytes > 0
    assert not [t for t in threading.enumerate() if t.name.startswith(THREAD_NAME_PREFIX)]


def test_a_hung_thread_worker_is_a_timeout_and_the_trial_returns() -> None:
    data = HangsInThreads()
    limits = MeasureLimits(window_s=0.5, min_batches=3, batch_timeout_s=1.0, trial_timeout_s=20)
    t0 = time.monotonic()
    try:
        with pytest.raises(TrialTimeout):
            measure(data, Candidate(4, 2, False, 2, False, worker_kind="thread"), limits=limits,
                    shuffle=False)
        # The batch limit plus the shut-down's wait for the threads, not the hang.
        assert time.monotonic() - t0 < 10
    finally:
        data.release.set()
    deadline = time.monotonic() + 5
    while any(t.name.startswith(THREAD_NAME_PREFIX) for t in threading.enumerate()):
        assert time.monotonic() < deadline, "the released thread worker did not end"
        time.sleep(0.02)


def test_the_memory_guard_stops_thread_workers() -> None:
    limit = process_memory() + 200 * 2**20
    limits = MeasureLimits(window_s=30, min_batches=3, max_batches=10_000, memory_limit_bytes=limit)
    with pytest.raises(MemoryLimitExceeded, match="over the memory budget"):
        measure(Hog(), Candidate(4, 2, False, 2, False, worker_kind="thread"), limits=limits)


# ------------------------------------------------------------------- the one loader builder


def test_a_cache_is_built_once_per_trial(monkeypatch: pytest.MonkeyPatch) -> None:
    from autotune import pretransform as pt

    # A plain list is a map-style dataset that cannot be weakly referenced, so no build is reused.
    samples = [(torch.full((4,), float(i)), i % 3) for i in range(256)]
    with pytest.raises(TypeError):
        weakref.ref(samples)
    real = pt.prepare
    calls: list[str] = []

    def counting(dataset, strategy, **kwargs):
        calls.append(strategy)
        return real(dataset, strategy, **kwargs)

    monkeypatch.setattr(pt, "prepare", counting)
    m = measure(samples, Candidate(8, pretransform="ram"), limits=FAST)
    assert calls == ["ram"] and m.cache_bytes > 0


def test_the_users_collate_fn_gets_samples_under_a_cache() -> None:
    # What the search measures is what make_loader gives: the user's collate_fn with its samples.
    def as_dict(samples):
        assert isinstance(samples, list) and len(samples) == 8
        return {"x": torch.stack([x for x, _ in samples]), "y": torch.tensor([y for _, y in samples])}

    seen: list[str] = []
    m = measure(Sleepy(n=256, delay_s=0.0), Candidate(8, pretransform="ram"), limits=FAST,
                collate_fn=as_dict, step=lambda b: seen.append(type(b).__name__))
    assert m.cache_bytes > 0 and set(seen) == {"dict"}
    threaded = Candidate(8, 2, False, 2, False, "ram", worker_kind="thread")
    for c in (Candidate(8, pretransform="ram"), threaded):
        batch = next(iter(build_loader(Sleepy(n=256, delay_s=0.0), c, collate_fn=as_dict)))
        assert torch.equal(batch["x"][:, 0], torch.arange(8.0))
        assert batch["y"].tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
