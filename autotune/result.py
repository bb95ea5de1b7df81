"""What tuning found: :class:`TuneResult`, built the same way by both drivers, its trial table and
plot, and stored profiles.

Below the drivers (``api``, ``loader``) and the report that reads it (``report``); it imports
neither and measures nothing. A stored profile is a ``TuneResult.to_dict()``; :func:`lookup` reads
one back and refuses, with a warning, a record that parses but holds settings no loader could use.

# NOTE [ A result's loader ]
# ``TuneResult.make_loader`` returns an ``autotune.DataLoader`` fixed to the result. The drop-in is
# built on this module (its search makes results), so this module does not import it: the drop-in
# hands its builder (``DataLoader.from_result``) to :func:`build_loaders_with` when it is imported,
# and importing any part of autotune imports it (``autotune/__init__.py``).
"""

from __future__ import annotations

import json
import logging
import math
import statistics
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from torch.utils.data import DataLoader

from . import profiles
from .decide import Decision, TrialRecord, interval_label
from .exceptions import ProfileStoreWarning
from .space import PRETRANSFORMS, Candidate, Strategy

log = logging.getLogger("autotune")

DEFAULT_BUDGET_S = 60.0
"""A minute: enough for ~25 measured candidates on a small machine, short beside any training run."""

DEFAULT_EPOCHS = 10
"""Epochs a pre-transform cache and worker start-up are amortised over, when the user does not say."""

REASON_WIDTH = 92
"""Characters of a failure reason shown under the table: one line of a 100-column terminal."""

PLOT_INSTALL_HINT = "pip install 'dataloader-autotune[plot]'"
"""How to get matplotlib for :meth:`TuneResult.plot` (installed as ``dataloader-autotune``)."""

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


@dataclass(frozen=True)
class TuneResult:
    """The best DataLoader configuration found, with the evidence for it.

    ``samples_per_s``, ``busy`` and ``wait_fraction`` are medians over the chosen configuration's
    measurements. The baseline is what the user runs (their settings, or PyTorch's defaults where
    they wrote none; ``baseline_kwargs``), measured in the same run. ``speedup`` is how much faster a
    training run of ``epochs`` epochs goes than with the baseline, start-up included (NOTE [ Score ]
    in decide.py) and the pre-transform cache already built: the build, ``cache_build_s``, is paid
    once, and later runs on the machine find the cache (NOTE [ Decisions ] 6). ``speedup_low`` and
    ``speedup_high`` are its bounds, each one-sided at ``confidence`` (NOTE [ Decisions ]);
    ``throughput_speedup`` is the ratio of steady-state samples/s alone. A configuration replaces the
    baseline only when the whole interval is at least 1.05 over a run that builds its cache: otherwise
    the result *is* the baseline, and ``decision`` says why. ``torch_threads`` is the
    main-process thread count the winner was measured with (``None``: leave it as it is).
    ``load_average`` is the work other processes ran per usable CPU while it tuned (0: none, 1: every
    usable CPU busy with them; NOTE [ Others' load ] in machine.py), ``None`` where unread.
    """

    loader_kwargs: dict[str, Any]
    pretransform: Strategy = "none"
    torch_threads: int | None = None
    samples_per_s: float = 0.0
    busy: float = 0.0
    wait_fraction: float = 0.0
    speedup: float | None = None
    speedup_low: float | None = None
    speedup_high: float | None = None
    confidence: float | None = None
    throughput_speedup: float | None = None
    cache_build_s: float = 0.0
    """What building the chosen configuration's cache took, paid once (NOTE [ Decisions ] 6 in
    decide.py); 0: it has none."""
    challenger: str | None = None
    """Where the baseline was kept: what the best other configuration measured against it."""
    undecided: bool = False
    """Whether the baseline was kept undecided: the challenger led it, not yet with confidence
    (``decision`` says how much more measuring would decide)."""
    baseline_kwargs: dict[str, Any] | None = None
    baseline_samples_per_s: float | None = None
    baseline_busy: float | None = None
    baseline_wait_fraction: float | None = None
    decision: str = ""
    spread: float = 0.0
    trials: tuple[TrialRecord, ...] = ()
    device: str = "cpu"
    epochs: int = DEFAULT_EPOCHS
    budget_s: float = DEFAULT_BUDGET_S
    tuning_s: float = 0.0
    load_average: float | None = None
    from_cache: bool = False
    key: str | None = None
    machine: dict[str, Any] = field(default_factory=dict)
    workload: dict[str, Any] = field(default_factory=dict)
    study_name: str | None = None
    storage_url: str | None = None

    @property
    def candidate(self) -> Candidate:
        return Candidate.from_loader_kwargs(
            self.loader_kwargs, pretransform=self.pretransform, torch_threads=self.torch_threads)

    @property
    def kept_baseline(self) -> bool:
        """Whether the result is the baseline itself (nothing beat it with confidence)."""
        return (self.baseline_kwargs is not None and self.baseline_kwargs == self.loader_kwargs
                and self.pretransform == "none" and self.torch_threads is None)

    def make_loader(self, dataset: Any, **overrides: Any) -> DataLoader[Any]:
        """A DataLoader with the tuned settings, as measured; ``overrides`` win (``shuffle=True`` etc.).

        It is an :class:`autotune.DataLoader` fixed to this result (it explores nothing): built by
        the same builder the search measured with, the pre-transform applied (the cache is built once
        per process and dataset), thread workers where they won, and the main process's torch thread
        count set to ``torch_threads`` while it loads, put back by ``close()`` or when the loader is
        collected. A tunable setting in ``overrides`` (``num_workers=0``, say) replaces the tuned one.
        """
        if _loader_builder is None:  # NOTE [ A result's loader ]: autotune was never fully imported
            raise RuntimeError("make_loader needs autotune.DataLoader: import autotune first")
        return _loader_builder(self, dataset, **overrides)

    def training_args(self) -> dict[str, Any]:
        """The tuned settings as Hugging Face ``transformers.TrainingArguments`` keywords.

        ``TrainingArguments(output_dir=..., **result.training_args())``. The Trainer builds a plain
        DataLoader, which can start neither thread workers nor a pre-transform cache: when either
        won, these are the best measured configuration without them. The main process's thread
        count has no place there either (set it with ``torch.set_num_threads``).
        """
        c = self.candidate
        if c.threaded or c.pretransform != "none":  # neither is the Trainer's to build
            plain = [t for t in self.trials
                     if t.state == "complete" and t.score is not None and not t.candidate.threaded
                     and t.candidate.pretransform == "none"]
            c = max(plain, key=lambda t: t.score or 0.0).candidate if plain else Candidate(c.batch_size)
        return {
            "dataloader_num_workers": c.num_workers,
            "dataloader_pin_memory": c.pin_memory,
            "dataloader_persistent_workers": c.persistent_workers if c.num_workers else False,
            "dataloader_prefetch_factor": c.prefetch_factor if c.num_workers else None,
        }

    def diagnosis(self) -> str:
        """One line on the bottleneck, before and after."""
        if self.baseline_wait_fraction is None:
            return f"tuned: the step waits for data {self.wait_fraction:.0%} of the time"
        kind = "data-bound" if self.baseline_wait_fraction > 0.5 else "step-bound"
        return (
            f"{kind}: with the baseline settings the step waited {self.baseline_wait_fraction:.0%} of"
            f" the time; tuned: {self.wait_fraction:.0%}"
        )

    def speedup_text(self) -> str | None:
        """``1.42x (90% interval 1.31-1.55x)``, or ``None`` without a baseline."""
        if self.speedup is None:
            return None
        if self.kept_baseline:
            # What the best other configuration measured is ``challenger`` and ``decision``'s.
            why = ("undecided" if self.undecided else "nothing faster" if self.challenger is not None
                   else "nothing else measured")
            return f"{self.speedup:.2f}x, your settings kept ({why})"
        if self.speedup_low is None or self.speedup_high is None or not math.isfinite(self.speedup_high):
            return f"{self.speedup:.2f}x (no interval: too few repeated measurements)"
        return (f"{self.speedup:.2f}x ({interval_label(self.confidence or 0.95)}"
                f" {self.speedup_low:.2f}-{self.speedup_high:.2f}x)")

    def baseline_text(self) -> str:
        """What the speed-up is against: the user's settings, or PyTorch's defaults."""
        defaults = {"num_workers": 0, "pin_memory": False, "prefetch_factor": 2, "persistent_workers": False,
                    "in_order": True}
        kwargs = {k: v for k, v in (self.baseline_kwargs or {}).items()
                  if k != "batch_size" and defaults.get(k, object()) != v}
        if not kwargs:
            return "PyTorch's defaults"
        return "your settings (" + ", ".join(f"{k}={v!r}" for k, v in kwargs.items()) + ")"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["trials"] = [t.to_dict() for t in self.trials]
        for name in ("speedup_low", "speedup_high"):  # JSON has no infinity
            if data[name] is not None and not math.isfinite(data[name]):
                data[name] = None
        if data["storage_url"]:
            data["storage_url"] = profiles.mask_url(data["storage_url"])
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), default=str, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **changes: Any) -> TuneResult:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["trials"] = tuple(TrialRecord.from_dict(t) for t in data.get("trials", ()))
        if fields.get("storage_url"):
            fields["storage_url"] = profiles.mask_url(fields["storage_url"])
        fields.update(changes)
        return cls(**fields)

    def table(self) -> str:
        """The trial table: every trial, one row each, with the reasons for failed, pruned and
        infeasible ones below.

        Numbers are right-aligned; the rows fit a 100-column terminal. The chosen configuration's rows
        are starred; a reason shared by several trials is listed once.
        """
        chosen = self.candidate if self.loader_kwargs else None
        notes: dict[str, str] = {}
        rows: list[list[str]] = []
        for t in self.trials:
            note = ""
            if t.state != "complete" and t.reason:
                note = notes.setdefault(t.reason, str(len(notes) + 1))
            rows.append(_trial_row(t, chosen is not None and t.candidate == chosen, note))
        headers = [h for h, _ in _COLUMNS]
        widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

        def line(cells: Sequence[str]) -> str:
            parts = [f"{cell:{align}{w}}"
                     for cell, (_, align), w in zip(cells, _COLUMNS, widths, strict=True)]
            return " ".join(parts).rstrip()

        out = [line(headers), line(["-" * w for w in widths])]
        out += [line(r) for r in rows]
        if not rows:
            out.append("(no trials: this result was not measured in this run)")
        out += ["", _LEGEND]
        for reason, number in notes.items():
            out.append(_shorten(f"[{number}] {reason}", REASON_WIDTH))
        return "\n".join(out)

    def plot(self, path: str | Path) -> str:
        """Throughput and busy fraction against ``num_workers``, one series per batch size and
        pretransform (needs matplotlib).

        Every measurement is a dot; the line joins the median at each worker count. The baseline and
        the chosen configuration are marked. Saved as an image at ``path`` (PNG unless the suffix
        says otherwise); returns the path. matplotlib is imported only here, and draws on an Agg
        canvas of its own, so a plot never changes the backend a notebook or script has chosen.
        """
        try:
            from matplotlib.backends.backend_agg import FigureCanvasAgg
            from matplotlib.figure import Figure
        except ImportError as err:
            raise ImportError(f"plotting needs matplotlib; install it with {PLOT_INSTALL_HINT}") from err

        fig = Figure(figsize=(11, 4.5), layout="constrained")
        FigureCanvasAgg(fig)
        ax_sps, ax_busy = fig.subplots(1, 2)
        series = _series(self)
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

        if self.baseline_samples_per_s is not None:
            ax_sps.axhline(self.baseline_samples_per_s, color="0.4", linestyle=":", linewidth=1,
                           label=f"baseline ({self.baseline_text()})")
        if self.loader_kwargs and self.samples_per_s > 0:
            w = int(self.loader_kwargs.get("num_workers", 0))
            ax_sps.scatter([w], [self.samples_per_s], marker="*", s=220, color="gold",
                           edgecolors="black", zorder=5, label="chosen")
            ax_busy.scatter([w], [self.busy * 100], marker="*", s=220, color="gold",
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
        speed = f", {self.speedup:.2f}x {self.baseline_text()}" if self.speedup is not None else ""
        fig.suptitle(f"autotune: {self.samples_per_s:,.0f} samples/s{speed} on {self.device}")
        out = str(path)
        fig.savefig(out, dpi=100)
        return out


def built_text(result: TuneResult) -> str:
    """``, its cache built (a 2.1 s build, paid once)`` where the chosen configuration has a cache
    (NOTE [ Decisions ] 6 in decide.py), else nothing."""
    if result.pretransform == "none" or result.kept_baseline:
        return ""
    took = f"a {result.cache_build_s:.1f} s build" if result.cache_build_s >= 0.05 else "its build"
    return f", its cache built ({took}, paid once)"


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


_loader_builder: Callable[..., DataLoader[Any]] | None = None
"""What ``TuneResult.make_loader`` builds with (NOTE [ A result's loader ])."""


def build_loaders_with(builder: Callable[..., DataLoader[Any]]) -> None:
    """``builder(result, dataset, **overrides)`` builds the loaders of ``TuneResult.make_loader``
    (NOTE [ A result's loader ])."""
    global _loader_builder
    _loader_builder = builder


def from_decision(decision: Decision, trials: Sequence[TrialRecord], **context: Any) -> TuneResult:
    """The result of a finished search, whichever driver ran it: the decision's chosen configuration,
    its figures and the interval against the baseline; ``context`` fills the rest (device, epochs,
    key, machine, workload, budget, timings, study)."""
    chosen, base, verdict = decision.chosen, decision.baseline, decision.verdict
    speedup = low = high = conf = None
    if base is not None and base.score:
        if chosen.candidate == base.candidate:
            speedup = 1.0
            if verdict is not None:  # the baseline kept: the interval is the challenger's, for the record
                conf = verdict.confidence
        elif (shown := decision.served or verdict) is not None:  # NOTE [ Decisions ] 6: cache built
            speedup, low, high, conf = shown.ratio, shown.low, shown.high, shown.confidence
        else:
            speedup = chosen.score / base.score
    return TuneResult(
        loader_kwargs=chosen.candidate.loader_kwargs(),
        pretransform=chosen.candidate.pretransform,
        torch_threads=chosen.candidate.torch_threads,
        samples_per_s=chosen.samples_per_s,
        busy=chosen.busy,
        wait_fraction=chosen.wait_fraction,
        speedup=speedup,
        speedup_low=low,
        speedup_high=high,
        confidence=conf,
        cache_build_s=chosen.measurement.build_s,
        throughput_speedup=(chosen.samples_per_s / base.samples_per_s
                            if base is not None and base.samples_per_s else None),
        challenger=(f"{decision.challenger.candidate.label()} measured {verdict.describe()}"
                    if decision.kept_baseline and decision.challenger is not None and verdict is not None
                    else None),
        undecided=decision.undecided,
        baseline_kwargs=base.candidate.loader_kwargs() if base is not None else None,
        baseline_samples_per_s=base.samples_per_s if base is not None else None,
        baseline_busy=base.busy if base is not None else None,
        baseline_wait_fraction=base.wait_fraction if base is not None else None,
        decision=decision.reason,
        spread=chosen.spread,
        trials=tuple(trials),
        **context,
    )


def profile_problem(record: dict[str, Any]) -> str | None:
    """Why a stored record cannot be used as a result (settings no loader accepts), or ``None``."""
    kwargs = record.get("loader_kwargs")
    if not isinstance(kwargs, dict):
        return "it has no loader_kwargs object"

    def is_int(v: Any, low: int) -> bool:
        return isinstance(v, int) and not isinstance(v, bool) and v >= low

    checks = (
        ("batch_size", lambda v: is_int(v, 1), "a positive integer"),
        ("num_workers", lambda v: v is None or is_int(v, 0), "a non-negative integer"),
        ("worker_threads", lambda v: v is None or is_int(v, 1), "a positive integer"),
        ("pin_memory", lambda v: v is None or isinstance(v, bool), "True or False"),
        ("prefetch_factor", lambda v: v is None or is_int(v, 1), "a positive integer or null"),
        ("prefetch_per_thread", lambda v: v is None or is_int(v, 1), "a positive integer or null"),
        ("persistent_workers", lambda v: v is None or isinstance(v, bool), "True or False"),
        ("in_order", lambda v: v is None or isinstance(v, bool), "True or False"),
    )
    for name, ok, rule in checks:
        if name in kwargs and not ok(kwargs[name]):
            return f"loader_kwargs {name}={kwargs[name]!r} must be {rule}"
    if "batch_size" not in kwargs:
        return "loader_kwargs has no batch_size"
    if record.get("pretransform", "none") not in PRETRANSFORMS:
        return f"pretransform={record.get('pretransform')!r} is not one of {PRETRANSFORMS}"
    threads = record.get("torch_threads")
    if threads is not None and not is_int(threads, 1):
        return f"torch_threads={threads!r} must be a positive integer or null"
    try:
        TuneResult.from_dict(record).candidate  # noqa: B018 - the record must rebuild
    except (TypeError, ValueError, KeyError) as err:
        return f"it does not rebuild a result ({type(err).__name__}: {err})"
    return None


def lookup(store: profiles.ProfileStore, key: str) -> TuneResult | None:
    """The stored profile for ``key`` as a result, or ``None`` (missing, or unusable: warned)."""
    record = store.get(key)
    if record is None:
        return None
    problem = profile_problem(record)
    if problem is not None:
        warnings.warn(
            f"ignoring the stored profile {key} in {store.location}: {problem}. It is measured again"
            " and replaced; or remove it with `autotune profiles clear`.",
            ProfileStoreWarning, stacklevel=3,
        )
        return None
    log.info("autotune: profile %s found in %s; not measuring", key, store.location)
    return TuneResult.from_dict(record, from_cache=True)
