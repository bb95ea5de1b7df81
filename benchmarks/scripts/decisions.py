"""How well the drop-in decides: ``python benchmarks/scripts/decisions.py`` (``--quick`` for a smoke run).

Writes DECISIONS.md and decisions.json to ``benchmarks/results/decisions/`` (``--out`` elsewhere;
``--quick`` writes to a temporary folder unless ``--out`` is given).

# NOTE [ Decision power ]
# One question: run as a user runs it, does the drop-in find the win that is there, leave alone what
# has none, cost nothing where it loses, and say what its loop then gets? Each run is a fresh process
# with an empty profile folder, and in it, on one workload and with the settings a script writes:
# 1. the user's loop with torch's DataLoader and those settings, EPOCHS epochs (the user's time);
# 2. the same loop with the drop-in as ``autotune run`` builds it (what is written is its baseline and
#    is searched around), EPOCHS epochs (the run's time), recording the epoch it settled in and its
#    decision: a confirmed win (another configuration, with its interval above 1), kept, undecided,
#    or unconfirmed (another configuration, where the baseline could not be measured at all);
# 3. the oracle: every configuration of ORACLE_WORKERS with torch's DataLoader, two epochs each (the
#    second timed), and the user's settings likewise: the best fixed configuration's gain;
# 4. a plain loop over ``result.make_loader`` beside one with the user's settings: an epoch of each
#    to warm up (the returned loader's cache fills), then PLAIN_ROUNDS rounds of an epoch of each,
#    which goes first alternating, so that each order is taken as often; the median of the rounds'
#    ratios is what the user's own loop gets from the returned choice, to hold the tuner's reported
#    speed-up against (which is, as this loop's, with the cache built: NOTE [ Decisions ] 6 in
#    autotune/decide.py). The best fixed gain is the larger of the oracle's and this (the worker grid
#    holds no cache). The record keeps the report's interval and steady-state ratio beside it, and
#    the two warm-up epochs;
# 5. the same figure by four estimators, from the measurements of the last search: the pairs' plain
#    mean, their mean weighted by their batches' variances (NOTE [ Decisions ] 3 in
#    autotune/decide.py uses the one or the other, as the pairs spread), the ratio of the geometric
#    means of all measurements (the verdict where the pairs are too few), and the ratio of the
#    median scores, each with the cache built; to hold each against the plain loop. The record keeps
#    that search's trials too (``search_records``), so that an estimator not yet written can be read
#    later on the same runs, against the same plain loop;
# 6. in the plain loop's rounds, each loader's short-window lean: the median rate of its windows of
#    SHORT_WINDOW batches over its epoch's rate (``window_lean``), the median over the rounds. A
#    window of a few dozen milliseconds seldom holds one of a loop's rare stalls that the epoch pays
#    for, so it reads the rate above the epoch's where the stalls are rare, and below it where batches
#    come in bursts; a speed-up read from such windows leans by the ratio of the two leans.
# The workloads: storage latency (1 ms a read), CPU-bound reads (0.6 ms), a step-bound loop (a 30 ms
# step, nothing to win), an ImageFolder of PNG files with a fixed pipeline and a random flip, and rows
# already in memory (a TensorDataset); each with nothing written and with 2, 4 and 16 workers written.
# Run quiet and beside one busy core (NOTE [ Loaded mode ] in _common/hog.py), REPEATS times each. Figures
# are per run; the summary gives counts and medians, never a single time.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.pretransform import node  # noqa: E402
from benchmarks._common.harness import (  # noqa: E402
    describe_machine,
    fill_in,
    load_average,
    out_folder,
    quick_notice,
)
from benchmarks._common.hog import cpu_hog  # noqa: E402
from benchmarks.scripts.training import train  # noqa: E402

EPOCHS = 4
"""Epochs of the user's loop and of the drop-in's: a short run, where deciding early matters."""

ORACLE_WORKERS = (0, 1, 2, 3, 4)
"""Worker counts the oracle measures (on 2 CPUs, more only compete)."""

SAMPLES = 2048
"""Samples per epoch; batches of BATCH."""

BATCH = 32

WIN = 1.3
"""An oracle gain at least this large is a win that should be found (the issue's bar)."""

NOTHING = 1.05
"""An oracle gain under this is nothing to win: nothing should change."""

WORKLOADS = ("latency", "cpu", "step-bound", "folder", "tabular")
WRITTEN: dict[str, dict[str, Any]] = {
    "nothing": {},
    "w2": {"num_workers": 2, "pin_memory": True},
    "w4": {"num_workers": 4, "pin_memory": True},
    "w16": {"num_workers": 16},
}

SHORT_WINDOW = 16
"""Batches of a short window (NOTE [ Decision power ] 6): as many as a fast candidate's measured window
holds, 15 in 35 ms for the cached loader of the ``folder`` workload."""

PLAIN_ROUNDS = 6
"""Rounds of the plain-loop check (NOTE [ Decision power ] 4): one epoch each is a single pair of
numbers on a shared machine. Beside a busy core one round of three read 17.5x where the other two
read 11.7x and 10.4x, so three rounds leave the median to one pair; six, half of them in each order,
do not."""

FOLDER_IMAGES = 4096
"""PNG files of the ``folder`` workload (64 x 64, written by the child into a temporary folder): an
epoch of about a second, as the other workloads'."""

TABULAR_ROWS = 16384
"""Rows of the ``tabular`` workload: an epoch of about a second, as the other workloads'."""


@dataclass(frozen=True)
class Sizes:
    """How much one run measures: the grid's sizes, or ``QUICK``'s for a smoke run."""

    folder_images: int = FOLDER_IMAGES
    oracle_workers: tuple[int, ...] = ORACLE_WORKERS
    plain_rounds: int = PLAIN_ROUNDS


QUICK = Sizes(folder_images=512, oracle_workers=(0, 2), plain_rounds=2)
"""``--quick``: every part of a run on an eighth of the images, its figures meaningless (a smoke run
that a test waits for)."""


# -- the child: one run ---------------------------------------------------------------------------

def _make(workload: str, scratch: str, sizes: Sizes = Sizes()) -> tuple[Any, Any]:
    """(dataset, step) of a workload, made in memory (``folder``: files written under ``scratch``)."""
    import torch
    import torchvision.transforms as T
    from torch.utils.data import Dataset, TensorDataset
    from torchvision.datasets import ImageFolder

    from autotune.workloads import write_image_folder

    class Latency(Dataset[Any]):
        """Each read waits 1 ms (storage), as remote or network file systems do."""

        def __len__(self) -> int:
            return SAMPLES

        def __getitem__(self, i: int) -> Any:
            time.sleep(0.001)
            return torch.full((3, 16, 16), float(i)), i % 10

    class Cpu(Latency):
        """Each read computes for 0.6 ms (decoding, augmenting)."""

        def __getitem__(self, i: int) -> Any:
            end = time.perf_counter() + 0.0006
            while time.perf_counter() < end:
                pass
            return torch.full((3, 16, 16), float(i)), i % 10

    class Cheap(Latency):
        def __getitem__(self, i: int) -> Any:
            return torch.full((3, 16, 16), float(i)), i % 10

    def light(batch: Any) -> None:
        time.sleep(0.002)

    def heavy(batch: Any) -> None:
        time.sleep(0.03)

    if workload == "folder":  # PNGs decoded per sample, a fixed pipeline and a random flip
        root = write_image_folder(Path(scratch) / "images", n=sizes.folder_images, size=64, fmt="PNG")
        transform = T.Compose([T.ToTensor(), T.Normalize((0.5,) * 3, (0.25,) * 3), T.RandomHorizontalFlip()])
        return ImageFolder(str(root), transform=transform), light
    if workload == "tabular":  # rows already in memory: little to win but the collation
        gen = torch.Generator().manual_seed(0)
        rows = torch.randn((TABULAR_ROWS, 64), generator=gen)
        return TensorDataset(rows, torch.arange(TABULAR_ROWS) % 10), light
    return {"latency": (Latency(), light), "cpu": (Cpu(), light), "step-bound": (Cheap(), heavy)}[workload]


def plain_rounds(users: Any, made: Any, step: Any, rounds: int = PLAIN_ROUNDS
                 ) -> tuple[list[float], list[float], dict[str, float | None]]:
    """The user's epoch over the returned choice's, per round; the two warm-up epochs (the user's,
    the returned choice's) (NOTE [ Decision power ] 4); each loader's short-window lean, the median
    over the rounds (NOTE [ Decision power ] 6)."""
    warm = train(users, step, 1) + train(made, step, 1)
    ratios = []
    leans: dict[str, list[float]] = {"users": [], "made": []}

    def epoch(name: str, loader: Any) -> float:
        arrivals: list[float] = []
        (seconds,) = train(loader, step, 1, arrivals=arrivals)
        lean = window_lean(arrivals, SHORT_WINDOW)
        if lean is not None:
            leans[name].append(lean)
        return seconds

    for r in range(rounds):
        if r % 2 == 0:
            theirs = epoch("users", users)
            ours = epoch("made", made)
        else:
            ours = epoch("made", made)
            theirs = epoch("users", users)
        ratios.append(theirs / ours)
    return ratios, warm, {k: statistics.median(v) if v else None for k, v in leans.items()}


def window_lean(arrivals: list[float], width: int) -> float | None:
    """The median rate of an epoch's windows of ``width`` batches over the epoch's own rate, both
    from its second batch on (the first carries the start-up); ``None``: too short an epoch."""
    times = arrivals[1:]
    if len(times) < 2 * width + 1 or times[-1] <= times[0]:
        return None
    whole = (len(times) - 1) / (times[-1] - times[0])
    rates = [width / (times[i + width] - times[i]) for i in range(len(times) - width)
             if times[i + width] > times[i]]
    return statistics.median(rates) / whole if rates else None


def estimators(result: Any, last: list[Any], dataset_len: int, stop_per_worker_s: float
               ) -> dict[str, Any] | None:
    """The reported speed-up (cache built) by four estimators from the measurements of the last search
    (NOTE [ Decision power ] 5): the pairs' plain mean, their mean weighted by their batches'
    variances, the ratio of the geometric means of all measurements (the verdict where pairs are too
    few) and that of the median scores; with the pairs' count, whether their spread exceeded what
    their batches say, and the verdict of that search again (``this_search``: the reported figure,
    where the report came from it). ``last`` is the last search's trials and ``stop_per_worker_s``
    the stop cost its scores were made with. ``None`` where the baseline was kept or never measured."""
    from autotune.decide import Ledger, pair_means

    trials = list(result.trials)
    base = next((t.candidate for t in trials if t.phase == "baseline"), None)
    chosen = result.candidate
    if base is None or chosen == base or result.speedup is None:
        return None
    ledger = Ledger.replayed(last, dataset_len, EPOCHS, stop_per_worker_s)
    diffs, variances = ledger.paired_logs(chosen, base, built=False)
    weighted = plain = None
    spread_wins = False
    if len(diffs) > 1:
        (weighted, within), (plain, between) = pair_means(diffs, variances)
        spread_wins = between > within
    elif diffs:
        weighted = plain = diffs[0]

    def median_score(recs: Any) -> float:
        return statistics.median(math.exp(x) for x in ledger.log_scores(recs, False))

    base_recs = ledger.baseline_records(base)
    mine = ledger.by_candidate.get(chosen, ())
    if not mine or not base_recs:
        return None
    means = statistics.fmean(ledger.log_scores(mine, False)) - statistics.fmean(
        ledger.log_scores(base_recs, False))
    again = ledger.verdict(chosen, base, built=False)
    return {
        "pairs": len(diffs), "spread_exceeds_batches": spread_wins,
        "paired_mean": math.exp(plain) if plain is not None else None,
        "paired_weighted": math.exp(weighted) if weighted is not None else None,
        "geometric_means": math.exp(means),
        "median_scores": median_score(mine) / median_score(base_recs),
        "this_search": again.ratio if again is not None else None,
    }


def last_search(trials: list[Any]) -> list[Any]:
    """The trials of the last search a result holds (each search numbers its trials from 0)."""
    starts = [i for i, t in enumerate(trials) if t.number == 0]
    return trials[starts[-1]:] if starts else trials


def search_records(last: list[Any], dataset_len: int, stop_per_worker_s: float) -> dict[str, Any]:
    """The last search's trials, with the stop cost its scores were made with: what replays its ledger
    (``Ledger.replayed``), so that another estimator can be read on the same runs (NOTE [ Decision
    power ] 5)."""
    return {"dataset_len": dataset_len, "stop_per_worker_s": stop_per_worker_s,
            "trials": [t.to_dict() for t in last]}


def _stop_per_worker(records: list[Any], dataset_len: int) -> float:
    """The seconds one worker took to stop, as the records' scores were made with (NOTE [ Score ] in
    autotune/decide.py), solved from a record of process workers; 0 where there is none."""
    for r in records:
        m, c = r.measurement, r.candidate
        if m is None or not r.score or not m.startup_seen or c.num_workers == 0 or c.worker_kind != "process":
            continue
        startups = 1 if c.persistent_workers else EPOCHS
        run_s = EPOCHS * dataset_len / r.score
        fixed = run_s - EPOCHS * dataset_len / m.samples_per_s - m.build_s
        return max(0.0, (fixed / startups - m.startup_s) / c.num_workers)
    return 0.0


def child(workload: str, written: str, sizes: Sizes = Sizes()) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="autotune-decisions-data-") as scratch:
        return _child(workload, written, scratch, sizes)


def _child(workload: str, written: str, scratch: str, sizes: Sizes) -> dict[str, Any]:
    import torch.utils.data as tud

    import autotune
    from autotune.loader import DataLoader as DropIn

    class RunLoader(DropIn[Any]):
        explicit_settings_are_fixed = False  # as ``autotune run`` builds it

    ds, step = _make(workload, scratch, sizes)
    kw: dict[str, Any] = {"batch_size": BATCH, "shuffle": True, **WRITTEN[written]}
    user = train(tud.DataLoader(ds, **kw), step, EPOCHS)
    loader = RunLoader(ds, epochs=EPOCHS, **kw)
    tuned, settled_in = [], None
    for epoch in range(EPOCHS):
        tuned += train(loader, step, 1)
        if settled_in is None and loader.settled:
            settled_in = epoch + 1
    result = loader.tuning
    loader.close()
    oracle = {}
    for w in sizes.oracle_workers:
        oracle[f"w={w}"] = train(tud.DataLoader(ds, batch_size=BATCH, shuffle=True, num_workers=w),
                                   step, 2)[1]
    users_second = train(tud.DataLoader(ds, **kw), step, 2)[1]
    check = warm = None
    lean: dict[str, float | None] = {}
    if result is not None:
        made = result.make_loader(ds, shuffle=True)
        check, warm, lean = plain_rounds(tud.DataLoader(ds, **kw), made, step, sizes.plain_rounds)
        made.close()
    best = min(oracle.values())
    last = last_search(list(result.trials)) if result is not None else []
    stop = _stop_per_worker(last, len(ds))
    decision = "none"
    if result is not None:
        decision = ("undecided" if result.undecided else "kept" if result.kept_baseline
                    # another configuration chosen with no baseline measured to confirm it against
                    else "unconfirmed" if result.speedup is None else "win")
    return {
        "workload": workload, "written": written, "user_s": user, "tuned_s": tuned,
        "run_ratio": sum(tuned) / sum(user), "settled_in_epoch": settled_in,
        "oracle_s": oracle, "users_epoch_s": users_second,
        "oracle_gain": users_second / best,
        "decision": decision,
        "chosen": result.candidate.label() if result is not None else None,
        "reported_speedup": result.speedup if result is not None else None,
        "reported_low": result.speedup_low if result is not None else None,
        "reported_high": result.speedup_high if result is not None else None,
        "reported_throughput": result.throughput_speedup if result is not None else None,
        "estimators": estimators(result, last, len(ds), stop) if result is not None else None,
        "search": search_records(last, len(ds), stop) if last else None,
        "plain_loop_speedup": statistics.median(check) if check else None,
        "plain_loop_rounds": check,
        "plain_loop_warmup_s": warm,
        "plain_loop_window_lean": lean,
        "autotune": autotune.__version__,
    }


# -- the parent: the grid, quiet and loaded -------------------------------------------------------

def _one(workload: str, written: str, quick: bool = False) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="autotune-decisions-") as cache:
        env = {**os.environ, "AUTOTUNE_CACHE_DIR": cache, "PYTHONWARNINGS": "ignore"}
        argv = [sys.executable, __file__, "--child", workload, written, *(["--quick"] if quick else [])]
        proc = subprocess.run(argv, env=env,
                              capture_output=True, text=True, timeout=900)
        node.clear(cache)  # the run's node caches in /dev/shm go with its profile folder
    if proc.returncode != 0:
        return {"workload": workload, "written": written, "error": proc.stderr[-2000:]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


CHANGED = ("win", "unconfirmed")
"""Decisions that replace the user's settings."""


def best_gain(r: dict[str, Any]) -> float:
    """The best fixed configuration measured in the run: the worker grid's, or the returned choice's
    in a plain loop where that was better (a cache, which the grid does not hold)."""
    return max(r["oracle_gain"], r["plain_loop_speedup"] or 0.0)


def _counts(ok: list[dict[str, Any]]) -> dict[str, str]:
    """Wins confirmed where the best fixed gain is at least WIN, changes where it is under NOTHING."""
    win_cases = [r for r in ok if best_gain(r) >= WIN]
    none_cases = [r for r in ok if best_gain(r) < NOTHING]
    return {
        "wins_confirmed": f"{sum(r['decision'] == 'win' for r in win_cases)} of {len(win_cases)}",
        "changed_with_nothing_to_win": (f"{sum(r['decision'] in CHANGED for r in none_cases)}"
                                        f" of {len(none_cases)}"),
    }


def summarize(runs: list[dict[str, Any]]) -> dict[str, Any]:
    ok = [r for r in runs if "error" not in r]
    agree = [r["reported_speedup"] / r["plain_loop_speedup"] for r in ok
             if r["decision"] == "win" and r["reported_speedup"] and r["plain_loop_speedup"]]
    return {
        "runs": len(runs), "failed": len(runs) - len(ok), **_counts(ok),
        "median_run_ratio": statistics.median(r["run_ratio"] for r in ok) if ok else None,
        "worst_run_ratio": max((r["run_ratio"] for r in ok), default=None),
        "undecided": sum(r["decision"] == "undecided" for r in ok),
        "reported_over_plain_loop": ([round(min(agree), 2), round(statistics.median(agree), 2),
                                      round(max(agree), 2)] if agree else None),
        "within_15_percent_by_estimator": _by_estimator(ok),
        "short_window_lean": _leans(ok),
    }


def _leans(ok: list[dict[str, Any]]) -> dict[str, float] | None:
    """Over the wins, the median short-window lean of the returned loader, of the user's, and of the
    first over the second: how far a speed-up read from short windows leans (NOTE [ Decision power ]
    6). ``None`` where no run recorded them."""
    made, users, both = [], [], []
    for r in ok:
        lean = r.get("plain_loop_window_lean") or {}
        m, u = lean.get("made"), lean.get("users")
        if r["decision"] != "win" or m is None or u is None:
            continue
        made.append(m)
        users.append(u)
        both.append(m / u)
    if not both:
        return None
    return {"returned": round(statistics.median(made), 3), "users": round(statistics.median(users), 3),
            "speed_up": round(statistics.median(both), 3)}


ESTIMATORS = ("paired_mean", "paired_weighted", "geometric_means", "median_scores")
"""The estimators a run records beside the reported figure (NOTE [ Decision power ] 5)."""


def _by_estimator(ok: list[dict[str, Any]]) -> dict[str, str]:
    """Per estimator, of the wins where it has a figure: how many lie within 15 % of the plain loop."""
    out = {}
    for name in ("reported", *ESTIMATORS):
        ratios = []
        for r in ok:
            est = r.get("estimators") or {}
            x = r["reported_speedup"] if name == "reported" else est.get(name)
            if r["decision"] == "win" and est and x and r["plain_loop_speedup"]:
                ratios.append(x / r["plain_loop_speedup"])
        out[name] = f"{sum(abs(q - 1) <= 0.15 for q in ratios)} of {len(ratios)}"
    return out


def per_case(runs: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """The repeats of each (workload, written) case together: what the done-when counts per case."""
    cases: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for r in runs:
        cases.setdefault((r["workload"], r["written"]), []).append(r)
    rows = []
    for (workload, written), rs in cases.items():
        ok = [r for r in rs if "error" not in r]
        gains = [best_gain(r) for r in ok]
        told = sorted({r["decision"] for r in ok})
        rows.append({
            "workload": workload, "written": written, "runs": len(rs), "failed": len(rs) - len(ok),
            "best_gain_median": statistics.median(gains) if gains else None,
            "decisions": {d: sum(r["decision"] == d for r in ok) for d in told}, **_counts(ok),
            "run_ratio_median": statistics.median(r["run_ratio"] for r in ok) if ok else None,
            "run_ratio_worst": max((r["run_ratio"] for r in ok), default=None),
        })
    return rows


def combine(paths: list[Path]) -> dict[str, Any]:
    """One page over several pages this script wrote (``--combine``): every run of each mode, each
    marked with its page's commit, summarized together and per case."""
    pages = []
    for p in paths:
        path = p / "decisions.json" if p.is_dir() else p
        if not path.is_file():
            raise SystemExit(f"--combine {p}: no decisions.json there; pass the folders this script"
                             " wrote (or their decisions.json)")
        pages.append(json.loads(path.read_text()))
    modes: dict[str, list[dict[str, Any]]] = {}
    for page in pages:
        for mode, block in page["modes"].items():
            modes.setdefault(mode, []).extend({**r, "commit": page.get("commit", "unknown")}
                                              for r in block["runs"])
    commits = list(dict.fromkeys(page.get("commit", "unknown") for page in pages))
    return {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": pages[-1]["machine"],
            "commit": ", ".join(commits), "pages": [str(p) for p in paths],
            "modes": {m: {"runs": runs, "summary": summarize(runs), "cases": per_case(runs)}
                      for m, runs in modes.items()}}


def write_markdown(data: dict[str, Any], path: Path) -> None:
    lines = ["# How well the drop-in decides", "",
             f"Written by `benchmarks/scripts/decisions.py` ({data['when']},"
             f" commit {data.get('commit', 'unknown')}) on {data['machine']}.",
             "See NOTE [ Decision power ] in the script for what each figure is.", "",
             *quick_notice(bool(data.get("quick")))]
    for mode, block in data["modes"].items():
        s = block["summary"]
        lines += [f"## {mode}", "",
                  f"- runs: {s['runs']} ({s['failed']} failed)",
                  f"- best fixed gain >= {WIN}x: a win confirmed in {s['wins_confirmed']} runs",
                  f"- best fixed gain < {NOTHING}x: changed in {s['changed_with_nothing_to_win']} runs",
                  f"- the run's time against the user's settings: median {s['median_run_ratio']:.2f}x,"
                  f" worst {s['worst_run_ratio']:.2f}x" if s["median_run_ratio"] is not None else "",
                  f"- undecided at the end: {s['undecided']}",
                  f"- reported speed-up over a plain loop's, where it won (min, median, max):"
                  f" {s['reported_over_plain_loop']}"]
        if s.get("short_window_lean"):
            lean = s["short_window_lean"]
            lines.append(f"- windows of {SHORT_WINDOW} batches in the plain loop, median rate over the"
                         f" epoch's (NOTE [ Decision power ] 6): the returned loader"
                         f" {lean['returned']:.3f}, the user's {lean['users']:.3f}, a speed-up read from"
                         f" them {lean['speed_up']:.3f}")
        if s.get("within_15_percent_by_estimator"):
            lines.append("- within 15 % of the plain loop, by estimator: " + ", ".join(
                f"{k} {v}" for k, v in s["within_15_percent_by_estimator"].items()))
        lines.append("")
        if "cases" in block:
            lines += ["| workload | written | runs | best fixed gain, median | decisions |"
                      f" gain >= {WIN}x: win confirmed | gain < {NOTHING}x: changed |"
                      " run time vs user's, median | worst |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for c in block["cases"]:
                gain = f"{c['best_gain_median']:.2f}x" if c["best_gain_median"] is not None else "-"
                median = f"{c['run_ratio_median']:.2f}x" if c["run_ratio_median"] is not None else "-"
                worst = f"{c['run_ratio_worst']:.2f}x" if c["run_ratio_worst"] is not None else "-"
                told = ", ".join(f"{d} {n}" for d, n in c["decisions"].items())
                lines.append(f"| {c['workload']} | {c['written']} | {c['runs']} | {gain} | {told} |"
                             f" {c['wins_confirmed']} | {c['changed_with_nothing_to_win']} | {median} |"
                             f" {worst} |")
            lines.append("")
        lines += ["| workload | written | oracle gain | decision | chosen | settled in epoch | run time"
                  " vs user's | reported | plain loop | commit |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in block["runs"]:
            if "error" in r:
                lines.append(f"| {r['workload']} | {r['written']} | failed | | | | | | | |")
                continue
            rep = f"{r['reported_speedup']:.2f}x" if r["reported_speedup"] else "-"
            plain = f"{r['plain_loop_speedup']:.2f}x" if r["plain_loop_speedup"] else "-"
            lines.append(f"| {r['workload']} | {r['written']} | {r['oracle_gain']:.2f}x | {r['decision']} |"
                         f" {r['chosen']} | {r['settled_in_epoch']} | {r['run_ratio']:.2f}x | {rep} |"
                         f" {plain} | {r.get('commit', data.get('commit', ''))} |")
        lines.append("")
    lines += ["`oracle gain`: the best worker count's second epoch against the user's; `reported`: the",
              "tuner's speed-up (a run of its epochs, start-up included, a cache already built); `plain",
              "loop`: the user's epoch over the returned choice's in plain loops side by side, the median",
              f"of {PLAIN_ROUNDS} rounds after a warm-up epoch."]
    path.write_text("\n".join(lines) + "\n")


def _save(data: dict[str, Any], folder: Path) -> None:
    (folder / "decisions.json").write_text(json.dumps(data, indent=1))
    write_markdown(data, folder / "DECISIONS.md")


def _chosen(parser: argparse.ArgumentParser, flag: str, value: str | None, known: tuple[str, ...]
            ) -> tuple[str, ...]:
    if value is None:
        return known
    names = tuple(v.strip() for v in value.split(",") if v.strip())
    unknown = [n for n in names if n not in known]
    if unknown or not names:
        parser.error(f"{flag} {value!r}: {', '.join(unknown) or 'nothing'} is not one of"
                     f" {', '.join(known)}; pass a comma-separated list of those")
    return names


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--child", nargs=2, metavar=("WORKLOAD", "WRITTEN"), help=argparse.SUPPRESS)
    parser.add_argument("--quick", action="store_true",
                        help="one repeat of a reduced grid, to a temporary folder")
    parser.add_argument("--repeats", type=int, default=None)
    parser.add_argument("--modes", default=None, help="comma-separated: quiet,loaded")
    parser.add_argument("--workloads", default=None,
                        help=f"comma-separated, of {', '.join(WORKLOADS)} (default: all)")
    parser.add_argument("--written", default=None,
                        help=f"comma-separated, of {', '.join(WRITTEN)} (default: all)")
    parser.add_argument("--combine", type=Path, nargs="+", default=None, metavar="FOLDER",
                        help="measure nothing: one page over the pages of earlier runs (with --out)")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for DECISIONS.md and decisions.json (default:"
                        " benchmarks/results/decisions/; with --quick, a new temporary folder)")
    args = parser.parse_args(argv)
    if args.child:
        print(json.dumps(child(*args.child, QUICK if args.quick else Sizes())))
        return 0
    if args.combine:
        if args.out is None:
            parser.error("--combine needs --out: the folder for the page over the runs")
        args.out.mkdir(parents=True, exist_ok=True)
        _save(combine(args.combine), args.out)
        print(f"wrote {args.out / 'DECISIONS.md'}")
        return 0
    fill_in(args, {"repeats": 1, "modes": "quiet"}, {"repeats": 3, "modes": "quiet,loaded"})
    workloads = _chosen(parser, "--workloads", args.workloads, WORKLOADS)
    written = _chosen(parser, "--written", args.written, tuple(WRITTEN))
    folder = out_folder(args, __file__, "autotune-decisions-")  # after the names: a refusal leaves none
    folder.mkdir(parents=True, exist_ok=True)
    grid = ([(w, s) for w in workloads for s in written] if not args.quick
            else [(workloads[0] if args.workloads else "latency", written[0] if args.written else "nothing")])
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                            cwd=Path(__file__).resolve().parent).stdout.strip() or "unknown"
    data: dict[str, Any] = {"when": time.strftime("%Y-%m-%d %H:%M"), "machine": describe_machine(),
                            "commit": commit, **({"quick": True} if args.quick else {}), "modes": {}}
    for mode in args.modes.split(","):
        runs: list[dict[str, Any]] = []
        with cpu_hog(enabled=mode == "loaded") as hog:
            for _ in range(args.repeats):
                for workload, written in grid:
                    runs.append(_one(workload, written, args.quick))
                    print(mode, workload, written, runs[-1].get("decision", "error"), flush=True)
                    # Written after every run: a run stopped part-way leaves what it measured.
                    data["modes"][mode] = {"runs": runs, "summary": summarize(runs), "hog": hog,
                                           "load_average": load_average()}
                    _save(data, folder)
        _save(data, folder)  # with what the hog did, filled in when it stopped
    print(f"wrote {folder / 'DECISIONS.md'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
