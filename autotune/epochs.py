"""The drop-in's epochs: what ``iter(loader)`` returns, and the stretches an epoch is served in.

# NOTE [ Epochs and stretches ]
# An epoch draws its items (index batches, or indices without auto-collation) from the loader's own
# sampler, lazily, one at a time, as torch does (a sampler that never ends is fine): the ``Feed``.
# It is served in consecutive stretches, each by an inner DataLoader of one candidate whose sampler
# takes items from the feed (``FeedSampler``) and records them. A stretch that ends before its inner
# loader handed out everything it took (its workers prefetch) gives the rest back to the front of the
# feed, so every item comes exactly once, in the sampler's order where delivery is in order. Stretches
# of worker processes deliver as the user's ``in_order`` says: out of order, what is given back is
# what torch's iterator still had pending; measured stretches of threads deliver in order.
#
# Per stretch (measured ones): the time to the first item is start-up; a few items drain what the
# workers made ready; then the time blocked in ``next()`` is the wait and the time until the user asks
# for the next item is the user's step (no device synchronisation: on CUDA the step's host time is what
# the loop waits for). Throughput is samples over the wall time of that window (the later half of the
# measured items, where the earlier half may still drain a backlog that cannot be counted; every
# measured item where it can: NOTE [ Counted windows are whole ]).
#
# Hiding start-up: a measured stretch that has its window stops taking items from the feed (it is
# "sealed") and serves only what its workers already took, its backlog. Its outcome is recorded then,
# the next stretch is chosen and started at once (its workers start and prefetch from the feed, after
# the sealed stretch's items), and it takes over when the backlog is served: the next candidate's
# start-up overlaps the last batches of this one instead of stalling the loop, and the backlog's work is
# served rather than given back and loaded again. Order is kept: the next stretch's items all come after
# the sealed one's. Should the sealed stretch fail while it drains, or the epoch end, the started
# stretch is closed first (unrecorded), so that each gives back its items in the feed's order.
#
# NOTE [ No fork beside thread workers ]
# A stretch of worker processes does not start ahead while a stretch of thread workers serves its
# last items: torch forks its workers, and a fork copies every lock of the process as it is, while the
# threads hold them inside the user's dataset code (an image decoder, an import, an allocator), and
# no thread is in the child to release them. On a real ImageFolder beside a busy core, 5 worker
# processes forked while a thread worker decoded: one batch came after 15 s, and the next not within
# the 20 s an explored candidate is given, an epoch of 48 s where the user's own took 16 s. Such a
# stretch starts in its turn instead, once the thread stretch has stopped and joined its threads; its
# start-up is then waited for, and measured as such.
#
# NOTE [ Continuing a stretch ]
# A stretch of the same candidate as the one before it (the baseline measured, then served on; two
# rounds of the finals meeting at the baseline) serves on the same inner loader, as torch's one
# iterator per epoch would: no new workers start, and the queue they keep stays full across the
# boundary. Starting new ones cost a short epoch a tenth of its time (16 workers on 2 CPUs: a third),
# where the user's own loader pays that once an epoch. A sealed stretch hands its inner loader to the
# next one when the next is chosen; one that ran to its limit keeps its workers (they hold nothing it
# took) until the next stretch is known, and stops them if that one is another candidate. The inner
# loader's sampler stops at each stretch's limit and goes on when the next raises it
# (``FeedSampler``); the tasks its workers went without meanwhile are sent then
# (``supervise.resume_sampling``). A measured stretch at the epoch's end seals too: the items its
# workers hold are served, not given back and loaded again. Only a stretch with the same batch time
# limit continues: an explored candidate's loader drops a batch that hangs, the user's settings wait.
# The user's settings are served again and again within an epoch (between the candidates measured,
# in every round of the finals), so once a stretch of them has handed out every item it took, its
# workers are parked, idle, while other candidates serve, and the next stretch of them serves on
# them (``EpochIterator._parked``): they start once an epoch, as the user's own do, instead of once
# a turn (4 workers on 2 CPUs: 0.3-0.4 s, half a one-second epoch). Parked workers take no items and
# no CPU; they stop when the epoch ends or the search settles on another candidate.
#
# NOTE [ Bursts ]
# Worker processes started together finish their batches together: batches arrive in bursts, one per
# worker, with a gap while the next round is loaded. A short window that opens in a gap and closes at
# the end of a burst counts the burst's batches over a fraction of the cycle, and reads a multiple of
# what the stretch delivers over its length. Where the loop waited
# for data after the warm-up (a fetch that found no batch ready), the window therefore runs from the
# first such fetch to the last: two items that each opened a burst, the same point of the workers'
# cycle, with whole cycles between them. A fetch that waited also proves that nothing made ready during
# start-up was left, so the window may start there rather than in the later half. Where the loop never
# waited twice (the step is the bottleneck), batches come as fast as the loop asks and the window is
# the later half of the measured items, as above.
#
# NOTE [ Counted windows are whole ]
# Where the workers' queue is read at every item, a window counts what the loader produced (NOTE
# [ Queue-corrected windows ] in measure.py), so the backlog made during start-up is no reason to
# leave the earlier half out: the window spans every measured item past the warm-up. Over the later
# half only, it held as few as four items while the reading of the queue swings by a batch or two
# with the batches in flight. The user's 4 workers, in the 12-item stretches of a filled cache's
# check beside a busy core, read 73-96 samples/s that way (the queue read 5 at the window's start and
# 2 at its end) where the same stretch served 134 over its whole length and the script's own epochs
# ran at about 180, and the speed-up reported read 2-3 times what the settled epochs then showed.
#
# NOTE [ Drained windows ]
# A fetch that waited found no batch ready: whatever the workers had made ready ahead of the loop
# (up to workers x prefetch batches) was served by then. So a window between two such fetches reads
# the rate the loader sustains, however deep its queue, and needs neither the backlog's worth of
# warm-up items nor a second backlog to drain: only the warm-up batches and STRETCH_MIN_BATCHES
# between the two fetches. Without it, a worker count far past the CPUs (16 workers, prefetch 2: a
# 32-batch queue) needs some 70 items before its window opens, more than a short epoch holds, and
# the user's own settings were never measured at all. Where the loop never waits (the step is the
# bottleneck), nothing proves the queue drained; where the queue is read at every item, the window
# counts what the loader produced (NOTE [ Queue-corrected windows ] in measure.py) and needs the same
# two batches per worker, not the backlog; where it cannot be read, the backlog rule stands.
# What is left between two such fetches is the work the workers have in hand, up to a batch each;
# it counts at one end and not at the other, so the window spans DRAINED_CYCLES batches per worker
# (``online.drained_span``), and the queue's change is counted as well (NOTE [ Queue-corrected
# windows ] in measure.py): in order, a fetch waits for its own batch with others finished behind it.
#
# NOTE [ The first stretch settles in ]
# The first stretch of the search serves the baseline while the process itself still warms up: the
# first steps of a training run are slower (allocations, caches, the page cache), with torch's own
# loader as much as with any. Its rate is the reference every other stretch's cost is weighed against
# (NOTE [ Online search ], 4, in online.py). Measured from its start, it reads slower than the same
# settings do later, so every other stretch's cost is underweighted and the bound on exploring rarely
# binds. So its window opens only after
# it has served one window's time, or where the epoch is short, as many of its items as leave room
# for a window and for the drain of its workers' queue at its end (``settling_bound``); it may serve
# twice the share of the epoch other stretches may. Neither costs anything:
# the baseline is what the user's loop would have run anyway.
#
# NOTE [ A whole epoch ]
# Where the first stretch never found room for its window and served its epoch to the end (a short
# epoch of many workers: 64 batches, 16 workers on 2 CPUs), no part of it reads the rate the loop
# got. Its last items came from the queue with nothing left to make (the workers stop when the
# sampler ends), so a window there reads the queue's drain, several times what the loader sustains,
# and the queue correction (NOTE [ Queue-corrected windows ] in measure.py) cannot undo a swing as
# large as the window. Such a stretch is measured whole: its start-up is the time to its first item,
# its rate every later item over the time from the first to the last. Start-up plus the epoch at that
# rate is the epoch as the user's loop had it, the queue made during start-up included once.

# NOTE [ The drain at a stretch's end ]
# A stretch that ends without its window (it ran to its limit or to the epoch's end) is measured
# when it closes. Its workers got no new items once its sampler stopped, at the limit or where the
# epoch ended, so its last items came from their queue with nothing made meanwhile. A window over
# that tail finds the queue full at its start and empty at its end, and the queue correction (NOTE
# [ Queue-corrected windows ] in measure.py) counts the batches served as made before it: 16 workers
# behind a step-bound loop read a third of the rate the loop got. Where the queue is read at every
# item, that tail is where each item left one batch fewer ready than the one before, to the end
# (``Timeline.sustained_end``); the window ends before it, however few items are left before it,
# and where fewer than WARMUP_BATCHES are, nothing is measured. The tail holds nothing of the rate:
# over it the workers had nothing to make, and the step ran without them beside it. The user's 16
# workers behind torchvision's reference script: steps of 150 ms in the tail against 250 ms before
# it; a window that took the tail in, with its batches counted as made before it, read 29 samples/s
# where the script's epochs ran at 148, and the speed-up reported read 4.9x where a run that
# measured the same cache without that tail read 1.56x (90 % interval 1.21-2.02x). (It used to take
# the tail in where fewer than a second backlog's worth of items stood before it.)
# The same holds for a window measured while the stretch still serves, once its sampler is done
# (``Timeline.sampler_done``): a fast loop may need more time for a window than the items before
# the limit give, and a window closed inside the tail read 16 workers over a tensor dataset at 301
# and 1,476 samples/s, in final stretches between two that read 7,700-8,300.
# A drained window (NOTE [ Drained windows ]) never ends in that tail, measured when the stretch
# closes or before: beside a busy core a fetch there may take a millisecond with its queue full
# behind it, and a window from an earlier such fetch to the last item read the user's 16 workers
# at 239-279 samples/s in a first stretch that served the whole epoch at 940.

# NOTE [ The search fills from its first stretch ]
# Where a ram cache applies, the search's plan (its space, the probes that plan and prove the cache)
# is made and the cache's fill started before its first stretch (``Tuning.start_filling``), so that
# the whole first epoch loads through the cache. Planned after the first stretch, that stretch (up to
# half of a short epoch) would store nothing, the cache would be incomplete after epoch 1, and the
# check that measures it (NOTE [ Settled means proven ] in tuning.py) would wait an epoch longer.
# It also makes the first epoch's comparisons even: the baseline pays the fill's copies as
# every candidate measured after it does, where its rate had been measured without them and each
# candidate was weighed against it with them.
#
# Failures: a candidate that fails (a worker crashes, hangs past the batch time limit, cannot start)
# ends its stretch with the reason, and the items it did not hand out are served by the baseline. An
# error raised while the baseline (the user's own settings) serves is the user's: it reaches the caller
# as torch would raise it, and the iterator goes on with the next item after it, as torch's does. A
# worker's death is raised inside a stretch's own ``next()``, never in the user's code between items
# (NOTE [ Worker deaths ] in supervise.py).
"""

from __future__ import annotations

import bisect
import contextlib
import logging
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch.utils.data as tud
from torch.utils.data.datapipes.datapipe import IterDataPipe

from .decide import Failure, Phase
from .feed import Feed, FeedSampler
from .machine import CpuSnapshot, cpu_snapshot, loading_beside_step
from .measure import (
    WARMUP_BATCHES,
    Measurement,
    batch_length,
    produced,
    quiet_pickle_warning,
    window_log_se,
)
from .online import STRETCH_MIN_BATCHES, STRETCH_WINDOW_S, Outcome, drained_span
from .serving import EpochSettings, Serving
from .space import Candidate
from .supervise import (
    CHILD_SIGNAL,
    ready_batches,
    resume_sampling,
    start_iterator,
    stop_iterator,
    worker_pids,
)

log = logging.getLogger("autotune")

ABANDON_AFTER = 3
"""Measured items before a candidate may be abandoned."""

WAITED_S = 0.001
"""A fetch that blocked this long found no batch ready: the loop waited for data (NOTE [ Bursts ])."""

HIDE_STARTUP = True
"""Whether a measured stretch serves its backlog while the next one starts (NOTE [ Epochs and
stretches ]); ``benchmarks/scripts/startup.py`` turns it off to measure what it saves."""


@dataclass
class Timeline:
    """Per-item times of one stretch, and the measurement they make (NOTE [ Epochs and stretches ])."""

    backlog: int
    """Items the workers may have made ready ahead of the user (workers x prefetch)."""
    workers: int = 0
    """Workers loading at once: a drained window spans ``drained_span`` items."""
    window_s: float = STRETCH_WINDOW_S
    settle_s: float = 0.0
    """Seconds served before the warm-up may end (NOTE [ The first stretch settles in ])..."""
    settle_items: int | None = None
    """...or after this many items, whichever comes first (``None``: no bound)."""
    startup_s: float = 0.0
    startup_seen: bool = True
    """Whether the loop waited for the whole start-up (``Measurement.startup_seen``)."""
    received: list[float] = field(default_factory=list)
    waits: list[float] = field(default_factory=list)
    counts: list[int] = field(default_factory=list)
    ready: list[int | None] = field(default_factory=list)
    """Per item: batches the workers had finished ahead of the loop (``None``: not known)."""
    steps: list[float] = field(default_factory=list)
    sampler_done: bool = False
    """Its sampler gave its last item (the stretch's limit, or the epoch's end): the workers' queue
    only drains from there (NOTE [ The drain at a stretch's end ])."""
    _settled_at: int | None = field(default=None, init=False, repr=False)

    @property
    def warmup(self) -> int:
        """Items before the measured window: the warm-up batches, the backlog where the workers'
        queue cannot be read (NOTE [ Drained windows ]), and the first stretch's settling in (NOTE
        [ The first stretch settles in ])."""
        first = WARMUP_BATCHES + (0 if self.counted else self.backlog)
        if self.settle_s <= 0:
            return first
        if self._settled_at is None:
            at = self._settle_index(first)
            if at is None:
                return first
            if at >= len(self.received):
                return at  # still settling in: nothing measured yet
            self._settled_at = at
        return self._settled_at

    def _settle_index(self, first: int) -> int | None:
        """The item where settling in ends, at ``first`` at the earliest (``None``: nothing yet)."""
        if not self.received:
            return None
        at = bisect.bisect_left(self.received, self.received[0] + self.settle_s)
        if self.settle_items is not None:
            at = min(at, self.settle_items)
        return max(first, at)

    def drained(self) -> tuple[int, int] | None:
        """(first, last) of two fetches that waited, after the warm-up batches and the settling in,
        at least STRETCH_MIN_BATCHES apart (NOTE [ Drained windows ]); ``None``: none yet."""
        floor = WARMUP_BATCHES if self.settle_s <= 0 else self._settle_index(WARMUP_BATCHES)
        if floor is None:
            return None
        # Not into the queue's drain at the end (NOTE [ The drain at a stretch's end ]).
        last = self.sustained_end() if self.counted else len(self.received) - 1
        waited = [i for i in range(floor, last + 1) if self.waits[i] >= WAITED_S]
        if len(waited) >= 2 and waited[-1] - waited[0] >= drained_span(self.workers):
            return waited[0], waited[-1]
        return None

    def item(self, asked: float, got: float, samples: int, ready: int | None = None) -> None:
        self.received.append(got)
        self.waits.append(got - asked)
        self.counts.append(samples)
        self.ready.append(ready)

    @property
    def counted(self) -> bool:
        """Whether the workers' queue is read at every item, so a window counts what the loader
        produced (NOTE [ Queue-corrected windows ] in measure.py)."""
        return bool(self.ready) and self.ready[-1] is not None

    def enough(self) -> int:
        """Items past the warm-up a window needs: with the queue counted, a round of every worker
        twice over (each end may count a batch per worker still in hand); without, a second
        backlog's worth (one made ready during start-up drains only as fast as the step outpaces
        the workers)."""
        if self.counted:
            return drained_span(self.workers)
        return max(STRETCH_MIN_BATCHES, self.backlog)

    def measured(self) -> int:
        return max(0, len(self.received) - 1 - self.warmup)

    def complete(self, now: float) -> bool:
        """A drained window of at least ``window_s`` (NOTE [ Drained windows ]), or else enough items
        past the warm-up (``enough``) over enough time."""
        span = self.drained()
        if span is not None and self.received[span[1]] - self.received[span[0]] >= self.window_s:
            return True
        if self.measured() < self.enough():
            return False
        return now - self.received[self.warmup] >= self.window_s

    def rate_below(self, threshold: float, now: float) -> bool:
        if threshold <= 0 or self.measured() < ABANDON_AFTER:
            return False
        start = self.warmup
        # What was made ready during start-up only flatters the rate, so a low one is real.
        return sum(self.counts[start + 1:]) / max(now - self.received[start], 1e-9) < threshold

    def sustained_end(self) -> int:
        """The last item before the queue only drained: past it, each item left one batch fewer
        ready and none was made (NOTE [ The drain at a stretch's end ])."""
        j = len(self.ready) - 1
        while j > 0:
            now, before = self.ready[j], self.ready[j - 1]
            if now is None or before is None or now != before - 1:
                break
            j -= 1
        return j

    def window(self, ended: bool = False) -> tuple[int, int]:
        """(the item it opens at, the last item in it) of the measured window: between two fetches
        that waited, else every measured item where the workers' queue is counted (NOTE [ Counted
        windows are whole ]) and the later half of them where it is not (NOTE [ Bursts ]). It
        closes when its last item arrives: from one arrival to another it holds as many fetches as
        steps, where closing later (when the loop asks for the next item) would count one step
        more than the batches it counts, a quarter of a three-batch window."""
        span = self.drained()
        if span is not None:
            return span
        # Never into the drain at the end (NOTE [ The drain at a stretch's end ]); where the queue
        # is not read, ``sustained_end`` is the last item.
        end = self.sustained_end() if ended or self.sampler_done else len(self.received) - 1
        if self.counted:
            return self.warmup, end
        return self.warmup + (end - self.warmup) // 2, end

    def measurement(self, build_s: float, memory: Callable[[], int], *, epoch: bool = False,
                    ended: bool = False) -> Measurement | None:
        """The window's measurement (``None``: too few items); ``memory()``: what the main process and
        the stretch's worker processes hold; ``epoch``: the stretch served a whole
        epoch, from its first item to its last, and is measured whole (NOTE [ A whole epoch ]);
        ``ended``: the stretch has ended; then, as once its sampler is done, the queue's drain at its
        end is left out (NOTE [ The drain at a stretch's end ])."""
        if epoch and len(self.received) > WARMUP_BATCHES + 1:
            k, stop = 0, len(self.received) - 1
            samples = sum(self.counts[1:])
        elif self.drained() is None and self.measured() < self.enough():
            return None  # too few: the items made ready during start-up would flatter the rate
        else:
            k, stop = self.window(ended)
            if stop - k < WARMUP_BATCHES:
                return None  # the drain at its end left too little before it to read a rate
            samples = produced(sum(self.counts[k + 1:stop + 1]), stop - k, self.ready[k], self.ready[stop])
        wall = max(self.received[stop] - self.received[k], 1e-9)
        waits = self.waits[k + 1:stop + 1]
        steps = self.steps[k:stop]  # the steps inside the window: the one after each item but its last
        return Measurement(
            samples_per_s=samples / wall,
            busy=min(1.0, sum(steps) / wall),
            wait_fraction=min(1.0, sum(waits) / wall),
            step_ms=(statistics.median(steps) if steps else 0.0) * 1000.0,
            wait_ms=statistics.median(waits) * 1000.0,
            startup_s=self.startup_s,
            startup_seen=self.startup_seen,
            batches=len(waits),
            samples=samples,
            window_s=wall,
            peak_memory_bytes=memory(),
            build_s=build_s,
            log_se=window_log_se(self.received[k], self.received[k + 1:stop + 1],
                                 self.counts[k + 1:stop + 1], self.workers),
        )


def settling_bound(limit: int, workers: int, backlog: int) -> int:
    """The item where a first stretch of ``limit`` items stops settling in at the latest (NOTE
    [ The first stretch settles in ]): room is left for a counted window of ``workers`` (NOTE
    [ Drained windows ]) and, after it, for the ``backlog`` its workers hold when its sampler stops,
    whose drain no window reads (NOTE [ The drain at a stretch's end ]). Without that room, a step-
    bound loop that served 16 workers' 256 items in less than the settling time had a window of one
    item left before the drain: half of such first stretches measured nothing, two epochs in a row,
    and the loader settled on the user's settings with nothing measured."""
    return limit - 1 - drained_span(workers) - backlog


class Failed(Exception):
    """A candidate's stretch failed for a reason of its own (kept in ``Stretch.failure``)."""

    def __init__(self, failure: Failure) -> None:
        super().__init__(str(failure))
        self.failure = failure


class Stretch:
    """One candidate serving up to ``limit`` items of the feed (``None``: to the end)."""

    def __init__(self, serving: Serving, settings: EpochSettings, candidate: Candidate, phase: Phase | None,
                 feed: Feed | None,
                 *, limit: int | None, baseline: bool, abandon_below: float = 0.0,
                 whole: bool = False, private: bool = False, window_s: float = STRETCH_WINDOW_S,
                 settle: bool = False) -> None:
        self.serving = serving
        self.settings = settings
        self.candidate = candidate
        self.phase = phase
        """The search phase it is measured for; ``None``: served, not measured."""
        self.feed = feed
        self.limit = limit
        self.baseline = baseline
        self.abandon_below = abandon_below
        self.whole = whole
        self.private = private
        """Never the loader's held (persistent) inner loader: another iterator may be using it."""
        self.from_start = feed is not None and feed.untouched()
        """It starts at its epoch's first item."""
        self.offset = 0
        """Items of the inner loader's sampler served before this stretch (one it continues on)."""
        self.handed_over = False
        """Its inner loader serves on in the next stretch: closing stops nothing, gives nothing back."""
        self.adopted_from: Stretch | None = None
        """The stretch whose inner loader it continues on, until it takes over."""
        self.served = 0
        self.raised = 0
        """Items whose loading raised the user's error (handed to the caller as that error)."""
        self.samples = 0
        self.failure: Failure | None = None
        self.abandoned = False
        self.interfered = False
        self.done = False
        self.sealed = False
        """Taking no more items: serving its backlog while the next stretch starts (NOTE above)."""
        self.recorded = False
        self.exhausted = False
        """The inner loader ran out before the stretch's limit: the epoch has no items left."""
        self.measurement: Measurement | None = None
        self.inner: Any = None
        self.sampler: FeedSampler | None = None
        self.prepared: Any = None
        """The cache the inner loader reads (or the dataset as it is): its build is the candidate's cost."""
        self.it: Any = None
        self.held = False
        self.started_at = 0.0
        self.last = 0.0
        self.fetch_s = 0.0
        self.fetch_cpu_s = 0.0
        """Wall and main-thread CPU time of the fetches after the first (``Outcome.load_cpu_share``)."""
        self.cpu_at_start: CpuSnapshot | None = None
        self.beside_step: float | None = None
        """``Outcome.loading_beside_step``, read once when the stretch's outcome is first asked for."""
        c = candidate
        backlog = c.num_workers * (c.prefetch_factor or 2) if c.num_workers else 0
        self.line = Timeline(backlog=backlog, workers=c.num_workers, window_s=window_s,
                             settle_s=window_s if settle else 0.0,
                             settle_items=(settling_bound(limit, c.num_workers, backlog)
                                           if settle and limit is not None else None))
        self.close_s = 0.0
        """What closing it took (its workers' exit): part of what it cost the loop."""
        self.worker_processes = 0
        """The inner iterator's worker processes, read as it starts serving: what an epoch's end
        stops where they are not persistent (``_stopping_workers``)."""
        self._signals = contextlib.ExitStack()

    @property
    def explored(self) -> bool:
        """Measured for a candidate other than the user's settings: its inner loader drops a batch
        that takes longer than the explore limit, where the user's settings would wait."""
        return self.phase is not None and not self.baseline

    def start(self) -> None:
        """Build the inner loader and start it (its workers, its first prefetch)."""
        self._began()
        self._signals.enter_context(CHILD_SIGNAL.installed(defer_outside_fetch=True))
        try:
            self.inner, self.sampler, self.held, self.prepared = self.serving.inner_for(
                self.candidate, self.settings, self.feed, self.limit, measured=self.phase is not None,
                baseline=self.baseline, private=self.private)
            # torch's own warnings for the user's settings were given by the loader's iter(); a
            # candidate's pickling failure is its reason, the baseline's the user's to see.
            with quiet_pickle_warning(None if self.baseline else self.inner):
                self.it = start_iterator(self.inner)
            self.worker_processes = self._stopping_workers()
        except Exception as err:
            if self.baseline:
                raise
            self.fail(err)

    def continues(self, prev: Stretch) -> bool:
        """Whether this stretch can serve on ``prev``'s inner loader (NOTE [ Continuing a stretch ]):
        the same candidate, worker processes or threads in order, nothing of ``prev`` lost."""
        c = prev.candidate
        return (self.candidate == c and prev.it is not None and not prev.held and prev.failure is None
                and self.explored == prev.explored  # the same batch time limit (the inner's timeout)
                and prev.limit is not None and prev.sampler is not None and self.feed is prev.feed
                and c.num_workers > 0 and c.in_order and not self.private
                and getattr(prev.it, "_in_order", True) is not False)

    def adopt(self, prev: Stretch) -> None:
        """Serve on ``prev``'s inner loader after ``prev``'s last item: its workers keep their queue
        full across the boundary instead of new ones starting (NOTE [ Continuing a stretch ])."""
        assert prev.limit is not None and prev.sampler is not None
        self._began()
        self._signals.enter_context(CHILD_SIGNAL.installed(defer_outside_fetch=True))
        self.inner, self.sampler, self.held, self.prepared, self.it = (
            prev.inner, prev.sampler, prev.held, prev.prepared, prev.it)
        self.offset = prev.offset + prev.limit
        self.sampler.limit = None if self.limit is None else self.offset + self.limit
        prev.handed_over = True
        self.adopted_from = prev
        self.line.startup_seen = False  # its workers run already: no start-up to wait for
        self.worker_processes = prev.worker_processes
        resume_sampling(self.it)

    def disown(self) -> None:
        """Give the inner loader back to the stretch it was adopted from (this one will not serve):
        that stretch stops it and gives back everything it took, in the feed's order."""
        prev, self.adopted_from = self.adopted_from, None
        if prev is not None and prev.sampler is not None and prev.limit is not None:
            prev.handed_over = False
            prev.sampler.limit = prev.offset + prev.limit
        self.it = self.sampler = None

    def fail(self, err: BaseException) -> None:
        self.failure = Failure.of(err)
        self.done = True
        raise Failed(self.failure) from err

    def next(self) -> Any:
        now = time.perf_counter()
        if self.it is None and not self.done:
            self.start()
            now = time.perf_counter()
        elif self.last:
            self.line.steps.append(now - self.last)
        if self.done:
            raise StopIteration
        measured = (self.phase is not None and not self.whole and not self.sealed
                    and self._measured_enough(now))
        if measured and (self.abandoned or not self._seal()):  # else it serves its backlog first
            self.done = True
            raise StopIteration
        if self.limit is not None and self.served + self.raised >= self.limit:
            self.done = True
            raise StopIteration
        if self.serving.live_iterators() > 1:
            self.interfered = True
        cpu = time.thread_time()
        try:
            with CHILD_SIGNAL.fetching():
                item = next(self.it)
        except StopIteration:
            # Workers running until this call and shut down now: torch stopped them as the epoch's
            # items ran out.
            if self.worker_processes and getattr(self.it, "_shutdown", False):
                self.serving.tuning.stopped(self.worker_processes, time.perf_counter() - now)
                self.worker_processes = 0
            self.done = True
            self.exhausted = self.limit is None or self.served + self.raised < self.limit
            raise
        except Exception as err:
            if self.baseline:
                # The user's own settings: the user's error, for this item, as torch raises it; the
                # stretch goes on with the next item, as torch's iterator does.
                self.raised += 1
                raise
            self.fail(err)
        got = time.perf_counter()
        if self.served == 0:
            self.line.startup_s = got - self.started_at
        else:
            self.fetch_s += got - now
            self.fetch_cpu_s += time.thread_time() - cpu
        n = batch_length(item, self.settings.batch_size or 1)
        self.line.item(now, got, n, ready_batches(self.it))
        if not self.line.sampler_done:
            self.line.sampler_done = self._sampler_done()
        self.served += 1
        self.samples += n
        self.last = time.perf_counter()
        return item

    def _sampler_done(self) -> bool:
        """Whether its sampler gave its last item: its limit, or the epoch's."""
        s, feed = self.sampler, self.feed
        return s is not None and (s.at_limit() or (feed is not None and feed.exhausted()))

    def _seal(self) -> bool:
        """Take no more items and serve the ones taken (NOTE [ Epochs and stretches ], hiding
        start-up; at the epoch's end, the items its workers hold are served rather than loaded
        again); ``False`` where there is nothing to serve or the next stretch could not start."""
        sampler, feed = self.sampler, self.feed
        if (sampler is None or feed is None or self.held
                or not self.candidate.num_workers or not self.candidate.in_order):
            return False
        if not feed.exhausted() and not (HIDE_STARTUP and feed.has_more()):
            return False
        if len(sampler.taken) <= self.offset + self.served + self.raised:
            return False
        sampler.limit = len(sampler.taken)
        self.limit = sampler.limit - self.offset
        self.sealed = True
        return True

    def _began(self) -> None:
        """The stretch's wall time counts from now; the user's settings also read the CPU times, to
        tell whether their workers compete with the step (NOTE [ Loading beside the step ])."""
        self.started_at = time.perf_counter()
        self.cpu_at_start = cpu_snapshot() if self.baseline and self.phase is not None else None

    def take_over(self) -> None:
        """A stretch started ahead of its turn begins serving: its start-up is what the loop waits
        from now to its first item, and its wall time counts from now."""
        self._began()
        self.adopted_from = None
        # Its workers started (or ran) while another stretch served; one not started yet (NOTE
        # [ No fork beside thread workers ]) starts now, and the loop waits for all of its start-up.
        self.line.startup_seen = self.it is None

    def _measured_enough(self, now: float) -> bool:
        if self.line.rate_below(self.abandon_below, now):
            self.abandoned = True
            self.measurement = self.line.measurement(self._build_s(), self._memory)
            return True
        if self.line.complete(now):
            self.measurement = self.line.measurement(self._build_s(), self._memory)
            return True
        return False

    def _memory(self) -> int:
        """What the main process and the stretch's workers hold (``Serving.memory``)."""
        return self.serving.memory(self.candidate, lambda: worker_pids(self.it))

    def _build_s(self) -> float:
        """What building the candidate's cache cost (a stretch that only loads through a filling
        cache has none of its own)."""
        if self.prepared is None or self.candidate.pretransform == "none":
            return 0.0
        return float(self.prepared.build_s)

    def close(self, *, keep: bool = False) -> None:
        """Stop the inner iterator (a held, persistent one stays, as does one handed over to the next
        stretch), give back what was not served; ``keep``: leave it running for now (``release``)."""
        t0 = time.perf_counter()
        if self.adopted_from is not None:
            self.disown()  # closed before taking over: the stretch it came from has it still
        if self.phase is not None and self.measurement is None and self.failure is None:
            self.measurement = self.line.measurement(self._build_s(), self._memory,
                                                     epoch=self._whole_epoch(), ended=True)
        if keep:
            self.done = True
        else:
            self.release()
        self.close_s = time.perf_counter() - t0

    def _whole_epoch(self) -> bool:
        """Whether it served every item of its epoch, from the first (NOTE [ A whole epoch ])."""
        # A stretch that continues another's loader, or starts ahead of its turn, finds the feed
        # already drawn from: ``from_start`` rules both out.
        return (self.from_start and self.feed is not None and self.feed.exhausted()
                and self._not_handed_out() == [])

    def keepable(self) -> bool:
        """Whether, run to its limit, it may keep its workers until the next stretch is known: they
        hold nothing it took (every item it took was handed out)."""
        left = self._not_handed_out()
        return (self.it is not None and not self.held and self.failure is None and self.limit is not None
                and self.candidate.num_workers > 0 and left is not None and not left)

    def release(self) -> None:
        """Stop the inner iterator (unless held or handed over) and give back what was not served."""
        left = None if self.handed_over else self._not_handed_out()
        if self.it is not None and not self.held and not self.handed_over:
            workers, t0 = self._stopping_workers(), time.perf_counter()
            stop_iterator(self.it)  # and what its workers left in /dev/shm
            if workers:
                self.serving.tuning.stopped(workers, time.perf_counter() - t0)
        if left is not None:
            assert self.feed is not None and self.sampler is not None
            self.feed.give_back(left)
            self.sampler.taken = []
        self.it = None
        self.done = True
        self._signals.close()

    def _stopping_workers(self) -> int:
        """Worker processes that stopping the inner iterator would stop: torch's own iterator stops
        those not persistent as an epoch's items run out, each epoch, and what that takes is scored
        (NOTE [ Score ] in decide.py). 0: none running, or threads (they stop at once)."""
        it = self.it
        if it is None or self.candidate.worker_kind != "process" or getattr(it, "_shutdown", True):
            return 0
        return len(getattr(it, "_workers", ()))

    def _not_handed_out(self) -> list[Any] | None:
        """The items the inner loader took from the feed and never handed out (``None``: not known)."""
        sampler, it = self.sampler, self.it
        if sampler is None or self.feed is None:
            return None
        if it is not None and getattr(it, "_in_order", True) is False and hasattr(it, "_task_info"):
            # Out of order: torch's iterator keeps the tasks it has not handed out in ``_task_info``,
            # keyed by the order it took them in; what it took but never sent comes after.
            taken = sampler.taken
            return [taken[k] for k in sorted(it._task_info) if k < len(taken)] + taken[it._send_idx:]
        if self.candidate.in_order:
            return sampler.taken[self.offset + self.served + self.raised:]
        return None

    def outcome(self) -> Outcome | None:
        if self.phase is None:
            return None
        m = None if self.interfered else self.measurement
        if self.cpu_at_start is not None:
            self.beside_step = loading_beside_step(self.cpu_at_start, cpu_snapshot())
            self.cpu_at_start = None
        return Outcome(self.candidate, self.phase, m, self.failure, self.abandoned and not self.interfered,
                       self.samples, (self.last or time.perf_counter()) - self.started_at + self.close_s
                       if self.started_at else 0.0,
                       self.fetch_cpu_s / self.fetch_s if self.fetch_s > 0 else None, self.beside_step)

    def remaining(self) -> int | None:
        return None if self.limit is None else max(0, self.limit - self.served - self.raised)


_TO_THE_END: Any = object()
"""A fallback that serves the rest of the epoch (the failed stretch had no limit)."""


class Driver:
    """What one kind of epoch serves next (see the subclasses); ``record`` hears each stretch's end."""

    def __init__(self, serving: Serving, settings: EpochSettings, feed: Feed | None) -> None:
        self.serving = serving
        self.settings = settings
        self.tuning = serving.tuning
        self.feed = feed

    def next_stretch(self) -> Stretch | None:
        raise NotImplementedError

    def record(self, stretch: Stretch) -> None:
        """A stretch ended."""

    def fallback(self, limit: int | None) -> Stretch:
        """The baseline, unmeasured, over what a failed stretch left (NOTE [ Epochs and stretches ])."""
        return self._stretch(self.tuning.baseline, None, limit)

    def end(self, complete: bool) -> None:
        """The epoch ended (``complete``: every item was served)."""

    def _stretch(self, c: Candidate, phase: Phase | None, limit: int | None, **kw: Any) -> Stretch:
        return Stretch(self.serving, self.settings, c, phase, self.feed, limit=limit,
                       baseline=c == self.tuning.baseline, **kw)


class SearchDriver(Driver):
    """An epoch that searches: stretches by the explorer's candidates, then the settled one."""

    def __init__(self, serving: Serving, settings: EpochSettings, feed: Feed | None) -> None:
        super().__init__(serving, settings, feed)
        try:
            self.epoch_items: int | None = len(settings.index_sampler)
        except TypeError:
            self.epoch_items = None
        self.tuning.epoch_items = self.epoch_items

    def next_stretch(self) -> Stretch | None:
        t = self.tuning
        if t.settled is not None:
            return self._stretch(t.settled, None, None)
        nxt = t.next_candidate()
        if nxt is None:
            decision = t.decision_due()
            if decision is None:
                return self._stretch(t.baseline, None, None)
            self.serving.settle(t.settle(decision))
            return self._stretch(t.settled or t.baseline, None, None)
        c, phase = nxt
        if self.feed is None:  # a stream: one candidate for the whole epoch
            return self._stretch(c, phase, None, whole=True)
        limit = t.stretch_length(c, self.epoch_items)
        first = phase == "baseline"
        if first:  # NOTE [ The first stretch settles in ]: twice the share, within the epoch
            limit = max(limit, min(2 * limit, self.epoch_items or 2 * limit))
            if self.epoch_items:  # its room for a window is counted within what the epoch holds
                limit = min(limit, self.epoch_items)
            t.start_filling()  # NOTE [ The search fills from its first stretch ]
        return self._stretch(c, phase, limit, abandon_below=t.abandon_below(phase), whole=t.together,
                             window_s=t.window_s(self.epoch_items), settle=first)

    def record(self, stretch: Stretch) -> None:
        if stretch.phase is not None and not stretch.interfered:
            self.tuning.record(stretch.outcome() or Outcome(stretch.candidate, stretch.phase))
        _settled_failed(self, stretch)

    def end(self, complete: bool) -> None:
        if complete and self.tuning.settled is None:
            settled = self.tuning.end_search_epoch()
            if settled is not None:
                self.serving.settle(settled)


def _settled_failed(driver: Driver, stretch: Stretch) -> None:
    """The settled configuration failed (its worker crashed, say): the baseline serves from now on."""
    t = driver.tuning
    if stretch.failure is None or stretch.phase is not None or stretch.candidate != t.settled:
        return
    log.info("autotune: %s failed on the loader at %s (%s); the baseline serves from now on",
             stretch.candidate.label(), t.origin, stretch.failure)
    t.settled_failed()
    driver.serving.settle(t.baseline)


def _more(feed: Feed | None) -> bool:
    """Whether an epoch whose stretch ran to its end still has items (a sampler longer than its
    ``__len__``: ``Feed.drained`` found one past it)."""
    return feed is not None and feed.has_more()


class SettledDriver(Driver):
    """An epoch of the settled configuration, timed for NOTE [ Settled means proven ]."""

    def __init__(self, serving: Serving, settings: EpochSettings, feed: Feed | None) -> None:
        super().__init__(serving, settings, feed)
        self.served: Stretch | None = None

    def record(self, stretch: Stretch) -> None:
        _settled_failed(self, stretch)

    def next_stretch(self) -> Stretch | None:
        if self.tuning.settled is None:
            return None
        if self.served is not None:
            # Items left past the sampler's length (it yields more than __len__ says): served too.
            return self._stretch(self.tuning.settled, None, None) if _more(self.feed) else None
        self.served = self._stretch(self.tuning.settled, None, None)
        return self.served

    def end(self, complete: bool) -> None:
        s = self.served
        if complete and s is not None and s.failure is None and not s.interfered:
            wall = (s.last or time.perf_counter()) - s.started_at if s.started_at else 0.0
            self.tuning.end_settled_epoch(s.samples, wall, sum(s.line.waits))


class PlainDriver(Driver):
    """A second live iterator of the same loader: what serves now, unmeasured, to the end."""

    def __init__(self, serving: Serving, settings: EpochSettings, feed: Feed | None) -> None:
        super().__init__(serving, settings, feed)
        self.served = False

    def next_stretch(self) -> Stretch | None:
        if self.served and not _more(self.feed):
            return None
        self.served = True
        return Stretch(self.serving, self.settings, self.tuning.serving(), None, self.feed, limit=None,
                       baseline=self.tuning.serving() == self.tuning.baseline, private=True)


def start_epoch(serving: Serving, settings: EpochSettings, fresh: bool) -> Driver:
    """An epoch: its feed from the loader's own sampler and, for a new iterator (not one reset),
    a base seed drawn as torch's iterators draw it; then the driver that serves it."""
    feed = None
    if not isinstance(settings.dataset, tud.IterableDataset):
        source = iter(settings.index_sampler)
        try:
            length: int | None = len(settings.index_sampler)
        except TypeError:  # a sampler without a length (one that never ends, say)
            length = None
        feed = Feed(source, length)
    if fresh:
        serving.draw_base_seed(settings.generator, datapipe=isinstance(settings.dataset, IterDataPipe))
    if feed is not None and serving.user_workers > 0:
        feed.prime(serving.user_workers * serving.user_prefetch)
    for it in list(serving.live):
        it.finish_if_served()  # an epoch a trainer stopped at len(loader) is over
    if serving.live_iterators():
        return PlainDriver(serving, settings, feed)  # a second live iterator, as torch allows
    t = serving.tuning
    t.begin_epoch()
    return (SettledDriver if t.settled is not None else SearchDriver)(serving, settings, feed)


class EpochIterator:
    """What ``iter(loader)`` returns: one epoch, served stretch by stretch by its driver.

    Torch's iterator protocol: ``next()``, ``len()``, and, for a loader whose user settings keep
    persistent workers, ``_reset`` to start the next epoch on the same object.
    """

    def __init__(self, loader: tud.DataLoader[Any], serving: Serving, *, fresh: bool = True) -> None:
        self._loader = loader
        """Kept, never called, so that the loader lives while its epoch is served (collected, it
        releases what its serving state holds, and ``autotune run`` reports it)."""
        self._serving = serving
        self._last_it: Any = None
        """The last stretch's torch iterator: its internals (``_workers``) stay readable after it."""
        self._start_epoch(loader, fresh=fresh)

    def _start_epoch(self, loader: tud.DataLoader[Any], fresh: bool) -> None:
        """Copy what the epoch serves with from ``loader`` (NOTE [ Serving state ] in serving.py)."""
        self._settings = EpochSettings.of(loader)
        self._driver = start_epoch(self._serving, self._settings, fresh)
        self._stretch: Stretch | None = None
        self._served = 0
        self._ended = False
        self._fallback: Any = None
        self._next: Stretch | None = None
        """The stretch started while a sealed one serves its backlog (NOTE [ Epochs and stretches ])."""
        self._kept: Stretch | None = None
        """A stretch that ran to its limit, its workers kept until the next is known (NOTE
        [ Continuing a stretch ])."""
        self._parked: Stretch | None = None
        """The user's settings run to a limit, their idle workers kept while other candidates are
        measured, for the next stretch of them this epoch (NOTE [ Continuing a stretch ])."""
        self._serving.live.add(self)
        if self._serving.eager_start:  # torch starts its workers in iter() for the user's settings
            stretch = self._open()
            if stretch is not None:
                try:
                    stretch.start()
                except Failed:
                    self._failed(stretch)

    def __iter__(self) -> EpochIterator:
        return self

    def __len__(self) -> int:
        return len(self._settings.index_sampler)  # as torch's iterator: a stream's has no length

    def __getattr__(self, name: str) -> Any:
        # torch's iterator internals (``_workers``, ...), where the current stretch's iterator has them
        stretch = self.__dict__.get("_stretch")
        it = stretch.it if stretch is not None and stretch.it is not None else self.__dict__.get("_last_it")
        if not name.startswith("__") and it is not None:
            return getattr(it, name)
        raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")

    def _open(self) -> Stretch | None:
        ahead = self._next
        stretch: Stretch | None
        if ahead is not None:
            self._next = None
            ahead.take_over()
            self._settle_kept(ahead)
            if self._parked is not None and self._parked.handed_over:
                self._release_parked()  # its workers serve ``ahead`` now: this stops nothing
            self._stretch = ahead
            if ahead.failure is not None:  # it failed as it started: its share goes to the baseline
                self._failed(ahead)
                return self._open()
            return ahead
        if self._fallback is not None:
            limit, self._fallback = self._fallback, None
            stretch = self._driver.fallback(None if limit is _TO_THE_END else limit)
        else:
            stretch = self._driver.next_stretch()
        self._settle_kept(stretch)
        self._resume_parked(stretch, take_over=True)
        self._stretch = stretch
        return stretch

    def _settle_kept(self, stretch: Stretch | None) -> None:
        """The kept stretch's workers serve ``stretch`` where it continues them; the user's settings
        wait with theirs while another candidate serves; anything else stops."""
        kept, self._kept = self._kept, None
        if kept is None:
            return
        if stretch is not None and stretch.it is None and stretch.continues(kept):
            stretch.adopt(kept)
            stretch.take_over()
        elif stretch is not None and kept.baseline and stretch.candidate != kept.candidate:
            self._park(kept, stretch)
            return
        kept.release()  # stops its workers unless ``stretch`` serves on them

    def _park(self, kept: Stretch, nxt: Stretch) -> None:
        """Keep the user's settings' idle workers while ``nxt``, another candidate, serves."""
        self._release_parked()
        self._parked = kept
        log.debug("autotune: %s waits with its workers while %s serves", kept.candidate.label(),
                  nxt.candidate.label())

    def _resume_parked(self, stretch: Stretch | None, *, take_over: bool) -> None:
        """Serve ``stretch`` on the parked workers where it continues them (``take_over``: now;
        otherwise once it takes over, in ``_open``); release them where nothing comes or a
        candidate is served for good (the search settled elsewhere)."""
        parked = self._parked
        if parked is None:
            return
        if stretch is not None and stretch.it is None and stretch.continues(parked):
            stretch.adopt(parked)
            if take_over:
                stretch.take_over()
                self._release_parked()  # its inner loader is the stretch's now: this stops nothing
        elif stretch is None or (stretch.phase is None and not stretch.baseline):
            self._release_parked()

    def _release_parked(self) -> None:
        parked, self._parked = self._parked, None
        if parked is not None:
            parked.release()

    def _start_next(self, sealed: Stretch) -> None:
        """``sealed`` has its measurement: record it and start the stretch after it now."""
        sealed.recorded = True
        self._driver.record(sealed)
        feed = self._driver.feed
        if feed is not None and feed.exhausted():
            return  # it holds the epoch's last items: no stretch comes after it
        nxt = self._driver.next_stretch()
        if nxt is None:
            return
        self._next = nxt
        if nxt.continues(sealed):  # the same candidate: its workers serve on (no start-up to hide)
            nxt.adopt(sealed)
            return
        self._resume_parked(nxt, take_over=False)
        if nxt.it is not None:  # it serves on the parked workers, which wait for no start-up
            return
        if sealed.candidate.threaded and nxt.candidate.processes:
            # NOTE [ No fork beside thread workers ]: it starts in its turn, the threads stopped.
            log.debug("autotune: %s starts once %s's threads have stopped", nxt.candidate.label(),
                      sealed.candidate.label())
            return
        self._driver.tuning.started_ahead += 1
        log.debug("autotune: %s starts while %s serves its last %d items", nxt.candidate.label(),
                  sealed.candidate.label(), sealed.remaining() or 0)
        try:
            nxt.start()
        except Failed:
            pass  # recorded when it takes over (``_open``)
        except Exception:
            # The user's own error, from the user's settings: raised in its turn, not ahead of it.
            self._drop_next()

    def _drop_next(self) -> None:
        """Close the stretch started ahead, unrecorded: it gives its items back to the feed's front."""
        nxt, self._next = self._next, None
        if nxt is not None:
            on_parked = nxt.adopted_from is not None and nxt.adopted_from is self._parked
            nxt.close()
            if on_parked:
                self._release_parked()  # what its workers took for ``nxt`` goes back to the feed

    def _failed(self, stretch: Stretch) -> None:
        """The rest of a failed stretch goes to the baseline (NOTE [ Epochs and stretches ])."""
        self._drop_next()
        left = stretch.remaining()
        self._close_stretch()
        if left != 0:
            self._fallback = _TO_THE_END if left is None else left

    def __next__(self) -> Any:
        while True:
            if self._ended:
                raise StopIteration
            stretch = self._stretch
            if stretch is None or stretch.done:
                self._close_stretch()
                stretch = self._open()
                if stretch is None:
                    self._end(complete=True)
                    raise StopIteration
            try:
                item = stretch.next()
            except StopIteration:
                # Kept: its workers may serve the next stretch, or (the user's settings) wait
                # while other candidates serve (NOTE [ Continuing a stretch ]).
                self._close_stretch(keep=(self._next is None or stretch.baseline)
                                    and not stretch.exhausted and stretch.keepable())
                if self._next is not None:
                    continue  # the stretch started ahead takes over (``_open``)
                feed = self._driver.feed
                if (stretch.exhausted and feed is None) or (feed is not None and feed.drained()):
                    self._end(complete=True)
                    raise
                continue
            except Failed:
                self._failed(stretch)
                continue
            if stretch.sealed and not stretch.recorded:
                self._start_next(stretch)
            self._served += 1
            self._serving.served_batches += 1
            if self._driver.tuning.cuda_data is None:
                self._driver.tuning.observe(item)
            return item

    def _close_stretch(self, *, keep: bool = False) -> None:
        """Close the current stretch and record it; ``keep``: its workers wait for the next stretch,
        which may serve on them (NOTE [ Continuing a stretch ])."""
        stretch, self._stretch = self._stretch, None
        if stretch is not None:
            self._release_kept()
            if stretch.it is not None:
                self._last_it = stretch.it
            stretch.close(keep=keep)
            if keep:
                self._kept = stretch
            if not stretch.recorded:
                stretch.recorded = True
                self._driver.record(stretch)

    def _end(self, complete: bool) -> None:
        if self._ended:
            return
        self._ended = True
        self._serving.live.discard(self)  # live: its epoch has not ended
        try:
            self._drop_next()
            self._close_stretch()
        finally:
            self._release_kept()
            self._driver.end(complete)

    def _release_kept(self) -> None:
        kept, self._kept = self._kept, None
        if kept is not None:
            kept.release()
        if self._ended:
            self._release_parked()

    def finish(self) -> None:
        """End an epoch whose every item was handed out but whose end was never asked for.

        Trainers stop at ``len(loader)`` items (Lightning does) instead of running the iterator to
        StopIteration, so the bookkeeping after the last item would never run. Here it does;
        anything else is closed.
        """
        if self._ended:
            return
        try:
            complete = self._served >= self._settings.length()
        except TypeError:  # no length
            complete = False
        self._end(complete)

    close = finish

    def finish_if_served(self) -> None:
        """End this epoch if every item of it was handed out (its end was simply never asked for)."""
        try:
            if not self._ended and self._served >= self._settings.length():
                self.finish()
        except TypeError:  # no length
            pass

    def _reset(self, loader: tud.DataLoader[Any], first_iter: bool = False) -> None:
        """The next epoch on this same iterator (persistent workers, as torch's ``_reset``), with
        what ``loader`` says now."""
        self.finish()
        self._start_epoch(loader, fresh=False)

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.finish()
