"""The offline search: an Optuna study over the space, the only module that imports Optuna.

# NOTE [ Search ]
# 1. The baseline (what the user runs; PyTorch's defaults unless told otherwise) is measured first,
#    even where it lies outside the space, so every later figure has a reference from the same run.
#    Strategies the pre-transform module refused are recorded as infeasible trials, and so are the
#    worker processes people write where /dev/shm cannot hold their batches (SearchSpace.left_out).
# 2. An Optuna study (TPE, seeded) proposes candidates, warm-started first with the workers that would
#    keep the step busy as estimated from the baseline (load time over step time,
#    decide.estimate_workers; the drop-in starts its exploration from the same estimate), then with
#    points that span the worker range: the cores-based rule of thumb, one worker per core, and the
#    worker bound. Each candidate is measured for real; a failing candidate becomes a failed trial with
#    its reason and the search goes on. A candidate whose running throughput falls below
#    decide.PRUNE_RATIO of the best so far is pruned. An out-of-memory error at a batch size makes
#    that batch size and larger ones infeasible. The search stops early once PATIENCE candidates in a
#    row after the warm starts brought no better score: the budget is a ceiling, not a target.
# 3. At most FINAL_FRACTION of the budget re-measures the finalists and the baseline in interleaved
#    rounds (decide.Ledger.finalists): at least MIN_FINAL_ROUNDS, and more, up to MAX_FINAL_ROUNDS,
#    while a round still changes the pick or the pick's verdict against the baseline is undecided.
#    The decision is decide.Ledger.decide (NOTE [ Decisions ] in decide.py), the one the drop-in uses.
# 4. Confirming: while the pick leads the baseline without a decided verdict, the two are measured
#    side by side again, in alternating order, with all that is left of the budget (the search's
#    early stop leaves some), until the verdict is decided or the budget is spent. An end that is
#    still undecided says so, with what was measured and how many more rounds would decide it.
"""

from __future__ import annotations

import contextlib
import logging
import statistics
import time
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import Any, cast

import optuna
import torch

from .decide import (
    PRUNE_RATIO,
    TIE_TOLERANCE,
    Decision,
    Ledger,
    Phase,
    Summary,
    TrialRecord,
    describe_error,
    estimate_workers,
    is_oom,
)
from .describe import jsonable
from .exceptions import CandidateError, ProfileStoreWarning, TrialPruned
from .measure import Measurement, measure
from .profiles import mask_url
from .progress import Progress
from .space import Candidate, SearchSpace, Strategy
from .supervise import MeasureLimits

log = logging.getLogger(__name__)

FINAL_FRACTION = 0.25
"""Share of the budget kept for re-measuring the finalists side by side."""

MAX_FINAL_ROUNDS = 5
"""Re-measurement rounds at most; more only narrows an already small spread."""

MIN_FINAL_ROUNDS = 2
"""Re-measurement rounds the finalists get whenever the budget leaves room for them."""

MAX_CONFIRM_ROUNDS = 20
"""Rounds of the undecided leader against the baseline at most (NOTE [ Search ] 4): past them a
verdict narrows too slowly to be worth the wait, however much budget is left."""

PATIENCE = 10
"""Searched candidates in a row without a better score (by TIE_TOLERANCE) after which the search
has converged and stops early, leaving the rest of the budget unspent."""

MAX_IDLE_PROPOSALS = 40
"""Consecutive proposals that were duplicates or infeasible after which the space counts as explored."""


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
    baseline: Candidate | None = None
    """What the user runs (NOTE [ Decisions ] 1 in decide.py); ``None``: PyTorch's defaults at the
    space's baseline batch size. Measured even where it lies outside the space."""


@dataclass(frozen=True)
class SearchOutcome:
    """What a search found: the decision (chosen, baseline, verdict) and every trial."""

    decision: Decision
    trials: tuple[TrialRecord, ...]
    study_name: str | None

    @property
    def best(self) -> Summary:
        """The configuration to use: the challenger that won with confidence, else the baseline."""
        return self.decision.chosen

    @property
    def baseline(self) -> Summary | None:
        return self.decision.baseline


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
    return Candidate(bs, pin_memory=pin, pretransform=cast(Strategy, pt), torch_threads=threads,
                     **space.workers(kind, workers, prefetch, in_order))


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


class _Runner:
    """Measures one candidate at a time, within what is left of the budget, into the ledger."""

    def __init__(self, dataset: Any, step: Callable[[Any], Any] | None, space: SearchSpace,
                 settings: SearchSettings, ledger: Ledger, progress: Progress,
                 evaluate: Callable[..., Measurement]) -> None:
        self.dataset = dataset
        self.step = step
        self.space = space
        self.settings = settings
        self.ledger = ledger
        self.progress = progress
        self.evaluate = evaluate
        started = settings.started_at if settings.started_at is not None else time.monotonic()
        self.deadline = started + settings.budget_s
        self.oom_batch: int | None = None
        self.baseline = settings.baseline or space.baseline()

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def expected_trial_s(self) -> float:
        done = [r.duration_s for r in self.ledger.records if r.state == "complete"]
        if done:
            return statistics.median(done)
        return 2.0 * self.settings.limits.window_s + 1.0

    def record(self, c: Candidate, phase: Phase, state: Any, *, m: Measurement | None = None,
               reason: str | None = None, duration_s: float = 0.0) -> TrialRecord:
        rec = self.ledger.record(c, phase, state, m=m, reason=reason, duration_s=duration_s)
        self.progress.update(label=c.label(), state=state,
                             samples_per_s=m.samples_per_s if m else None,
                             best=self.ledger.best_score or None, phase=phase)
        if state != "complete":
            log.info("%s trial %s: %s (%s)", phase, c.label(), state, reason)
        return rec

    def run(self, c: Candidate, phase: Phase,
            report: Callable[[int, float], None] | None = None) -> TrialRecord:
        ledger, settings = self.ledger, self.settings
        # The baseline is what the user runs: measured even outside the space.
        reason = self.space.check(c) if c != self.baseline else None
        if reason is not None:
            return self.record(c, phase, "infeasible", reason=reason)
        if self.oom_batch is not None and c.batch_size >= self.oom_batch:
            return self.record(c, phase, "infeasible", reason=(
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
            return self.record(c, phase, "pruned", reason=str(err), duration_s=time.monotonic() - t0)
        except CandidateError as err:
            return self.record(c, phase, "failed", reason=f"{type(err).__name__}: {err}",
                               duration_s=time.monotonic() - t0)
        except Exception as err:  # the user's dataset or step: kept, re-raised if nothing works
            ledger.user_errors.append((err, c))
            if is_oom(err):
                self.oom_batch = min(self.oom_batch or c.batch_size, c.batch_size)
            return self.record(c, phase, "failed", reason=describe_error(err),
                               duration_s=time.monotonic() - t0)
        return self.record(c, phase, "complete", m=m, duration_s=time.monotonic() - t0)


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
        while idle < MAX_IDLE_PROPOSALS and runner.left() - final_reserve > runner.expected_trial_s():
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


def _finals(runner: _Runner, space: SearchSpace, settings: SearchSettings) -> Decision:
    """Phase 3 of NOTE [ Search ]: re-measure the finalists beside the baseline, then decide."""
    ledger, baseline = runner.ledger, runner.baseline
    finalists = ledger.finalists(baseline, space)
    if len(finalists) > 1:
        # Interleaved rounds, each in a rotated order; the best-ranked go first in round one, so a
        # budget that allows only part of a round still re-measures the leader and the baseline.
        leader = ledger.by_candidate[finalists[0]]  # stands in for a twin not measured yet
        cost = {c: statistics.median(r.duration_s for r in ledger.by_candidate.get(c, leader))
                for c in finalists}
        base = [baseline] if baseline in finalists else []
        first = list(dict.fromkeys([finalists[0], *base, *finalists[1:]]))
        final_started = time.monotonic()
        decision = ledger.decide(finalists, baseline)
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
            previous, decision = decision, ledger.decide(finalists, baseline)
            settled = (decision.challenger is not None and previous.challenger is not None
                       and decision.challenger.candidate == previous.challenger.candidate)
            undecided = decision.verdict is not None and decision.verdict.open
            if r + 1 >= MIN_FINAL_ROUNDS and settled and not undecided:
                break  # the pick held and its verdict is clear: more rounds would not change it
        _confirm(runner, finalists, cost)
    return ledger.decide(finalists, baseline)


def _confirm(runner: _Runner, finalists: list[Candidate], cost: dict[Candidate, float]) -> None:
    """NOTE [ Search ] 4: while the pick leads the baseline undecided, measure the two side by side,
    in alternating order, with whatever is left of the budget, until the verdict is decided."""
    ledger, baseline = runner.ledger, runner.baseline
    for turn in range(MAX_CONFIRM_ROUNDS):
        decision = ledger.decide(finalists, baseline)
        if not decision.undecided or decision.challenger is None:
            return
        pair = [decision.challenger.candidate, baseline][::1 if turn % 2 == 0 else -1]
        if runner.left() < sum(cost.get(c, 0.0) for c in pair):
            return  # out of budget: the decision says what it saw and what would decide it
        for c in pair:
            runner.run(c, "final")


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
    ledger = Ledger(settings.dataset_len, settings.epochs)
    runner = _Runner(dataset, step, space, settings, ledger, progress or Progress(0, enabled=False),
                     evaluate)
    measured = runner.run(runner.baseline, "baseline").measurement
    for strategy, why in settings.refused.items():
        refused = replace(space.baseline(), pretransform=cast(Strategy, strategy))
        runner.record(refused, "search", "infeasible", reason=f"pretransform={strategy!r}: {why}")
    for c, why in space.left_out(settings.usable_cpus):
        runner.record(c, "search", "infeasible", reason=why)
    study_name = _explore(runner, space, settings, measured)
    if not ledger.by_candidate:
        raise ledger.failure(settings.budget_s)
    decision = _finals(runner, space, settings)
    return SearchOutcome(decision, tuple(ledger.records), study_name)
