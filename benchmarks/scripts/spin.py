"""The step's own threads under load: how much a training step on the CPU slows down when the machine
is shared, by configuration, and what takes that away.

    python benchmarks/scripts/spin.py [--rounds 5] [--batches 30] [--hogs 0 1 2] [--quick] [--out DIR]

Writes SPIN.md and spin.json to ``benchmarks/results/spin/`` (``--out`` elsewhere; ``--quick``
writes to a temporary folder unless ``--out`` is given).

# NOTE [ Spin protocol ]
# 1. The step is the cifar10-like workload's (a small CNN trained on the CPU), fed by PyTorch's
#    DataLoader with the defaults, batch 64. Each arm runs in a fresh Python process, because the
#    OpenMP runtime reads its settings once, when it is loaded:
#      defaults     torch's thread count as it comes (one per CPU), OpenMP as it comes;
#      threads=1    torch.set_num_threads(1) before the loop;
#      passive      OMP_WAIT_POLICY=PASSIVE in the environment (waiting OpenMP threads sleep
#                   instead of spinning);
#      thread-w2    autotune's ThreadDataLoader with two loading threads, torch's thread count as
#                   it comes.
# 2. Per load level (0, 1, 2 busy cores beside the benchmark, benchmarks/_common/hog.py), ROUNDS rounds; a
#    round runs every arm once, in an order rotated every round. An arm warms up for WARMUP
#    batches, then BATCHES batches are timed: samples/s over them, and the median step.
# 3. Ratios against the defaults are paired by round (NOTE [ Paired ratio interval ] in _common/stats.py).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import subprocess
import sys
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import harness  # noqa: E402
from benchmarks._common.hog import cpu_hog  # noqa: E402
from benchmarks._common.stats import paired_interval, spread  # noqa: E402

ROUNDS = 5
"""Rounds per load level: four degrees of freedom for each interval."""

BATCHES = 30
"""Batches timed per arm."""

WARMUP = 5
"""Batches run before the timing starts."""

HOGS = (0, 1, 2)
"""Busy cores beside the benchmark, per load level."""

ARMS = ("defaults", "threads=1", "passive", "thread-w2")
"""The configurations compared (NOTE [ Spin protocol ] 1)."""

QUICK = {"rounds": 1, "batches": 2, "hogs": [1]}
"""A smoke run: its figures mean nothing."""

QUICK_WARMUP = 1
"""The smoke run's warm-up batches: one, so that the timed batches still follow a first one."""

QUICK_OUT_PREFIX = "autotune-spin-out-"

_ARM = """
import json, os, statistics, sys, time
sys.path.insert(0, {root!r})
import torch
from torch.utils.data import DataLoader
from autotune import workloads as wl
from autotune.threads import ThreadDataLoader
arm, batches, warmup = {arm!r}, {batches}, {warmup}
if arm == "threads=1":
    torch.set_num_threads(1)
w = wl.get_workload("cifar10-like", n=64 * (batches + warmup))
if arm == "thread-w2":
    loader = ThreadDataLoader(w.dataset, batch_size=64, shuffle=True, worker_threads=2)
else:
    loader = DataLoader(w.dataset, batch_size=64, shuffle=True)
steps, n, t0 = [], 0, None
for i, batch in enumerate(loader):
    if i == warmup:
        t0 = time.perf_counter()
    t = time.perf_counter()
    w.step(batch)
    if i >= warmup:
        steps.append(time.perf_counter() - t)
        n += len(batch[0])
print(json.dumps({{"samples_per_s": n / (time.perf_counter() - t0),
                  "step_ms": 1000 * statistics.median(steps), "torch_threads": torch.get_num_threads(),
                  "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}}))
"""


def run_arm(arm: str, batches: int, warmup: int = WARMUP) -> dict[str, Any]:
    """One arm in a fresh process (NOTE [ Spin protocol ] 1)."""
    env = dict(os.environ)
    env.pop("OMP_WAIT_POLICY", None)
    if arm == "passive":
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    root = str(Path(__file__).resolve().parents[2])
    source = _ARM.format(root=root, arm=arm, batches=batches, warmup=warmup)
    done = subprocess.run([sys.executable, "-c", source], env=env, capture_output=True, text=True,
                          timeout=600, check=False)
    if done.returncode != 0:
        raise RuntimeError(f"arm {arm} failed: {done.stderr.strip()[-2000:]}")
    out: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return out


def level(hogs: int, rounds: int, batches: int, warmup: int = WARMUP) -> dict[str, Any]:
    """Every arm, ROUNDS interleaved rounds, beside ``hogs`` busy cores."""
    per: dict[str, list[dict[str, Any]]] = {a: [] for a in ARMS}
    with ExitStack() as stack:
        records = [stack.enter_context(cpu_hog()) for _ in range(hogs)]
        load_start = harness.load_average()
        for r in range(rounds):
            for arm in ARMS[r % len(ARMS):] + ARMS[:r % len(ARMS)]:
                per[arm].append(run_arm(arm, batches, warmup))
                print(f"  {hogs} busy, round {r + 1}: {arm}: {per[arm][-1]['samples_per_s']:.0f} samples/s",
                      file=sys.stderr, flush=True)
        load_end = harness.load_average()
    base = [x["samples_per_s"] for x in per["defaults"]]
    arms = {}
    for arm in ARMS:
        sps = [x["samples_per_s"] for x in per[arm]]
        arms[arm] = {
            "samples_per_s": sps, "median": statistics.median(sps), "spread": spread(sps),
            "step_ms": [x["step_ms"] for x in per[arm]],
            "median_step_ms": statistics.median(x["step_ms"] for x in per[arm]),
            "against_defaults": None if arm == "defaults" else paired_interval(sps, base),
            "ran_with": {k: per[arm][0][k] for k in ("torch_threads", "omp_wait_policy")},
        }
    return {"hogs": hogs, "load_start": load_start, "load_end": load_end,
            "hog_cpu_s": [rec.get("cpu_s") for rec in records], "arms": arms}


def markdown(meta: dict[str, Any], levels: list[dict[str, Any]]) -> str:
    lines = [
        "# The step's own threads under load", "",
        f"Run on {meta['date']} with `{meta['command']}` ({meta['total_s']:.0f} s in all).", "",
        f"Machine: {meta['machine']}. Load average (1, 5, 15 min) at the start: {meta['load']}.", "",
        "The cifar10-like step (a small CNN trained on the CPU), fed by PyTorch's DataLoader with its"
        " defaults, batch 64; each arm in a fresh process, the arms of a round interleaved, beside 0, 1"
        " or 2 busy cores. See NOTE [ Spin protocol ] in `benchmarks/scripts/spin.py`.", "",
        *harness.quick_notice(meta["quick"]),
        "| busy cores | arm | samples/s (median) | spread | median step | against the defaults |",
        "|---:|---|---:|---:|---:|---|",
    ]
    for lv in levels:
        for arm, a in lv["arms"].items():
            against = "(the defaults)" if a["against_defaults"] is None else a["against_defaults"].text()
            lines.append(f"| {lv['hogs']} | {arm} | {a['median']:,.0f} | {a['spread']:.0%} |"
                         f" {a['median_step_ms']:.1f} ms | {against} |")
    lines += ["", "Per round (samples/s):", ""]
    for lv in levels:
        rounds = "; ".join(f"{arm} {', '.join(f'{x:,.0f}' for x in a['samples_per_s'])}"
                           for arm, a in lv["arms"].items())
        load = f"load {lv['load_start'][0]:.2f} to {lv['load_end'][0]:.2f}"
        lines.append(f"- {lv['hogs']} busy ({load}): {rounds}")
    return "\n".join(lines) + "\n"


def _json(value: Any) -> Any:
    return value.to_dict()  # an Interval


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/scripts/spin.py", description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=None, help=f"per load level (default {ROUNDS})")
    p.add_argument("--batches", type=int, default=None, help=f"timed per arm (default {BATCHES})")
    p.add_argument("--hogs", type=int, nargs="+", default=None,
                   help="busy cores beside the benchmark, one level each"
                   f" (default {' '.join(map(str, HOGS))})")
    p.add_argument("--quick", action="store_true", help="a smoke run: its figures mean nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for SPIN.md and spin.json (default: benchmarks/results/spin/;"
                   " with --quick, a new temporary folder)")
    args = p.parse_args(argv)
    harness.fill_in(args, QUICK, {"rounds": ROUNDS, "batches": BATCHES, "hogs": list(HOGS)})
    harness.require_positive(p, args, "rounds", "batches")
    if any(h < 0 for h in args.hogs):
        p.error(f"--hogs {args.hogs}: busy cores cannot be negative")
    return args


def out_folder(args: argparse.Namespace) -> Path:
    return harness.out_folder(args, __file__, QUICK_OUT_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/scripts/spin.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick, "machine": harness.describe_machine(),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "rounds": args.rounds, "batches": args.batches,
        "warmup": QUICK_WARMUP if args.quick else WARMUP,
    }
    levels = [level(h, args.rounds, args.batches, meta["warmup"]) for h in args.hogs]
    meta["total_s"] = round(time.time() - started, 1)
    data = json.dumps({"meta": meta, "levels": levels}, indent=1, default=_json)
    (out / "spin.json").write_text(data + "\n")
    (out / "SPIN.md").write_text(markdown(meta, levels))
    print(f"wrote {out / 'SPIN.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
