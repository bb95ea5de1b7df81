"""One drop-in loader's tuning across its epochs: the settings the user fixed, the baseline, the
online search (``online.Explorer``) and its ledger, the settled configuration and the checks on it.

Per-epoch state lives in the epoch's iterator (``epochs.py``); what outlives an epoch lives here,
and what serves it (the inner loader kept, the thread count, the base seed) in ``serving.py``.

# NOTE [ Settled means proven ]
# A configuration other than the baseline is kept only while it keeps its promise. After each whole
# settled epoch its rate (samples over the epoch's wall time, the user's steps included, as the
# stretches were measured) is compared with the baseline's measured rate: below it by more than the
# measured noise (at least RECHECK_MARGIN) in SLOW_EPOCHS epochs in a row, the next epoch measures the
# two side by side again (NOTE [ Online search ] 6 in online.py), and the baseline is used again
# unless the settled configuration still wins with confidence; the log and the result say so.
# Drift: when the share of time spent waiting for data rises DRIFT_WAIT_RISE above the first settled
# epoch's in DRIFT_EPOCHS epochs in a row, the next epoch explores again, but never sooner than
# MIN_EPOCHS_BETWEEN_SEARCHES epochs after the last search and only with epochs left to pay for it, so
# a loaded machine cannot make the loader thrash.
# A ram cache that filled from the epochs after the search settled is measured against the settled
# choice and the baseline at the next epoch boundary (``Explorer.challenge``), once, and only with
# two epochs left at least: the one it is measured in, and one to win back what measuring cost; and
# not where the loop waited for data less than MIN_WAIT_TO_EXPLORE of the time on the settled choice
# (over its first settled epoch, else in the search): a cache shortens only the loading, so there it
# could not win what measuring it costs, and the fill stops. A cache configuration replaces the
# settled choice only when it beats the baseline with confidence; a settled choice that won its own
# search stays unless the check measures it slower than the baseline with confidence (a check that
# ends without a winner is no proof that it stopped winning).
#
# NOTE [ The baseline measured warm ]
# A search whose finals never measured the baseline (its epochs ran out first) decides against the
# baseline's first stretch alone, taken while the process warms up and a ram cache fills through it.
# Of 16 workers written, six such first windows read 1,469-2,147 samples/s (mean 1,680) where the
# user's own epochs beside them ran at 1,680-2,240 (mean 1,960): the speed-up reported leaned high,
# 1.13x a plain loop's over the returned loader in the median of the decision benchmark's w16 cases.
# So such a search settles and stores its pick as it is, and at the next epoch boundary, with two
# epochs left at least (the one measured in, and one to use what it decides), the pick and the
# baseline play CONFIRM_ROUNDS rounds in a ledger of their own; its decision replaces the stored one:
# the pick's figures as measured against the warm baseline, or the baseline where it beat the pick
# with confidence. A check that ends without a winner keeps the pick (it won its search), with the
# check's figures. Taking that measurement before settling instead (one more search epoch) delayed
# the decision past the end of short runs whose length is guessed (10 epochs where none is given): a
# 2-epoch fit ended "still exploring" and stored nothing.
#
# NOTE [ The cache before the workers ]
# Where a ram cache fills from the first epoch and the baseline's own stretches fill it (it is in
# shared memory, or the baseline reads in the main process or in threads), the first epoch measures
# the baseline's first stretch and then serves the baseline, unmeasured, to the epoch's end; the
# search goes on in the next epoch with the filled cache first (NOTE [ Online search ] 3 in
# online.py). Worker counts explored while the cache fills would each pay a start of workers, and
# finals between them would be decided before the cache could be measured, only for the cache's check
# to measure everything again: on short epochs that cost the run more than it won (an ImageFolder
# with 2 workers written, 4 epochs: the first epoch 1.8-2.0x the user's). Only with three epochs at
# least (one to fill, one to measure, one to use), on epochs that hold HOLD_MIN_STRETCHES of the
# baseline's shortest measured stretches (on a shorter one, a whole epoch is too much of the search's
# room: a run of two such epochs would end undecided; there the search explores while the cache
# fills), and not under torchrun (the ranks' caches fill apart). That epoch does not count against
# MAX_SEARCH_EPOCHS: it measured nothing but the baseline.
#
# NOTE [ The baseline's epoch ]
# The same holds for a first epoch that the baseline's first stretch held whole: on short epochs the
# stretch that settles in (NOTE [ The first stretch settles in ] in epochs.py) of many workers may
# take all of one (16 workers, two batches each: 73 items, twice that to settle in, every one of the
# 128 batches of a 4,096-image epoch). That epoch too measured nothing but the baseline; counted, it
# left the search one epoch, whose finals measured the baseline once at most.
#
# NOTE [ An undecided profile is resumed ]
# A run too short to decide (torchvision's reference script, 3 epochs of a step that hardly waits:
# a ram cache led the user's 16 workers by 1.39x, 90 % interval 0.97-2.00x, when the epochs ran out)
# stores the baseline, undecided. A stored profile settles the next run at once, so without more
# that run would serve the baseline unmeasured and store nothing new: every later run stays
# undecided. So a stored profile that kept the baseline undecided against a ram cache starts the
# cache's fill at once: the first epoch fills it as it serves the baseline, and the next boundary
# measures it against the baseline (the filled cache's check of NOTE [ Settled means proven ],
# whatever the loop waited: the profile already measured the cache ahead). Its decision is stored
# in place of the undecided one. Only with three epochs at least, as for any filled cache.
"""

from __future__ import annotations

import collections
import contextlib
import enum
import logging
import math
import statistics
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import Any, TypeVar, cast

from torch.utils.data import default_collate

from . import pretransform as pt
from . import profiles
from .decide import Decision, Ledger, TrialRecord
from .describe import contains_cuda
from .distributed import reduce_measurements
from .exceptions import CandidateError, ProfileStoreError, ProfileStoreWarning
from .machine import CpuSnapshot, cpu_snapshot, others_load
from .measure import Measurement
from .online import (
    MAX_STRETCH_FRACTION,
    MIN_BESIDE_STEP_TO_EXPLORE,
    MIN_STRETCH_WINDOW_S,
    MIN_WAIT_TO_EXPLORE,
    STRETCH_WINDOW_S,
    STRETCHES_PER_EPOCH,
    UNSIZED_STRETCH,
    Explorer,
    Outcome,
    drained_items,
    stretch_items,
)
from .plan import CUDA_DATA, Plan
from .result import TuneResult, from_decision, lookup
from .space import Candidate, SearchSpace, Strategy, cpus_per_rank

log = logging.getLogger("autotune")

MAX_SEARCH_EPOCHS = 2
"""Epochs a search may take at most (and one fewer than the run); undecided at the end, the decision
is made on what was measured: the baseline unless a challenger already wins with confidence."""

SLOW_EPOCHS = 2
"""Settled epochs in a row below the baseline's rate before it is measured again."""

CONFIRM_ROUNDS = 2
"""Rounds of the settled choice and the baseline in the warm baseline's check: MIN_PAIRS adjacent
pairs, the fewest a paired verdict weighs (NOTE [ The baseline measured warm ])."""

RECHECK_MARGIN = 0.05
"""A settled epoch is slow when below the baseline's rate by more than this (or the noise, if more)."""

DRIFT_WAIT_RISE = 0.25
"""A rise of the waiting share this far above the first settled epoch is drift."""

DRIFT_EPOCHS = 2
"""Settled epochs in a row with drift before the loader explores again."""

MIN_EPOCHS_BETWEEN_SEARCHES = 3
"""Epochs at least from one search (or check) to the next."""

HOLD_MIN_STRETCHES = STRETCHES_PER_EPOCH // 2
"""The first epoch waits for the cache only where it holds this many of the baseline's shortest
measured stretches (NOTE [ The cache before the workers ])."""

FILLED_ENOUGH = 0.98
"""A cache filled this far is measured as a cache: samples an epoch skips (drop_last) or that its
layout cannot hold are served from the source, correctly, at a negligible cost."""

LOAD_CHANGE = 0.5
"""A stored choice is measured again when the load per CPU differs by more than this from when it
was made (half a core's worth of other work per core)."""

STOPS_KEPT = 32
"""The latest stops of workers whose median per worker is scored (NOTE [ Score ] in decide.py): a
long run's stops weigh alike at a fixed cost."""


class Phase(enum.Enum):
    """Where a drop-in loader is across its epochs (NOTE [ Phases ]). ``Tuning._enter`` alone moves
    it; ``settled`` holds a configuration exactly in SETTLED and DUE."""

    SEARCHING = "searching"
    """Its first search: nothing settled yet."""
    SETTLED = "settled"
    """Serving the settled configuration, judged after each epoch (NOTE [ Settled means proven ])."""
    DUE = "due"
    """Settled, and the next epoch measures again: its rate fell below the baseline's, the wait
    drifted up, or a stored choice meets another load (``why`` says which)."""
    CHECKING_CACHE = "checking its filled cache"
    """The ram cache filled after the search settled: it is measured against the settled choice."""
    RECHECKING = "rechecking"
    """The settled choice measured against the baseline again."""
    CONFIRMING = "confirming"
    """The search's pick measured against the baseline warm: the search measured the baseline only
    in its first stretch (NOTE [ The baseline measured warm ])."""
    SEARCHING_AGAIN = "searching again"
    """A drift's new search, from the baseline."""


MEASURING = frozenset({Phase.SEARCHING, Phase.CHECKING_CACHE, Phase.RECHECKING, Phase.CONFIRMING,
                       Phase.SEARCHING_AGAIN})
"""The phases whose epochs measure (an explorer serves them); in the others one configuration serves."""

# NOTE [ Phases ]
# SEARCHING -> SETTLED: the search decided (``settle``), or a stored profile or a given configuration
#   settles the loader at once (``settle_from_profile``).
# SETTLED -> DUE: a settled epoch ran slower than the baseline (SLOW_EPOCHS in a row), waited longer
#   for data (DRIFT_EPOCHS), or a stored choice's first epoch met another load (LOAD_CHANGE).
# SETTLED -> CHECKING_CACHE: at an epoch boundary, the ram cache is full (once).
# SETTLED -> CONFIRMING: at the first boundary after a search whose pick was measured only against
#   the baseline's first stretch, unless the cache's check starts there (it measures the baseline too).
# DUE -> RECHECKING (slow epochs, another load) or SEARCHING_AGAIN (drift): at the next boundary.
# CHECKING_CACHE, RECHECKING, CONFIRMING, SEARCHING_AGAIN -> SETTLED: their decision (``settle``).
# Any measuring phase whose epochs run out settles on what was measured.


@dataclass(frozen=True)
class Fixed:
    """The tunable settings the user fixed (``None``: tuned), checked as torch checks them."""

    num_workers: int | None = None
    pin_memory: bool | None = None
    prefetch_factor: int | None = None
    persistent_workers: bool | None = None
    torch_threads: int | None = None
    leave_threads: bool = False
    """``torch_threads=None``: the main process's thread count is left as it is, never searched."""

    def fields(self) -> dict[str, Any]:
        """The candidate fields every candidate must have."""
        out: dict[str, Any] = {}
        if self.num_workers is not None:
            out["num_workers"] = self.num_workers
            if self.num_workers > 0:
                out["worker_kind"] = "process"
        if self.pin_memory is not None:
            out["pin_memory"] = self.pin_memory
        if self.prefetch_factor is not None:
            out["prefetch_factor"] = self.prefetch_factor
        if self.persistent_workers is not None:
            out["persistent_workers"] = self.persistent_workers
        if self.torch_threads is not None or self.leave_threads:
            out["torch_threads"] = self.torch_threads
        return out

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in self.fields().items() if k != "worker_kind"}


T = TypeVar("T")


class Tuning:
    """What one drop-in loader knows across epochs (see the module docstring)."""

    def __init__(self, plan: Plan, fixed: Fixed, baseline: Candidate, *,
                 store_args: dict[str, Any] | None, origin: str, reads_in_main: bool,
                 threads_allowed: bool) -> None:
        self.plan = plan
        self.fixed = fixed
        self.baseline = baseline
        self.store_args = store_args
        self.origin = origin
        self.reads_in_main = reads_in_main
        """Whether samples may be read in the main process (then planning a cache may): the user's
        settings read them there, or reading them there changes nothing the workers read."""
        self.threads_allowed = threads_allowed
        self.ledger = Ledger(plan.dataset_len, plan.epochs)
        self.history: list[TrialRecord] = []
        """Trials of earlier searches (a drift's, a check's), kept for the report."""
        self.explorer: Explorer | None = None
        self.space: SearchSpace | None = None
        self.settled: Candidate | None = None
        self.result: TuneResult | None = None
        self.cuda_data: bool | None = None
        """Whether the batches hold CUDA tensors, seen in the first one served (``None``: not yet)."""
        self.epochs_done = 0
        self.search_epochs = 0
        self.last_search_at = 0
        self.reference_wait: float | None = None
        self.slow = 0
        self.drifting = 0
        self.phase = Phase.SEARCHING
        """Where the loader is (NOTE [ Phases ]); moved by ``_enter`` alone."""
        self.why: str | None = None
        """In DUE, why the next epoch measures again; in a phase that measures again after settling,
        what it measures (``measuring_again``)."""
        self.noise_sd = 0.0
        """The spread (standard deviation of log-scores) the last search measured."""
        self.filling: pt.Prepared | None = None
        """The ram cache filled by the loading pass, where one applies."""
        self.challenged = False
        """Whether the filled cache was measured against the settled choice already."""
        self.resuming = False
        """Whether a stored profile left a cache undecided against the baseline, and this run fills
        the cache to measure the two again (NOTE [ An undecided profile is resumed ])."""
        self.incumbent: tuple[Candidate, Decision] | None = None
        """The settled choice a check measures (a filled cache's, the warm baseline's), and the
        decision that chose it."""
        self.confirm_due = False
        """Whether the next epoch measures the settled choice against the baseline warm (NOTE [ The
        baseline measured warm ])."""
        self.decision: Decision | None = None
        """The decision the loader settled on last."""
        self.started_ahead = 0
        """Stretches whose workers started while the one before served its backlog (epochs.py)."""
        self.stops: collections.deque[float] = collections.deque(maxlen=STOPS_KEPT)
        """Seconds per worker process that each of the latest stops of an inner loader's workers
        took (NOTE [ Score ] in decide.py)."""
        self.epoch_items: int | None = None
        """Items an epoch has (``None``: no length); a candidate needing more than half of them for
        one measurement is not tried."""
        self.early: tuple[SearchSpace, dict[str, str], float | None] | None = None
        """What ``start_filling`` planned before the first stretch, until the search starts."""
        self.load_check: tuple[float, CpuSnapshot | None] | None = None
        """A stored choice's load and the CPU times since it serves, until others' load is read."""
        self.load_since = plan.cpu_at_start
        """The CPU times when the latest search began: its result's load is read from them."""
        self.others_served = False
        """Whether this epoch served a stretch other than the baseline's first (NOTE [ The
        baseline's epoch ])."""
        self.held_for_fill = False
        """Whether this epoch's search waits for the ram cache to fill (``filling_first``)."""
        self.beside_step = 0.0
        """The share of the run's CPU the user's settings' workers took on busy CPUs, last read
        (NOTE [ Loading beside the step ] in machine.py)."""
        self.partial: tuple[tuple[int, int], TuneResult | None] | None = None
        """The last partial result and the measurements it was made of (history, ledger records)."""

    def __getstate__(self) -> dict[str, Any]:
        # A copy (pickled, deep-copied) keeps what was measured and chosen; a ram cache being filled
        # is this process's memory: the copy fills its own, from its next epoch on.
        state = self.__dict__.copy()
        state["filling"] = None
        return state

    # -- the search --------------------------------------------------------------------------------

    @property
    def together(self) -> bool:
        return self.plan.dist is not None

    @property
    def searching(self) -> bool:
        return self.phase in MEASURING

    @property
    def serving_settled(self) -> bool:
        """Whether the settled configuration serves, unquestioned (not due to be measured again)."""
        return self.phase is Phase.SETTLED

    def _enter(self, phase: Phase, why: str | None = None, *, settled: Candidate | None = None) -> None:
        """Move to ``phase`` (NOTE [ Phases ]): the one place the loader's phase and what it has
        settled on change together."""
        if phase in MEASURING:
            settled = None
        elif settled is None:
            settled = self.settled
        if phase not in MEASURING and settled is None:
            raise RuntimeError(f"{phase.value} without a settled configuration")  # a bug of autotune
        log.debug("autotune: the loader at %s: %s -> %s%s", self.origin, self.phase.value, phase.value,
                  f" ({why})" if why else "")
        self.phase, self.why, self.settled = phase, why, settled

    def settled_failed(self) -> None:
        """The settled configuration failed (its worker crashed, say): the baseline serves from now
        on, in the same phase."""
        self.settled = self.baseline

    def next_candidate(self) -> tuple[Candidate, Any] | None:
        """The next stretch's candidate and phase; ``None``: the baseline serves the rest of the epoch,
        unmeasured (the search decided, or it waits for the cache to fill: ``filling_first``)."""
        if self.explorer is None:
            return (self.baseline, "baseline") if not self.ledger.records else None
        self.explorer.cache_ready = self.cache_ready()
        if self.filling_first():
            self.held_for_fill = True
            return None
        return self.explorer.next()

    def filling_first(self) -> bool:
        """Whether the first epoch's search waits for the ram cache (NOTE [ The cache before the
        workers ]): the baseline's own stretches fill it, the cache is full by the epoch's end, and
        at least two epochs are left to measure it and then use it."""
        f, b, ex = self.filling, self.baseline, self.explorer
        if (f is None or ex is None or self.epochs_done > 0 or self.together or ex.decision is not None
                or ex.phase != "online" or ex.nothing_to_win or self.plan.epochs < 3 or self.cache_ready()):
            return False
        if not self.epoch_items or self.epoch_items < HOLD_MIN_STRETCHES * drained_items(b):
            return False  # a short epoch: holding it would leave the search too little room
        return f.shared or b.num_workers == 0 or b.worker_kind == "thread"

    def cache_ready(self) -> bool:
        """Whether the ram cache holds (nearly) every sample: only then is it measured as a cache
        (while it fills, a stretch through it costs about an uncached one)."""
        if self.filling is None:
            return True
        counts = self.filling.fill_counts()
        return counts.complete or (counts.total > 0 and counts.filled >= FILLED_ENOUGH * counts.total)

    def filling_pass(self) -> pt.Prepared | None:
        """The ram cache while it fills (every stretch of the epoch loads through it), else None."""
        if self.filling is None or self.cache_ready():
            return None
        return self.filling

    def observe(self, item: Any) -> None:
        """The first item served: data already on an accelerator rules out worker processes (it is
        seen here rather than by reading a sample the user's settings would not read)."""
        if self.cuda_data is None:
            self.cuda_data = contains_cuda(item)

    def serving(self) -> Candidate:
        """What serves when nothing is measured: the settled configuration, else the baseline."""
        return self.settled or self.baseline

    def abandon_below(self, phase: Any) -> float:
        if self.explorer is None or self.together:
            return 0.0
        return self.explorer.abandon_below(phase)

    def stretch_length(self, c: Candidate, epoch_items: int | None) -> int:
        """Items one measured stretch of ``c`` may serve (NOTE [ Epochs and stretches ] in epochs.py):
        what its measurement needs, at least, and a share of the epoch."""
        share = int(MAX_STRETCH_FRACTION * epoch_items) if epoch_items else UNSIZED_STRETCH
        return max(share, stretch_items(c))

    def window_s(self, epoch_items: int | None) -> float:
        """STRETCH_WINDOW_S, or a 1/STRETCHES_PER_EPOCH share of an epoch at the baseline's rate."""
        base = self.ledger.by_candidate.get(self.baseline)
        if not base or not epoch_items or base[0].measurement is None:
            return STRETCH_WINDOW_S
        m = base[0].measurement
        epoch_s = epoch_items * (m.samples / max(1, m.batches)) / max(m.samples_per_s, 1e-9)
        return min(STRETCH_WINDOW_S, max(MIN_STRETCH_WINDOW_S, epoch_s / STRETCHES_PER_EPOCH))

    def stopped(self, workers: int, seconds: float) -> None:
        """An inner loader's ``workers`` worker processes took ``seconds`` to stop."""
        self.stops.append(seconds / workers)

    def record(self, outcome: Outcome) -> None:
        stop = statistics.median(self.stops) if self.stops else 0.0
        if self.together:
            outcome, stop = self._agree(outcome, stop)
        # Before this outcome is scored: its workers, and those of every stretch before it, stop
        # at each epoch's end as the user's would (NOTE [ Score ] in decide.py).
        self.ledger.stop_cost(stop)
        if self.explorer is None:
            if outcome.measurement is None and outcome.failure is None:
                return  # no window yet: the baseline serves again
            self._start_search()
        assert self.explorer is not None
        if outcome.phase != "baseline":
            self.others_served = True
        _log_outcome(outcome, self.origin)
        if outcome.loading_beside_step is not None:
            self.beside_step = outcome.loading_beside_step
        self.explorer.record(outcome)
        if self.explorer.nothing_to_win and self.filling is not None:
            # No cache can make this run faster: the epochs stop paying to fill one.
            self.filling = None

    def start_filling(self) -> None:
        """Before the search's first stretch: plan the space and start the ram cache's fill, so that
        the first stretch loads through it like every other stretch of the epoch (NOTE [ The search
        fills from its first stretch ]). Planned once; ``_start_search`` takes what it planned."""
        if self.explorer is None and self.early is None and not self.ledger.records:
            self.early = self._plan_space()

    def _plan_space(self) -> tuple[SearchSpace, dict[str, str], float | None]:
        """(the space, the strategies refused with why, a device cache's estimated build), with the
        ram cache's fill started where the space has one."""
        space, refused = self._space()
        ctx = self.plan.dist
        # A ram cache fills from the samples the epoch loads anyway (NOTE [ Filling caches ]): it
        # costs no build. The device cache is still built, and its build is weighed.
        build_s = pt.estimate_build_s(self.plan.dataset) if "device" in space.pretransforms else None
        if ctx is not None:  # rank 0's view, so that every rank explores the same space
            space, build_s = ctx.broadcast((space, build_s) if ctx.leader else None)
        if "ram" in space.pretransforms and self.filling is None:
            try:
                self.filling = pt.prepare(self.plan.dataset, "ram", device=self.plan.device,
                                          memory_budget_bytes=self.plan.cache_budget(), fill="pass")
            except CandidateError as err:
                refused["ram"] = str(err)
                space = replace(space, pretransforms=tuple(p for p in space.pretransforms if p != "ram"))
        return space, refused, build_s

    def _start_search(self) -> None:
        early, self.early = self.early, None
        # Data seen on an accelerator in the first stretch bounds the workers: planned again then.
        space, refused, build_s = early if early is not None and not self.cuda_data else self._plan_space()
        self.space = space
        self.explorer = Explorer(space, self.baseline, self.ledger, allowed_fields=self.fixed.fields(),
                                 cache_build_s=build_s,
                                 longest_stretch=self.epoch_items // 2 if self.epoch_items else None,
                                 cpus=self._cpus(), shared_cache=self._shared_cache(),
                                 gathered_cache=self._gathered_cache())
        self.explorer.cache_ready = self.cache_ready()
        for strategy, why in refused.items():
            self.ledger.record(replace(self.baseline, pretransform=cast(Strategy, strategy)), "online",
                               "infeasible",
                               reason=f"pretransform={strategy!r}: {why}")
        for left, why in space.left_out(self.plan.machine.usable_cpus):
            self.ledger.record(left, "online", "infeasible", reason=why)

    def _settled_wait(self) -> float | None:
        """The share of the time the loop waited for data on the settled configuration: over its
        first settled epoch where one ended, else the median of what the search measured (its
        records are in ``history``: settling starts a fresh ledger)."""
        if self.reference_wait is not None:
            return self.reference_wait
        waits = [r.measurement.wait_fraction for r in self.history
                 if r.candidate == self.settled and r.measurement is not None]
        return statistics.median(waits) if waits else None

    def _cache_candidates(self) -> list[Candidate]:
        """The ram cache's candidates, as the search tries them (Explorer.cache_candidates)."""
        assert self.space is not None
        probe = Explorer(self.space, self.baseline, Ledger(None, 1), allowed_fields=self.fixed.fields(),
                         cpus=self._cpus(), shared_cache=self._shared_cache(),
                         gathered_cache=self._gathered_cache())
        return [c for c in probe.cache_candidates() if c.pretransform == "ram"]

    def _cpus(self) -> int:
        return cpus_per_rank(self.plan.machine.usable_cpus, self.plan.local_ranks)

    def _shared_cache(self) -> bool:
        return self.filling is not None and self.filling.shared

    def _gathered_cache(self) -> bool:
        """Whether the ram cache serves the user's batches by one gather each (torch's collate)."""
        if self.filling is None or self.plan.collate_fn is not None or self.plan.batch_size is None:
            return False
        return self.filling.gathers_batches(default_collate)

    def _profile_problem(self, c: Candidate) -> str | None:
        """Why a stored choice cannot serve this loader on this machine (outside today's space: a
        worker count past its bound, a kind of worker or persistence it no longer allows), or
        ``None``. Its cache is checked when it is prepared, so none is planned here."""
        if c == self.baseline:
            return None
        space, _ = self._space(caches=False)
        return space.check(replace(c, pretransform="none"))

    def _space(self, *, caches: bool = True) -> tuple[SearchSpace, dict[str, str]]:
        plan = self.plan
        strategies = (plan.strategies if caches and self.reads_in_main and not plan.iterable
                      else ("none",))
        max_workers = plan.max_workers
        excluded = dict(plan.excluded)
        if self.cuda_data:
            max_workers = 0
            excluded["num_workers>0"] = CUDA_DATA
        if plan.iterable:
            # A stream keeps the workers it was given: more would replay it, unless it shards.
            max_workers = self.fixed.num_workers or 0
            excluded["num_workers>0"] = (
                "a stream is served by the workers it was given: more workers replay an"
                " IterableDataset that does not shard itself")
        plan = replace(plan, strategies=strategies, max_workers=max_workers, excluded=excluded,
                       max_threads=plan.max_threads if self.threads_allowed else 0)
        return plan.space()

    def _agree(self, o: Outcome, stop: float) -> tuple[Outcome, float]:
        """Every rank ends the stretch with the same outcome, and scores it with the same workers'
        stop, the slowest rank's (NOTE [ Exploring under torchrun ])."""
        ctx = self.plan.dist
        assert ctx is not None
        m = o.measurement
        mine = (("failed", o.failure) if o.failure is not None
                else ("ok", m.to_dict()) if m is not None else ("none", None))
        gathered = ctx.gather((mine, o.load_cpu_share, o.loading_beside_step, stop))
        stop = max(g[3] for g in gathered)
        outcomes = [g[0] for g in gathered]
        # CPU-bound, or loading beside the step, only where every rank's is: the ranks must queue
        # the same candidates.
        o = replace(o, load_cpu_share=_least([g[1] for g in gathered]),
                    loading_beside_step=_least([g[2] for g in gathered]))
        failed = [(rank, failure) for rank, (kind, failure) in enumerate(outcomes) if kind == "failed"]
        if failed:
            rank, failure = failed[0]
            return replace(o, failure=failure.on_rank(rank), measurement=None, abandoned=False), stop
        if all(kind == "ok" for kind, _ in outcomes):
            reduced = reduce_measurements([Measurement.from_dict(d) for _, d in outcomes])
            return replace(o, measurement=reduced, abandoned=False), stop
        return replace(o, measurement=None, abandoned=False), stop

    def decision_due(self) -> Decision | None:
        """The explorer's decision once it has one."""
        return self.explorer.decision if self.explorer is not None else None

    def force_decision(self) -> Decision:
        """The search ran out of epochs: decide on what was measured (the baseline unless a
        challenger already wins with confidence); raises the ledger's failure where nothing was."""
        decision = self._decision_so_far()
        if decision is None:
            raise self.ledger.failure()
        return decision

    def _decision_so_far(self) -> Decision | None:
        """The decision on what was measured so far; None where nothing a decision needs was."""
        finalists = self.ledger.finalists(self.baseline, self.space)
        if self.baseline not in self.ledger.by_candidate and not finalists:
            return None
        return self.ledger.decide(finalists or [self.baseline], self.baseline)

    # -- settling ----------------------------------------------------------------------------------

    def settle(self, decision: Decision, *, phase_note: str = "") -> Candidate:
        decision = self._against_earlier_baseline(decision)
        decision, self.incumbent = self._incumbent_kept(decision), None
        self.decision = decision
        self.result = self._result(decision)
        c = decision.chosen.candidate
        # NOTE [ The baseline measured warm ]: a search's pick that only the baseline's cold first
        # stretch stood against is measured against it once more, warm.
        self.confirm_due = (self.phase in (Phase.SEARCHING, Phase.SEARCHING_AGAIN) and c != self.baseline
                            and self.baseline in self.ledger.by_candidate
                            and not self.ledger.warm_baseline(self.baseline))
        if self.plan.dist is None or self.plan.dist.leader:
            record = self.result.to_dict()
            self._with_store("store the profile", lambda store: store.put(self.plan.key, record))
        var, df = self.ledger.noise()
        self.noise_sd = math.sqrt(var) if df and math.isfinite(var) else 0.0
        self.history.extend(self.ledger.records)
        if self.explorer is not None:
            loss = self.explorer.loss_s
            log.debug("autotune: the search at %s served its stretches %.2f s %s than the baseline's"
                      " first measured pace would have", self.origin, abs(loss),
                      "slower" if loss >= 0 else "faster")
        self.explorer = None
        self.ledger = Ledger(self.plan.dataset_len, self.plan.epochs, earlier=self.history)
        self._enter(Phase.SETTLED, settled=c)
        self.last_search_at = self.epochs_done
        self.reference_wait = None
        self.slow = self.drifting = 0
        log.info("autotune: the loader at %s settled on %s: %s%s", self.origin, c.label(),
                 decision.reason, phase_note)
        return c

    def _against_earlier_baseline(self, decision: Decision) -> Decision:
        """A check's decision (a filled cache's, the warm baseline's) made where its own stretches
        never measured the baseline: the best measured configuration, weighed against the baseline's
        measurements from the search before it. On epochs of a few batches the baseline's stretch
        may find no room for its window (the README's example over 2,020 images at batch_size=128:
        16 batches an epoch), and the check chose its cache with no speed-up to report, against a
        baseline the search had measured. Weighed so, a win with confidence is reported with its
        interval; a pick slower than the baseline leaves the baseline; otherwise the pick stands,
        with no figure: the two medians' ratio, from windows of a few batches taken an epoch apart,
        read 8.05x where the epochs then ran 4-5x faster than the baseline's."""
        if decision.baseline is not None or self.phase not in (Phase.CHECKING_CACHE, Phase.CONFIRMING):
            return decision
        earlier = [r for r in self.history if r.candidate == self.baseline and r.state == "complete"
                   and r.measurement is not None]
        if not earlier:
            return decision
        # Each ledger numbers its trials from 0, and a verdict pairs trials by number (``Ledger.pairs``):
        # renumbered in the order they were measured, the search's come before the check's.
        joined = [replace(r, number=i) for i, r in enumerate([*earlier, *self.ledger.records])]
        ledger = Ledger.replayed(joined, self.plan.dataset_len, self.plan.epochs,
                                 self.ledger.stop_per_worker_s)
        weighed = ledger.decide(ledger.finalists(self.baseline, self.space), self.baseline)
        base = weighed.baseline
        if base is None or not weighed.kept_baseline or base.score >= decision.chosen.score:
            return weighed
        return replace(decision, reason=(
            "the check measured the baseline in none of its stretches; the best measured configuration"
            f" is used, faster than the baseline's measurement in the search before"
            f" ({decision.chosen.score / base.score:.1f}x, from windows an epoch apart: no speed-up"
            " figure)"))

    def _incumbent_kept(self, decision: Decision) -> Decision:
        """What a check of the settled choice decided (a filled cache's, the warm baseline's), with
        the settled choice kept unless a cache configuration beat the baseline or the baseline beat
        it with confidence: it won its own search, and a few rounds of a noisy check that end without
        a winner are no proof that it stopped winning (NOTE [ Settled means proven ]). Other
        decisions as they are."""
        if self.incumbent is None:
            return decision
        incumbent, chose_it = self.incumbent
        if incumbent == self.baseline or decision.chosen.candidate != self.baseline:
            return decision
        if self.phase is Phase.CONFIRMING:
            cut = "the check against the baseline, measured warm, was cut short"
            why, against = "it won its search, and", "the baseline measured warm"
        else:
            cut = "the filled cache did not beat it"
            why, against = "no cache configuration beat the baseline with confidence, and", "the baseline"
        verdict = self.ledger.verdict(incumbent, self.baseline)
        if verdict is not None and verdict.loses:
            return decision  # slower than the baseline with confidence: the baseline again
        if verdict is None:  # not measured in the check: as it was chosen
            return replace(chose_it, reason=f"{chose_it.reason}; {cut}")
        served, said = self.ledger.served(incumbent, self.baseline, verdict)
        return Decision(self.ledger.summarize(incumbent), decision.baseline, decision.challenger, verdict,
                        f"kept {incumbent.label()}: {why} {incumbent.label()} measured {said} against"
                        f" {against}, not slower with confidence", served=served)

    def settle_from_profile(self, result: TuneResult | None, c: Candidate) -> None:
        """Settled from the start: a stored profile, or a configuration given (``make_loader``).

        A profile chosen under another load than the machine has now is not this machine's truth
        as it is now: where the first settled epoch finds other processes running more (or less)
        than when it was chosen, its choice is measured against the baseline again in the next.
        """
        self.result = result
        self._enter(Phase.SETTLED, settled=c)
        then = result.load_average if result is not None else None
        if then is not None and c != self.baseline:
            self.load_check = (then, cpu_snapshot())
        if result is not None and c == self.baseline and self._cache_undecided(result):
            self._resume()

    def _cache_undecided(self, result: TuneResult) -> bool:
        """Whether ``result`` kept the baseline undecided against a ram cache among its finalists,
        with an epoch to fill the cache and two to measure it and then use it."""
        return result.undecided and self.plan.epochs >= 3 and any(
            t.phase == "final" and t.candidate.pretransform == "ram" for t in result.trials)

    def _resume(self) -> None:
        """NOTE [ An undecided profile is resumed ]: plan the space and start the ram cache's fill,
        so that the first epoch fills it and the next measures it against the baseline."""
        space, _, _ = self._plan_space()
        if self.filling is None:
            return  # no ram cache on this machine now: the stored choice stands
        self.space, self.resuming = space, True
        log.info("autotune: the profile for the loader at %s left its cache undecided against the"
                 " baseline; the cache fills over this epoch and is measured again in the next", self.origin)

    def _check_load(self) -> None:
        """After a settled epoch of a stored choice: others' load read over it against the load the
        choice was measured under (NOTE [ Others' load ] in machine.py); changed by more than
        LOAD_CHANGE, the next epoch measures it against the baseline again."""
        if self.load_check is None:
            return
        then, since = self.load_check
        now = others_load(since)
        ctx = self.plan.dist
        if ctx is not None:  # rank 0's reading, so that every rank checks, or none
            now = ctx.broadcast(now if ctx.leader else None)
        if now is None:
            return  # too short a window to read: the next epoch reads a longer one
        self.load_check = None
        if abs(now - then) > LOAD_CHANGE and self.phase is Phase.SETTLED:
            self.slow = SLOW_EPOCHS
            self.last_search_at = -MIN_EPOCHS_BETWEEN_SEARCHES
            self._enter(Phase.DUE, f"the profile for the loader at {self.origin} was chosen while other"
                        f" processes ran {then:.2f} of each CPU, and they ran {now:.2f} over the last"
                        " epoch; measuring its choice against the baseline again")

    def _result(self, decision: Decision) -> TuneResult:
        trials = tuple(self.history) + tuple(self.ledger.records)
        return from_decision(
            decision, trials, device=str(self.plan.device), epochs=self.plan.epochs, budget_s=0.0,
            tuning_s=sum(r.duration_s for r in trials), key=self.plan.key,
            machine=self.plan.machine.fingerprint(), workload=self.plan.workload,
            load_average=others_load(self.load_since),
        )

    def settled_before(self) -> bool:
        """Whether the loader settled before and measures again now (or at the next epoch): its
        settled ``result`` stands meanwhile."""
        return self.result is not None and self.phase not in (Phase.SEARCHING, Phase.SETTLED)

    def measuring_again(self) -> str | None:
        """What the loader measures again after it settled (``settled_before``), for a report;
        ``None`` where it never settled or serves its settled choice unquestioned."""
        if not self.settled_before():
            return None
        return "nothing yet: it was due at the next epoch" if self.phase is Phase.DUE else self.why

    def partial_result(self) -> TuneResult | None:
        """What was measured so far, before a decision."""
        if self.result is not None and self.searching is False:
            return self.result
        if not self.ledger.by_candidate:
            return self.result
        made_of = (len(self.history), len(self.ledger.records))
        if self.partial is not None and self.partial[0] == made_of:
            return self.partial[1]  # nothing measured since: the same decision (and no /proc read)
        decision = self._decision_so_far()  # None: nothing measured completes a decision yet
        partial = self._result(self._incumbent_kept(decision)) if decision is not None else self.result
        self.partial = (made_of, partial)
        return partial

    @contextlib.contextmanager
    def store(self) -> Iterator[profiles.ProfileStore]:
        """The profile store, open only while it is used (a database's connections are let go)."""
        assert self.store_args is not None
        store = profiles.open_store(**self.store_args)
        try:
            yield store
        finally:
            store.close()

    def _with_store(self, action: str, use: Callable[[profiles.ProfileStore], T]) -> T | None:
        """``use(store)``. A store that fails (unreachable, corrupt, read-only) is let go for this
        loader with one warning: a profile store never ends a training run; the loader tunes and
        serves as before, storing nothing."""
        if self.store_args is None:
            return None
        try:
            with self.store() as store:
                return use(store)
        except (ProfileStoreError, OSError) as err:
            self.store_args = None
            warnings.warn(
                f"the profile store could not {action} ({err}); the loader at {self.origin} goes on"
                " without it: nothing is read from it or stored for this loader.",
                ProfileStoreWarning, stacklevel=2)
            return None

    def lookup(self) -> TuneResult | None:
        hit = self._with_store("be read", lambda store: lookup(store, self.plan.key))
        if hit is not None and (problem := self._profile_problem(hit.candidate)) is not None:
            warnings.warn(
                f"ignoring the stored profile {self.plan.key} for the loader at {self.origin}: {problem}."
                " It is measured again and replaced.", ProfileStoreWarning, stacklevel=2)
            hit = None
        ctx = self.plan.dist
        if ctx is not None:  # rank 0's answer, so that every rank explores, or none
            shared = ctx.broadcast(hit.to_dict() if ctx.leader and hit is not None else None)
            hit = TuneResult.from_dict(shared, from_cache=True) if shared is not None else None
        return hit

    # -- after each epoch (NOTE [ Settled means proven ]) -----------------------------------------

    def end_search_epoch(self) -> Candidate | None:
        """An epoch of searching ended; the configuration settled on when the search is over."""
        if not (self.held_for_fill or self._baseline_alone()):
            self.search_epochs += 1
        self.epochs_done += 1
        self.others_served = False
        self.held_for_fill = False
        allowed = max(1, min(MAX_SEARCH_EPOCHS, self.plan.epochs - 1))
        if self.phase not in MEASURING or self.search_epochs < allowed:
            return None
        if not self.ledger.by_candidate:  # epochs too short to measure anything: nothing to store
            self._enter(Phase.SETTLED, settled=self.baseline)
            return self.baseline
        return self.settle(self.force_decision(), phase_note=" (the search ran out of epochs)")

    def _baseline_alone(self) -> bool:
        """Whether the first epoch served the baseline's first stretch, measured, and nothing else
        (NOTE [ The baseline's epoch ]): it held the whole epoch."""
        return self.epochs_done == 0 and not self.others_served and self.baseline in self.ledger.by_candidate

    def end_settled_epoch(self, samples: int, wall_s: float, wait_s: float) -> None:
        self.epochs_done += 1
        if samples > 0 and wall_s > 0:
            self._judge_epoch(samples, wall_s, wait_s)
        if self.plan.epochs - self.epochs_done >= 1:
            self._check_load()

    def _judge_epoch(self, samples: int, wall_s: float, wait_s: float) -> None:
        """A settled epoch's rate against the baseline's, and its wait against the first's."""
        rate, wait = samples / wall_s, min(1.0, wait_s / wall_s)
        if self.together:
            ctx = self.plan.dist
            assert ctx is not None
            gathered = ctx.gather((rate, wait))
            rate, wait = min(r for r, _ in gathered), max(w for _, w in gathered)
        result = self.result
        base_rate = result.baseline_samples_per_s if result is not None else None
        if self.settled != self.baseline and base_rate:
            margin = max(RECHECK_MARGIN, 2.0 * self.noise_sd)
            self.slow = self.slow + 1 if rate < base_rate * (1.0 - margin) else 0
        if self.reference_wait is None:
            self.reference_wait = wait
        self.drifting = self.drifting + 1 if wait > self.reference_wait + DRIFT_WAIT_RISE else 0
        rested = self.epochs_done - self.last_search_at >= MIN_EPOCHS_BETWEEN_SEARCHES
        left = self.plan.epochs - self.epochs_done
        if rested and self.slow >= SLOW_EPOCHS and self.settled is not None and base_rate:
            self._enter(Phase.DUE, f"the loader at {self.origin} ran {rate:,.0f} samples/s on"
                        f" {self.settled.label()} against the baseline's {base_rate:,.0f}; measuring the two"
                        " side by side again")
        elif rested and self.drifting >= DRIFT_EPOCHS and left >= 2:
            self._enter(Phase.DUE, f"the loader at {self.origin} waited {wait:.0%} of an epoch for data,"
                        f" against {self.reference_wait:.0%} when it settled; exploring again")

    def begin_epoch(self) -> None:
        """Start what a check, a drift or a filled cache asked for, at an epoch boundary."""
        if (self.phase is Phase.SETTLED and self.settled is not None and not self.challenged
                and self.filling is not None and self.cache_ready() and self.space is not None
                and self.settled.pretransform != "ram" and self.plan.epochs - self.epochs_done >= 2):
            self.challenged = True
            wait = self._settled_wait()
            if wait is not None and wait < MIN_WAIT_TO_EXPLORE and not self.resuming and not (
                    self.settled == self.baseline and self.beside_step >= MIN_BESIDE_STEP_TO_EXPLORE):
                # NOTE [ Online search ] 2 in online.py: a cache only shortens the loading, and the
                # loop hardly waits for it; measuring the cache would cost more than it could win.
                log.info("autotune: the loader at %s waits for data %.0f%% of the time on %s; its"
                         " filled cache is not measured", self.origin, 100 * wait, self.settled.label())
                self.filling = None
                return
            # A ram candidate the search measured was measured full (Explorer tries the cache only
            # then): it joined that search and lost, and is not measured again.
            lost = {r.candidate for r in self.history if r.measurement is not None}
            cached = [c for c in self._cache_candidates() if c != self.settled and c not in lost]
            if cached:
                settled = self.settled
                log.info("autotune: the loader at %s has filled its cache; measuring it against %s",
                         self.origin, settled.label())
                self._measure_again(Phase.CHECKING_CACHE, f"its filled cache against {settled.label()}")
                self.explorer = Explorer.challenge(self.space, self.baseline, [*cached, settled],
                                                   self.ledger)
            return
        if self.phase is Phase.SETTLED and self.confirm_due:
            self._confirm()
            return
        if self.phase is not Phase.DUE or self.settled is None:
            return
        log.info("autotune: %s", self.why)
        settled = self.settled
        if self.slow >= SLOW_EPOCHS and settled != self.baseline:
            if self.space is None:
                self.space, _ = self._space()
            self._measure_again(Phase.RECHECKING, f"{settled.label()} against the baseline")
            self.explorer = Explorer.recheck(self.space, self.baseline, settled, self.ledger)
        else:
            self._measure_again(Phase.SEARCHING_AGAIN,
                                "other configurations, the loop waiting longer for data than when it settled")
            self.explorer = None  # a new search, from the baseline

    def _confirm(self) -> None:
        """NOTE [ The baseline measured warm ]: the settled choice against the baseline in
        CONFIRM_ROUNDS rounds, with an epoch left after this one to use what it decides."""
        self.confirm_due = False
        settled = self.settled
        if (settled is None or settled == self.baseline or self.space is None
                or self.plan.epochs - self.epochs_done < 2):
            return
        log.info("autotune: the loader at %s measured its baseline only in its first stretch; measuring"
                 " %s against it again, warm", self.origin, settled.label())
        self._measure_again(Phase.CONFIRMING, f"{settled.label()} against the baseline, measured warm")
        self.explorer = Explorer.recheck(self.space, self.baseline, settled, self.ledger,
                                         rounds=CONFIRM_ROUNDS)

    def _measure_again(self, phase: Phase, why: str) -> None:
        """Enter ``phase``, which measures the settled choice again in a ledger of its own. In a
        filled cache's check and the warm baseline's, the decision that chose it stands unless the
        check beats it (``_incumbent_kept``); a recheck (its epochs ran slow) or a new search (the
        loop's wait drifted) decides afresh."""
        settled = self.settled
        kept_unless_beaten = phase in (Phase.CHECKING_CACHE, Phase.CONFIRMING)
        if kept_unless_beaten and settled is not None and self.decision is not None:
            self.incumbent = (settled, self.decision)
        self.confirm_due = False  # every check measures the baseline warm
        self._enter(phase, why)
        self.search_epochs = 0
        self.ledger = Ledger(self.plan.dataset_len, self.plan.epochs, earlier=self.history)
        self.load_since = cpu_snapshot()


def _least(shares: list[float | None]) -> float | None:
    """The smallest of every rank's share; ``None`` where a rank has none."""
    return None if None in shares else min(s for s in shares if s is not None)


def _log_outcome(o: Outcome, origin: str) -> None:
    """One stretch of the search, at debug level: what it served and what it measured."""
    if not log.isEnabledFor(logging.DEBUG):
        return
    m = o.measurement
    what = (f"failed: {o.failure}" if o.failure is not None
            else f"{m.samples_per_s:,.0f} samples/s, waiting {m.wait_fraction:.0%}" if m is not None
            else "no window measured")
    log.debug("autotune: the loader at %s served %d samples in %.2f s on %s (%s%s): %s", origin, o.samples,
              o.wall_s, o.candidate.label(), o.phase, ", abandoned" if o.abandoned else "", what)
