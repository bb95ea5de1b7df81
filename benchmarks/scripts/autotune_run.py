"""``autotune run`` benchmarks: the seed's script and its recommendation pasted in, the speed-up the
report claims checked by an independent measurement, and the command's overhead.

    python benchmarks/scripts/autotune_run.py [--samples 2048] [--epochs 2] [--rounds 3]
        [--check-samples 4096] [--check-rounds 5] [--part seed|speedup|overhead ...] [--quick] [--out DIR]

Writes AUTOTUNE_RUN.md and autotune_run.json to ``benchmarks/results/autotune_run/`` (``--out``
elsewhere; ``--quick`` writes to a temporary folder unless ``--out`` is given).

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

NOTE [ The reported speed-up, checked ]
1. The same training script with ``DataLoader(dataset, batch_size=16, shuffle=True, num_workers=W)``
   written in it, for W = 16 (the default of a widely used image-classification script: more worker
   processes than a small machine has cores, outside the search space) and W = 0 (torch's default).
2. ``autotune run --json`` on it, unmodified, in a fresh profile folder. The report's speed-up is
   against the script's own setting, over the ``epochs`` the drop-in assumes (start-up included:
   NOTE [ Score ] in autotune/decide.py; a cache as later runs find it, built: NOTE [ Decisions ] 6),
   with its interval (``speedup_low`` and ``speedup_high``, NOTE [ Decisions ]).
3. Independently of the report's own measurements: the script as written and the same script with
   its loader replaced by ``autotune.DataLoader.configured(dataset, candidate=<the configuration the
   report chose>)``, which serves exactly that configuration (thread workers, a cache and the torch
   thread count included) and explores nothing, each as a fresh ``python`` process training that
   many ``epochs``, in interleaved rounds (the order alternates). The ratio of their throughputs per
   round, and its interval: NOTE [ Paired ratio interval ] in benchmarks/_common/stats.py, at the report's
   confidence. When the report kept the script's own settings, the two are the same configuration
   and the check measures the noise around 1.
4. Target: the reported speed-up lies within the independent interval.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from autotune.pretransform import node  # noqa: E402
from autotune.result import DEFAULT_EPOCHS as DROPIN_EPOCHS  # noqa: E402
from benchmarks._common import harness  # noqa: E402
from benchmarks._common.output import write_json  # noqa: E402
from benchmarks._common.stats import paired_interval, rotated, spread  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
QUICK_OUT_PREFIX = "autotune-run-seed-"
"""Prefix of the temporary folder a ``--quick`` run writes to when ``--out`` is not given."""

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

QUICK_SAMPLES = 256
"""``--quick``: 16 batches an epoch for the speed-up check; too few to measure a baseline of many
workers, which the report then says, and enough for one of no workers."""

QUICK_SEED_SAMPLES = 128
"""``--quick``: 8 batches an epoch for the seed's script, whose 20 workers no epoch that short
measures either way."""

QUICK_TUNE_EPOCHS = 1
"""``--quick``: epochs of every ``autotune run``."""

DEFAULT_OVERHEAD_RUNS = 5
"""Runs of each no-loader command for the overhead's median."""

RUN_TIMEOUT_S = 900
"""One script run takes a few minutes at most here; this only stops a hung one."""

CHECK_WORKERS = (16, 0)
"""The settings the speed-up check's scripts write (NOTE [ The reported speed-up, checked ] 1)."""

QUICK_CHECK_WORKERS = (0,)
"""``--quick``: the one setting whose tiny epochs the report can measure (and so the one that runs
the check's every step)."""

CHECK_BATCH_SIZE = 16
"""The check's scripts' batch size, as the seed's."""

DEFAULT_CHECK_SAMPLES = 4096
"""256 batches an epoch: a baseline of 16 worker processes needs 73 batches of an epoch before its
first measured window (autotune.online.stretch_items), and the search needs room after it."""

CHECK_TUNE_EPOCHS = 4
"""Epochs of the check's ``autotune run``: the search takes two at most, then it serves settled."""

DEFAULT_CHECK_ROUNDS = 5
"""Interleaved rounds of the independent measurement: four degrees of freedom for its interval."""

PARTS = ("seed", "speedup", "overhead")
"""The benchmark's parts: NOTE [ The seed benchmark ] 1-3, NOTE [ The reported speed-up, checked ],
NOTE [ The seed benchmark ] 4."""

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
loader = {loader}(dataset, batch_size={batch_size}, shuffle=True{settings})
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
    print(f"[autotune_run {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def _env(cache: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["AUTOTUNE_CACHE_DIR"] = str(cache)
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


@contextlib.contextmanager
def _clearing(work: Path) -> Iterator[None]:
    """The runs' profile folders are ``cache*`` in ``work``: their node caches in /dev/shm go with
    them (docs/caches.md), not at the next run's sweep."""
    try:
        yield
    finally:
        for folder in work.glob("cache*"):
            node.clear(folder)


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


def _script(settings: str, *, threads: int | None = None, loader: str = "DataLoader",
            imports: str = "", batch_size: int = 16) -> str:
    return SCRIPT.format(settings=f", {settings}" if settings else "", loader=loader, imports=imports,
                         threads=f"torch.set_num_threads({threads})\n" if threads is not None else "",
                         batch_size=batch_size)


def _kwargs(kwargs: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "batch_size")


def pastes(loader: dict[str, Any]) -> dict[str, tuple[str, str]]:
    """What the report says to paste, as (the changed lines, the script): the lines for torch's
    DataLoader, and, when thread workers or a cache won, the report's first suggestion too; nothing
    when the report recommends nothing (the loader could not be measured)."""
    out: dict[str, tuple[str, str]] = {}
    if "plain_kwargs" not in loader:
        return out
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


def tune(work: Path, *, samples: int, epochs: int, settings: str = SEED_SETTING,
         batch_size: int = 16, name: str = "seed_train.py") -> dict[str, Any]:
    """``autotune run --json`` on the script with ``settings`` in a fresh profile folder (NOTE 2)."""
    script = work / name
    script.write_text(_script(settings, batch_size=batch_size))
    report = work / f"{script.stem}-autotune-run.json"
    done, wall = _run([sys.executable, "-m", "autotune", "run", "--json", str(report), str(script),
                       str(samples), str(epochs)], cwd=work, env=_env(work / f"cache-{script.stem}"))
    if done.returncode != 0:
        raise RuntimeError(f"autotune run exited with {done.returncode}:\n{done.stderr[-3000:]}")
    doc = json.loads(report.read_text())
    (loader,) = doc["loaders"]
    first = done.stderr.find("autotune: ")  # what autotune wrote: its progress lines, then the report
    report_text = done.stderr[first:] if first >= 0 else done.stderr
    tuning = loader.get("tuning", {})
    return {
        "command": f"autotune run --json {report.name} {name} {samples} {epochs}",
        "cache": str(work / f"cache-{script.stem}"),
        "wall_s": wall,
        "throughput_under_run": _throughput(done, "autotune run"),
        "status": loader["status"],
        "best": loader.get("best"),
        "best_label": loader.get("best_label"),
        "plain_kwargs": loader.get("plain_kwargs"),
        "torch_threads": loader.get("torch_threads"),
        "baseline_kwargs": loader.get("baseline_kwargs"),
        "reported_speedup": loader.get("speedup"),
        "reported_speedup_low": loader.get("speedup_low"),
        "reported_speedup_high": loader.get("speedup_high"),
        "reported_confidence": loader.get("confidence"),
        "reported_throughput_speedup": loader.get("throughput_speedup"),
        "kept_baseline": loader.get("kept_baseline"),
        "decision": loader.get("decision"),
        "epochs": tuning.get("epochs"),
        "load_average_per_cpu": tuning.get("load_average"),
        "trials": len(tuning.get("trials", [])),
        "report": report_text.strip("\n"),
        "loader": {k: v for k, v in loader.items() if k != "tuning"},
        "trial_table": [_trial_row(t) for t in tuning.get("trials", [])],
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
    env = _env(Path(tuned["cache"]))  # the profile autotune run stored, for autotune.DataLoader
    per: dict[str, list[float]] = {name: [] for name in variants}
    names = list(variants)
    for r in range(rounds):
        for name in rotated(names, r):
            done, _ = _run([sys.executable, str(scripts[name]), str(samples), str(epochs)], cwd=work, env=env)
            per[name].append(_throughput(done, f"the {name} script"))
            log(f"round {r + 1}/{rounds}: {name} {per[name][-1]:,.0f} samples/s")
    seed = statistics.median(per["seed"])
    rows = {}
    for name, (line, _) in variants.items():
        med = statistics.median(per[name])
        rows[name] = {"line": line, "samples_per_s": per[name], "median": med, "spread": spread(per[name]),
                      "ratio": med / seed,
                      "round_ratios": [x / s for x, s in zip(per[name], per["seed"], strict=True)],
                      "met": name == "seed" or med / seed >= TARGET_RATIO}
    return {"variants": rows, "target": TARGET_RATIO}


def _reported_candidate(tuned: dict[str, Any], batch_size: int, settings: str) -> dict[str, Any]:
    """The configuration the report chose, as a ``Candidate`` dict; the script's own settings when it
    chose nothing (the loader could not be measured)."""
    from autotune.space import Candidate

    if tuned["best"] is not None:
        c = Candidate.from_loader_kwargs(tuned["best"], pretransform=tuned["loader"]["pretransform"],
                                         torch_threads=tuned["torch_threads"])
    else:
        workers = int(settings.split("=")[1])
        c = Candidate(batch_size, workers, prefetch_factor=2 if workers else None)
    return c.to_dict()


def speedup_check(work: Path, workers: int, *, samples: int, tune_epochs: int, rounds: int,
                  epochs: int | None = None) -> dict[str, Any]:
    """The report's speed-up against an independent interleaved measurement of the script's own
    setting and the one the report chose (NOTE [ The reported speed-up, checked ])."""
    settings = f"num_workers={workers}"
    log(f"autotune run on a script with {settings} ({samples} samples, {tune_epochs} epochs)")
    tuned = tune(work, samples=samples, epochs=tune_epochs, settings=settings, batch_size=CHECK_BATCH_SIZE,
                 name=f"train_w{workers}.py")
    candidate = _reported_candidate(tuned, CHECK_BATCH_SIZE, settings)
    log(f"the report chose {tuned['best_label'] or 'nothing'} ({tuned['status']}), speed-up"
        f" {_ratio(tuned['reported_speedup'])} against the script's own setting")
    run_epochs = epochs or tuned["epochs"] or DROPIN_EPOCHS
    scripts = {name: work / f"check_w{workers}_{name}.py" for name in ("script", "reported")}
    scripts["script"].write_text(_script(settings, batch_size=CHECK_BATCH_SIZE))
    scripts["reported"].write_text(_script(
        f"candidate=Candidate.from_dict({candidate!r})", loader="autotune.DataLoader.configured",
        imports="import autotune\nfrom autotune.space import Candidate\n", batch_size=CHECK_BATCH_SIZE))
    env = _env(work / f"cache-check-w{workers}")  # empty: the configured loader reads no profile
    per: dict[str, list[float]] = {name: [] for name in scripts}
    for r in range(rounds):
        for name in rotated(list(scripts), r):
            done, _ = _run([sys.executable, str(scripts[name]), str(samples), str(run_epochs)], cwd=work,
                           env=env)
            per[name].append(_throughput(done, f"the {name} script"))
            log(f"check w={workers}, round {r + 1}/{rounds}: {name} {per[name][-1]:,.0f} samples/s")
    measured = paired_interval(per["reported"], per["script"])
    reported = tuned["reported_speedup"]
    low, high = tuned["reported_speedup_low"], tuned["reported_speedup_high"]
    overlap = (reported is not None and (low if low is not None else reported) <= measured.high
               and (high if high is not None else reported) >= measured.low)
    return {
        "workers": workers, "line": f"DataLoader(dataset, batch_size={CHECK_BATCH_SIZE}, shuffle=True,"
        f" {settings})", "samples": samples, "epochs": run_epochs, "rounds": rounds, "tune": tuned,
        "candidate": candidate, "samples_per_s": per,
        "medians": {k: statistics.median(v) for k, v in per.items()},
        "spreads": {k: spread(v) for k, v in per.items()},
        "measured": measured.to_dict(), "measured_text": measured.text(),
        "reported": reported, "reported_low": low, "reported_high": high,
        "met": reported is not None and measured.contains(reported), "intervals_overlap": overlap,
    }


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
    m["load_average"] = harness.load_average()
    return m


YES = {True: "yes", False: "**no**"}


def _ratio(x: float | None) -> str:
    return "-" if x is None else f"{x:.2f}x"


def targets(data: dict[str, Any]) -> list[tuple[str, str, bool]]:
    """(target, value, met) for every part that ran."""
    rows = []
    if "compare" in data:
        c = data["compare"]
        rows += [(f"{name} >= {c['target']:g}x the seed's throughput", f"{row['ratio']:.2f}x", row["met"])
                 for name, row in c["variants"].items() if name != "seed"]
    for check in data.get("speedup", []):
        rows.append((f"`num_workers={check['workers']}`: the reported speed-up lies within the independent"
                     f" interval ({check['measured_text']})", _ratio(check["reported"]), check["met"]))
    if "overhead" in data:
        o = data["overhead"]
        rows.append((f"overhead on a script with no loader (imports torch) < {o['target_s']:g} s",
                     f"{o['imports torch']['overhead_s']:.2f} s", o["met"]))
    return rows


def _trial_lines(t: dict[str, Any]) -> list[str]:
    return [
        "| phase | state | workers | kind | pretransform | torch threads | samples/s | batches | reason |",
        "|---|---|---:|---|---|---:|---:|---:|---|",
        *(f"| {r['phase']} | {r['state']} | {r['num_workers']} | {r['worker_kind']} | {r['pretransform']} |"
          f" {r['torch_threads'] if r['torch_threads'] is not None else '-'} |"
          f" {format(r['samples_per_s'], ',.0f') if r['samples_per_s'] else '-'} | {r['batches'] or '-'} |"
          f" {r['reason'] or ''} |" for r in t.get("trial_table", [])),
    ]


def _seed_lines(data: dict[str, Any]) -> list[str]:
    t, c = data["tune"], data["compare"]
    return [
        "## 1. `autotune run` on the seed script",
        "",
        f"NOTE [ The seed benchmark ]: a plain training loop over CIFAR10Like({data['samples']}) with the"
        " CIFAR-10 training transform and SmallCNN on the CPU, `batch_size=16, num_workers=20` written in"
        f" it, {data['epochs']} epochs per timed run; throughput is the script's own: samples over its"
        " training loop's wall time, worker start-up at every epoch included.",
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
        *_trial_lines(t),
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
    ]


def _overhead_lines(o: dict[str, Any]) -> list[str]:
    lines = [
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
    return [*lines, "", "The target is for the first row: every script that builds a DataLoader imports"
            " torch. For a script that imports nothing, the command still imports torch and autotune"
            " itself, and that import is most of the difference.", ""]


def _speedup_lines(checks: list[dict[str, Any]]) -> list[str]:
    lines = [
        "## 4. The reported speed-up against an independent measurement",
        "",
        "NOTE [ The reported speed-up, checked ]: the script as written, run unmodified under `autotune run`"
        " in a fresh profile folder; then, each as a fresh `python` process in interleaved rounds, the"
        " script as written against the same script serving exactly the configuration the report chose"
        " (`autotune.DataLoader.configured`, exploring nothing), each training as many epochs as the"
        " reported speed-up is for. The independent ratio is the geometric mean of the per-round ratios;"
        " its interval is Student's t on their logarithms, at the report's confidence (NOTE [ Paired"
        " ratio interval ] in `benchmarks/_common/stats.py`).",
        "",
        "| script's loader | `autotune run` chose | status | reported speed-up (interval) |"
        " independent ratio (interval) | within | intervals overlap | samples/s: script, chosen (median,"
        " spread) |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for ch in checks:
        t = ch["tune"]
        rep = ("none" if ch["reported"] is None else
               f"{ch['reported']:.2f}x" + ("" if ch["reported_low"] is None else
                                           f" ({ch['reported_low']:.2f}-{_ratio(ch['reported_high'])})"))
        chose = f"`{t['best_label']}`" if t["best_label"] else "nothing"
        chose += " (its own)" if t["kept_baseline"] else ""
        lines.append(
            f"| `{ch['line']}` | {chose} | {t['status']} | {rep} | {ch['measured_text']} |"
            f" {YES[ch['met']]} | {YES[ch['intervals_overlap']]} |"
            f" {ch['medians']['script']:,.0f} ({ch['spreads']['script']:.0%}),"
            f" {ch['medians']['reported']:,.0f} ({ch['spreads']['reported']:.0%}) |")
    for ch in checks:
        t = ch["tune"]
        lines += [
            "",
            f"### `num_workers={ch['workers']}`",
            "",
            f"`{t['command']}`: {t['wall_s']:.0f} s; {ch['samples']} samples, {ch['rounds']} rounds of"
            f" {ch['epochs']} epochs each for the independent measurement; load per CPU the report"
            f" recorded: {t['load_average_per_cpu']}. Decision: {t['decision'] or '-'}",
            "",
            "Per round (samples/s): script " + ", ".join(f"{x:,.0f}" for x in ch["samples_per_s"]["script"])
            + "; chosen " + ", ".join(f"{x:,.0f}" for x in ch["samples_per_s"]["reported"]) + ".",
            "",
            "```",
            t["report"],
            "```",
            "",
            *_trial_lines(t),
        ]
    return [*lines, ""]


def write_markdown(data: dict[str, Any], path: Path) -> Path:
    m = data["machine"]
    lines = ["# `autotune run`: the seed's script, the reported speed-up checked, the overhead", ""]
    lines += [*harness.quick_notice(bool(data.get("quick"))),
        f"Run on {data['date']} with `{data['command']}` ({data['minutes']:.1f} min in all).",
        "",
        f"Machine: {m.get('usable_cpus')} usable CPUs, accelerator {m.get('accelerator')}, torch"
        f" {m.get('torch')}; load average (1, 5, 15 min) at the start"
        f" {', '.join(map(str, m['load_average']))}, at the end {', '.join(map(str, data['load_end']))}.",
        "",
        "## Targets",
        "",
        "| target | value | met |",
        "|---|---:|---|",
        *(f"| {target} | {value} | {YES[met]} |" for target, value, met in targets(data)),
        "",
    ]
    if "compare" in data:
        lines += _seed_lines(data)
    if "overhead" in data:
        lines += _overhead_lines(data["overhead"])
    if "speedup" in data:
        lines += _speedup_lines(data["speedup"])
    if data.get("notes"):
        lines += ["## Notes", "", *data["notes"], ""]
    path.write_text("\n".join(lines))
    return path


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python benchmarks/scripts/autotune_run.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=DEFAULT_SAMPLES, help="the seed script's samples")
    parser.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS, help="epochs per timed seed run")
    parser.add_argument("--rounds", type=int, default=DEFAULT_ROUNDS, help="rounds of the seed comparison")
    parser.add_argument("--check-samples", type=int, default=DEFAULT_CHECK_SAMPLES,
                        help="the speed-up check's samples")
    parser.add_argument("--check-rounds", type=int, default=DEFAULT_CHECK_ROUNDS,
                        help="rounds of the independent measurement")
    parser.add_argument("--check-epochs", type=int, default=None,
                        help="epochs per independent run (default: as many as the reported speed-up is for)")
    parser.add_argument("--overhead-runs", type=int, default=DEFAULT_OVERHEAD_RUNS)
    parser.add_argument("--part", action="append", choices=PARTS, help="repeatable (default: all)")
    parser.add_argument("--quick", action="store_true",
                        help="a tiny run that checks the benchmark works; written to a temporary folder")
    parser.add_argument("--out", type=Path, help="folder for AUTOTUNE_RUN.md and autotune_run.json"
                        " (default: benchmarks/results/autotune_run/;"
                        " with --quick, a new temporary folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.samples, args.epochs, args.rounds, args.overhead_runs = QUICK_SEED_SAMPLES, 1, 1, 1
        args.check_samples, args.check_rounds, args.check_epochs = QUICK_SAMPLES, 1, 1
    args.part = args.part or list(PARTS)
    return args


def out_folder(args: argparse.Namespace) -> Path:
    return harness.out_folder(args, __file__, QUICK_OUT_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    parts = args.part
    out = out_folder(args)
    started = time.perf_counter()
    data: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/scripts/autotune_run.py",
                               *(sys.argv[1:] if argv is None else argv)]),
        "quick": args.quick, "parts": parts, "machine": _machine(), "samples": args.samples,
        "epochs": args.epochs, "rounds": args.rounds,
    }
    with tempfile.TemporaryDirectory(prefix="autotune-run-seed-work-") as tmp, _clearing(Path(tmp)):
        work = Path(tmp)
        if "seed" in parts:
            tune_epochs = TUNE_EPOCHS if not args.quick else QUICK_TUNE_EPOCHS
            log(f"autotune run on the seed script ({args.samples} samples, {tune_epochs} epochs)")
            data["tune"] = tune(work, samples=args.samples, epochs=tune_epochs)
            log(f"best {data['tune']['best_label']} ({data['tune']['status']}); for torch's DataLoader"
                f" {data['tune']['plain_kwargs']}")
            data["compare"] = compare(work, data["tune"], samples=args.samples, epochs=args.epochs,
                                      rounds=args.rounds)
        if "speedup" in parts:
            tune_epochs = CHECK_TUNE_EPOCHS if not args.quick else QUICK_TUNE_EPOCHS
            data["speedup"] = [speedup_check(work, w, samples=args.check_samples, rounds=args.check_rounds,
                                             tune_epochs=tune_epochs, epochs=args.check_epochs)
                               for w in (QUICK_CHECK_WORKERS if args.quick else CHECK_WORKERS)]
        if "overhead" in parts:
            data["overhead"] = overhead(work, runs=args.overhead_runs)
    data["minutes"] = (time.perf_counter() - started) / 60.0
    data["load_end"] = harness.load_average()
    out.mkdir(parents=True, exist_ok=True)
    write_json(data, out / "autotune_run.json")
    write_markdown(data, out / "AUTOTUNE_RUN.md")
    for target, value, met in targets(data):
        log(f"{target}: {value} ({'met' if met else 'missed'})")
    log(f"written to {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
