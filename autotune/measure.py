"""Run one candidate for real and measure it.

# NOTE [ Measurement protocol ]
# 1. Build a fresh DataLoader from the candidate (the user's objects are never changed). The time from
#    ``iter(loader)`` to the first batch is ``startup_s`` (worker start, cache warm-up).
# 2. Warm-up batches run untimed: enough to drain what the workers prepared while the loader started
#    (num_workers * prefetch_factor batches) plus WARMUP_BATCHES, so the window sees the steady state;
#    at most ``window_s`` of them, since a buffer that drains that slowly means the step is the limit.
# 3. The window: for every batch, the time blocked in ``next()`` is ``wait`` and the time in the step
#    (batch moved to the device, then the user's step) is ``step``. On CUDA the step is timed with CUDA
#    events so the host never serialises the device; on CPU with ``time.perf_counter``. The window runs
#    for at least ``min_batches`` batches and ``window_s`` seconds, at most ``max_batches``; when an
#    epoch ends inside it, a new epoch starts and its start-up counts as waiting, as in training.
# 4. ``samples_per_s`` = samples the loader produced in the window / window wall time (NOTE
#    [ Queue-corrected windows ]); ``busy`` = step time / wall time.
#    The search may prune a candidate inside the window, but only after 2 * min_batches batches and
#    half the window, so a noisy first few batches never decide.
# 5. Guards: a watchdog thread checks the per-batch and whole-trial time limits and the memory of the
#    main process plus all its children (PSS where the OS reports it, so pages the workers share with
#    the main process count once). On a breach it kills the workers and interrupts the main thread; the
#    trial fails with TrialTimeout or MemoryLimitExceeded. In every case the iterator is shut down and
#    every worker is gone (waited for, then killed) before ``measure`` returns or raises.
#
# NOTE [ Queue-corrected windows ]
# A loader with workers holds up to workers x prefetch finished batches ahead of the loop. A window
# that starts with that queue full and ends with it drained counts batches made before it opened, and
# can read several times the rate the loader sustains (16 workers on 2 CPUs, say).
# So a window counts what the loader *produced* in it: the batches the loop took plus the change in
# the batches finished ahead of it (read from the iterator's result queues and its reorder buffer,
# ``supervise.ready_batches``), each worth the window's mean batch. A queue that drained lowers the
# rate, one that filled raises it; a queue held full (the step is the limit) changes nothing. Where
# the queue cannot be read (no workers: nothing is made ahead), the count is the loop's.
#
# NOTE [ Evidence from batches ]
# A window is one number for its rate, but it holds many batches, and their spread says how well
# that number is known: the window's batches are split into up to BLOCKS consecutive blocks of at
# least a round of the workers each (a round arrives as a burst, so a block of a single batch would
# read the burst, not the rate), and the standard error of the window's log-rate is the spread of
# the blocks' log-rates over the square root of their number (``Measurement.log_se``). Two windows
# measured side by side then compare with the evidence of every batch in them (``Ledger.verdict``,
# NOTE [ Decisions ] 3 in decide.py), not only the spread between repeated windows.
"""


from __future__ import annotations

import contextlib
import math
import pickle
import statistics
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate, default_convert

from . import pretransform as pt
from . import shm
from .exceptions import (
    CandidateError,
    CandidateInfeasible,
    ConfigurationError,
    TrialPruned,
    TrialTimeout,
    WorkerFailed,
)
from .machine import SHM_DIR
from .preflight import start_method
from .space import Candidate
from .supervise import (
    Interrupted,
    MeasureLimits,
    Watchdog,
    interruptible,
    ready_batches,
    shut_down,
    start_iterator,
    worker_pids,
)
from .threads import ThreadDataLoader

WARMUP_BATCHES = 2
"""Batches after start-up that are not measured, on top of draining the workers' prefetch (both
drivers: the harness here and the drop-in's stretches)."""

MAX_WARMUP_BATCHES = 64
"""Cap on warm-up, so many workers with a deep prefetch do not eat the trial."""


@dataclass(frozen=True)
class _Window:
    """What the steady-state window of one trial saw (the figures of a Measurement but memory and
    the cache's)."""

    samples_per_s: float
    busy: float
    wait_fraction: float
    step_ms: float
    wait_ms: float
    startup_s: float
    batches: int
    samples: int
    window_s: float


@dataclass(frozen=True)
class Measurement(_Window):
    """What one candidate achieved (see NOTE [ Measurement protocol ])."""

    peak_memory_bytes: int
    build_s: float = 0.0
    cache_bytes: int = 0
    log_se: float | None = None
    """The standard error of ``log(samples_per_s)`` read from the window's own batches (NOTE
    [ Evidence from batches ]); ``None``: too few batches to say."""
    startup_seen: bool = True
    """Whether ``startup_s`` is the start-up a loop waits for when the candidate's loader starts
    (an epoch's start): false where its stretch served on workers already running, or started them
    while another stretch served (NOTE [ Start-ups the loop waits for ] in decide.py)."""

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Measurement:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


ProgressFn = Callable[[int, float], bool]
"""Called during the window with (batches so far, samples/s so far); returning True prunes the trial."""


def to_device(batch: Any, device: torch.device, non_blocking: bool = False) -> Any:
    """Move every tensor in a (nested) batch to ``device``; other values pass through."""
    if isinstance(batch, torch.Tensor):
        if batch.device == device:
            return batch
        return batch.to(device, non_blocking=non_blocking)
    if isinstance(batch, dict):
        return {k: to_device(v, device, non_blocking) for k, v in batch.items()}
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # namedtuple
        return type(batch)(*(to_device(v, device, non_blocking) for v in batch))
    if isinstance(batch, (list, tuple)):
        return type(batch)(to_device(v, device, non_blocking) for v in batch)
    return batch


BLOCKS = 8
"""Blocks a window's batches are split into at most, for its standard error (NOTE [ Evidence from
batches ])."""

MIN_BLOCKS = 3
"""Blocks a window needs at least for a standard error: two would give one degree of freedom."""


def window_log_se(opened: float, arrivals: list[float], counts: list[int], workers: int) -> float | None:
    """The standard error of a window's log-rate from the rates of its blocks (NOTE [ Evidence from
    batches ]): ``opened`` is when the window opened, ``arrivals`` and ``counts`` each batch's time
    and samples after it; a block holds at least a batch per worker, a whole round of them."""
    n = len(arrivals)
    per_block = max(2, workers)
    blocks = min(BLOCKS, n // per_block)
    if blocks < MIN_BLOCKS:
        return None
    logs = []
    start, begin = 0, opened
    for j in range(1, blocks + 1):
        stop = round(j * n / blocks)
        wall = arrivals[stop - 1] - begin
        samples = sum(counts[start:stop])
        if wall <= 0 or samples <= 0:
            return None
        logs.append(math.log(samples / wall))
        start, begin = stop, arrivals[stop - 1]
    return statistics.stdev(logs) / math.sqrt(blocks)


def produced(samples: int, batches: int, ready_at_start: int | None, ready_at_end: int | None) -> int:
    """The samples the loader produced over a window in which the loop took ``samples`` in
    ``batches`` batches, given the batches finished ahead of the loop at its two ends (NOTE
    [ Queue-corrected windows ]); ``samples`` where either end is not known, or where the queue
    changed by as many batches as the window holds (too short a window to read a rate from)."""
    if ready_at_start is None or ready_at_end is None or batches <= 0:
        return samples
    change = ready_at_end - ready_at_start
    if abs(change) >= batches:
        return samples  # a window shorter than its queue's swing says nothing of the rate either way
    return round(samples + change * samples / batches)


def batch_length(batch: Any, default: int) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        try:
            return int(batch.size(0)) if batch.dim() else default
        except RuntimeError:  # a tensor whose sizes cannot be read this way (a nested one, say)
            return default
    if isinstance(batch, dict):
        for v in batch.values():
            return batch_length(v, default)
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (torch.Tensor, dict, list, tuple)):
            return batch_length(first, default)
        return len(batch)
    return default


@contextlib.contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """Set the main process's intra-op thread count for the block; always restored."""
    old = torch.get_num_threads()
    if n is not None and n != old:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        if torch.get_num_threads() != old:
            torch.set_num_threads(old)


class ThreadCounts:
    """The main process's torch thread count as holders set it (see NOTE [ Thread count ]).

    # NOTE [ Thread count ]
    # Each drop-in loader that applies a tuned torch thread count holds it until it is closed or
    # collected. Holders form a stack keyed by owner: the count in force is the newest holder's, and
    # when the last one lets go the count from before the first is put back, whatever the order in
    # which they let go (two loaders closed in creation order end where they started).
    """

    def __init__(self) -> None:
        self._held: dict[int, int] = {}
        self._before: int | None = None

    def hold(self, owner: int, n: int) -> None:
        if not self._held:
            self._before = torch.get_num_threads()
        self._held.pop(owner, None)
        self._held[owner] = n
        self._apply()

    def release(self, owner: int) -> None:
        if self._held.pop(owner, None) is None:
            return
        if self._held:
            self._apply()
        elif self._before is not None:
            if torch.get_num_threads() != self._before:
                torch.set_num_threads(self._before)
            self._before = None

    def _apply(self) -> None:
        n = next(reversed(self._held.values()))
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)


THREAD_COUNTS = ThreadCounts()


def build_loader(
    dataset: Any,
    candidate: Candidate,
    *,
    device: torch.device | str = "cpu",
    shuffle: bool = False,
    collate_fn: Callable[[Any], Any] | None = None,
    seed: int | None = None,
    batch_timeout_s: float = 0.0,
    prepared: pt.Prepared | None = None,
    **overrides: Any,
) -> DataLoader[Any]:
    """The DataLoader for ``candidate`` over ``dataset``: the one builder behind the search and
    ``TuneResult.make_loader``, so what is measured is what the user gets.

    A ``torch.utils.data.DataLoader`` for worker processes (or none), a
    :class:`~autotune.threads.ThreadDataLoader` for thread workers. The pre-transform is applied
    (``prepared``, when the caller built it already, else built or reused here), and the user's
    ``collate_fn`` receives the samples it would receive without it. ``seed`` fixes the shuffling
    order; ``batch_timeout_s`` > 0 bounds the wait for a batch from workers. ``overrides`` are
    DataLoader arguments that win over the candidate's (``drop_last=True``, ``num_workers=0``, ...).
    """
    device = torch.device(device)
    if prepared is None:
        prepared = pt.prepare(dataset, candidate.pretransform, device=device)
    data, collate = prepared.loader_parts(collate_fn)
    kwargs: dict[str, Any] = candidate.loader_kwargs()
    if collate is not None:
        kwargs["collate_fn"] = collate
    if isinstance(data, IterableDataset):
        # Left unspecified: torch's constructor would otherwise apply it to the user's datapipe,
        # switching its own Shuffler off for good; the user's loader already applied theirs.
        shuffle = False
        kwargs["shuffle"] = None
    else:
        kwargs["shuffle"] = shuffle
    if candidate.num_workers > 0 and batch_timeout_s > 0:
        kwargs["timeout"] = batch_timeout_s
    if seed is not None and shuffle:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    if "batch_sampler" in overrides:  # it decides the batches: DataLoader refuses both
        kwargs.pop("batch_size")
        kwargs.pop("shuffle")
    kwargs.update(overrides)
    if kwargs.get("pin_memory") and not torch.accelerator.is_available():
        # torch would not pin either; without the flag the stretch skips torch's warning, which the
        # drop-in gives once per epoch as torch does (DataLoader._get_iterator)
        kwargs["pin_memory"] = False
    workers = kwargs.get("num_workers", 0)
    if candidate.threaded:
        if workers:
            raise ConfigurationError(
                f"num_workers={workers} cannot be combined with the tuned thread workers"
                f" ({candidate.label()}); change their number with worker_threads=, or build a"
                " plain torch DataLoader with the worker processes you want."
            )
        return ThreadDataLoader(data, **kwargs)
    private = prepared.strategy == "ram" and not prepared.shared and workers
    if private and not prepared.fill_counts().complete:
        raise CandidateInfeasible(
            f"the pretransform='ram' cache fills in private memory ({SHM_DIR} could not hold it):"
            " worker processes would each fill a copy of their own; use thread workers or num_workers=0"
        )
    if private and start_method(kwargs.get("multiprocessing_context")) != "fork":
        raise CandidateInfeasible(
            f"the pretransform='ram' cache is in private memory ({SHM_DIR} could not hold it), which"
            f" worker processes started by {start_method(kwargs.get('multiprocessing_context'))!r}"
            " would each receive copied through /dev/shm; use fork, thread workers or num_workers=0"
        )
    if candidate.pretransform == "device" and workers:
        raise ConfigurationError(
            f"num_workers={workers} cannot be used with pretransform='device': worker processes"
            " cannot share CUDA tensors; keep num_workers=0."
        )
    if not workers:
        kwargs.pop("prefetch_factor", None)
        kwargs.pop("persistent_workers", None)
    else:  # a batch that /dev/shm cannot hold fails in the worker, not lost in its queue
        kwargs["collate_fn"] = shm.SharedInWorker(
            _torch_collate(kwargs) if kwargs.get("collate_fn") is None else kwargs["collate_fn"])
    return CandidateLoader(data, **kwargs)


class CandidateLoader(DataLoader[Any]):
    """torch's DataLoader without its too-many-workers advice: the search decides the worker count
    by measuring, and the user was given torch's warning for their own settings already.

    Overriding the check, not filtering the warning, matters: ``warnings.catch_warnings`` resets
    Python's shown-once registry, so every stretch built in one would show the user's once-only
    warnings (``pin_memory`` without CUDA, say) again.
    """

    def check_worker_number_rationality(self) -> None:
        pass


@contextlib.contextmanager
def quiet_pickle_warning(loader: Any) -> Iterator[None]:
    """Silence torch's pickling warning while ``loader``'s workers start: a candidate that cannot be
    sent to them fails with that reason and its fix. Only where workers are spawned (the warning
    comes from nowhere else), since entering ``catch_warnings`` re-arms every shown-once warning;
    ``None`` (the user's own settings) keeps the warning for the user."""
    spawned = (loader is not None and bool(getattr(loader, "num_workers", 0))
               and start_method(getattr(loader, "multiprocessing_context", None)) != "fork")
    if not spawned:
        yield
        return
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Got pickle error when attempting to start a worker")
        yield


def _torch_collate(kwargs: dict[str, Any]) -> Callable[[Any], Any]:
    """The collate function torch uses when none is given: batches of samples (``batch_size`` or a
    batch sampler) are collated, single samples only converted."""
    batched = kwargs.get("batch_sampler") is not None or kwargs.get("batch_size", 1) is not None
    return default_collate if batched else default_convert


def _start(loader: Any, candidate: Candidate) -> Any:
    """``iter(loader)``; a dataset that cannot be sent to spawned workers fails the candidate."""
    try:
        with quiet_pickle_warning(loader):
            return start_iterator(loader)
    except (TypeError, AttributeError, pickle.PicklingError) as err:
        if candidate.num_workers == 0 or candidate.threaded or "pickle" not in str(err).lower():
            raise
        raise WorkerFailed(
            f"the dataset or collate_fn could not be sent to the worker processes, which receive them"
            f" pickled under this start method: {type(err).__name__}: {err}; make them picklable,"
            " or use num_workers=0"
        ) from err


def _shm_death(death: WorkerFailed | None) -> WorkerFailed | None:
    """A worker's death, named as running out of /dev/shm where it was a bus error (NOTE [ Shared
    memory ] 3 in shm.py)."""
    if death is not None and shm.exhausted(death):
        return WorkerFailed(shm.failure_reason(death, "a worker process"))
    return death


def _release_frames(err: BaseException) -> None:
    """Let go of what the finished frames under a trial's failure hold, now rather than at collection.

    A failure raised out of :func:`measure` sits in a reference cycle (its traceback holds this frame,
    whose locals hold the failure), so the frames below stay alive until the cycle collector runs,
    and with them whatever they held: after a failed read the DataLoader opens
    temporary files to probe the open-file limit, and an exception there leaves the ones already open
    to the collector, which may finalise a file before the wrapper that closes it, with a
    ResourceWarning. Clearing those frames releases such objects at once, in order. The frames of the
    user's own errors are left as they are.
    """
    traceback.clear_frames(err.__traceback__)


def map_loader_error(err: BaseException) -> CandidateError | None:
    """Failures that belong to the candidate's workers (processes or threads), not to the user's code.

    Running out of /dev/shm is the candidate's, wherever it happened (NOTE [ Shared memory ] in
    shm.py); the empty segment torch leaves behind then is removed here, where both drivers see it.
    """
    if isinstance(err, CandidateError):
        return err
    text = str(err)
    if isinstance(err, RuntimeError) and shm.exhausted(err):
        shm.discard_failed_segment(err)
        if "DataLoader worker" in text:
            return WorkerFailed(shm.failure_reason(err, "a worker process"))
        return CandidateInfeasible(shm.failure_reason(err, "the main process"))
    if isinstance(err, RuntimeError):
        if "DataLoader timed out" in text:
            return TrialTimeout(f"a worker produced no batch in time ({text})")
        if ("DataLoader worker" in text or "DataLoader thread workers" in text) and (
                "exited unexpectedly" in text or "killed by" in text):
            return WorkerFailed(text.strip().splitlines()[0])
        if "_share_filename_" in text or "only available on CPU" in text:
            return WorkerFailed(
                "workers cannot share CUDA tensors (_share_filename_: only available on CPU);"
                " use num_workers=0 or thread workers for data that lives on the GPU"
            )
    return None


class _Epochs:
    """The trial's loader and its current iterator: a new one (a new epoch) when one is exhausted.

    The iterator is kept here, not only in a frame, so the shut-down finds it whatever was raised.
    """

    def __init__(self, loader: Any, candidate: Candidate) -> None:
        self.loader = loader
        self.candidate = candidate
        self.iterator: Any = None

    def start(self) -> Any:
        self.iterator = _start(self.loader, self.candidate)
        return next(self.iterator)

    def next(self) -> Any:
        try:
            return next(self.iterator)
        except StopIteration:
            # A new epoch inside the window: its start-up counts as waiting, as it does in training.
            return self.start()


def measure(
    dataset: Any,
    candidate: Candidate,
    *,
    step: Callable[[Any], Any] | None = None,
    device: torch.device | str = "cpu",
    limits: MeasureLimits | None = None,
    progress: ProgressFn | None = None,
    shuffle: bool = True,
    collate_fn: Callable[[Any], Any] | None = None,
    seed: int | None = 0,
) -> Measurement:
    """Measure ``candidate`` on ``dataset`` for real (see NOTE [ Measurement protocol ]).

    Raises a :class:`CandidateError` subclass when the candidate itself fails (timeout, memory,
    a dead worker, pruned); any other exception comes from the user's dataset or step, unchanged.
    """
    limits = limits or MeasureLimits()
    device = torch.device(device)
    prepared: pt.Prepared | None = None
    epochs: _Epochs | None = None
    loader: Any = None
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_threads(candidate.torch_threads))
        arm = stack.enter_context(interruptible())
        watchdog = Watchdog(limits, arm, lambda: worker_pids(
            *((epochs.iterator, getattr(epochs.loader, "_iterator", None)) if epochs is not None else ())))
        watchdog.start()
        # Runs before the signal handler is restored even if the shut-down below is cut short: a
        # watchdog left running could signal a process that no longer handles the signal.
        stack.callback(watchdog.stop)
        death: WorkerFailed | None = None
        try:
            try:
                # Inside the guard: building a pre-transform cache counts against the trial's limits.
                prepared = pt.prepare(dataset, candidate.pretransform, device=device,
                                      memory_budget_bytes=limits.cache_budget_bytes)
                built = build_loader(
                    dataset, candidate, device=device, shuffle=shuffle, collate_fn=collate_fn,
                    seed=seed, batch_timeout_s=limits.batch_timeout_s, prepared=prepared,
                )
                epochs = _Epochs(built, candidate)
                log_se, window = _run(epochs, step, device, limits, watchdog, progress)
            finally:
                loader = epochs.loader if epochs is not None else None
                iterators = (epochs.iterator if epochs is not None else None,
                             getattr(loader, "_iterator", None))
                death = shut_down(watchdog, arm, iterators, loader)
        except Interrupted as err:
            failure = watchdog.failure or TrialTimeout("the trial was interrupted")
            _release_frames(err)
            raise failure from err
        except CandidateError as err:
            _release_frames(err)
            raise
        except Exception as err:
            # Classified after the shut-down (see NOTE [ Shut-down under signals ]): a dead worker
            # surfaces as whatever broke first (a RuntimeError, a reset connection), so look at them.
            if watchdog.failure is not None:
                _release_frames(err)
                raise watchdog.failure from err
            mapped = _shm_death(death) or map_loader_error(err)
            if mapped is not None:
                _release_frames(err)
                raise mapped from err
            raise
        if watchdog.failure is not None:
            raise watchdog.failure
    assert prepared is not None
    return Measurement(
        **asdict(window),
        peak_memory_bytes=watchdog.peak_memory,
        build_s=prepared.build_s,
        cache_bytes=prepared.nbytes,
        log_se=log_se,
    )


def _run(
    epochs: _Epochs,
    step: Callable[[Any], Any] | None,
    device: torch.device,
    limits: MeasureLimits,
    watchdog: Watchdog,
    progress: ProgressFn | None,
) -> tuple[float | None, _Window]:
    """(the window's log-rate standard error, the window) of one trial."""
    candidate = epochs.candidate
    cuda = device.type == "cuda"
    non_blocking = candidate.pin_memory and cuda

    def consume(batch: Any) -> Any:
        batch = to_device(batch, device, non_blocking)
        return step(batch) if step is not None else None

    t0 = time.perf_counter()
    first = epochs.start()
    startup_s = time.perf_counter() - t0
    watchdog.progress()
    consume(first)
    watchdog.check()
    if cuda:
        torch.cuda.synchronize(device)

    warmup = WARMUP_BATCHES
    if candidate.num_workers > 0:
        warmup += candidate.num_workers * (candidate.prefetch_factor or 2)
    warmup = min(warmup, MAX_WARMUP_BATCHES)

    warm_start = time.perf_counter()
    for _ in range(warmup):
        consume(epochs.next())
        watchdog.check()
        watchdog.progress()
        if time.perf_counter() - warm_start > limits.window_s:
            # Batches prepared during start-up come at once; when draining them takes this long,
            # consumption is already the bottleneck and the steady state has begun.
            break
    if cuda:
        torch.cuda.synchronize(device)

    waits: list[float] = []
    steps: list[float] = []
    arrivals: list[float] = []
    counts: list[int] = []
    samples = 0
    opened_on = epochs.iterator
    ready_at_start = ready_batches(opened_on)
    window_start = time.perf_counter()
    events: list[tuple[Any, Any]] = []
    while True:
        tw = time.perf_counter()
        batch = epochs.next()
        ts = time.perf_counter()
        waits.append(ts - tw)
        arrivals.append(ts)
        counts.append(batch_length(batch, candidate.batch_size))
        samples += counts[-1]
        if cuda:
            start_ev = torch.cuda.Event(enable_timing=True)
            end_ev = torch.cuda.Event(enable_timing=True)
            start_ev.record()
            consume(batch)
            end_ev.record()
            events.append((start_ev, end_ev))
        else:
            consume(batch)
            steps.append(time.perf_counter() - ts)
        watchdog.check()
        watchdog.progress()
        n = len(waits)
        elapsed = time.perf_counter() - window_start
        # Prune only on evidence: two checkpoints' worth of batches and half a window.
        checkpoint = (n >= 2 * limits.min_batches and n % limits.min_batches == 0
                      and elapsed >= limits.window_s / 2)
        if checkpoint and progress is not None and progress(n, samples / max(elapsed, 1e-9)):
            raise TrialPruned(f"pruned after {n} batches at {samples / max(elapsed, 1e-9):.0f} samples/s")
        if n >= limits.max_batches or (n >= limits.min_batches and elapsed >= limits.window_s):
            break
    if cuda:
        torch.cuda.synchronize(device)
        steps = [s.elapsed_time(e) / 1000.0 for s, e in events]
    wall = time.perf_counter() - window_start
    # An epoch that ended inside the window took its queue with it: its count is the loop's.
    ready_at_end = ready_batches(epochs.iterator) if epochs.iterator is opened_on else None
    step_total = sum(steps)
    log_se = window_log_se(window_start, arrivals, counts, candidate.num_workers)
    samples = produced(samples, len(waits), ready_at_start, ready_at_end)
    return log_se, _Window(
        samples_per_s=samples / wall,
        busy=min(1.0, step_total / wall),
        wait_fraction=min(1.0, sum(waits) / wall),
        step_ms=statistics.median(steps) * 1000.0,
        wait_ms=statistics.median(waits) * 1000.0,
        startup_s=startup_s,
        batches=len(waits),
        samples=samples,
        window_s=wall,
    )
