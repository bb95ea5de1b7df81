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
# 4. ``samples_per_s`` = samples in the window / window wall time; ``busy`` = step time / wall time.
#    The search may prune a candidate inside the window, but only after 2 * min_batches batches and
#    half the window, so a noisy first few batches never decide.
# 5. Guards: a watchdog thread checks the per-batch and whole-trial time limits and the memory of the
#    main process plus all its children (PSS where the OS reports it, so pages the workers share with
#    the main process count once). On a breach it kills the workers and interrupts the main thread; the
#    trial fails with TrialTimeout or MemoryLimitExceeded. In every case the iterator is shut down and
#    every worker is gone (waited for, then killed) before ``measure`` returns or raises.
"""

from __future__ import annotations

import contextlib
import glob
import logging
import math
import os
import pickle
import signal
import statistics
import threading
import time
import traceback
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, IterableDataset

from . import pretransform as pt
from .exceptions import CandidateError, MemoryLimitExceeded, TrialPruned, TrialTimeout, WorkerFailed
from .space import Candidate

log = logging.getLogger(__name__)

WARMUP_BATCHES = 2
"""Untimed batches after start-up, on top of draining the workers' initial prefetch."""

MAX_WARMUP_BATCHES = 64
"""Cap on warm-up, so many workers with a deep prefetch do not eat the trial."""

DEFAULT_WINDOW_S = 1.0
"""Steady-state window length: long enough to average scheduler noise, short enough for 30+ trials."""

DEFAULT_BATCH_TIMEOUT_S = 60.0
"""A single batch taking longer than this is a hang, not a slow dataset."""

DEFAULT_TRIAL_TIMEOUT_S = 120.0
"""No single candidate may take longer than this, start-up and shut-down included."""

SHUTDOWN_TIMEOUT_S = 10.0
"""How long worker processes get to exit after their iterator is shut down, before being killed."""

WATCHDOG_POLL_S = 0.05
"""How often the watchdog checks time and memory."""

_INTERRUPT_SIGNAL = getattr(signal, "SIGUSR2", None)
_CHILD_SIGNAL = getattr(signal, "SIGCHLD", None)


@dataclass(frozen=True)
class MeasureLimits:
    """How long and how much one measurement may take."""

    window_s: float = DEFAULT_WINDOW_S
    min_batches: int = 5
    max_batches: int = 100_000
    """A guard only: windows end by time, so a very fast loader still gets a window of window_s."""
    batch_timeout_s: float = DEFAULT_BATCH_TIMEOUT_S
    trial_timeout_s: float = DEFAULT_TRIAL_TIMEOUT_S
    memory_limit_bytes: int | None = None
    """Ceiling on the PSS of this process plus all its children; ``None``: no memory guard."""

    def __post_init__(self) -> None:
        for name in ("window_s", "batch_timeout_s", "trial_timeout_s"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and value > 0 and math.isfinite(value)):
                raise ValueError(f"{name}={value!r} must be a positive number of seconds.")
        if self.min_batches < 1 or self.max_batches < self.min_batches:
            raise ValueError(
                f"min_batches={self.min_batches}, max_batches={self.max_batches}: need"
                " 1 <= min_batches <= max_batches."
            )


@dataclass(frozen=True)
class Measurement:
    """What one candidate achieved (see NOTE [ Measurement protocol ])."""

    samples_per_s: float
    busy: float
    wait_fraction: float
    step_ms: float
    wait_ms: float
    startup_s: float
    batches: int
    samples: int
    window_s: float
    peak_memory_bytes: int
    build_s: float = 0.0
    cache_bytes: int = 0

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


def batch_length(batch: Any, default: int) -> int:
    """Samples in a collated batch: the leading dimension of its first tensor."""
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() else default
    if isinstance(batch, dict):
        for v in batch.values():
            return batch_length(v, default)
    if isinstance(batch, (list, tuple)) and batch:
        first = batch[0]
        if isinstance(first, (torch.Tensor, dict, list, tuple)):
            return batch_length(first, default)
        return len(batch)
    return default


def process_memory(proc: psutil.Process | None = None) -> int:
    """PSS (or RSS where PSS is not reported) of a process and all its children, in bytes."""
    proc = proc or psutil.Process()
    total = 0
    for p in [proc, *proc.children(recursive=True)]:
        try:
            info = p.memory_full_info()
            total += int(getattr(info, "pss", 0) or info.rss)
        except (psutil.NoSuchProcess, psutil.ZombieProcess):
            continue
        except psutil.AccessDenied:
            with contextlib.suppress(psutil.Error):
                total += int(p.memory_info().rss)
    return total


def child_pids() -> set[int]:
    try:
        return {p.pid for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return set()


def reap_new_children(before: set[int], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> list[int]:
    """Wait for children that did not exist in ``before`` to exit; kill those that do not.

    Returns the pids that had to be killed (an empty list is the normal case).
    """
    try:
        procs = [p for p in psutil.Process().children(recursive=True) if p.pid not in before]
    except psutil.Error:
        return []
    if not procs:
        return []
    _, alive = psutil.wait_procs(procs, timeout=timeout_s)
    killed = []
    for p in alive:
        with contextlib.suppress(psutil.Error):
            p.kill()
            killed.append(p.pid)
    if alive:
        psutil.wait_procs(alive, timeout=timeout_s)
        log.warning("killed %d worker process(es) that did not exit: %s", len(killed), killed)
    return killed


class _Watchdog(threading.Thread):
    """Enforces the time and memory limits of one trial from a side thread."""

    def __init__(self, limits: MeasureLimits, before: set[int], arm: _Arm) -> None:
        super().__init__(name="autotune-watchdog", daemon=True)
        self.limits = limits
        self.before = before
        self.arm = arm
        self.main_ident = threading.main_thread().ident
        self.started_at = time.perf_counter()
        self.last_progress = self.started_at
        self.peak_memory = 0
        self.failure: CandidateError | None = None
        self._stop_event = threading.Event()
        self._proc = psutil.Process()

    def progress(self) -> None:
        self.last_progress = time.perf_counter()

    def check(self) -> None:
        """Raise the failure in the main thread, at a point where that is always safe."""
        if self.failure is not None:
            raise self.failure

    def stop(self) -> None:
        self._stop_event.set()
        self.join(timeout=5)

    def run(self) -> None:
        limits = self.limits
        while not self._stop_event.wait(WATCHDOG_POLL_S):
            if self.arm.child_pending:  # a worker's death went unreported (see NOTE [ Interrupting ... ])
                self._signal(_CHILD_SIGNAL)
            now = time.perf_counter()
            try:
                mem = process_memory(self._proc)
            except psutil.Error:
                mem = 0
            self.peak_memory = max(self.peak_memory, mem)
            if limits.memory_limit_bytes is not None and mem > limits.memory_limit_bytes:
                self._fail(
                    MemoryLimitExceeded(
                        f"the main process and its workers used {mem / 2**20:.0f} MiB, over the"
                        f" memory budget of {limits.memory_limit_bytes / 2**20:.0f} MiB"
                    )
                )
            elif now - self.started_at > limits.trial_timeout_s:
                self._fail(
                    TrialTimeout(f"the trial ran past its time limit of {limits.trial_timeout_s:.1f} s")
                )
            elif now - self.last_progress > limits.batch_timeout_s:
                self._fail(
                    TrialTimeout(
                        f"no batch arrived for {limits.batch_timeout_s:.1f} s (batch time limit);"
                        " the dataset or a worker hangs"
                    )
                )
            if self.failure is not None:
                break
        # The main thread ignores the signal in some places (see NOTE [ Interrupting the main thread ]):
        # repeat it until it lands or the trial is being shut down.
        while self.failure is not None and self.arm.armed:
            self._signal(_INTERRUPT_SIGNAL)
            if self._stop_event.wait(WATCHDOG_POLL_S):
                break

    def _fail(self, failure: CandidateError) -> None:
        self.failure = failure
        # Kill the workers first: the main thread may be blocked waiting on them.
        with contextlib.suppress(psutil.Error):
            for p in self._proc.children(recursive=True):
                if p.pid not in self.before:
                    with contextlib.suppress(psutil.Error):
                        p.kill()

    def _signal(self, signum: int | None) -> None:
        """Send ``signum`` to the main thread, unless the trial is already being shut down."""
        if self._stop_event.is_set() or not self.arm.possible:
            return
        if signum is not None and self.main_ident is not None:
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_kill(self.main_ident, signum)


class _Interrupted(BaseException):
    """Raised in the main thread by the watchdog's signal; turned into the watchdog's failure."""


# NOTE [ Interrupting the main thread ]
# The watchdog stops a trial by raising an exception in the main thread from a signal handler, and
# PyTorch's SIGCHLD handler raises one there when a worker dies. Such an exception lands between any
# two bytecodes. Most places are harmless: the trial's loader is thrown away. A few are not: while the
# main thread receives a batch's file descriptor from a worker (multiprocessing's resource sharer, its
# Unix socket, torch's storage rebuild), or while the DataLoader probes the open-file limit with
# temporary files after a failed read, an exception strands a socket, a file or a descriptor that is
# closed, with a ResourceWarning, only whenever the garbage collector gets to it. So during a trial
# both handlers look at where the main thread is and do nothing inside that code. The measuring loop
# raises the watchdog's failure itself after every batch, and the watchdog repeats either signal every
# poll until a handler has run outside that code.


def _unsafe_files() -> frozenset[str]:
    """Files of code an exception must not cut short (see NOTE [ Interrupting the main thread ])."""
    import multiprocessing.reduction
    import multiprocessing.resource_sharer
    import socket
    import tempfile

    import torch.multiprocessing.reductions

    modules = (socket, tempfile, multiprocessing.reduction, multiprocessing.resource_sharer,
               torch.multiprocessing.reductions)
    return frozenset(os.path.abspath(m.__file__) for m in modules if m.__file__)


_UNSAFE_FILES = _unsafe_files()


def _in_unsafe_code(frame: Any) -> bool:
    """Whether ``frame`` or one of its callers runs code an exception must not cut short."""
    depth = 0
    while frame is not None and depth < 64:
        if os.path.abspath(frame.f_code.co_filename) in _UNSAFE_FILES:
            return True
        frame = frame.f_back
        depth += 1
    return False


class _Arm:
    """Whether the watchdog's signal may interrupt the main thread right now."""

    def __init__(self, possible: bool) -> None:
        self.possible = possible
        self.armed = possible
        self.child_pending = False
        """A SIGCHLD arrived inside unsafe code; PyTorch's handler has yet to look at the workers."""


@contextlib.contextmanager
def _interruptible() -> Iterator[_Arm]:
    """Let the watchdog interrupt the main thread, where signals can be handled at all."""
    if _INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield _Arm(False)
        return
    arm = _Arm(True)

    def handler(signum: int, frame: Any) -> None:
        if arm.armed and not _in_unsafe_code(frame):
            arm.armed = False
            raise _Interrupted()

    old = signal.signal(_INTERRUPT_SIGNAL, handler)
    try:
        with _deferred_child_errors(arm):
            yield arm
    finally:
        arm.armed = False
        signal.signal(_INTERRUPT_SIGNAL, old)


@contextlib.contextmanager
def _deferred_child_errors(arm: _Arm) -> Iterator[None]:
    """Wrap PyTorch's SIGCHLD handler so that it never raises in unsafe code (see the NOTE)."""
    from torch.utils.data._utils import signal_handling

    if _CHILD_SIGNAL is None:
        yield
        return
    signal_handling._set_SIGCHLD_handler()  # installed once per process; wrapped here, never replaced
    torch_handler = signal.getsignal(_CHILD_SIGNAL)
    if not callable(torch_handler):
        yield
        return

    def handler(signum: int, frame: Any) -> None:
        if _in_unsafe_code(frame):
            arm.child_pending = True  # the watchdog sends it again
            return
        arm.child_pending = False
        torch_handler(signum, frame)

    signal.signal(_CHILD_SIGNAL, handler)
    try:
        yield
    finally:
        arm.child_pending = False
        signal.signal(_CHILD_SIGNAL, torch_handler)


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


def make_loader(
    dataset: Any,
    candidate: Candidate,
    *,
    device: torch.device,
    shuffle: bool = True,
    collate_fn: Callable[[Any], Any] | None = None,
    seed: int | None = None,
    batch_timeout_s: float = 0.0,
    **overrides: Any,
) -> DataLoader[Any]:
    """A DataLoader for ``candidate`` over ``dataset``, with the pre-transform applied."""
    prepared = pt.prepare(dataset, candidate.pretransform, device=device)
    kwargs: dict[str, Any] = candidate.loader_kwargs()
    if prepared.collate_fn is not None:
        kwargs["collate_fn"] = prepared.collate_fn
    elif collate_fn is not None:
        kwargs["collate_fn"] = collate_fn
    if isinstance(prepared.dataset, IterableDataset):
        shuffle = False
    kwargs["shuffle"] = shuffle
    if candidate.num_workers > 0 and batch_timeout_s > 0:
        kwargs["timeout"] = batch_timeout_s
    if seed is not None and shuffle:
        kwargs["generator"] = torch.Generator().manual_seed(seed)
    kwargs.update(overrides)
    with quiet_worker_warning():
        return DataLoader(prepared.dataset, **kwargs)


@contextlib.contextmanager
def quiet_worker_warning() -> Iterator[None]:
    """Silence PyTorch's too-many-workers warning: the search decides that by measuring."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="This DataLoader will create")
        # Raised as WorkerFailed by ``_start``, with the fix; the generic warning would only repeat it.
        warnings.filterwarnings("ignore", message="Got pickle error when attempting to start a worker")
        yield


def _start(loader: Any, candidate: Candidate) -> Any:
    """``iter(loader)``; a dataset that cannot be sent to spawned workers fails the candidate."""
    try:
        with quiet_worker_warning():
            return iter(loader)
    except (TypeError, AttributeError, pickle.PicklingError) as err:
        if candidate.num_workers == 0 or "pickle" not in str(err).lower():
            raise
        raise WorkerFailed(
            f"the dataset or collate_fn could not be sent to the worker processes, which receive them"
            f" pickled under this start method: {type(err).__name__}: {err}; make them picklable,"
            " or use num_workers=0"
        ) from err


# NOTE [ Shut-down under signals ]
# PyTorch installs a SIGCHLD handler that raises a RuntimeError in the main thread, wherever it is, when
# a worker of a live iterator exits abnormally. A worker that crashes, or that the watchdog kills, can
# therefore raise inside the shut-down itself, and again for every other worker that exits meanwhile.
# So the shut-down first takes the trial's workers off that handler's list, then runs each step to
# completion, retrying one a signal cut short, and errors are classified only afterwards.


def _unregister_workers(iterators: tuple[Any, ...]) -> None:
    """Stop PyTorch's SIGCHLD handler from raising for these iterators' workers (see the NOTE)."""
    from torch.utils.data._utils import signal_handling

    for it in iterators:
        if getattr(it, "_worker_pids_set", False):
            with contextlib.suppress(Exception):
                signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False


SHM_DIR = "/dev/shm"
"""Where POSIX shared memory segments appear as files (Linux)."""


def _worker_pids(iterators: tuple[Any, ...]) -> set[int]:
    pids: set[int] = set()
    for it in iterators:
        for w in getattr(it, "_workers", None) or ():
            with contextlib.suppress(Exception):
                if w.pid is not None:
                    pids.add(int(w.pid))
    return pids


def _remove_orphan_segments(pids: set[int]) -> list[str]:
    """Unlink the shared-memory segments that dead workers created and never got to unlink.

    A worker names a batch's segment ``torch_<pid>_...`` and unlinks it as soon as the main process
    has it; a worker killed in between (by the memory guard, a crash) leaves it in /dev/shm for good.
    Only segments of the given pids, all of which have exited, are touched.
    """
    removed: list[str] = []
    if not pids or not os.path.isdir(SHM_DIR):
        return removed
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                continue  # still running: its segments are in use
        except psutil.Error:
            pass  # gone
        for path in glob.glob(os.path.join(SHM_DIR, f"torch_{pid}_*")):
            with contextlib.suppress(OSError):
                os.unlink(path)
                removed.append(os.path.basename(path))
    if removed:
        log.info("removed %d shared-memory segment(s) left by dead workers", len(removed))
    return removed


def _cleanup(watchdog: _Watchdog, iterator: Any, loader: Any, before: set[int]) -> None:
    steps: tuple[Callable[[], Any], ...] = (
        watchdog.stop,
        lambda: _shutdown(iterator, loader),
        lambda: reap_new_children(before),
    )
    for action in steps:
        for _ in range(3):
            try:
                action()
                break
            except Exception as err:  # noqa: BLE001 - see NOTE [ Shut-down under signals ]
                log.debug("shut-down step interrupted by %s: %s; retrying", type(err).__name__, err)


_STOPPED_BY_SHUTDOWN = {-signal.SIGTERM, -signal.SIGKILL}
"""Exit codes of workers that the shut-down itself ended (terminated, then killed)."""


def _dead_workers(iterators: tuple[Any, ...], *, after_shutdown: bool = False) -> list[tuple[int, int]]:
    """(pid, exit code) of every worker of the trial's iterators that ended abnormally.

    Looked at before the shut-down and, since a crash can be seen (a closed pipe) before its exit
    status is, again after it, not counting the workers the shut-down ended itself.
    """
    dead: dict[int, int] = {}
    for it in iterators:
        for w in getattr(it, "_workers", None) or ():
            with contextlib.suppress(Exception):
                code = w.exitcode
                if code and not (after_shutdown and code in _STOPPED_BY_SHUTDOWN):
                    dead[w.pid] = code
    return list(dead.items())


def _worker_death(dead: list[tuple[int, int]]) -> WorkerFailed | None:
    if not dead:
        return None
    pid, code = dead[0]
    if code < 0:
        try:
            how = f"was killed by signal {signal.Signals(-code).name} ({signal.strsignal(-code)})"
        except ValueError:
            how = f"was killed by signal {-code}"
    else:
        how = f"exited unexpectedly with exit code {code}"
    return WorkerFailed(
        f"DataLoader worker (pid {pid}) {how}: the dataset, or a library it calls, crashed or exited"
        " in a worker process; run it with num_workers=0 to see the error"
    )


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


def _shutdown(iterator: Any, loader: Any) -> None:
    for it in (iterator, getattr(loader, "_iterator", None)):
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown is not None:
            with contextlib.suppress(Exception):
                shutdown()
    if loader is not None:
        loader._iterator = None


def _map_loader_error(err: BaseException) -> CandidateError | None:
    """Failures that belong to the candidate's worker processes, not to the user's code."""
    text = str(err)
    if isinstance(err, RuntimeError):
        if "DataLoader timed out" in text:
            return TrialTimeout(f"a worker produced no batch in time ({text})")
        if "DataLoader worker" in text and ("exited unexpectedly" in text or "killed by" in text):
            return WorkerFailed(text.strip().splitlines()[0])
        if "_share_filename_" in text or "only available on CPU" in text:
            return WorkerFailed(
                "workers cannot share CUDA tensors (_share_filename_: only available on CPU);"
                " use num_workers=0 for data that lives on the GPU"
            )
    return None


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
    cuda = device.type == "cuda"
    before = child_pids()
    prepared: pt.Prepared | None = None
    loader: Any = None
    holder: dict[str, Any] = {}
    with contextlib.ExitStack() as stack:
        stack.enter_context(torch_threads(candidate.torch_threads))
        arm = stack.enter_context(_interruptible())
        watchdog = _Watchdog(limits, before, arm)
        watchdog.start()
        # Runs before the signal handler is restored even if the shut-down below is cut short: a
        # watchdog left running could signal a process that no longer handles the signal.
        stack.callback(watchdog.stop)
        dead: list[tuple[int, int]] = []
        try:
            try:
                # Inside the guard: building a pre-transform cache counts against the trial's limits.
                prepared = pt.prepare(dataset, candidate.pretransform, device=device)
                loader = make_loader(
                    dataset,
                    candidate,
                    device=device,
                    shuffle=shuffle,
                    collate_fn=collate_fn,
                    seed=seed,
                    batch_timeout_s=limits.batch_timeout_s,
                )
                result = _run(loader, holder, candidate, step, device, limits, watchdog, progress, cuda)
            finally:
                # Disarm first: a late signal must not cut the shut-down short.
                arm.armed = False
                iterators = (holder.get("iterator"), getattr(loader, "_iterator", None))
                _unregister_workers(iterators)
                dead = _dead_workers(iterators)
                workers = _worker_pids(iterators)
                _cleanup(watchdog, holder.get("iterator"), loader, before)
                dead = dead or _dead_workers(iterators, after_shutdown=True)
                _remove_orphan_segments(workers)
        except _Interrupted as err:
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
            mapped = _worker_death(dead) or _map_loader_error(err)
            if mapped is not None:
                _release_frames(err)
                raise mapped from err
            raise
        if watchdog.failure is not None:
            raise watchdog.failure
    assert prepared is not None
    return Measurement(
        peak_memory_bytes=watchdog.peak_memory,
        build_s=prepared.build_s,
        cache_bytes=prepared.nbytes,
        **result,
    )


def _run(
    loader: Any,
    holder: dict[str, Any],
    candidate: Candidate,
    step: Callable[[Any], Any] | None,
    device: torch.device,
    limits: MeasureLimits,
    watchdog: _Watchdog,
    progress: ProgressFn | None,
    cuda: bool,
) -> dict[str, Any]:
    non_blocking = candidate.pin_memory and cuda

    def consume(batch: Any) -> Any:
        batch = to_device(batch, device, non_blocking)
        return step(batch) if step is not None else None

    t0 = time.perf_counter()
    iterator = holder["iterator"] = _start(loader, candidate)
    first = next(iterator)
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

    def next_batch() -> Any:
        nonlocal iterator
        try:
            return next(iterator)
        except StopIteration:
            # A new epoch inside the window: its start-up counts as waiting, as it does in training.
            iterator = holder["iterator"] = _start(loader, candidate)
            return next(iterator)

    warm_start = time.perf_counter()
    for _ in range(warmup):
        consume(next_batch())
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
    samples = 0
    window_start = time.perf_counter()
    events: list[tuple[Any, Any]] = []
    while True:
        tw = time.perf_counter()
        batch = next_batch()
        ts = time.perf_counter()
        waits.append(ts - tw)
        samples += batch_length(batch, candidate.batch_size)
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
    step_total = sum(steps)
    return {
        "samples_per_s": samples / wall,
        "busy": min(1.0, step_total / wall),
        "wait_fraction": min(1.0, sum(waits) / wall),
        "step_ms": statistics.median(steps) * 1000.0,
        "wait_ms": statistics.median(waits) * 1000.0,
        "startup_s": startup_s,
        "batches": len(waits),
        "samples": samples,
        "window_s": wall,
    }
