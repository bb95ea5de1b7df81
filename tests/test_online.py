"""The drop-in's search policy (NOTE [ Online search ] in autotune/online.py), driven with a stand-in
for the stretches it would serve: each candidate's samples/s are the test's figures, cycled, so that
which configuration wins, and when the search stops, are exact. The real stretches, the real
measurements and the user's loop are in test_loader.py; here only the decisions are."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from autotune.decide import Ledger, estimate_workers
from autotune.epochs import Timeline, settling_bound
from autotune.measure import Measurement
from autotune.online import MAX_CANDIDATES, RECHECK_ROUNDS, Explorer, Outcome
from autotune.space import Candidate, SearchSpace

BASE = Candidate(32)
SAMPLES = 3200
"""Samples each stand-in stretch serves."""


def measurement(sps: float, wait: float, startup_s: float = 0.0) -> Measurement:
    return Measurement(samples_per_s=sps, busy=1 - wait, wait_fraction=wait, step_ms=10.0,
                       wait_ms=10.0 * wait / max(1e-9, 1 - wait), startup_s=startup_s, batches=100,
                       samples=SAMPLES, window_s=SAMPLES / sps, peak_memory_bytes=0)


def run(space: SearchSpace, rate: Callable[[Candidate], Iterator[float]], *, wait: float = 0.75,
        dataset_len: int = 50_000, epochs: int = 10, max_stretches: int = 80,
        beside: float | None = None, base: Candidate = BASE,
        base_startup_s: float = 0.0) -> tuple[Explorer, list[Candidate]]:
    """Serve the explorer's candidates until it decides; return it and what it served, in order."""
    ledger = Ledger(dataset_len, epochs)
    ex = Explorer(space, base, ledger)
    rates: dict[Candidate, Iterator[float]] = {}
    served: list[Candidate] = []
    for _ in range(max_stretches):
        nxt = ex.next()
        if nxt is None:
            return ex, served
        c, phase = nxt
        sps = next(rates.setdefault(c, rate(c)))
        served.append(c)
        m = measurement(sps, wait, base_startup_s) if c == base else measurement(sps, 0.1)
        ex.record(Outcome(c, phase, m, samples=SAMPLES, wall_s=SAMPLES / sps,
                          loading_beside_step=beside if c == base else None))
    raise AssertionError(f"no decision after {max_stretches} stretches: {[c.label() for c in served]}")


def steady(figures: dict[str, float], default: float = 100.0) -> Callable[[Candidate], Iterator[float]]:
    """samples/s by kind: 'base', 'process', 'thread'; the same every time."""
    def rate(c: Candidate) -> Iterator[float]:
        kind = "base" if c.num_workers == 0 else c.worker_kind
        return itertools.repeat(figures.get(kind, default))
    return rate


SPACE = SearchSpace(batch_sizes=(32,), max_workers=4, max_threads=4, prefetch_factors=(2,),
                    baseline_batch_size=32)


def test_a_clear_win_is_found_confirmed_and_chosen() -> None:
    ex, served = run(SPACE, steady({"base": 100.0, "process": 400.0, "thread": 200.0}))
    assert ex.decision is not None and ex.decision.chosen.candidate.worker_kind == "process"
    assert ex.decision.verdict is not None and ex.decision.verdict.wins
    # The finals measured the winner and the baseline again, side by side.
    finals = [r for r in ex.ledger.records if r.phase == "final"]
    assert {r.candidate for r in finals} >= {BASE, ex.decision.chosen.candidate}
    assert sum(r.candidate == BASE for r in finals) >= 2


def test_nothing_to_win_keeps_the_baseline_without_exploring() -> None:
    # The baseline waits 2 % of the time: no loader can make the run more than 2 % faster.
    ex, served = run(SPACE, steady({"base": 100.0, "process": 400.0}), wait=0.02)
    assert ex.decision is not None and ex.decision.kept_baseline
    assert served == [BASE]  # no candidate was tried
    assert ex.decision.reason.startswith("the loop waited for data 2.0% of the run")
    assert "nothing else was tried" in ex.decision.reason


def test_a_loader_that_waits_for_its_workers_to_start_has_something_to_win() -> None:
    # An evaluation loader of 7 batches with 16 workers written: between batches it waits 1 %, but
    # its workers take 0.4 s to start every epoch, a fifth of its run. Fewer workers start faster.
    # Kept alive, the same workers start once in ten epochs: 2 % of the run, nothing to win.
    base = Candidate(32, num_workers=16, prefetch_factor=2)
    ex, served = run(SPACE, lambda c: itertools.repeat(137.0 if c == base else 200.0), wait=0.01,
                     dataset_len=224, epochs=10, base=base, base_startup_s=0.4)
    assert set(served) != {base}
    assert ex.decision is not None and "nothing else was tried" not in ex.decision.reason
    kept = replace(base, persistent_workers=True)
    ex, served = run(SPACE, lambda c: itertools.repeat(137.0 if c == kept else 200.0), wait=0.01,
                     dataset_len=224, epochs=10, base=kept, base_startup_s=0.4)
    assert served == [kept] and ex.decision is not None and "nothing else was tried" in ex.decision.reason


def test_workers_beside_a_busy_step_get_the_cache_tried() -> None:
    # The baseline hardly waits (2 %), but its workers take 40 % of the run's CPU on CPUs busy all
    # the time (NOTE [ Online search ] 2): the cache, which removes their work, is tried and wins;
    # no other worker count is (the work per sample is the same at any count).
    space = replace(SPACE, pretransforms=("none", "ram"))
    def rate(c: Candidate) -> Iterator[float]:
        return itertools.repeat(300.0 if c.pretransform == "ram" else 100.0)
    ex, served = run(space, rate, wait=0.02, beside=0.4)
    assert ex.decision is not None and ex.decision.chosen.candidate.pretransform == "ram"
    assert ex.decision.verdict is not None and ex.decision.verdict.wins
    assert all(c == BASE or c.pretransform == "ram" for c in served)
    # The same loop where the workers take less of it: nothing to win, nothing tried.
    ex, served = run(space, rate, wait=0.02, beside=0.1)
    assert ex.decision is not None and ex.decision.kept_baseline and served == [BASE]


def test_a_noisy_machine_keeps_the_baseline() -> None:
    # Workers look 10 % faster on average, but every window wobbles by +-40 %: not a confident win.
    def rate(c: Candidate) -> Iterator[float]:
        base = 110.0 if c.num_workers else 100.0
        return itertools.cycle([base * 1.4, base * 0.6, base])
    ex, _ = run(SPACE, rate)
    assert ex.decision is not None and ex.decision.kept_baseline
    v = ex.decision.verdict
    assert v is not None and v.low < 1.0 < v.high


def test_slower_candidates_end_the_exploration_within_its_loss_bound() -> None:
    # Every candidate is a quarter of the baseline's speed: exploring costs time, so it stops early,
    # after far fewer than MAX_CANDIDATES, and the baseline is kept.
    ex, served = run(SPACE, steady({"base": 400.0, "process": 100.0, "thread": 100.0}),
                     dataset_len=2_000, epochs=2)
    explored = {c for c in served if c != BASE}
    assert ex.decision is not None and ex.decision.kept_baseline
    assert len(explored) < MAX_CANDIDATES
    projected = 2 * 2_000 / 400.0
    # It stopped because the bound was spent: 5 % of what the baseline's waiting (half its time
    # here) costs the run, more than 1 % of the run.
    assert ex.loss_s > 0.05 * 0.5 * projected


def test_a_loop_that_waits_more_may_spend_more_exploring() -> None:
    # The same slow candidates: a baseline that waits 90 % of the time has more to win than one
    # that waits 10 %, and may spend more stretches finding it (NOTE [ Online search ] 4).
    spent = {}
    for wait in (0.1, 0.9):
        ex, served = run(SPACE, steady({"base": 400.0, "process": 100.0, "thread": 100.0}),
                         dataset_len=200_000, epochs=2, wait=wait)
        spent[wait] = len([c for c in served if c != BASE])
    assert spent[0.9] > spent[0.1]


def test_a_candidate_within_the_tie_tolerance_is_not_worth_the_finals() -> None:
    # Workers measure 2 % faster: even confirmed, that is a tie; the finals would only cost time.
    ex, served = run(SPACE, steady({"base": 100.0, "process": 102.0, "thread": 101.0}))
    assert ex.decision is not None and ex.decision.kept_baseline
    assert not [r for r in ex.ledger.records if r.phase == "final"]
    assert "not worth measuring again" in ex.decision.reason
    assert ex.decision.challenger is not None and ex.decision.verdict is not None


def test_the_finals_end_after_a_round_that_leaves_the_challenger_behind() -> None:
    # Every worker candidate measures 30 % ahead once, then 30 % behind: after one round of the
    # finals none leads, and the baseline is kept without the second round.
    def rate(c: Candidate) -> Iterator[float]:
        if c.num_workers == 0:
            return itertools.repeat(100.0)
        return itertools.chain([130.0], itertools.repeat(70.0)) if c.worker_kind == "process" \
            else itertools.repeat(40.0)
    ex, served = run(SPACE, rate)
    assert ex.decision is not None and ex.decision.kept_baseline
    finals = [r for r in ex.ledger.records if r.phase == "final"]
    assert sum(r.candidate == BASE for r in finals) == 1, [r.candidate.label() for r in finals]


def test_a_leading_challenger_plays_every_final_round() -> None:
    # The same start, but the workers stay ahead: the finals run their rounds and the workers win.
    def rate(c: Candidate) -> Iterator[float]:
        if c.num_workers == 0:
            return itertools.cycle([100.0, 96.0, 104.0])
        return itertools.cycle([130.0, 125.0, 135.0]) if c.worker_kind == "process" \
            else itertools.repeat(40.0)
    ex, _ = run(SPACE, rate)
    assert ex.decision is not None and not ex.decision.kept_baseline
    finals = [r for r in ex.ledger.records if r.phase == "final"]
    assert sum(r.candidate == BASE for r in finals) >= 2


def _final_stretches(ex: Explorer, kind: str) -> dict[Candidate, int]:
    """Final-phase stretches per challenger of a worker kind."""
    out: dict[Candidate, int] = {}
    for r in ex.ledger.records:
        if r.phase == "final" and r.candidate.num_workers and r.candidate.worker_kind == kind:
            out[r.candidate] = out.get(r.candidate, 0) + 1
    return out


def test_a_challenger_that_falls_behind_the_baseline_drops_out_of_the_finals() -> None:
    # Thread workers measure 80 % ahead once, then 60 % behind; three process workers stay 100 % ahead:
    # after the first round the threads play no more, the processes play on and win.
    def rate(c: Candidate) -> Iterator[float]:
        if c.num_workers == 0:
            return itertools.cycle([100.0, 96.0, 104.0])
        if c.worker_kind == "thread":
            return itertools.chain([180.0], itertools.repeat(40.0))
        return itertools.cycle([200.0, 195.0, 205.0] if c.num_workers == 3 else [150.0])
    ex, _ = run(SPACE, rate)
    assert ex.decision is not None and ex.decision.chosen.candidate.worker_kind == "process"
    threads = _final_stretches(ex, "thread")
    assert threads and max(threads.values()) == 1, threads
    assert max(_final_stretches(ex, "process").values()) >= 2
    assert set(threads) <= ex.dropped


def test_a_challenger_the_best_beats_with_confidence_drops_out_of_the_finals() -> None:
    # Two and four process workers lead the baseline by 30 %, three by 100 %, each within a few per
    # cent: once a round has measured the noise, two and four cannot catch up and stop costing
    # stretches, while three plays on and wins.
    def rate(c: Candidate) -> Iterator[float]:
        if c.num_workers == 0:
            return itertools.cycle([100.0, 96.0, 104.0])
        if c.worker_kind == "thread":
            return itertools.repeat(110.0)
        lead = 2.0 if c.num_workers == 3 else 1.3
        return itertools.cycle([100.0 * lead, 97.0 * lead, 103.0 * lead])
    ex, _ = run(SPACE, rate)
    assert ex.decision is not None and ex.decision.chosen.candidate.num_workers == 3
    played = _final_stretches(ex, "process")
    assert played[ex.decision.chosen.candidate] >= 2
    behind = {c: n for c, n in played.items() if c.num_workers != 3}
    assert behind and max(behind.values()) == 1 and set(behind) <= ex.dropped, played


def test_a_challenge_whose_challengers_fall_behind_or_go_unmeasured_keeps_the_baseline_and_says_why() -> None:
    # A cache challenge: the process candidate measures 40 % behind; the thread candidate's stretches
    # never complete a window. After one round nothing measured can win: the finals end, and the
    # reason names what was measured rather than claiming nothing could be.
    proc = replace(BASE, num_workers=2, prefetch_factor=2, persistent_workers=True)
    thread = replace(BASE, num_workers=1, worker_kind="thread", prefetch_factor=2)
    ex = Explorer.challenge(SPACE, BASE, [proc, thread], Ledger(50_000, 10))
    served: list[Candidate] = []
    while (nxt := ex.next()) is not None and len(served) < 40:
        c, phase = nxt
        served.append(c)
        if c == thread:
            ex.record(Outcome(c, phase))  # the epoch ended before a window was measured
            continue
        sps = 100.0 if c == BASE else 60.0
        ex.record(Outcome(c, phase, measurement(sps, 0.5 if c == BASE else 0.1), samples=SAMPLES,
                          wall_s=SAMPLES / sps))
    assert ex.decision is not None and ex.decision.kept_baseline
    assert served.count(proc) == 1 and served.count(thread) == 1, [c.label() for c in served]
    assert proc.label() in ex.decision.reason and "could be measured" not in ex.decision.reason


UNCAPPED = estimate_workers(measurement(100.0, 0.8), 8)


def _first_candidates(share: float | None, cpus: int | None) -> list[Candidate]:
    """What the explorer queues after a baseline that waits 80 % of the time (ceil(L / S) = 4 or 5,
    as the floats round: UNCAPPED)."""
    ex = Explorer(replace(SPACE, max_workers=8, max_threads=8), BASE, Ledger(50_000, 10), cpus=cpus)
    c, phase = ex.next() or (None, None)
    assert c == BASE and phase == "baseline"
    ex.record(Outcome(BASE, "baseline", measurement(100.0, 0.8), samples=SAMPLES, wall_s=32.0,
                      load_cpu_share=share))
    return list(ex.queue)


def test_cpu_bound_loading_gets_no_more_workers_than_cpus_beside_the_step() -> None:
    # Loading that keeps the main thread on a CPU: on 2 CPUs one worker is all that can run beside
    # the step; 4 would only compete.
    assert {c.num_workers for c in _first_candidates(0.9, cpus=2)} == {1}
    assert {c.num_workers for c in _first_candidates(0.9, cpus=4)} == {3}
    # Loading that waits (storage, the network) uses no CPU: the estimate stands.
    assert {c.num_workers for c in _first_candidates(0.05, cpus=2)} == {UNCAPPED}
    assert {c.num_workers for c in _first_candidates(None, cpus=2)} == {UNCAPPED}
    assert {c.num_workers for c in _first_candidates(0.9, cpus=None)} == {UNCAPPED}


def test_a_recheck_goes_back_to_the_baseline_when_the_settled_one_no_longer_wins() -> None:
    settled = Candidate(32, num_workers=2, prefetch_factor=2, persistent_workers=True)
    ledger = Ledger(50_000, 10)
    ex = Explorer.recheck(SPACE, BASE, settled, ledger)
    figures = {BASE: itertools.cycle([100.0, 104.0, 97.0]), settled: itertools.cycle([90.0, 95.0, 92.0])}
    while (nxt := ex.next()) is not None:
        c, phase = nxt
        assert phase == "recheck"
        sps = next(figures[c])
        ex.record(Outcome(c, phase, measurement(sps, 0.5), samples=SAMPLES, wall_s=SAMPLES / sps))
    assert ex.decision is not None and ex.decision.kept_baseline
    assert sum(r.candidate == settled for r in ledger.records) == 3


def serve_alike(ex: Explorer) -> list[Candidate]:
    """Serve every candidate at the same rate until the explorer decides; what it tried, in order."""
    tried: list[Candidate] = []
    for _ in range(40):
        nxt = ex.next()
        if nxt is None:
            break
        c, phase = nxt
        tried.append(c)
        ex.record(Outcome(c, phase, measurement(100.0, 0.5), samples=SAMPLES, wall_s=SAMPLES / 100.0))
    assert ex.decision is not None
    return tried


def test_fixed_settings_are_never_searched() -> None:
    ledger = Ledger(50_000, 10)
    base = Candidate(32, num_workers=2, prefetch_factor=4, persistent_workers=True)
    space = replace(SPACE, prefetch_factors=(2, 4))
    ex = Explorer(space, base, ledger, allowed_fields={"num_workers": 2, "prefetch_factor": 4,
                                                       "worker_kind": "process"})
    tried = serve_alike(ex)
    assert all((c.num_workers, c.prefetch_factor, c.worker_kind) == (2, 4, "process") for c in tried)


def test_a_written_worker_count_still_has_the_torch_thread_counts_tried() -> None:
    # num_workers=2 written and persistence not: every other candidate the space allows keeps its
    # workers alive, so the thread counts are tried on the baseline's workers kept alive.
    base = Candidate(32, num_workers=2, prefetch_factor=2)
    space = replace(SPACE, torch_threads=(1, 2), persistent=True)
    ex = Explorer(space, base, Ledger(50_000, 10),
                  allowed_fields={"num_workers": 2, "worker_kind": "process"})
    tried = serve_alike(ex)
    others = [c for c in tried if c != base]
    assert others and all(c.torch_threads is not None and c.num_workers == 2 for c in others), tried
    assert all(space.check(c) is None for c in others)


def test_pin_memory_written_without_cuda_still_has_the_other_settings_searched() -> None:
    # Torch pins nothing without CUDA (it warns), so the search never proposes pinning there; but
    # pin_memory=True written is on every candidate, and was the reason each one was refused.
    base = Candidate(32, num_workers=2, prefetch_factor=2, pin_memory=True)
    fixed = {"num_workers": 2, "worker_kind": "process", "pin_memory": True}
    for pinned in (False, True):
        space = replace(SPACE, torch_threads=(1, 2), persistent=False, pretransforms=("none", "ram"),
                        pinned=pinned)
        ex = Explorer(space, base, Ledger(50_000, 10), allowed_fields=fixed, shared_cache=True, cpus=2)
        others = [c for c in serve_alike(ex) if c != base]
        if not pinned:
            assert others == [], others
            continue
        assert {c.pretransform for c in others} == {"none", "ram"}, others
        assert all(c.pin_memory and c.num_workers == 2 and space.check(c) is None for c in others)


def test_pin_memory_written_as_a_starting_point_without_cuda_leaves_the_cache_searched() -> None:
    # Under ``autotune run`` what is written is searched around, not fixed: candidates derived from a
    # pinned baseline carried pin_memory=True into a space without CUDA, which refused each one, the
    # cache included, so the loader kept the baseline with a cache filled and never measured.
    base = Candidate(32, num_workers=2, prefetch_factor=2, pin_memory=True)
    space = replace(SPACE, torch_threads=(1, 2), persistent=False, pretransforms=("none", "ram"))
    ex = Explorer(space, base, Ledger(50_000, 10), shared_cache=True, cpus=2)
    assert [c for c in ex.cache_candidates() if c.pretransform == "ram"], ex.cache_candidates()
    others = [c for c in serve_alike(ex) if c != base]
    assert {c.pretransform for c in others} == {"none", "ram"}, others
    assert all(not c.pin_memory and space.check(c) is None for c in others)


# -- the stretch's measured window (NOTE [ Bursts ] in epochs.py) ------------------------------------


def _timeline_of(arrivals: list[float], step_s: float, backlog: int) -> tuple[Timeline, float]:
    """A stretch's timeline from the times its batches became ready, consumed by a loop whose step
    takes ``step_s``: (the timeline, the time the loop asked for the next batch after the last)."""
    line = Timeline(backlog=backlog, window_s=0.0)
    asked = 0.0
    for ready in arrivals:
        got = max(asked, ready)
        line.item(asked, got, 64)
        line.steps.append(step_s)
        asked = got + step_s
    return line, asked


def test_a_window_over_bursts_measures_whole_worker_cycles() -> None:
    # Seven workers that started together deliver seven batches at once every half second: 14 batches
    # a second. A window that ends on a burst would count far more.
    workers, cycle_s = 7, 0.5
    arrivals = [0.6 + cycle_s * (i // workers) + 0.002 * (i % workers) for i in range(workers * 5)]
    line, end = _timeline_of(arrivals, step_s=0.005, backlog=2 * workers)
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None
    assert abs(m.samples_per_s / (64 * workers / cycle_s) - 1.0) < 0.05, m.samples_per_s


def test_a_loop_that_never_waits_is_measured_at_its_own_pace() -> None:
    # Batches always ready: the step sets the pace, and the window is the later half as before.
    line, end = _timeline_of([0.0] * 40, step_s=0.01, backlog=4)
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None
    assert abs(m.samples_per_s / (64 / 0.01) - 1.0) < 0.1, m.samples_per_s
    assert m.busy > 0.95


def test_a_short_window_counts_as_many_steps_as_batches() -> None:
    # Ten batches always ready, a 30 ms step: the later half holds four batches. Closed when the loop
    # asked for the next one, it counted a fifth step and read 20 % slow; closed at its last
    # arrival, it reads the step's own pace.
    line, _ = _timeline_of([0.0] * 10, step_s=0.03, backlog=0)
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None and m.batches == 4
    assert abs(m.samples_per_s / (64 / 0.03) - 1.0) < 0.02, m.samples_per_s


def test_a_counted_window_spans_every_measured_item() -> None:
    # NOTE [ Counted windows are whole ]: the user's 4 workers in a 12-item stretch of a filled
    # cache's check, beside a busy core. The queue read at each item swings by a batch or two as
    # batches are in flight (the readings are the ones that stretch recorded); the loop got a batch
    # every 100 ms. Over the later half (four items) the swing from 5 to 2 read a quarter of that.
    ready = [4, 4, 3, 4, 4, 3, 5, 4, 3, 3, 2]
    line = Timeline(backlog=8, workers=4, window_s=0.0)
    line.startup_s = 1.2
    for i, r in enumerate(ready):
        at = 1.2 + 0.1 * i
        line.item(at - 0.001, at, 32, r)
        line.steps.append(0.099)
    line.sampler_done = True
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None and abs(m.samples_per_s / 320 - 1.0) < 0.15, m.samples_per_s


def _epoch_of_bursts() -> tuple[Timeline, float]:
    """The first stretch of a 64-batch epoch served by 16 workers (NOTE [ A whole epoch ]): rounds of
    16 batches 0.15 s apart after a 0.6 s start-up, the last two rounds finished together (the workers
    had nothing left to make), a 2 ms step; the workers' queue is read at every item."""
    workers, step_s = 16, 0.002
    made = [0.6 + 0.15 * min(i // workers, 2) for i in range(64)]
    line = Timeline(backlog=2 * workers, workers=workers, window_s=0.3, settle_s=0.3,
                    settle_items=len(made) - 1 - 2 * workers)
    asked = 0.0
    for i, at in enumerate(made):
        got = max(asked, at)
        if i == 0:
            line.startup_s = got
        line.item(asked, got, 32, sum(m <= got for m in made) - (i + 1))
        line.steps.append(step_s)
        asked = got + step_s
    return line, asked


def test_a_stretch_that_served_its_whole_epoch_is_measured_whole() -> None:
    line, end = _epoch_of_bursts()

    def epoch_s(m: Measurement | None) -> float:
        assert m is not None
        return m.startup_s + 64 * 32 / m.samples_per_s

    # Measured whole, start-up plus the epoch at its rate is the epoch the loop had; so does its
    # window, which counts the queue over every item past the warm-up (NOTE [ Counted windows are
    # whole ]; over the later half it read an epoch a quarter shorter).
    assert abs(epoch_s(line.measurement(build_s=0.0, memory=lambda: 0, epoch=True)) / end - 1.0) < 0.03
    assert abs(epoch_s(line.measurement(build_s=0.0, memory=lambda: 0)) / end - 1.0) < 0.03


def test_a_first_stretch_faster_than_its_settling_time_leaves_room_for_a_window() -> None:
    # NOTE [ The first stretch settles in ]: 16 workers behind a 3 ms step keep 31 batches ready
    # while their sampler runs (a 256-item stretch); it stops 32 items before the end, and the queue
    # drains one a step (NOTE [ The drain at a stretch's end ]). The whole stretch takes 0.77 s,
    # less than the 0.75 s of settling and a window: the window must fit between the two.
    limit, workers, backlog = 256, 16, 32
    line = Timeline(backlog=backlog, workers=workers, window_s=0.75, settle_s=0.75,
                    settle_items=settling_bound(limit, workers, backlog))
    line.startup_s, t = 0.5, 0.5
    for i in range(limit):
        line.item(t, t + 0.00005, 32, min(31, limit - 1 - i))
        line.steps.append(0.003)
        t += 0.003
        line.sampler_done = i >= limit - backlog
    m = line.measurement(build_s=0.0, memory=lambda: 0, ended=True)
    assert m is not None and abs(m.samples_per_s / (32 / 0.003) - 1.0) < 0.05, m


@pytest.mark.parametrize("served", [80, 69], ids=["ended", "serving"])
def test_the_drain_at_a_stretch_s_end_is_left_out_of_its_window(served: int) -> None:
    # NOTE [ The drain at a stretch's end ]: 16 workers keep 31 batches ready behind a 30 ms step,
    # until the stretch's limit stops their sampler; its last 31 items empty the queue, one each.
    # Its window is measured as it ends, or while it serves (its time came only inside the tail).
    line = Timeline(backlog=32, workers=16, window_s=0.0)
    t = 0.0
    for i in range(served):
        line.item(t, t + 0.0001, 32, min(31, 79 - i))
        line.steps.append(0.03)
        t += 0.0301
    pace = 32 / 0.0301
    assert line.sustained_end() == 48
    drained = line.measurement(build_s=0.0, memory=lambda: 0)
    # Without it, the tail's batches count as made before the window.
    assert drained is not None and drained.samples_per_s < 0.75 * pace
    if served == 80:
        m = line.measurement(build_s=0.0, memory=lambda: 0, ended=True)
    else:
        line.sampler_done = True
        m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None and abs(m.samples_per_s / pace - 1.0) < 0.02, m.samples_per_s


def test_a_window_never_takes_in_the_drain_however_little_stands_before_it() -> None:
    # NOTE [ The drain at a stretch's end ]: the user's 16 workers behind a step-bound loop (the
    # readings torchvision's reference script recorded): the queue full for seven items at 250 ms a
    # step, then the sampler done and the queue drained one batch an item as the step, with no
    # workers beside it, took 150 ms. Taken in, the drain counted as made before the window: 29
    # samples/s where the loop got about 130 before it.
    line = Timeline(backlog=32, workers=16, window_s=0.0)
    t = 0.0
    for i in range(35):
        step = 0.25 if i < 7 else 0.15
        line.item(t, t + 0.001, 32, 31 if i <= 7 else 31 - (i - 7))
        line.steps.append(step)
        t += 0.001 + step
    line.sampler_done = True
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None and abs(m.samples_per_s / (32 / 0.251) - 1.0) < 0.1, m.samples_per_s
    assert line.window() == (2, 7)


def test_a_drained_window_does_not_end_in_the_drain_at_a_stretch_s_end() -> None:
    # NOTE [ The drain at a stretch's end ]: as above, and beside a busy core two fetches took 2 ms
    # with the queue full behind them (item 20) or nothing left to make (the last): no window
    # between them, which reads the tail's batches as made before it.
    line = Timeline(backlog=32, workers=16, window_s=0.0)
    t = 0.0
    for i in range(64):
        line.sampler_done = i >= 32  # its sampler gave its last item: the queue only drains from here
        line.item(t, t + (0.002 if i in (20, 63) else 0.0001), 32, min(31, 63 - i))
        line.steps.append(0.03)
        t += 0.0301
    assert line.drained() is None
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None and abs(m.samples_per_s / (32 / 0.0301) - 1.0) < 0.1, m.samples_per_s


def _warming_timeline(settle_s: float, settle_items: int | None = None) -> tuple[Timeline, float]:
    """A main-process loop (every fetch waits) whose first second runs at half its later pace: 25
    batches of 40 ms, then 50 batches of 20 ms."""
    line = Timeline(backlog=0, window_s=0.3, settle_s=settle_s, settle_items=settle_items)
    t = 0.0
    for i in range(75):
        load = 0.02 if i < 25 else 0.01
        line.item(t, t + load, 64)
        t += load
        line.steps.append(load)
        t += load
    return line, t


def test_the_first_stretch_is_measured_after_the_process_warmed_up() -> None:
    # NOTE [ The first stretch settles in ]: the reference rate is the later pace, 64 / 20 ms.
    later = 64 / 0.02
    line, end = _warming_timeline(settle_s=1.0)
    assert line.warmup == 26  # the first item served a second after the first
    m = line.measurement(build_s=0.0, memory=lambda: 0)
    assert m is not None
    assert abs(m.samples_per_s / later - 1.0) < 0.05, m.samples_per_s
    # Measured from its start, as every other stretch is, the window takes in the slow first second.
    plain, end = _warming_timeline(settle_s=0.0)
    slow = plain.measurement(build_s=0.0, memory=lambda: 0)
    assert slow is not None and slow.samples_per_s < 0.8 * later


def test_a_short_epoch_s_first_stretch_settles_in_within_its_items() -> None:
    line, _ = _warming_timeline(settle_s=60.0, settle_items=30)
    assert line.warmup == 30
    assert line.measured() == 75 - 1 - 30


def test_a_stretch_still_settling_in_has_measured_nothing() -> None:
    line = Timeline(backlog=0, window_s=0.0, settle_s=5.0)
    for i in range(20):
        line.item(0.1 * i, 0.1 * i + 0.01, 8)
    assert line.measured() == 0
    assert not line.complete(2.0)
    assert line.measurement(build_s=0.0, memory=lambda: 0) is None


def test_a_cache_in_shared_memory_is_also_read_by_a_worker_process_per_cpu() -> None:
    space = replace(SPACE, pretransforms=("none", "ram"), torch_threads=(None, 1, 2))

    def cached(cpus: int | None, shared_cache: bool, gathered_cache: bool = False) -> list[Candidate]:
        ex = Explorer(space, BASE, Ledger(50_000, 10), cpus=cpus, shared_cache=shared_cache,
                      gathered_cache=gathered_cache)
        return ex.cache_candidates()

    processes = [c for c in cached(cpus=2, shared_cache=True) if c.worker_kind == "process" and c.num_workers]
    assert [(c.num_workers, c.torch_threads, c.pretransform) for c in processes] == [(2, 1, "ram")]
    # In private memory a worker process would read a copy: only the main process and threads read it.
    assert all(c.num_workers == 0 or c.worker_kind == "thread" for c in cached(cpus=2, shared_cache=False))
    assert all(c.num_workers == 0 or c.worker_kind == "thread" for c in cached(cpus=None, shared_cache=True))
    # A batch that is one gather leaves a worker process only the copy back: the main process and a
    # thread read it.
    gathered = cached(cpus=2, shared_cache=True, gathered_cache=True)
    assert [(c.num_workers, c.worker_kind) for c in gathered] == [(0, "process"), (1, "thread")]


def test_a_filled_cache_is_tried_before_any_worker_count() -> None:
    # A ram cache filled by the first epoch's loading starts no workers and removes the per-sample
    # work: it is the first thing tried after the baseline, ahead of the estimated worker counts.
    space = replace(SPACE, pretransforms=("none", "ram"))
    ex, served = run(space, steady({"base": 100.0, "process": 300.0, "thread": 250.0}))
    first = served[1]
    assert served[0] == BASE and first.pretransform == "ram" and first.num_workers == 0, served
    # Still filling, it waits its turn: the worker counts come first.
    ex = Explorer(space, BASE, Ledger(50_000, 10), cache_ready=False)
    ex.next()
    ex.record(Outcome(BASE, "baseline", measurement(100.0, 0.75), samples=SAMPLES, wall_s=32.0))
    c, _ = ex.next() or (None, None)
    assert c is not None and c.pretransform == "none" and c.num_workers > 0, c


def test_a_cache_that_fills_while_the_finals_play_joins_them() -> None:
    # The cache fills while the worker counts are explored and their finals begin: once it is full,
    # the next stretch tries it, and the finals start again with it among them; it wins there, in the
    # same search, not in a check after the search settled on a worker count.
    space = replace(SPACE, pretransforms=("none", "ram"))
    ex = Explorer(space, BASE, Ledger(50_000, 10), cache_ready=False)
    served: list[tuple[Candidate, str]] = []
    while (nxt := ex.next()) is not None and len(served) < 40:
        c, phase = nxt
        served.append((c, phase))
        sps = 1000.0 if c.pretransform == "ram" else 100.0 if c == BASE else 150.0
        ex.record(Outcome(c, phase, measurement(sps, 0.75 if c == BASE else 0.1), samples=SAMPLES,
                          wall_s=SAMPLES / sps))
        if phase == "final":
            ex.cache_ready = True  # filled by the stretches so far
    first_final = next(i for i, (_, p) in enumerate(served) if p == "final")
    assert all(c.pretransform == "none" for c, _ in served[:first_final + 1])
    joined = served[first_final + 1]
    assert joined[0].pretransform == "ram" and joined[1] == "online", [(c.label(), p) for c, p in served]
    assert any(c.pretransform == "ram" and p == "final" for c, p in served[first_final + 1:])
    assert ex.decision is not None and ex.decision.chosen.candidate.pretransform == "ram"


def test_a_candidate_that_hardly_waits_ends_the_search_for_loaders() -> None:
    # The filled cache read by a thread worker waits 2 % of the time: no worker count can win more
    # than that, so none is tried; the finals take the cache against the baseline. The same holds for
    # a cache 100x faster that waits 90 % of its time in a loop that barely steps: its wait is under
    # 1 % of the baseline's time per sample. With the cache 3x faster and waiting 30 %, the worker
    # counts are still explored.
    space = replace(SPACE, pretransforms=("none", "ram"))

    def serve(cache_sps: float, cache_wait: float) -> list[Candidate]:
        ex = Explorer(space, BASE, Ledger(50_000, 10))
        served: list[Candidate] = []
        while (nxt := ex.next()) is not None and len(served) < 40:
            c, phase = nxt
            served.append(c)
            sps, wait = (100.0, 0.75) if c == BASE else (cache_sps, cache_wait) if c.pretransform == "ram" \
                else (150.0, 0.5)
            ex.record(Outcome(c, phase, measurement(sps, wait), samples=SAMPLES, wall_s=SAMPLES / sps))
        assert ex.decision is not None
        return served

    for quick in (serve(300.0, 0.02), serve(10_000.0, 0.9)):
        assert all(c.pretransform == "ram" or c == BASE or c.torch_threads is not None for c in quick), \
            [c.label() for c in quick]
    slow = serve(300.0, 0.3)
    assert any(c.pretransform == "none" and c.num_workers > 0 for c in slow), [c.label() for c in slow]


def test_a_cache_sure_of_its_win_ends_its_check_early() -> None:
    # A filled cache's check plays RECHECK_ROUNDS rounds; a cache 3x faster in windows within 4 %
    # wins at 99.5 % after the second (the baseline's cold first window no longer counts), and the
    # third is not played (NOTE [ Decisions ] 5 in decide.py). Within 40 % it plays all three.
    cached = replace(BASE, pretransform="ram")

    def check(wobble: float) -> list[Candidate]:
        ledger = Ledger(50_000, 10)
        ledger.record(BASE, "baseline", "complete", m=measurement(60.0, 0.75))  # cold, while filling
        ex = Explorer.challenge(SPACE, BASE, [cached], ledger)
        rates = {BASE: itertools.cycle([100.0, 100.0 * (1 - wobble), 100.0 * (1 + wobble)]),
                 cached: itertools.cycle([300.0, 300.0 * (1 + wobble), 300.0 * (1 - wobble)])}
        served: list[Candidate] = []
        while (nxt := ex.next()) is not None and len(served) < 20:
            c, phase = nxt
            served.append(c)
            sps = next(rates[c])
            ex.record(Outcome(c, phase, measurement(sps, 0.75 if c == BASE else 0.05), samples=SAMPLES,
                              wall_s=SAMPLES / sps))
        assert ex.decision is not None and ex.decision.chosen.candidate == cached, ex.decision.reason
        return served

    assert len(check(0.04)) == 2 * 2
    assert len(check(0.4)) == 2 * RECHECK_ROUNDS
