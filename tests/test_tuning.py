"""A drop-in's tuning across epochs (NOTE [ Settled means proven ] in autotune/tuning.py), driven with
figures the test chooses: a stand-in for the epochs' measurements, so that when the loader checks
its choice again, goes back to the baseline or explores again is exact."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest
import torch
from torch.utils.data import DataLoader, Dataset

from autotune.decide import TrialRecord
from autotune.machine import CpuSnapshot, cpu_snapshot
from autotune.measure import Measurement
from autotune.online import Outcome
from autotune.plan import make_plan
from autotune.result import TuneResult
from autotune.space import Candidate
from autotune.tuning import MIN_EPOCHS_BETWEEN_SEARCHES, SLOW_EPOCHS, STOPS_KEPT, Fixed, Phase, Tuning

BASE = Candidate(16)
WORKERS = Candidate(16, num_workers=2, prefetch_factor=2, persistent_workers=True)


class Indexed(Dataset):
    def __len__(self) -> int:
        return 640

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((2,), float(i)), i


def searching(epochs: int = 20, pretransform: str = "none", baseline: Candidate = BASE) -> Tuning:
    """A drop-in loader's tuning over ``epochs``, nothing served yet."""
    plan = make_plan(Indexed(), None, batch_size=16, budget_s=None, device="cpu", epochs=epochs,
                     pretransform=pretransform, max_workers=None, memory_budget_bytes=None,
                     batch_timeout_s=None, shuffle=True, collate_fn=None, seed=0, read_samples=False)
    return Tuning(plan, Fixed(), baseline, store_args=None, origin="train.py:1", reads_in_main=True,
                  threads_allowed=True)


def tuning(result: TuneResult | None = None, settled: Candidate = WORKERS) -> Tuning:
    t = searching()
    t.settle_from_profile(result or TuneResult(loader_kwargs=settled.loader_kwargs(),
                                               baseline_samples_per_s=1000.0), settled)
    return t


def settled_epochs(t: Tuning, n: int, rate: float, wait: float = 0.1) -> None:
    for _ in range(n):
        t.end_settled_epoch(int(rate * 10), 10.0, wait * 10.0)


def measurement(sps: float) -> Measurement:
    return Measurement(samples_per_s=sps, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                       startup_s=0.0, batches=40, samples=640, window_s=640 / sps, peak_memory_bytes=0)


def play(t: Tuning, rates: dict[Candidate, float]) -> None:
    """Serve the search's stretches with the given rates until it decides."""
    for _ in range(20):
        nxt = t.next_candidate()
        if nxt is None:
            decision = t.decision_due()
            assert decision is not None
            t.settle(decision)
            return
        c, phase = nxt
        t.record(Outcome(c, phase, measurement(rates[c]), samples=640, wall_s=640 / rates[c]))
    raise AssertionError("no decision")


def test_a_settled_choice_slower_than_the_baseline_is_checked_and_dropped() -> None:
    t = tuning()
    settled_epochs(t, MIN_EPOCHS_BETWEEN_SEARCHES, rate=1000.0)  # as promised: nothing happens
    assert t.phase is Phase.SETTLED
    settled_epochs(t, SLOW_EPOCHS, rate=700.0)  # 30 % below the baseline's rate, twice
    assert t.phase is Phase.DUE and t.why is not None and "side by side again" in t.why
    t.begin_epoch()
    assert t.phase is Phase.RECHECKING and t.measuring_again() == f"{WORKERS.label()} against the baseline"
    assert t.settled is None and t.explorer is not None and t.explorer.phase == "recheck"
    play(t, {WORKERS: 700.0, BASE: 1000.0})
    assert t.settled == BASE and t.result is not None and t.result.kept_baseline
    assert t.phase is Phase.SETTLED and t.measuring_again() is None


def test_a_choice_that_still_wins_is_kept_after_its_check() -> None:
    t = tuning()
    settled_epochs(t, MIN_EPOCHS_BETWEEN_SEARCHES + SLOW_EPOCHS, rate=700.0)
    t.begin_epoch()
    play(t, {WORKERS: 2000.0, BASE: 1000.0})
    assert t.settled == WORKERS


def test_one_slow_epoch_is_not_enough_and_checks_are_spaced() -> None:
    t = tuning()
    settled_epochs(t, MIN_EPOCHS_BETWEEN_SEARCHES, rate=1000.0)
    settled_epochs(t, 1, rate=700.0)
    settled_epochs(t, 1, rate=1000.0)
    settled_epochs(t, 1, rate=700.0)
    assert t.phase is Phase.SETTLED  # never two slow epochs in a row
    fresh = tuning()
    settled_epochs(fresh, SLOW_EPOCHS, rate=700.0)
    assert fresh.phase is Phase.SETTLED  # too soon after the search


def test_sustained_drift_explores_again_from_the_baseline() -> None:
    t = tuning(settled=BASE)
    settled_epochs(t, MIN_EPOCHS_BETWEEN_SEARCHES, rate=1000.0, wait=0.1)
    settled_epochs(t, 2, rate=1000.0, wait=0.6)
    assert t.phase is Phase.DUE and t.why is not None and "exploring again" in t.why
    t.begin_epoch()
    assert t.phase is Phase.SEARCHING_AGAIN and t.settled is None and t.explorer is None
    assert t.next_candidate() == (BASE, "baseline")


def test_a_profile_chosen_under_another_load_is_checked_after_its_first_epoch() -> None:
    # Others' load over the first settled epoch against the load the choice was measured under
    # (NOTE [ Others' load ] in machine.py). The epoch's window is made here: ten seconds in which other
    # processes ran 0.9 of each CPU, so that the machine's real load cannot change the outcome.
    def settled_under(then: float) -> Tuning:
        t = tuning(TuneResult(loader_kwargs=WORKERS.loader_kwargs(), baseline_samples_per_s=1000.0,
                              load_average=then))
        assert t.load_check is not None and t.phase is Phase.SETTLED  # nothing read yet: nothing decided
        now = cpu_snapshot()
        assert now is not None
        t.load_check = (then, CpuSnapshot(now.at - 10.0, now.busy_s - 9.0 * now.cpus, now.own_s, now.cpus))
        settled_epochs(t, 1, rate=1000.0)
        return t

    stale = settled_under(0.0)
    why = stale.why
    assert stale.phase is Phase.DUE
    assert why is not None and re.search(r"ran 0\.00 .* they ran 0\.9\d", why), why
    stale.begin_epoch()
    assert stale.explorer is not None and stale.explorer.phase == "recheck"
    same = settled_under(0.9)
    assert same.phase is Phase.SETTLED and same.load_check is None


def test_a_window_too_short_to_read_waits_for_the_next_epoch() -> None:
    t = tuning(TuneResult(loader_kwargs=WORKERS.loader_kwargs(), baseline_samples_per_s=1000.0,
                          load_average=0.0))
    t.load_check = (0.0, cpu_snapshot())  # the epoch ends at once: under MIN_LOAD_WINDOW_S
    settled_epochs(t, 1, rate=1000.0)
    assert t.load_check is not None and t.phase is Phase.SETTLED


def filled_and_settled(epochs: int, epochs_done: int) -> Tuning:
    """A search whose ram cache filled from the epochs it loaded, settled on the baseline."""
    t = searching(epochs, pretransform="ram")
    t.record(Outcome(BASE, "baseline", measurement(1000.0), samples=640, wall_s=0.64))
    assert t.filling is not None
    list(DataLoader(t.filling.dataset, batch_size=16, collate_fn=t.filling.collate_fn))  # the epoch's pass
    assert t.cache_ready()
    t.settle(t.force_decision())
    t.epochs_done = epochs_done
    return t


def settled_on_a_cold_baseline(epochs: int = 10, epochs_done: int = 2) -> Tuning:
    """A search that settled on WORKERS (three windows about 1,500 samples/s) against the baseline's
    first stretch alone (1,000): its epochs ran out before its finals reached the baseline."""
    t = searching(epochs)
    t.record(Outcome(BASE, "baseline", measurement(1000.0), samples=640, wall_s=0.64))
    for jitter in (1.0, 1.02, 0.98):
        t.ledger.record(WORKERS, "final", "complete", m=measurement(1500.0 * jitter))
    t.settle(t.force_decision())
    assert t.settled == WORKERS and t.result is not None
    assert t.result.speedup == pytest.approx(1.5, rel=0.03)
    t.epochs_done = epochs_done
    return t


def test_a_pick_measured_against_a_cold_baseline_alone_is_measured_against_it_warm() -> None:
    # NOTE [ The baseline measured warm ]: the next epoch plays the two side by side; the stored
    # decision is replaced by the check's, whose figure stands on the baseline's warm pace.
    t = settled_on_a_cold_baseline()
    t.begin_epoch()
    assert t.phase is Phase.CONFIRMING and t.explorer is not None and t.explorer.phase == "recheck"
    assert t.measuring_again() == f"{WORKERS.label()} against the baseline, measured warm"
    assert t.result is not None and t.result.candidate == WORKERS  # ended here, the stored pick stands
    play(t, {WORKERS: 1500.0, BASE: 1250.0})
    assert t.settled == WORKERS and t.phase is Phase.SETTLED and t.measuring_again() is None
    assert t.result is not None and t.result.speedup == pytest.approx(1.2, rel=0.01)
    assert not t.confirm_due  # once
    # The warm baseline level with the pick: a check without a winner keeps what won the search.
    t = settled_on_a_cold_baseline()
    t.begin_epoch()
    play(t, {WORKERS: 1500.0, BASE: 1480.0})
    assert t.settled == WORKERS and t.result is not None
    assert t.result.decision is not None and "measured warm, not slower" in t.result.decision
    # The warm baseline faster than the pick: the baseline again.
    t = settled_on_a_cold_baseline()
    t.begin_epoch()
    play(t, {WORKERS: 1100.0, BASE: 1400.0})
    assert t.settled == BASE and t.result is not None and t.result.kept_baseline


def test_a_check_that_never_measured_the_baseline_weighs_the_search_s_measurement_of_it() -> None:
    # Epochs of a few batches: the check's baseline stretch found no room for a window.
    def checked(windows: tuple[float, ...]) -> Tuning:
        t = settled_on_a_cold_baseline()
        t.begin_epoch()
        for sps in windows:
            t.ledger.record(WORKERS, "recheck", "complete", m=measurement(sps))
        decision = t.ledger.decide([WORKERS], BASE)
        assert decision.baseline is None  # alone, the check has nothing to weigh its pick against
        t.settle(decision)
        return t

    won = checked((1500.0, 1530.0, 1470.0))  # repeated: a win with confidence over the search's 1,000
    assert won.settled == WORKERS and won.result is not None
    assert won.result.speedup == pytest.approx(1.5, rel=0.03) and won.result.speedup_low is not None
    once = checked((1500.0,))  # once: no noise measured, so no figure, and the pick stands
    assert once.settled == WORKERS and once.result is not None and once.result.speedup is None
    assert once.result.decision is not None and "in none of its stretches" in once.result.decision


def test_the_warm_baseline_is_measured_only_where_the_search_did_not_and_an_epoch_is_left() -> None:
    last = settled_on_a_cold_baseline(epochs=4, epochs_done=3)
    last.begin_epoch()
    assert last.phase is Phase.SETTLED and last.settled == WORKERS
    t = searching()
    t.record(Outcome(BASE, "baseline", measurement(1000.0), samples=640, wall_s=0.64))
    for jitter in (1.0, 1.02, 0.98):
        t.ledger.record(WORKERS, "final", "complete", m=measurement(1500.0 * jitter))
        t.ledger.record(BASE, "final", "complete", m=measurement(1000.0 * jitter))
    t.settle(t.force_decision())
    t.epochs_done = 2
    t.begin_epoch()
    assert t.phase is Phase.SETTLED and t.settled == WORKERS and not t.confirm_due


def test_a_filled_cache_is_measured_only_with_an_epoch_left_to_gain_in() -> None:
    t = filled_and_settled(epochs=5, epochs_done=2)
    t.begin_epoch()
    assert t.settled is None and t.explorer is not None and t.explorer.phase == "final"
    # Whole samples served as one gather per batch: read in the main process and by a thread.
    challengers = {c for c in t.explorer.finalists if c != BASE}
    assert {(c.pretransform, c.num_workers, c.worker_kind) for c in challengers} == {
        ("ram", 0, "process"), ("ram", 1, "thread")}
    last = filled_and_settled(epochs=5, epochs_done=4)
    last.begin_epoch()  # the last epoch: what the check could win, it could not win back
    assert last.settled == BASE and last.explorer is None


def test_a_filled_cache_is_not_measured_where_the_loop_hardly_waits_for_data() -> None:
    # A cache shortens only the loading: where the settled configuration waited for data 2 % of its
    # epoch, the check could win at most that, and the fill stops.
    t = filled_and_settled(epochs=6, epochs_done=1)
    t.end_settled_epoch(2000, 2.0, 0.04)
    assert t.reference_wait is not None and t.reference_wait < 0.05
    t.begin_epoch()
    assert t.settled == BASE and t.filling is None
    # Before any settled epoch ended: what the search measured on the settled choice.
    searched = filled_and_settled(epochs=6, epochs_done=1)
    searched.history = [replace(r, measurement=replace(r.measurement, wait_fraction=0.02))
                        if r.measurement is not None else r for r in searched.history]
    searched.begin_epoch()
    assert searched.settled == BASE and searched.filling is None
    waited = filled_and_settled(epochs=6, epochs_done=1)
    waited.end_settled_epoch(2000, 2.0, 0.6)  # 30 %: measured
    waited.begin_epoch()
    assert waited.settled is None and waited.explorer is not None and waited.explorer.phase == "final"


def test_a_cache_that_lost_in_the_search_is_not_measured_again_after_it() -> None:
    # The cache filled while the search played, joined it (NOTE [ Online search ] 3 in online.py)
    # and lost: the check an epoch after the search settled would measure what was already decided.
    t = filled_and_settled(epochs=6, epochs_done=1)
    cached = t._cache_candidates()
    assert cached
    for c in cached:
        t.history.append(TrialRecord(len(t.history), "final", c, "complete", measurement(900.0), 900.0))
    t.begin_epoch()
    assert t.settled == BASE and t.explorer is None
    # One of them measured: the others still are.
    t = filled_and_settled(epochs=6, epochs_done=1)
    t.history.append(TrialRecord(len(t.history), "final", cached[0], "complete", measurement(900.0), 900.0))
    t.begin_epoch()
    assert t.explorer is not None
    assert set(t.explorer.finalists) == {*cached[1:], BASE}


ONE_THREAD = Candidate(16, torch_threads=1)


def cache_filled_after_a_win() -> Tuning:
    """Settled on one torch thread, a clear win in its own search; then the cache filled, and the
    next epoch measures it against that choice."""
    t = filled_and_settled(epochs=10, epochs_done=2)
    t.settled = None  # the search again, with its ledger: the thread count beat the baseline
    for jitter in (1.0, 1.02, 0.98):
        t.ledger.record(ONE_THREAD, "final", "complete", m=measurement(1500.0 * jitter))
        t.ledger.record(BASE, "final", "complete", m=measurement(1000.0 * jitter))
    t.settle(t.ledger.decide([ONE_THREAD, BASE], BASE))
    assert t.settled == ONE_THREAD
    t.begin_epoch()
    assert t.explorer is not None and ONE_THREAD in t.explorer.finalists
    return t


def test_a_filled_cache_that_beats_nothing_leaves_a_settled_winner_in_place() -> None:
    # No cache ahead, and the thread count ahead or level with the baseline in a round: nothing
    # beats the settled choice, which stays.
    for settled_sps in (1500.0, 1000.0):
        t = cache_filled_after_a_win()
        assert t.explorer is not None
        cached = [c for c in t.explorer.finalists if c not in (ONE_THREAD, BASE)]
        rates = {ONE_THREAD: settled_sps, BASE: 1000.0, **{c: 900.0 for c in cached}}
        for _ in range(len(rates)):  # the check's first round: what it has measured shows the choice
            nxt = t.next_candidate()
            assert nxt is not None
            t.record(Outcome(nxt[0], nxt[1], measurement(rates[nxt[0]]), samples=640, wall_s=0.64))
        partial = t.partial_result()
        assert partial is not None and partial.candidate == ONE_THREAD, partial.decision if partial else None
        # Ended here, the run reports the settled choice, which stands, and what was measured.
        assert t.measuring_again() == f"its filled cache against {ONE_THREAD.label()}"
        assert t.result is not None and t.result.candidate == ONE_THREAD
        assert t.partial_result() is partial  # nothing measured since: not decided (nor /proc read) again
        play(t, rates)
        assert t.settled == ONE_THREAD, t.result.decision if t.result else None
        assert t.measuring_again() is None
        assert t.result is not None and not t.result.kept_baseline


def test_a_filled_cache_that_wins_replaces_the_settled_choice() -> None:
    t = cache_filled_after_a_win()
    assert t.explorer is not None
    main = next(c for c in t.explorer.finalists if c.pretransform == "ram" and c.num_workers == 0)
    rest = [c for c in t.explorer.finalists if c not in (main, ONE_THREAD, BASE)]
    play(t, {main: 3000.0, ONE_THREAD: 1500.0, BASE: 1000.0, **{c: 900.0 for c in rest}})
    assert t.settled == main


def test_batches_already_on_an_accelerator_rule_out_worker_processes() -> None:
    # A CPU stand-in for a CUDA batch (no GPU here): what the drop-in sees in its first batch, not by
    # reading a sample of its own. tests/test_gpu.py runs the real thing on a GPU.
    class OnDevice:
        is_cuda = True

    t = tuning()
    t.observe((OnDevice(), [1, 2]))
    assert t.cuda_data is False  # not a tensor: nothing on a device
    t = tuning()
    fake = torch.zeros(2).as_subclass(_CudaStandIn)
    t.observe([fake, torch.zeros(2)])
    assert t.cuda_data is True
    space, _ = t._space()
    assert space.max_workers == 0 and space.max_threads > 0


class _CudaStandIn(torch.Tensor):
    """A CPU tensor that says it is on a CUDA device: a stand-in, as no GPU is here."""

    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


def test_the_workers_stop_measured_is_scored_from_the_next_outcome_on() -> None:
    # The first outcome is recorded before any worker stopped; once stops are timed, the next outcome
    # scores every record with their median (NOTE [ Score ] in decide.py).
    user = Candidate(16, num_workers=4, prefetch_factor=2)
    t = searching(baseline=user)
    t.record(Outcome(user, "baseline", measurement(1000.0), samples=640, wall_s=0.64))
    (first,) = t.ledger.by_candidate[user]
    assert t.ledger.stop_per_worker_s == 0.0 and first.score == pytest.approx(1000.0)
    t.stopped(4, 0.04)
    t.stopped(4, 0.2)  # one slow stop (an abandoned stretch's busy workers) does not set the cost
    t.stopped(4, 0.04)
    nxt = t.next_candidate()
    assert nxt is not None
    t.record(Outcome(nxt[0], nxt[1], measurement(1000.0), samples=640, wall_s=0.64))
    assert t.ledger.stop_per_worker_s == pytest.approx(0.01)
    (first,) = t.ledger.by_candidate[user]  # 20 epochs of 640 samples, each paying 4 x 10 ms to stop
    assert first.score == pytest.approx(20 * 640 / (20 * 0.04 + 20 * 640 / 1000.0))
    for _ in range(STOPS_KEPT):  # a long run's latest stops set the cost, at a fixed cost per record
        t.stopped(4, 0.08)
    nxt = t.next_candidate()
    assert nxt is not None
    t.record(Outcome(nxt[0], nxt[1], measurement(1000.0), samples=640, wall_s=0.64))
    assert len(t.stops) == STOPS_KEPT and t.ledger.stop_per_worker_s == pytest.approx(0.02)


def test_a_first_epoch_the_baseline_s_first_stretch_held_whole_leaves_the_search_its_epochs() -> None:
    # NOTE [ The baseline's epoch ]: that epoch measured nothing but the baseline, as one held for a
    # cache to fill; the epochs that search count.
    t = searching(epochs=4)
    assert t.next_candidate() == (BASE, "baseline")
    t.record(Outcome(BASE, "baseline", measurement(100.0), samples=640, wall_s=6.4))
    assert t.end_search_epoch() is None
    assert t.search_epochs == 0
    nxt = t.next_candidate()
    assert nxt is not None and nxt[0] != BASE
    t.record(Outcome(nxt[0], nxt[1], measurement(150.0), samples=640, wall_s=640 / 150.0))
    assert t.end_search_epoch() is None
    assert t.search_epochs == 1


def test_a_profile_that_left_its_cache_undecided_fills_it_and_measures_it_again() -> None:
    # NOTE [ An undecided profile is resumed ]: the stored run kept the baseline, a ram cache ahead
    # but undecided, in a loop that hardly waited for data.
    cached = replace(BASE, pretransform="ram")
    trials = tuple(TrialRecord(i, "final", c, "complete", measurement(sps), sps)
                   for i, (c, sps) in enumerate([(BASE, 1000.0), (cached, 1390.0)]))

    def stored(undecided: bool) -> Tuning:
        t = searching(5, pretransform="ram")
        t.settle_from_profile(TuneResult(loader_kwargs=BASE.loader_kwargs(), baseline_samples_per_s=1000.0,
                                         undecided=undecided, trials=trials), BASE)
        return t

    t = stored(undecided=True)
    assert t.settled == BASE and t.filling is not None
    list(DataLoader(t.filling.dataset, batch_size=16, collate_fn=t.filling.collate_fn))  # epoch 1's pass
    settled_epochs(t, 1, rate=1000.0, wait=0.01)
    t.begin_epoch()
    assert t.phase is Phase.CHECKING_CACHE and t.explorer is not None
    assert any(c.pretransform == "ram" for c in t.explorer.finalists), t.explorer.finalists
    decided = stored(undecided=False)  # a decided profile is served as it is
    assert decided.filling is None and decided.phase is Phase.SETTLED
