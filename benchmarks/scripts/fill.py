"""A ``ram`` cache filled by the first epoch, against an uncached epoch and a blocking build.

    python benchmarks/scripts/fill.py [--n 10000] [--rounds 3] [--workers 0 2] [--batch-size 128]
                                      [--torch-threads K] [--out DIR] [--render JSON]

Prints one table per worker count and writes FILL.md and fill.json to ``benchmarks/results/fill/``
(``--out`` elsewhere).

# NOTE [ Fill benchmark protocol ]
# CIFAR10Like(n) with the standard training transform, loaded in shuffled batches by a torch
# DataLoader with forked workers. Per round, in an order rotated each round:
#   uncached: one epoch over the dataset as given;
#   pass:     prepare(fill="pass") and the first epoch over it (it fills the cache), then a second
#             epoch (over ``loader_parts``, the built cache's wrapper once complete);
#   build:    prepare() (the blocking build) and the first epoch, then a second epoch.
# Each cache is dropped before the next is made, and kept private to the process
# (AUTOTUNE_NODE_CACHE=off): a node cache would hand the next arm the samples this one filled.
# Times include the loader's start-up (workers are not persistent); "first" includes prepare.
# Figures are medians over the rounds, compared as ratios of medians measured in the same run; the
# load average before and after is printed with them.
# ``--torch-threads`` sets the main process's torch threads (workers use one each, as torch sets):
# with workers=0 on a loaded machine, multi-threaded tensor ops (the cache's batched gather) wait on
# each other's threads, which the DataLoader's own per-sample path does less.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import shlex
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import DataLoader  # noqa: E402

from autotune import pretransform as pt  # noqa: E402
from autotune.workloads import CIFAR10Like, cifar_train_transform  # noqa: E402
from benchmarks._common import harness  # noqa: E402
from benchmarks._common.stats import rotated  # noqa: E402

CPU = torch.device("cpu")


def _epoch(dataset: Any, collate: Any, workers: int, batch_size: int) -> int:
    loader = DataLoader(dataset, batch_size=batch_size, shuffle=True, num_workers=workers,
                        collate_fn=collate, multiprocessing_context="fork" if workers else None)
    return sum(len(batch[1]) for batch in loader)


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cached(ds: Any, fill: str, workers: int, batch_size: int) -> tuple[float, float, float]:
    """(first epoch with prepare, second epoch, fraction filled after the first)."""
    pt.clear_builds()
    gc.collect()
    holder: dict[str, Any] = {}

    def first() -> None:
        holder["p"] = pt.prepare(ds, "ram", device=CPU, fill=fill)
        _epoch(*holder["p"].loader_parts(), workers, batch_size)

    t1 = _timed(first)
    filled = holder["p"].filled_fraction()
    t2 = _timed(lambda: _epoch(*holder["p"].loader_parts(), workers, batch_size))
    holder.clear()
    pt.clear_builds()
    return t1, t2, filled


def run(n: int, rounds: int, workers: int, batch_size: int) -> dict[str, Any]:
    torch.manual_seed(0)
    ds = CIFAR10Like(n, transform=cifar_train_transform())
    pt.strategies(ds, cuda=False)  # plan once, outside the timings (both caches share the plan)
    times: dict[str, list[float]] = {k: [] for k in ("uncached", "pass_1", "pass_2", "build_1", "build_2")}
    filled: list[float] = []
    load = [os.getloadavg()[0]]
    arms = ["uncached", "pass", "build"]
    for r in range(rounds):
        for arm in rotated(arms, r):
            if arm == "uncached":
                times["uncached"].append(_timed(lambda: _epoch(ds, None, workers, batch_size)))
            else:
                t1, t2, f = _cached(ds, arm, workers, batch_size)
                times[f"{arm}_1"].append(t1)
                times[f"{arm}_2"].append(t2)
                if arm == "pass":
                    filled.append(f)
        load.append(os.getloadavg()[0])
    med = {k: statistics.median(v) for k, v in times.items()}
    return {
        "workers": workers, "n": n, "rounds": rounds, "batch_size": batch_size, "seconds": times,
        "median_s": med, "filled_after_first_pass": filled, "load_avg_1min": load,
        "ratios": {
            "pass first / uncached": med["pass_1"] / med["uncached"],
            "build first / uncached": med["build_1"] / med["uncached"],
            "pass first / build first": med["pass_1"] / med["build_1"],
            "pass second / build second": med["pass_2"] / med["build_2"],
            "pass second / uncached": med["pass_2"] / med["uncached"],
        },
    }


def write_markdown(summary: dict[str, Any], path: Path) -> None:
    """The page: per worker count, each arm's median and per-round seconds, and the ratios."""
    lines = [
        "# A ram cache filled by the first epoch",
        "",
        f"Run on {summary.get('date', 'a date not recorded')} with"
        + (f" `{summary['command']}`" if "command" in summary else " options not recorded")
        + f" on {summary['cpus']} CPUs, {summary['torch_threads']} torch thread(s) in the main process."
        " See NOTE [ Fill benchmark protocol ] in `benchmarks/scripts/fill.py`: times in seconds,"
        " medians over the rounds, ratios of medians from the same run.",
        "",
    ]
    for res in summary["results"]:
        lines += [
            f"## workers={res['workers']}",
            "",
            f"{res['n']} samples, batch {res['batch_size']}, {res['rounds']} rounds; load average (1 min) at"
            f" the start and after each round: {', '.join(f'{v:.1f}' for v in res['load_avg_1min'])}; filled"
            f" after the first pass: {', '.join(f'{v:.0%}' for v in res['filled_after_first_pass'])}.",
            "",
            "| arm | median s | per round |",
            "|---|---:|---|",
            *(f"| {arm} | {res['median_s'][arm]:.2f} | {', '.join(f'{v:.2f}' for v in times)} |"
              for arm, times in res["seconds"].items()),
            "",
            "| ratio | median |",
            "|---|---:|",
            *(f"| {name} | {value:.2f}x |" for name, value in res["ratios"].items()),
            "",
        ]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/scripts/fill.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--torch-threads", type=int, default=None)
    harness.add_out(parser, __file__)
    harness.add_render(parser, "FILL.md")
    args = parser.parse_args(argv)
    if harness.render(args, "FILL.md", write_markdown):
        return 0
    os.environ["AUTOTUNE_NODE_CACHE"] = "off"  # each arm fills its own cache (NOTE [ Fill ... ])
    if args.torch_threads is not None:
        torch.set_num_threads(args.torch_threads)
    results = []
    for workers in args.workers:
        res = run(args.n, args.rounds, workers, args.batch_size)
        results.append(res)
        print(f"\nworkers={workers}, torch threads {torch.get_num_threads()}, n={args.n},"
              f" {args.rounds} rounds, load avg (1 min) per round:"
              f" {', '.join(f'{v:.1f}' for v in res['load_avg_1min'])} on {os.cpu_count()} CPUs")
        for k, v in res["median_s"].items():
            print(f"  {k:<9} median {v:6.2f} s   ({', '.join(f'{s:.2f}' for s in res['seconds'][k])})")
        for k, v in res["ratios"].items():
            print(f"  {k:<27} {v:5.2f}x")
    summary = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
               "command": shlex.join(["python", "benchmarks/scripts/fill.py",
                                      *(sys.argv[1:] if argv is None else argv)]),
               "cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "results": results}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fill.json").write_text(json.dumps(summary, indent=1) + "\n")
    write_markdown(summary, args.out / "FILL.md")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
