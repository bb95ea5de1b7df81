"""Inside a container's limits: PyTorch's defaults, ``num_workers=4`` and the tuned result side by side.

    python benchmarks/scripts/containers.py [--rounds 5] [--quick] [--out DIR]

# NOTE [ Containers benchmark ]
# 1. Each environment is made for real, for a child process of this script (root on Linux; an
#    environment that cannot be made is reported as skipped, with the reason):
#    shm-64m: a private mount namespace with a 64 MiB tmpfs on /dev/shm, Docker's default;
#    cpu-1:   a child of this process's cgroup with a CPU quota of one CPU (v1 ``cpu.cfs_quota_us``,
#             v2 ``cpu.max``), as a container started with ``--cpus=1``;
#    shm-1g:  a 1 GiB /dev/shm, the fix (``docker run --shm-size=1g``): the control that measures what
#             the fix brings, as the ratio of its tuned/defaults to shm-64m's (each against the
#             defaults of its own rounds, so the two runs' different moments cancel out).
# 2. In the child, per workload (the seed's CIFAR-10-shaped workload and a JPEG folder, each with the
#    small CNN's training step): ``tune_loader`` (BUDGET_S, no profile cache), then PyTorch's
#    defaults, ``num_workers=4`` (what people write: prefetch 2, no persistent workers) and the tuned
#    result measured with ``autotune.measure.measure`` in interleaved rounds, the order rotated each
#    round, so a slow drift of the shared machine hits all three alike. Figures are medians over the
#    rounds, the spread (max - min) / median; ratios compare medians of the same rounds, by
#    steady-state samples/s and by the epoch score (NOTE [ Score ] in autotune/decide.py: a cache pays
#    its build, workers that are not persistent their start-up, over EPOCHS epochs). The machine's
#    load (one-minute average per CPU) is read before every round.
# 3. A configuration that fails (a worker that runs out of /dev/shm, a timeout) is recorded with its
#    reason: "crashed". Targets: the tuned result never crashes where the defaults run, and on the
#    seed workload in shm-64m it is at least 1.5x the defaults by epoch score.
# Writes CONTAINERS.md and containers.json to benchmarks/results/containers/ (or --out). The
# environments' helpers (a small /dev/shm, a child cgroup) are also what tests/test_containers.py runs
# its scripts in.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks._common import harness  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

ENVIRONMENTS = ("shm-64m", "cpu-1", "shm-1g")
"""Every environment, in the order it runs (NOTE [ Containers benchmark ] 1)."""

WORKLOADS = ("cifar10-like", "imagefolder-jpeg")
"""The seed's workload and a folder of JPEG files."""

CONFIGS = ("defaults", "num_workers=4", "tuned")

BUDGET_S = 60.0
"""The tuning budget: ``tune_loader``'s default."""

QUICK_BUDGET_S = 12.0
"""The tuning budget of ``--quick``: a smoke run, not a measurement."""

EPOCHS = 10
"""Epochs the score amortises a cache's build and the workers' start-up over."""

TARGET_SPEEDUP = 1.5
"""Tuned over PyTorch's defaults on the seed workload in a 64 MiB /dev/shm, by epoch score."""


class Unavailable(Exception):
    """An environment cannot be made here (not Linux, not root, no unshare, no such controller)."""


# --------------------------------------------------------------------------------------------------
# Environments


def small_shm(size_mib: int) -> list[str]:
    """A command prefix that runs what follows in a private mount namespace whose /dev/shm is a tmpfs
    of ``size_mib`` MiB; it goes with the process, and the host's /dev/shm is never touched."""
    if not sys.platform.startswith("linux") or shutil.which("unshare") is None:
        raise Unavailable("a private /dev/shm needs unshare(1) from util-linux on Linux")
    script = f'mount -t tmpfs -o size={size_mib}m tmpfs /dev/shm && exec "$@"'
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]


def in_cgroup(path: str) -> list[str]:
    """A command prefix that moves the process into the cgroup at ``path`` before it execs the rest."""
    return ["sh", "-c", 'echo $$ > "$0/cgroup.procs" && exec "$@"', path]


@contextlib.contextmanager
def child_cgroup(controller: str, settings: dict[str, dict[str, str]], name: str) -> Iterator[str]:
    """A child of this process's cgroup for ``controller``, called ``name``, with the files of
    ``settings[version]`` written; removed afterwards (once the processes in it have exited)."""
    from autotune.machine import own_cgroup

    if not sys.platform.startswith("linux"):
        raise Unavailable("cgroups are Linux's")
    if os.geteuid() != 0:
        raise Unavailable("making a cgroup needs root")
    found = own_cgroup(controller)
    if found is None:
        raise Unavailable(f"no {controller} controller is mounted")
    version, folder = found
    path = os.path.join(folder, name)
    try:
        os.mkdir(path)
    except OSError as err:
        raise Unavailable(f"cannot make a cgroup under {folder}: {err.strerror}") from err
    try:
        for file, value in settings[version].items():
            if not os.path.exists(os.path.join(path, file)):
                raise Unavailable(f"{file} is not in the new {version} cgroup: the {controller}"
                                  " controller is not enabled for children")
            with open(os.path.join(path, file), "w") as fh:
                fh.write(value)
        yield path
    finally:
        for _ in range(50):  # the kernel may take a moment to let go of a cgroup just left
            try:
                os.rmdir(path)
                break
            except FileNotFoundError:
                break
            except OSError:
                time.sleep(0.1)


ONE_CPU = {"v1": {"cpu.cfs_period_us": "100000", "cpu.cfs_quota_us": "100000"},
           "v2": {"cpu.max": "100000 100000"}}
"""A quota of one CPU, for either cgroup version."""


@contextlib.contextmanager
def environment(name: str) -> Iterator[list[str]]:
    """The command prefix that runs a child in environment ``name`` (NOTE [ Containers benchmark ] 1)."""
    if name == "shm-64m":
        yield small_shm(64)
    elif name == "shm-1g":
        yield small_shm(1024)
    elif name == "cpu-1":
        with child_cgroup("cpu", ONE_CPU, f"autotune-bench-{os.getpid()}") as path:
            yield in_cgroup(path)
    else:
        raise ValueError(f"unknown environment {name!r}; use one of {ENVIRONMENTS}")


# --------------------------------------------------------------------------------------------------
# The child: tune, then the three configurations in interleaved rounds


def log(message: str) -> None:
    print(f"[containers {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def make_workload(name: str, folder: Path, *, quick: bool) -> Any:
    from autotune import workloads as wl

    if name == "cifar10-like":
        return wl.cifar10_workload(1_000 if quick else 50_000)
    if name == "imagefolder-jpeg":
        root = wl.write_image_folder(folder / "images", n=128 if quick else 2_000, size=64 if quick else 128,
                                     fmt="JPEG")
        w = wl.imagefolder_workload(root, size=56 if quick else 112)
        return replace(w, description=w.description.replace(f" under {root}", ""))  # a temporary folder
    raise ValueError(f"unknown workload {name!r}; use one of {WORKLOADS}")


def run_child(workload_name: str, *, quick: bool, rounds: int) -> dict[str, Any]:
    """Step 2 of the NOTE, in this process (already inside its environment)."""
    import torch

    from autotune import pretransform as pt
    from autotune import report, tune_loader
    from autotune.decide import score
    from autotune.exceptions import CandidateError, TuningFailed
    from autotune.machine import detect_machine
    from autotune.measure import MeasureLimits, measure
    from autotune.space import Candidate

    machine = detect_machine()
    log(f"{workload_name}: {machine.limits_line()}")
    with tempfile.TemporaryDirectory(prefix="autotune-containers-") as tmp:
        w = make_workload(workload_name, Path(tmp), quick=quick)
        t0 = time.monotonic()
        configs = {
            "defaults": Candidate(w.batch_size),
            "num_workers=4": Candidate(w.batch_size, num_workers=4, prefetch_factor=2),
        }
        try:
            result = tune_loader(w.dataset, w.step, batch_size=w.batch_size,
                                 budget_s=QUICK_BUDGET_S if quick else BUDGET_S, epochs=EPOCHS,
                                 cache=False, progress=False)
        except TuningFailed as err:  # recorded: the rounds still compare the other two
            tuned: dict[str, Any] = {"error": str(err)}
        else:
            configs["tuned"] = result.candidate
            tuned = {"label": result.candidate.label(), "loader_kwargs": result.loader_kwargs,
                     "pretransform": result.pretransform, "decision": result.decision,
                     "shm_bound": report.shm_bound(result),
                     "reasons": sorted({t.reason for t in result.trials if t.reason})}
        tuning_s = time.monotonic() - t0
        log(f"  tuned in {tuning_s:.0f} s: {tuned.get('label', tuned.get('error'))}")
        limits = MeasureLimits(window_s=0.5 if quick else 2.0, min_batches=3 if quick else 5,
                               batch_timeout_s=60, trial_timeout_s=120)
        figures: dict[str, dict[str, Any]] = {
            k: {"label": c.label(), "samples_per_s": [], "scores": [], "failures": []}
            for k, c in configs.items()}
        loads: list[float | None] = []
        names = list(configs)
        for r in range(rounds):
            loads.append(_load())
            for name in names[r % len(names):] + names[:r % len(names)]:
                c = configs[name]
                try:
                    m = measure(w.dataset, c, step=w.step, limits=limits, shuffle=True, seed=r)
                except CandidateError as err:
                    figures[name]["failures"].append(f"{type(err).__name__}: {err}")
                    continue
                figures[name]["samples_per_s"].append(m.samples_per_s)
                figures[name]["scores"].append(score(m, c, len(w.dataset), EPOCHS))
            log(f"  round {r + 1}/{rounds}: " + ", ".join(
                f"{k} {_median(f['samples_per_s']):.0f}/s" for k, f in figures.items()))
        pt.clear_builds()
        segments = sorted(os.path.basename(p) for p in Path("/dev/shm").glob("torch_*"))
    for f in figures.values():
        f["median_samples_per_s"] = _median(f["samples_per_s"])
        f["median_score"] = _median(f["scores"])
        f["spread"] = _spread(f["samples_per_s"])
    return {
        "workload": workload_name,
        "description": w.description,
        "batch_size": w.batch_size,
        "limits": machine.limits_line(),
        "torch": torch.__version__,
        "tuning_s": tuning_s,
        "tuned": tuned,
        "configs": figures,
        "load_per_cpu": loads,
        "segments_left": segments,
    }


def _load() -> float | None:
    try:
        return round(os.getloadavg()[0] / max(1, len(os.sched_getaffinity(0))), 2)
    except (OSError, AttributeError):
        return None


def _median(values: list[float]) -> float:
    return statistics.median(values) if values else 0.0


def _spread(values: list[float]) -> float:
    med = _median(values)
    return (max(values) - min(values)) / med if med > 0 else 0.0


# --------------------------------------------------------------------------------------------------
# The parent: every environment, then the report


def run_environment(env: str, *, quick: bool, rounds: int, workloads: list[str]) -> dict[str, Any]:
    """Every workload in a child process inside environment ``env``; skipped with the reason where
    the environment cannot be made."""
    out: dict[str, Any] = {"environment": env, "workloads": []}
    for name in workloads:
        with tempfile.NamedTemporaryFile(suffix=".json") as tmp:
            argv = [sys.executable, "-m", "benchmarks.scripts.containers", "--child", name,
                    "--child-out", tmp.name, "--rounds", str(rounds), *(["--quick"] if quick else [])]
            try:
                with environment(env) as prefix:
                    log(f"{env}: {name}")
                    done = subprocess.run([*prefix, *argv], cwd=ROOT, text=True, stdout=subprocess.PIPE,
                                          env={**os.environ, "PYTHONPATH": str(ROOT)})
            except Unavailable as err:
                return {**out, "skipped": str(err)}
            if done.returncode != 0:
                out["workloads"].append({"workload": name, "error": f"exit {done.returncode}"})
                continue
            out["workloads"].append(json.loads(Path(tmp.name).read_text()))
    return out


def headline(report: dict[str, Any]) -> dict[str, Any]:
    """The targets (NOTE [ Containers benchmark ] 3) and the speed-up the fix brings, measured."""
    by = {(e["environment"], w["workload"]): w for e in report["environments"] for w in e.get("workloads", [])
          if "configs" in w}

    def ratio(w: dict[str, Any], key: str) -> float | None:
        base, tuned = w["configs"]["defaults"][key], w["configs"].get("tuned", {}).get(key, 0.0)
        return tuned / base if base > 0 and tuned > 0 else None

    crashes = [f"{env}/{name}" for (env, name), w in by.items()
               if "tuned" in w["configs"] and w["configs"]["tuned"]["failures"]
               and not w["configs"]["defaults"]["failures"]]
    seed = by.get(("shm-64m", "cifar10-like"))
    seed_ratio = ratio(seed, "median_score") if seed else None
    fix: dict[str, float | None] = {}
    for name in WORKLOADS:
        small, large = by.get(("shm-64m", name)), by.get(("shm-1g", name))
        if small and large:
            a, b = ratio(small, "median_score"), ratio(large, "median_score")
            fix[name] = b / a if a and b else None
    return {"tuned_crashes_where_defaults_run": crashes, "seed_shm64_tuned_over_defaults_score": seed_ratio,
            "seed_target_met": seed_ratio is not None and seed_ratio >= TARGET_SPEEDUP,
            "shm_1g_over_64m_tuned": fix}


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def write_markdown(report: dict[str, Any], path: Path) -> None:
    h = report["headline"]
    lines = [
        "# Inside a container's limits: defaults, num_workers=4 and the tuned result",
        "",
        f"Run {report['date']} on {report['machine']['cpus']} CPUs ({report['machine']['cpu']}),"
        f" {report['rounds']} interleaved rounds per workload{' (--quick)' if report['quick'] else ''};"
        " generated by `python benchmarks/scripts/containers.py` (NOTE [ Containers benchmark ] in the"
        " script says how). The machine is shared: only ratios of medians from the same rounds are"
        " compared; the load is the one-minute average per CPU before each round.",
        "",
        *(["**A --quick smoke run** (small datasets, a short tuning budget): it shows that every"
           " environment and configuration runs end to end, not the figures; `python"
           " benchmarks/scripts/containers.py` on a quiet machine writes them.", ""]
          if report["quick"] else []),
        f"- The tuned result crashed where PyTorch's defaults ran: "
        f"{', '.join(h['tuned_crashes_where_defaults_run']) or 'never'}.",
        f"- Seed workload in a 64 MiB /dev/shm, tuned over the defaults by epoch score:"
        f" {_fmt(h['seed_shm64_tuned_over_defaults_score'])} (target {TARGET_SPEEDUP}x:"
        f" {'met' if h['seed_target_met'] else 'missed'}).",
    ]
    for name, value in h["shm_1g_over_64m_tuned"].items():
        lines.append(f"- What `docker run --shm-size=1g` brings on {name}, measured: the tuned result's"
                     f" speed-up over the defaults is {_fmt(value)} that in 64 MiB.")
    for env in report["environments"]:
        lines += ["", f"## {env['environment']}", ""]
        if "skipped" in env:
            lines.append(f"Skipped: {env['skipped']}.")
            continue
        for w in env["workloads"]:
            if "configs" not in w:
                lines += [f"### {w['workload']}", "", f"The child failed: {w['error']}.", ""]
                continue
            loads = [x for x in w["load_per_cpu"] if x is not None]
            t = w["tuned"]
            tuned = (f"Tuning failed in {w['tuning_s']:.0f} s: {t['error']}" if "error" in t else
                     f"Tuned in {w['tuning_s']:.0f} s to `{t['label']}`"
                     + (" (/dev/shm bound the search)" if t["shm_bound"] else ""))
            lines += [
                f"### {w['workload']}",
                "",
                f"{w['description']}; batch size {w['batch_size']}. Limits: {w['limits']}. {tuned}"
                + f". Load {min(loads, default=0):.2f}-{max(loads, default=0):.2f} per CPU;"
                f" /dev/shm segments left: {len(w['segments_left'])}.",
                "",
                "| config | settings | median samples/s | spread | epoch score | ratio to defaults"
                " (samples/s, score) | crashed |",
                "|---|---|---:|---:|---:|---|---|",
            ]
            base = w["configs"]["defaults"]
            for name in (n for n in CONFIGS if n in w["configs"]):
                c = w["configs"][name]
                r_sps, r_score = (c[k] / base[k] if base[k] else None
                                  for k in ("median_samples_per_s", "median_score"))
                crashed = f"{len(c['failures'])}x: {c['failures'][0][:120]}" if c["failures"] else "no"
                lines.append(f"| {name} | `{c['label']}` | {c['median_samples_per_s']:.0f} |"
                             f" {c['spread']:.0%} | {c['median_score']:.0f} | {_fmt(r_sps)}, {_fmt(r_score)}"
                             f" | {crashed} |")
            lines.append("")
    path.write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small datasets, short tuning, 2 rounds")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for CONTAINERS.md and containers.json (default:"
                        " benchmarks/results/containers/, or a temporary folder with --quick)")
    parser.add_argument("--environments", nargs="*", default=list(ENVIRONMENTS), choices=ENVIRONMENTS)
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--child", choices=WORKLOADS, help=argparse.SUPPRESS)
    parser.add_argument("--child-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    rounds = 2 if args.quick else args.rounds
    if args.child:
        child = run_child(args.child, quick=args.quick, rounds=rounds)
        args.child_out.write_text(json.dumps(child, default=str))
        return 0
    out = args.out or (Path(tempfile.mkdtemp(prefix="autotune-containers-")) if args.quick
                       else harness.results_folder(__file__))
    out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "quick": args.quick,
        "rounds": rounds,
        "machine": {"cpus": os.cpu_count(), "cpu": platform.processor() or platform.machine()},
        "environments": [run_environment(env, quick=args.quick, rounds=rounds, workloads=args.workloads)
                         for env in args.environments],
    }
    report["headline"] = headline(report)
    report["seconds"] = time.monotonic() - t0
    (out / "containers.json").write_text(json.dumps(report, indent=1, default=str) + "\n")
    write_markdown(report, out / "CONTAINERS.md")
    log(f"wrote {out / 'CONTAINERS.md'} and containers.json in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
