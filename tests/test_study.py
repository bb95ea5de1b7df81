"""When the finals stop, with a stand-in for the measurement so that every figure is known.

The stand-in replaces only ``measure`` (real measurements are noisy, which is what the rule is about);
the Optuna study and the search around it are the real ones.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from autotune.decide import Failure, describe_error
from autotune.exceptions import ProfileStoreWarning
from autotune.measure import Measurement
from autotune.space import Candidate, SearchSpace
from autotune.study import MAX_FINAL_ROUNDS, MIN_FINAL_ROUNDS, SearchSettings, run_search


def _stand_in(speed: dict[int, list[float]]) -> Callable[..., Measurement]:
    """Each candidate's samples/s cycle through the values given for its worker count."""
    cycles: dict[Candidate, Iterator[float]] = {}

    def evaluate(dataset: Any, c: Candidate, **kwargs: Any) -> Measurement:
        sps = next(cycles.setdefault(c, itertools.cycle(speed[c.num_workers])))
        return Measurement(samples_per_s=sps, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                           startup_s=0.0, batches=10, samples=80, window_s=0.01, peak_memory_bytes=0)

    return evaluate


def _finals(speed: dict[int, list[float]]) -> tuple[int, int]:
    """Rounds the finals ran, and the chosen worker count."""
    space = SearchSpace(batch_sizes=(8,), max_workers=3, prefetch_factors=(2,), baseline_batch_size=8)
    settings = SearchSettings(budget_s=60, epochs=1, dataset_len=None, device=torch.device("cpu"),
                              usable_cpus=2)
    outcome = run_search(None, None, space, settings, evaluate=_stand_in(speed))
    rounds = Counter(r.candidate for r in outcome.trials if r.phase == "final")
    assert len(rounds) == 4 and len(set(rounds.values())) == 1, rounds  # all finalists, every round
    return next(iter(rounds.values())), outcome.best.candidate.num_workers


def test_finals_stop_when_a_round_leaves_the_pick_as_it_was() -> None:
    assert _finals({0: [100.0], 1: [300.0], 2: [200.0], 3: [150.0]}) == (MIN_FINAL_ROUNDS, 1)


def test_finals_go_on_while_each_round_changes_the_pick() -> None:
    # One worker measures 300 then 100 by turns; two workers a steady 250: the medians cross every round.
    rounds, _ = _finals({0: [100.0], 1: [300.0, 100.0], 2: [250.0], 3: [150.0]})
    assert rounds == MAX_FINAL_ROUNDS


def _kind_stand_in(speed: dict[str, float]) -> Callable[..., Measurement]:
    """samples/s by the kind of loading: ``none`` (no workers), ``process``, ``thread``, each with one
    worker or more, a little more for out-of-order delivery when ``unordered`` is given."""

    def evaluate(dataset: Any, c: Candidate, **kwargs: Any) -> Measurement:
        kind = c.worker_kind if c.num_workers else "none"
        sps = speed[kind] + (0.0 if c.in_order else speed.get("unordered", 0.0))
        return Measurement(samples_per_s=sps, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                           startup_s=0.0, batches=10, samples=80, window_s=0.01, peak_memory_bytes=0)

    return evaluate


def _winner(speed: dict[str, float]) -> Candidate:
    space = SearchSpace(batch_sizes=(8,), max_workers=3, prefetch_factors=(2,), baseline_batch_size=8,
                        max_threads=3, in_order_choices=(True, False))
    settings = SearchSettings(budget_s=30, epochs=1, dataset_len=None, device=torch.device("cpu"),
                              usable_cpus=2)
    return run_search(None, None, space, settings, evaluate=_kind_stand_in(speed)).best.candidate


def test_the_search_keeps_the_faster_kind_of_workers() -> None:
    # Where threads do not help the search never loses by offering them, and where they do it finds them.
    assert _winner({"none": 100.0, "process": 300.0, "thread": 150.0}).worker_kind == "process"
    assert _winner({"none": 100.0, "process": 150.0, "thread": 300.0}).threaded
    assert _winner({"none": 300.0, "process": 150.0, "thread": 150.0}).num_workers == 0
    # Out-of-order delivery wins only when it is faster, and by more than a tie.
    assert not _winner({"none": 100.0, "process": 300.0, "thread": 150.0, "unordered": 50.0}).in_order
    assert _winner({"none": 100.0, "process": 300.0, "thread": 150.0, "unordered": 1.0}).in_order


def test_an_error_from_a_thread_worker_is_described_by_its_own_last_line() -> None:
    err = ValueError("Caught ValueError in DataLoader thread worker 1.\nOriginal Traceback (most recent"
                     " call last):\n  File \"x.py\", line 3, in f\nValueError: sample 5 is corrupt")
    assert describe_error(err) == "ValueError in a worker: ValueError: sample 5 is corrupt"
    # The same failure as a value: its type and line stay apart, and a rank names itself.
    failure = Failure.of(err)
    assert (failure.kind, failure.in_worker, failure.message) == ("ValueError", True,
                                                                 "ValueError: sample 5 is corrupt")
    assert str(failure.on_rank(1)) == "failed on rank 1: " + describe_error(err)
    assert Failure.of(MemoryError("out")) == Failure("MemoryError", "out")


def test_a_study_database_that_cannot_be_opened_is_named_without_its_password() -> None:
    space = SearchSpace(batch_sizes=(8,), max_workers=1, prefetch_factors=(2,), baseline_batch_size=8)
    settings = SearchSettings(budget_s=10, epochs=1, dataset_len=None, device=torch.device("cpu"),
                              usable_cpus=2, storage_url="postgresql://tuner:s3cret@127.0.0.1:1/studies",
                              study_name="autotune-test")
    with pytest.warns(ProfileStoreWarning) as rec:
        outcome = run_search(None, None, space, settings, evaluate=_stand_in({0: [100.0], 1: [200.0]}))
    text = " ".join(str(w.message) for w in rec)
    assert "kept in memory" in text and "tuner:***@127.0.0.1" in text and "s3cret" not in text
    assert outcome.study_name is None and outcome.best.candidate.num_workers == 1


def test_the_search_starts_from_the_estimated_worker_count() -> None:
    # Loading takes 30 ms a batch without workers and the step 10 ms: three workers keep the step busy.
    from autotune.decide import estimate_workers
    from autotune.study import warm_starts

    baseline = Measurement(samples_per_s=800.0, busy=0.25, wait_fraction=0.75, step_ms=10.0, wait_ms=30.0,
                           startup_s=0.0, batches=20, samples=640, window_s=0.8, peak_memory_bytes=0)
    assert estimate_workers(baseline, 8) == 3
    assert estimate_workers(baseline, 2) == 2  # never past the bound
    space = SearchSpace(batch_sizes=(32,), max_workers=8, max_threads=8)
    starts = warm_starts(space, 2, baseline)
    assert [(c.num_workers, c.worker_kind) for c in starts[:2]] == [(3, "process"), (3, "thread")]
    assert all(space.check(c) is None for c in starts)


def test_an_undecided_leader_is_measured_against_the_baseline_until_decided() -> None:
    # One worker reads 140 and 100 by turns against the baseline's 100, 60 and 150: after the
    # finals' rounds its interval still reaches under 1.05, so the two are measured again side by
    # side with the budget the early stop left, until the verdict is decided.
    space = SearchSpace(batch_sizes=(8,), max_workers=1, prefetch_factors=(2,), baseline_batch_size=8)
    settings = SearchSettings(budget_s=60, epochs=1, dataset_len=None, device=torch.device("cpu"),
                              usable_cpus=2)
    outcome = run_search(None, None, space, settings, evaluate=_stand_in({0: [100.0, 60.0, 150.0],
                                                                        1: [140.0, 100.0]}))
    finals = Counter(r.candidate.num_workers for r in outcome.trials if r.phase == "final")
    assert finals[1] > MAX_FINAL_ROUNDS  # past the finals' rounds: confirming
    assert outcome.decision.verdict is not None and outcome.decision.verdict.wins
    assert outcome.best.candidate.num_workers == 1


def test_a_leader_still_undecided_when_the_budget_ends_says_so() -> None:
    # A budget too short to decide: the baseline is kept, and the result says it is undecided, with
    # what was measured, never a bare 1.00x.
    from autotune.result import from_decision

    space = SearchSpace(batch_sizes=(8,), max_workers=1, prefetch_factors=(2,), baseline_batch_size=8)
    settings = SearchSettings(budget_s=60, epochs=1, dataset_len=None, device=torch.device("cpu"),
                              usable_cpus=2)
    # 400 and 30 by turns against 100, 60 and 150: 1.1x with a spread no confirming round can narrow
    # enough (MAX_CONFIRM_ROUNDS).
    outcome = run_search(None, None, space, settings, evaluate=_stand_in({0: [100.0, 60.0, 150.0],
                                                                        1: [400.0, 30.0]}))
    d = outcome.decision
    assert d.kept_baseline and d.undecided
    assert "undecided" in d.reason and "more round" in d.reason
    result = from_decision(d, outcome.trials)
    assert result.speedup_text() == "1.00x, your settings kept (undecided)"
    assert result.challenger is not None and result.challenger.startswith("bs=8 w=1")
    assert "interval" in result.challenger
