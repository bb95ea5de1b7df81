"""What a tuning run found, for people and for machines: the trial table, a summary, JSON and a plot.

Everything here reads a :class:`~autotune.result.TuneResult` and its :class:`~autotune.decide.TrialRecord`
objects; nothing measures. matplotlib is imported only by :func:`plot`, and draws on an Agg canvas of
its own, so a plot never changes the backend a notebook or script has chosen.
"""

from __future__ import annotations

import json
import statistics
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .machine import SHM_DIR, fingerprint_limits
from .profiles import mask_url
from .shm import SHM_FIX

if TYPE_CHECKING:
    from .decide import TrialRecord
    from .result import TuneResult

REASON_WIDTH = 92
"""Characters of a failure reason shown under the table: one line of a 100-column terminal."""

TEXT_WIDTH = 96
"""Width prose in the summary is wrapped to, so it reads in a 100-column terminal."""

BUSY_LOAD = 0.25
"""Other processes' work per usable CPU above which the summary calls the machine busy (one process
keeping one core of two busy reads 0.5; NOTE [ Others' load ] in machine.py)."""

PLOT_INSTALL_HINT = "pip install 'dataloader-autotune[plot]'"
"""How to get matplotlib for :func:`plot` (the package is installed as ``dataloader-autotune``)."""

DASHBOARD_INSTALL_HINT = "pip install 'dataloader-autotune[dashboard]'"
"""How to get the ``optuna-dashboard`` command :func:`dashboard_hint` prints."""

_COLUMNS: tuple[tuple[str, str], ...] = (
    # (header, alignment) -- numbers right-aligned, words left-aligned
    ("#", ">"),
    ("phase", "<"),
    ("batch", ">"),
    ("wrk", ">"),
    ("ord", "<"),
    ("pin", "<"),
    ("pf", ">"),
    ("pers", "<"),
    ("pretf", "<"),
    ("tthr", ">"),
    ("samples/s", ">"),
    ("step ms", ">"),
    ("busy%", ">"),
    ("wait%", ">"),
    ("score", ">"),
    ("state", "<"),
)

_LEGEND = (
    "wrk = worker processes (2) or threads (2t), ord = batches in order (-) or as ready (any),\n"
    "pf = prefetch_factor, pers = persistent_workers, pretf = pretransform, tthr = torch threads,\n"
    "busy/wait = share of the time in the step/waiting for data, * = chosen"
)


# --------------------------------------------------------------------------------------------------
# Text


def _flag(value: bool) -> str:
    return "yes" if value else "-"


def _opt(value: Any) -> str:
    return "-" if value is None else str(value)


def _shorten(text: str, width: int) -> str:
    text = " ".join(text.split())
    return text if len(text) <= width else text[: width - 3].rstrip() + "..."


def _trial_row(t: TrialRecord, chosen: bool, note: str) -> list[str]:
    c, m = t.candidate, t.measurement
    state = t.state + (f" [{note}]" if note else "")
    return [
        f"{t.number}{'*' if chosen else ''}",
        t.phase,
        str(c.batch_size),
        f"{c.num_workers}t" if c.threaded else str(c.num_workers),
        "-" if c.in_order else "any",
        _flag(c.pin_memory),
        _opt(c.prefetch_factor),
        _flag(c.persistent_workers and c.num_workers > 0),
        c.pretransform,
        _opt(c.torch_threads),
        f"{m.samples_per_s:,.0f}" if m else "-",
        (f"{m.step_ms:.1f}" if m.step_ms >= 1 else f"{m.step_ms:.2f}") if m else "-",
        f"{m.busy * 100:.0f}" if m else "-",
        f"{m.wait_fraction * 100:.0f}" if m else "-",
        f"{t.score:,.0f}" if t.score is not None else "-",
        state,
    ]


def trial_table(result: TuneResult) -> str:
    """Every trial, one row each, with the reasons for failed, pruned and infeasible ones below.

    Numbers are right-aligned; the rows fit a 100-column terminal. The chosen configuration's rows
    are starred; a reason shared by several trials is listed once.
    """
    chosen = result.candidate if result.loader_kwargs else None
    notes: dict[str, str] = {}
    rows: list[list[str]] = []
    for t in result.trials:
        note = ""
        if t.state != "complete" and t.reason:
            note = notes.setdefault(t.reason, str(len(notes) + 1))
        rows.append(_trial_row(t, chosen is not None and t.candidate == chosen, note))
    headers = [h for h, _ in _COLUMNS]
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: Sequence[str]) -> str:
        parts = [f"{cell:{align}{w}}" for cell, (_, align), w in zip(cells, _COLUMNS, widths, strict=True)]
        return " ".join(parts).rstrip()

    out = [line(headers), line(["-" * w for w in widths])]
    out += [line(r) for r in rows]
    if not rows:
        out.append("(no trials: this result was not measured in this run)")
    out += ["", _LEGEND]
    for reason, number in notes.items():
        out.append(_shorten(f"[{number}] {reason}", REASON_WIDTH))
    return "\n".join(out)


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


def baseline_text(result: TuneResult) -> str:
    """What the speed-up is against: the user's settings, or PyTorch's defaults."""
    defaults = {"num_workers": 0, "pin_memory": False, "prefetch_factor": 2, "persistent_workers": False,
                "in_order": True}
    kwargs = {k: v for k, v in (result.baseline_kwargs or {}).items()
              if k != "batch_size" and defaults.get(k, object()) != v}
    if not kwargs:
        return "PyTorch's defaults"
    return "your settings (" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"


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
    against = baseline_text(result)
    if result.speedup is not None and result.baseline_samples_per_s is not None:
        steady = (
            f"; {result.throughput_speedup:.2f}x in steady-state samples/s"
            if result.throughput_speedup is not None else ""
        )
        lines += textwrap.wrap(
            f"Speed-up:    {result.speedup_text()} over {against} for {result.epochs} epochs,"
            f" start-up and cache build included{steady}", width=TEXT_WIDTH, subsequent_indent=" " * 13)
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


# --------------------------------------------------------------------------------------------------
# Plot


def _series(result: TuneResult) -> dict[tuple[int, str], dict[int, list[tuple[float, float]]]]:
    """(batch_size, pretransform) -> num_workers -> [(samples/s, busy)] of every complete trial."""
    out: dict[tuple[int, str], dict[int, list[tuple[float, float]]]] = {}
    for t in result.trials:
        if t.state != "complete" or t.measurement is None:
            continue
        c, m = t.candidate, t.measurement
        out.setdefault((c.batch_size, c.pretransform), {}).setdefault(c.num_workers, []).append(
            (m.samples_per_s, m.busy)
        )
    return out


def plot(result: TuneResult, path: str | Path) -> str:
    """Throughput and busy fraction against ``num_workers``, one series per batch size and pretransform.

    Every measurement is a dot; the line joins the median at each worker count. The baseline and the
    chosen configuration are marked. Saved as an image at ``path`` (PNG unless the suffix
    says otherwise); returns the path.
    """
    try:
        from matplotlib.backends.backend_agg import FigureCanvasAgg
        from matplotlib.figure import Figure
    except ImportError as err:
        raise ImportError(f"plotting needs matplotlib; install it with {PLOT_INSTALL_HINT}") from err

    fig = Figure(figsize=(11, 4.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax_sps, ax_busy = fig.subplots(1, 2)
    series = _series(result)
    for i, ((bs, pretf), by_workers) in enumerate(sorted(series.items())):
        color = f"C{i % 10}"
        label = f"batch {bs}" + ("" if pretf == "none" else f", pretransform {pretf}")
        workers = sorted(by_workers)
        for w in workers:
            pts = by_workers[w]
            ax_sps.scatter([w] * len(pts), [p[0] for p in pts], color=color, alpha=0.35, s=14)
            ax_busy.scatter([w] * len(pts), [p[1] * 100 for p in pts], color=color, alpha=0.35, s=14)
        med_sps = [statistics.median(p[0] for p in by_workers[w]) for w in workers]
        med_busy = [statistics.median(p[1] for p in by_workers[w]) * 100 for w in workers]
        ax_sps.plot(workers, med_sps, "-o", color=color, label=label, markersize=5)
        ax_busy.plot(workers, med_busy, "-o", color=color, label=label, markersize=5)

    if result.baseline_samples_per_s is not None:
        ax_sps.axhline(result.baseline_samples_per_s, color="0.4", linestyle=":", linewidth=1,
                       label=f"baseline ({baseline_text(result)})")
    if result.loader_kwargs and result.samples_per_s > 0:
        w = int(result.loader_kwargs.get("num_workers", 0))
        ax_sps.scatter([w], [result.samples_per_s], marker="*", s=220, color="gold",
                       edgecolors="black", zorder=5, label="chosen")
        ax_busy.scatter([w], [result.busy * 100], marker="*", s=220, color="gold",
                        edgecolors="black", zorder=5)

    ax_sps.set_xlabel("num_workers")
    ax_sps.set_ylabel("samples/s")
    ax_sps.set_title("Throughput")
    ax_sps.set_ylim(bottom=0)
    ax_busy.set_xlabel("num_workers")
    ax_busy.set_ylabel("busy %  (share of the time in the step)")
    ax_busy.set_title("Busy fraction")
    ax_busy.set_ylim(0, 105)
    for ax in (ax_sps, ax_busy):
        ax.grid(True, alpha=0.3)
        ax.xaxis.get_major_locator().set_params(integer=True)
    if series:
        ax_sps.legend(fontsize="small")
    else:
        ax_sps.text(0.5, 0.5, "no complete trials", ha="center", va="center", transform=ax_sps.transAxes)
    speed = f", {result.speedup:.2f}x {baseline_text(result)}" if result.speedup is not None else ""
    fig.suptitle(f"autotune: {result.samples_per_s:,.0f} samples/s{speed} on {result.device}")
    out = str(path)
    fig.savefig(out, dpi=100)
    return out
