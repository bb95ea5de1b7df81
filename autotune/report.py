"""What a tuning run found, for people and for machines: a summary, the code to paste, and JSON.

Everything here reads a :class:`~autotune.result.TuneResult`, above it; nothing measures. The trial
table and the plot are the result's own (``TuneResult.table()``, ``TuneResult.plot()``), so that a
result shows itself without reaching up here.
"""

from __future__ import annotations

import json
import textwrap
from typing import Any

from .machine import SHM_DIR, fingerprint_limits
from .profiles import mask_url
from .result import TuneResult, built_text
from .shm import SHM_FIX

TEXT_WIDTH = 96
"""Width prose in the summary is wrapped to, so it reads in a 100-column terminal."""

BUSY_LOAD = 0.25
"""Other processes' work per usable CPU above which the summary calls the machine busy (one process
keeping one core of two busy reads 0.5; NOTE [ Others' load ] in machine.py)."""

DASHBOARD_INSTALL_HINT = "pip install 'dataloader-autotune[dashboard]'"
"""How to get the ``optuna-dashboard`` command :func:`dashboard_hint` prints."""


def loader_code(result: TuneResult, dataset_name: str = "dataset", *, width: int | None = None) -> str:
    """The loader statement for the best settings, ready to paste.

    ``DataLoader(...)`` (torch's) for worker processes or none; ``ThreadDataLoader(...)`` (autotune's)
    when thread workers won, since a plain DataLoader cannot start them. One line, or, when that is
    longer than ``width``, the arguments wrapped and indented black-style.
    """
    cls = "ThreadDataLoader" if result.candidate.threaded else "DataLoader"
    args = [dataset_name, *(f"{k}={v!r}" for k, v in result.loader_kwargs.items())]
    line = f"loader = {cls}({', '.join(args)})"
    if width is None or len(line) <= width:
        return line
    body = textwrap.wrap(", ".join(args) + ",", width=width - 4, break_long_words=False,
                         break_on_hyphens=False)
    return "\n".join([f"loader = {cls}(", *(f"    {ln}" for ln in body), ")"])


def measurements_of_best(result: TuneResult) -> int:
    """How many complete measurements the chosen configuration has (its figures are their medians)."""
    chosen = result.candidate
    return sum(1 for t in result.trials if t.state == "complete" and t.candidate == chosen)


def limits(result: TuneResult) -> str | None:
    """The limits the result was tuned under (CPUs, memory, /dev/shm), from its machine fingerprint."""
    return fingerprint_limits(result.machine) if result.machine else None


def shm_bound(result: TuneResult) -> bool:
    """Whether /dev/shm ruled out or failed a configuration of the search (NOTE [ Shared memory ] in
    shm.py): then the report gives the fix."""
    return any(t.state in ("failed", "infeasible") and SHM_DIR in (t.reason or "") for t in result.trials)


def summary(result: TuneResult) -> dict[str, Any]:
    """The headline figures as JSON-able values (the ``"summary"`` of :func:`to_json`)."""
    return {
        "loader_kwargs": dict(result.loader_kwargs),
        "pretransform": result.pretransform,
        "torch_threads": result.torch_threads,
        "code": loader_code(result),
        "samples_per_s": result.samples_per_s,
        "baseline_kwargs": result.baseline_kwargs,
        "baseline_samples_per_s": result.baseline_samples_per_s,
        "speedup": result.speedup,
        "speedup_low": result.speedup_low,
        "speedup_high": result.speedup_high,
        "confidence": result.confidence,
        "kept_baseline": result.kept_baseline,
        "challenger": result.challenger,
        "undecided": result.undecided,
        "decision": result.decision,
        "load_average": result.load_average,
        "spread": result.spread,
        "busy": result.busy,
        "wait_fraction": result.wait_fraction,
        "diagnosis": result.diagnosis(),
        "measurements": measurements_of_best(result),
        "trials": len(result.trials),
        "from_cache": result.from_cache,
        "tuning_s": result.tuning_s,
        "limits": limits(result),
        "shm_bound": shm_bound(result),
        "shm_fix": SHM_FIX if shm_bound(result) else None,
        "key": result.key,
        "study_name": result.study_name,
        "storage_url": mask_url(result.storage_url) if result.storage_url else None,
    }


def summary_text(result: TuneResult) -> str:
    """The best settings as code to paste, the speed-up, the spread, the diagnosis, the cache status."""
    lines = ["Best DataLoader settings for this machine and workload:", ""]
    if result.candidate.threaded:
        lines.append("    from autotune import ThreadDataLoader")
    lines += [f"    {ln}" for ln in loader_code(result, width=TEXT_WIDTH - 4).splitlines()]
    if result.torch_threads is not None:
        lines.append(f"    torch.set_num_threads({result.torch_threads})")
    lines.append("")
    if result.candidate.threaded:
        lines += [*textwrap.wrap(
            f"Thread workers won: {result.candidate.num_workers} threads in the main process load the"
            " batches. torch.utils.data.DataLoader cannot start threads; autotune.ThreadDataLoader is a"
            " DataLoader subclass that does, and result.make_loader(dataset) builds it for you.",
            width=TEXT_WIDTH), ""]
    if result.pretransform != "none":
        where = "into RAM" if result.pretransform == "ram" else f"onto {result.device}"
        lines += [
            *textwrap.wrap(
                f"The deterministic part of the transform runs once, {where}"
                f" (pretransform={result.pretransform!r}). A plain DataLoader does not do that: build"
                " the loader from the tuning result, which wraps the dataset:",
                width=TEXT_WIDTH,
            ),
            "",
            "    result = autotune.tune_loader(dataset, step, ...)   # instant: the profile is stored",
            "    loader = result.make_loader(dataset, shuffle=True)",
            "",
        ]
    n = measurements_of_best(result)
    basis = f"median of {n} measurement{'s' if n != 1 else ''}" if n else "stored figures"
    lines.append(f"Throughput:  {result.samples_per_s:,.0f} samples/s ({basis}, spread {result.spread:.0%})")
    against = result.baseline_text()
    if result.speedup is not None and result.baseline_samples_per_s is not None:
        steady = (
            f"; {result.throughput_speedup:.2f}x in steady-state samples/s"
            if result.throughput_speedup is not None else ""
        )
        lines += textwrap.wrap(
            f"Speed-up:    {result.speedup_text()} over {against} for {result.epochs} epochs,"
            f" start-up included{built_text(result)}{steady}", width=TEXT_WIDTH, subsequent_indent=" " * 13)
        lines.append(
            f"             (baseline: {result.baseline_samples_per_s:,.0f} samples/s, measured in"
            " the same run)"
        )
    else:
        lines.append(f"Speed-up:    not known ({against} could not be measured)")
    if result.decision:
        lines += textwrap.wrap(f"Decision:    {result.decision}", width=TEXT_WIDTH,
                               subsequent_indent=" " * 13)
    if result.load_average is not None:
        lines.append(f"Load:        other processes ran {result.load_average:.2f} of each usable CPU while"
                     " it tuned" + (" (a busy machine: figures are noisier)"
                                    if result.load_average > BUSY_LOAD else ""))
    lines.append(f"Diagnosis:   {result.diagnosis()}")
    if (limited := limits(result)) is not None:
        lines.append(f"Limits:      {limited}")
    if shm_bound(result):
        lines += textwrap.wrap(
            f"{SHM_DIR + ':':<13}too small for the batches worker processes pass here, so they were left out"
            f" or failed (see the reasons above); the fix: {SHM_FIX}", width=TEXT_WIDTH,
            subsequent_indent=" " * 13)
    if result.from_cache:
        lines.append(
            f"Cache:       from the stored profile {result.key} (not measured now; --retune measures"
            " again)"
        )
    else:
        stored = f", stored as profile {result.key}" if result.key else ""
        n_trials = len(result.trials)
        lines.append(
            f"Cache:       measured now: {n_trials} trial{'s' if n_trials != 1 else ''} in"
            f" {result.tuning_s:.0f} s{stored}"
        )
    return "\n".join(lines)


def dashboard_hint(result: TuneResult) -> str:
    """The command that shows every trial of the run in optuna-dashboard, or why there is none.

    The storage URL is shown with its password masked (a profile stored before passwords were
    masked included); optuna-dashboard is not a dependency, so the line says how to install it.
    """
    url = result.storage_url
    if not url or not result.study_name:
        return "Every trial is listed above; this run's study was kept in memory only."
    shown = mask_url(url)
    if url.startswith("sqlite:"):
        command = f"optuna-dashboard {shown}"
        where = f"See every trial: {command}   (study {result.study_name})"
    else:
        where = (
            f"Every trial is in the Optuna storage {shown}, study {result.study_name}; see them with"
            f" `optuna-dashboard URL`, the URL with its password"
        )
    return f"{where}\n(optuna-dashboard comes with `{DASHBOARD_INSTALL_HINT}`)"


def to_json(result: TuneResult, *, indent: int | None = 2) -> str:
    """``result.to_dict()`` plus a ``"summary"`` of the headline figures, as one JSON document."""
    data = result.to_dict()
    data["summary"] = summary(result)
    if data.get("storage_url"):
        data["storage_url"] = mask_url(data["storage_url"])
    return json.dumps(data, indent=indent, default=str)
