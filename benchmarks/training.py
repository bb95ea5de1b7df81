"""Whole training runs: the drop-in DataLoader against PyTorch's defaults, tuning ahead, and the oracle.

    python benchmarks/training.py [--epochs 5] [--min-epoch-s 20] [--workload NAME ...] [--quick]

Writes ``benchmarks/TRAINING.md`` and ``benchmarks/training.json`` (``--out`` elsewhere).

# NOTE [ Training-run protocol ]
# Per workload, the wall time of a training run of EPOCHS epochs of the user's own loop (for each batch,
# the workload's step), five ways, in one process, one after the other:
#   defaults:     torch.utils.data.DataLoader(dataset, batch_size, shuffle=True);
#   drop-in:      autotune.DataLoader(dataset, batch_size, shuffle=True), empty profile store: the
#                 exploration happens inside the run and is part of its time;
#   tune+train:   tune_loader(dataset, step, batch_size) with its default budget, then
#                 result.make_loader(dataset, shuffle=True): the budget is part of the run's time;
#   oracle:       the best configuration known, fixed from the start (see below);
#   second run:   autotune.DataLoader again, with the drop-in's profile store: no exploration.
# The dataset is sized so that an epoch at PyTorch's defaults takes at least --min-epoch-s seconds, as
# real epochs do (measured with autotune.measure before the runs); a short workload (an epoch of a few
# seconds) is reported too, as it is: no tuner can amortise its exploration there.
# The oracle: an exhaustive grid over today's space (thread workers included) takes longer than the
# runs themselves, so the oracle is the best, by median epoch score over interleaved rounds of
# autotune.measure, of every configuration any of the runs chose plus PyTorch's defaults: the tuners
# are compared with the best they could have started from. A pre-transform cache is rebuilt for every
# run (pretransform.clear_builds), so each pays its own build.
# The machine is shared: runs are sequential, so their ratios carry the noise of their minutes;
# RESULTS.md states the load average.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
import torch.utils.data as tud  # noqa: E402

from autotune import DataLoader, tune_loader  # noqa: E402
from autotune import pretransform as pt  # noqa: E402
from autotune import workloads as wl  # noqa: E402
from autotune.decide import score  # noqa: E402
from autotune.exceptions import CandidateError  # noqa: E402
from autotune.machine import detect_machine  # noqa: E402
from autotune.measure import MeasureLimits, measure  # noqa: E402
from autotune.space import Candidate  # noqa: E402

EPOCHS = 5
"""A short training run: long enough to amortise exploration, short enough to benchmark."""

MIN_EPOCH_S = 20.0
"""An epoch at PyTorch's defaults takes at least this long, as real epochs do."""

SHORT_EPOCH_S = 2.5
"""The short workload's epoch at PyTorch's defaults."""

ORACLE_ROUNDS = 3
"""Interleaved rounds that rank the oracle candidates."""

WORKLOADS = ("cifar10-like", "latency", "tensor", "imagefolder-jpeg", "photos-crop-48")
"""The four benchmark workloads and a folder of JPEG photos of varying sizes."""


@dataclass
class Built:
    """A workload sized for the run, and how to make a fresh copy of its dataset."""

    name: str
    make: Callable[[], Any]
    step: Callable[[Any], Any]
    batch_size: int
    n: int
    description: str
    cleanup: list[Path] = field(default_factory=list)


def _move_only(batch: Any) -> None:
    """The step of a workload without one: the batch is only received."""


def _throughput(dataset: Any, step: Callable[[Any], Any], batch_size: int) -> float:
    m = measure(dataset, Candidate(batch_size=batch_size), step=step, limits=MeasureLimits(window_s=2.0))
    return m.samples_per_s


def build(name: str, epoch_s: float) -> Built:
    """The workload with as many samples as make an epoch of ``epoch_s`` at PyTorch's defaults."""
    tmp: list[Path] = []
    if name in ("cifar10-like", "latency", "tensor"):
        probe = wl.get_workload(name, n=2048)
        step = probe.step or _move_only
        sps = _throughput(probe.dataset, step, probe.batch_size)
        n = max(probe.batch_size * 8, int(sps * epoch_s))

        def make() -> Any:
            return wl.get_workload(name, n=n).dataset

        return Built(name, make, step, probe.batch_size, n, probe.description.split(";")[0], tmp)
    root = Path(tempfile.mkdtemp(prefix="autotune-training-"))
    tmp.append(root)
    if name == "imagefolder-jpeg":
        wl.write_image_folder(root / "probe", n=512)
        probe = wl.imagefolder_workload(root / "probe")
        sps = _throughput(probe.dataset, probe.step, probe.batch_size)
        n = max(probe.batch_size * 8, int(sps * epoch_s))
        wl.write_image_folder(root / "data", n=n)
        w = wl.imagefolder_workload(root / "data")
        return Built(name, lambda: wl.imagefolder_workload(root / "data").dataset,
                     w.step, w.batch_size, n, w.description, tmp)
    # photos-crop-48: photos of 120-320 px, RandomResizedCrop(48) + flip + ToTensor + Normalize
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(48), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(wl.IMAGENET_MEAN, wl.IMAGENET_STD),
    ])
    wl.write_photo_folder(root / "probe", n=256)
    probe_ds = datasets.ImageFolder(str(root / "probe"), transform=transform)
    step = wl.make_train_step(wl.SmallCNN(num_classes=len(probe_ds.classes)))
    sps = _throughput(probe_ds, step, 64)
    n = max(64 * 8, int(sps * epoch_s))
    wl.write_photo_folder(root / "data", n=n)
    return Built(name, lambda: datasets.ImageFolder(str(root / "data"), transform=transform),
                 wl.make_train_step(wl.SmallCNN(num_classes=len(probe_ds.classes))), 64, n,
                 "JPEG photos of 120-320 px, RandomResizedCrop(48) + flip + ToTensor + Normalize", tmp)


def train(loader: Any, step: Callable[[Any], Any], epochs: int) -> list[float]:
    """The user's loop; the seconds of each epoch."""
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for batch in loader:
            step(batch)
        times.append(time.perf_counter() - t0)
    return times


def run_workload(b: Built, epochs: int, budget_s: float | None) -> dict[str, Any]:
    store = Path(tempfile.mkdtemp(prefix="autotune-training-store-"))
    offline_store = Path(tempfile.mkdtemp(prefix="autotune-training-offline-"))
    runs: dict[str, dict[str, Any]] = {}
    threads = torch.get_num_threads()

    def record(label: str, started: float, epoch_times: list[float], chosen: Candidate | None,
               extra: dict[str, Any] | None = None) -> None:
        runs[label] = {"wall_s": time.perf_counter() - started, "epochs_s": epoch_times,
                       "chosen": chosen.label() if chosen else None,
                       "candidate": chosen.to_dict() if chosen else None, **(extra or {})}
        torch.set_num_threads(threads)
        pt.clear_builds()
        print(f"  {label:<11} {runs[label]['wall_s']:7.1f} s  {chosen.label() if chosen else ''}",
              file=sys.stderr, flush=True)

    print(f"{b.name}: {b.n} samples, batch {b.batch_size}", file=sys.stderr, flush=True)
    # The drop-in, as a user meets it: one import changed, an empty profile store.
    ds = b.make()
    t0 = time.perf_counter()
    loader = DataLoader(ds, batch_size=b.batch_size, shuffle=True, cache_dir=str(store))
    times = train(loader, b.step, epochs)
    dropin = loader.tuning.candidate if loader.tuning else None
    explored = len(loader.tuning.trials) if loader.tuning else 0
    loader.close()
    record("drop-in", t0, times, dropin, {"candidates_explored": explored})

    ds = b.make()
    t0 = time.perf_counter()
    kwargs: dict[str, Any] = {"budget_s": budget_s} if budget_s else {}
    result = tune_loader(ds, b.step, batch_size=b.batch_size, cache_dir=str(offline_store),
                         progress=False, **kwargs)
    tuned_at = time.perf_counter() - t0
    loader = result.make_loader(ds, shuffle=True)
    times = train(loader, b.step, epochs)
    loader.close()
    record("tune+train", t0, times, result.candidate, {"tuning_s": tuned_at})

    # The oracle among everything chosen, by median epoch score over interleaved rounds.
    ds = b.make()
    pool = list(dict.fromkeys(c for c in (dropin, result.candidate, Candidate(b.batch_size)) if c))
    scores: dict[Candidate, list[float]] = {c: [] for c in pool}
    for r in range(ORACLE_ROUNDS):
        for c in pool[r % len(pool):] + pool[:r % len(pool)]:
            try:
                m = measure(ds, c, step=b.step, limits=MeasureLimits(window_s=1.5))
            except CandidateError:
                continue
            scores[c].append(score(m, c, b.n, epochs))
    oracle = max(pool, key=lambda c: statistics.median(scores[c]) if scores[c] else 0.0)
    pt.clear_builds()
    torch.set_num_threads(threads)

    ds = b.make()
    t0 = time.perf_counter()
    loader = DataLoader.configured(ds, oracle, shuffle=True)
    times = train(loader, b.step, epochs)
    loader.close()
    record("oracle", t0, times, oracle)

    ds = b.make()
    t0 = time.perf_counter()
    times = train(tud.DataLoader(ds, batch_size=b.batch_size, shuffle=True), b.step, epochs)
    record("defaults", t0, times, Candidate(b.batch_size))

    ds = b.make()
    t0 = time.perf_counter()
    loader = DataLoader(ds, batch_size=b.batch_size, shuffle=True, cache_dir=str(store))
    hit = loader.settled
    times = train(loader, b.step, epochs)
    second = loader.tuning.candidate if loader.tuning else None
    loader.close()
    record("second run", t0, times, second, {"profile_hit": hit})
    for path in (store, offline_store, *b.cleanup):
        shutil.rmtree(path, ignore_errors=True)
    oracle_s = runs["oracle"]["wall_s"]
    return {
        "name": b.name, "description": b.description, "samples": b.n, "batch_size": b.batch_size,
        "epochs": epochs, "runs": runs,
        "ratios": {k: v["wall_s"] / oracle_s for k, v in runs.items()},
        "targets": {
            "drop-in <= 1.05x oracle": runs["drop-in"]["wall_s"] <= 1.05 * oracle_s,
            "drop-in <= tune+train": runs["drop-in"]["wall_s"] <= runs["tune+train"]["wall_s"],
            "second run <= 1.02x oracle": runs["second run"]["wall_s"] <= 1.02 * oracle_s,
        },
    }


def write(results: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps({"meta": meta, "workloads": results}, indent=1))
    lines = [
        "# Training runs: the drop-in DataLoader inside the user's loop", "",
        f"Run on {meta['date']} with `{meta['command']}`.", "",
        f"Machine: {meta['machine']}. Load average at the start: {meta['load']}.", "",
        "Wall time of a whole training run (every epoch of the user's own loop, exploration or tuning"
        " budget included), and its ratio to the oracle's run. See NOTE [ Training-run protocol ] in"
        " `benchmarks/training.py`: the oracle is the best, by median epoch score over interleaved"
        " rounds, of every configuration chosen plus the defaults, fixed from the start.", "",
        "| workload | samples | epoch at defaults | defaults | drop-in | tune+train | oracle | second run |"
        " drop-in chose | oracle |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in results:
        runs = r["runs"]
        cells = [f"{runs[k]['wall_s']:.0f} s ({r['ratios'][k]:.2f}x)"
                 for k in ("defaults", "drop-in", "tune+train", "oracle", "second run")]
        lines.append(
            f"| {r['name']} | {r['samples']} | {statistics.median(runs['defaults']['epochs_s']):.1f} s | "
            + " | ".join(cells)
            + f" | `{runs['drop-in']['chosen']}` | `{runs['oracle']['chosen']}` |")
    lines += ["", "## Targets", "", "| workload | target | met |", "|---|---|---|"]
    for r in results:
        for target, met in r["targets"].items():
            lines.append(f"| {r['name']} | {target} | {'yes' if met else '**no**'} |")
    lines += ["", "## Epoch times", ""]
    for r in results:
        lines.append(f"- {r['name']}: " + "; ".join(
            f"{k} " + ", ".join(f"{t:.1f}" for t in v["epochs_s"]) for k, v in r["runs"].items()))
    (out / "TRAINING.md").write_text("\n".join(lines) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python benchmarks/training.py", description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=EPOCHS)
    p.add_argument("--min-epoch-s", type=float, default=MIN_EPOCH_S)
    p.add_argument("--workload", action="append", choices=WORKLOADS)
    p.add_argument("--no-short", action="store_true", help="skip the short-epoch workload")
    p.add_argument("--budget", type=float, default=None, help="tune_loader's budget (default: its own)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny epochs, its figures mean nothing")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if args.quick:
        args.min_epoch_s, args.epochs, args.budget = 0.5, 2, 3.0
        args.workload = args.workload or ["latency"]
        args.no_short = True
    out = args.out or (Path(tempfile.mkdtemp(prefix="autotune-training-out-")) if args.quick
                       else Path(__file__).resolve().parent)
    names = args.workload or list(WORKLOADS)
    started = time.time()
    machine = detect_machine()
    meta = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": "python benchmarks/training.py " + " ".join(argv if argv is not None else sys.argv[1:]),
        "machine": (f"{machine.usable_cpus} usable CPUs of a {machine.cpu_model}, "
                    f"{machine.ram_total_bytes / 2**30:.1f} GiB RAM, accelerator {machine.accelerator}, "
                    f"torch {machine.torch_version}"),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
    }
    results = []
    for name in names:
        results.append(run_workload(build(name, args.min_epoch_s), args.epochs, args.budget))
    if not args.no_short:
        short = build("cifar10-like", SHORT_EPOCH_S)
        short.name = "cifar10-like (short epochs)"
        results.append(run_workload(short, args.epochs, args.budget))
    meta["total_s"] = round(time.time() - started, 1)
    write(results, meta, out)
    print(f"wrote {out / 'TRAINING.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
