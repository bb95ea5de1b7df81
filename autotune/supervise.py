"""Supervising one trial: the watchdog over its time and memory, and the shut-down after it.

``measure`` runs a candidate; this module makes sure the run stops when it must and leaves nothing
behind (NOTE [ Measurement protocol ], step 5, in measure.py). The watchdog enforces the limits from
a side thread and interrupts the main thread by a signal (NOTE [ Interrupting the main thread ]);
:func:`shut_down` stops the iterators, the worker processes and thread workers, and their
shared-memory segments (NOTE [ Shut-down under signals ]). Thread workers cannot be killed: a thread
stuck in the dataset is left as a daemon thread (NOTE [ Thread workers ] in threads.py), and the
trial still ends on time because the main thread never waits on it without a limit.
"""

from __future__ import annotations

import contextlib
import gc
import glob
import logging
import math
import multiprocessing.util
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil

from .exceptions import CandidateError, MemoryLimitExceeded, TrialTimeout, WorkerFailed

log = logging.getLogger(__name__)

SHUTDOWN_TIMEOUT_S = 10.0
"""How long worker processes get to exit after their iterator is shut down, before being killed."""

WATCHDOG_POLL_S = 0.05
"""How often the watchdog checks time and memory."""

DEFAULT_WINDOW_S = 1.0
"""Steady-state window length: long enough to average scheduler noise, short enough for 30+ trials."""

DEFAULT_BATCH_TIMEOUT_S = 60.0
"""A single batch taking longer than this is a hang, not a slow dataset."""

DEFAULT_TRIAL_TIMEOUT_S = 120.0
"""No single candidate may take longer than this, start-up and shut-down included."""


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
    cache_budget_bytes: int | None = None
    """Ceiling on what a ``ram`` pre-transform cache may hold: its build stops above it; ``None``: none."""

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


_INTERRUPT_SIGNAL = getattr(signal, "SIGUSR2", None)
_CHILD_SIGNAL = getattr(signal, "SIGCHLD", None)


def process_memory(proc: psutil.Process | None = None, children: set[int] | None = None, *,
                   alike: bool = False) -> int:
    """PSS (or RSS where PSS is not reported) of a process and its children, in bytes.

    ``children``: the pids to count beside the process; ``None`` counts every descendant, which
    psutil finds by reading every process's status on the machine. ``alike``: the children are one
    loader's workers, alike: one is read and counted for each (reading PSS takes milliseconds a
    process, and 16 workers' took a short epoch's loop a fifth of its time).
    """
    proc = proc or psutil.Process()
    if children is None:
        procs = [proc, *proc.children(recursive=True)]
    else:
        procs = [proc]
        for pid in children:
            with contextlib.suppress(psutil.Error):
                procs.append(psutil.Process(pid))
    if alike and len(procs) > 2:
        return _memory(procs[0]) + (len(procs) - 1) * max((_memory(p) for p in procs[1:3]), default=0)
    return sum(_memory(p) for p in procs)


def _memory(p: psutil.Process) -> int:
    """PSS of one process (RSS where PSS is not reported or not readable; 0 where it is gone)."""
    try:
        info = p.memory_full_info()
        return int(getattr(info, "pss", 0) or info.rss)
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return 0
    except psutil.AccessDenied:
        with contextlib.suppress(psutil.Error):
            return int(p.memory_info().rss)
    return 0


def reap(pids: set[int], timeout_s: float = SHUTDOWN_TIMEOUT_S) -> list[int]:
    """Wait for these worker processes (this trial's own, never anyone else's) to exit; kill those
    that do not. Returns the pids that had to be killed (an empty list is the normal case)."""
    procs = []
    for pid in pids:
        with contextlib.suppress(psutil.Error):
            procs.append(psutil.Process(pid))
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


# NOTE [ A watchdog beside a busy step ]
# The watchdog is a Python thread: every time it reads a file it lets go of the GIL, and while the
# main thread runs Python code (a step, a dataset) it gets it back only after the interpreter's switch
# interval, 5 ms. Reading the memory of every descendant means reading the status of every process on
# the machine to find them (psutil's ``children``), several files each: beside a step that spins in
# Python, one such reading can take seconds on a machine with a few dozen processes, and a time
# limit checked against a clock read before it is then enforced seconds late. So the watchdog reads
# the clock before and after the memory, and counts only the main process and the trial's own
# workers, whose pids it has (a worker's own children are not counted).


class Watchdog(threading.Thread):
    """Enforces the time and memory limits of one trial from a side thread."""

    def __init__(self, limits: MeasureLimits, arm: Arm, workers: Callable[[], set[int]]) -> None:
        super().__init__(name="autotune-watchdog", daemon=True)
        self.limits = limits
        self.arm = arm
        self.workers = workers
        """The pids of the trial's own worker processes (the only ones it may kill)."""
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
            if CHILD_SIGNAL.pending:  # a worker's death went unreported (see NOTE [ Interrupting ... ])
                self._signal(_CHILD_SIGNAL)
            # The clock before and after the memory reading: see NOTE [ A watchdog beside a busy step ].
            failure: CandidateError | None = self._late()
            if failure is None:
                workers: set[int] = set()
                try:
                    with contextlib.suppress(Exception):
                        workers = self.workers()
                    mem = process_memory(self._proc, workers)
                except psutil.Error:
                    mem = 0
                self.peak_memory = max(self.peak_memory, mem)
                if limits.memory_limit_bytes is not None and mem > limits.memory_limit_bytes:
                    failure = MemoryLimitExceeded(
                        f"the main process and its workers used {mem / 2**20:.0f} MiB, over the"
                        f" memory budget of {limits.memory_limit_bytes / 2**20:.0f} MiB"
                    )
                else:
                    failure = self._late()
            if failure is not None:
                self._fail(failure)
                break
        # The main thread ignores the signal in some places (see NOTE [ Interrupting the main thread ]):
        # repeat it until it lands or the trial is being shut down.
        while self.failure is not None and self.arm.armed:
            self._signal(_INTERRUPT_SIGNAL)
            if self._stop_event.wait(WATCHDOG_POLL_S):
                break

    def _late(self) -> TrialTimeout | None:
        """The time limit the trial has passed by now, if any."""
        now = time.perf_counter()
        if now - self.started_at > self.limits.trial_timeout_s:
            return TrialTimeout(f"the trial ran past its time limit of {self.limits.trial_timeout_s:.1f} s")
        if now - self.last_progress > self.limits.batch_timeout_s:
            return TrialTimeout(
                f"no batch arrived for {self.limits.batch_timeout_s:.1f} s (batch time limit);"
                " the dataset or a worker hangs"
            )
        return None

    def _fail(self, failure: CandidateError) -> None:
        self.failure = failure
        # Kill the trial's workers first: the main thread may be blocked waiting on them.
        with contextlib.suppress(Exception):
            for pid in self.workers():
                with contextlib.suppress(psutil.Error):
                    psutil.Process(pid).kill()

    def _signal(self, signum: int | None) -> None:
        """Send ``signum`` to the main thread, unless the trial is already being shut down."""
        if self._stop_event.is_set() or not self.arm.possible:
            return
        if signum is not None and self.main_ident is not None:
            with contextlib.suppress(OSError, ValueError):
                signal.pthread_kill(self.main_ident, signum)


class Interrupted(BaseException):
    """Raised in the main thread by the watchdog's signal; turned into the watchdog's failure."""


# NOTE [ Interrupting the main thread ]
# The watchdog stops a trial by raising an exception in the main thread from a signal handler, and
# PyTorch's SIGCHLD handler raises one there when a worker dies. Such an exception lands between any
# two bytecodes. Most places are harmless: the trial's loader is thrown away. A few are not: while the
# main thread receives a batch's file descriptor from a worker (multiprocessing's resource sharer, its
# Unix socket, torch's storage rebuild), or while the DataLoader probes the open-file limit with
# temporary files after a failed read, an exception strands a socket, a file or a descriptor that is
# closed, with a ResourceWarning, only whenever the garbage collector gets to it. And one raised inside
# a garbage collector's callback, a ``__del__`` or a finalizer (multiprocessing's, closing a queue) is
# lost altogether: Python reports it as unraisable and goes on. So during a trial both handlers look
# at where the main thread is and do nothing inside that code. The measuring loop raises the
# watchdog's failure itself after every batch, and the watchdog repeats either signal every poll until
# a handler has run outside that code.


def _unsafe_files() -> frozenset[str]:
    """Files of code an exception must not cut short (see NOTE [ Interrupting the main thread ])."""
    import multiprocessing.reduction
    import multiprocessing.resource_sharer
    import multiprocessing.util
    import socket
    import tempfile

    import torch.multiprocessing.reductions

    modules = (socket, tempfile, multiprocessing.reduction, multiprocessing.resource_sharer,
               multiprocessing.util, torch.multiprocessing.reductions)
    return frozenset(os.path.abspath(m.__file__) for m in modules if m.__file__)


_UNSAFE_FILES = _unsafe_files()


def _in_unsafe_code(frame: Any) -> bool:
    """Whether ``frame`` or one of its callers runs code an exception must not cut short."""
    unraisable = {getattr(c, "__code__", None) for c in gc.callbacks}
    depth = 0
    while frame is not None and depth < 64:
        code = frame.f_code
        if code in unraisable or code.co_name == "__del__":
            return True
        if os.path.abspath(code.co_filename) in _UNSAFE_FILES:
            return True
        frame = frame.f_back
        depth += 1
    return False


class Arm:
    """Whether the watchdog's signal may interrupt the main thread right now."""

    def __init__(self, possible: bool) -> None:
        self.possible = possible
        self.armed = possible


@contextlib.contextmanager
def interruptible() -> Iterator[Arm]:
    """Let the watchdog interrupt the main thread, where signals can be handled at all."""
    if _INTERRUPT_SIGNAL is None or threading.current_thread() is not threading.main_thread():
        yield Arm(False)
        return
    arm = Arm(True)

    def handler(signum: int, frame: Any) -> None:
        if arm.armed and not _in_unsafe_code(frame):
            arm.armed = False
            raise Interrupted()

    old = signal.signal(_INTERRUPT_SIGNAL, handler)
    try:
        with CHILD_SIGNAL.installed(defer_outside_fetch=False):
            yield arm
    finally:
        arm.armed = False
        signal.signal(_INTERRUPT_SIGNAL, old)


# NOTE [ Worker deaths ]
# PyTorch's SIGCHLD handler raises a RuntimeError in the main thread, wherever it is, when a worker of
# a live iterator exits abnormally. ChildSignal wraps that handler, once for the process, while any
# trial is measured or any drop-in serves a stretch, and lets it run only where raising is safe and
# belongs: never inside unsafe code (NOTE [ Interrupting the main thread ]), and for the drop-in only
# inside its own ``next()``, never in the user's code between batches. A signal it holds back is
# ``pending``: the trial's watchdog sends it again, and the drop-in's next fetch asks PyTorch directly
# whether a worker failed (a non-blocking wait on the registered workers), which raises there.


class ChildSignal:
    """The one wrapper of PyTorch's SIGCHLD handler (see NOTE [ Worker deaths ])."""

    def __init__(self) -> None:
        self.depth = 0
        self.strict = 0
        """Contexts in which the handler runs wherever it is safe (a trial owns the main thread)."""
        self.fetch_depth = 0
        self.pending = False
        self.torch_handler: Any = None

    @contextlib.contextmanager
    def installed(self, *, defer_outside_fetch: bool) -> Iterator[None]:
        """Wrap the handler for the block; ``defer_outside_fetch``: raise only inside :meth:`fetching`."""
        if _CHILD_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        if self.depth == 0:
            from torch.utils.data._utils import signal_handling

            signal_handling._set_SIGCHLD_handler()  # installed once per process by PyTorch
            handler = signal.getsignal(_CHILD_SIGNAL)
            if callable(handler) and handler != self.handle:
                self.torch_handler = handler
                signal.signal(_CHILD_SIGNAL, self.handle)
        self.depth += 1
        self.strict += 0 if defer_outside_fetch else 1
        try:
            yield
        finally:
            self.depth -= 1
            self.strict -= 0 if defer_outside_fetch else 1
            if self.depth == 0:
                if self.torch_handler is not None and signal.getsignal(_CHILD_SIGNAL) == self.handle:
                    signal.signal(_CHILD_SIGNAL, self.torch_handler)
                self.torch_handler = None
                self.pending = False

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        """Around a drop-in's fetch: a death held back since the last one is raised here."""
        self.fetch_depth += 1
        try:
            if self.pending:
                self.pending = False
                import torch

                torch._C._error_if_any_worker_fails()
            yield
        finally:
            self.fetch_depth -= 1

    def handle(self, signum: int, frame: Any) -> None:
        if self.torch_handler is None:
            return
        if _in_unsafe_code(frame) or (not self.strict and not self.fetch_depth):
            self.pending = True
            return
        self.pending = False
        self.torch_handler(signum, frame)


CHILD_SIGNAL = ChildSignal()


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


def worker_pids(*iterators: Any) -> set[int]:
    """The pids of the worker processes these DataLoader iterators started."""
    pids: set[int] = set()
    for it in iterators:
        for w in getattr(it, "_workers", None) or ():
            with contextlib.suppress(Exception):
                if w.pid is not None:
                    pids.add(int(w.pid))
    return pids


def ready_batches(it: Any) -> int | None:
    """Batches this DataLoader iterator's workers finished that the loop has not taken yet: in its
    result queues and, for an in-order iterator, held back until their turn (NOTE [ Queue-corrected
    windows ] in measure.py). ``None`` where the iterator keeps no such queue (no workers) or it
    cannot be read."""
    try:
        if hasattr(it, "_task_info") and hasattr(it, "_data_queue"):  # torch's worker processes
            held = sum(1 for info in list(it._task_info.values()) if len(info) == 2)
            queued = it._data_queue.qsize()
            pinning = getattr(it, "_pin_memory_thread", None) is not None
            if pinning:  # the pin-memory thread moves them from the workers' queue to its own
                queued += it._worker_result_queue.qsize()
            return int(held + queued)
        pool = getattr(it, "_pool", None)
        if pool is not None and hasattr(it, "_ready"):  # thread workers (threads.py)
            return len(it._ready) + pool.results.qsize()
    except (NotImplementedError, AttributeError, OSError, ValueError):
        return None  # qsize() is not implemented everywhere (macOS); a closed queue
    return None


def resume_sampling(it: Any) -> None:
    """Send an in-order iterator's workers what its sampler has again, up to the prefetch it keeps.

    An iterator whose sampler ran out stops sending work, and each batch it hands out after that
    leaves its workers one task short; once the sampler has items again (a stretch continues on it:
    NOTE [ Continuing a stretch ] in epochs.py), this tops the tasks back up. Torch's invariant holds:
    the batches sent and not handed out (``_task_info``) stay under workers x prefetch, so the send
    each hand-out makes still finds room.
    """
    if hasattr(it, "_try_put_index") and hasattr(it, "_task_info"):  # torch's worker processes
        room = it._prefetch_factor * it._num_workers
        while len(it._task_info) < room and not it._shutdown:
            sent = it._send_idx
            it._try_put_index()
            if it._send_idx == sent:  # the sampler has nothing more
                return
    elif hasattr(it, "resume"):  # thread workers (threads.py)
        it.resume()


def remove_orphan_segments(pids: set[int]) -> list[str]:
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


def _cleanup(watchdog: Watchdog, iterators: tuple[Any, ...], loader: Any, workers: set[int]) -> None:
    steps: tuple[Callable[[], Any], ...] = (
        watchdog.stop,
        lambda: _shutdown(iterators, loader),
        lambda: reap(workers),
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


# NOTE [ Ctrl-C at worker start ]
# Starting a worker process forks, and in the parent Python then runs the fork hooks that modules
# registered (logging releases its lock there). A Ctrl-C whose handler runs inside such a hook raises
# KeyboardInterrupt where Python can only print "Exception ignored" and drop it: the training goes on
# as if the key had not been pressed. Torch's own loader has that window once an epoch (a loop of
# short epochs with two workers lost 3 Ctrl-Cs of 10); a tuning loader starts workers more often.
# So while an iterator starts its workers, SIGINT's handler only notes the signal; once the start
# is over, the handler that was in place (Python's KeyboardInterrupt, or the user's own) runs with
# it, and where it raises, the new iterator is shut down before the exception goes on. A worker
# forked meanwhile gets that handler back at once (an at-fork hook), as torch's workers have it.


class _HeldInterrupt:
    """SIGINT's handler while workers start: notes the signal for ``previous`` to handle after."""

    def __init__(self, previous: Callable[[int, Any], Any]) -> None:
        self.previous = previous
        self.caught: tuple[int, Any] | None = None

    def __call__(self, signum: int, frame: Any) -> None:
        if self.caught is None:
            self.caught = (signum, frame)


def _restore_interrupt_in_child() -> None:
    handler = signal.getsignal(signal.SIGINT)
    if isinstance(handler, _HeldInterrupt):
        with contextlib.suppress(ValueError):
            signal.signal(signal.SIGINT, handler.previous)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_restore_interrupt_in_child)


@contextlib.contextmanager
def interrupt_held() -> Iterator[None]:
    """Hold a Ctrl-C back for the block and deliver it after (NOTE [ Ctrl-C at worker start ])."""
    previous = signal.getsignal(signal.SIGINT)
    if (threading.current_thread() is not threading.main_thread() or not callable(previous)
            or isinstance(previous, _HeldInterrupt)):
        yield  # not the main thread, no Python handler to lose, or held already
        return
    held = _HeldInterrupt(previous)
    signal.signal(signal.SIGINT, held)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if held.caught is not None:
            signum, frame = held.caught
            held.caught = None
            previous(signum, frame)


# NOTE [ A killed worker's temporary folder ]
# A worker process that passes a tensor's storage to the main process (torch's file-descriptor
# sharing) starts multiprocessing's resource sharer, whose socket lives in a temporary folder
# (``pymp-*``) the process makes on first use and removes when it exits. A worker that is killed (the
# watchdog's limits, the memory guard, a stopped search) runs no exit code, and its folder stays in
# the temporary directory for good. A forked worker uses its parent's folder where the parent has one,
# so the main process makes its own before workers start: the workers share it, and the main process
# removes it at its exit, whatever became of them.


def _share_temp_folder(loader: Any) -> None:
    """See the NOTE: the main process's multiprocessing temporary folder, made before workers fork."""
    if getattr(loader, "num_workers", 0) > 0:
        with contextlib.suppress(OSError):
            multiprocessing.util.get_temp_dir()


def start_iterator(loader: Any) -> Any:
    """``iter(loader)``, leaving no worker process behind when it is cut short, and losing no Ctrl-C.

    Torch starts the workers one by one inside the iterator's constructor. An exception there leaves
    a half-built iterator: its finalizer fails on what was not built yet, and a worker started but
    not yet noted in its list outlives the call. Here the half-built iterator is found in the
    exception's traceback and its workers stopped before the exception goes on; torch's own
    finalizer is then skipped, since there is nothing left for it to do. A Ctrl-C during the start is
    held until it is over (NOTE [ Ctrl-C at worker start ]), then stops the new iterator too.
    """
    it = None
    _share_temp_folder(loader)
    try:
        with interrupt_held():
            try:
                it = iter(loader)
            except BaseException as err:
                _stop_half_built(err.__traceback__)
                raise
    except BaseException:
        if it is not None:
            stop_iterator(it)
        raise
    return it


def _stop_half_built(tb: Any) -> None:
    from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

    while tb is not None:
        frame = tb.tb_frame
        it = frame.f_locals.get("self")
        if frame.f_code.co_name == "__init__" and isinstance(it, _MultiProcessingDataLoaderIter):
            workers = list(getattr(it, "_workers", ()))
            started = frame.f_locals.get("w")  # the one started last, perhaps not in the list yet
            if started is not None and not any(started is w for w in workers):
                workers.append(started)
            if getattr(it, "_worker_pids_set", False):
                from torch.utils.data._utils import signal_handling

                with contextlib.suppress(Exception):
                    signal_handling._remove_worker_pids(id(it))
                it._worker_pids_set = False
            it._shutdown = True
            for w in workers:
                with contextlib.suppress(Exception):
                    if w.pid is not None:
                        w.terminate()
            for w in workers:
                with contextlib.suppress(Exception):
                    if w.pid is not None:
                        w.join(SHUTDOWN_TIMEOUT_S)
            return
        tb = tb.tb_next


def stop_iterator(it: Any) -> None:
    """Shut one DataLoader iterator down: torch's worker processes (joined, and terminated by torch if
    they do not exit), or a ThreadDataLoader's threads. Errors on the way are not the caller's.

    What its workers left in /dev/shm goes too: a worker whose allocation failed there raises an
    error that names the segment, and an iterator stopped before that error is read (the stretch was
    over) would leave the segment behind.
    """
    workers = worker_pids(it)
    for name in ("_shutdown_workers", "close"):
        stop = getattr(it, name, None)
        if stop is not None:
            with contextlib.suppress(Exception):
                stop()
            break
    remove_orphan_segments(workers)


def _shutdown(iterators: tuple[Any, ...], loader: Any) -> None:
    """Shut every iterator down, the loader's own persistent one included."""
    for it in (*iterators, getattr(loader, "_iterator", None)):
        stop_iterator(it)
    if loader is not None:
        loader._iterator = None


def shut_down(watchdog: Watchdog, arm: Arm, iterators: tuple[Any, ...], loader: Any) -> WorkerFailed | None:
    """Stop the watchdog, shut the trial's iterators down, reap its workers and remove what dead ones
    left (see NOTE [ Shut-down under signals ]). Returns the failure of a worker process that died
    abnormally during the trial, if one did, to be raised in place of what broke first."""
    # Disarm first: a late signal must not cut the shut-down short.
    arm.armed = False
    _unregister_workers(iterators)
    dead = _dead_workers(iterators)
    workers = worker_pids(*iterators, getattr(loader, "_iterator", None))
    _cleanup(watchdog, iterators, loader, workers)
    dead = dead or _dead_workers(iterators, after_shutdown=True)
    remove_orphan_segments(workers)
    return _worker_death(dead)
