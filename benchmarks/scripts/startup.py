"""Hiding start-up: the drop-in's first run with each next candidate started while the stretch before
it serves its last batches, against the same run with each candidate started in its turn.

    python benchmarks/scripts/startup.py [--rounds 5] [--epochs 3] [--min-epoch-s 6]
                                         [--workload NAME ...] [--quick] [--out DIR]

Writes STARTUP.md and startup.json to ``benchmarks/results/startup/`` (``--out`` elsewhere; ``--quick``
writes to a temporary folder unless ``--out`` is given).

# NOTE [ Start-up benchmark protocol ]
# 1. Per workload (sized as in training.py: an epoch at PyTorch's defaults takes about
#    --min-epoch-s), ROUNDS rounds; each round runs the user's loop twice, in an order that flips
#    every round: "ahead" (the drop-in as shipped) and "in turn" (autotune.epochs.HIDE_STARTUP off:
#    a measured stretch ends as soon as it has its window and the next candidate starts then). Both
#    are autotune.DataLoader(dataset, batch_size, shuffle=True) with a new, empty profile folder, so
#    every run explores; EPOCHS epochs of the workload's step on every batch.
# 2. Per run: the whole run's wall time, the first epoch's (where the exploring happens), how many
#    stretches were started ahead, and the pick. Per round the ratio ahead / in turn of each, paired
#    (NOTE [ Paired ratio interval ] in _common/stats.py): the interval says whether the difference is more
#    than the machine's noise. The two runs' picks may differ; both are recorded.
# 3. The machine as it is: its load before and after each run is recorded.
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
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402

from autotune import DataLoader  # noqa: E402
from autotune import epochs as drop_in_epochs  # noqa: E402
from autotune import pretransform as pt  # noqa: E402
from benchmarks._common import harness  # noqa: E402
from benchmarks._common.stats import paired_interval  # noqa: E402
from benchmarks.scripts.training import Built, Settings, build, train  # noqa: E402

ROUNDS = 5
"""Rounds per workload: four degrees of freedom for each interval."""

EPOCHS = 3
"""Epochs per run: the drop-in explores in the first one or two."""

MIN_EPOCH_S = 6.0
"""An epoch at PyTorch's defaults lasts about this."""

WORKLOADS = ("latency", "imagefolder-jpeg", "photos-crop-48")
"""Workloads whose search tries worker processes (the start-up there is what is hidden)."""

DEFAULT_WORKLOADS = ("latency", "imagefolder-jpeg")

ARMS = ("ahead", "in turn")

QUICK = {"rounds": 1, "epochs": 2, "min_epoch_s": 0.5, "workload": ["latency"]}
"""A smoke run: one tiny workload, one round; its figures mean nothing."""

QUICK_OUT_PREFIX = "autotune-startup-out-"


def one_run(b: Built, epochs: int, ahead: bool) -> dict[str, Any]:
    """The user's loop over a new drop-in with an empty profile folder; the arm's switch set."""
    store = Path(tempfile.mkdtemp(prefix="autotune-startup-store-"))
    drop_in_epochs.HIDE_STARTUP = ahead
    threads = torch.get_num_threads()
    load_before = os.getloadavg()[0]
    try:
        t0 = time.perf_counter()
        loader = DataLoader(b.make(), batch_size=b.batch_size, shuffle=True, cache_dir=str(store))
        times = train(loader, b.step, epochs)
        wall = time.perf_counter() - t0
        result = loader.tuning
        chosen = None if result is None else result.candidate.label()
        if chosen is not None and not loader.settled:
            chosen = f"still exploring (best so far {chosen})"
        started_ahead = loader._tuning.started_ahead
        loader.close()
    finally:
        drop_in_epochs.HIDE_STARTUP = True
        torch.set_num_threads(threads)
        pt.clear_builds()
        shutil.rmtree(store, ignore_errors=True)
    return {"wall_s": wall, "epochs_s": times, "started_ahead": started_ahead, "chosen": chosen,
            "load_before": round(load_before, 2), "load_after": round(os.getloadavg()[0], 2)}


def run_workload(b: Built, rounds: int, epochs: int) -> dict[str, Any]:
    runs: dict[str, list[dict[str, Any]]] = {arm: [] for arm in ARMS}
    print(f"{b.name}: {b.n} samples, batch {b.batch_size}", file=sys.stderr, flush=True)
    for r in range(rounds):
        for arm in ARMS if r % 2 == 0 else ARMS[::-1]:
            run = one_run(b, epochs, ahead=arm == "ahead")
            runs[arm].append(run)
            print(f"  round {r + 1}/{rounds} {arm:<8} {run['wall_s']:6.1f} s"
                  f" (epoch 1 {run['epochs_s'][0]:.1f} s, {run['started_ahead']} started ahead)"
                  f" {run['chosen']}", file=sys.stderr, flush=True)
    ahead, turn = runs["ahead"], runs["in turn"]
    whole = paired_interval([x["wall_s"] for x in ahead], [x["wall_s"] for x in turn])
    first = paired_interval([x["epochs_s"][0] for x in ahead], [x["epochs_s"][0] for x in turn])
    return {
        "name": b.name, "n": b.n, "batch_size": b.batch_size, "description": b.description, "runs": runs,
        "median_wall_s": {arm: statistics.median(x["wall_s"] for x in v) for arm, v in runs.items()},
        "median_first_epoch_s": {arm: statistics.median(x["epochs_s"][0] for x in v)
                                 for arm, v in runs.items()},
        "whole_run": whole.to_dict(), "first_epoch": first.to_dict(),
        "whole_run_text": whole.text(), "first_epoch_text": first.text(),
    }


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = [
        "# Hiding start-up: the next candidate started while the last batches are served", "",
        f"Run on {meta['date']} with `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all).", "",
        f"Machine: {meta['machine']}. Load average (1, 5, 15 min) at the start: {meta['load']}.", "",
    ]
    lines += [*harness.quick_notice(meta["quick"]),
        "The drop-in's first run (an empty profile folder, so it explores) of the user's loop, "
        f"{meta['epochs']} epochs, {meta['rounds']} rounds per workload, the two arms in an order that"
        " flips every round: **ahead** (as shipped: when a measured stretch has its window, the next"
        " candidate's workers start while it serves the batches its workers already took) and **in"
        " turn** (each candidate started when the stretch before it ends, its backlog given back and"
        " loaded again). Ratios are ahead / in turn, per round, with their interval (NOTE [ Paired ratio"
        " interval ] in `benchmarks/_common/stats.py`); below 1 is faster. See NOTE [ Start-up benchmark"
        " protocol ] in `benchmarks/scripts/startup.py`.", "",
        "| workload | samples | whole run, ahead | whole run, in turn | whole run ahead / in turn |"
        " first epoch, ahead | first epoch, in turn | first epoch ahead / in turn | started ahead per run |",
        "|---|---:|---:|---:|---|---:|---:|---|---:|",
    ]
    for w in results:
        per_run = statistics.median(x["started_ahead"] for x in w["runs"]["ahead"])
        lines.append(
            f"| {w['name']} | {w['n']} | {w['median_wall_s']['ahead']:.1f} s |"
            f" {w['median_wall_s']['in turn']:.1f} s | {w['whole_run_text']} |"
            f" {w['median_first_epoch_s']['ahead']:.1f} s | {w['median_first_epoch_s']['in turn']:.1f} s |"
            f" {w['first_epoch_text']} | {per_run:g} |")
    lines += ["", "Picks per run (ahead; in turn):", ""]
    for w in results:
        picks = "; ".join(f"{a['chosen']} / {t['chosen']}" for a, t in zip(w["runs"]["ahead"],
                                                                           w["runs"]["in turn"], strict=True))
        lines.append(f"- {w['name']}: {picks}")
    return "\n".join(lines) + "\n"


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/scripts/startup.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help=f"per workload (default {ROUNDS})")
    p.add_argument("--epochs", type=int, default=None, help=f"per run (default {EPOCHS})")
    p.add_argument("--min-epoch-s", type=float, default=None,
                   help=f"an epoch at PyTorch's defaults lasts at least this (default {MIN_EPOCH_S:g})")
    p.add_argument("--workload", action="append", choices=WORKLOADS,
                   help=f"repeatable (default: {', '.join(DEFAULT_WORKLOADS)})")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny sizes, its figures mean nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for STARTUP.md and startup.json (default: benchmarks/results/startup/;"
                   " with --quick, a new temporary folder)")
    args = p.parse_args(argv)
    harness.fill_in(args, QUICK, {"rounds": ROUNDS, "epochs": EPOCHS, "min_epoch_s": MIN_EPOCH_S,
                                         "workload": list(DEFAULT_WORKLOADS)})
    harness.require_positive(p, args, "rounds", "epochs")
    return args


def out_folder(args: argparse.Namespace) -> Path:
    return harness.out_folder(args, __file__, QUICK_OUT_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    settings = Settings(args.epochs, None, 1)
    if args.quick:
        settings = Settings(args.epochs, None, 1, probe_window_s=0.5, min_batches=3)
    started = time.time()
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/scripts/startup.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "machine": harness.describe_machine(),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "rounds": args.rounds, "epochs": args.epochs, "min_epoch_s": args.min_epoch_s,
    }
    results = []
    for name in args.workload:
        b = build(name, args.min_epoch_s, settings)
        try:
            results.append(run_workload(b, args.rounds, args.epochs))
        finally:
            for path in b.cleanup:
                shutil.rmtree(path, ignore_errors=True)
        meta["total_s"] = round(time.time() - started, 1)
        (out / "startup.json").write_text(json.dumps({"meta": meta, "workloads": results}, indent=1) + "\n")
        (out / "STARTUP.md").write_text(markdown(meta, results))
    print(f"wrote {out / 'STARTUP.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
