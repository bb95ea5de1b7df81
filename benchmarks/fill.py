"""A ``ram`` cache filled by the first epoch, against an uncached epoch and a blocking build.

    python benchmarks/fill.py [--n 10000] [--rounds 3] [--workers 0 2] [--batch-size 128]
                              [--torch-threads K]

Prints one table per worker count and writes ``benchmarks/fill.json``.

# NOTE [ Fill benchmark protocol ]
# CIFAR10Like(n) with the standard training transform, loaded in shuffled batches by a torch
# DataLoader with forked workers. Per round, in an order rotated each round:
#   uncached: one epoch over the dataset as given;
#   pass:     prepare(fill="pass") and the first epoch over it (it fills the cache), then a second
#             epoch (over ``loader_parts``, the built cache's wrapper once complete);
#   build:    prepare() (the blocking build) and the first epoch, then a second epoch.
# Each cache is dropped before the next is made. Times include the loader's start-up (workers are
# not persistent); "first" includes prepare. Figures are medians over the rounds, compared as ratios
# of medians measured in the same run; the load average before and after is printed with them.
# ``--torch-threads`` sets the main process's torch threads (workers use one each, as torch sets):
# with workers=0 on a loaded machine, multi-threaded tensor ops (the cache's batched gather) wait on
# each other's threads, which the DataLoader's own per-sample path does less.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from autotune import pretransform as pt
from autotune.workloads import CIFAR10Like, cifar_train_transform

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
        for arm in arms[r % 3:] + arms[: r % 3]:
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


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--workers", type=int, nargs="+", default=[0, 2])
    parser.add_argument("--batch-size", type=int, default=128)
    parser.add_argument("--torch-threads", type=int, default=None)
    parser.add_argument("--out", type=Path, default=Path(__file__).with_name("fill.json"))
    args = parser.parse_args(argv)
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
    summary = {"cpus": os.cpu_count(), "torch_threads": torch.get_num_threads(), "results": results}
    args.out.write_text(json.dumps(summary, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
