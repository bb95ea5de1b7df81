"""The drop-in DataLoader: ``from autotune import DataLoader`` tunes itself inside the user's epochs.

# NOTE [ Online tuning ]
# The loader is a torch.utils.data.DataLoader: it is built, checked and sized by torch's own
# constructor (sampler, batch_sampler, collate_fn, drop_last, generator, len() behave as in torch),
# and only its iteration differs. Every setting the user passed explicitly is fixed; the rest of what
# the offline search chooses (workers of either kind, prefetch, pin_memory, the pre-transform cache,
# the main process's torch threads) is tuned while the user trains:
# 1. Plan as tune_loader does (plan.make_plan: the same checks, exclusions and profile key). A stored
#    profile for this machine and workload settles the loader at once, with no exploration.
# 2. Otherwise an epoch is drawn whole from the loader's own sampler (so its order is the one the
#    sampler gives, DistributedSampler.set_epoch included) and served in consecutive stretches, each by
#    an inner loader of one candidate over exactly that stretch's batches (measure.build_loader, the
#    builder the offline search uses). What a stretch did not hand out goes to the next one, so every
#    sample comes exactly once per epoch whatever happens to a candidate.
# 3. Per stretch: the time to the first batch is start-up; a few batches drain what the workers made
#    ready; then the time blocked in __next__ is the wait and the time until the user asks for the next
#    batch is the user's step (no device synchronisation: on CUDA the step's host time is what the
#    loop waits for). Throughput is samples over the wall time of that window, scored as the search
#    scores (NOTE [ Score ] in study.py). A candidate below ABANDON_RATIO of the best so far is
#    abandoned after a few batches.
# 4. The exploration starts from an estimate rather than from blind sampling: the first stretch runs
#    PyTorch's defaults (no workers), which gives the per-batch load time L (the wait) and step time S;
#    keeping the step busy takes about ceil(L / S) workers (study.estimate_workers, which warm-starts
#    the offline search too), so that is tried first with processes and with threads, with its
#    neighbours; then a cache where it can still pay for its build, and the torch thread counts around
#    the best so far, at most MAX_CANDIDATES in all; then the finalists once more.
# 5. Settle on the best score (within TIE_TOLERANCE, fewer workers), store the profile, apply its
#    torch thread count, and keep serving it (its workers persist across epochs). The wait fraction
#    is still watched: well above what was measured (another job took the cores, the page cache went
#    cold), the next epoch explores again, and the log says why.
# 6. Under torchrun (a process group initialised, as for tune_loader), see NOTE [ Exploring under
#    torchrun ] below.
# 7. A candidate that fails (a worker crashes, hangs past the batch time limit, or cannot start) is
#    abandoned with its reason and the stretch goes on with PyTorch's defaults; when those fail too,
#    the error is the user's and is raised. A worker's death is raised inside the stretch's own
#    next(), never in the user's code between batches (_ChildErrors). An IterableDataset switches
#    candidate only at epoch boundaries, one candidate per epoch, since a stream cannot be split by
#    index.

# NOTE [ Exploring under torchrun ]
# Every rank has its own drop-in over its DistributedSampler shard, and their workers share the node's
# CPUs, so the ranks explore together (as tune_loader tunes cooperatively, NOTE [ Cooperative tuning ]
# in distributed.py): the worker bound is per rank; rank 0's space and cache estimate are broadcast;
# stretches have a fixed length in batches and are served whole (no early end, no abandoning), so every
# rank ends each stretch at the same point of the epoch; there the outcomes are gathered and reduced
# (the slowest rank decides, a failure on any rank is a failure for all), so every rank's explorer sees
# the same records and makes the same choices; rank 0 alone writes the profile, and the drift check
# takes the slowest rank's wait. This assumes, as DDP does, that every rank runs the same loop over
# the same number of batches per epoch.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import signal
import statistics
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import torch
import torch.utils.data as tud

from . import pretransform as pt
from . import profiles
from .api import DEFAULT_BUDGET_S, DEFAULT_EPOCHS, TuneResult, lookup
from .describe import dataset_length
from .distributed import reduce_measurements
from .exceptions import CandidateError, ConfigurationError, WorkerFailed
from .measure import (
    Measurement,
    batch_length,
    build_loader,
    map_loader_error,
    process_memory,
    quiet_worker_warning,
)
from .plan import Plan, make_plan
from .space import Candidate, SearchSpace
from .study import TIE_TOLERANCE, TrialRecord, estimate_workers, score
from .supervise import child_pids, reap_new_children, remove_orphan_segments

log = logging.getLogger("autotune")

AUTO = "auto"
"""Pass this for a setting to have it tuned even where passing nothing would not."""

STRETCH_MIN_BATCHES = 6
"""Batches measured per stretch after its warm-up: enough for a median, cheap on short epochs."""

STRETCH_WINDOW_S = 0.75
"""Seconds measured per stretch at least (the offline window is 1 s for a minute's budget)."""

MAX_STRETCH_FRACTION = 0.25
"""A stretch serves at most this share of an epoch, so one epoch compares several candidates."""

WARMUP_BATCHES = 2
"""Batches after the first that are not measured, on top of draining the workers' prefetch."""

ABANDON_RATIO = 0.5
"""A candidate below this share of the best throughput so far is abandoned early."""

ABANDON_AFTER = 3
"""Measured batches before a candidate may be abandoned."""

MAX_CANDIDATES = 8
"""Candidates explored at most before settling (the estimate makes more rarely worth it)."""

FINALISTS = 2
"""Candidates measured once more before settling (the best two, when they are close), with the
defaults."""

FINAL_BAND = 0.85
"""A runner-up within this share of the best score is a finalist: further behind, noise cannot
plausibly reverse the order."""

MAX_EXPLORE_EPOCHS = 2
"""Epochs that may be spent exploring before settling on the best measured so far."""

DRIFT_WAIT_RISE = 0.25
"""Re-explore when the settled configuration's wait fraction rises this far above the measured one."""

EXPLORE_BATCH_TIMEOUT_S = 20.0
"""While exploring, a candidate whose next batch takes longer than this has hung and is dropped
(``batch_timeout_s`` overrides it; the settled configuration waits as the user's loader would)."""

MIN_TUNE_BATCHES = 2 * STRETCH_MIN_BATCHES
"""A loader that never served this many batches is reported as too short to tune."""

_TUNED_TORCH_ARGS = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")
"""torch DataLoader arguments the loader tunes when they are not given."""

_NOT_GIVEN: Any = object()
"""The default of a tunable argument: it was not given, so it is tuned."""


class Listener:
    """Told about every drop-in loader of this process (``autotune run`` reports with it)."""

    def built(self, loader: DataLoader) -> None:
        """``loader`` was just constructed."""

    def settled(self, loader: DataLoader) -> None:
        """``loader`` finished exploring, or found its profile: then inside its constructor, before
        :meth:`built`; it serves its best configuration from now on."""


_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with contextlib.suppress(ValueError):
        _listeners.remove(listener)


def _notify(event: str, loader: DataLoader) -> None:
    for listener in list(_listeners):
        with contextlib.suppress(Exception):
            getattr(listener, event)(loader)


@dataclass
class _Stretch:
    """What one stretch of an epoch served and saw."""

    candidate: Candidate
    served: int = 0
    """Items (batches, or samples without auto-collation) handed to the user."""
    measurement: Measurement | None = None
    failure: str | None = None
    abandoned: bool = False


@dataclass(frozen=True)
class _Summary:
    """One candidate over its measurements: the median score, and the measurement nearest it."""

    candidate: Candidate
    score: float
    measurement: Measurement
    measurements: int


@dataclass
class _Explorer:
    """Which candidate serves next, from the measurements so far (see NOTE [ Online tuning ] 4)."""

    space: SearchSpace
    fixed: dict[str, Any]
    dataset_len: int | None
    epochs: int
    records: list[TrialRecord] = field(default_factory=list)
    queue: list[Candidate] = field(default_factory=list)
    tried: set[Candidate] = field(default_factory=set)
    estimated: bool = False
    caches_tried: bool = False
    threads_tried: bool = False
    finals_started: bool = False
    finals: list[Candidate] = field(default_factory=list)
    build_s: float | None = None
    """The estimated build time of a cache (None: unknown)."""

    def allowed(self, c: Candidate) -> bool:
        if c in self.tried or self.space.check(c) is not None:
            return False
        return all(getattr(c, k) == v for k, v in self.fixed.items())

    def baseline(self) -> Candidate:
        """PyTorch's defaults, or the nearest point the user's fixed settings allow."""
        c = replace(self.space.baseline(), torch_threads=None)
        return self.conform(c)

    def conform(self, c: Candidate) -> Candidate:
        """``c`` with the user's fixed settings applied (prefetch and persistence made consistent)."""
        c = replace(c, **{k: v for k, v in self.fixed.items() if k in Candidate.__dataclass_fields__})
        if c.num_workers == 0:
            c = replace(c, prefetch_factor=None, persistent_workers=False, worker_kind="process",
                        in_order=True)
        else:
            pf = c.prefetch_factor if c.prefetch_factor in self.space.prefetch_factors else 2
            c = replace(c, prefetch_factor=pf,
                        persistent_workers=self.space.persistent and c.worker_kind == "process")
        return c

    def summaries(self) -> dict[Candidate, _Summary]:
        """Every measured candidate over its measurements."""
        by: dict[Candidate, list[TrialRecord]] = {}
        for r in self.records:
            if r.score is not None and r.measurement is not None:
                by.setdefault(r.candidate, []).append(r)
        out = {}
        for c, recs in by.items():
            med = statistics.median(r.score or 0.0 for r in recs)
            near = min(recs, key=lambda r: abs((r.score or 0.0) - med))
            assert near.measurement is not None
            out[c] = _Summary(c, med, near.measurement, len(recs))
        return out

    def best(self) -> _Summary | None:
        """The best candidate by median score; within TIE_TOLERANCE of it, the fewest workers."""
        summaries = list(self.summaries().values())
        if not summaries:
            return None
        top = max(x.score for x in summaries)
        tied = [x for x in summaries if x.score >= (1.0 - TIE_TOLERANCE) * top]
        return min(tied, key=lambda x: (x.candidate.num_workers, -x.score))

    def finalists(self) -> list[Candidate]:
        """The best few, to be measured once more: one short window is not a verdict on a shared
        machine, so the pick is the median over two (or more) of them."""
        best = self.best()
        ranked = sorted(
            {r.candidate: r.score or 0.0 for r in self.records if r.state == "complete"}.items(),
            key=lambda kv: -kv[1])
        top = ranked[0][1] if ranked else 0.0
        out = [c for c, sc in ranked[:FINALISTS] if sc >= FINAL_BAND * top]
        if best is not None and best.candidate not in out:
            out.insert(0, best.candidate)
        # The defaults again too: they ran first, on a cold page cache and before anything was warm,
        # which flatters every later candidate; measured once more, the speed-up is side by side.
        base = self.records[0].candidate if self.records else None
        if base is not None and base not in out and any(r.candidate == base and r.measurement
                                                         for r in self.records):
            out.append(base)
        return out

    def best_throughput(self) -> float:
        return max((r.measurement.samples_per_s for r in self.records if r.measurement), default=0.0)

    def record(self, stretch: _Stretch) -> None:
        c, m = stretch.candidate, stretch.measurement
        if m is None and stretch.failure is None and not stretch.abandoned:
            return  # the epoch ended before a window was measured: it is tried again next epoch
        self.tried.add(c)
        if c in self.queue:
            self.queue.remove(c)
        if self.finals_started and c in self.finals:
            self.finals.remove(c)
        if stretch.failure is not None:
            state, sc = "failed", None
        elif m is None:
            state, sc = "pruned" if stretch.abandoned else "infeasible", None
        else:
            state, sc = ("pruned" if stretch.abandoned else "complete"), score(
                m, c, self.dataset_len, self.epochs)
        reason = stretch.failure or ("abandoned: clearly slower than the best so far"
                                     if stretch.abandoned else None)
        phase = "baseline" if not self.records else ("final" if self.finals_started else "online")
        self.records.append(TrialRecord(len(self.records), phase, c, state, m, sc, reason,
                                        m.window_s + m.startup_s if m else 0.0))
        if not self.estimated and m is not None and c.num_workers == 0 and c.pretransform == "none":
            self.estimated = True
            self.queue[:0] = self.from_estimate(m)

    def from_estimate(self, m: Measurement) -> list[Candidate]:
        """Candidates around the worker count that would keep the step busy (NOTE 4)."""
        base = self.baseline()
        out: list[Candidate] = []
        for kind, n in (("process", self.space.max_workers), ("thread", self.space.max_threads)):
            if n <= 0:
                continue
            want = estimate_workers(m, n)
            for w in (want, want + 1, want - 1):
                if 1 <= w <= n:
                    out.append(self.conform(replace(base, num_workers=w, worker_kind=kind,
                                                    prefetch_factor=2)))
        return [c for c in dict.fromkeys(out) if self.allowed(c)]

    def caches(self) -> list[Candidate]:
        """The cache strategies, tried once the workers are known, when they can still pay off.

        A cache removes the per-sample work of its prefix but costs its build inside the user's
        epoch: it is tried only while the best so far still waits for data long enough that the
        time to win over the training run exceeds the build's estimate.
        """
        best = self.best()
        if best is None or best.measurement is None or self.dataset_len is None:
            return []
        m = best.measurement
        step_bound = m.samples_per_s / max(1e-9, 1.0 - m.wait_fraction)  # no waiting at all
        to_win = self.epochs * self.dataset_len * (1.0 / m.samples_per_s - 1.0 / step_bound)
        out: list[Candidate] = []
        for strategy in ("ram", "device"):
            if strategy not in self.space.pretransforms:
                continue
            if self.build_s is not None and self.build_s > to_win:
                # Not tried, and the table says why.
                skipped = self.conform(replace(self.baseline(), pretransform=strategy))
                self.records.append(TrialRecord(
                    len(self.records), "online", skipped, "infeasible", reason=(
                        f"pretransform={strategy!r}: its build (~{self.build_s:.1f} s) would cost more"
                        f" than waiting for data costs the best configuration over {self.epochs}"
                        f" epochs (~{to_win:.1f} s)")))
                continue
            base = self.conform(replace(self.baseline(), pretransform=strategy))
            out.append(base)
            if strategy == "ram" and self.space.max_threads > 0:
                out.append(self.conform(replace(base, num_workers=1, worker_kind="thread",
                                                prefetch_factor=2)))
        return [c for c in out if self.allowed(c)]

    def threads_around(self, best: Candidate) -> list[Candidate]:
        current = best.torch_threads or torch.get_num_threads()
        return [replace(best, torch_threads=t) for t in self.space.torch_threads
                if t is not None and t != current]

    def next(self) -> Candidate | None:
        """The candidate to measure next (the same until it is recorded), or ``None``: done."""
        if not self.records:
            return self.baseline()
        if len(self.tried) >= MAX_CANDIDATES:
            self.queue.clear()
        while self.queue and not self.allowed(self.queue[0]):
            self.queue.pop(0)
        if self.finals_started:
            return self.finals[0] if self.finals else None
        if not self.queue and not self.caches_tried:
            self.caches_tried = True
            self.queue.extend(self.caches())
        if not self.queue and not self.threads_tried:
            self.threads_tried = True
            best = self.best()
            if best is not None and "torch_threads" not in self.fixed:
                self.queue.extend(c for c in self.threads_around(best.candidate) if self.allowed(c))
        if self.queue:
            return self.queue[0]
        self.finals_started = True
        self.finals = self.finalists() if len(self.tried) > 1 else []
        return self.finals[0] if self.finals else None


@dataclass
class _Timeline:
    """Per-batch times of one stretch, and the measurement they make (NOTE [ Online tuning ] 3)."""

    backlog: int
    """Batches the workers may have made ready ahead of the user (workers x prefetch)."""
    startup_s: float = 0.0
    received: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    steps: list[float] = field(default_factory=list)

    @property
    def warmup(self) -> int:
        return WARMUP_BATCHES + self.backlog

    def batch(self, asked: float, got: float, samples: int) -> None:
        self.received.append(got)
        self.waits.append(got - asked)
        self.counts.append(samples)

    def step(self, seconds: float) -> None:
        self.steps.append(seconds)

    def measured(self) -> int:
        return max(0, len(self.received) - 1 - self.warmup)

    def complete(self) -> bool:
        """Enough batches past the warm-up (at least a second backlog's worth: one made ready during
        start-up drains only as fast as the step outpaces the workers) over enough time."""
        n = self.measured()
        if n < max(STRETCH_MIN_BATCHES, self.backlog):
            return False
        return self.received[-1] - self.received[self.warmup] >= STRETCH_WINDOW_S

    def clearly_below(self, threshold: float) -> bool:
        n = self.measured()
        if threshold <= 0 or n < ABANDON_AFTER:
            return False
        start = self.warmup
        elapsed = self.received[-1] - self.received[start]
        # What was made ready during start-up only flatters the rate, so a low one is real.
        return sum(self.counts[start + 1:]) / max(elapsed, 1e-9) < threshold

    def measurement(self, last_yield: float, loader: Any) -> Measurement | None:
        """Over the later half of the measured batches: the earlier half may still drain a backlog."""
        n = self.measured()
        if n < max(STRETCH_MIN_BATCHES, self.backlog):
            return None  # too few: the batches made ready during start-up would flatter the rate
        k = self.warmup + n // 2  # the window runs from batch k's arrival to the last hand-out
        wall = max(last_yield - self.received[k], 1e-9)
        samples = sum(self.counts[k + 1:])
        waits = self.waits[k + 1:]
        steps = self.steps[k:len(self.received) - 1]
        return Measurement(
            samples_per_s=samples / wall,
            busy=min(1.0, sum(steps) / wall),
            wait_fraction=min(1.0, sum(waits) / wall),
            step_ms=(statistics.median(steps) if steps else 0.0) * 1000.0,
            wait_ms=statistics.median(waits) * 1000.0,
            startup_s=self.startup_s,
            batches=len(waits),
            samples=samples,
            window_s=wall,
            peak_memory_bytes=process_memory(),
            build_s=float(getattr(loader, "_autotune_build_s", 0.0) or 0.0),
        )


class _ChildErrors:
    """Keeps a dead worker's error for the stretch's own ``next()`` (NOTE [ Online tuning ] 7).

    PyTorch's SIGCHLD handler raises in the main thread, wherever it is, when a worker of a live
    iterator dies; between batches that is the user's code. While any stretch is being served, the
    handler is wrapped (once for the process, however many loaders explore): inside a stretch's
    ``next()`` it raises as PyTorch's would, so the candidate fails where it is caught; anywhere else
    the error waits until the next ``next()``, which raises it before fetching.
    """

    def __init__(self) -> None:
        self.active = 0
        self.inside = 0
        self.pending = False
        self.torch_handler: Any = None

    @contextlib.contextmanager
    def exploring(self) -> Iterator[None]:
        if _CHILD_SIGNAL is None or threading.current_thread() is not threading.main_thread():
            yield
            return
        if self.active == 0:
            from torch.utils.data._utils import signal_handling

            signal_handling._set_SIGCHLD_handler()  # installed once per process by PyTorch
            handler = signal.getsignal(_CHILD_SIGNAL)
            if callable(handler) and handler != self.handle:
                self.torch_handler = handler
                signal.signal(_CHILD_SIGNAL, self.handle)
        self.active += 1
        try:
            yield
        finally:
            self.active -= 1
            if self.active == 0 and self.torch_handler is not None:
                if signal.getsignal(_CHILD_SIGNAL) == self.handle:
                    signal.signal(_CHILD_SIGNAL, self.torch_handler)
                self.torch_handler = None
                self.pending = False

    @contextlib.contextmanager
    def fetching(self) -> Iterator[None]:
        self.inside += 1
        try:
            # PyTorch's own check (a non-blocking wait on the registered workers): raises for a dead
            # one, whether or not its signal arrived (signals of children exiting together merge).
            self.pending = False
            torch._C._error_if_any_worker_fails()
            yield
        finally:
            self.inside -= 1

    def handle(self, signum: int, frame: Any) -> None:
        if self.inside and self.torch_handler is not None:
            self.torch_handler(signum, frame)
        else:
            self.pending = True


_CHILD_SIGNAL = getattr(signal, "SIGCHLD", None)
_CHILD_ERRORS = _ChildErrors()


class _Items(tud.Sampler[Any]):
    """A fixed run of the epoch's batches (or indices): what one stretch serves."""

    def __init__(self, items: Sequence[Any]) -> None:
        self.items = items

    def __iter__(self) -> Iterator[Any]:
        return iter(self.items)

    def __len__(self) -> int:
        return len(self.items)


class _EpochIterator:
    """What ``iter(loader)`` returns: the epoch's batches, with ``len()`` and ``close()``."""

    def __init__(self, loader: DataLoader, gen: Iterator[Any]) -> None:
        self._loader = loader
        self._gen = gen
        self._handed = 0
        self._done = False

    def __iter__(self) -> _EpochIterator:
        return self

    def __next__(self) -> Any:
        try:
            item = next(self._gen)
        except StopIteration:
            self._done = True
            raise
        self._handed += 1
        return item

    def __len__(self) -> int:
        return len(self._loader)

    def finish(self) -> None:
        """End an epoch whose every batch was handed out but whose end was never asked for.

        Trainers stop at ``len(loader)`` batches (Lightning does) instead of running the iterator
        to StopIteration, so the bookkeeping after the last batch (the last stretch's measurement,
        the settling, the drift check) would never run. Here it does; anything else is closed.
        """
        if self._done:
            return
        try:
            complete = self._handed >= len(self._loader)
        except TypeError:  # a stream without a length
            complete = False
        if complete:
            try:
                next(self._gen)
            except StopIteration:
                self._done = True
                return
        self.close()

    def close(self) -> None:
        self._done = True
        close = getattr(self._gen, "close", None)
        if close is not None:
            close()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.finish()


def _origin() -> str:
    """``file:line`` of the user's code that built the loader (the first frame outside autotune)."""
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frame = inspect.currentframe()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((here, torch_dir)) and "<frozen" not in path:
            rel = os.path.relpath(path)
            return f"{rel if not rel.startswith('..') else path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _shutdown_inner(it: Any) -> None:
    for name in ("_shutdown_workers", "close"):
        fn = getattr(it, name, None)
        if fn is not None:
            with contextlib.suppress(Exception):
                fn()
            return


class _Held:
    """What a loader holds that must be let go: the settled loader's workers and the torch thread
    count it changed. Apart from the loader, so that it can be released when the loader is collected."""

    def __init__(self) -> None:
        self.inner: Any = None
        self.inner_for: Candidate | None = None
        self.previous_threads: int | None = None

    def apply_threads(self, n: int | None) -> None:
        """Use ``n`` torch threads (``None``: the count before this loader changed it)."""
        if n is None:
            if self.previous_threads is not None and torch.get_num_threads() != self.previous_threads:
                torch.set_num_threads(self.previous_threads)
            return
        if self.previous_threads is None:
            self.previous_threads = torch.get_num_threads()
        if torch.get_num_threads() != n:
            torch.set_num_threads(n)

    def drop_inner(self) -> None:
        inner, self.inner, self.inner_for = self.inner, None, None
        if inner is not None:
            _shutdown_inner(getattr(inner, "_iterator", None))

    def release(self) -> None:
        self.drop_inner()
        previous, self.previous_threads = self.previous_threads, None
        if previous is not None and torch.get_num_threads() != previous:
            torch.set_num_threads(previous)


class DataLoader(tud.DataLoader):
    """``torch.utils.data.DataLoader`` that tunes itself while you train (see NOTE [ Online tuning ]).

    Takes every argument torch's DataLoader takes. ``num_workers``, ``pin_memory``,
    ``prefetch_factor`` and ``persistent_workers`` are tuned unless you pass them (pass ``"auto"`` to
    have a passed one tuned too); ``batch_size``, ``shuffle``, samplers, ``collate_fn``, ``drop_last``
    and everything else are yours and never change. autotune's own keyword arguments:

    Args:
        pretransform: ``"auto"`` (every cache strategy that applies), ``"none"``, or names, as for
            :func:`autotune.tune_loader`.
        torch_threads: the main process's torch thread count, tuned (``"auto"``), fixed (an int), or
            left as it is (``None``).
        device: where your step runs (decides ``pin_memory`` and the ``device`` cache); ``None``:
            CUDA when available.
        epochs: the training length that worker start-up and a cache build are amortised over.
        cache, cache_dir, storage, retune: the profile store, as for :func:`autotune.tune_loader`.
        batch_timeout_s: a candidate whose next batch takes longer than this has hung and is dropped.

    ``loader.tuning`` is a :class:`~autotune.TuneResult` once a configuration has been measured.
    ``close()`` (or leaving a ``with`` block) shuts the workers down and restores the torch thread
    count; the loader also does that when it is collected.
    """

    explicit_settings_are_fixed: bool = True
    """Whether the tunable settings the caller passes are fixed (True) or starting points (False)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = _NOT_GIVEN,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool | str = _NOT_GIVEN,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | str | None = _NOT_GIVEN,
        persistent_workers: bool | str = _NOT_GIVEN,
        pin_memory_device: str = "",
        in_order: bool = True,
        pretransform: str | Sequence[str] = AUTO,
        torch_threads: int | str | None = AUTO,
        device: str | torch.device | None = None,
        epochs: int = DEFAULT_EPOCHS,
        cache: bool = True,
        cache_dir: str | None = None,
        storage: str | None = None,
        retune: bool = False,
        batch_timeout_s: float | None = None,
        _configured: Candidate | None = None,
    ) -> None:
        given = {"num_workers": num_workers, "pin_memory": pin_memory,
                 "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers}
        self.script_settings = {k: v for k, v in given.items() if v is not _NOT_GIVEN}
        """The tunable settings as the caller wrote them (``autotune run`` reports them)."""
        fixed = _fixed_settings(self.script_settings, fix=self.explicit_settings_are_fixed)
        threads_fixed = _fixed_threads(torch_threads)
        leave_threads = torch_threads is None
        start = _starting_candidate(self.script_settings) if not self.explicit_settings_are_fixed else None
        # torch's own constructor checks and sets everything else; the outer loader starts no workers.
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler, 0, collate_fn,
            bool(fixed.get("pin_memory", False)), drop_last, timeout, worker_init_fn,
            multiprocessing_context, generator, prefetch_factor=None, persistent_workers=False,
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        self._origin = _origin()
        self._held = _Held()
        self._current: weakref.ref[_EpochIterator] | None = None
        self._served_batches = 0
        self._explore_epochs = 0
        self._drift_pending: str | None = None
        self._settled: Candidate | None = None
        self._settled_wait: float | None = None
        self._result: TuneResult | None = None
        self._start = start
        self._space: SearchSpace | None = None
        self._explorer: _Explorer | None = None
        if threads_fixed is not None or leave_threads:
            fixed["torch_threads"] = threads_fixed
        self._fixed = fixed
        self._explore_timeout_s = (batch_timeout_s if batch_timeout_s is not None
                                   else EXPLORE_BATCH_TIMEOUT_S)
        # The same checks, exclusions and key as tune_loader (plan.make_plan), raised here, not
        # in the middle of an epoch.
        self._plan: Plan = make_plan(
            dataset, None, batch_size=_plan_batch_size(dataset, batch_size),
            budget_s=DEFAULT_BUDGET_S, device=device, epochs=epochs, pretransform=pretransform,
            max_workers=fixed.get("num_workers") if fixed.get("worker_kind") != "thread" else None,
            memory_budget_bytes=None, batch_timeout_s=batch_timeout_s,
            shuffle=bool(shuffle) or sampler is not None, collate_fn=collate_fn, seed=0,
            fixed={k: v for k, v in fixed.items() if k != "num_workers"}, stacklevel=3,
        )
        self._store_args = ({"cache_dir": cache_dir, "storage": storage}
                            if cache and _configured is None else None)
        if _configured is not None:
            self._settle(_configured)
        elif self._store_args is not None and not retune:
            with self._store() as store:
                hit = lookup(store, self._plan.key)
            ctx = self._plan.dist
            if ctx is not None:  # rank 0's answer, so that every rank explores, or none
                shared = ctx.broadcast(hit.to_dict() if ctx.leader and hit is not None else None)
                hit = TuneResult.from_dict(shared, from_cache=True) if shared is not None else None
            if hit is not None:
                self._result = hit
                self._settle(hit.candidate)
        # Collected without close(): the workers still go and the thread count is still put back.
        weakref.finalize(self, self._held.release)
        _notify("built", self)

    @classmethod
    def configured(cls, dataset: Any, candidate: Candidate, *, device: str | torch.device | None = None,
                   **kwargs: Any) -> DataLoader:
        """A loader fixed to ``candidate`` (it explores nothing); torch arguments in ``kwargs`` win.

        What :meth:`autotune.TuneResult.make_loader` returns. A tunable torch argument in ``kwargs``
        (``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``) replaces the
        candidate's: ``num_workers`` makes them worker processes, as a plain DataLoader would start.
        """
        c = candidate
        if "num_workers" in kwargs:
            n = kwargs.pop("num_workers")
            _fixed_settings({"num_workers": n}, fix=True)
            c = replace(c, num_workers=n, worker_kind="process", in_order=True,
                        prefetch_factor=(c.prefetch_factor or 2) if n else None,
                        persistent_workers=bool(n) and c.persistent_workers)
        for name in ("pin_memory", "prefetch_factor", "persistent_workers"):
            if name in kwargs:
                value = kwargs.pop(name)
                _fixed_settings({name: value}, fix=True)
                c = replace(c, **{name: value})
        if "in_order" in kwargs:
            c = replace(c, in_order=bool(kwargs.pop("in_order")))
        kwargs.setdefault("batch_size", c.batch_size)
        c = replace(c, batch_size=kwargs["batch_size"] if kwargs["batch_size"] is not None else 1)
        return cls(dataset, pretransform=c.pretransform, device=device, cache=False,
                   torch_threads=c.torch_threads, _configured=c, **kwargs)

    # -- public ------------------------------------------------------------------------------------

    @property
    def tuning(self) -> TuneResult | None:
        """What was tried and chosen (``None`` before the first measurement)."""
        if self._result is None and self._explorer is not None and self._explorer.records:
            return self._make_result(final=False)
        return self._result

    @property
    def origin(self) -> str:
        """``file:line`` where the loader was built."""
        return self._origin

    @property
    def settled(self) -> bool:
        """Whether exploration is over and the best configuration is being served."""
        return self._settled is not None and self._drift_pending is None

    @property
    def served_batches(self) -> int:
        return self._served_batches

    def close(self) -> None:
        """Shut the workers down and put back the torch thread count this loader changed."""
        self._finish_epoch()
        self._held.release()

    def _finish_epoch(self) -> None:
        current = self._current() if self._current is not None else None
        self._current = None
        if current is not None:
            current.finish()

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __iter__(self) -> _EpochIterator:  # type: ignore[override]
        self._finish_epoch()  # a closed loader can be iterated again, like torch's
        epoch = _EpochIterator(self, self._serve_epoch())
        self._current = weakref.ref(epoch)
        return epoch

    # -- serving -----------------------------------------------------------------------------------

    def _serve_epoch(self) -> Iterator[Any]:
        if self._drift_pending is not None:
            log.info("autotune: %s; exploring again this epoch", self._drift_pending)
            self._drift_pending = None
            self._settled = None
            self._explorer = None
            self._explore_epochs = 0
        if self._settled is not None:
            yield from self._serve_settled()
            return
        self._explore_epochs += 1
        if isinstance(self.dataset, tud.IterableDataset):
            yield from self._explore_stream()
        else:
            yield from self._explore_map()

    def _serve_settled(self) -> Iterator[Any]:
        c = self._settled
        assert c is not None
        self._apply_threads(c.torch_threads)
        inner = self._inner_loader(c)
        with quiet_worker_warning():
            it = iter(inner)
        waits = 0.0
        started = time.perf_counter()
        n = 0
        try:
            while True:
                t0 = time.perf_counter()
                try:
                    batch = next(it)
                except StopIteration:
                    break
                waits += time.perf_counter() - t0
                n += 1
                self._served_batches += 1
                yield batch
        finally:
            if not c.persistent_workers:
                _shutdown_inner(it)
        wall = time.perf_counter() - started
        if self._plan.dist is not None and n >= MIN_TUNE_BATCHES:
            self._drift_check_together(waits / max(wall, 1e-9), c)
        elif n >= MIN_TUNE_BATCHES and wall > 0:
            wait = waits / wall
            if self._settled_wait is None:
                self._settled_wait = wait  # the first whole epoch served settled is the reference
            elif wait > self._settled_wait + DRIFT_WAIT_RISE:
                self._drift_pending = (
                    f"the loader built at {self._origin} waited {wait:.0%} of this epoch for data,"
                    f" against {self._settled_wait:.0%} in its first epoch on {c.label()}"
                )

    def _drift_check_together(self, wait: float, c: Candidate) -> None:
        """Under torchrun: the reference and the verdict are the slowest rank's, so all agree."""
        ctx = self._plan.dist
        assert ctx is not None
        wait = max(ctx.gather(wait))
        if self._settled_wait is None:
            self._settled_wait = wait
        elif wait > self._settled_wait + DRIFT_WAIT_RISE:
            self._drift_pending = (
                f"the loader built at {self._origin} waited {wait:.0%} of this epoch for data on its"
                f" slowest rank, against {self._settled_wait:.0%} in its first epoch on {c.label()}"
            )

    @contextlib.contextmanager
    def _store(self) -> Iterator[profiles.ProfileStore]:
        """The profile store, open only while it is used (a database's connections are let go)."""
        assert self._store_args is not None
        store = profiles.open_store(**self._store_args)
        try:
            yield store
        finally:
            store.close()

    def _ensure_explorer(self) -> _Explorer:
        if self._explorer is None:
            if self._space is None:
                self._space, _ = self._plan.search()
            build_s = (pt.estimate_build_s(self.dataset)
                       if set(self._space.pretransforms) - {"none"} else None)
            ctx = self._plan.dist
            if ctx is not None:  # rank 0's view of the space, so every rank explores the same one
                self._space, build_s = ctx.broadcast((self._space, build_s) if ctx.leader else None)
            fixed = {k: v for k, v in self._fixed.items() if k != "batch_size"}
            self._explorer = _Explorer(self._space, fixed, self._plan.dataset_len, self._plan.epochs,
                                       build_s=build_s)
            if self._start is not None:
                self._explorer.queue.append(self._explorer.conform(
                    replace(self._space.baseline(), **self._start)))
        return self._explorer

    def _explore_map(self) -> Iterator[Any]:
        explorer = self._ensure_explorer()
        together = self._plan.dist is not None  # see NOTE [ Exploring under torchrun ]
        items = list(self._index_sampler)
        pos = 0
        share = int(MAX_STRETCH_FRACTION * len(items))
        while pos < len(items):
            c = explorer.next() if self._settled is None else None
            if c is None:
                if self._settled is None:
                    self._finish_exploring()
                assert self._settled is not None
                yield from self._serve_items(self._settled, items[pos:])
                return
            stretch = _Stretch(c)
            backlog = c.num_workers * (c.prefetch_factor or 2)
            per_stretch = max(share, WARMUP_BATCHES + 2 * backlog + STRETCH_MIN_BATCHES + 1)
            yield from self._serve_stretch(stretch, items[pos:pos + per_stretch],
                                           abandon=not explorer.finals_started, whole=together)
            pos += stretch.served
            if together:
                self._agree(stretch)
            explorer.record(stretch)
            if stretch.served == 0 and stretch.failure is None:
                break  # the inner loader gave nothing: nothing is left to serve
        if self._settled is None and (self._explore_epochs >= MAX_EXPLORE_EPOCHS or explorer.next() is None):
            self._finish_exploring()

    def _agree(self, stretch: _Stretch) -> None:
        """Every rank ends the stretch with the same outcome (NOTE [ Exploring under torchrun ])."""
        ctx = self._plan.dist
        assert ctx is not None
        m = stretch.measurement
        mine = (("failed", stretch.failure) if stretch.failure is not None
                else ("ok", m.to_dict()) if m is not None else ("none", None))
        outcomes = ctx.gather(mine)
        failed = [(rank, text) for rank, (kind, text) in enumerate(outcomes) if kind == "failed"]
        if failed:
            stretch.failure = f"failed on rank {failed[0][0]}: {failed[0][1]}"
            stretch.measurement = None
        elif all(kind == "ok" for kind, _ in outcomes):
            stretch.measurement = reduce_measurements([Measurement.from_dict(d) for _, d in outcomes])
        else:
            stretch.measurement = None
        stretch.abandoned = False

    def _explore_stream(self) -> Iterator[Any]:
        """An IterableDataset: one candidate per epoch (a stream cannot be split by index)."""
        explorer = self._ensure_explorer()
        c = explorer.next()
        if c is None:
            self._finish_exploring()
            yield from self._serve_settled()
            return
        stretch = _Stretch(c)
        yield from self._serve_stretch(stretch, None, abandon=False)
        if self._plan.dist is not None:
            self._agree(stretch)
        explorer.record(stretch)
        if stretch.failure is not None and stretch.served == 0:
            # Nothing reached the user yet: the epoch can still be served whole by the defaults.
            fallback = _Stretch(explorer.baseline())
            yield from self._serve_stretch(fallback, None)
        if explorer.next() is None:
            self._finish_exploring()

    def _serve_items(self, c: Candidate, items: Sequence[Any]) -> Iterator[Any]:
        """The rest of an epoch by the settled candidate."""
        stretch = _Stretch(c)
        yield from self._serve_stretch(stretch, items, measure=False)

    def _serve_stretch(self, stretch: _Stretch, items: Sequence[Any] | None, *,
                       measure: bool = True, abandon: bool = True, whole: bool = False) -> Iterator[Any]:
        """Serve ``items`` (``None``: the whole stream) by ``stretch.candidate``; record what it saw.

        Over items, it stops once the measurement is complete or the candidate is abandoned (the
        rest goes to the next stretch), unless ``whole``; a stream is served to its end whatever the
        measurement.
        A candidate that fails hands the rest to PyTorch's defaults (NOTE [ Online tuning ] 6).
        """
        c = stretch.candidate
        self._apply_threads(c.torch_threads)
        before = child_pids()
        try:
            loader = self._stretch_loader(c, items)
        except CandidateError as err:
            stretch.failure = f"{type(err).__name__}: {err}"
            return
        line = _Timeline(backlog=c.num_workers * (c.prefetch_factor or 2) if c.num_workers else 0)
        it: Any = None
        exploring = _CHILD_ERRORS.exploring()
        t_start = time.perf_counter()
        last_yield = 0.0
        try:
            exploring.__enter__()
            with quiet_worker_warning():
                it = iter(loader)
            while True:
                t0 = time.perf_counter()
                if measure and last_yield:
                    line.step(t0 - last_yield)
                try:
                    with _CHILD_ERRORS.fetching():
                        batch = next(it)
                except StopIteration:
                    break
                t1 = time.perf_counter()
                if stretch.served == 0:
                    line.startup_s = t1 - t_start
                if measure:
                    line.batch(t0, t1, batch_length(batch, self.batch_size or 1))
                stretch.served += 1
                self._served_batches += 1
                last_yield = time.perf_counter()
                yield batch
                if not measure or whole:
                    continue
                best = self._explorer.best_throughput() if self._explorer is not None else 0.0
                if abandon and line.clearly_below(ABANDON_RATIO * best):
                    stretch.abandoned = True
                elif not line.complete():
                    continue
                if items is not None:
                    break
                measure = False  # a stream is served to its end; the window is what it measured
                stretch.measurement = line.measurement(last_yield, loader)
        except GeneratorExit:
            raise
        except Exception as err:  # noqa: BLE001 - classified below: the candidate's, or the user's
            if c.num_workers == 0 and c.pretransform == "none":
                raise  # PyTorch's defaults: the error is the user's own
            stretch.failure = _describe_failure(err)
            log.info("autotune: candidate %s failed (%s); serving the rest with the defaults",
                     c.label(), stretch.failure)
        finally:
            if it is not None:
                _shutdown_inner(it)
            exploring.__exit__(None, None, None)
            if c.num_workers and c.worker_kind == "process":
                reap_new_children(before)
                remove_orphan_segments(child_pids() - before)
        if stretch.failure is not None:
            if items is None:
                if stretch.served > 0:
                    raise WorkerFailed(
                        f"the stream's candidate {c.label()} failed after {stretch.served} batches"
                        f" ({stretch.failure}); a stream cannot be resumed where it stopped"
                    )
                return
            # Only the part of the stretch it did not hand out: every sample still once.
            fallback = _Stretch(self._ensure_explorer().baseline())
            yield from self._serve_stretch(fallback, items[stretch.served:], measure=False)
            stretch.served += fallback.served
            return
        if measure and stretch.measurement is None:
            stretch.measurement = line.measurement(last_yield, loader)

    # -- building ----------------------------------------------------------------------------------

    def _loader_args(self, c: Candidate, items: Sequence[Any] | None) -> dict[str, Any]:
        """Arguments for an inner loader serving ``items`` (or, ``None``, the loader's own sampler)."""
        kw: dict[str, Any] = {"worker_init_fn": self.worker_init_fn,
                              "pin_memory_device": self.pin_memory_device}
        if c.num_workers and c.worker_kind == "process":
            kw["multiprocessing_context"] = self.multiprocessing_context
        if c.threaded:
            kw.pop("worker_init_fn")
        if isinstance(self.dataset, tud.IterableDataset):
            kw.update(batch_size=self.batch_size, drop_last=self.drop_last)
        elif self._auto_collation:
            kw["batch_sampler"] = _Items(items) if items is not None else self.batch_sampler
        else:
            kw.update(batch_size=None, sampler=_Items(items) if items is not None else self.sampler)
        return kw

    def _build(self, c: Candidate, items: Sequence[Any] | None, *, timeout_s: float) -> Any:
        if c.num_workers:
            # A stretch hands out its batches in order, so that what it did not hand out is known;
            # the settled loader delivers as the candidate and the caller's in_order say.
            c = replace(c, in_order=items is not None or (c.in_order and self.in_order))
        prepared = pt.prepare(self.dataset, c.pretransform, device=self._plan.device)
        loader = build_loader(
            self.dataset, c, device=self._plan.device, shuffle=False, collate_fn=self.collate_fn,
            batch_timeout_s=timeout_s, prepared=prepared, **self._loader_args(c, items),
        )
        loader._autotune_build_s = prepared.build_s if prepared.strategy != "none" else 0.0
        loader._autotune_prepared = prepared
        return loader

    def _stretch_loader(self, c: Candidate, items: Sequence[Any] | None) -> Any:
        # The user's own timeout wins; while exploring, a hung candidate is dropped after the batch
        # time limit, as in the offline search.
        timeout = self.timeout or (0.0 if c == self._settled else self._explore_timeout_s)
        return self._build(c, items, timeout_s=timeout)

    def _inner_loader(self, c: Candidate) -> Any:
        """The settled candidate's loader over the loader's own sampler, kept across epochs.

        At every epoch its cache is checked against what it froze (NOTE [ Fresh caches ] in the
        pre-transform package): after a change the loader is built again, and ``prepare`` warns,
        naming the change, and rebuilds the cache, so an epoch never trains on stale samples.
        """
        held = self._held
        prepared = getattr(held.inner, "_autotune_prepared", None)
        if prepared is not None and prepared.stale_reason() is not None:
            held.drop_inner()
        if held.inner is None or held.inner_for != c:
            held.drop_inner()
            held.inner = self._build(c, None, timeout_s=self.timeout)
            held.inner_for = c
        return held.inner

    # -- settling ----------------------------------------------------------------------------------

    def _finish_exploring(self) -> None:
        explorer = self._ensure_explorer()
        best = explorer.best()
        if best is None:
            c = explorer.baseline()
            log.info("autotune: nothing could be measured for the loader at %s; serving %s",
                     self._origin, c.label())
            self._settle(c)
            return
        self._result = self._make_result(final=True)
        if self._store_args is not None and (self._plan.dist is None or self._plan.dist.leader):
            with self._store() as store:
                store.put(self._plan.key, self._result.to_dict())
        self._settle(best.candidate)
        log.info("autotune: the loader at %s settled on %s (%s)", self._origin, best.candidate.label(),
                 f"{self._result.speedup:.2f}x the defaults" if self._result.speedup else "no baseline")

    def _settle(self, c: Candidate) -> None:
        self._settled = c
        self.num_workers = c.num_workers if c.worker_kind == "process" else 0
        self.prefetch_factor = c.prefetch_factor if self.num_workers else None
        self.pin_memory = c.pin_memory
        self._settled_wait = None
        _notify("settled", self)

    def _make_result(self, *, final: bool) -> TuneResult:
        explorer = self._ensure_explorer()
        best = explorer.best()
        first = explorer.records[0].candidate if explorer.records else None
        base = explorer.summaries().get(first) if first is not None else None  # the defaults
        trials = tuple(explorer.records)
        if best is None or best.measurement is None:
            c = explorer.baseline()
            return TuneResult(loader_kwargs=c.loader_kwargs(), trials=trials,
                              device=str(self._plan.device), epochs=self._plan.epochs, key=self._plan.key,
                              machine=self._plan.machine.fingerprint(), workload=self._plan.workload)
        m, bm = best.measurement, base.measurement if base else None
        return TuneResult(
            loader_kwargs=best.candidate.loader_kwargs(),
            pretransform=best.candidate.pretransform,
            torch_threads=best.candidate.torch_threads,
            samples_per_s=m.samples_per_s, busy=m.busy, wait_fraction=m.wait_fraction,
            speedup=(best.score / base.score) if base and base.score and best.score else None,
            throughput_speedup=(m.samples_per_s / bm.samples_per_s) if bm and bm.samples_per_s else None,
            baseline_samples_per_s=bm.samples_per_s if bm else None,
            baseline_busy=bm.busy if bm else None,
            baseline_wait_fraction=bm.wait_fraction if bm else None,
            trials=trials, device=str(self._plan.device), epochs=self._plan.epochs,
            budget_s=0.0, tuning_s=sum(r.duration_s for r in trials), key=self._plan.key,
            machine=self._plan.machine.fingerprint(), workload=self._plan.workload,
        )

    # -- threads and clean-up ----------------------------------------------------------------------

    def _apply_threads(self, n: int | None) -> None:
        self._held.apply_threads(n)


def _plan_batch_size(dataset: Any, batch_size: int | None) -> int:
    """The batch size as the plan sees it: torch serves a batch larger than the dataset as one
    short batch, and so does this loader, so the plan's check must not refuse it."""
    n = dataset_length(dataset)
    size = batch_size if batch_size is not None else 1
    return min(size, n) if n else size


def _describe_failure(err: BaseException) -> str:
    mapped = map_loader_error(err)
    if mapped is not None:
        return f"{type(mapped).__name__}: {mapped}"
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    return f"{type(err).__name__}: {(lines or [''])[-1][:300]}"


def _fixed_settings(given: dict[str, Any], *, fix: bool) -> dict[str, Any]:
    """The candidate fields the caller fixed, checked as torch checks them, with a clear error."""
    fixed: dict[str, Any] = {}
    for name, value in given.items():
        if isinstance(value, str):
            if value != AUTO:
                raise ConfigurationError(
                    f"{name}={value!r} is not a setting; pass a value, or {AUTO!r} to have it tuned."
                )
            continue
        if name == "num_workers":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(
                    f"num_workers={value!r} must be a non-negative integer, or {AUTO!r} to have it"
                    " tuned; use num_workers=0 to load in the main process."
                )
        elif name == "prefetch_factor":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(
                    f"prefetch_factor={value!r} must be a positive integer, None, or {AUTO!r}."
                )
        elif not isinstance(value, bool):
            raise ConfigurationError(f"{name}={value!r} must be True or False, or {AUTO!r}.")
        if fix:
            fixed[name] = value
    if fixed.get("num_workers") == 0:
        if fixed.get("prefetch_factor") is not None:
            raise ConfigurationError(
                f"prefetch_factor={fixed['prefetch_factor']} needs num_workers > 0; leave it out or"
                f" pass {AUTO!r}."
            )
        if fixed.get("persistent_workers"):
            raise ConfigurationError(
                "persistent_workers=True needs num_workers > 0; leave it out or pass 'auto'."
            )
    if fixed.get("prefetch_factor") is None:
        fixed.pop("prefetch_factor", None)
    if "persistent_workers" in fixed:
        fixed.pop("persistent_workers")  # decided by the epochs (NOTE in space.py), as offline
    if fixed.get("num_workers", 0) > 0:
        fixed["worker_kind"] = "process"
    return fixed


def _fixed_threads(value: int | str | None) -> int | None:
    if value == AUTO or value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(
            f"torch_threads={value!r} must be a positive integer, or {AUTO!r} to have it tuned."
        )
    return value


def _starting_candidate(given: dict[str, Any]) -> dict[str, Any]:
    """The script's own settings as the first candidate after the defaults (``autotune run``)."""
    start: dict[str, Any] = {}
    workers = given.get("num_workers")
    if isinstance(workers, int) and not isinstance(workers, bool):
        start["num_workers"] = workers
        if workers:
            pf = given.get("prefetch_factor")
            start["prefetch_factor"] = pf if isinstance(pf, int) and not isinstance(pf, bool) else 2
    if isinstance(given.get("pin_memory"), bool):
        start["pin_memory"] = given["pin_memory"]
    return start
