"""Run the benchmark suite: ``python -m benchmarks`` or ``python benchmarks/run.py``.

See NOTE [ Benchmark protocol ] in ``benchmarks/suite.py``. ``--quick`` checks that the suite runs
(tiny budgets, a reduced grid, one round); its figures mean nothing, so unless ``--out`` says
otherwise it writes them to a new temporary folder and leaves the committed results alone.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from autotune.machine import detect_machine  # noqa: E402
from benchmarks import output, suite  # noqa: E402

DEFAULT_BUDGET_S = 60.0
"""The tuner's own default budget, so the benchmark measures what a user gets."""

QUICK_BUDGET_S = 4.0
"""Enough for the baseline and a few trials: quick mode checks the suite runs, not the figures."""

DEFAULT_ROUNDS = 5
"""Interleaved rounds: the median of five shrugs off one or two disturbed measurements."""

DEFAULT_TOP_K = 3
"""Grid points re-measured as oracle candidates (plus the grid's fastest per sample)."""

RESULTS_DIR = Path(__file__).resolve().parent
"""Where a full run writes RESULTS.md, results.json and results.png: the committed results."""

QUICK_OUT_PREFIX = "autotune-bench-quick-"
"""Prefix of the temporary folder a ``--quick`` run writes to when ``--out`` is not given."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (tiny budgets, reduced grid)")
    p.add_argument("--workload", action="append", choices=suite.WORKLOAD_NAMES,
                   help="run only this workload (repeatable; default: all)")
    p.add_argument("--gpu", action="store_true", help="measure on CUDA (skipped when there is none)")
    p.add_argument("--budget", type=float, default=None,
                   help=f"tuning budget in seconds (default {DEFAULT_BUDGET_S:g}, quick {QUICK_BUDGET_S:g})")
    p.add_argument("--rounds", type=int, default=None,
                   help=f"interleaved measurement rounds (default {DEFAULT_ROUNDS}, quick 1)")
    p.add_argument("--top-k", type=int, default=None,
                   help=f"grid points re-measured as oracle candidates (default {DEFAULT_TOP_K})")
    p.add_argument("--max-workers", type=int, default=None,
                   help="bound num_workers for the tuner and the grid alike (default: the machine's)")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for RESULTS.md, results.json and results.png (default: benchmarks/;"
                   " with --quick, a new temporary folder)")
    p.add_argument("--from-json", type=Path, default=None, metavar="PATH",
                   help="measure nothing: write RESULTS.md and results.png again from a results.json")
    args = p.parse_args(argv)
    for name in ("budget", "rounds", "top_k", "max_workers"):
        value = getattr(args, name)
        if value is not None and value <= (0 if name != "max_workers" else -1):
            p.error(f"--{name.replace('_', '-')}={value} must be positive")
    return args


def out_folder(args: argparse.Namespace) -> Path:
    """``--out``, else a new temporary folder for a smoke run, else the committed results' folder."""
    if args.out is not None:
        return Path(args.out)
    if args.quick and args.from_json is None:
        return Path(tempfile.mkdtemp(prefix=QUICK_OUT_PREFIX))
    return RESULTS_DIR


def render(source: Path, out: Path) -> int:
    """RESULTS.md and results.png from the figures of an earlier run."""
    data = json.loads(source.read_text())
    out.mkdir(parents=True, exist_ok=True)
    output.write_markdown(data, out / "RESULTS.md")
    output.write_plot(data, out / "results.png")
    print(f"benchmarks: wrote {out / 'RESULTS.md'} and {out / 'results.png'} from {source}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return render(args.from_json, out_folder(args))
    if args.gpu and not torch.cuda.is_available():
        print("benchmarks: --gpu asked for, but CUDA is not available on this machine; skipped.")
        return 0
    settings = suite.Settings(
        budget_s=args.budget or (QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S),
        rounds=args.rounds or DEFAULT_ROUNDS,
        top_k=args.top_k or DEFAULT_TOP_K,
        quick=args.quick,
        device="cuda" if args.gpu else "cpu",
        max_workers=args.max_workers,
    )
    if args.quick:
        settings = suite.quick_settings(settings)
        settings = replace(settings, rounds=args.rounds or 1, top_k=args.top_k or 1)
    names = args.workload or list(suite.WORKLOAD_NAMES)
    out = out_folder(args)
    out.mkdir(parents=True, exist_ok=True)
    command = shlex.join(["python", "-m", "benchmarks", *(sys.argv[1:] if argv is None else argv)])
    machine = detect_machine()
    started = time.monotonic()
    data: dict = {
        "meta": {
            "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
            "command": command,
            "machine": machine.to_dict(),
            "load_average": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
            "budget_s": settings.budget_s,
            "rounds": settings.rounds,
            "top_k": settings.top_k,
            "quick": settings.quick,
            "device": settings.device,
            "max_workers": settings.max_workers,
            "pretransform": settings.pretransform,
            "epochs": suite.EPOCHS,
        },
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        for name in names:
            workload = suite.make_workload(name, Path(tmp) / name, quick=settings.quick,
                                           device=settings.device)
            result = suite.with_strong_target(suite.run_workload(workload, settings))
            data["workloads"][workload.name] = result
            data["meta"]["total_s"] = time.monotonic() - started
            # Written after every workload, so a long run that is stopped keeps what it measured.
            output.write_json(data, out / "results.json")
    output.write_markdown(data, out / "RESULTS.md")
    plot = output.write_plot(data, out / "results.png")
    print(f"benchmarks: wrote {out / 'RESULTS.md'}, {out / 'results.json'}"
          + (f", {plot}" if plot else " (no plot: matplotlib is not installed)")
          + f" in {data['meta']['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
