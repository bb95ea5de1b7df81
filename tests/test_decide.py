"""The decision rule both drivers share (NOTE [ Decisions ] in autotune/decide.py), on figures the
tests choose: a stand-in for measurements, so that noise is exactly what each test says it is."""

from __future__ import annotations

import math
from dataclasses import replace
from typing import Any

import pytest

from autotune.decide import (
    BLOCK_DEGREES,
    CONFIDENCE,
    INTERIM_CONFIDENCE,
    RUNNER_UP_CONFIDENCE,
    TIE_TOLERANCE,
    Ledger,
    t_quantile,
)
from autotune.measure import Measurement
from autotune.result import built_text, from_decision
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


THREADED_CACHE = Candidate(32, num_workers=1, prefetch_factor=2, worker_kind="thread", pretransform="ram")
ONE_THREAD_CACHE = Candidate(32, pretransform="ram", torch_threads=1)


def _recorded(windows: list[tuple[Candidate, str, float, float]]) -> Ledger:
    """Windows in the order they were measured: (candidate, phase, samples/s, their batches' log_se)."""
    led = Ledger(dataset_len=None, epochs=1)
    for c, phase, sps, se in windows:
        led.record(c, phase, "complete", m=replace(m(sps), log_se=se))  # type: ignore[arg-type]
    return led


def _uneven_pick(steady: tuple[float, float]) -> Ledger:
    """The decision benchmark's PNG folder with nothing written (its figures): thread workers over
    the filled cache, ahead by their median, read 8,272 and 14,580 beside the baseline's 1,500-1,700;
    ``steady`` are the two windows of ``w=0 ram t=1``."""
    return _recorded([
        (BASE, "baseline", 1517.0, 0.041), (THREADED_CACHE, "online", 8272.0, 0.112),
        (ONE_THREAD_CACHE, "online", steady[0], 0.019), (ONE_THREAD_CACHE, "final", steady[1], 0.035),
        (BASE, "final", 1708.0, 0.030), (THREADED_CACHE, "final", 14580.0, 0.015),
        (BASE, "final", 1536.0, 0.090),
    ])


def test_a_finalist_that_wins_at_the_stricter_confidence_stands_in_for_an_undecided_pick() -> None:
    led = _uneven_pick((8386.0, 7846.0))
    finalists = [THREADED_CACHE, ONE_THREAD_CACHE, BASE]
    assert led.pick([THREADED_CACHE, ONE_THREAD_CACHE]).candidate == THREADED_CACHE  # type: ignore[union-attr]
    unsure = led.verdict(THREADED_CACHE, BASE)
    assert unsure is not None and not unsure.wins  # 5.4x, its interval from under 1x
    d = led.decide(finalists, BASE)
    assert d.chosen.candidate == ONE_THREAD_CACHE and d.verdict is not None and d.verdict.wins
    assert d.verdict.confidence == CONFIDENCE and 4.0 < d.verdict.ratio < 5.0  # reported at 95 %
    assert "ahead by its median score" in d.reason and "99% confidence" in d.reason


def test_a_finalist_that_wins_only_at_the_pick_s_confidence_does_not_stand_in() -> None:
    # Two windows 1.58x and 1.43x the baseline's beside them: past 1.05x at 95 %, not at 99 %.
    led = _uneven_pick((2700.0, 2200.0))
    runner_up = led.verdict(ONE_THREAD_CACHE, BASE)
    assert runner_up is not None and runner_up.wins
    strict = led.verdict(ONE_THREAD_CACHE, BASE, RUNNER_UP_CONFIDENCE)
    assert strict is not None and not strict.wins
    d = led.decide([THREADED_CACHE, ONE_THREAD_CACHE, BASE], BASE)
    assert d.kept_baseline and d.undecided and d.challenger is not None
    assert d.challenger.candidate == THREADED_CACHE


@pytest.mark.parametrize(("df", "q"), [(1, 31.821), (4, 3.747), (13, 2.681), (500, 2.326)])
def test_the_runner_up_quantiles_are_the_tables(df: int, q: float) -> None:
    assert t_quantile(df, RUNNER_UP_CONFIDENCE) == pytest.approx(q)


@pytest.mark.parametrize(("df", "q"), [(1, 6.314), (2, 2.920), (11, 1.812), (500, 1.645)])
def test_the_t_quantiles_are_the_tables(df: int, q: float) -> None:
    assert t_quantile(df) == pytest.approx(q)
    assert math.isinf(t_quantile(0))


@pytest.mark.parametrize(("df", "q"), [(1, 63.657), (8, 3.355), (11, 3.169), (500, 2.576)])
def test_the_interim_quantiles_are_the_tables(df: int, q: float) -> None:
    assert t_quantile(df, INTERIM_CONFIDENCE) == pytest.approx(q)


def _paired(rounds: list[tuple[float, float]], log_se: float | None | list[float]) -> Ledger:
    """Rounds of (the challenger's, the baseline's) rate measured side by side, in that order, each
    window with ``log_se`` read from its batches (a list: one per round, for both its windows)."""
    led = Ledger(dataset_len=None, epochs=1)
    ses = log_se if isinstance(log_se, list) else [log_se] * len(rounds)
    for (fast, base), se in zip(rounds, ses, strict=True):
        for c, v in ((FAST, fast), (BASE, base)):
            led.record(c, "final", "complete", m=Measurement(
                samples_per_s=v, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0, startup_s=0.0,
                batches=10, samples=320, window_s=1.0, peak_memory_bytes=0, log_se=se))
    return led


# The machine halves its speed between rounds (another job starts): both configurations slow alike.
DRIFTING = [(130.0, 100.0), (66.0, 50.0), (131.0, 101.0)]


def test_paired_windows_cancel_a_drift_that_hides_a_win_from_the_repeats_alone() -> None:
    # Without the batches' evidence the repeats' spread holds the drift: no confident win.
    unpaired = _paired(DRIFTING, log_se=None).verdict(FAST, BASE)
    assert unpaired is not None and not unpaired.wins
    # Paired, the drift cancels within each round: 1.3x, with an interval that excludes 1.
    paired = _paired(DRIFTING, log_se=0.02).verdict(FAST, BASE)
    assert paired is not None and paired.wins and 1.25 < paired.ratio < 1.35
    assert paired.low > 1.2 and paired.high < 1.4


def test_pairs_that_disagree_more_than_their_batches_say_are_judged_by_their_spread() -> None:
    # Each window's batches say 1 %, but the pairs read 1.5x, 0.8x and 1.2x: the spread between
    # the pairs decides, and it is far too wide for a win.
    v = _paired([(150.0, 100.0), (80.0, 100.0), (120.0, 100.0)], log_se=0.01).verdict(FAST, BASE)
    assert v is not None and not v.wins and v.low < 1.0 < v.high
    assert v.degrees_of_freedom == 2


def test_pairs_that_spread_more_than_their_batches_say_count_alike() -> None:
    # The pairs read 2x, 4x and 8x; the first one's batches happen to agree closely (0.1 %), the
    # others' less (5 %). Far apart as they are, the batches do not tell which pair is sure: the
    # estimate is their plain mean, 4x, not the first pair's 2x.
    v = _paired([(200.0, 100.0), (400.0, 100.0), (800.0, 100.0)], log_se=[0.001, 0.05, 0.05]
                ).verdict(FAST, BASE)
    assert v is not None and v.ratio == pytest.approx(4.0)
    assert v.degrees_of_freedom == 2 and v.low < 4.0 < v.high


def test_pairs_that_spread_as_their_batches_say_count_by_them() -> None:
    # 1.1x from windows whose batches say 20 %, 1.3x from ones that say 40 %: the spread is inside
    # what the batches say, and the surer pair counts four times the other.
    v = _paired([(110.0, 100.0), (130.0, 100.0)], log_se=[0.2, 0.4]).verdict(FAST, BASE)
    assert v is not None
    assert v.ratio == pytest.approx(math.exp((4 * math.log(1.1) + math.log(1.3)) / 5))
    assert v.degrees_of_freedom == 2 * BLOCK_DEGREES * 2


def test_nothing_to_win_is_not_a_win_from_the_batches_either() -> None:
    v = _paired([(101.0, 100.0), (99.0, 100.0), (100.5, 100.0)], log_se=0.02).verdict(FAST, BASE)
    assert v is not None and not v.wins and not v.loses and 0.97 < v.ratio < 1.03


def test_a_confident_gain_of_a_percent_is_not_worth_a_change() -> None:
    # 1 % faster in every pair, with batches that say so within 0.1 %: a sure gain, too small to
    # change what the user runs for.
    led = _paired([(101.0, 100.0), (101.2, 100.1), (100.9, 99.9)], log_se=0.001)
    d = led.decide([FAST, BASE], BASE)
    assert d.verdict is not None and d.verdict.faster and not d.verdict.wins
    assert d.verdict.ratio < 1.0 + TIE_TOLERANCE
    assert d.kept_baseline and not d.undecided
    assert "not worth a change" in d.reason


def test_one_pair_is_not_enough_for_a_verdict_from_batches() -> None:
    # A single pair cannot show a drift between its two windows: the repeats' rule applies.
    led = _paired([(130.0, 100.0)], log_se=0.001)
    v = led.verdict(FAST, BASE)
    assert v is not None and v.degrees_of_freedom == 0 and not v.wins


def test_the_baseline_s_cold_first_measurement_is_left_out_once_repeats_stand_beside_it() -> None:
    # The baseline's first window ran while the process warmed up, at half its later pace; the
    # challenger and the later baseline windows are alike: no win, where counting the cold one
    # would have made one.
    led = Ledger(dataset_len=None, epochs=1)
    led.record(BASE, "baseline", "complete", m=m(50.0))
    for v in (100.0, 102.0, 98.0):
        led.record(FAST, "final", "complete", m=m(v + 1.0))
        led.record(BASE, "final", "complete", m=m(v))
    v = led.verdict(FAST, BASE)
    assert v is not None and not v.wins and 0.98 < v.ratio < 1.04


def test_one_warm_measurement_of_the_baseline_is_its_pace_without_the_cold_one() -> None:
    # One later baseline window beside the cold first: the speed-up is read against the warm one
    # (about 1.0x), not against its mean with the cold one (about 1.4x), where that window held
    # enough batches to tell its own spread; one too short to (no log_se) does not replace it.
    def verdict(warm_se: float | None) -> tuple[Ledger, Any]:
        led = Ledger(dataset_len=None, epochs=1)
        led.record(BASE, "baseline", "complete", m=m(50.0))
        led.record(FAST, "search", "complete", m=m(101.0))
        led.record(FAST, "final", "complete", m=m(99.0))
        led.record(BASE, "final", "complete", m=replace(m(100.0), log_se=warm_se))
        return led, led.verdict(FAST, BASE)

    led, v = verdict(0.01)
    assert v is not None and not v.wins and 0.98 < v.ratio < 1.02
    assert led.summarize(BASE, led.baseline_records(BASE)).score == pytest.approx(100.0)
    led, v = verdict(None)
    assert v is not None and 1.3 < v.ratio < 1.5 and len(led.baseline_records(BASE)) == 2


def test_a_baseline_window_too_short_to_tell_its_spread_does_not_stand_beside_one_that_can() -> None:
    # 16 worker processes started for a short stretch of the finals hand over their first round as
    # one burst: its window has no standard error, and read 1,443 samples/s where the first window
    # of the same settings, long enough to tell its spread, read 6,256 and the plain loop agreed
    # with that one. Beside it, the speed-up read 2.0x what the plain loop measured.
    led = Ledger(dataset_len=None, epochs=1)
    led.record(BASE, "baseline", "complete", m=replace(m(100.0), log_se=0.02))
    led.record(FAST, "search", "complete", m=replace(m(300.0), log_se=0.02))
    led.record(BASE, "final", "complete", m=m(40.0))
    v = led.verdict(FAST, BASE)
    assert v is not None and 2.9 < v.ratio < 3.1
    assert [r.phase for r in led.baseline_records(BASE)] == ["baseline"]
    # Where none can tell its spread, the rule before stands: the cold one beside the warm one.
    led = Ledger(dataset_len=None, epochs=1)
    led.record(BASE, "baseline", "complete", m=m(100.0))
    led.record(BASE, "final", "complete", m=m(40.0))
    assert len(led.baseline_records(BASE)) == 2


def test_a_confident_gain_under_five_percent_keeps_what_the_user_runs() -> None:
    # 4 % faster in every pair, surely: a gain the user would not notice is no reason for a change.
    led = _paired([(104.0, 100.0), (104.2, 100.1), (103.9, 99.9), (104.1, 100.0)], log_se=0.001)
    d = led.decide([FAST, BASE], BASE)
    assert d.verdict is not None and d.verdict.faster and not d.verdict.wins
    assert 1.0 + TIE_TOLERANCE < d.verdict.ratio < 1.05
    assert d.kept_baseline and not d.undecided
    assert "less than 5%" in d.reason


def test_a_win_must_also_gain_five_percent_in_its_median_score() -> None:
    # The pairs say at least 6 % with confidence, four of them well ahead; the median score says
    # 4 %: what most windows read is no reason for a change.
    led = _paired([(104.0, 100.0), (125.0, 100.0), (104.0, 100.0), (125.0, 100.0), (104.0, 100.0),
                   (125.0, 100.0), (104.0, 100.0), (125.0, 100.0), (104.0, 100.0)], log_se=0.001)
    d = led.decide([FAST, BASE], BASE)
    score = led.summarize(FAST).score / led.summarize(BASE).score
    assert d.verdict is not None and d.verdict.wins and score < 1.05
    assert d.kept_baseline and "less than 5%" in d.reason


def test_a_gain_whose_interval_reaches_under_five_percent_keeps_what_the_user_runs() -> None:
    # 7 % on average, surely faster, but the pairs spread so that the interval's lower end is 1.04:
    # a true gain of 3 % reads like this as often as not (the pick is the best of several, so its
    # ratio leans high). Undecided, not a change; more rounds side by side could decide it.
    led = _paired([(111.0, 100.0), (104.0, 100.0), (108.0, 100.0), (103.0, 100.0), (110.0, 100.0)],
                  log_se=0.001)
    d = led.decide([FAST, BASE], BASE)
    assert d.verdict is not None and d.verdict.faster and d.verdict.ratio >= 1.05
    assert 1.0 < d.verdict.low < 1.05 and not d.verdict.wins and d.verdict.open
    assert d.kept_baseline and d.undecided
    assert "not 5% faster at 95% confidence" in d.reason and "more round" in d.reason


def test_a_clear_win_ends_the_finals_before_their_last_round() -> None:
    # Two rounds, 2x in both, each window's batches within 2 %: a win at 99.5 % already.
    led = _paired([(200.0, 100.0), (204.0, 101.0)], log_se=0.02)
    assert led.decided_early([FAST, BASE], BASE)
    v = led.verdict(FAST, BASE, INTERIM_CONFIDENCE)
    assert v is not None and v.wins and v.confidence == INTERIM_CONFIDENCE


def test_a_win_only_at_95_percent_plays_the_rounds_left() -> None:
    # 1.2x in two pairs whose batches spread by 6 %: a win at 95 % (the last round's look), not at
    # 99.5 % (an earlier round's): the finals go on.
    led = _paired([(120.0, 100.0), (121.0, 100.0)], log_se=0.06)
    assert led.decide([FAST, BASE], BASE).verdict.wins  # type: ignore[union-attr]
    assert not led.decided_early([FAST, BASE], BASE)


def test_a_small_sure_gain_does_not_end_the_finals_early() -> None:
    # Sure at any confidence, but under MIN_GAIN: no win to end on.
    led = _paired([(103.0, 100.0), (103.1, 100.0)], log_se=0.001)
    assert not led.decided_early([FAST, BASE], BASE)


def test_workers_that_stop_every_epoch_pay_their_stop_in_the_score() -> None:
    # 4 epochs of 1,000 samples at 1,000 samples/s, 0.1 s to the first batch; 16 worker processes
    # that take 10 ms each to stop. Not persistent: both every epoch; persistent: once; threads: none.
    led = Ledger(dataset_len=1000, epochs=4)
    stopping = Candidate(32, num_workers=16, prefetch_factor=2)
    kept = Candidate(32, num_workers=16, prefetch_factor=2, persistent_workers=True)
    threads = Candidate(32, num_workers=16, prefetch_factor=2, worker_kind="thread")
    window = Measurement(samples_per_s=1000.0, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                         startup_s=0.1, batches=10, samples=320, window_s=1.0, peak_memory_bytes=0)
    for c in (stopping, kept, threads, BASE):
        led.record(c, "final", "complete", m=window)
    before = {c: led.summarize(c).score for c in led.by_candidate}
    assert before[stopping] == pytest.approx(4000 / (4 * 0.1 + 4))
    led.stop_cost(0.01)  # measured after these were recorded: every record is scored again
    after = {c: led.summarize(c).score for c in led.by_candidate}
    assert after[stopping] == pytest.approx(4000 / (4 * (0.1 + 0.16) + 4))
    assert after[kept] == pytest.approx(4000 / (0.1 + 0.16 + 4))
    assert after[threads] == before[threads] and after[BASE] == before[BASE]
    assert led.best_score == max(after.values())
    led.record(stopping, "final", "complete", m=window)  # recorded after: scored with the stop
    assert [r.score for r in led.by_candidate[stopping]] == pytest.approx([after[stopping]] * 2)


def test_a_start_up_the_loop_did_not_wait_for_is_scored_as_one_it_did() -> None:
    # 4 epochs of 1,000 samples at 1,000 samples/s; the user's 16 workers start in 0.3 s each epoch.
    # A stretch served on workers already running reads 0 s to its first batch; the run still pays
    # 0.3 s every epoch, so it is scored as the start-ups the loop waited for say, whichever came first.
    workers = Candidate(32, num_workers=16, prefetch_factor=2)

    def window(startup_s: float, seen: bool) -> Measurement:
        return Measurement(samples_per_s=1000.0, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                           startup_s=startup_s, batches=10, samples=320, window_s=1.0,
                           peak_memory_bytes=0, startup_seen=seen)

    full = 4000 / (4 * 0.3 + 4)
    led = Ledger(dataset_len=1000, epochs=4)
    led.record(workers, "final", "complete", m=window(0.0, False))
    assert led.by_candidate[workers][0].score == pytest.approx(4000 / 4)  # nothing better known yet
    led.record(workers, "final", "complete", m=window(0.2, True))
    led.record(workers, "final", "complete", m=window(0.4, True))  # the median of the two: 0.3 s
    led.record(workers, "final", "complete", m=window(0.01, False))
    scores = [r.score for r in led.by_candidate[workers]]
    assert scores[0] == scores[3] == pytest.approx(full)  # the one before them scored again too
    assert scores[1] == pytest.approx(4000 / (4 * 0.2 + 4)) and led.best_score == pytest.approx(scores[1])
    # A later search of the same loader scores its own unseen start-ups by the earlier ones.
    later = Ledger(dataset_len=1000, epochs=4, earlier=led.records)
    assert later.record(workers, "final", "complete", m=window(0.0, False)).score == pytest.approx(full)
    # Read back from a result's trials, the records score as they did.
    again = Ledger.replayed(led.records, 1000, 4)
    assert [r.score for r in again.records] == pytest.approx([r.score for r in led.records])


def test_a_cache_pick_is_decided_with_its_build_and_reported_once_built() -> None:
    # 4 epochs of 1,000 samples. The baseline reads 1,000 samples/s; the cache reads 5,000 once built,
    # and its build took 2 s: over a run that builds it, 4 s against 2.8 s (1.43x); every run after
    # that reads it built, 4 s against 0.8 s (5x). The rule weighs the first; the user is told the
    # second, as the pairs say it, so the figure lies inside its own interval.
    cached = Candidate(32, pretransform="ram")
    led = Ledger(dataset_len=1000, epochs=4)
    for fast, base in [(5000.0, 1000.0), (5100.0, 1010.0), (4900.0, 990.0)]:
        for c, v, build in ((cached, fast, 2.0), (BASE, base, 0.0)):
            led.record(c, "final", "complete", m=Measurement(
                samples_per_s=v, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0, startup_s=0.0,
                batches=10, samples=320, window_s=1.0, peak_memory_bytes=0, build_s=build, log_se=0.01))
    d = led.decide([cached, BASE], BASE)
    assert d.chosen.candidate == cached and d.verdict is not None and d.served is not None
    assert d.verdict.ratio == pytest.approx(4 / 2.8, rel=0.02)
    assert d.served.ratio == pytest.approx(5.0, rel=0.02)
    assert "1.43x" in d.reason and "5.00x" in d.reason and "once it is built" in d.reason
    result = from_decision(d, led.records, epochs=4)
    assert result.speedup == d.served.ratio and result.cache_build_s == 2.0
    assert result.speedup_low is not None and result.speedup_high is not None
    assert result.speedup_low <= result.speedup <= result.speedup_high
    assert "its cache built (a 2.0 s build, paid once)" in built_text(result)


def test_without_a_cache_the_reported_figure_is_the_verdict_s() -> None:
    # Nothing to build: one estimate, the same for the decision and the figure (the pairs' ratio,
    # not the ratio of median scores, which here reads 1.31x).
    led = _paired([(130.0, 100.0), (131.0, 100.0), (160.0, 100.0), (125.0, 100.0), (200.0, 100.0)],
                  log_se=0.01)
    d = led.decide([FAST, BASE], BASE)
    assert d.verdict is not None and d.served is not None and not d.kept_baseline
    assert d.served == d.verdict and "once it is built" not in d.reason
    result = from_decision(d, led.records, epochs=1)
    assert result.speedup == pytest.approx(d.verdict.ratio) and built_text(result) == ""
    assert led.summarize(FAST).score / led.summarize(BASE).score == pytest.approx(1.31)
    assert result.speedup == pytest.approx(1.47, abs=0.01)
