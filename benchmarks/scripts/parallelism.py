"""Thread workers and out-of-order delivery against worker processes, side by side on this machine.

    python benchmarks/scripts/parallelism.py [--rounds 5] [--quick] [--out DIR]

# NOTE [ Parallelism benchmark ]
# For each workload (a straggler dataset, and the suite's cifar10-like with the ``ram`` cache,
# imagefolder JPEGs, tensor, latency), in one process and one run:
# 1. Screening: a small grid of candidates of three families, each measured once with
#    ``autotune.measure.measure`` (the tuner's protocol and guards): worker processes or none
#    ("process-only", what the search could pick before thread workers), thread workers, and
#    out-of-order delivery (the out-of-order twins of the best in-order candidates with workers).
#    The best of each family by samples/s is its pick.
# 2. Rounds: PyTorch's defaults, the three picks, the out-of-order pick's in-order twin (and, on the
#    straggler workload, the pair issue 13 quotes: eight worker processes in and out of order) are
#    measured again, interleaved, for ``rounds`` rounds, the order rotated each round, so slow drifts
#    of a shared machine hit every configuration alike. Each figure is the median over the rounds;
#    the spread is (max - min) / median. Only ratios of medians from the same rounds are compared.
# 3. "search" is the best of the three picks by median: what a search offered every kind keeps.
#    Its ratio to process-only is the "never loses" check; threads / process-only and
#    out-of-order / its in-order twin are the targets (>= 1.15x on cifar10-like with the cache,
#    >= 1.2x on the straggler workload).
# 4. torchdata.nodes (when installed): the thread pick's settings built with ParallelMapper
#    (method="thread") + Prefetcher, against ThreadDataLoader, interleaved, same step, same batches
#    (see NOTE [ Thread workers ] in autotune/threads.py for why autotune does not depend on it).
# Writes PARALLELISM.md and parallelism.json to benchmarks/results/parallelism/ (or --out).
"""

from __future__ import annotations

import argparse
import itertools
import json
import platform
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as a script: make the repository root importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

import torch  # noqa: E402
from torch.utils.data import Dataset  # noqa: E402

from autotune import pretransform as pt  # noqa: E402
from autotune import workloads as wl  # noqa: E402
from autotune.exceptions import CandidateError  # noqa: E402
from autotune.machine import detect_machine  # noqa: E402
from autotune.measure import MeasureLimits, measure  # noqa: E402
from autotune.space import Candidate  # noqa: E402
from benchmarks._common import harness  # noqa: E402

STRAGGLER_EVERY = 40
"""One read in this many is slow: the straggler workload of issue 13."""

STRAGGLER_SLOW_S, STRAGGLER_FAST_S = 0.100, 0.003
"""The slow read and every other read, in seconds."""

WORKLOADS = ("straggler", "cifar10-like-ram", "imagefolder-jpeg", "tensor", "latency")
"""Every workload, in the order it runs."""

SCREEN_WINDOW_S, ROUND_WINDOW_S = 1.0, 1.5
"""Steady-state windows for screening and for the rounds: the rounds get the longer one."""

ISSUE_PAIR = {
    "issue's pair, in order": Candidate(16, 8, False, 2, True),
    "issue's pair, out of order": Candidate(16, 8, False, 2, True, in_order=False),
}
"""The straggler comparison issue 13 quotes: eight worker processes, the default prefetch."""

TARGETS = {"cifar10-like-ram": ("threads", 1.15), "straggler": ("out-of-order", 1.2)}
"""The issue's targets: (which ratio, at least)."""


class StragglerDataset(Dataset[tuple[torch.Tensor, int]]):
    """One read in STRAGGLER_EVERY takes STRAGGLER_SLOW_S, the rest STRAGGLER_FAST_S (slow storage
    with a long tail); sample i is a (3, 32, 32) tensor made from i, the target i % 10."""

    def __init__(self, n: int = 4096) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        time.sleep(STRAGGLER_SLOW_S if index % STRAGGLER_EVERY == 7 else STRAGGLER_FAST_S)
        gen = torch.Generator().manual_seed(index)
        return torch.rand((3, 32, 32), generator=gen), index % 10


@dataclass
class Case:
    """One workload and the grid screened on it."""

    name: str
    dataset: Any
    step: Callable[[Any], Any] | None
    batch_size: int
    description: str
    pretransform: str = "none"
    workers: tuple[int, ...] = (1, 2, 4)
    torch_threads: tuple[int | None, ...] = (None,)
    prefetch: tuple[int, ...] = (2,)
    extra: dict[str, Candidate] = field(default_factory=dict)
    """Configurations measured in the rounds beside the picks, by name."""


def make_case(name: str, folder: Path, *, quick: bool) -> Case:
    if name == "straggler":
        n = 1024 if quick else 4096
        return Case(name, StragglerDataset(n), None, 16,
                    f"{n} samples, one read in {STRAGGLER_EVERY} takes {STRAGGLER_SLOW_S * 1000:g} ms and"
                    f" the rest {STRAGGLER_FAST_S * 1000:g} ms; no step", workers=(4, 8), prefetch=(1, 2, 4),
                    extra=ISSUE_PAIR)
    if name == "cifar10-like-ram":
        w = wl.cifar10_workload(1_000 if quick else 10_000)
        return Case(name, w.dataset, w.step, w.batch_size, w.description + "; the ram cache",
                    pretransform="ram", workers=(1, 2), torch_threads=(1, 2))
    if name == "imagefolder-jpeg":
        root = wl.write_image_folder(folder / "images", n=200 if quick else 2_000, size=128, fmt="JPEG")
        w = wl.imagefolder_workload(root, size=112)
        description = w.description.replace(f" under {root}", "")  # a temporary folder
        return Case(name, w.dataset, w.step, w.batch_size, description, workers=(1, 2, 4),
                    torch_threads=(1, 2))
    if name == "tensor":
        w = wl.tensor_workload(2_000 if quick else 20_000)
        return Case(name, w.dataset, w.step, w.batch_size, w.description, workers=(1, 2),
                    torch_threads=(1, 2))
    if name == "latency":
        w = wl.latency_workload(512 if quick else 2_048)
        return Case(name, w.dataset, w.step, w.batch_size, w.description, workers=(2, 4, 8))
    raise ValueError(f"unknown workload {name!r}; use one of {WORKLOADS}.")


def families(case: Case) -> dict[str, list[Candidate]]:
    """The in-order screening grid by family (out-of-order twins are added after screening)."""
    base = Candidate(case.batch_size, pretransform=case.pretransform)
    process = [replace(base, torch_threads=t) for t in case.torch_threads]
    threads = []
    for t, w, pf in itertools.product(case.torch_threads, case.workers, case.prefetch):
        process.append(replace(base, num_workers=w, prefetch_factor=pf, persistent_workers=True,
                               torch_threads=t))
        threads.append(replace(base, num_workers=w, prefetch_factor=pf, worker_kind="thread",
                               torch_threads=t))
    return {"process-only": process, "threads": threads}


@dataclass
class Figures:
    """One configuration's measurements in the rounds."""

    name: str
    candidate: Candidate
    samples_per_s: list[float] = field(default_factory=list)
    failures: list[str] = field(default_factory=list)

    @property
    def median(self) -> float:
        return statistics.median(self.samples_per_s) if self.samples_per_s else 0.0

    @property
    def spread(self) -> float:
        med = self.median
        return (max(self.samples_per_s) - min(self.samples_per_s)) / med if med > 0 else 0.0


def log(message: str) -> None:
    print(f"[parallelism {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def measure_once(case: Case, c: Candidate, window_s: float) -> float | str:
    limits = MeasureLimits(window_s=window_s, min_batches=5, batch_timeout_s=30, trial_timeout_s=60)
    try:
        return measure(case.dataset, c, step=case.step, limits=limits, shuffle=True, seed=0).samples_per_s
    except CandidateError as err:
        return f"{type(err).__name__}: {err}"


def _log_screen(family: str, c: Candidate, sps: float | str) -> None:
    log(f"  screen {family:13s} {c.label():32s} {sps if isinstance(sps, str) else f'{sps:8.0f}/s'}")


def screen(case: Case) -> dict[str, Candidate]:
    """The best candidate of each family by one measurement each (step 1 of the NOTE)."""
    best: dict[str, tuple[float, Candidate]] = {}
    for family, candidates in families(case).items():
        for c in candidates:
            sps = measure_once(case, c, SCREEN_WINDOW_S)
            _log_screen(family, c, sps)
            if isinstance(sps, float) and sps > best.get(family, (0.0, c))[0]:
                best[family] = (sps, c)
    ordered = [c for _, c in best.values() if c.num_workers > 0]
    for c in ordered:
        twin = replace(c, in_order=False)
        sps = measure_once(case, twin, SCREEN_WINDOW_S)
        _log_screen("out-of-order", twin, sps)
        if isinstance(sps, float) and sps > best.get("out-of-order", (0.0, twin))[0]:
            best["out-of-order"] = (sps, twin)
    return {family: c for family, (_, c) in best.items()}


def rounds(case: Case, picks: dict[str, Candidate], n_rounds: int) -> dict[str, Figures]:
    """Step 2 of the NOTE: every configuration once per round, the order rotated each round."""
    configs = {"defaults": Candidate(case.batch_size), **picks}
    if "out-of-order" in picks:
        configs["in-order twin"] = replace(picks["out-of-order"], in_order=True)
    configs.update(case.extra)
    figures = {name: Figures(name, c) for name, c in configs.items()}
    names = list(figures)
    for r in range(n_rounds):
        order = names[r % len(names):] + names[:r % len(names)]
        for name in order:
            sps = measure_once(case, figures[name].candidate, ROUND_WINDOW_S)
            if isinstance(sps, str):
                figures[name].failures.append(sps)
            else:
                figures[name].samples_per_s.append(sps)
        log(f"  round {r + 1}/{n_rounds}: " + ", ".join(f"{n} {f.median:.0f}" for n, f in figures.items()))
    return figures


def torchdata_side_by_side(case: Case, c: Candidate, n_rounds: int, window_s: float) -> dict[str, Any] | None:
    """Step 4 of the NOTE: ThreadDataLoader against torchdata.nodes with the same settings."""
    try:
        import torchdata.nodes as tn
    except ImportError:
        return None
    from torch.utils.data import BatchSampler, RandomSampler, default_collate

    from autotune.measure import build_loader, torch_threads

    prepared = pt.prepare(case.dataset, c.pretransform, device=torch.device("cpu"))
    data, collate = prepared.loader_parts(None)
    collate = collate or default_collate
    getitems = getattr(data, "__getitems__", None)

    def fetch(indices: list[int]) -> Any:
        return collate(getitems(indices) if getitems else [data[i] for i in indices])

    def nodes_loader() -> Any:
        sampler = BatchSampler(RandomSampler(range(len(data))), c.batch_size, drop_last=False)
        node = tn.SamplerWrapper(sampler)
        node = tn.ParallelMapper(node, fetch, num_workers=c.num_workers, method="thread",
                                 in_order=c.in_order)
        return tn.Loader(tn.Prefetcher(node, prefetch_factor=c.num_workers * (c.prefetch_factor or 2)))

    def ours() -> Any:
        return build_loader(case.dataset, c, shuffle=True, prepared=prepared)

    def timed(make: Callable[[], Any]) -> float:
        """samples/s over at least ``window_s`` and 5 batches, after 3 warm-up batches."""
        with torch_threads(c.torch_threads):
            it = iter(make())
            for _ in range(3):
                next(it)
            t0, samples, n = time.perf_counter(), 0, 0
            while n < 5 or time.perf_counter() - t0 < window_s:
                try:
                    batch = next(it)
                except StopIteration:
                    it = iter(make())
                    batch = next(it)
                samples += c.batch_size
                n += 1
                if case.step is not None:
                    case.step(batch)
            elapsed = time.perf_counter() - t0
            close = getattr(it, "close", None)
            if close is not None:
                close()
            del it
        return samples / elapsed

    runs: dict[str, list[float]] = {"ThreadDataLoader": [], "torchdata.nodes": []}
    for r in range(n_rounds):
        pair = [("ThreadDataLoader", ours), ("torchdata.nodes", nodes_loader)]
        for name, make in pair[r % 2:] + pair[:r % 2]:
            runs[name].append(timed(make))
    med = {k: statistics.median(v) for k, v in runs.items()}
    log(f"  torchdata.nodes vs ThreadDataLoader: {med['torchdata.nodes'] / med['ThreadDataLoader']:.2f}x")
    return {"candidate": c.label(), "samples_per_s": runs, "median": med,
            "nodes_over_ours": med["torchdata.nodes"] / med["ThreadDataLoader"]}


def run_case(case: Case, n_rounds: int, quick: bool) -> dict[str, Any]:
    t0 = time.monotonic()
    log(f"{case.name}: {case.description}")
    if case.pretransform != "none":
        pt.prepare(case.dataset, case.pretransform, device=torch.device("cpu"))  # built once, before
    picks = screen(case)
    figures = rounds(case, picks, n_rounds)
    process = figures["process-only"].median
    search = max((figures[k] for k in ("process-only", "threads", "out-of-order") if k in figures),
                 key=lambda f: f.median)

    def ratio(a: str, b: str) -> float | None:
        if a not in figures or b not in figures or figures[b].median <= 0:
            return None
        return figures[a].median / figures[b].median

    in_order_best = max((figures[k].median for k in ("process-only", "threads") if k in figures), default=0.0)
    ratios = {
        "threads / process-only": ratio("threads", "process-only"),
        "out-of-order / in-order twin": ratio("out-of-order", "in-order twin"),
        "out-of-order / best in-order": (figures["out-of-order"].median / in_order_best
                                         if "out-of-order" in figures and in_order_best > 0 else None),
        "search / process-only": search.median / process if process > 0 else None,
        "process-only / defaults": ratio("process-only", "defaults"),
        "threads / defaults": ratio("threads", "defaults"),
    }
    if case.extra:
        ratios["issue's pair: out of order / in order"] = ratio(
            "issue's pair, out of order", "issue's pair, in order")
    nodes = None
    if "threads" in picks:
        nodes = torchdata_side_by_side(case, picks["threads"], 3 if quick else 5, ROUND_WINDOW_S)
    return {
        "workload": case.name,
        "description": case.description,
        "batch_size": case.batch_size,
        "configurations": {
            n: {"label": f.candidate.label(), "candidate": f.candidate.to_dict(),
                "samples_per_s": f.samples_per_s, "median_samples_per_s": f.median, "spread": f.spread,
                "failures": f.failures}
            for n, f in figures.items()
        },
        "search_pick": search.name,
        "ratios": ratios,
        "torchdata_nodes": nodes,
        "seconds": time.monotonic() - t0,
    }


def _fmt(x: float | None) -> str:
    return "n/a" if x is None else f"{x:.2f}x"


def write_markdown(report: dict[str, Any], path: Path) -> None:
    m = report["machine"]
    lines = [
        "# Thread workers and out-of-order delivery: measured side by side",
        "",
        f"Run {report['date']} on {m['usable_cpus']} usable CPUs ({m['cpu']}), torch {m['torch']},"
        f" {report['rounds']} interleaved rounds per workload; generated by `python"
        " benchmarks/scripts/parallelism.py` (NOTE [ Parallelism benchmark ] in the script says how)."
        " The machine is shared: only ratios of medians taken in the same rounds are compared;"
        " the spread is (max - min) / median over the rounds. \"search\" is the pick with the best"
        " median of the three, what a search offered every kind keeps (the tuner itself also prefers"
        " in-order delivery and fewer workers within its 3 % tie tolerance).",
        "",
        "| workload | process-only | threads | out-of-order | threads / process-only |"
        " out-of-order / in-order | search / process-only | target |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for case in report["workloads"]:
        cfg, r = case["configurations"], case["ratios"]

        def cell(name: str, cfg: dict[str, Any] = cfg) -> str:
            if name not in cfg:
                return "-"
            c = cfg[name]
            return f"`{c['label']}` {c['median_samples_per_s']:.0f}/s ±{c['spread']:.0%}"

        target = TARGETS.get(case["workload"])
        verdict = "-"
        if target is not None:
            keys = (["threads / process-only"] if target[0] == "threads" else
                    ["out-of-order / in-order twin", "issue's pair: out of order / in order"])
            verdict = f"{target[0]} >= {target[1]}x: " + "; ".join(
                f"{'met' if (v := r.get(k)) is not None and v >= target[1] else 'missed'}"
                + (f" ({k.split(':')[0]}, {_fmt(v)})" if len(keys) > 1 else "")
                for k in keys if k in r)
        lines.append(
            f"| {case['workload']} | {cell('process-only')} | {cell('threads')} | {cell('out-of-order')}"
            f" | {_fmt(r['threads / process-only'])} | {_fmt(r['out-of-order / in-order twin'])}"
            f" | {_fmt(r['search / process-only'])} ({case['search_pick']}) | {verdict} |"
        )
    lines += [
        "",
        "Where the in-order twin is the same configuration as another pick (tensor, latency), the two"
        " differ by noise alone: a measure of how far apart two medians of this shared machine can be.",
        "",
        "Against PyTorch's defaults (same rounds):",
        "",
    ]
    for case in report["workloads"]:
        r, cfg = case["ratios"], case["configurations"]
        twin = cfg.get("in-order twin")
        lines.append(
            f"- {case['workload']}: defaults {cfg['defaults']['median_samples_per_s']:.0f}/s;"
            f" process-only {_fmt(r['process-only / defaults'])}, threads {_fmt(r['threads / defaults'])}"
            + (f"; in-order twin `{twin['label']}` {twin['median_samples_per_s']:.0f}/s" if twin else "")
            + f"; out-of-order / best in-order pick {_fmt(r['out-of-order / best in-order'])}"
            + "".join(f"; {k} {_fmt(v)}" for k, v in r.items() if k.startswith("issue's"))
            + f". {case['description']}."
        )
    nodes = [c for c in report["workloads"] if c.get("torchdata_nodes")]
    if nodes:
        lines += ["", "torchdata.nodes (ParallelMapper with threads + Prefetcher) against ThreadDataLoader,"
                  " same settings, same step, interleaved:", ""]
        for case in nodes:
            n = case["torchdata_nodes"]
            lines.append(f"- {case['workload']} (`{n['candidate']}`): torchdata.nodes / ThreadDataLoader ="
                         f" {n['nodes_over_ours']:.2f}x")
    lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--quick", action="store_true", help="small datasets, 2 rounds: a smoke run")
    parser.add_argument("--out", type=Path, default=None,
                        help="folder for PARALLELISM.md and parallelism.json (default:"
                        " benchmarks/results/parallelism/, or a temporary folder with --quick)")
    parser.add_argument("--workloads", nargs="*", default=list(WORKLOADS), choices=WORKLOADS)
    harness.add_render(parser, "PARALLELISM.md")
    args = parser.parse_args(argv)
    if harness.render(args, "PARALLELISM.md", write_markdown):
        return 0
    n_rounds = 2 if args.quick else args.rounds
    out = args.out or (Path(tempfile.mkdtemp(prefix="autotune-parallelism-")) if args.quick
                       else harness.results_folder(__file__))
    out.mkdir(parents=True, exist_ok=True)
    machine = detect_machine()
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "rounds": n_rounds,
        "machine": {"usable_cpus": machine.usable_cpus, "cpu": platform.processor() or platform.machine(),
                    "torch": torch.__version__},
        "workloads": [],
    }
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="autotune-parallelism-data-") as tmp:
        for name in args.workloads:
            case = make_case(name, Path(tmp), quick=args.quick)
            report["workloads"].append(run_case(case, n_rounds, args.quick))
            pt.clear_builds()
    report["seconds"] = time.monotonic() - t0
    (out / "parallelism.json").write_text(json.dumps(report, indent=2, default=str))
    write_markdown(report, out / "PARALLELISM.md")
    log(f"wrote {out / 'PARALLELISM.md'} and parallelism.json in {report['seconds']:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
