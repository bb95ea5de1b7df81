"""The benchmark suite: the tuner against PyTorch's defaults, rules of thumb and an exhaustive grid.

    python -m benchmarks [--workload NAME ...] [--budget 60] [--rounds 5] [--top-k 3] [--max-workers N]
                         [--gpu] [--quick] [--out DIR] [--from-json PATH]

(or ``python benchmarks/scripts/suite.py``). Writes SUITE.md, suite.json and suite.png to
``benchmarks/results/suite/`` (``--gpu``: its ``gpu/`` folder; ``--out`` elsewhere). ``--quick`` checks
that the suite runs (tiny budgets, a reduced grid, one round); its figures mean nothing, so unless
``--out`` says otherwise it writes them to a new temporary folder and leaves the committed results
alone.

# NOTE [ Benchmark protocol ]
# For each workload, in one process and one run:
# 1. Tune: ``tune_loader`` with the workload's batch size and the run's budget (no profile cache), timed.
# 2. Grid: every point of the same search space (built as ``tune_loader`` builds it, see
#    ``tuner_space``) measured once with the same MeasureLimits the tuner uses, timed. Pre-transform
#    caches are dropped before the tuning and before the grid, so each pays its own cache builds.
# 3. Rounds: the named configurations (PyTorch's defaults, the rules of thumb, an over-provisioned
#    loader, the tuned candidate and the grid's best few points) are measured again side by side,
#    interleaved, for ``rounds`` rounds, the order rotated each round, so slow drifts of a shared
#    machine hit every configuration alike. Each figure is the median over the rounds; the spread is
#    (max - min) / median. The oracle is the grid finalist with the best median.
# Every measurement is ``autotune.measure.measure`` with the same limits, so every figure comes from
# the same protocol (NOTE [ Measurement protocol ] in autotune/measure.py). Throughput is compared per
# sample, so the over-provisioned loader's smaller batch size stays comparable. The epoch-aware score
# (NOTE [ Score ] in autotune/study.py), which the tuner maximises, is reported beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import IterableDataset  # noqa: E402

from autotune import api, plan, tune_loader  # noqa: E402
from autotune import pretransform as pt  # noqa: E402
from autotune import workloads as wl  # noqa: E402
from autotune.decide import score  # noqa: E402
from autotune.exceptions import CandidateError  # noqa: E402
from autotune.machine import detect_machine  # noqa: E402
from autotune.measure import MeasureLimits, measure  # noqa: E402
from autotune.space import Candidate, SearchSpace, build_space, resolve_in_order  # noqa: E402
from benchmarks._common import harness, output  # noqa: E402
from benchmarks._common.stats import rotated  # noqa: E402

WORKLOAD_NAMES = ("cifar10-like", "imagefolder-jpeg", "latency", "tensor")
"""Every workload of the suite, in the order it runs."""

OVERPROVISIONED = (20, 16)
"""(num_workers, batch_size) of the over-provisioned loader: a setting seen in the wild on small boxes."""

EPOCHS = api.DEFAULT_EPOCHS
"""Epochs the epoch-aware score amortises start-up and cache builds over: the tuner's default."""

GRID_MAX_WORKERS = {"cifar10-like": 4, "imagefolder-jpeg": 4, "tensor": 4}
"""The worker bound for the tuner and the grid alike, where it is below the machine's.

NOTE [ Reduced grid ]: the machine's bound is 4 workers per CPU (8 on two CPUs), which with 4 prefetch
factors, 2 thread counts and 2 pre-transforms is 132 points per workload, about 25 minutes of grid on
a shared two-core machine. For the CPU-bound workloads more than two workers per CPU has never been
faster (they compete for the same cores), so those spaces stop at 4 workers, for the tuner too; the
latency workload, whose workers mostly wait, keeps the full bound.
"""

HEURISTICS = ("workers=cpus", "rule-of-thumb", "over-provisioned")
"""The named configurations a user would pick without measuring (PyTorch's defaults aside)."""


@dataclass(frozen=True)
class Settings:
    """One run of the suite."""

    budget_s: float
    rounds: int
    top_k: int
    quick: bool
    device: str = "cpu"
    max_workers: int | None = None
    """Upper bound on ``num_workers`` for the tuner and the grid alike (``None``: the machine's)."""
    pretransform: str | tuple[str, ...] = "auto"
    """Pre-transform strategies for the tuner and the grid alike."""
    seed: int = 0


@dataclass
class ConfigResult:
    """One named configuration measured in the interleaved rounds."""

    name: str
    candidate: Candidate
    samples_per_s: list[float] = field(default_factory=list)
    scores: list[float] = field(default_factory=list)
    busy: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples_per_s) if self.samples_per_s else 0.0

    @property
    def median_score(self) -> float:
        return statistics.median(self.scores) if self.scores else 0.0

    @property
    def spread(self) -> float:
        med = self.median
        return (max(self.samples_per_s) - min(self.samples_per_s)) / med if med > 0 else 0.0

    def to_dict(self, default_median: float) -> dict[str, Any]:
        return {
            "label": self.candidate.label(),
            "candidate": self.candidate.to_dict(),
            "samples_per_s": self.samples_per_s,
            "median_samples_per_s": self.median,
            "min_samples_per_s": min(self.samples_per_s, default=0.0),
            "max_samples_per_s": max(self.samples_per_s, default=0.0),
            "spread": self.spread,
            "scores": self.scores,
            "median_score": self.median_score,
            "median_busy": statistics.median(self.busy) if self.busy else 0.0,
            "ratio_to_default": self.median / default_median if default_median > 0 else None,
            "failures": self.failures,
        }


def size(dataset: Any) -> int:
    """``len(dataset)``: every workload here is a map-style dataset with a length."""
    return len(dataset)


def log(message: str) -> None:
    print(f"[bench {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


# --------------------------------------------------------------------------------------------------
# Workloads


def make_workload(name: str, folder: Path, *, quick: bool, device: str) -> wl.Workload:
    """The workload ``name``, built from data made here (images are written under ``folder``)."""
    if name == "cifar10-like":
        # 10 000 images: a RAM cache builds in about 3 s on one core, as a real CIFAR-10 subset would.
        return wl.cifar10_workload(1_000 if quick else 10_000, device=device)
    if name == "imagefolder-jpeg":
        root = wl.write_image_folder(folder / "images", n=200 if quick else 2_000,
                                     size=32 if quick else 64, fmt="JPEG")
        return wl.imagefolder_workload(root, size=32, device=device)
    if name == "latency":
        # 1024 samples at 5 ms: one epoch in the main process takes about 5 s, as does a RAM cache
        # build, which stays within the tuner's build-time limit for the default budget.
        return wl.latency_workload(256 if quick else 1_024, delay_s=0.002 if quick else 0.005)
    if name == "tensor":
        return wl.tensor_workload(2_000 if quick else 20_000, device=device)
    raise ValueError(f"unknown workload {name!r}; use one of {WORKLOAD_NAMES}.")


# --------------------------------------------------------------------------------------------------
# The tuner's space and limits


def requested_pretransforms(settings: Settings) -> tuple[str, ...]:
    if settings.pretransform == "auto":
        return pt.STRATEGIES
    if isinstance(settings.pretransform, str):
        return (settings.pretransform,)
    return tuple(settings.pretransform)


def tuner_space(dataset: Any, *, batch_size: int, device: torch.device, settings: Settings,
                pretransforms: Sequence[str] | None = None) -> SearchSpace:
    """The space ``tune_loader`` searches for these arguments (one process, no distributed ranks),
    built by the same functions; ``pretransforms`` skips the planning with the strategies known."""
    machine = detect_machine()
    if pretransforms is None:
        pretransforms, _ = plan.pretransform_choices(
            dataset, requested_pretransforms(settings), device=device, machine=machine,
            budget_s=settings.budget_s,
        )
    return build_space(
        machine, batch_size=batch_size, dataset_len=len(dataset), cuda=device.type == "cuda",
        pretransforms=pretransforms, max_workers=settings.max_workers, epochs=EPOCHS, local_world_size=1,
        thread_workers=not isinstance(dataset, IterableDataset), max_threads=settings.max_workers,
        in_order_choices=resolve_in_order(None, shuffle=True),
    )


def refused_by_tuner(trials: Sequence[Any]) -> set[str]:
    """Pre-transform strategies the tuner recorded as refused for this dataset (NOTE [ Search ] 1)."""
    return {
        t.candidate.pretransform for t in trials
        if t.state == "infeasible" and (t.reason or "").startswith("pretransform=")
        and t.candidate.num_workers == 0
    }


def tuner_limits(budget_s: float) -> MeasureLimits:
    """The MeasureLimits ``tune_loader`` measures with for ``budget_s``."""
    return plan.measure_limits(budget_s)


def heuristic_configs(batch_size: int, cpus: int, local_world_size: int = 1) -> dict[str, Candidate]:
    """PyTorch's defaults and what users pick without measuring; PyTorch defaults for the rest."""

    def workers(n: int, bs: int = batch_size) -> Candidate:
        return Candidate(batch_size=bs, num_workers=n, prefetch_factor=2)

    return {
        "default": Candidate(batch_size=batch_size),
        "workers=cpus": workers(cpus),
        # The rule behind a popular training framework's "consider increasing num_workers" warning.
        "rule-of-thumb": workers(max(1, cpus // local_world_size - 1)),
        "over-provisioned": workers(OVERPROVISIONED[0], OVERPROVISIONED[1]),
    }


# --------------------------------------------------------------------------------------------------
# Phases


def measure_once(w: wl.Workload, c: Candidate, *, device: torch.device, limits: MeasureLimits,
                 seed: int) -> tuple[dict[str, Any], float]:
    """One measurement of ``c`` as a JSON-able record, and how long it took."""
    t0 = time.monotonic()
    try:
        m = measure(w.dataset, c, step=w.step, device=device, limits=limits, seed=seed)
    except CandidateError as err:
        return {"state": "failed", "reason": f"{type(err).__name__}: {err}"}, time.monotonic() - t0
    record = {
        "state": "complete",
        "samples_per_s": m.samples_per_s,
        "score": score(m, c, size(w.dataset), EPOCHS),
        "busy": m.busy,
        "startup_s": m.startup_s,
        "build_s": m.build_s,
    }
    return record, time.monotonic() - t0


def run_tuner(w: wl.Workload, *, device: torch.device, settings: Settings) -> dict[str, Any]:
    pt.clear_builds()
    t0 = time.monotonic()
    result = tune_loader(
        w.dataset, w.step, batch_size=w.batch_size, budget_s=settings.budget_s, device=device,
        cache=False, progress=False, max_workers=settings.max_workers,
        pretransform=settings.pretransform, epochs=EPOCHS, seed=settings.seed,
    )
    wall = time.monotonic() - t0
    tried = sorted({r.candidate.label() for r in result.trials if r.state == "complete"})
    # When the winner was first measured: how much of the budget the search needed to find it; and
    # where the rest went: candidates tried after it (the convergence check) and the final rounds.
    elapsed, found_s, after_winner, final_s = 0.0, None, 0, 0.0
    for r in result.trials:
        if r.phase == "final":
            final_s += r.duration_s
            continue
        elapsed += r.duration_s
        if found_s is None and r.state == "complete" and r.candidate == result.candidate:
            found_s = elapsed
        elif found_s is not None and r.state in ("complete", "pruned", "failed"):
            after_winner += 1
    return {
        "candidate": result.candidate,
        "tuning_s": wall,
        "reported_tuning_s": result.tuning_s,
        "reported_samples_per_s": result.samples_per_s,
        "reported_speedup": result.speedup,
        "trials": len(result.trials),
        "measured": len(tried),
        "measured_labels": tried,
        "winner_found_s": found_s,
        "search_s": elapsed,
        "tried_after_winner": after_winner,
        "final_s": final_s,
        "records": result.trials,
    }


def run_grid(w: wl.Workload, space: SearchSpace, *, device: torch.device, limits: MeasureLimits,
             seed: int) -> dict[str, Any]:
    pt.clear_builds()
    points: list[dict[str, Any]] = []
    t0 = time.monotonic()
    for c in space.grid():
        record, took = measure_once(w, c, device=device, limits=limits, seed=seed)
        points.append({"label": c.label(), "candidate": c.to_dict(), "duration_s": took, **record})
    return {"total_s": time.monotonic() - t0, "size": len(points), "points": points}


def grid_finalists(points: Sequence[dict[str, Any]], top_k: int) -> list[Candidate]:
    """The ``top_k`` grid points by epoch-aware score, plus the fastest per sample if not among them."""
    done = [p for p in points if p["state"] == "complete"]
    by_score = sorted(done, key=lambda p: -p["score"])[:top_k]
    by_sps = max(done, key=lambda p: p["samples_per_s"], default=None)
    chosen = [*by_score, *([by_sps] if by_sps is not None else [])]
    unique: list[Candidate] = []
    for p in chosen:
        c = Candidate.from_dict(p["candidate"])
        if c not in unique:
            unique.append(c)
    return unique


def run_rounds(w: wl.Workload, configs: dict[str, Candidate], *, device: torch.device,
               limits: MeasureLimits, rounds: int, seed: int,
               on_measured: Callable[[str], None] | None = None) -> dict[str, ConfigResult]:
    """Measure every distinct candidate once per round, interleaved, the order rotated each round."""
    pt.clear_builds()
    distinct = list(dict.fromkeys(configs.values()))
    per_candidate: dict[Candidate, list[dict[str, Any]]] = {c: [] for c in distinct}
    for r in range(rounds):
        for c in rotated(distinct, r):
            record, _ = measure_once(w, c, device=device, limits=limits, seed=seed + r)
            per_candidate[c].append(record)
            if on_measured is not None:
                on_measured(f"round {r + 1}/{rounds} {c.label()}: "
                            + (f"{record['samples_per_s']:.0f} samples/s"
                               if record["state"] == "complete" else record["reason"]))
    results: dict[str, ConfigResult] = {}
    for name, c in configs.items():
        res = ConfigResult(name, c)
        for record in per_candidate[c]:
            if record["state"] == "complete":
                res.samples_per_s.append(record["samples_per_s"])
                res.scores.append(record["score"])
                res.busy.append(record["busy"])
            else:
                res.failures.append(record["reason"])
        results[name] = res
    return results


# --------------------------------------------------------------------------------------------------
# One workload, end to end


def ratio(a: float, b: float) -> float | None:
    return a / b if b > 0 else None


def run_workload(w: wl.Workload, settings: Settings) -> dict[str, Any]:
    device = torch.device(settings.device)
    cpus = detect_machine().usable_cpus
    if settings.max_workers is None and not settings.quick:
        settings = replace(settings, max_workers=GRID_MAX_WORKERS.get(w.name))
    log(f"{w.name}: {w.description}")
    tuned = run_tuner(w, device=device, settings=settings)
    tuned_c: Candidate = tuned.pop("candidate")
    trials = tuned.pop("records")
    log(f"{w.name}: tuned in {tuned['tuning_s']:.1f} s -> {tuned_c.label()}")

    space = tuner_space(w.dataset, batch_size=w.batch_size, device=device, settings=settings)
    # Cross-check: the strategies the tuner itself used (the requested ones less those it refused).
    used = tuple(s for s in requested_pretransforms(settings)
                 if s not in refused_by_tuner(trials) and (s != "device" or device.type == "cuda"))
    mismatch = None
    if set(used or ("none",)) != set(space.pretransforms):
        mismatch = (f"the copy of api.py chose {space.pretransforms}, the tuner {used};"
                    " the grid uses the tuner's")
        log(f"{w.name}: {mismatch}")
        space = tuner_space(w.dataset, batch_size=w.batch_size, device=device, settings=settings,
                            pretransforms=used or ("none",))
    limits = tuner_limits(settings.budget_s)
    if settings.quick:
        limits = replace(limits, trial_timeout_s=max(limits.trial_timeout_s, QUICK_TRIAL_TIMEOUT_S))
    log(f"{w.name}: space of {space.size()} points (workers 0..{space.max_workers}, prefetch"
        f" {space.prefetch_factors}, threads {space.torch_threads}, pretransforms {space.pretransforms});"
        f" window {limits.window_s:.2f} s")
    grid = run_grid(w, space, device=device, limits=limits, seed=settings.seed)
    log(f"{w.name}: grid of {grid['size']} points in {grid['total_s']:.1f} s")

    finalists = grid_finalists(grid["points"], settings.top_k)
    configs = heuristic_configs(w.batch_size, cpus)
    configs["tuned"] = tuned_c
    for i, c in enumerate(finalists, 1):
        configs[f"grid #{i}"] = c
    results = run_rounds(w, configs, device=device, limits=limits, rounds=settings.rounds,
                         seed=settings.seed, on_measured=lambda s: log(f"{w.name}: {s}"))

    grid_names = [n for n in results if n.startswith("grid #")]
    oracle = max(grid_names, key=lambda n: results[n].median)
    oracle_score = max(grid_names, key=lambda n: results[n].median_score)
    best_heuristic = max(HEURISTICS, key=lambda n: results[n].median)
    default = results["default"].median
    t = results["tuned"]
    headline = {
        "oracle": oracle,
        "oracle_by_score": oracle_score,
        "best_heuristic": best_heuristic,
        "tuned_over_oracle": ratio(t.median, results[oracle].median),
        "tuned_over_oracle_score": ratio(t.median_score, results[oracle_score].median_score),
        "tuned_over_default": ratio(t.median, default),
        "tuned_over_default_score": ratio(t.median_score, results["default"].median_score),
        "tuned_over_best_heuristic": ratio(t.median, results[best_heuristic].median),
        "tuned_over_each_heuristic": {n: ratio(t.median, results[n].median) for n in HEURISTICS},
        "tuning_over_grid_time": ratio(tuned["tuning_s"], grid["total_s"]),
    }
    oracle_c = results[oracle].candidate
    return {
        "name": w.name,
        "description": w.description,
        "batch_size": w.batch_size,
        "dataset_len": size(w.dataset),
        "space": {
            "size": space.size(),
            "max_workers": space.max_workers,
            "prefetch_factors": list(space.prefetch_factors),
            "torch_threads": list(space.torch_threads),
            "pretransforms": list(space.pretransforms),
            "persistent_workers": space.persistent,
            "tuned_in_space": space.check(tuned_c) is None,
            "mismatch": mismatch,
        },
        "window_s": limits.window_s,
        "max_workers_argument": settings.max_workers,
        "tuning": {**tuned, "candidate": tuned_c.to_dict(), "label": tuned_c.label(),
                   "tried_oracle": oracle_c.label() in tuned["measured_labels"]},
        "grid": grid,
        "configs": {n: r.to_dict(default) for n, r in results.items()},
        "headline": headline,
        "targets": targets(headline),
    }


TARGETS: dict[str, tuple[str, float]] = {
    "tuned/oracle >= 0.95": ("tuned_over_oracle", 0.95),
    "tuned/default >= 1.0": ("tuned_over_default", 1.0),
    "tuned >= every rule of thumb": ("tuned_over_best_heuristic", 1.0),
    "tuning time <= 15 % of grid time": ("tuning_over_grid_time", 0.15),
}
"""The claims checked for every workload: (headline key, threshold)."""

STRONG_SPEEDUP = {"cifar10-like": 3.0, "latency": 3.0}
"""Workloads where the tuned loader must beat PyTorch's defaults by this factor."""


def targets(headline: dict[str, Any]) -> dict[str, dict[str, Any]]:
    """Each target with its value and whether it is met (the time ratio must stay below its bound)."""
    out: dict[str, dict[str, Any]] = {}
    for label, (key, bound) in TARGETS.items():
        value = headline.get(key)
        below = key == "tuning_over_grid_time"
        met = value is not None and (value <= bound if below else value >= bound)
        out[label] = {"key": key, "value": value, "bound": bound, "met": met}
    return out


def with_strong_target(result: dict[str, Any]) -> dict[str, Any]:
    """Add the per-workload speed-up target (3x the defaults) where the suite claims one."""
    bound = STRONG_SPEEDUP.get(result["name"])
    if bound is None:
        return result
    value = result["headline"]["tuned_over_default"]
    result["targets"][f"tuned/default >= {bound:g}x"] = {
        "key": "tuned_over_default", "value": value, "bound": bound,
        "met": value is not None and value >= bound,
    }
    return result


QUICK_TRIAL_TIMEOUT_S = 30.0
"""Quick mode's floor on the per-measurement time limit: its tiny budget would time out 20 workers."""


def quick_settings(settings: Settings) -> Settings:
    """A run that only checks the suite works: tiny budget, a grid of the main-process points only."""
    return replace(settings, quick=True, max_workers=0 if settings.max_workers is None else
                   settings.max_workers, pretransform="none", rounds=1, top_k=1)


# --------------------------------------------------------------------------------------------------
# The command line


DEFAULT_BUDGET_S = 60.0
"""The tuner's own default budget, so the benchmark measures what a user gets."""

QUICK_BUDGET_S = 5.0
"""Enough for the baseline and a few trials: quick mode checks the suite runs, not the figures."""

DEFAULT_ROUNDS = 5
"""Interleaved rounds: the median of five shrugs off one or two disturbed measurements."""

DEFAULT_TOP_K = 3
"""Grid points re-measured as oracle candidates (plus the grid's fastest per sample)."""

QUICK_OUT_PREFIX = "autotune-bench-quick-"
"""Prefix of the temporary folder a ``--quick`` run writes to when ``--out`` is not given."""

PAGE, FIGURES, PLOT = "SUITE.md", "suite.json", "suite.png"
"""What a run writes: the page, every figure, and the plot."""


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="a short smoke run (tiny budgets, reduced grid)")
    p.add_argument("--workload", action="append", choices=WORKLOAD_NAMES,
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
                   help=f"folder for {PAGE}, {FIGURES} and {PLOT} (default: benchmarks/results/suite/,"
                   " with --gpu its gpu/ folder; with --quick, a new temporary folder)")
    p.add_argument("--from-json", type=Path, default=None, metavar="PATH",
                   help=f"measure nothing: write {PAGE} and {PLOT} again from a {FIGURES}, beside it"
                   " unless --out says otherwise")
    args = p.parse_args(argv)
    for name in ("budget", "rounds", "top_k", "max_workers"):
        value = getattr(args, name)
        if value is not None and value <= (0 if name != "max_workers" else -1):
            p.error(f"--{name.replace('_', '-')}={value} must be positive")
    return args


def out_folder(args: argparse.Namespace) -> Path:
    """``--out``; else the folder of the figures ``--from-json`` renders; else a new temporary folder
    for a smoke run; else the committed results' folder (a GPU run's in its ``gpu/`` folder)."""
    if args.out is not None:
        return Path(args.out)
    if args.from_json is not None:
        return Path(args.from_json).parent
    if args.quick:
        return Path(tempfile.mkdtemp(prefix=QUICK_OUT_PREFIX))
    folder = harness.results_folder(__file__)
    return folder / "gpu" if args.gpu else folder


def render(source: Path, out: Path) -> int:
    """The page and the plot from the figures of an earlier run."""
    data = json.loads(source.read_text())
    out.mkdir(parents=True, exist_ok=True)
    output.write_markdown(data, out / PAGE)
    output.write_plot(data, out / PLOT)
    print(f"benchmarks: wrote {out / PAGE} and {out / PLOT} from {source}")
    return 0


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.from_json is not None:
        return render(args.from_json, out_folder(args))
    if args.gpu and not torch.cuda.is_available():
        print("benchmarks: --gpu asked for, but CUDA is not available on this machine; skipped.")
        return 0
    settings = Settings(
        budget_s=args.budget or (QUICK_BUDGET_S if args.quick else DEFAULT_BUDGET_S),
        rounds=args.rounds or DEFAULT_ROUNDS,
        top_k=args.top_k or DEFAULT_TOP_K,
        quick=args.quick,
        device="cuda" if args.gpu else "cpu",
        max_workers=args.max_workers,
    )
    if args.quick:
        settings = quick_settings(settings)
        settings = replace(settings, rounds=args.rounds or 1, top_k=args.top_k or 1)
    names = args.workload or list(WORKLOAD_NAMES)
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
            "epochs": EPOCHS,
        },
        "workloads": {},
    }
    with tempfile.TemporaryDirectory(prefix="autotune-bench-") as tmp:
        for name in names:
            workload = make_workload(name, Path(tmp) / name, quick=settings.quick, device=settings.device)
            result = with_strong_target(run_workload(workload, settings))
            data["workloads"][workload.name] = result
            data["meta"]["total_s"] = time.monotonic() - started
            # Written after every workload, so a long run that is stopped keeps what it measured.
            output.write_json(data, out / FIGURES)
    output.write_markdown(data, out / PAGE)
    plot = output.write_plot(data, out / PLOT)
    print(f"benchmarks: wrote {out / PAGE}, {out / FIGURES}"
          + (f", {plot}" if plot else " (no plot: matplotlib is not installed)")
          + f" in {data['meta']['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
