"""When the finals stop, with a stand-in for the measurement so that every figure is known.

The stand-in replaces only ``measure`` (real measurements are noisy, which is what the rule is about);
the Optuna study and the search around it are the real ones.
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import torch

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
