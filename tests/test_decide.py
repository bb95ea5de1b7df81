"""The decision rule both drivers share (NOTE [ Decisions ] in autotune/decide.py), on figures the
tests choose: a stand-in for measurements, so that noise is exactly what each test says it is."""

from __future__ import annotations

import math

import pytest

from autotune.decide import CONFIDENCE, Ledger, t_quantile
from autotune.measure import Measurement
from autotune.space import Candidate

BASE = Candidate(32)
FAST = Candidate(32, num_workers=2, prefetch_factor=2, persistent_workers=True)
THREADS = Candidate(32, num_workers=2, prefetch_factor=2, worker_kind="thread")


def m(sps: float, memory: int = 0) -> Measurement:
    return Measurement(samples_per_s=sps, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                       startup_s=0.0, batches=10, samples=320, window_s=1.0, peak_memory_bytes=memory)


def ledger(figures: dict[Candidate, list[float]]) -> Ledger:
    led = Ledger(dataset_len=None, epochs=1)  # no length: the score is the throughput itself
    for c, values in figures.items():
        for v in values:
            led.record(c, "final", "complete", m=m(v))
    return led


def test_a_clear_win_over_repeated_measurements_replaces_the_baseline() -> None:
    led = ledger({BASE: [100, 104, 98], FAST: [200, 190, 210]})
    d = led.decide([FAST, BASE], BASE)
    assert d.chosen.candidate == FAST and not d.kept_baseline
    assert d.verdict is not None and d.verdict.wins and 1.8 < d.verdict.ratio < 2.1
    assert d.verdict.low > 1.0 and d.verdict.confidence == CONFIDENCE
    assert "beats the baseline" in d.reason


def test_a_gain_inside_the_noise_keeps_the_baseline() -> None:
    # 5 % better on average, but the repeats of each spread by 20 %: not a win at 95 %.
    led = ledger({BASE: [100, 80, 120], FAST: [105, 85, 126]})
    d = led.decide([FAST, BASE], BASE)
    assert d.kept_baseline and d.chosen.candidate == BASE
    assert d.verdict is not None and not d.verdict.wins and d.verdict.low < 1.0 < d.verdict.high
    assert "kept the baseline" in d.reason and "95%" in d.reason


def test_without_repeats_there_is_no_noise_estimate_and_no_win() -> None:
    led = ledger({BASE: [100], FAST: [500]})
    d = led.decide([FAST, BASE], BASE)
    assert d.kept_baseline
    assert d.verdict is not None and d.verdict.degrees_of_freedom == 0 and "measured once" in d.reason


def test_the_noise_is_pooled_over_every_repeated_candidate() -> None:
    # The baseline was measured once; the repeats of others tell how noisy a window is.
    led = ledger({BASE: [100], FAST: [300, 310, 290], THREADS: [150, 152, 148]})
    var, df = led.noise()
    assert df == 4 and 0 < var < 0.01
    d = led.decide([FAST, THREADS, BASE], BASE)
    assert d.chosen.candidate == FAST and d.verdict is not None and d.verdict.wins


def test_a_tie_goes_to_fewer_workers() -> None:
    led = ledger({FAST: [200, 201], THREADS: [202, 203], BASE: [100, 101]})
    pick = led.pick([FAST, THREADS])
    assert pick is not None and pick.candidate in (FAST, THREADS)
    few = Candidate(32, num_workers=1, prefetch_factor=2, persistent_workers=True)
    led.record(few, "final", "complete", m=m(199))
    led.record(few, "final", "complete", m=m(200))
    assert led.pick([FAST, THREADS, few]).candidate == few  # within 3 %: the cheaper one


def test_the_finalists_are_the_best_few_and_the_baseline() -> None:
    unordered = Candidate(32, num_workers=2, prefetch_factor=2, persistent_workers=True, in_order=False)
    led = ledger({BASE: [50], unordered: [400], FAST: [300], THREADS: [200]})
    finals = led.finalists(BASE)
    assert finals[0] == unordered and finals[-1] == BASE
    assert Candidate(32, num_workers=2, prefetch_factor=2, persistent_workers=True, in_order=True) in finals


def test_an_unmeasured_baseline_defers_to_the_best_measured() -> None:
    led = ledger({FAST: [200, 210]})
    d = led.decide([FAST], BASE)
    assert d.chosen.candidate == FAST and d.baseline is None


def test_nothing_measured_is_a_failure_naming_the_reasons() -> None:
    led = Ledger(None, 1)
    led.record(FAST, "search", "failed", reason="WorkerFailed: boom")
    from autotune.exceptions import TuningFailed

    with pytest.raises(TuningFailed, match="WorkerFailed: boom"):
        led.decide([FAST], BASE)


@pytest.mark.parametrize(("df", "q"), [(1, 6.314), (2, 2.920), (11, 1.812), (500, 1.645)])
def test_the_t_quantiles_are_the_tables(df: int, q: float) -> None:
    assert t_quantile(df) == pytest.approx(q)
    assert math.isinf(t_quantile(0))
