"""Whole training runs: the drop-in DataLoader against the user's settings, tuning ahead, and the oracle.

    python benchmarks/scripts/training.py [--epochs 5] [--min-epoch-s 20] [--repeats 3]
                                          [--workload NAME ...] [--mode quiet|loaded ...]
                                          [--quick] [--out DIR]

Writes TRAINING.md and training.json to ``benchmarks/results/training/`` (``--out`` elsewhere; ``--quick``
writes to a temporary folder unless ``--out`` is given).

# NOTE [ Training-run protocol ]
# Per workload and mode, the wall time of a training run of EPOCHS epochs of the user's own loop (for
# each batch, the workload's step), five ways, in one process:
#   user's settings: torch.utils.data.DataLoader(dataset, batch_size, shuffle=True): the standard
#                 workloads write no loader settings, so this is PyTorch's defaults;
#   drop-in:      autotune.DataLoader(dataset, batch_size, shuffle=True), an empty profile store: the
#                 exploration happens inside the run and is part of its time (the drop-in is not told
#                 the run's length: it assumes its default, as a user who changed one import gets);
#   tune+train:   tune_loader(dataset, step, batch_size) with its default budget, then
#                 result.make_loader(dataset, shuffle=True): the budget is part of the run's time;
#   oracle:       the best configuration known, fixed from the start (see below);
#   second run:   autotune.DataLoader again, with the drop-in's profile store: no exploration.
# Modes: quiet (the machine as it is), and loaded (NOTE [ Loaded mode ] in _common/hog.py: one busy core
# beside every run of the mode, including the oracle's ranking, so that each ratio compares runs
# under the same load).
# Repeats: the five runs are made REPEATS times. In each repeat the runs whose ratio is a target are
# neighbours in time (the user's settings beside the drop-in, the oracle beside the second run), and
# their order flips from one repeat to the next, so a drift of the machine does not always favour
# the same side. Each ratio is taken within a repeat; the table gives the median over the repeats and
# the range (min-max) as the spread. Absolute times are medians over the repeats.
# The dataset is sized so that an epoch at the user's settings takes at least --min-epoch-s seconds on
# the quiet machine, as real epochs do (measured with autotune.measure before the runs); the loaded
# mode runs the same dataset. A short workload (an epoch of a few seconds) is reported too, as it
# is: no tuner can amortise its exploration there.
# The oracle: an exhaustive grid over today's space (thread workers included) takes longer than the
# runs themselves, so the oracle is the best, by median epoch score over interleaved rounds of
# autotune.measure, of every configuration any run of the mode chose so far plus PyTorch's
# defaults, ranked again in each repeat: the tuners are compared with the best they could have
# started from. A pre-transform cache is rebuilt for every run (pretransform.clear_builds), so each
# pays its own build.
# Workloads: the suite's three, a folder of JPEGs, photos of varying sizes with a random crop, and
# no-gain: small tensors already in memory (nothing to decode) and a step-heavy CNN, where no loader
# setting can beat PyTorch's defaults and the drop-in must cost nothing.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
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
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
import torch.utils.data as tud  # noqa: E402

from autotune import DataLoader, TuneResult, tune_loader  # noqa: E402
from autotune import pretransform as pt  # noqa: E402
from autotune import workloads as wl  # noqa: E402
from autotune.decide import score  # noqa: E402
from autotune.exceptions import CandidateError, TuningFailed  # noqa: E402
from autotune.measure import MeasureLimits, measure  # noqa: E402
from autotune.space import Candidate  # noqa: E402
from benchmarks._common import harness  # noqa: E402
from benchmarks._common.hog import cpu_hog  # noqa: E402
from benchmarks._common.stats import rotated  # noqa: E402

EPOCHS = 5
"""A short training run: long enough to amortise exploration, short enough to benchmark."""

MIN_EPOCH_S = 20.0
"""An epoch at the user's settings takes at least this long, as real epochs do."""

SHORT_EPOCH_S = 2.5
"""The short workload's epoch at the user's settings."""

REPEATS = 3
"""Repeats of the five runs: a median and a range of every ratio, not one draw of the noise."""

ORACLE_ROUNDS = 3
"""Interleaved rounds that rank the oracle candidates."""

ORACLE_WINDOW_S = 1.5
"""The measured window of one oracle-ranking measurement."""

MIN_BATCHES = 8
"""An epoch has at least this many batches, however fast the user's settings are."""

PROBE_WINDOW_S = 2.0
"""The measured window that sizes a workload's dataset."""

WORKLOADS = ("cifar10-like", "latency", "tensor", "imagefolder-jpeg", "photos-crop-48", "no-gain")
"""The suite's three workloads, two folders of images, and one where no loader setting can help."""

MODES = ("quiet", "loaded")
"""The machine as it is, and with one core kept busy by another process (NOTE [ Loaded mode ])."""

RUNS = ("user's settings", "drop-in", "tune+train", "oracle", "second run")
"""The five runs of one repeat, as the tables show them."""

TARGETS = (
    ("drop-in / user's settings", ("drop-in", "user's settings"), 1.02, MODES),
    ("drop-in / oracle", ("drop-in", "oracle"), 1.05, ("quiet",)),
    ("second run / oracle", ("second run", "oracle"), 1.02, MODES),
)
"""(name, (numerator, denominator), bound on the median ratio of wall times, modes it applies to)."""

QUICK = {"min_epoch_s": 0.1, "epochs": 1, "budget": 1.5, "repeats": 1, "workload": ["no-gain"]}
"""A smoke run: one tiny workload of a few batches, both modes, one repeat of one-epoch runs, a short
tuning budget (in the loaded mode it may run out, which the run records); its figures mean nothing."""

QUICK_OUT_PREFIX = "autotune-training-out-"
"""Prefix of the temporary folder a ``--quick`` run writes to when ``--out`` is not given."""


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


@dataclass
class Settings:
    """How long each run is and how each is measured (the command line, with the quick overrides)."""

    epochs: int
    budget_s: float | None
    repeats: int
    oracle_rounds: int = ORACLE_ROUNDS
    oracle_window_s: float = ORACLE_WINDOW_S
    probe_window_s: float = PROBE_WINDOW_S
    min_batches: int = MIN_BATCHES


class StepHeavyCNN(nn.Module):
    """Three 3x3 convolutions (32, 64, 64 channels, the last two of stride 2): about 57k parameters,
    a step of tens of milliseconds on 64 images of 32x32 on one CPU core, against a fraction of a
    millisecond to fetch them from memory."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv2d(3, 32, 3, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.Conv2d(64, 64, 3, stride=2, padding=1), nn.ReLU(inplace=True),
            nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, num_classes),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)


def no_gain_dataset(n: int, seed: int = 0) -> tud.TensorDataset:
    """``n`` 3x32x32 float32 images already decoded, in memory, and their labels."""
    gen = torch.Generator().manual_seed(seed)
    images = torch.rand((n, 3, 32, 32), generator=gen)
    return tud.TensorDataset(images, torch.randint(0, 10, (n,), generator=gen))


def no_gain_step() -> Callable[[Any], Any]:
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return wl.make_train_step(StepHeavyCNN())


def _move_only(batch: Any) -> None:
    """The step of a workload without one: the batch is only received."""


def _throughput(dataset: Any, step: Callable[[Any], Any], batch_size: int, window_s: float) -> float:
    m = measure(dataset, Candidate(batch_size=batch_size), step=step, limits=MeasureLimits(window_s=window_s))
    return m.samples_per_s


def build(name: str, epoch_s: float, s: Settings) -> Built:
    """The workload with as many samples as make an epoch of ``epoch_s`` at PyTorch's defaults, and
    at least ``s.min_batches`` batches."""
    tmp: list[Path] = []

    def size(dataset: Any, step: Callable[[Any], Any], batch_size: int) -> int:
        sps = _throughput(dataset, step, batch_size, s.probe_window_s)
        return max(batch_size * s.min_batches, int(sps * epoch_s))

    if name in ("cifar10-like", "latency", "tensor"):
        probe = wl.get_workload(name, n=2048)
        step = probe.step or _move_only
        n = size(probe.dataset, step, probe.batch_size)

        def make() -> Any:
            return wl.get_workload(name, n=n).dataset

        return Built(name, make, step, probe.batch_size, n,
                     wl.get_workload(name, n=n).description.split(";")[0], tmp)
    if name == "no-gain":
        step = no_gain_step()
        n = size(no_gain_dataset(512), step, 64)
        return Built(name, lambda: no_gain_dataset(n), step, 64, n,
                     "3x32x32 float tensors already in memory (nothing to decode), a step-heavy"
                     " 3-conv CNN trained on cpu", tmp)
    root = Path(tempfile.mkdtemp(prefix="autotune-training-"))
    tmp.append(root)
    if name == "imagefolder-jpeg":
        wl.write_image_folder(root / "probe", n=512)
        probe = wl.imagefolder_workload(root / "probe")
        n = size(probe.dataset, probe.step or _move_only, probe.batch_size)
        wl.write_image_folder(root / "data", n=n)
        w = wl.imagefolder_workload(root / "data")
        return Built(name, lambda: wl.imagefolder_workload(root / "data").dataset,
                     w.step or _move_only, w.batch_size, n, w.description, tmp)
    # photos-crop-48: photos of 120-320 px, RandomResizedCrop(48) + flip + ToTensor + Normalize
    from torchvision import datasets, transforms

    transform = transforms.Compose([
        transforms.RandomResizedCrop(48), transforms.RandomHorizontalFlip(), transforms.ToTensor(),
        transforms.Normalize(wl.IMAGENET_MEAN, wl.IMAGENET_STD),
    ])
    wl.write_photo_folder(root / "probe", n=256)
    probe_ds = datasets.ImageFolder(str(root / "probe"), transform=transform)
    n = size(probe_ds, wl.make_train_step(wl.SmallCNN(num_classes=len(probe_ds.classes))), 64)
    wl.write_photo_folder(root / "data", n=n)
    return Built(name, lambda: datasets.ImageFolder(str(root / "data"), transform=transform),
                 wl.make_train_step(wl.SmallCNN(num_classes=len(probe_ds.classes))), 64, n,
                 "JPEG photos of 120-320 px, RandomResizedCrop(48) + flip + ToTensor + Normalize", tmp)


def train(loader: Any, step: Callable[[Any], Any], epochs: int,
          after_epoch: Callable[[], None] | None = None,
          arrivals: list[float] | None = None) -> list[float]:
    """The user's loop; the seconds of each epoch. ``arrivals``, where given, gets the time each batch
    arrived at."""
    times = []
    for _ in range(epochs):
        t0 = time.perf_counter()
        for batch in loader:
            if arrivals is not None:
                arrivals.append(time.perf_counter())
            step(batch)
        times.append(time.perf_counter() - t0)
        if after_epoch is not None:
            after_epoch()
    return times


def _load() -> float:
    return round(os.getloadavg()[0], 2)


def _tuning(result: TuneResult | None) -> dict[str, Any]:
    """What a drop-in's result says about its decision, for the record."""
    if result is None:
        return {"decision": "nothing measured (the run was too short to tune)"}
    return {"decision": result.decision, "kept_baseline": result.kept_baseline,
            "speedup": result.speedup, "speedup_low": result.speedup_low,
            "speedup_high": result.speedup_high, "confidence": result.confidence,
            "baseline_kwargs": result.baseline_kwargs, "load_average_per_cpu": result.load_average,
            "trials": len(result.trials)}


class Repeat:
    """One repeat of the five runs of a workload in one mode (NOTE [ Training-run protocol ])."""

    def __init__(self, b: Built, s: Settings, pool: list[Candidate]) -> None:
        self.b, self.s, self.pool = b, s, pool
        self.runs: dict[str, dict[str, Any]] = {}
        self.store = Path(tempfile.mkdtemp(prefix="autotune-training-store-"))
        self.offline_store = Path(tempfile.mkdtemp(prefix="autotune-training-offline-"))
        self.threads = torch.get_num_threads()
        self.oracle: Candidate | None = None
        self.oracle_scores: dict[str, list[float]] = {}

    def run(self, forward: bool) -> dict[str, Any]:
        try:
            first = ["user's settings", "drop-in"]
            for label in first if forward else first[::-1]:
                self._one(label)
            self._one("tune+train")
            self._rank_oracle()
            last = ["oracle", "second run"]
            for label in last if forward else last[::-1]:
                self._one(label)
        finally:
            for path in (self.store, self.offline_store):
                shutil.rmtree(path, ignore_errors=True)
        return {"order": [k for k in self.runs], "runs": self.runs,
                "oracle_scores": self.oracle_scores}

    def _one(self, label: str) -> None:
        b, epochs = self.b, self.s.epochs
        ds = b.make()
        load_before = _load()
        extra: dict[str, Any] = {}
        chosen: Candidate | None
        t0 = time.perf_counter()
        if label == "user's settings":
            times = train(tud.DataLoader(ds, batch_size=b.batch_size, shuffle=True), b.step, epochs)
            chosen = Candidate(b.batch_size)
        elif label in ("drop-in", "second run"):
            loader = DataLoader(ds, batch_size=b.batch_size, shuffle=True, cache_dir=str(self.store))
            settled_at: list[bool] = []
            extra["profile_hit"] = loader.settled
            times = train(loader, b.step, epochs, after_epoch=lambda: settled_at.append(loader.settled))
            chosen = loader.tuning.candidate if loader.tuning else None
            extra.update(_tuning(loader.tuning))
            extra["settled_after_epoch"] = next((i + 1 for i, s in enumerate(settled_at) if s), None)
            loader.close()
        elif label == "tune+train":
            kwargs: dict[str, Any] = {"budget_s": self.s.budget_s} if self.s.budget_s else {}
            try:
                result = tune_loader(ds, b.step, batch_size=b.batch_size, cache_dir=str(self.offline_store),
                                     progress=False, **kwargs)
            except TuningFailed as err:  # what its user does then: train with their own settings
                extra["decision"] = f"tuning failed ({err}); trained with the user's settings"
                chosen = Candidate(b.batch_size)
                loader = tud.DataLoader(ds, batch_size=b.batch_size, shuffle=True)
            else:
                extra["decision"] = result.decision
                chosen = result.candidate
                loader = result.make_loader(ds, shuffle=True)
            extra["tuning_s"] = time.perf_counter() - t0
            times = train(loader, b.step, epochs)
            if isinstance(loader, DataLoader):
                loader.close()
        else:  # oracle
            assert self.oracle is not None
            chosen = self.oracle
            loader = DataLoader.configured(ds, chosen, shuffle=True)
            times = train(loader, b.step, epochs)
            loader.close()
        wall = time.perf_counter() - t0
        self.runs[label] = {"wall_s": wall, "epochs_s": times, "chosen": chosen.label() if chosen else None,
                            "candidate": chosen.to_dict() if chosen else None,
                            "load_before": load_before, "load_after": _load(), **extra}
        torch.set_num_threads(self.threads)
        pt.clear_builds()
        if chosen is not None and chosen not in self.pool:
            self.pool.append(chosen)
        print(f"    {label:<16} {wall:7.1f} s  {chosen.label() if chosen else ''}", file=sys.stderr,
              flush=True)

    def _rank_oracle(self) -> None:
        """The best of the pool by median epoch score over interleaved rounds."""
        b = self.b
        ds = b.make()
        scores: dict[Candidate, list[float]] = {c: [] for c in self.pool}
        for r in range(self.s.oracle_rounds):
            for c in rotated(self.pool, r):
                try:
                    m = measure(ds, c, step=b.step, limits=MeasureLimits(window_s=self.s.oracle_window_s))
                except CandidateError:
                    continue
                scores[c].append(score(m, c, b.n, self.s.epochs))
        self.oracle = max(self.pool, key=lambda c: statistics.median(scores[c]) if scores[c] else 0.0)
        self.oracle_scores = {c.label(): v for c, v in scores.items()}
        pt.clear_builds()
        torch.set_num_threads(self.threads)


def ratios(runs: dict[str, dict[str, Any]]) -> dict[str, float]:
    """Every target's ratio of wall times within one repeat, and tune+train's for the record."""
    out = {name: runs[a]["wall_s"] / runs[c]["wall_s"] for name, (a, c), _, _ in TARGETS}
    out["tune+train / oracle"] = runs["tune+train"]["wall_s"] / runs["oracle"]["wall_s"]
    out["user's settings / oracle"] = runs["user's settings"]["wall_s"] / runs["oracle"]["wall_s"]
    return out


def summarise(repeats: list[dict[str, Any]], mode: str) -> dict[str, Any]:
    """Medians and ranges over the repeats; the targets on the medians."""
    per = [ratios(r["runs"]) for r in repeats]
    summary = {k: {"median": statistics.median(p[k] for p in per), "min": min(p[k] for p in per),
                   "max": max(p[k] for p in per)} for k in per[0]}
    walls = {label: statistics.median(r["runs"][label]["wall_s"] for r in repeats) for label in RUNS}
    targets = {f"{name} <= {bound:g}x": summary[name]["median"] <= bound
               for name, _, bound, modes in TARGETS if mode in modes}
    return {"ratios": summary, "per_repeat": per, "median_wall_s": walls, "targets": targets}


def run_mode(b: Built, s: Settings, mode: str) -> dict[str, Any]:
    print(f"  {mode}", file=sys.stderr, flush=True)
    pool = [Candidate(b.batch_size)]
    with cpu_hog(enabled=mode == "loaded") as hog:
        load_start = harness.load_average()
        repeats = []
        for r in range(s.repeats):
            print(f"   repeat {r + 1}/{s.repeats}", file=sys.stderr, flush=True)
            repeats.append(Repeat(b, s, pool).run(forward=r % 2 == 0))
        load_end = harness.load_average()
    return {"mode": mode, "hog": hog, "load_start": load_start, "load_end": load_end, "repeats": repeats,
            **summarise(repeats, mode)}


def run_workload(b: Built, s: Settings, modes: list[str]) -> dict[str, Any]:
    print(f"{b.name}: {b.n} samples, batch {b.batch_size}", file=sys.stderr, flush=True)
    try:
        results = {mode: run_mode(b, s, mode) for mode in modes}
    finally:
        for path in b.cleanup:
            shutil.rmtree(path, ignore_errors=True)
    return {"name": b.name, "description": b.description, "samples": b.n, "batch_size": b.batch_size,
            "epochs": s.epochs, "modes": results}


# --------------------------------------------------------------------------------------------------
# The report

METHOD = """\
Wall time of a whole training run of the user's own loop, every epoch included (the drop-in's
exploration and `tune_loader`'s budget too), for five runs: the **user's settings** (the loader as the
script wrote it: PyTorch's defaults for these workloads), the **drop-in** `autotune.DataLoader` with an
empty profile store, **tune+train** (`tune_loader` then `make_loader`), the **oracle** (the best
configuration any run chose, or the defaults, ranked by interleaved measurements and fixed from the
start) and the drop-in's **second run** from its stored profile. Every mode has {repeats} repeat(s) of
the five runs; the user's settings run beside the drop-in and the oracle beside the second run,
in an order that flips every repeat. Ratios are taken within a repeat: the tables give their median
over the repeats and, in brackets, their range (min-max) as the spread. **loaded**: one other process
keeps one core busy for the whole mode (its CPU seconds are recorded below). See NOTE
[ Training-run protocol ] in `benchmarks/scripts/training.py` and NOTE [ Loaded mode ] in
`benchmarks/_common/hog.py`.

Targets (on the medians): drop-in <= 1.02x the user's settings in every workload and mode, first run
and its exploration included; drop-in <= 1.05x the oracle on the quiet machine; second run <= 1.02x
the oracle.

Workloads: `cifar10-like`, `latency`, `tensor` (the suite's), `imagefolder-jpeg` (a folder of JPEGs),
`photos-crop-48` (photos of 120-320 px with a random crop), **no-gain** (3x32x32 tensors already in
memory and a step-heavy CNN: nothing to load, so no loader setting can beat PyTorch's defaults and the
drop-in must cost nothing), and `cifar10-like` with 2.5 s epochs, where no tuner can amortise its
exploration. Each dataset is sized so that an epoch at the user's settings takes at least
{min_epoch_s:g} s on the quiet machine; the loaded mode runs the same dataset."""


def _ratio_cell(r: dict[str, float], repeats: int) -> str:
    if repeats < 2:
        return f"{r['median']:.2f}x"
    return f"{r['median']:.2f}x ({r['min']:.2f}-{r['max']:.2f})"


def _chosen(run: dict[str, Any]) -> str:
    return f"`{run['chosen']}`" if run["chosen"] else "nothing measured"


def markdown(meta: dict[str, Any], results: list[dict[str, Any]]) -> str:
    lines = ["# Training runs: the drop-in DataLoader inside the user's loop", ""]
    lines += [*harness.quick_notice(meta["quick"]),
        f"Run on {meta['date']} with `{meta['command']}` ({meta['total_s'] / 60:.1f} min in all).", "",
        f"Machine: {meta['machine']}. Load average (1, 5, 15 min) at the start: {meta['load']}.", "",
        METHOD.format(repeats=meta["repeats"], min_epoch_s=meta["min_epoch_s"]), "",
        "| workload | mode | samples | epoch at user's | user's settings | drop-in | tune+train | oracle |"
        " second run | drop-in / user's | drop-in / oracle | second run / oracle | drop-in chose | oracle |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|---|",
    ]
    for w in results:
        for mode, m in w["modes"].items():
            first = m["repeats"][0]["runs"]
            epoch = statistics.median(
                t for r in m["repeats"] for t in r["runs"]["user's settings"]["epochs_s"])
            n = len(m["repeats"])
            lines.append(
                f"| {w['name']} | {mode} | {w['samples']} | {epoch:.1f} s | "
                + " | ".join(f"{m['median_wall_s'][k]:.1f} s" for k in RUNS) + " | "
                + " | ".join(_ratio_cell(m["ratios"][name], n) for name, _, _, _ in TARGETS)
                + f" | {_chosen(first['drop-in'])} | {_chosen(first['oracle'])} |")
    lines += ["", "## Targets", "", "| workload | mode | target | median | met |", "|---|---|---|---:|---|"]
    for w in results:
        for mode, m in w["modes"].items():
            for target, met in m["targets"].items():
                name = target.split(" <=")[0]
                lines.append(f"| {w['name']} | {mode} | {target} | {m['ratios'][name]['median']:.2f}x |"
                             f" {'yes' if met else '**no**'} |")
    lines += ["", "## The drop-in's decisions", "",
              "Per repeat: what the drop-in chose, after which epoch it had settled, its reported speed-up"
              " against the user's settings with its interval, and the machine's load per CPU it"
              " recorded.", ""]
    for w in results:
        for mode, m in w["modes"].items():
            for i, r in enumerate(m["repeats"]):
                d = r["runs"]["drop-in"]
                interval = ("" if d.get("speedup_low") is None else
                            f" (interval {d['speedup_low']:.2f}-"
                            f"{d['speedup_high'] if d['speedup_high'] is not None else float('inf'):.2f}x)")
                speed = f"{d['speedup']:.2f}x{interval}" if d.get("speedup") is not None else "none"
                lines.append(f"- {w['name']}, {mode}, repeat {i + 1}: {_chosen(d)}, settled after epoch"
                             f" {d.get('settled_after_epoch')}, reported {speed}, load/CPU"
                             f" {d.get('load_average_per_cpu')}; {d.get('decision', '')}")
    lines += ["", "## Epoch times and load", ""]
    for w in results:
        for mode, m in w["modes"].items():
            hog = m["hog"]
            hog_text = (f"; the hog (pid {hog['pid']}) used {hog.get('cpu_s')} CPU s in"
                        f" {hog.get('alive_s')} s" if hog.get("enabled") else "")
            lines.append(f"- {w['name']}, {mode}: load average {m['load_start']} at the start,"
                         f" {m['load_end']} at the end{hog_text}")
            for i, r in enumerate(m["repeats"]):
                lines.append(f"  - repeat {i + 1} (in this order): " + "; ".join(
                    f"{k} " + ", ".join(f"{t:.1f}" for t in r["runs"][k]["epochs_s"])
                    + f" (load {r['runs'][k]['load_before']})" for k in r["order"]))
    return "\n".join(lines) + "\n"


def write(results: list[dict[str, Any]], meta: dict[str, Any], out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "training.json").write_text(json.dumps({"meta": meta, "workloads": results}, indent=1,
                                                  default=str) + "\n")
    (out / "TRAINING.md").write_text(markdown(meta, results))


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python benchmarks/scripts/training.py",
                                description=__doc__.splitlines()[0])
    p.add_argument("--epochs", type=int, default=None, help=f"epochs per run (default {EPOCHS})")
    p.add_argument("--min-epoch-s", type=float, default=None,
                   help=f"an epoch at the user's settings lasts at least this (default {MIN_EPOCH_S:g})")
    p.add_argument("--repeats", type=int, default=None, help=f"repeats of the five runs (default {REPEATS})")
    p.add_argument("--workload", action="append", choices=WORKLOADS, help="repeatable (default: all)")
    p.add_argument("--mode", action="append", choices=MODES, help="repeatable (default: both)")
    p.add_argument("--no-short", action="store_true", help="skip the short-epoch workload")
    p.add_argument("--budget", type=float, default=None, help="tune_loader's budget (default: its own)")
    p.add_argument("--quick", action="store_true", help="a smoke run: tiny epochs, its figures mean nothing")
    p.add_argument("--out", type=Path, default=None,
                   help="folder for TRAINING.md and training.json (default: benchmarks/results/training/;"
                   " with --quick, a new temporary folder)")
    args = p.parse_args(argv)
    harness.fill_in(args, QUICK, {"min_epoch_s": MIN_EPOCH_S, "epochs": EPOCHS, "repeats": REPEATS})
    args.no_short = args.no_short or args.quick
    harness.require_positive(p, args, "epochs", "repeats")
    return args


def out_folder(args: argparse.Namespace) -> Path:
    return harness.out_folder(args, __file__, QUICK_OUT_PREFIX)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    out = out_folder(args)
    settings = Settings(args.epochs, args.budget, args.repeats)
    if args.quick:
        settings = Settings(args.epochs, args.budget, args.repeats, oracle_rounds=1, oracle_window_s=0.3,
                            probe_window_s=0.5, min_batches=3)
    names = args.workload or list(WORKLOADS)
    modes = args.mode or list(MODES)
    started = time.time()
    meta: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "command": shlex.join(["python", "benchmarks/scripts/training.py",
                               *(argv if argv is not None else sys.argv[1:])]),
        "quick": args.quick,
        "machine": harness.describe_machine(),
        "load": ", ".join(f"{x:.2f}" for x in os.getloadavg()),
        "epochs": settings.epochs, "repeats": settings.repeats, "modes": modes,
        "min_epoch_s": args.min_epoch_s,
    }
    results = []
    for name in names:
        results.append(run_workload(build(name, args.min_epoch_s, settings), settings, modes))
        meta["total_s"] = round(time.time() - started, 1)
        write(results, meta, out)  # after every workload: a long run that is stopped keeps its figures
    if not args.no_short:
        short = build("cifar10-like", SHORT_EPOCH_S, settings)
        short.name = "cifar10-like (short epochs)"
        results.append(run_workload(short, settings, modes))
    meta["total_s"] = round(time.time() - started, 1)
    write(results, meta, out)
    print(f"wrote {out / 'TRAINING.md'}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
