"""Two ranks on one node: tuning each rank alone versus tuning them together, measured side by side.

    python benchmarks/scripts/ranks.py [--budget 30] [--rounds 3] [--out DIR] [--render JSON]

1. Tunes the CIFAR-10-shaped workload (per-sample decoding, no pre-transform) in a single process:
   the configuration a rank would pick if it were alone on the node.
2. Tunes it cooperatively under ``torchrun --nproc-per-node=2`` (every rank measures each candidate
   at the same time; the worker bound is per rank).
3. Under ``torchrun --nproc-per-node=2`` again, both ranks measure both configurations at the same
   time, interleaved for ``--rounds`` rounds, and report each rank's median samples/s.

Writes RANKS.md and ranks.json to ``benchmarks/results/ranks/`` (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import harness  # noqa: E402

N_SAMPLES = 8192
"""Small enough to generate in a moment, large enough that no window wraps an epoch often."""


def _workload() -> Any:
    from autotune.workloads import cifar10_workload

    return cifar10_workload(N_SAMPLES, seed=0)


def _tune(budget: float) -> dict[str, Any]:
    from autotune import tune_loader

    w = _workload()
    result = tune_loader(w.dataset, w.step, batch_size=w.batch_size, budget_s=budget,
                         pretransform="none", cache=False, progress=False)
    return result.to_dict()


def _rank_main(mode: str, out: Path, budget: float, rounds: int) -> None:
    """Runs inside each torchrun rank."""
    import torch.distributed as dist

    from autotune.measure import MeasureLimits, measure
    from autotune.space import Candidate

    dist.init_process_group("gloo", timeout=timedelta(seconds=600))
    rank = dist.get_rank()
    if mode == "tune":
        data = _tune(budget)
        if rank == 0:
            (out / "together.json").write_text(json.dumps(data))
    else:
        configs = json.loads((out / "configs.json").read_text())
        w = _workload()
        limits = MeasureLimits(window_s=2.0)
        seen: dict[str, list[float]] = {name: [] for name in configs}
        for r in range(rounds):
            names = list(configs)[r % 2:] + list(configs)[: r % 2]
            for name in names:
                dist.barrier()  # both ranks start the same configuration at the same moment
                m = measure(w.dataset, Candidate.from_dict(configs[name]), step=w.step, limits=limits)
                seen[name].append(m.samples_per_s)
        (out / f"measured-rank{rank}.json").write_text(json.dumps(seen))
    dist.barrier()
    dist.destroy_process_group()


def _torchrun(args: list[str]) -> None:
    exe = shutil.which("torchrun", path=os.path.dirname(sys.executable))
    cmd = [exe] if exe else [sys.executable, "-m", "torch.distributed.run"]
    cmd += ["--standalone", "--nproc-per-node=2", __file__, *args]
    subprocess.run(cmd, check=True, env=dict(os.environ, PYTHONWARNINGS="ignore"))


def write_markdown(report: dict[str, Any], path: Path) -> None:
    """The page: each configuration's settings and median samples/s per rank, and the node's ratio."""
    from autotune.space import Candidate

    lines = [
        "# Two ranks on one node: tuned alone against tuned together",
        "",
        f"Run on {report.get('date', 'a date not recorded')} with"
        + (f" `{report['command']}`" if "command" in report else " options not recorded")
        + f": a {report['budget_s']:g} s tuning budget, {report['rounds']} interleaved rounds in which"
        " both ranks measure the same configuration at once. What each step is: the docstring of"
        " `benchmarks/scripts/ranks.py`.",
        "",
        "| configuration | settings | rank 0 samples/s | rank 1 samples/s | node samples/s |",
        "|---|---|---:|---:|---:|",
    ]
    for name, c in report["configs"].items():
        medians = c["median_per_rank"]
        lines.append(f"| {name} | `{Candidate.from_dict(c['candidate']).label()}` |"
                     f" {medians[0]:.0f} | {medians[1]:.0f} | {sum(medians):.0f} |")
    ratio = report["together_over_alone"]
    lines += ["", "Node throughput, tuned together / tuned alone (medians): "
              + ("n/a" if ratio is None else f"{ratio:.2f}x") + ".", ""]
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python benchmarks/scripts/ranks.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--budget", type=float, default=30.0)
    parser.add_argument("--rounds", type=int, default=3)
    harness.add_out(parser, __file__)
    harness.add_render(parser, "RANKS.md")
    parser.add_argument("--rank-mode", choices=["tune", "measure"], help=argparse.SUPPRESS)
    parser.add_argument("--work", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.rank_mode:
        _rank_main(args.rank_mode, args.work, args.budget, args.rounds)
        return 0
    if harness.render(args, "RANKS.md", write_markdown):
        return 0

    from autotune.space import Candidate

    work = Path(tempfile.mkdtemp(prefix="autotune-ranks-"))
    try:
        alone = _tune(args.budget)
        _torchrun(["--rank-mode", "tune", "--work", str(work), "--budget", str(args.budget)])
        together = json.loads((work / "together.json").read_text())

        def candidate(result: dict[str, Any]) -> dict[str, Any]:
            kw = result["loader_kwargs"]
            return Candidate(
                batch_size=kw["batch_size"], num_workers=kw["num_workers"],
                pin_memory=kw.get("pin_memory", False), prefetch_factor=kw.get("prefetch_factor"),
                persistent_workers=kw.get("persistent_workers", False),
                pretransform=result["pretransform"], torch_threads=result["torch_threads"],
            ).to_dict()

        configs = {"tuned alone": candidate(alone), "tuned together": candidate(together)}
        (work / "configs.json").write_text(json.dumps(configs))
        _torchrun(["--rank-mode", "measure", "--work", str(work), "--rounds", str(args.rounds)])
        per_rank = [json.loads((work / f"measured-rank{r}.json").read_text()) for r in (0, 1)]
    finally:
        shutil.rmtree(work, ignore_errors=True)

    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/scripts/ranks.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "budget_s": args.budget, "rounds": args.rounds, "configs": {},
    }
    print(f"{'configuration':<16} {'workers':>7} {'threads':>7} {'rank 0 /s':>10} {'rank 1 /s':>10}"
          f" {'node /s':>9}")
    for name, cfg in configs.items():
        medians = [statistics.median(r[name]) for r in per_rank]
        report["configs"][name] = {"candidate": cfg, "median_per_rank": medians,
                                   "per_rank_samples_per_s": [r[name] for r in per_rank]}
        print(f"{name:<16} {cfg['num_workers']:>7} {cfg['torch_threads'] or '-':>7}"
              f" {medians[0]:>10.0f} {medians[1]:>10.0f} {sum(medians):>9.0f}")
    a, b = (sum(report["configs"][n]["median_per_rank"]) for n in configs)
    report["together_over_alone"] = b / a if a else None
    print(f"node throughput, tuned together / tuned alone: {report['together_over_alone']:.2f}x")
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "ranks.json").write_text(json.dumps(report, indent=2))
    write_markdown(report, args.out / "RANKS.md")
    return 0


if __name__ == "__main__":
    sys.exit(main())
