"""The search core both drivers share: what a measurement is worth, and which configuration wins.

``tune_loader`` (the Optuna study, ``study.py``) and the drop-in ``DataLoader`` (the online explorer,
``online.py``) measure candidates differently (a harness ahead of training, stretches of the user's
own epochs) but record every outcome in one :class:`Ledger` and decide with its rules: one score, one
tie rule, one finalist rule, one test against the baseline, one way to describe an error.

# NOTE [ Score ]
# A candidate's score is the throughput of a whole training run of `epochs` epochs over N samples:
#     score = epochs * N / (build_s + (startup_s + stop_s) * (1 if persistent_workers else epochs)
#                           + epochs * N / samples_per_s)
# so a pre-transform cache pays its build once, workers that are not persistent pay their start-up
# and their stop every epoch, and with batch sizes that differ the comparison is per sample, never
# per step. ``stop_s`` is the candidate's worker processes times the seconds one took to stop (torch
# joins each at an epoch's end: 16 on 2 busy CPUs took 0.15 s, a sixth of a one-second epoch), as
# the drop-in measured it on the workers it stopped (``Ledger.stop_cost``); 0 until it has, and for
# thread workers and the offline study, whose windows take an epoch's end in as waiting.
#
# NOTE [ Start-ups the loop waits for ]
# A run pays ``startup_s`` at each epoch's start, when torch starts the workers and the loop waits
# for the first batch. The drop-in measures it where a stretch starts its loader and the loop waits
# for it. Many stretches do not: one that serves on the workers of the stretch before it, or on the
# user's settings' parked workers, finds them running (NOTE [ Continuing a stretch ] in epochs.py),
# and one started while another stretch served hid part of its start. Their ``startup_s`` reads near
# 0, and a score built on it is an epoch without a start-up: the user's 16 workers on 2 CPUs (a
# third of a second each epoch) then scored a third faster than the user's loop ran, and the speed-up
# reported against them read 1.74x where a plain loop over the returned loader read 1.96x. So such a
# measurement (``startup_seen`` false) is scored with the median of its candidate's start-ups the
# loop did wait for, in this search or an earlier one of the same loader (``Ledger(earlier=...)``),
# and with its own where there is none. Over the decision benchmark's grid (one repeat, quiet and
# beside a busy core), the reported speed-up then lay within 15 % of a plain loop's on 34 of 37
# wins, against 30 of 38 before; its `tabular` rows with workers written went from 0.81-0.87 of the
# plain loop to 0.94-1.06.
#
# NOTE [ Decisions ]
# 1. The baseline is what the user runs: the settings they wrote, or PyTorch's defaults where they
#    wrote none. It is measured like any candidate, even outside the search space, and every speed-up
#    is against it.
# 2. The pick among the finalists is the best median score; among those within TIE_TOLERANCE of it,
#    fewer workers, then in-order delivery, then less memory win.
# 3. The pick replaces the baseline only when it wins with confidence. The evidence is paired: each
#    measurement of the pick goes with the baseline's measurement nearest to it in time (``pairs``),
#    so that a shared machine's drift, which moves both alike, cancels within a pair. Each pair's
#    difference of log-scores has a variance from the batches inside its two windows (their
#    ``log_se``, NOTE [ Evidence from batches ] in measure.py). Where the pairs spread no more than
#    their batches say, the estimate is the pairs' mean weighted by those variances, with the
#    variance of that mean. Where they spread more (a drift within a pair, a start that differed:
#    what a window's own batches cannot see), the batches' variances do not tell a sure pair from
#    an unsure one, and the estimate is the pairs' plain mean, with the variance of their spread.
#    (One estimate and its variance from one model; against a plain loop over the returned loader
#    the two means did alike, 25 and 24 of 30 decision-benchmark wins within 15 %.)
#    The baseline's first measurement, taken while the process still warms up (its first steps are
#    slower whatever loads them) and a ram cache fills, is left out once another stands beside it
#    whose window held enough batches to tell its own spread (its ``log_se``), or MIN_PAIRS others,
#    from the verdict and from the baseline's median score: one such warm measurement is a truer
#    pace than its mean with a cold one (a run that counted both reported 8.49x where its one pair
#    read 6.86x and a plain loop over the loader it returned 6.05x), but a window of one round of 16
#    workers just started is not (alone, it read a run's speed-up 2.0x the plain loop's, 1.5x with
#    the cold one beside it). Nor does such a window stand beside one that told its spread, cold or
#    warm: one read 1,443 samples/s where that first one read 6,256, and the plain loop bore the
#    first one out; counting only windows that tell their spread where any does brought 22 of 28
#    recorded wins within 15 % of the plain loop, against 20, and six cases with 16 workers written
#    6 of 6 where they had read 2 of 6 (``benchmarks/results/decisions/w16-windows``). From
#    MIN_PAIRS pairs on; where the windows cannot say (too few batches), the ratio is tested on the
#    logarithms of every repeated measurement, with the noise from the spread of the repeats
#    themselves (the pooled variance of each candidate's measurements around its own mean). Either
#    way the noise is measured, not assumed. The one-sided lower bound of the ratio at CONFIDENCE
#    must be at least 1 + MIN_GAIN, and so must the ratio of the median scores (a gain of a few
#    percent is not worth changing what the user runs); otherwise the baseline is kept. The bound,
#    not the ratio, must clear MIN_GAIN: the pick is the best of several, so its ratio leans high,
#    and a true gain of 3-4 % read 1.06x and 1.11x with bounds of 1.01-1.05 (the decision
#    benchmark's in-memory rows, nothing written). With the bound, a gain under MIN_GAIN changes
#    what the user runs at most as often as the confidence allows. Without repeats there is no noise
#    estimate and no confident win. Where the pick does not win so, the other finalists that win at
#    RUNNER_UP_CONFIDENCE (99 %) stand in for it, the best of them by rule 2; each such test adds at
#    most 1 % to the chance of a false win. A pick's few windows may spread too far to tell, where
#    another's did not: in the decision benchmark's PNG folder with nothing written, thread workers
#    over the filled cache read 6,685 and 11,236 beside the baseline's 1,500 (5.40x, interval
#    0.74-39.14x), and the baseline was kept, undecided, with ``w=0 ram t=1`` at 4.27x (3.36-5.44x)
#    beside it. Of 109 searches recorded by that benchmark and replayed, that one alone changes.
#    The interval is reported with the speed-up: its two one-sided CONFIDENCE bounds, together a
#    two-sided interval of 2 * CONFIDENCE - 1 (90 %).
# 4. Finalists are the best FINALISTS by median score (an out-of-order leader with its in-order twin)
#    and the baseline, re-measured in interleaved rounds so that a slow drift of a shared machine hits
#    them alike.
# 5. The finals are sequential: after each round but the last, they end at once where the pick
#    already wins by rule 3 with its bound at INTERIM_CONFIDENCE (99.5 %) rather than CONFIDENCE
#    (``decided_early``), once the baseline has MIN_PAIRS warm measurements; the last
#    round's look is at CONFIDENCE. Each look may be wrong, so the
#    chance of a false win over k rounds is at most 5 % + (k - 1) x 0.5 % (at most 6.5 % in the
#    drop-in's four rounds, and 1 % more for each finalist that may stand in for the pick at the
#    last look, rule 3), while a clear win is taken after the first or second round instead of
#    the last. A challenger that no longer leads the baseline stops playing after any round
#    (NOTE [ Online search ] 5 in online.py).
# 6. What is reported is not what decided: the decision weighs the pick's cache build, as a run
#    that must still build the cache pays it, but by the time it is reported the build is paid, and
#    the cache outlives the process (NOTE [ Node caches ] in pretransform/node.py): the rest of the
#    run and every later run on the machine read it built. So the speed-up reported
#    (``Decision.served``, ``TuneResult.speedup``) is the same paired estimate as rule 3's, with
#    the same pairs, scored with the build left out; the build's seconds are reported beside it.
#    One estimator for the figure and its interval, so the figure always lies inside it (the ratio
#    of median scores once read 4.39x against an interval from 4.43x). Measured against a plain loop
#    over the returned loader (the decision benchmark, PNG folder, one busy core), the figure with
#    the build in read 0.66-0.73x of that loop where the steady-state ratio read 0.99-1.07x.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, replace
from typing import Any, Literal

import torch

from .exceptions import CandidateError, TuningFailed
from .measure import Measurement, map_loader_error
from .space import Candidate, SearchSpace

Phase = Literal["baseline", "search", "online", "final", "recheck"]
"""When a trial ran: the baseline first, the search (offline) or online exploration, the finals, or
a settled configuration checked again against the baseline."""

TrialState = Literal["complete", "failed", "pruned", "infeasible"]
"""How a trial ended: measured, failed with a reason, stopped early as clearly slower, or never run."""

PRUNE_RATIO = 0.5
"""A candidate running below this share of the best throughput so far is stopped early."""

TIE_TOLERANCE = 0.03
"""Scores within 3 % are a tie on a shared machine; the cheaper candidate wins (NOTE [ Decisions ] 2)."""

MIN_GAIN = 0.05
"""What the pick must gain over the baseline to replace it, in its ratio and in its score over the
run (NOTE [ Decisions ] 3): a sure gain of a few percent is not worth changing what the user runs."""

FINALISTS = 3
"""How many of the best candidates are re-measured beside the baseline (NOTE [ Decisions ] 4)."""

CONFIDENCE = 0.95
"""The one-sided confidence at which a candidate must beat the baseline (NOTE [ Decisions ] 3)."""

MIN_PAIRS = 2
"""Paired measurements a verdict from batches needs at least: one pair alone cannot show a drift
between its two windows (NOTE [ Decisions ] 3)."""

BLOCK_DEGREES = 2
"""Degrees of freedom a window's batches count for at least (measure.MIN_BLOCKS blocks, less one)."""

INTERIM_CONFIDENCE = 0.995
"""The one-sided confidence at which a look before the last round may end the finals early (NOTE
[ Decisions ] 5)."""

RUNNER_UP_CONFIDENCE = 0.99
"""The one-sided confidence at which another finalist may win where the pick does not (NOTE
[ Decisions ] 3): each such test adds at most 1 % to the chance of a false win."""

_T95 = ((1, 6.314), (2, 2.920), (3, 2.353), (4, 2.132), (5, 2.015), (6, 1.943), (7, 1.895),
        (8, 1.860), (9, 1.833), (10, 1.812), (12, 1.782), (15, 1.753), (20, 1.725), (30, 1.697),
        (60, 1.671), (120, 1.658))
"""One-sided 95 % quantiles of Student's t by degrees of freedom (standard tables); 1.645 beyond."""

_T995 = ((1, 63.657), (2, 9.925), (3, 5.841), (4, 4.604), (5, 4.032), (6, 3.707), (7, 3.499),
         (8, 3.355), (9, 3.250), (10, 3.169), (12, 3.055), (15, 2.947), (20, 2.845), (30, 2.750),
         (60, 2.660), (120, 2.617))
"""One-sided 99.5 % quantiles of Student's t by degrees of freedom (standard tables); 2.576 beyond."""

_T99 = ((1, 31.821), (2, 6.965), (3, 4.541), (4, 3.747), (5, 3.365), (6, 3.143), (7, 2.998),
        (8, 2.896), (9, 2.821), (10, 2.764), (12, 2.681), (15, 2.602), (20, 2.528), (30, 2.457),
        (60, 2.390), (120, 2.358))
"""One-sided 99 % quantiles of Student's t by degrees of freedom (standard tables); 2.326 beyond."""

_TABLES = {CONFIDENCE: (_T95, 1.645), RUNNER_UP_CONFIDENCE: (_T99, 2.326),
           INTERIM_CONFIDENCE: (_T995, 2.576)}

_OOM_MARKERS = ("out of memory", "CUDA error: out of memory", "DefaultCPUAllocator: can't allocate")


def interval_label(confidence: float) -> str:
    """How the bounds read together: each is one-sided at ``confidence``, so the two make a
    two-sided interval of 2 * confidence - 1 (95 % one-sided bounds: a 90 % interval)."""
    return f"{2 * confidence - 1:.0%} interval"


def t_quantile(df: int, confidence: float = CONFIDENCE) -> float:
    """The one-sided ``confidence`` quantile (CONFIDENCE, RUNNER_UP_CONFIDENCE or
    INTERIM_CONFIDENCE) of Student's t with ``df`` degrees of freedom (for a df between two table
    rows, the smaller row's, which is the larger quantile: conservative)."""
    if df < 1:
        return math.inf
    table, beyond = _TABLES[confidence]
    value = math.inf
    for rows, q in table:
        if df >= rows:
            value = q
    return value if df <= table[-1][0] else beyond


def score(m: Measurement, c: Candidate, dataset_len: int | None, epochs: int,
          stop_per_worker_s: float = 0.0) -> float:
    """See NOTE [ Score ]; ``stop_per_worker_s``: the seconds one worker process takes to stop."""
    if m.samples_per_s <= 0:
        return 0.0
    if dataset_len is None:
        return m.samples_per_s
    return epochs * dataset_len / sum(_run_seconds(m, c, dataset_len, epochs, stop_per_worker_s))


def waiting_share(m: Measurement, c: Candidate, dataset_len: int | None, epochs: int,
                  stop_per_worker_s: float = 0.0) -> float:
    """The share of a run on ``c`` (measured ``m``) in which the loop does not step: its waits between
    batches, and its cache's build and its workers' start-ups and stops (NOTE [ Score ]). No loader
    can make that run faster by more than this share of it; an evaluation loader of a few batches
    that starts 16 workers every epoch waits mostly for them to start."""
    if m.samples_per_s <= 0 or dataset_len is None:
        return m.wait_fraction
    fixed, batches = _run_seconds(m, c, dataset_len, epochs, stop_per_worker_s)
    return (fixed + batches * m.wait_fraction) / (fixed + batches)


def _run_seconds(m: Measurement, c: Candidate, dataset_len: int, epochs: int,
                 stop_per_worker_s: float) -> tuple[float, float]:
    """A run's seconds (NOTE [ Score ]): its cache's build and its workers' start-ups and stops, and
    its epochs' batches."""
    startups = 1 if (c.persistent_workers and c.num_workers > 0) else epochs
    stop_s = c.num_workers * stop_per_worker_s if c.worker_kind == "process" else 0.0
    return m.build_s + (m.startup_s + stop_s) * startups, epochs * dataset_len / m.samples_per_s


def pair_means(diffs: Sequence[float], variances: Sequence[float]
               ) -> tuple[tuple[float, float], tuple[float, float]]:
    """Two estimates of paired differences (NOTE [ Decisions ] 3), each with its variance: their
    mean weighted by the variances their windows' batches give, and their plain mean with the
    variance of their spread (at least two pairs)."""
    weights = [1.0 / v for v in variances]
    weighted = sum(w * d for w, d in zip(weights, diffs, strict=True)) / sum(weights)
    return (weighted, 1.0 / sum(weights)), (statistics.fmean(diffs), statistics.variance(diffs) / len(diffs))


def estimate_workers(baseline: Measurement, bound: int) -> int:
    """Workers that would keep the step busy, from a measurement without workers.

    Without workers a batch costs its load time L (the wait) plus the step S, one after the other;
    with workers loading overlaps the step, and about ceil(L / S) of them are needed so that a batch
    is always ready. Bounded by ``bound``; at least one.
    """
    step = max(baseline.step_ms, 1e-3)
    return max(1, min(bound, math.ceil(baseline.wait_ms / step)))


@dataclass(frozen=True)
class Failure:
    """Why a candidate has no measurement: the error's type and its one line (``describe_error``)."""

    kind: str
    """The exception's type name (``WorkerFailed``, ``MemoryLimitExceeded``, the user's own type)."""
    message: str
    in_worker: bool = False
    """Raised in a worker and re-raised by torch: ``message`` is the original's last line."""
    rank: int | None = None
    """Under torchrun, the rank it failed on (``None``: this process)."""

    @classmethod
    def of(cls, err: BaseException) -> Failure:
        mapped = map_loader_error(err)
        if mapped is not None:
            return cls(type(mapped).__name__, str(mapped).strip().splitlines()[0][:300])
        lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
        if len(lines) > 1 and ("worker process" in lines[0] or "thread worker" in lines[0]):
            return cls(type(err).__name__, lines[-1][:300], in_worker=True)
        return cls(type(err).__name__, (lines or [""])[0][:300])

    def on_rank(self, rank: int) -> Failure:
        return replace(self, rank=rank)

    def __str__(self) -> str:
        text = f"{self.kind}{' in a worker' if self.in_worker else ''}: {self.message}"
        return text if self.rank is None else f"failed on rank {self.rank}: {text}"


def describe_error(err: BaseException) -> str:
    """One line for a failed trial: ``Type: message``; a worker failure as the candidate's; an error
    re-raised from a worker by the original's last line."""
    return str(Failure.of(err))


def is_oom(err: BaseException) -> bool:
    """Whether ``err`` is running out of memory (host or device)."""
    if isinstance(err, MemoryError) and not isinstance(err, CandidateError):
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _OOM_MARKERS)


@dataclass(frozen=True)
class TrialRecord:
    """One candidate tried: its configuration and either its measurement or why it has none."""

    number: int
    phase: Phase
    candidate: Candidate
    state: TrialState
    measurement: Measurement | None = None
    score: float | None = None
    reason: str | None = None
    duration_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["candidate"] = self.candidate.to_dict()
        data["measurement"] = self.measurement.to_dict() if self.measurement else None
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> TrialRecord:
        m = data.get("measurement")
        return cls(
            number=int(data["number"]),
            phase=data["phase"],
            candidate=Candidate.from_dict(data["candidate"]),
            state=data["state"],
            measurement=Measurement.from_dict(m) if m else None,
            score=float(data["score"]) if data.get("score") is not None else None,
            reason=data.get("reason"),
            duration_s=float(data.get("duration_s", 0.0)),
        )


@dataclass(frozen=True)
class Summary:
    """One candidate over all its measurements: the medians of throughput, busy and wait fractions
    and score; ``spread`` = (max - min) / median of the throughput; the highest peak memory."""

    candidate: Candidate
    samples_per_s: float
    busy: float
    wait_fraction: float
    score: float
    spread: float
    peak_memory_bytes: int
    measurements: int
    measurement: Measurement
    """The measurement whose score is nearest the median (its start-up and build figures)."""


@dataclass(frozen=True)
class Verdict:
    """A candidate against the baseline (NOTE [ Decisions ] 3): the ratio of their scores (geometric
    means), its one-sided lower and upper bounds at ``confidence``, and whether it wins."""

    ratio: float
    low: float
    high: float
    confidence: float
    degrees_of_freedom: int

    @property
    def faster(self) -> bool:
        """Faster than the baseline with confidence, perhaps by too little to be worth a change."""
        return self.low > 1.0

    @property
    def wins(self) -> bool:
        """Faster than the baseline by at least MIN_GAIN with confidence: what replacing it takes."""
        return self.low >= 1.0 + MIN_GAIN

    @property
    def open(self) -> bool:
        """Neither a win nor ruled out as one: more measuring could still show a gain of MIN_GAIN."""
        return not self.wins and self.high >= 1.0 + MIN_GAIN

    @property
    def loses(self) -> bool:
        return self.high < 1.0

    def describe(self) -> str:
        if self.degrees_of_freedom < 1:
            return f"{self.ratio:.2f}x, measured once (no repeat to tell it from noise)"
        return f"{self.ratio:.2f}x ({interval_label(self.confidence)} {self.low:.2f}-{self.high:.2f}x)"

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "wins": self.wins}


def verdict_text(verdict: Verdict, served: Verdict | None) -> str:
    """What a pick measured against the baseline: over the run (its cache's build included) and,
    where that differs, once the cache is built (NOTE [ Decisions ] 6)."""
    if served is None or math.isclose(served.ratio, verdict.ratio, rel_tol=0.005):
        return verdict.describe()
    return f"{verdict.describe()} building its cache, {served.describe()} once it is built"


@dataclass(frozen=True)
class Decision:
    """What the finals decided: the configuration to use, the best challenger and its verdict."""

    chosen: Summary
    baseline: Summary | None
    challenger: Summary | None
    verdict: Verdict | None
    reason: str
    served: Verdict | None = None
    """The chosen configuration against the baseline as its loop runs once its cache is built, the
    figure reported (NOTE [ Decisions ] 6); ``None`` where the baseline is kept or unmeasured."""

    @property
    def kept_baseline(self) -> bool:
        return self.baseline is not None and self.chosen.candidate == self.baseline.candidate

    @property
    def undecided(self) -> bool:
        """The baseline kept while the best challenger measured ahead of it by more than a tie, but
        not with confidence: more measuring could still show it faster (or not)."""
        v = self.verdict
        return self.kept_baseline and v is not None and v.ratio >= 1.0 + MIN_GAIN and v.open


def _tells_spread(r: TrialRecord) -> bool:
    """Whether a record's window held enough batches to tell its own spread (``log_se``)."""
    return r.measurement is not None and r.measurement.log_se is not None


class Ledger:
    """Every trial of one search, and the rules that decide on them (NOTE [ Decisions ])."""

    def __init__(self, dataset_len: int | None, epochs: int, earlier: Iterable[TrialRecord] = ()) -> None:
        """``earlier``: the records of earlier searches of the same loader, whose start-ups stand
        for those this one does not see (NOTE [ Start-ups the loop waits for ])."""
        self.dataset_len = dataset_len
        self.epochs = epochs
        self.records: list[TrialRecord] = []
        self.by_candidate: dict[Candidate, list[TrialRecord]] = {}
        self.user_errors: list[tuple[BaseException, Candidate]] = []
        self.best_sps = 0.0
        self.best_score = 0.0
        self.stop_per_worker_s = 0.0
        """The seconds one worker process takes to stop (NOTE [ Score ]); 0: not measured."""
        self.startups: dict[Candidate, list[float]] = {}
        """Per candidate, the start-ups its loop waited for whole (NOTE [ Start-ups the loop waits for ])."""
        for rec in earlier:
            self._learn_startup(rec.candidate, rec.measurement)

    @classmethod
    def replayed(cls, records: Iterable[TrialRecord], dataset_len: int | None, epochs: int,
                 stop_per_worker_s: float = 0.0) -> Ledger:
        """A ledger of ``records`` as they were recorded (a search's trials read back from its
        result), scored again with workers that take ``stop_per_worker_s`` each to stop."""
        records = list(records)
        ledger = cls(dataset_len, epochs, earlier=records)
        ledger.records = records
        ledger.stop_per_worker_s = stop_per_worker_s
        ledger._rescore()
        return ledger

    def record(self, c: Candidate, phase: Phase, state: TrialState, *, m: Measurement | None = None,
               reason: str | None = None, duration_s: float = 0.0) -> TrialRecord:
        rec = TrialRecord(len(self.records), phase, c, state, m, self._score(m, c) if m is not None else None,
                          reason, duration_s)
        self.records.append(rec)
        if self._learn_startup(c, m) and any(r.measurement is not None and not r.measurement.startup_seen
                                             for r in self.by_candidate.get(c, ())):
            self._rescore()  # its measurements served on running workers count this start-up now
        else:
            self._count(rec)
        return rec

    def _learn_startup(self, c: Candidate, m: Measurement | None) -> bool:
        """Keep ``m``'s start-up where its loop waited for it whole; whether it did."""
        if m is None or not m.startup_seen:
            return False
        self.startups.setdefault(c, []).append(m.startup_s)
        return True

    def _score(self, m: Measurement, c: Candidate, built: bool = True) -> float:
        """``m``'s score (NOTE [ Score ]), with the start-up ``c``'s loop waits for (NOTE [ Start-ups
        the loop waits for ]); ``built`` false: with its cache's build left out (NOTE [ Decisions ] 6)."""
        seen = self.startups.get(c)
        if not m.startup_seen and seen:
            m = replace(m, startup_s=statistics.median(seen))
        if not built and m.build_s:
            m = replace(m, build_s=0.0)
        return score(m, c, self.dataset_len, self.epochs, self.stop_per_worker_s)

    def _count(self, rec: TrialRecord) -> None:
        m, sc = rec.measurement, rec.score
        if m is not None and sc is not None and rec.state == "complete":
            self.by_candidate.setdefault(rec.candidate, []).append(rec)
            self.best_sps = max(self.best_sps, m.samples_per_s)
            self.best_score = max(self.best_score, sc)

    def stop_cost(self, per_worker_s: float) -> None:
        """Score every record, past and to come, with workers that take ``per_worker_s`` each to stop
        (NOTE [ Score ]): the first stretches are recorded before any worker was stopped."""
        if per_worker_s == self.stop_per_worker_s:
            return
        self.stop_per_worker_s = per_worker_s
        self._rescore()

    def _rescore(self) -> None:
        """Score every record again, with the stop cost and the start-ups known now."""
        self.records = [r if r.measurement is None else
                        replace(r, score=self._score(r.measurement, r.candidate)) for r in self.records]
        self.by_candidate, self.best_sps, self.best_score = {}, 0.0, 0.0
        for rec in self.records:
            self._count(rec)

    def tried(self) -> set[Candidate]:
        return {r.candidate for r in self.records if r.state != "infeasible"}

    def measured(self, c: Candidate) -> int:
        return len(self.by_candidate.get(c, ()))

    def summarize(self, c: Candidate, records: Sequence[TrialRecord] | None = None) -> Summary:
        """``c`` over its measurements (``records``: over these of them)."""
        recs = list(records) if records is not None else self.by_candidate[c]
        ms = [r.measurement for r in recs if r.measurement is not None]
        sps = [m.samples_per_s for m in ms]
        med = statistics.median(sps)
        med_score = statistics.median(r.score or 0.0 for r in recs)
        near = min(recs, key=lambda r: abs((r.score or 0.0) - med_score))
        assert near.measurement is not None
        return Summary(
            candidate=c,
            samples_per_s=med,
            busy=statistics.median(m.busy for m in ms),
            wait_fraction=statistics.median(m.wait_fraction for m in ms),
            score=med_score,
            spread=(max(sps) - min(sps)) / med if med > 0 else 0.0,
            peak_memory_bytes=max(m.peak_memory_bytes for m in ms),
            measurements=len(ms),
            measurement=near.measurement,
        )

    def ranked(self) -> list[Candidate]:
        """Every measured candidate, best median score first."""
        return sorted(self.by_candidate, key=lambda c: -self.summarize(c).score)

    def pick(self, candidates: Iterable[Candidate]) -> Summary | None:
        """The best median score; within TIE_TOLERANCE of it, fewer workers, in order, less memory."""
        summaries = [self.summarize(c) for c in dict.fromkeys(candidates) if c in self.by_candidate]
        if not summaries:
            return None
        top = max(s.score for s in summaries)
        tied = [s for s in summaries if s.score >= (1.0 - TIE_TOLERANCE) * top]
        return min(tied, key=lambda s: (s.candidate.num_workers, not s.candidate.in_order,
                                        s.peak_memory_bytes, -s.score))

    def finalists(self, baseline: Candidate, space: SearchSpace | None = None) -> list[Candidate]:
        """The best FINALISTS by median score, the baseline last (NOTE [ Decisions ] 4).

        An out-of-order leader comes with its in-order twin (when ``space`` allows it), so that
        out-of-order delivery wins only where it is clearly faster.
        """
        out = [c for c in self.ranked() if c != baseline][:FINALISTS]
        if out and not out[0].in_order:
            twin = replace(out[0], in_order=True)
            if twin not in out and (space is None or space.check(twin) is None):
                out.append(twin)
        if baseline in self.by_candidate:
            out.append(baseline)
        return out

    def _log_score(self, rec: TrialRecord, built: bool) -> float | None:
        """The logarithm of ``rec``'s score; ``built`` false: with its cache's build left out (NOTE
        [ Decisions ] 6). ``None`` where it has none."""
        m = rec.measurement
        if not rec.score or m is None:
            return None
        if built or not m.build_s:
            return math.log(rec.score)
        return math.log(self._score(m, rec.candidate, built=False))

    def log_scores(self, recs: Iterable[TrialRecord], built: bool) -> list[float]:
        """The logarithms of ``recs``' scores, those without one left out (``built`` as for
        ``verdict``)."""
        return [x for x in (self._log_score(r, built) for r in recs) if x is not None]

    def noise(self, baseline: Candidate | None = None, built: bool = True) -> tuple[float, int]:
        """(pooled variance of log-scores around each candidate's mean, degrees of freedom); of
        ``baseline``, the measurements a verdict weighs (its cold first one left out as there);
        ``built`` false: scored with their caches' builds left out."""
        ss = 0.0
        df = 0
        for c, recs in self.by_candidate.items():
            if c == baseline:
                recs = self.baseline_records(c)
            logs = self.log_scores(recs, built)
            if len(logs) > 1:
                mean = statistics.fmean(logs)
                ss += sum((x - mean) ** 2 for x in logs)
                df += len(logs) - 1
        return (ss / df if df else math.inf), df

    def pairs(self, c: Candidate, baseline: Candidate) -> list[tuple[TrialRecord, TrialRecord]]:
        """Each measurement of ``c`` with the measurement of ``baseline`` nearest to it in time (by
        trial number), each used once (NOTE [ Decisions ] 3)."""
        free = self.baseline_records(baseline)
        out = []
        for rec in self.by_candidate.get(c, ()):
            if not free:
                break
            near = min(free, key=lambda r: abs(r.number - rec.number))
            free.remove(near)
            out.append((rec, near))
        return out

    def warm_baseline(self, baseline: Candidate) -> list[TrialRecord]:
        """The baseline's measurements after its first (phase ``baseline``, taken cold)."""
        return [r for r in self.by_candidate.get(baseline, ()) if r.phase != "baseline"]

    def baseline_records(self, baseline: Candidate) -> list[TrialRecord]:
        """The baseline's measurements a verdict weighs: its first one (phase ``baseline``, taken
        while a process still warms up) only until another stands beside it that held enough
        batches to tell its own spread, or MIN_PAIRS others do; and of those, the ones that held
        enough batches to tell their spread, where any did (NOTE [ Decisions ] 3)."""
        recs = list(self.by_candidate.get(baseline, ()))
        later = self.warm_baseline(baseline)
        weighed = later if any(map(_tells_spread, later)) or len(later) >= MIN_PAIRS else recs
        # A window too short to tell its own spread does not stand beside one that can.
        return [r for r in weighed if _tells_spread(r)] or weighed

    def paired_logs(self, c: Candidate, baseline: Candidate, built: bool = True
                    ) -> tuple[list[float], list[float]]:
        """Per pair (``pairs``) whose two windows both have their batches' standard errors: the
        difference of their log-scores, and its variance from those batches (NOTE [ Decisions ] 3)."""
        diffs: list[float] = []
        variances: list[float] = []
        for a, b in self.pairs(c, baseline):
            ma, mb = a.measurement, b.measurement
            la, lb = self._log_score(a, built), self._log_score(b, built)
            if la is None or lb is None or ma is None or mb is None or ma.log_se is None or mb.log_se is None:
                continue
            diffs.append(la - lb)
            variances.append(max(ma.log_se ** 2 + mb.log_se ** 2, 1e-12))
        return diffs, variances

    def _paired_verdict(self, c: Candidate, baseline: Candidate, confidence: float = CONFIDENCE,
                        built: bool = True) -> Verdict | None:
        """The verdict from paired windows and their batches (NOTE [ Decisions ] 3); ``None`` where
        fewer than MIN_PAIRS pairs have both windows' standard errors."""
        diffs, variances = self.paired_logs(c, baseline, built)
        n = len(diffs)
        if n < MIN_PAIRS:
            return None
        (weighted, within), (plain, between) = pair_means(diffs, variances)
        if within >= between:  # the batches account for the pairs' spread: weigh each by them
            diff, var, df = weighted, within, 2 * BLOCK_DEGREES * n
        else:  # they do not: no pair is surer than another, and the estimate is their plain mean
            diff, var, df = plain, between, n - 1
        half = t_quantile(df, confidence) * math.sqrt(var)
        return Verdict(math.exp(diff), math.exp(diff - half), math.exp(diff + half), confidence, df)

    def verdict(self, c: Candidate, baseline: Candidate, confidence: float = CONFIDENCE,
                built: bool = True) -> Verdict | None:
        """``c`` against ``baseline`` (NOTE [ Decisions ] 3), its bounds one-sided at ``confidence``;
        ``built`` false: as the loop runs once the caches are built (NOTE [ Decisions ] 6). ``None``
        when either is unmeasured."""
        if c != baseline:
            paired = self._paired_verdict(c, baseline, confidence, built)
            if paired is not None:
                return paired
        a = self.log_scores(self.by_candidate.get(c, ()), built)
        b = self.log_scores(self.baseline_records(baseline) if c != baseline
                            else self.by_candidate.get(baseline, ()), built)
        if not a or not b:
            return None
        diff = statistics.fmean(a) - statistics.fmean(b)
        var, df = self.noise(baseline, built)
        if df < 1:
            return Verdict(math.exp(diff), 0.0, math.inf, confidence, 0)
        half = t_quantile(df, confidence) * math.sqrt(var * (1.0 / len(a) + 1.0 / len(b)))
        return Verdict(math.exp(diff), math.exp(diff - half), math.exp(diff + half), confidence, df)

    def served(self, c: Candidate, baseline: Candidate, verdict: Verdict) -> tuple[Verdict | None, str]:
        """``c`` against ``baseline`` once its cache is built (the figure reported, NOTE [ Decisions ]
        6), and the text of it beside ``verdict``, the one over the run (``verdict_text``)."""
        served = self.verdict(c, baseline, built=False)
        return served, verdict_text(verdict, served)

    def decided_early(self, finalists: Sequence[Candidate], baseline: Candidate) -> bool:
        """Whether the finals may end before their last round (NOTE [ Decisions ] 5): the pick wins
        as ``decide`` would have it win, with its bound at INTERIM_CONFIDENCE."""
        if len(self.warm_baseline(baseline)) < MIN_PAIRS:  # one warm window cannot show its spread
            return False
        challenger = self.pick(c for c in finalists if c != baseline)
        if challenger is None:
            return False
        verdict = self.verdict(challenger.candidate, baseline, INTERIM_CONFIDENCE)
        return verdict is not None and self._wins(verdict, challenger, self._baseline_summary(baseline))

    def _baseline_summary(self, baseline: Candidate) -> Summary:
        """The baseline over the measurements a verdict weighs (``baseline_records``): its median
        score is then the pace its pairs had, not the cold first stretch's."""
        return self.summarize(baseline, self.baseline_records(baseline))

    @staticmethod
    def _wins(verdict: Verdict, challenger: Summary, base: Summary) -> bool:
        # ``wins`` holds the ratio's lower bound to 1 + MIN_GAIN, so the ratio itself is past it too.
        return verdict.wins and challenger.score >= (1.0 + MIN_GAIN) * base.score

    def decide(self, finalists: Sequence[Candidate], baseline: Candidate) -> Decision:
        """The configuration to use (NOTE [ Decisions ] 2-3)."""
        base = self._baseline_summary(baseline) if baseline in self.by_candidate else None
        challenger = self.pick(c for c in finalists if c != baseline)
        if base is None:
            if challenger is None:
                raise self.failure()
            return Decision(challenger, None, challenger, None,
                            "the baseline could not be measured; the best measured configuration is used")
        if challenger is None:
            return Decision(base, base, None, None, "no other configuration could be measured")
        verdict = self.verdict(challenger.candidate, baseline)
        assert verdict is not None
        behind = ""
        if not self._wins(verdict, challenger, base):
            runner_up = self._runner_up(finalists, baseline, challenger.candidate, base)
            if runner_up is not None:
                behind = (f"; {challenger.candidate.label()}, ahead by its median score, measured"
                          f" {verdict.describe()}, undecided, and this one wins at"
                          f" {RUNNER_UP_CONFIDENCE:.0%} confidence too")
                challenger, verdict = runner_up, self.verdict(runner_up.candidate, baseline)
                assert verdict is not None
        if self._wins(verdict, challenger, base):
            served, said = self.served(challenger.candidate, baseline, verdict)
            return Decision(challenger, base, challenger, verdict,
                            f"{challenger.candidate.label()} beats the baseline: {said}{behind}",
                            served=served)
        if verdict.ratio < 1.0 + MIN_GAIN or verdict.wins:  # the latter: short by its median score
            why = f"faster by less than {MIN_GAIN:.0%}: not worth a change"
        else:
            why = f"not {MIN_GAIN:.0%} faster at {verdict.confidence:.0%} confidence"
        kept = Decision(base, base, challenger, verdict,
                        f"kept the baseline: the best other configuration, {challenger.candidate.label()},"
                        f" measured {verdict.describe()}, {why}")
        more = self.rounds_to_decide(challenger.candidate, baseline, verdict) if kept.undecided else None
        if more is None:
            return kept
        rounds, seconds = more
        took = f" (~{seconds:.0f} s)" if seconds >= 1 else ""
        return replace(kept, reason=(
            f"{kept.reason}: undecided; about {rounds} more round{'s' if rounds != 1 else ''} of the"
            f" two side by side{took} would decide it if that ratio holds"))

    def _runner_up(self, finalists: Sequence[Candidate], baseline: Candidate, pick: Candidate,
                   base: Summary) -> Summary | None:
        """Where the pick does not win with confidence, the best of the other finalists that do, at
        RUNNER_UP_CONFIDENCE (NOTE [ Decisions ] 3); ``None`` where none does."""
        winners = []
        for c in finalists:
            if c in (baseline, pick) or c not in self.by_candidate:
                continue
            verdict = self.verdict(c, baseline, RUNNER_UP_CONFIDENCE)
            if verdict is not None and self._wins(verdict, self.summarize(c), base):
                winners.append(c)
        return self.pick(winners)

    def rounds_to_decide(self, c: Candidate, baseline: Candidate,
                         verdict: Verdict) -> tuple[int, float] | None:
        """(rounds, seconds) more of ``c`` and ``baseline`` side by side after which ``verdict``'s
        ratio, if it held, would be a win: its interval narrows as the square root of the rounds, and
        its lower end must reach 1 + MIN_GAIN. ``None`` where it measured less than that, or has no
        interval to narrow."""
        gain = 1.0 + MIN_GAIN
        if verdict.ratio <= gain or verdict.wins or verdict.low <= 0.0 or not math.isfinite(verdict.high):
            return None
        n = max(1, min(self.measured(c), self.measured(baseline)))
        needed = n * (math.log(verdict.ratio / verdict.low) / math.log(verdict.ratio / gain)) ** 2
        rounds = max(1, math.ceil(needed - n))
        per_round = sum(statistics.median(r.duration_s for r in self.by_candidate[x])
                        for x in (c, baseline))
        return rounds, rounds * per_round

    def failure(self, budget_s: float | None = None) -> BaseException:
        """The error to raise when nothing completed: the user's own, else a summary."""
        if self.user_errors:
            err, c = self.user_errors[0]
            tried = sum(1 for r in self.records if r.state in ("failed", "pruned", "complete"))
            err.add_note(
                f"autotune: raised under candidate {c.label()}; every one of the {tried}"
                " candidates tried failed, so this is most likely a bug in the dataset or step."
            )
            return err
        reasons = sorted({r.reason or r.state for r in self.records})
        within = f" within budget_s={budget_s:g}" if budget_s is not None else ""
        return TuningFailed(
            f"no candidate could be measured{within}; reasons: " + "; ".join(reasons[:5])
            + ". Raise budget_s, or check the dataset with a plain DataLoader first."
        )
