"""Repeatability: the same workload tuned several times from scratch; how often the pick differs, and
whether the picks' throughputs lie within the noise of each other.

    python benchmarks/scripts/repeat.py [--tunings 5] [--rounds 5] [--min-epoch-s 20] [--workload NAME ...]
                                        [--driver drop-in|tune_loader ...] [--quick] [--out DIR]

Writes REPEAT.md and repeat.json to ``benchmarks/results/repeat/`` (``--out`` elsewhere; ``--quick``
writes to a temporary folder unless ``--out`` is given).

# NOTE [ Repeatability protocol ]
# 1. Per workload and driver, TUNINGS tunings one after the other, each with a new, empty profile
#    folder: the drop-in, autotune.DataLoader(dataset, batch_size, shuffle=True) in the user's loop
#    (the workload's step on every batch) until it has settled, MAX_EPOCHS epochs at most; and
#    tune_loader(dataset, step, batch_size) with its default budget. The pick is the configuration
#    each chose (every field: workers and their kind, prefetch, persistence, cache, torch threads).
# 2. How often the pick differs: the distinct picks, and how many tunings picked something other than
#    the most common pick.
# 3. Whether the picks are within the noise of each other: every distinct pick and PyTorch's defaults
#    measured again side by side with autotune.measure, ROUNDS interleaved rounds (the order rotates),
#    steady-state samples/s per round. Each pick against the fastest pick by median: the paired ratio
#    and its interval (NOTE [ Paired ratio interval ] in _common/stats.py); within the noise when the interval
#    reaches 1 (the two cannot be told apart at that confidence). The spread of each configuration's
#    own repeated measurements is the noise it is judged against.
# 4. Workloads are sized as in training.py (an epoch at the defaults takes about --min-epoch-s), on
#    the machine as it is; its load is recorded with every tuning.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from autotune import DataLoader, tune_loader  # noqa: E402
from autotune import pretransform as pt  # noqa: E402
from autotune.exceptions import CandidateError, TuningFailed  # noqa: E402
from autotune.measure import MeasureLimits, measure  # noqa: E402
from autotune.space import Candidate  # noqa: E402
from benchmarks._common import harness  # noqa: E402
from benchmarks._common.stats import paired_interval, rotated, spread  # noqa: E402
from benchmarks.scripts.training import MIN_EPOCH_S, WORKLOADS, Built, Settings, build  # noqa: E402

TUNINGS = 5
"""Tunings per workload and driver."""

ROUNDS = 5
"""Interleaved rounds of the picks' re-measurement: four degrees of freedom for each interval."""

WINDOW_S = 2.0
"""The measured window of one re-measurement: twice the tuner's own, for steadier figures."""

MAX_EPOCHS = 4
"""Epochs a drop-in tuning may take to settle (its search takes two at most)."""

DRIVERS = ("drop-in", "tune_loader")
"""The two entry points, each tuned from scratch every time."""

DEFAULT_WORKLOADS = ("cifar10-like", "latency", "photos-crop-48")
"""Workloads where more than one configuration is plausible: a cache or thread workers, how many
workers behind a storage latency, a random crop on photos."""

QUICK = {"tunings": 2, "rounds": 2, "min_epoch_s": 1.0, "budget": 1.5, "window_s": 0.3,
         "workload": ["latency"]}
"""A smoke run: one tiny workload, two tunings per driver; its figures mean nothing."""

QUICK_OUT_PREFIX = "autotune-repeat-out-"
"""Prefix of the temporary folder a ``--quick`` run writes to when ``--out`` is not given."""


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def tune_once(b: Built, driver: str, budget_s: float | None) -> dict[str, Any]:
    """One tuning from scratch with ``driver``: what it picked and what it said about it."""
    store = Path(tempfile.mkdtemp(prefix="autotune-repeat-store-"))
    threads = torch.get_num_threads()
    load_before = _load()
    t0 = time.perf_counter()
    out: dict[str, Any] = {"driver": driver}
    try:
        ds = b.make()
        if driver == "drop-in":
            loader = DataLoader(ds, batch_size=b.batch_size, shuffle=True, cache_dir=str(store))
            epochs = 0
            while epochs < MAX_EPOCHS and not (epochs and loader.settled):
                for batch in loader:
                    b.step(batch)
                epochs += 1
            result = loader.tuning
            out.update(epochs=epochs, settled=loader.settled)
            loader.close()
        else:
            kwargs: dict[str, Any] = {"budget_s": budget_s} if budget_s else {}
            try:
                result = tune_loader(ds, b.step, batch_size=b.batch_size, cache_dir=str(store),
                                     progress=False, **kwargs)
            except TuningFailed as err:
                result = None
                out["failure"] = str(err)
    finally:
        torch.set_num_threads(threads)
        pt.clear_builds()
        shutil.rmtree(store, ignore_errors=True)
    out.update(seconds=time.perf_counter() - t0, load_before=load_before, load_after=_load())
    if result is None:
        out.update(pick=None, label=None)
        return out
    out.update(pick=result.candidate.to_dict(), label=result.candidate.label(), decision=result.decision,
               kept_baseline=result.kept_baseline, speedup=result.speedup, speedup_low=result.speedup_low,
               speedup_high=result.speedup_high, load_average_per_cpu=result.load_average)
    return out


def remeasure(b: Built, configs: list[Candidate], rounds: int,
              window_s: float) -> dict[Candidate, list[float]]:
    """Samples/s of every configuration per round, side by side (NOTE [ Repeatability protocol ] 3);
    a round in which one failed is dropped for all, so that the rounds stay paired."""
    ds = b.make()
    threads = torch.get_num_threads()
    per: dict[Candidate, list[float]] = {c: [] for c in configs}
    limits = MeasureLimits(window_s=window_s)
    try:
        for r in range(rounds):
            got: dict[Candidate, float] = {}
            for c in rotated(configs, r):
                try:
                    got[c] = measure(ds, c, step=b.step, limits=limits).samples_per_s
                except CandidateError as err:
                    print(f"    round {r + 1}: {c.label()} failed: {err}", file=sys.stderr, flush=True)
            if len(got) == len(configs):
                for c, sps in got.items():
                    per[c].append(sps)
    finally:
        torch.set_num_threads(threads)
        pt.clear_builds()
    return per


def judge(tunings: list[dict[str, Any]], per: dict[Candidate, list[float]]) -> dict[str, Any]:
    """How often the pick differs, and each pick against the fastest (NOTE [ Repeatability protocol ])."""
    labels = [t["label"] for t in tunings]
    counts = Counter(labels)
    common, common_n = counts.most_common(1)[0]
    picks = list(dict.fromkeys(Candidate.from_dict(t["pick"]) for t in tunings if t["pick"] is not None))
    measured = [c for c in picks if per.get(c)]
    rows: dict[str, Any] = {}
    best = max(measured, key=lambda c: statistics.median(per[c])) if measured else None
    for c, values in per.items():
        row: dict[str, Any] = {"samples_per_s": values, "picked": counts.get(c.label(), 0),
                               "median": statistics.median(values) if values else None,
                               "spread": spread(values) if values else None}
        if c == best:
            row.update(against_fastest_text="(the fastest)", within_noise=True)
        elif best is not None and values and c in picks:
            interval = paired_interval(values, per[best])
            row.update(against_fastest=interval.to_dict(), against_fastest_text=interval.text(),
                       within_noise=interval.high >= 1.0)
        rows[c.label()] = row
    within = [rows[c.label()].get("within_noise", False) for c in measured]
    return {"picks": labels, "distinct": len(counts), "most_common": common,
            "differs": len(labels) - common_n, "fastest": best.label() if best else None,
            "configs": rows, "all_within_noise": bool(within) and all(within)}


def run_driver(b: Built, driver: str, tunings: int, rounds: int, window_s: float,
               budget_s: float | None) -> dict[str, Any]:
    print(f"  {driver}", file=sys.stderr, flush=True)
    done = []
    for i in range(tunings):
        done.append(tune_once(b, driver, budget_s))
        print(f"    tuning {i + 1}/{tunings}: {done[-1]['label']} ({done[-1]['seconds']:.0f} s)",
              file=sys.stderr, flush=True)
    defaults = Candidate(b.batch_size)
    configs = list(dict.fromkeys([*(Candidate.from_dict(t["pick"]) for t in done if t["pick"]), defaults]))
    per = remeasure(b, configs, rounds, window_s)
    return {"driver": driver, "tunings": done, **judge(done, per)}


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    yes = {True: "yes", False: "**no**"}
    lines = ["# Repeatability: the same workload tuned from scratch, again and again", ""]
    lines += [*harness.quick_notice(meta["quick"]),
        f"Run on {meta['date']} with `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all).", "",
        f"Machine: {meta['machine']}. Load average (1, 5, 15 min) at the start: {meta['load']}; at the end:"
        f" {meta['load_end']}.", "",
        f"Each workload tuned {meta['tunings']} times per driver, each time with an empty profile folder;"
        f" then every distinct pick and PyTorch's defaults measured again side by side, {meta['rounds']}"
        " interleaved rounds of `autotune.measure` (steady-state samples/s). A pick is within the noise of"
        " the fastest pick when the interval of their paired ratio reaches 1. See NOTE [ Repeatability"
        " protocol ] in `benchmarks/scripts/repeat.py` and NOTE [ Paired ratio interval ] in"
        " `benchmarks/_common/stats.py`.",
        "",
        "| workload | driver | picks | distinct | tunings off the most common pick | fastest pick |"
        " every pick within the noise of the fastest |",
        "|---|---|---|---:|---:|---|---|",
    ]
    for w in results:
        for d in w["drivers"]:
            picks = ", ".join(f"`{p}`" if p else "nothing" for p in d["picks"])
            lines.append(f"| {w['name']} | {d['driver']} | {picks} | {d['distinct']} | {d['differs']} of"
                         f" {len(d['picks'])} | `{d['fastest']}` | {yes[d['all_within_noise']]} |")
    lines += ["", "## Re-measured side by side", ""]
    for w in results:
        lines += [f"### {w['name']}", "",
                  f"{w['description']}; {w['samples']} samples, batch {w['batch_size']}.", ""]
        for d in w["drivers"]:
            lines += [f"{d['driver']}:", "",
                      "| configuration | picked | samples/s (median) | spread | every round |"
                      " against the fastest pick |",
                      "|---|---:|---:|---:|---|---|"]
            for label, row in d["configs"].items():
                med = "-" if row["median"] is None else f"{row['median']:,.0f}"
                sp = "-" if row["spread"] is None else f"{row['spread']:.0%}"
                rounds = ", ".join(f"{x:,.0f}" for x in row["samples_per_s"])
                lines.append(f"| `{label}` | {row['picked']} | {med} | {sp} | {rounds} |"
                             f" {row.get('against_fastest_text', '-')} |")
            lines += ["", "Tunings:", ""]
            for i, t in enumerate(d["tunings"]):
                speed = ("" if t.get("speedup") is None else f"; reported {t['speedup']:.2f}x"
                         + ("" if t.get("speedup_low") is None else
                            f" ({t['speedup_low']:.2f}-{t['speedup_high'] or float('inf'):.2f}x)"))
                label = f"`{t['label']}`" if t["label"] else "nothing"
                lines.append(f"{i + 1}. {label} in {t['seconds']:.0f} s (load {t['load_before']})"
                             f"{speed}; {t.get('decision') or t.get('failure') or 'nothing measured'}")
            lines.append("")
    return "\n".join(lines) + "\n"


def write(meta: dict[str, Any], results: list[dict[str, Any]], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "repeat.json").write_text(json.dumps({"meta": meta, "workloads": results}, indent=1,
                                                default=str) + "\n")
    (out / "REPEAT.md").write_text(markdown(meta, results))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/scripts/repeat.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--tunings", type=int, default=None, help=f"per workload and driver (default {TUNINGS})")
    p.add_argument("--rounds", type=int, default=None, help=f"of the re-measurement (default {ROUNDS})")
    p.add_argument("--min-epoch-s", type=float, default=None,
                   help=f"an epoch at the defaults lasts at least this (default {MIN_EPOCH_S:g})")
    p.add_argument("--window-s", type=float, default=None, help=f"per re-measurement (default {WINDOW_S:g})")
    p.add_argument("--budget", type=float, default=None, help="tune_loader's budget (default: its own)")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help=f"repeatable (default: {', '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--driver", action="append", choices=DRIVERS, help="repeatable (default: both)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, its figures mean nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for REPEAT.md and repeat.json (default: benchmarks/results/repeat/;"
                   " with --quick, a new temporary folder)")
    args = p.parse_args(argv)
    harness.fill_in(args, QUICK, {"tunings": TUNINGS, "rounds": ROUNDS, "min_epoch_s": MIN_EPOCH_S,
                                  "window_s": WINDOW_S, "workload": list(DEFAULT_WORKLOADS)})
    harness.require_positive(p, args, "tunings", "rounds")
    return args


def out_folder(args: argparse.Namespace) -> Path:
    return harness.out_folder(args, __file__, QUICK_OUT_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_folder(args)
    drivers = args.driver or list(DRIVERS)
    sizing = Settings(epochs=1, budget_s=None, repeats=1, probe_window_s=args.window_s,
                      min_batches=3 if args.quick else 8)
    started = time.time()
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/scripts/repeat.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "tunings": args.tunings, "rounds": args.rounds, "window_s": args.window_s,
        "machine": harness.describe_machine(),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    results = []
    for name in args.workload:
        b = build(name, args.min_epoch_s, sizing)
        print(f"{b.name}: {b.n} samples, batch {b.batch_size}", file=sys.stderr, flush=True)
        try:
            drivers_out = [run_driver(b, d, args.tunings, args.rounds, args.window_s, args.budget)
                           for d in drivers]
        finally:
            for path in b.cleanup:
                shutil.rmtree(path, ignore_errors=True)
        results.append({"name": b.name, "description": b.description, "samples": b.n,
                        "batch_size": b.batch_size, "drivers": drivers_out})
        meta["total_s"] = round(time.time() - started, 1)
        meta["load_end"] = ", ".join(f"{x:.2f}" for x in os.getloadavg())
        write(meta, results, out)  # after every workload: a long run that is stopped keeps its figures
    print(f"wrote {out / 'REPEAT.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
