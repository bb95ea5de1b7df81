"""The search: an Optuna study over the space, the only module that imports Optuna.

# NOTE [ Search ]
# 1. PyTorch's defaults (the baseline) are measured first, so every later figure has a reference from
#    the same run. Strategies the pre-transform module refused are recorded as infeasible trials.
# 2. An Optuna study (TPE, seeded) proposes candidates, warm-started first with the workers that would
#    keep the step busy as estimated from the baseline (load time over step time, estimate_workers;
#    the drop-in DataLoader starts its exploration from the same estimate), then with points that span
#    the worker range: the cores-based rule of thumb, one worker per core, and the worker bound. Each
#    candidate is measured for real; a failing candidate becomes a failed trial with its reason and the
#    search goes on. A candidate whose running throughput falls below PRUNE_RATIO of the best so far
#    is pruned. An out-of-memory error at a batch size makes that batch size and larger ones infeasible.
#    The search stops early once PATIENCE candidates in a row after the warm starts brought no better
#    score: the budget is a ceiling, not a target.
# 3. At most FINAL_FRACTION of the budget re-measures the finalists (the best few, plus the baseline)
#    in interleaved rounds: at least MIN_FINAL_ROUNDS, and no more once a round leaves the pick as it
#    was. Each one's figures are the medians over its measurements, the winner has the best median
#    score, and among candidates within TIE_TOLERANCE of it the one with fewer workers, then in-order
#    delivery (batches in the sampler's order unless that is clearly slower; an out-of-order leader
#    is re-measured beside its in-order twin), then less memory wins. The speed-up is the winner's
#    score over the baseline's, both taken from the same rounds.
#
# NOTE [ Score ]
# A candidate's score is the throughput of a whole training run of `epochs` epochs over N samples:
#     score = epochs * N / (build_s + startup_s * (1 if persistent_workers else epochs)
#                           + epochs * N / samples_per_s)
# so a pre-transform cache pays its build once, workers that are not persistent pay their start-up
# every epoch, and with batch sizes that differ the comparison is per sample, never per step.
"""

from __future__ import annotations

import contextlib
import logging
import math
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import optuna
import torch

from .describe import jsonable
from .exceptions import CandidateError, ProfileStoreWarning, TrialPruned, TuningFailed
from .measure import MeasureLimits, Measurement, measure
from .profiles import mask_url
from .progress import Progress
from .space import Candidate, SearchSpace

log = logging.getLogger(__name__)

FINAL_FRACTION = 0.25
"""Share of the budget kept for re-measuring the finalists side by side."""

FINALISTS = 3
"""How many of the best candidates are re-measured (the baseline always is, too)."""

MAX_FINAL_ROUNDS = 5
"""Re-measurement rounds at most; more only narrows an already small spread."""

MIN_FINAL_ROUNDS = 2
"""Re-measurement rounds the finalists get whenever the budget leaves room for them."""

PATIENCE = 10
"""Searched candidates in a row without a better score (by TIE_TOLERANCE) after which the search
has converged and stops early, leaving the rest of the budget unspent."""

PRUNE_RATIO = 0.5
"""A candidate running below this fraction of the best throughput so far is stopped early."""

TIE_TOLERANCE = 0.03
"""Scores within 3 % are a tie on a shared machine; the cheaper candidate (fewer workers) wins."""

MAX_IDLE_PROPOSALS = 40
"""Consecutive proposals that were duplicates or infeasible after which the space counts as explored."""

_OOM_MARKERS = ("out of memory", "CUDA error: out of memory", "DefaultCPUAllocator: can't allocate")


@dataclass(frozen=True)
class TrialRecord:
    """One candidate tried: its configuration and either its measurement or why it has none."""

    number: int
    phase: str  # "baseline" | "search" | "final"
    candidate: Candidate
    state: str  # "complete" | "failed" | "pruned" | "infeasible"
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
            phase=str(data["phase"]),
            candidate=Candidate.from_dict(data["candidate"]),
            state=str(data["state"]),
            measurement=Measurement.from_dict(m) if m else None,
            score=data.get("score"),
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


@dataclass(frozen=True)
class SearchSettings:
    """Everything the search needs besides the dataset, the step and the space."""

    budget_s: float
    epochs: int
    dataset_len: int | None
    device: torch.device
    limits: MeasureLimits = field(default_factory=MeasureLimits)
    seed: int = 0
    shuffle: bool = True
    collate_fn: Callable[[Any], Any] | None = None
    usable_cpus: int = 1
    storage_url: str | None = field(default=None, repr=False)
    """The study database's URL, password included: used to connect, never shown or stored."""
    study_name: str | None = None
    refused: dict[str, str] = field(default_factory=dict)
    """Pre-transform strategies refused for this dataset, with the reason (recorded as trials)."""
    started_at: float | None = None
    """``time.monotonic()`` when the caller's budget began; the search's own start when ``None``."""


@dataclass(frozen=True)
class SearchOutcome:
    """What a search found: the pick, the baseline from the same finals, every trial."""

    best: Summary
    baseline: Summary | None
    speedup: float | None
    trials: tuple[TrialRecord, ...]
    study_name: str | None


def score(m: Measurement, c: Candidate, dataset_len: int | None, epochs: int) -> float:
    """See NOTE [ Score ]."""
    if m.samples_per_s <= 0:
        return 0.0
    if dataset_len is None:
        return m.samples_per_s
    startups = 1 if (c.persistent_workers and c.num_workers > 0) else epochs
    total = m.build_s + m.startup_s * startups + epochs * dataset_len / m.samples_per_s
    return epochs * dataset_len / total


def _is_oom(err: BaseException) -> bool:
    if isinstance(err, MemoryError) and not isinstance(err, CandidateError):
        return True
    oom_type = getattr(torch, "OutOfMemoryError", None)
    if oom_type is not None and isinstance(err, oom_type):
        return True
    return isinstance(err, RuntimeError) and any(s in str(err) for s in _OOM_MARKERS)


def describe_error(err: BaseException) -> str:
    """``Type: message`` on one line; for an error re-raised from a worker, the original's last line."""
    lines = [ln.strip() for ln in str(err).strip().splitlines() if ln.strip()]
    if len(lines) > 1 and ("worker process" in lines[0] or "thread worker" in lines[0]):
        return f"{type(err).__name__} in a worker: {lines[-1][:300]}"
    return f"{type(err).__name__}: {(lines or [''])[0][:300]}"


def _worker_param(space: SearchSpace, pretransform: str, kind: str) -> tuple[str, int] | None:
    """The Optuna parameter (name, upper bound) that counts workers of ``kind``, if any.

    Each kind has its own parameter, so every parameter keeps one distribution for the whole study;
    with both kinds, ``worker_kind`` chooses between them and 0 threads is the same candidate as 0
    processes (the search counts such a repeat once).
    """
    if kind not in space.worker_kinds(pretransform):
        return None
    return ("num_workers", space.max_workers) if kind == "process" else ("worker_threads", space.max_threads)


def params_of(c: Candidate, space: SearchSpace) -> dict[str, Any]:
    """The Optuna parameters that ``suggest`` would draw to produce ``c`` (for warm starts)."""
    params: dict[str, Any] = {}
    if len(space.batch_sizes) > 1:
        params["batch_size"] = c.batch_size
    if len(space.pretransforms) > 1:
        params["pretransform"] = c.pretransform
    kinds = space.worker_kinds(c.pretransform)
    kind = kinds[0] if len(kinds) == 1 else c.worker_kind
    if len(kinds) > 1:
        params["worker_kind"] = kind
    counted = _worker_param(space, c.pretransform, kind)
    if counted is not None:
        params[counted[0]] = c.num_workers
    if c.num_workers > 0:
        params["prefetch_factor"] = c.prefetch_factor
        if len(space.in_order_choices) > 1:
            params["in_order"] = c.in_order
    if space.cuda and c.pretransform != "device":
        params["pin_memory"] = c.pin_memory
    if len(space.torch_threads) > 1:
        params["torch_threads"] = c.torch_threads
    return params


def suggest(trial: optuna.Trial, space: SearchSpace) -> Candidate:
    """Draw a candidate; the conditional structure keeps every draw feasible by construction."""
    bs = (
        trial.suggest_categorical("batch_size", list(space.batch_sizes))
        if len(space.batch_sizes) > 1
        else space.batch_sizes[0]
    )
    pt = (
        trial.suggest_categorical("pretransform", list(space.pretransforms))
        if len(space.pretransforms) > 1
        else space.pretransforms[0]
    )
    kinds = space.worker_kinds(pt)
    kind = "process"
    if len(kinds) > 1:
        kind = str(trial.suggest_categorical("worker_kind", list(kinds)))
    elif kinds:
        kind = kinds[0]
    workers = 0
    counted = _worker_param(space, pt, kind)
    if counted is not None:
        workers = trial.suggest_int(counted[0], 0, counted[1])
    prefetch: int | None = None
    in_order = True
    if workers > 0:
        prefetch = trial.suggest_categorical("prefetch_factor", list(space.prefetch_factors))
        if len(space.in_order_choices) > 1:
            in_order = bool(trial.suggest_categorical("in_order", list(space.in_order_choices)))
    pin = False
    if space.cuda and pt != "device":
        pin = trial.suggest_categorical("pin_memory", [False, True])
    threads = space.torch_threads[0]
    if len(space.torch_threads) > 1:
        threads = int(trial.suggest_categorical("torch_threads", [int(t or 0) for t in space.torch_threads]))
    return Candidate(bs, pin_memory=pin, pretransform=pt, torch_threads=threads,
                     **space.workers(kind, workers, prefetch, in_order))


def estimate_workers(baseline: Measurement, bound: int) -> int:
    """Workers that would keep the step busy, from a measurement without workers (NOTE [ Search ] 2).

    Without workers a batch costs its load time L (the wait) plus the step S, one after the other;
    with workers loading overlaps the step, and about ceil(L / S) of them are needed so that a batch
    is always ready. Bounded by ``bound``; at least one.
    """
    step = max(baseline.step_ms, 1e-3)
    return max(1, min(bound, math.ceil(baseline.wait_ms / step)))


def warm_starts(space: SearchSpace, usable_cpus: int,
                baseline: Measurement | None = None) -> list[Candidate]:
    """Points that span the worker range, so the sampler starts from informed corners; with the
    baseline's measurement, the estimated worker count of each kind first (:func:`estimate_workers`)."""
    heuristic = space.heuristic(usable_cpus)

    def with_workers(base: Candidate, kind: str, count: int) -> Candidate:
        return replace(base, **space.workers(kind, count, 2 if count else None))

    points = []
    if baseline is not None:
        for kind, bound in (("process", space.max_workers), ("thread", space.max_threads)):
            if bound > 0:
                points.append(with_workers(heuristic, kind, estimate_workers(baseline, bound)))
    points.append(heuristic)
    # A cache next: it is the largest win where it applies, and a short budget may end before the
    # points that span the worker range.
    for strategy in ("ram", "device"):
        if strategy not in space.pretransforms:
            continue
        cached = replace(heuristic, pretransform=strategy,
                         pin_memory=heuristic.pin_memory and strategy != "device")
        # A cache often needs no workers at all (nothing left to compute per sample), and with a
        # random rest it may still want some: start from both, and from one thread where threads apply.
        for workers in sorted({0, 0 if strategy == "device" else heuristic.num_workers}):
            points.append(with_workers(cached, "process", workers))
        if space.max_threads > 0:
            points.append(with_workers(cached, "thread", 1))
    for workers in (min(usable_cpus, space.max_workers), space.max_workers):
        if workers > 0:
            points.append(with_workers(heuristic, "process", workers))
    if space.max_threads > 0:
        # One background thread already hides loading behind the step where loading is light.
        for threads in sorted({1, min(usable_cpus, space.max_threads)}):
            points.append(with_workers(heuristic, "thread", threads))
    if False in space.in_order_choices:
        ordered = next((p for p in points if p.num_workers > 0), None)
        if ordered is not None:
            points.append(replace(ordered, in_order=False))
    unique: list[Candidate] = []
    for p in points:
        if p not in unique and space.check(p) is None:
            unique.append(p)
    return unique


@contextlib.contextmanager
def _quiet_optuna() -> Iterator[None]:
    """Optuna logs every trial at INFO on its own handler; the progress display says it better."""
    logger = logging.getLogger("optuna")
    old = logger.level
    logger.setLevel(logging.WARNING)
    try:
        yield
    finally:
        logger.setLevel(old)


class _Ledger:
    """Every trial of one search so far, and the figures the phases decide on."""

    def __init__(self, settings: SearchSettings, progress: Progress) -> None:
        self.settings = settings
        self.progress = progress
        self.records: list[TrialRecord] = []
        self.by_candidate: dict[Candidate, list[TrialRecord]] = {}
        self.user_errors: list[tuple[BaseException, Candidate]] = []
        self.best_sps = 0.0
        self.best_score = 0.0

    def record(self, c: Candidate, phase: str, state: str, *, m: Measurement | None = None,
               reason: str | None = None, duration_s: float = 0.0) -> TrialRecord:
        sc = score(m, c, self.settings.dataset_len, self.settings.epochs) if m is not None else None
        rec = TrialRecord(len(self.records), phase, c, state, m, sc, reason, duration_s)
        self.records.append(rec)
        if m is not None and sc is not None:
            self.by_candidate.setdefault(c, []).append(rec)
            self.best_sps = max(self.best_sps, m.samples_per_s)
            self.best_score = max(self.best_score, sc)
        self.progress.update(label=c.label(), state=state,
                             samples_per_s=m.samples_per_s if m else None,
                             best=self.best_score or None, phase=phase)
        if state != "complete":
            log.info("%s trial %s: %s (%s)", phase, c.label(), state, reason)
        return rec

    def expected_trial_s(self) -> float:
        done = [r.duration_s for r in self.records if r.state == "complete"]
        if done:
            return statistics.median(done)
        return 2.0 * self.settings.limits.window_s + 1.0

    def summarize(self, c: Candidate) -> Summary:
        recs = self.by_candidate[c]
        ms = [r.measurement for r in recs if r.measurement is not None]
        sps = [m.samples_per_s for m in ms]
        med = statistics.median(sps)
        return Summary(
            candidate=c,
            samples_per_s=med,
            busy=statistics.median(m.busy for m in ms),
            wait_fraction=statistics.median(m.wait_fraction for m in ms),
            score=statistics.median(r.score for r in recs if r.score is not None),
            spread=(max(sps) - min(sps)) / med if med > 0 else 0.0,
            peak_memory_bytes=max(m.peak_memory_bytes for m in ms),
        )

    def pick(self, finalists: list[Candidate]) -> Summary:
        """The best median score; within TIE_TOLERANCE of it, fewer workers, in order, less memory."""
        summaries = [self.summarize(c) for c in finalists if c in self.by_candidate]
        top = max(s.score for s in summaries)
        tied = [s for s in summaries if s.score >= (1.0 - TIE_TOLERANCE) * top]
        return min(tied, key=lambda s: (s.candidate.num_workers, not s.candidate.in_order,
                                        s.peak_memory_bytes, -s.score))

    def failure(self) -> BaseException:
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
        return TuningFailed(
            f"no candidate could be measured within budget_s={self.settings.budget_s:g}; reasons: "
            + "; ".join(reasons[:5])
            + ". Raise budget_s, or check the dataset with a plain DataLoader first."
        )


class _Runner:
    """Measures one candidate at a time, within what is left of the budget, into the ledger."""

    def __init__(self, dataset: Any, step: Callable[[Any], Any] | None, space: SearchSpace,
                 settings: SearchSettings, ledger: _Ledger, evaluate: Callable[..., Measurement]) -> None:
        self.dataset = dataset
        self.step = step
        self.space = space
        self.settings = settings
        self.ledger = ledger
        self.evaluate = evaluate
        started = settings.started_at if settings.started_at is not None else time.monotonic()
        self.deadline = started + settings.budget_s
        self.oom_batch: int | None = None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def run(self, c: Candidate, phase: str,
            report: Callable[[int, float], None] | None = None) -> TrialRecord:
        ledger, settings = self.ledger, self.settings
        reason = self.space.check(c)
        if reason is not None:
            return ledger.record(c, phase, "infeasible", reason=reason)
        if self.oom_batch is not None and c.batch_size >= self.oom_batch:
            return ledger.record(c, phase, "infeasible", reason=(
                f"batch_size={c.batch_size} >= {self.oom_batch}, which ran out of memory"))
        cap = max(1.0, min(settings.limits.trial_timeout_s, self.left()))
        limits = replace(settings.limits, trial_timeout_s=cap)

        def on_progress(batches: int, sps: float) -> bool:
            if report is not None:
                report(batches, sps)
            return phase == "search" and ledger.best_sps > 0 and sps < PRUNE_RATIO * ledger.best_sps

        t0 = time.monotonic()
        try:
            m = self.evaluate(self.dataset, c, step=self.step, device=settings.device, limits=limits,
                              progress=on_progress, shuffle=settings.shuffle,
                              collate_fn=settings.collate_fn, seed=settings.seed)
        except TrialPruned as err:
            return ledger.record(c, phase, "pruned", reason=str(err),
                                 duration_s=time.monotonic() - t0)
        except CandidateError as err:
            return ledger.record(c, phase, "failed", reason=f"{type(err).__name__}: {err}",
                                 duration_s=time.monotonic() - t0)
        except Exception as err:  # the user's dataset or step: kept, re-raised if nothing works
            ledger.user_errors.append((err, c))
            if _is_oom(err):
                self.oom_batch = min(self.oom_batch or c.batch_size, c.batch_size)
            return ledger.record(c, phase, "failed", reason=describe_error(err),
                                 duration_s=time.monotonic() - t0)
        return ledger.record(c, phase, "complete", m=m, duration_s=time.monotonic() - t0)


@contextlib.contextmanager
def _open_study(settings: SearchSettings,
                sampler: optuna.samplers.BaseSampler) -> Iterator[tuple[optuna.Study, str | None]]:
    """The study and its name, kept in the profile store's database when it can be; in memory
    (name ``None``) otherwise. The database connections are closed when the search ends, not left to
    the garbage collector."""
    storage: optuna.storages.RDBStorage | None = None
    if settings.storage_url is not None:
        try:
            storage = _rdb_storage(settings.storage_url)
            study = optuna.create_study(
                direction="maximize", sampler=sampler, storage=storage,
                study_name=settings.study_name, load_if_exists=False,
            )
        except Exception as err:  # noqa: BLE001 - any storage failure leaves tuning possible
            if storage is not None:
                storage.engine.dispose()
                storage = None
            warnings.warn(
                mask_url(
                    f"the study could not be kept in {settings.storage_url!r} ({type(err).__name__}:"
                    f" {err}); it is kept in memory, so it will not show in optuna-dashboard."
                ),
                ProfileStoreWarning, stacklevel=5,
            )
    if storage is None:
        yield optuna.create_study(direction="maximize", sampler=sampler), None
        return
    try:
        yield study, settings.study_name
    finally:
        storage.engine.dispose()


def _explore(runner: _Runner, space: SearchSpace, settings: SearchSettings,
             baseline: Measurement | None = None) -> str | None:
    """Phase 2 of NOTE [ Search ]: the ask-and-tell loop; returns the stored study's name, if any."""
    ledger = runner.ledger
    final_reserve = FINAL_FRACTION * settings.budget_s
    sampler = optuna.samplers.TPESampler(seed=settings.seed, n_startup_trials=6)
    with _quiet_optuna(), _open_study(settings, sampler) as (study, study_name):
        study.set_user_attr("space", jsonable(space.to_dict()))
        starts = warm_starts(space, settings.usable_cpus, baseline)
        for c in starts:
            study.enqueue_trial(params_of(c, space), skip_if_exists=True)
        idle = 0
        warm = len(starts)
        tried = 0  # searched candidates, repeats not counted
        best, best_at = ledger.best_score, 0
        while idle < MAX_IDLE_PROPOSALS and runner.left() - final_reserve > ledger.expected_trial_s():
            if tried > warm and tried - best_at >= PATIENCE:
                log.info("search converged after %d candidates; stopping early", tried)
                break
            trial = study.ask()
            c = suggest(trial, space)
            trial.set_user_attr("candidate", c.label())
            seen = ledger.by_candidate.get(c)
            if seen:
                # A repeat adds nothing to the search; its measurement counts again for TPE.
                study.tell(trial, seen[-1].score)
                idle += 1
                continue

            def report(batches: int, sps: float, _t: optuna.Trial = trial) -> None:
                _t.report(sps, batches)

            try:
                rec = runner.run(c, "search", report)
            except BaseException:
                # Ctrl-C or the user's own fatal error: the stored trial must not stay RUNNING.
                with contextlib.suppress(Exception):
                    study.tell(trial, state=optuna.trial.TrialState.FAIL)
                raise
            tried += 1
            if ledger.best_score > best * (1.0 + TIE_TOLERANCE):
                best, best_at = ledger.best_score, tried
            trial.set_user_attr("state", rec.state)
            if rec.reason:
                trial.set_user_attr("reason", rec.reason)
            if rec.state == "complete":
                assert rec.measurement is not None and rec.score is not None
                trial.set_user_attr("measurement", rec.measurement.to_dict())
                study.tell(trial, rec.score)
                idle = 0
            elif rec.state == "pruned":
                study.tell(trial, state=optuna.trial.TrialState.PRUNED)
                idle = 0
            else:
                study.tell(trial, state=optuna.trial.TrialState.FAIL)
                idle = idle + 1 if rec.state == "infeasible" else 0
    return study_name


def _finals(runner: _Runner, space: SearchSpace, settings: SearchSettings) -> tuple[Summary, Summary | None]:
    """Phase 3 of NOTE [ Search ]: re-measure the finalists; (the pick, the baseline's summary)."""
    ledger = runner.ledger
    baseline = space.baseline()
    ranked = sorted(ledger.by_candidate, key=lambda c: -ledger.summarize(c).score)
    finalists = [c for c in ranked if c != baseline][:FINALISTS]
    if finalists and not finalists[0].in_order:
        # An out-of-order leader is re-measured beside its in-order twin, so that it wins only
        # where it is clearly faster (see pick).
        twin = replace(finalists[0], in_order=True)
        if twin not in finalists and space.check(twin) is None:
            finalists.append(twin)
    if baseline in ledger.by_candidate:
        finalists.append(baseline)
    if len(finalists) > 1:
        # Interleaved rounds, each in a rotated order; the best-ranked go first in round one,
        # so a budget that allows only part of a round still re-measures the leader and baseline.
        leader = ledger.by_candidate[finalists[0]]  # stands in for a twin not measured yet
        cost = {c: statistics.median(r.duration_s for r in ledger.by_candidate.get(c, leader))
                for c in finalists}
        first = [finalists[0], *([baseline] if baseline in cost else []), *finalists[1:]]
        first = list(dict.fromkeys(first))
        final_started = time.monotonic()
        pick = ledger.pick(finalists).candidate
        for r in range(MAX_FINAL_ROUNDS):
            order = first[r % len(first):] + first[:r % len(first)]
            if r and runner.left() < sum(cost.values()):
                break
            used = time.monotonic() - final_started
            if r >= MIN_FINAL_ROUNDS and used + sum(cost.values()) > FINAL_FRACTION * settings.budget_s:
                break
            for c in order:
                if runner.left() < cost[c]:
                    break
                runner.run(c, "final")
            previous, pick = pick, ledger.pick(finalists).candidate
            if r + 1 >= MIN_FINAL_ROUNDS and pick == previous:
                break  # another round did not change the pick: the order is settled
    best = ledger.pick(finalists)
    base = ledger.summarize(baseline) if baseline in ledger.by_candidate else None
    return best, base


STORAGE_ATTEMPTS = 5
"""Tries at opening a study database that another process is creating at the same moment."""


def _rdb_storage(url: str) -> optuna.storages.RDBStorage:
    """Optuna's storage for ``url``, retried while a concurrent process sets up its schema."""
    for attempt in range(STORAGE_ATTEMPTS):
        try:
            return optuna.storages.RDBStorage(url)
        except Exception as err:  # noqa: BLE001 - sqlalchemy IntegrityError / OperationalError
            if attempt == STORAGE_ATTEMPTS - 1 or type(err).__name__ not in (
                "IntegrityError", "OperationalError"):
                raise
            time.sleep(0.2 * (attempt + 1))
    raise AssertionError("unreachable")


def run_search(dataset: Any, step: Callable[[Any], Any] | None, space: SearchSpace,
               settings: SearchSettings, *, progress: Progress | None = None,
               evaluate: Callable[..., Measurement] = measure) -> SearchOutcome:
    """Search ``space`` for the best candidate (see NOTE [ Search ]).

    ``evaluate`` measures one candidate; it is :func:`autotune.measure.measure` unless several ranks
    measure together (NOTE [ Cooperative tuning ] in distributed.py).
    """
    ledger = _Ledger(settings, progress or Progress(0, enabled=False))
    runner = _Runner(dataset, step, space, settings, ledger, evaluate)
    baseline = space.baseline()
    measured = runner.run(baseline, "baseline").measurement
    for strategy, why in settings.refused.items():
        ledger.record(replace(baseline, pretransform=strategy), "search", "infeasible",
                      reason=f"pretransform={strategy!r}: {why}")
    study_name = _explore(runner, space, settings, measured)
    if not ledger.by_candidate:
        raise ledger.failure()
    best, base = _finals(runner, space, settings)
    speedup = (best.score / base.score) if base and base.score else None
    return SearchOutcome(best, base, speedup, tuple(ledger.records), study_name)
