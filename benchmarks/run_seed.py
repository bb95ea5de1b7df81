"""``autotune run`` on the seed's training script, then its recommendation pasted in, side by side.

    python benchmarks/run_seed.py [--samples 2048] [--epochs 2] [--rounds 3] [--quick]

NOTE [ The seed benchmark ]
1. A plain training script of the CIFAR-10-shaped workload (``autotune.workloads``: CIFAR10Like with
   the CIFAR-10 training transform, SmallCNN trained by ``make_train_step``) with the seed's setting
   written in it: ``DataLoader(dataset, batch_size=16, shuffle=True, num_workers=20)``.
2. ``autotune run --json`` on it, in a fresh profile folder, for enough epochs to settle. The
   DataLoader keyword arguments it recommends for torch's DataLoader (and ``torch.set_num_threads``
   when it says so) are pasted into a copy of the script.
3. Both scripts run with plain ``python``, each as a fresh process, in interleaved rounds (the order
   alternates), each timing its own training loop: samples over the loop's wall time, worker start-up
   at every epoch included, as the script pays it. Medians over the rounds, the spread is
   (max - min) / median; the ratio is of the medians, and the per-round ratios are kept.
4. The command's overhead: ``python noop.py`` against ``python -m autotune run noop.py``, interleaved,
   for a script that builds no loader and imports torch (as any script with a DataLoader does), and
   for one that imports nothing (where the overhead is mostly torch's own import).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.output import write_json  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
RESULTS_DIR = Path(__file__).resolve().parent

SEED_SETTING = "num_workers=20"
"""The seed's setting, written in the script beside ``batch_size=16, shuffle=True``."""

TARGET_RATIO = 3.0
"""The recommended settings, pasted in, should train at least this many times as fast."""

TARGET_OVERHEAD_S = 1.0
"""``autotune run`` on a script that builds no loader should cost less than this over ``python``."""

DEFAULT_SAMPLES = 2048
"""Samples per epoch: 128 batches of 16, enough for the drop-in to explore within an epoch or two."""

DEFAULT_EPOCHS = 2
"""Epochs per timed run: the seed's setting starts its 20 workers again every epoch."""

TUNE_EPOCHS = 3
"""Epochs of the ``autotune run``: exploration settles within two, the third is served settled."""

DEFAULT_ROUNDS = 3
"""Interleaved rounds of the two scripts: the median of three shrugs off one disturbed run."""

DEFAULT_OVERHEAD_RUNS = 5
"""Runs of each no-loader command for the overhead's median."""

RUN_TIMEOUT_S = 600
"""One script run takes well under a minute here; this only stops a hung one."""

SCRIPT = '''\
"""The seed's training script: CIFAR-10-shaped images, the training transform, a small CNN."""
import json
import sys
import time

import torch
from torch.utils.data import DataLoader

{imports}from autotune.workloads import CIFAR10Like, SmallCNN, cifar_train_transform, make_train_step

samples, epochs = int(sys.argv[1]), int(sys.argv[2])
torch.manual_seed(0)
{threads}dataset = CIFAR10Like(samples, seed=0, transform=cifar_train_transform())
loader = {loader}(dataset, batch_size=16, shuffle=True{settings})
step = make_train_step(SmallCNN(), device="cpu")
start, seen = time.perf_counter(), 0
for epoch in range(epochs):
    for batch in loader:
        step(batch)
        seen += len(batch[1])
print(json.dumps({{"samples": seen, "seconds": time.perf_counter() - start}}))
'''

NOOP_TORCH = "import torch\n\nprint('no loader here')\n"
NOOP_PLAIN = "print('no loader here')\n"


def log(message: str) -> None:
    print(f"[run_seed {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["AUTOTUNE_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _run(argv: list[str], *, cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                                       float]:
    t0 = time.perf_counter()
    done = subprocess.run(argv, cwd=cwd, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    return done, time.perf_counter() - t0


def _throughput(done: subprocess.CompletedProcess[str], what: str) -> float:
    if done.returncode != 0:
        raise RuntimeError(f"{what} exited with {done.returncode}:\n{done.stderr[-3000:]}")
    line = json.loads(done.stdout.strip().splitlines()[-1])
    return float(line["samples"]) / float(line["seconds"])


def _spread(values: list[float]) -> float:
    return (max(values) - min(values)) / statistics.median(values) if values else 0.0


def _script(settings: str, *, threads: int | None = None, loader: str = "DataLoader",
            imports: str = "") -> str:
    return SCRIPT.format(settings=f", {settings}" if settings else "", loader=loader, imports=imports,
                         threads=f"torch.set_num_threads({threads})\n" if threads is not None else "")


def _kwargs(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "batch_size")


def pastes(loader: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """What the report says to paste, as (the changed lines, the script): the lines for torch's
    DataLoader, and, when thread workers or a cache won, the report's first suggestion too."""
    out = {}
    plain, threads = loader["plain_kwargs"], loader.get("plain_torch_threads")
    line = f"DataLoader(dataset, batch_size=16, shuffle=True, {_kwargs(plain)})"
    line = f"torch.set_num_threads({threads}); {line}" if threads is not None else line
    out["pasted: torch DataLoader"] = (line, _script(_kwargs(plain), threads=threads))
    best, best_threads = loader["best"], loader.get("torch_threads")
    if loader["pretransform"] != "none":
        out["pasted: autotune.DataLoader"] = (
            "import autotune; autotune.DataLoader(dataset, batch_size=16, shuffle=True)  # the profile",
            _script("", loader="autotune.DataLoader", imports="import autotune\n"))
    elif loader["loader_class"] == "autotune.ThreadDataLoader":
        kw = {k: v for k, v in best.items() if k != "num_workers"}
        line = f"ThreadDataLoader(dataset, batch_size=16, shuffle=True, {_kwargs(kw)})"
        if best_threads is not None:
            line = f"torch.set_num_threads({best_threads}); {line}"
        out["pasted: ThreadDataLoader"] = (line, _script(
            _kwargs(kw), threads=best_threads, loader="ThreadDataLoader",
            imports="from autotune import ThreadDataLoader\n"))
    return out


def tune(work: Path, *, samples: int, epochs: int) -> dict[str, Any]:
    """``autotune run --json`` on the seed script in a fresh profile folder (NOTE 2)."""
    script = work / "seed_train.py"
    script.write_text(_script(SEED_SETTING))
    report = work / "autotune-run.json"
    done, wall = _run([sys.executable, "-m", "autotune", "run", "--json", str(report), str(script),
                       str(samples), str(epochs)], cwd=work, env=_env(work / "cache"))
    if done.returncode != 0:
        raise RuntimeError(f"autotune run exited with {done.returncode}:\n{done.stderr[-3000:]}")
    doc = json.loads(report.read_text())
    (loader,) = doc["loaders"]
    first = done.stderr.find("autotune: ")  # what autotune wrote: its progress lines, then the report
    report_text = done.stderr[first:] if first >= 0 else done.stderr
    return {
        "command": f"autotune run --json autotune-run.json seed_train.py {samples} {epochs}",
        "wall_s": wall,
        "throughput_under_run": _throughput(done, "autotune run"),
        "status": loader["status"],
        "best": loader.get("best"),
        "best_label": loader.get("best_label"),
        "plain_kwargs": loader.get("plain_kwargs"),
        "torch_threads": loader.get("torch_threads"),
        "reported_speedup_over_defaults": loader.get("throughput_speedup"),
        "reported_speedup_over_script": loader.get("speedup_over_script"),
        "trials": len(loader.get("tuning", {}).get("trials", [])),
        "report": report_text.strip("\n"),
        "loader": {k: v for k, v in loader.items() if k != "tuning"},
        "trial_table": [_trial_row(t) for t in loader.get("tuning", {}).get("trials", [])],
    }


def _trial_row(t: dict[str, Any]) -> dict[str, Any]:
    """One trial of the run, as the in-run explorer measured it (for reading, not for ratios)."""
    c, m = t["candidate"], t.get("measurement") or {}
    return {"phase": t["phase"], "state": t["state"], "num_workers": c["num_workers"],
            "worker_kind": c["worker_kind"], "pretransform": c["pretransform"],
            "torch_threads": c["torch_threads"], "samples_per_s": m.get("samples_per_s"),
            "batches": m.get("batches"), "reason": t.get("reason")}


def compare(work: Path, tuned: dict[str, Any], *, samples: int, epochs: int, rounds: int) -> dict[str, Any]:
    """The seed script against the pasted ones, interleaved, with plain python (NOTE 3)."""
    variants = {"seed": (f"DataLoader(dataset, batch_size=16, shuffle=True, {SEED_SETTING})",
                         _script(SEED_SETTING)), **pastes(tuned["loader"])}
    scripts = {}
    for i, (name, (_, text)) in enumerate(variants.items()):
        scripts[name] = work / f"variant_{i}.py"
        scripts[name].write_text(text)
    env = _env(work / "cache")  # the profile autotune run stored, for autotune.DataLoader
    per: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in names[r % len(names):] + names[:r % len(names)]:
            done, _ = _run([sys.executable, str(scripts[name]), str(samples), str(epochs)], cwd=work, env=env)
            per[name].append(_throughput(done, f"the {name} script"))
            log(f"round {r + 1}/{rounds}: {name} {per[name][-1]:,.0f} samples/s")
    seed = statistics.median(per["seed"])
    rows = {}
    for name, (line, _) in variants.items():
        med = statistics.median(per[name])
        rows[name] = {"line": line, "samples_per_s": per[name], "median": med, "spread": _spread(per[name]),
                      "ratio": med / seed,
                      "round_ratios": [x / s for x, s in zip(per[name], per["seed"], strict=True)],
                      "met": name == "seed" or med / seed >= TARGET_RATIO}
    return {"variants": rows, "target": TARGET_RATIO}


def overhead(work: Path, *, runs: int) -> dict[str, Any]:
    """``python noop.py`` against ``python -m autotune run noop.py``, interleaved (NOTE 4)."""
    env = _env(work / "cache")
    out: dict[str, Any] = {}
    for name, text in (("imports torch", NOOP_TORCH), ("imports nothing", NOOP_PLAIN)):
        noop = work / f"noop_{name.split()[-1]}.py"
        noop.write_text(text)
        plain: list[float] = []
        wrapped: list[float] = []
        for r in range(runs):
            pair = [(plain, [sys.executable, str(noop)]),
                    (wrapped, [sys.executable, "-m", "autotune", "run", str(noop)])]
            for times, argv in pair if r % 2 == 0 else pair[::-1]:
                done, wall = _run(argv, cwd=work, env=env)
                if done.returncode != 0 or done.stdout != "no loader here\n":
                    raise RuntimeError(f"{' '.join(argv)} failed:\n{done.stderr[-2000:]}")
                times.append(wall)
        extra = statistics.median(wrapped) - statistics.median(plain)
        paired = [w - p for w, p in zip(wrapped, plain, strict=True)]
        out[name] = {"python_s": plain, "autotune_run_s": wrapped,
                     "python_median_s": statistics.median(plain),
                     "autotune_run_median_s": statistics.median(wrapped), "overhead_s": extra,
                     "paired_overhead_median_s": statistics.median(paired)}
        log(f"overhead ({name}): {extra:.2f} s")
    out["target_s"] = TARGET_OVERHEAD_S
    out["met"] = out["imports torch"]["overhead_s"] < TARGET_OVERHEAD_S
    return out


def _machine() -> dict[str, Any]:
    from autotune.machine import detect_machine

    m = detect_machine().fingerprint()
    m["load_average"] = [round(x, 2) for x in os.getloadavg()]
    return m


def write_markdown(data: dict[str, Any], path: Path) -> Path:
    t, c, o = data["tune"], data["compare"], data["overhead"]
    m = data["machine"]
    yes = {True: "yes", False: "**no**"}
    lines = [
        "# `autotune run` on the seed's training script",
        "",
        f"Run on {data['date']} with `{data['command']}` ({data['minutes']:.1f} min in all).",
        "",
        f"Machine: {m.get('usable_cpus')} usable CPUs, accelerator {m.get('accelerator')}, torch"
        f" {m.get('torch')}; load average at the start {', '.join(map(str, m['load_average']))}"
        " (the machine is shared: other jobs ran during this benchmark).",
        "",
        "How it is measured: NOTE [ The seed benchmark ] in `benchmarks/run_seed.py`. The script is a",
        f"plain training loop over CIFAR10Like({data['samples']}) with the CIFAR-10 training transform",
        f"and SmallCNN on the CPU, {data['epochs']} epochs per timed run; throughput is the script's own:",
        "samples over its training loop's wall time, worker start-up at every epoch included.",
        "",
        "## Targets",
        "",
        "| target | value | met |",
        "|---|---:|---|",
        *(f"| {name} >= {c['target']:g}x the seed's throughput | {row['ratio']:.2f}x | {yes[row['met']]} |"
          for name, row in c["variants"].items() if name != "seed"),
        f"| overhead on a script with no loader (imports torch) < {o['target_s']:g} s |"
        f" {o['imports torch']['overhead_s']:.2f} s | {yes[o['met']]} |",
        "",
        "## 1. `autotune run` on the seed script",
        "",
        f"`{t['command']}`: {t['wall_s']:.0f} s, the loader {t['status']} on `{t['best_label']}`"
        f" after {t['trials']} trials; inside that run the script trained at"
        f" {t['throughput_under_run']:,.0f} samples/s (exploring included). Its report (stderr):",
        "",
        "```",
        t["report"],
        "```",
        "",
        "Its trials, as the explorer measured them inside the script's epochs (short windows on a",
        "shared machine: read them for the order, and section 2 for the speed):",
        "",
        "| phase | state | workers | kind | pretransform | torch threads | samples/s | batches | reason |",
        "|---|---|---:|---|---|---:|---:|---:|---|",
        *(f"| {r['phase']} | {r['state']} | {r['num_workers']} | {r['worker_kind']} | {r['pretransform']} |"
          f" {r['torch_threads'] if r['torch_threads'] is not None else '-'} |"
          f" {format(r['samples_per_s'], ',.0f') if r['samples_per_s'] else '-'} | {r['batches'] or '-'} |"
          f" {r['reason'] or ''} |" for r in t.get("trial_table", [])),
        "",
        "## 2. The seed's setting against the pasted ones",
        "",
        "Each script as a fresh `python` process, interleaved (the order rotates every round).",
        "",
        "| script | the line | samples/s (median) | spread | every round | x seed (median) |"
        " x seed per round |",
        "|---|---|---:|---:|---|---:|---|",
        *(f"| {name} | `{row['line']}` | {row['median']:,.0f} | {row['spread']:.0%} |"
          f" {', '.join(f'{x:,.0f}' for x in row['samples_per_s'])} | {row['ratio']:.2f} |"
          f" {', '.join(f'{x:.2f}' for x in row['round_ratios'])} |" for name, row in c["variants"].items()),
        "",
        "## 3. Overhead of the command on a script that builds no loader",
        "",
        "| script | `python noop.py` (median s) | `autotune run noop.py` (median s) | overhead (s) |"
        " paired overhead (median s) |",
        "|---|---:|---:|---:|---:|",
    ]
    for name in ("imports torch", "imports nothing"):
        x = o[name]
        lines.append(f"| {name} | {x['python_median_s']:.2f} | {x['autotune_run_median_s']:.2f} |"
                     f" {x['overhead_s']:.2f} | {x['paired_overhead_median_s']:.2f} |")
    lines += ["", "The target is for the first row: every script that builds a DataLoader imports torch. For",
              "a script that imports nothing, the command still imports torch and autotune itself, and that",
              "import is most of the difference.", ""]
    if data.get("notes"):
        lines += ["## Notes", "", *data["notes"], ""]
    path.write_text("\n".join(lines))
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES)
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS)
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS)
    parser.add_argument("--overhead-runs", type=int, default=DEFAULT_OVERHEAD_RUNS)
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run that checks the benchmark works; written to a temporary folder")
    parser.add_argument("--out", type=Path, help="folder for RUN.md and run.json (default: benchmarks/)")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.epochs, args.rounds, args.overhead_runs = 512, 1, 1, 1
    out = args.out or (Path(tempfile.mkdtemp(prefix="autotune-run-seed-")) if args.quick else RESULTS_DIR)
    started = time.perf_counter()
    machine = _machine()
    with tempfile.TemporaryDirectory(prefix="autotune-run-seed-work-") as tmp:
        work = Path(tmp)
        tune_epochs = TUNE_EPOCHS if not args.quick else 2
        log(f"autotune run on the seed script ({args.samples} samples, {tune_epochs} epochs)")
        tuned = tune(work, samples=args.samples, epochs=tune_epochs)
        log(f"best {tuned['best_label']} ({tuned['status']}); for torch's DataLoader {tuned['plain_kwargs']}")
        compared = compare(work, tuned, samples=args.samples, epochs=args.epochs, rounds=args.rounds)
        over = overhead(work, runs=args.overhead_runs)
    data = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": "python benchmarks/run_seed.py " + " ".join(sys.argv[1:] if argv is None else argv),
        "minutes": (time.perf_counter() - started) / 60.0,
        "machine": machine, "samples": args.samples, "epochs": args.epochs, "rounds": args.rounds,
        "tune": tuned, "compare": compared, "overhead": over,
    }
    write_json(data, out / "run.json")
    write_markdown(data, out / "RUN.md")
    ratios = {name: row["ratio"] for name, row in compared["variants"].items() if name != "seed"}
    summary = "; ".join(f"{name} {ratio:.2f}x the seed" for name, ratio in ratios.items())
    log(f"{summary} (target {TARGET_RATIO:g}x); overhead {over['imports torch']['overhead_s']:.2f} s"
        f" (target < {TARGET_OVERHEAD_S:g} s); written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
