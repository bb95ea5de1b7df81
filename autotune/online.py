"""The drop-in's search policy: which candidate serves the next stretch of the user's epoch, and when
the search is over. It measures nothing itself (``epochs.py`` serves and times the stretches) and
decides nothing on its own: every outcome goes into the shared :class:`~autotune.decide.Ledger`, and
the choice is ``Ledger.decide`` (NOTE [ Decisions ] in decide.py), as in ``tune_loader``.

# NOTE [ Online search ]
# 1. The first stretch serves the baseline (what the user wrote, or PyTorch's defaults): its wait and
#    step per batch give the load time L and step time S.
# 2. Nothing to win: when the baseline's run waits for data less than MIN_WAIT_TO_EXPLORE of its
#    time (between batches, and while its workers start and stop: ``decide.waiting_share``; an
#    evaluation loader of a few batches that starts 16 workers each epoch mostly waits for them), no
#    loader can make the run faster by more than 1 / (1 - wait); only the torch thread counts are
#    tried (on CPU-only machines the step's own threads compete with the workers), and where there are
#    none the baseline is kept at once. A ram cache filling from the epoch stops filling: it could
#    only win what the waiting costs. Unless the baseline's workers run beside the step on CPUs busy
#    all the time (NOTE [ Loading beside the step ] in machine.py): where they take at least
#    MIN_BESIDE_STEP_TO_EXPLORE of the run's CPU, the step is slower by what they take though it
#    hardly waits. The cache removes their work: it keeps filling and is tried, then the torch
#    thread counts (no other worker count: the work per sample is the same at any count); the loss
#    bound (NOTE 4) weighs that share as it weighs the waiting.
# 3. Otherwise ceil(L / S) workers (decide.estimate_workers) are tried with processes and threads,
#    at most one per CPU left beside the step where the baseline's loading keeps a CPU busy
#    (CPU_BOUND_LOAD: such a dataset only competes past one worker per core, NOTE [ Worker bound ]
#    in space.py), with their neighbours, then a cache where its build can still pay for itself
#    over the run, then the torch thread counts around the best so far: at most MAX_CANDIDATES.
#    A ram cache already filled (from the first epoch's loading) goes first: read in the main
#    process it starts no workers, so a few batches tell, and it removes the per-sample work that
#    no worker count removes; on short epochs, where every stretch of workers pays their start-up,
#    it is what can win before the run ends.
#    A candidate below decide.PRUNE_RATIO of the best throughput so far is abandoned after a few
#    batches. Once the best so far waits for data less than MIN_WAIT_TO_EXPLORE of the time, or its
#    wait per sample is less than that share of the baseline's whole time per sample (a loop that
#    barely steps waits most of the time on any loader), no other loader can win more than that:
#    the loaders left in the queue are dropped, and only the torch thread counts around it are
#    tried.
#    Where the ram cache fills from the first epoch, the search waits for it (NOTE [ The cache
#    before the workers ] in tuning.py). On epochs too short for that wait, the cache fills while
#    the search goes on; one that is full before the finals end is tried at once, and the finals
#    start again with it among them: a dataset on slow storage with 4 workers written spent its second
#    epoch on finals between two worker settings a few percent apart and measured the filled cache
#    only in its third, a run 1.37x the user's where the cache was 6x faster. A cache that joined
#    and lost is not measured again in the check after settling (Tuning.begin_epoch).
# 4. Exploring is an investment with a bound: every stretch's cost is its wall time minus what the
#    baseline would have taken for the same samples (start-up and close included) at the first
#    stretch's rate (measured once the process warmed up: NOTE [ The first stretch settles in ] in
#    epochs.py), and once the total exceeds the larger of EXPLORE_LOSS_FRACTION of the run projected
#    at that rate and EXPLORE_WIN_SHARE of what the baseline's waiting for data costs that run (the
#    most any loader can win: a loop that waits more has more to win and may spend more to find it),
#    no new candidate is tried.
# 5. The finals: the best FINALISTS and the baseline, one stretch each per round, in rotated order,
#    at least MIN_FINAL_ROUNDS rounds and more, up to MAX_FINAL_ROUNDS, while the verdict against the
#    baseline is undecided. Then Ledger.decide: the challenger only when it wins with confidence.
#    Every stretch of the finals costs what the challenger is slower, so they are played only while
#    they can pay: a candidate enters them only when its exploring measurement beat the baseline by
#    more than decide.TIE_TOLERANCE (none did: the baseline is kept at once), and after every round a
#    challenger that could no longer win drops out: one that no longer leads the baseline, or that
#    the best challenger beats with confidence (once the noise is measured). When none is left, the
#    finals end there. They also end after any round where the pick already wins at the stricter
#    interim confidence (NOTE [ Decisions ] 5 in decide.py): a clear win is not measured again.
#    The same holds for a filled cache's check (``challenge``), which is played as finals.
# 6. A settled configuration that measures slower than the baseline's rate is checked again
#    (``recheck``): RECHECK_ROUNDS rounds of it against the baseline, decided by the same rule; the
#    baseline is used again unless the settled configuration still wins with confidence.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from .decide import (
    FINALISTS,
    PRUNE_RATIO,
    TIE_TOLERANCE,
    Decision,
    Failure,
    Ledger,
    Phase,
    estimate_workers,
    waiting_share,
)
from .measure import WARMUP_BATCHES, Measurement
from .space import Candidate, SearchSpace, WorkerKind

log = logging.getLogger("autotune")

STRETCH_MIN_BATCHES = 6
"""Items measured per stretch after its warm-up: enough for a median, cheap on short epochs."""

STRETCH_WINDOW_S = 0.75
"""Seconds measured per stretch at least (the offline window is 1 s for a minute's budget)..."""

MIN_STRETCH_WINDOW_S = 0.2
"""...unless the epoch is short: then a window is 1/STRETCHES_PER_EPOCH of the epoch, at least this."""

STRETCHES_PER_EPOCH = 16
"""Measured stretches one epoch should hold, so that a search fits in an epoch or two."""

MAX_STRETCH_FRACTION = 0.25
"""A stretch serves at most this share of an epoch, so one epoch compares several candidates."""

UNSIZED_STRETCH = 64
"""Items a stretch may serve when the epoch has no length (a sampler that never ends)."""

MIN_WAIT_TO_EXPLORE = 0.05
"""Below this share of waiting at the baseline, faster loading cannot pay for trying it (NOTE 2)."""

MIN_BESIDE_STEP_TO_EXPLORE = 0.2
"""Workers that take this share of the run's CPU on busy CPUs or more slow the step enough that the
cache, which removes their work, is tried though the step hardly waits (NOTE 2)."""

MAX_CANDIDATES = 8
"""Candidates explored at most before the finals (the estimate makes more rarely worth it)."""

EXPLORE_LOSS_FRACTION = 0.01
"""Exploring stops once it has cost this share of the run projected at the baseline (NOTE 4)..."""

EXPLORE_WIN_SHARE = 0.05
"""...or, where more, this share of what waiting for data costs the baseline's run (NOTE 4)."""

MIN_FINAL_ROUNDS = 2
"""Rounds of the finals at least: the baseline then has three measurements and a noise estimate."""

MAX_FINAL_ROUNDS = 4
"""Rounds of the finals at most; undecided after them, the baseline is kept."""

CPU_BOUND_LOAD = 0.5
"""Loading in the main process that keeps its thread on a CPU this share of the time it takes is
CPU-bound: more workers than CPUs beside the step only compete for them (NOTE 3)."""

RECHECK_ROUNDS = 3
"""Rounds of a settled configuration against the baseline when it is checked again (NOTE 6): three
give each two degrees of freedom of noise, enough to tell a clear loss from a wobble."""


DRAINED_CYCLES = 2
"""Batches per worker a window between two fetches that waited spans at least: each end may count
up to a batch per worker still in hand (NOTE [ Drained windows ] in epochs.py)."""


def drained_span(workers: int) -> int:
    """Items between the two waited fetches of a drained window (NOTE [ Drained windows ])."""
    return max(STRETCH_MIN_BATCHES, DRAINED_CYCLES * workers)


def stretch_items(c: Candidate) -> int:
    """Items a measured stretch of ``c`` may need: the warm-up, a second backlog, the window (where
    the loop never waits for data, nothing shorter proves the workers' queue drained)."""
    backlog = c.num_workers * (c.prefetch_factor or 2)
    return WARMUP_BATCHES + 2 * backlog + STRETCH_MIN_BATCHES + 1


def drained_items(c: Candidate) -> int:
    """Items a measured stretch of ``c`` needs where the loop waits for data (the search explores
    only there): the warm-up, the workers' first round, and a drained window."""
    return WARMUP_BATCHES + c.num_workers + drained_span(c.num_workers) + 1


@dataclass(frozen=True)
class Outcome:
    """What one stretch did: measured, failed, abandoned, or too short to say."""

    candidate: Candidate
    phase: Phase
    measurement: Measurement | None = None
    failure: Failure | None = None
    abandoned: bool = False
    samples: int = 0
    wall_s: float = 0.0
    """From the stretch's first fetch to its end, the user's steps, the start-up and the close
    (its workers' exit) included."""
    load_cpu_share: float | None = None
    """The main thread's CPU time over the wall time of its fetches (``None``: not timed): near 1
    where loading in the main process computes, near 0 where it waits on storage or on workers."""
    loading_beside_step: float | None = None
    """The share of the run's CPU its worker processes took on busy CPUs (NOTE [ Loading beside the
    step ] in machine.py; ``None``: not read, as for every candidate but the user's settings)."""


@dataclass
class Explorer:
    """The online search of one loader (see NOTE [ Online search ])."""

    space: SearchSpace
    baseline: Candidate
    ledger: Ledger
    allowed_fields: dict[str, Any] = field(default_factory=dict)
    """Candidate fields fixed by the user: every candidate has these values."""
    cache_build_s: float | None = None
    """The estimated build time of a cache (``None``: unknown or no cache applies)."""
    longest_stretch: int | None = None
    """Items one measured stretch may take (a share of the epoch); ``None``: no bound."""
    cache_ready: bool = True
    """Whether a ram cache that fills from the loading pass is full enough to be measured."""
    cpus: int | None = None
    """CPUs this loader may use (its rank's share); ``None``: no CPU bound on the estimate."""
    shared_cache: bool = False
    """Whether the ram cache is in shared memory, where worker processes read what it holds."""
    gathered_cache: bool = False
    """Whether the ram cache serves each batch by one gather, with nothing left to run per sample."""
    queue: list[Candidate] = field(default_factory=list)
    phase: Phase = "baseline"
    loss_s: float = 0.0
    estimated: bool = False
    nothing_to_win: bool = False
    """The baseline hardly waits for data (NOTE 2): no loader, and no cache, can pay for itself."""
    beside_step: float = 0.0
    """The share of the run's CPU the baseline's workers took beside a step on busy CPUs, where that
    is what there is to win (NOTE 2); else 0."""
    neighbours_tried: bool = False
    caches_tried: bool = False
    threads_tried: bool = False
    rounds: list[list[Candidate]] = field(default_factory=list)
    finalists: list[Candidate] = field(default_factory=list)
    dropped: set[Candidate] = field(default_factory=set)
    """Challengers that dropped out of the finals: they could no longer win (NOTE 5)."""
    decision: Decision | None = None

    # -- what to serve -----------------------------------------------------------------------------

    def next(self) -> tuple[Candidate, Phase] | None:
        """The candidate for the next stretch and its phase, or ``None``: decided (see ``decision``)."""
        if self.decision is not None:
            return None
        if self.phase == "baseline":
            return self.baseline, "baseline"
        if (self.phase == "final" and not self.caches_tried and self.cache_ready
                and self.cache_candidates() and self._may_explore()):
            # A cache that filled while the finals played joins them (NOTE 3): it is tried now,
            # and the finals start again with it among them, rather than after they are decided.
            self.phase, self.rounds = "online", []
        if self.phase == "online":
            self._fill_queue()
            while self.queue and not self.allowed(self.queue[0]):
                self.queue.pop(0)
            self._nothing_left_to_win()
            if self.queue and self._may_explore():
                return self.queue[0], "online"
            self._start_rounds(MIN_FINAL_ROUNDS, "final")
        return self._next_in_rounds()

    def abandon_below(self, phase: Phase) -> float:
        """Samples/s under which a stretch is abandoned early (0: never, as in finals)."""
        return PRUNE_RATIO * self.ledger.best_sps if phase == "online" else 0.0

    def allowed(self, c: Candidate) -> bool:
        if c in self.ledger.tried() or self.space.check(c) is not None or not self.fits(c):
            return False
        if replace(c, persistent_workers=self.baseline.persistent_workers) == self.baseline:
            return False  # the baseline itself: keeping workers alive changes nothing in a stretch
        return all(getattr(c, k) == v for k, v in self.allowed_fields.items())

    def fits(self, c: Candidate) -> bool:
        """Whether a stretch of ``c`` can be measured within ``longest_stretch`` items."""
        return self.longest_stretch is None or drained_items(c) <= self.longest_stretch

    @classmethod
    def recheck(cls, space: SearchSpace, baseline: Candidate, settled: Candidate, ledger: Ledger,
                rounds: int = RECHECK_ROUNDS) -> Explorer:
        """A search of ``settled`` against the baseline alone, in ``rounds`` rounds (NOTE 6),
        recorded in a ledger of its own: the machine may have changed since the first search."""
        ex = cls(space, baseline, ledger, phase="recheck", estimated=True, neighbours_tried=True,
                 caches_tried=True, threads_tried=True)
        ex.finalists = [settled, baseline]
        ex.rounds = [[settled, baseline] if r % 2 == 0 else [baseline, settled] for r in range(rounds)]
        return ex

    @classmethod
    def challenge(cls, space: SearchSpace, baseline: Candidate, candidates: list[Candidate],
                  ledger: Ledger) -> Explorer:
        """``candidates`` (a cache filled since the search, and the settled choice) and the baseline
        in RECHECK_ROUNDS rotated rounds, decided by the same rule (NOTE 5)."""
        ex = cls(space, baseline, ledger, phase="final", estimated=True, neighbours_tried=True,
                 caches_tried=True, threads_tried=True)
        ex.finalists = [*dict.fromkeys(candidates), baseline]
        first = list(dict.fromkeys([*candidates, baseline]))
        ex.rounds = [first[r % len(first):] + first[:r % len(first)] for r in range(RECHECK_ROUNDS)]
        return ex

    # -- what was seen -----------------------------------------------------------------------------

    def record(self, o: Outcome) -> None:
        c = o.candidate
        if o.failure is not None:
            self.ledger.record(c, o.phase, "failed", reason=str(o.failure), duration_s=o.wall_s)
        elif o.abandoned:
            self.ledger.record(c, o.phase, "pruned", m=o.measurement, duration_s=o.wall_s,
                               reason="abandoned: clearly slower than the best so far")
        elif o.measurement is not None:
            self.ledger.record(c, o.phase, "complete", m=o.measurement, duration_s=o.wall_s)
        else:
            # The epoch ended (or another iterator interfered) before a window was measured: the
            # candidate is served again later, unless it was a final round's, which then moves on.
            self._played(c)
            return
        if c in self.queue:
            self.queue.remove(c)
        self._played(c)
        base = self.ledger.by_candidate.get(self.baseline)
        if base and c != self.baseline and o.samples:
            base_sps = base[0].measurement.samples_per_s if base[0].measurement else 0.0
            if base_sps > 0:
                self.loss_s += o.wall_s - o.samples / base_sps
        if self.phase == "baseline":
            self._after_baseline(o)

    def _played(self, c: Candidate) -> None:
        """A stretch of the round in progress was served: the round moves on."""
        if self.phase in ("final", "recheck") and self.rounds and self.rounds[0] and self.rounds[0][0] == c:
            self.rounds[0].pop(0)

    def _after_baseline(self, o: Outcome) -> None:
        m = o.measurement
        if m is None:
            if o.failure is not None:  # the user's own settings failed: nothing to compare against
                self.decision = self.ledger.decide([self.baseline], self.baseline) if (
                    self.baseline in self.ledger.by_candidate) else None
            return  # no window yet: the baseline is served again
        self.phase = "online"
        beside = o.loading_beside_step or 0.0
        wait = self._waiting(m)
        if wait < MIN_WAIT_TO_EXPLORE and beside >= MIN_BESIDE_STEP_TO_EXPLORE and any(
                c.pretransform == "ram" for c in self.cache_candidates()):
            log.info("autotune: the loop waits for data %.0f%% of the run with the baseline settings,"
                     " but their workers take %.0f%% of the run's CPU on busy CPUs; the cache, which"
                     " removes their work, is tried", 100 * wait, 100 * beside)
            self.beside_step = beside
            self.estimated = self.neighbours_tried = True
            return
        if wait < MIN_WAIT_TO_EXPLORE:
            log.info("autotune: the loop waits for data %.0f%% of the run with the baseline settings;"
                     " only the torch thread count can help", 100 * wait)
            self.estimated = self.neighbours_tried = self.caches_tried = self.nothing_to_win = True
            return
        self.estimated = True
        cpu_bound = o.load_cpu_share is not None and o.load_cpu_share >= CPU_BOUND_LOAD
        self.queue.extend(self._from_estimate(m, max(1, self.cpus - 1) if cpu_bound and self.cpus else None))

    # -- the exploration queue ---------------------------------------------------------------------

    def _may_explore(self) -> bool:
        """Within MAX_CANDIDATES and the loss bound (NOTE 4)."""
        explored = {r.candidate for r in self.ledger.records if r.phase == "online"}
        if len(explored) >= MAX_CANDIDATES:
            return False
        projected = self._projected_run_s()
        if projected is None:
            return True
        base = self.ledger.by_candidate[self.baseline][0].measurement
        to_win = max(self._waiting(base) if base is not None else 0.0, self.beside_step)
        return self.loss_s <= max(EXPLORE_LOSS_FRACTION, EXPLORE_WIN_SHARE * to_win) * projected

    def _waiting(self, m: Measurement) -> float:
        """The share of the run the baseline's loop waits for data, its workers' start-ups and stops
        included (``decide.waiting_share``)."""
        return waiting_share(m, self.baseline, self.ledger.dataset_len, self.ledger.epochs,
                             self.ledger.stop_per_worker_s)

    def _nothing_left_to_win(self) -> None:
        """Where the best so far hardly waits for data, no other loader can be faster by more than
        what it waits (NOTE 2): the loaders queued are dropped, and only the torch thread counts
        around it are left to try (NOTE 3)."""
        best = self.ledger.pick(self.ledger.by_candidate)
        if best is None or best.candidate == self.baseline:
            return
        base = self.ledger.summarize(self.baseline) if self.baseline in self.ledger.by_candidate else None
        # Its wait per sample against the baseline's whole time per sample: a loop that barely steps
        # waits most of the time on any loader, but one many times faster has little left to win.
        left = best.wait_fraction * (base.samples_per_s / best.samples_per_s
                                     if base is not None and best.samples_per_s > 0 else 1.0)
        if min(best.wait_fraction, left) >= MIN_WAIT_TO_EXPLORE:
            return
        same = replace(best.candidate, torch_threads=None)
        self.queue = [c for c in self.queue if replace(c, torch_threads=None) == same]
        self.neighbours_tried = self.caches_tried = True

    def _projected_run_s(self) -> float | None:
        base = self.ledger.by_candidate.get(self.baseline)
        n = self.ledger.dataset_len
        if not base or not n or base[0].measurement is None or base[0].measurement.samples_per_s <= 0:
            return None
        return self.ledger.epochs * n / base[0].measurement.samples_per_s

    def _fill_queue(self) -> None:
        if not self.caches_tried and self.cache_ready:
            # A filled cache first (NOTE 3): it starts no workers, so trying it costs a few batches,
            # and it removes the per-sample work no worker count removes.
            self.caches_tried = True
            self.queue[:0] = [c for c in self._caches() if c not in self.queue]
        if self.queue:
            return
        if not self.neighbours_tried:
            self.neighbours_tried = True
            self.queue.extend(self._neighbours())
        if not self.queue and not self.threads_tried:
            self.threads_tried = True
            best = self.ledger.pick(self.ledger.by_candidate)
            if best is not None and "torch_threads" not in self.allowed_fields:
                self.queue.extend(c for c in self._threads_around(best.candidate) if self.allowed(c))

    def conform(self, c: Candidate) -> Candidate:
        """``c`` with the user's fixed settings applied (prefetch and persistence made consistent)."""
        fixed = {k: v for k, v in self.allowed_fields.items() if k in Candidate.__dataclass_fields__}
        c = replace(c, **fixed)
        if c.pin_memory and not self.space.cuda and not self.space.pinned:
            # pin_memory=True written but not fixed (``autotune run``), without CUDA: torch pins
            # nothing there, so the candidates derived from it are the same loaders unpinned
            c = replace(c, pin_memory=False)
        if c.num_workers == 0:
            return replace(c, prefetch_factor=None, persistent_workers=False, worker_kind="process",
                           in_order=True)
        pf = c.prefetch_factor if c.prefetch_factor in self.space.prefetch_factors else 2
        return replace(c, prefetch_factor=pf,
                       persistent_workers=self.space.persistent and c.worker_kind == "process")

    def _from_estimate(self, m: Measurement, cpu_bound: int | None = None) -> list[Candidate]:
        """The worker count that would keep the step busy, with processes and with threads, at most
        ``cpu_bound`` where loading is CPU-bound (NOTE 3)."""
        base = replace(self.space.baseline(), batch_size=self.baseline.batch_size, torch_threads=None)
        out: list[Candidate] = []
        kinds: tuple[tuple[WorkerKind, int], ...] = (("process", self.space.max_workers),
                                                     ("thread", self.space.max_threads))
        for kind, n in kinds:
            fitting = [w for w in range(1, n + 1)
                       if self.fits(replace(base, num_workers=w, prefetch_factor=2))]
            if fitting:
                bound = min(max(fitting), cpu_bound or max(fitting))
                out.append(self.conform(replace(base, num_workers=estimate_workers(m, bound),
                                                worker_kind=kind, prefetch_factor=2)))
        return [c for c in dict.fromkeys(out) if self.allowed(c)]

    def _neighbours(self) -> list[Candidate]:
        """One worker more and one fewer than the best so far, of its kind."""
        best = self.ledger.pick(self.ledger.by_candidate)
        if best is None or best.candidate.num_workers == 0:
            return []
        c = best.candidate
        bound = self.space.max_workers if c.worker_kind == "process" else self.space.max_threads
        out = [self.conform(replace(c, num_workers=w)) for w in (c.num_workers + 1, c.num_workers - 1)
               if 1 <= w <= bound]
        return [x for x in out if self.allowed(x)]

    def _caches(self) -> list[Candidate]:
        """The cache strategies, once the workers are known, where the build can still pay off.

        A cache removes the per-sample work of its prefix but costs its build inside the user's
        epoch: it is tried only while the best so far still waits for data long enough that the
        time to win over the run exceeds the build's estimate; a cache not tried is recorded, with
        the reason.
        """
        best = self.ledger.pick(self.ledger.by_candidate)
        n = self.ledger.dataset_len
        if best is None or not n:
            return []
        m = best.measurement
        step_bound = m.samples_per_s / max(1e-9, 1.0 - m.wait_fraction)  # no waiting at all
        to_win = self.ledger.epochs * n * (1.0 / m.samples_per_s - 1.0 / step_bound)
        out: list[Candidate] = []
        for cached in self.cache_candidates():
            build_s = self.cache_build_s if cached.pretransform == "device" else None
            if build_s is not None and build_s > to_win:
                self.ledger.record(cached, "online", "infeasible", reason=(
                    f"pretransform='device': its build (~{build_s:.1f} s) would cost more"
                    f" than waiting for data costs the best configuration over {self.ledger.epochs}"
                    f" epochs (~{to_win:.1f} s)"))
                continue
            out.append(cached)
        return out

    def cache_candidates(self) -> list[Candidate]:
        """The caches, read in the main process, and the ram cache also by one thread worker (the
        random rest of the transform may still want one, and a gather overlaps the step) and, where
        it is in shared memory and work is left per sample, by a worker process per CPU with the
        step on the fewest torch threads: what is left of loading then runs beside a step that
        leaves the other CPUs to it, not between steps as in the main process. Where a batch is one
        gather, a worker process would copy back what it gathered: it costs the step more than it
        takes off it, and is not tried."""
        out: list[Candidate] = []
        for strategy in ("ram", "device"):
            if strategy not in self.space.pretransforms:
                continue
            cached = self.conform(replace(self.baseline, pretransform=strategy, num_workers=0))
            out.append(cached)
            if strategy == "ram" and self.space.max_threads > 0:
                out.append(self.conform(replace(cached, num_workers=1, worker_kind="thread",
                                                prefetch_factor=2)))
            if (strategy == "ram" and self.shared_cache and not self.gathered_cache and self.cpus
                    and self.space.max_workers > 0):
                threads = [t for t in self.space.torch_threads if t is not None]
                out.append(self.conform(replace(
                    cached, num_workers=min(self.cpus, self.space.max_workers), worker_kind="process",
                    prefetch_factor=2, torch_threads=min(threads) if threads else cached.torch_threads)))
        return [c for c in dict.fromkeys(out) if self.allowed(c)]

    def _threads_around(self, best: Candidate) -> list[Candidate]:
        current = best.torch_threads or torch.get_num_threads()
        # Conformed: the baseline as written may lie outside the space (its workers not kept alive).
        return [self.conform(replace(best, torch_threads=t)) for t in self.space.torch_threads
                if t is not None and t != current]

    # -- finals ------------------------------------------------------------------------------------

    def _start_rounds(self, rounds: int, phase: Phase) -> None:
        self.phase = phase
        finalists = self.ledger.finalists(self.baseline, self.space)[:FINALISTS + 2]
        self.finalists = [c for c in finalists
                          if c == self.baseline or (self._ahead(c) and c not in self.dropped)]
        if len(self.finalists) <= 1 < len(finalists):
            self.decision = self._not_worth_finals(finalists)
        if len(self.finalists) <= 1:
            self.rounds = []
            return
        # The best first and the baseline second in round one, rotated after, as offline.
        first = list(dict.fromkeys([self.finalists[0], self.baseline, *self.finalists[1:]]))
        self.rounds = [first[r % len(first):] + first[:r % len(first)] for r in range(rounds)]

    def _ahead(self, c: Candidate) -> bool:
        """Whether ``c`` measured ahead of the baseline by more than TIE_TOLERANCE (NOTE 5)."""
        if self.baseline not in self.ledger.by_candidate or c not in self.ledger.by_candidate:
            return True  # nothing to compare with: the finals measure it
        base = self.ledger.summarize(self.baseline).score
        return self.ledger.summarize(c).score > (1.0 + TIE_TOLERANCE) * base

    def _not_worth_finals(self, finalists: list[Candidate]) -> Decision:
        """The baseline, kept without finals: no candidate measured far enough ahead of it."""
        base = self.ledger.summarize(self.baseline)
        best = self.ledger.pick(c for c in finalists if c != self.baseline)
        assert best is not None
        verdict = self.ledger.verdict(best.candidate, self.baseline)
        measured = verdict.describe() if verdict is not None else "without a score"
        return Decision(base, base, best, verdict, (
            f"kept the baseline: the best other configuration, {best.candidate.label()}, measured"
            f" {measured}, not ahead of the baseline by more than {TIE_TOLERANCE:.0%}, so not worth"
            " measuring again"))

    def _could_win(self, c: Candidate, best: Candidate) -> bool:
        """Whether challenger ``c`` may still win the finals (NOTE 5): it leads the baseline so far
        and ``best``, the challenger Ledger.decide would pick now, does not beat it with confidence."""
        verdict = self.ledger.verdict(c, self.baseline)
        if verdict is None:
            return True  # no window measured yet: another round may measure it
        behind = self.ledger.verdict(c, best)  # of ``best`` against itself: even, never a loss
        return verdict.ratio > 1.0 and not (behind is not None and behind.loses)

    def _drop_out(self) -> None:
        """After a round of the finals: challengers that could no longer win play no more rounds
        (NOTE 5); when no measured one is left, the finals end. They stay finalists: Ledger.decide
        weighs what they measured, and says why the baseline is kept."""
        challengers = [c for c in self.finalists if c != self.baseline and c not in self.dropped]
        best = self.ledger.pick(challengers)
        left = [c for c in challengers if self._could_win(c, best.candidate)] if best is not None else []
        self.dropped.update(c for c in challengers if c not in left)
        if not any(c in self.ledger.by_candidate for c in left):
            self.rounds = []  # no measured challenger could win; an unmeasured one alone is not worth rounds
            return
        self.rounds = [[c for c in r if c not in self.dropped] for r in self.rounds]

    def _next_in_rounds(self) -> tuple[Candidate, Phase] | None:
        while self.rounds and not self.rounds[0]:
            self.rounds.pop(0)
            if self.phase == "final" and self.rounds:
                self._drop_out()
            if self.phase == "final" and self.rounds and self.ledger.decided_early(
                    [c for c in self.finalists if c not in self.dropped], self.baseline):
                self.rounds = []  # NOTE [ Decisions ] 5 in decide.py: a clear win needs no more rounds
            if not self.rounds:
                self._after_rounds()
        if self.decision is not None:
            return None
        if not self.rounds:
            self._after_rounds()
            return None if self.decision is not None else self._next_in_rounds()
        return self.rounds[0][0], self.phase

    def _after_rounds(self) -> None:
        decision = self.ledger.decide(self.finalists or [self.baseline], self.baseline)
        verdict = decision.verdict
        played = sum(1 for r in self.ledger.records if r.phase == self.phase and r.candidate == self.baseline)
        undecided = verdict is not None and verdict.open and verdict.ratio > 1.0
        if undecided and self.phase == "final" and played < MAX_FINAL_ROUNDS:
            self._start_rounds(1, "final")  # one more round while the verdict is open
            if self.rounds:
                return
        base = self.ledger.by_candidate.get(self.baseline)
        m = base[0].measurement if base else None
        if self.nothing_to_win and decision.challenger is None and m is not None:
            decision = replace(decision, reason=(
                f"the loop waited for data {self._waiting(m):.1%} of the run with the baseline settings:"
                " no loader can make the run faster, so nothing else was tried"))
        self.decision = decision
