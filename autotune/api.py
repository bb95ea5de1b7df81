"""``tune_loader`` and ``TuneResult``: the front door, glue only."""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch.utils.data import DataLoader

from . import distributed, profiles
from .measure import measure
from .plan import Plan, make_plan
from .progress import Progress
from .space import Candidate
from .study import SearchOutcome, SearchSettings, TrialRecord, run_search

log = logging.getLogger("autotune")

DEFAULT_BUDGET_S = 60.0
"""A minute: enough for ~25 measured candidates on a small machine, short beside any training run."""

DEFAULT_EPOCHS = 10
"""Epochs a pre-transform cache and worker start-up are amortised over, when the user does not say."""




@dataclass(frozen=True)
class TuneResult:
    """The best DataLoader configuration found, with the evidence for it.

    ``samples_per_s``, ``busy`` and ``wait_fraction`` are medians over the winner's measurements.
    ``speedup`` is how much faster a training run of ``epochs`` epochs goes than with PyTorch's
    defaults measured in the same run, start-up and any pre-transform build included (NOTE [ Score ]
    in study.py); ``throughput_speedup`` is the same ratio for steady-state samples/s alone. Both are
    ``None`` when the defaults could not be measured. ``torch_threads`` is the main-process thread
    count the winner was measured with: apply it with ``torch.set_num_threads`` (``None``: leave it).
    """

    loader_kwargs: dict[str, Any]
    pretransform: str = "none"
    torch_threads: int | None = None
    samples_per_s: float = 0.0
    busy: float = 0.0
    wait_fraction: float = 0.0
    speedup: float | None = None
    throughput_speedup: float | None = None
    baseline_samples_per_s: float | None = None
    baseline_busy: float | None = None
    baseline_wait_fraction: float | None = None
    spread: float = 0.0
    trials: tuple[TrialRecord, ...] = ()
    device: str = "cpu"
    epochs: int = DEFAULT_EPOCHS
    budget_s: float = DEFAULT_BUDGET_S
    tuning_s: float = 0.0
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

    def make_loader(self, dataset: Any, **overrides: Any) -> DataLoader[Any]:
        """A DataLoader with the tuned settings, as measured; ``overrides`` win (``shuffle=True`` etc.).

        It is an :class:`autotune.DataLoader` fixed to this result (it explores nothing): built by
        the same builder the search measured with, the pre-transform applied (the cache is built once
        per process and dataset), thread workers where they won, and the main process's torch thread
        count set to ``torch_threads`` while it loads, put back by ``close()`` or when the loader is
        collected. A tunable setting in ``overrides`` (``num_workers=0``, say) replaces the tuned one.
        """
        from .loader import DataLoader as TunedDataLoader

        return TunedDataLoader.configured(dataset, self.candidate, device=self.device, **overrides)

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
            f"{kind}: with PyTorch's defaults the step waited {self.baseline_wait_fraction:.0%} of"
            f" the time; tuned: {self.wait_fraction:.0%}"
        )

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        data["trials"] = [t.to_dict() for t in self.trials]
        if data["storage_url"]:
            data["storage_url"] = profiles.mask_url(data["storage_url"])
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), default=str, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **changes: Any) -> TuneResult:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["trials"] = tuple(TrialRecord.from_dict(t) for t in data.get("trials", ()))
        if fields.get("storage_url"):  # a profile stored before passwords were masked
            fields["storage_url"] = profiles.mask_url(fields["storage_url"])
        fields.update(changes)
        return cls(**fields)

    @classmethod
    def from_outcome(cls, outcome: SearchOutcome, plan: Plan, settings: SearchSettings) -> TuneResult:
        """The result of a finished search; the storage URL only ever with its password masked."""
        best, base = outcome.best, outcome.baseline
        return cls(
            loader_kwargs=best.candidate.loader_kwargs(),
            pretransform=best.candidate.pretransform,
            torch_threads=best.candidate.torch_threads,
            samples_per_s=best.samples_per_s,
            busy=best.busy,
            wait_fraction=best.wait_fraction,
            speedup=outcome.speedup,
            throughput_speedup=(
                best.samples_per_s / base.samples_per_s if base and base.samples_per_s else None
            ),
            baseline_samples_per_s=base.samples_per_s if base else None,
            baseline_busy=base.busy if base else None,
            baseline_wait_fraction=base.wait_fraction if base else None,
            spread=best.spread,
            trials=outcome.trials,
            device=str(plan.device),
            epochs=plan.epochs,
            budget_s=plan.budget_s,
            tuning_s=time.monotonic() - plan.started_at,
            key=plan.key,
            machine=plan.machine.fingerprint(),
            workload=plan.workload,
            study_name=outcome.study_name,
            storage_url=(
                profiles.mask_url(settings.storage_url)
                if outcome.study_name and settings.storage_url else None
            ),
        )

    def table(self) -> str:
        """The trial table as text (see :mod:`autotune.report`)."""
        from .report import trial_table

        return trial_table(self)

    def plot(self, path: str) -> str:
        """Throughput against workers and busy fraction, saved to ``path`` (needs matplotlib)."""
        from .report import plot

        return plot(self, path)


def tune_loader(
    dataset: Any,
    step: Callable[[Any], Any] | None = None,
    *,
    batch_size: int | Sequence[int] | None = None,
    budget_s: float = DEFAULT_BUDGET_S,
    device: str | torch.device | None = None,
    cache: bool = True,
    cache_dir: str | None = None,
    storage: str | None = None,
    retune: bool = False,
    epochs: int = DEFAULT_EPOCHS,
    pretransform: str | Sequence[str] = "auto",
    max_workers: int | None = None,
    memory_budget_bytes: int | None = None,
    batch_timeout_s: float | None = None,
    shuffle: bool = True,
    collate_fn: Callable[[Any], Any] | None = None,
    seed: int = 0,
    progress: bool = True,
    in_order: bool | None = None,
) -> TuneResult:
    """Find the fastest DataLoader settings for ``dataset`` (and ``step``) on this machine.

    Args:
        dataset: a map-style dataset (``__getitem__`` + ``__len__``) or an ``IterableDataset``.
        step: called with every batch, already moved to ``device``: your training step. ``None``
            measures loading alone.
        batch_size: an int fixes it (batch size changes training, so it is only searched when
            asked); a list searches among those; ``None`` searches ``space.DEFAULT_BATCH_SIZES``.
        budget_s: wall-clock seconds for the whole call, a ceiling: the search stops early once it
            converges, and a trial still running at the deadline is cut short.
        device: where batches go before the step; ``None``: CUDA when available, else CPU.
        cache: return a stored profile for the same machine and workload without measuring, and
            store the new best otherwise. ``retune=True`` measures and overwrites.
        cache_dir: the profile folder (default: ``AUTOTUNE_CACHE_DIR``, else the user cache dir).
        storage: an Optuna RDB storage URL (e.g. ``postgresql://...``) for shared profiles.
        epochs: the expected training length, over which start-up and pre-transform builds are
            amortised in the score.
        pretransform: ``"auto"`` (every strategy that applies), one name, or a list of names.
        max_workers: an upper bound on ``num_workers`` below the machine-derived one.
        memory_budget_bytes: ceiling on the memory of this process plus its workers during a trial
            (default: what it uses now plus half the available RAM).
        batch_timeout_s: a candidate whose next batch takes longer than this has hung and fails
            (default: ``measure.DEFAULT_BATCH_TIMEOUT_S``).
        shuffle, collate_fn: as for the DataLoader you will build.
        seed: seeds the sampler and the shuffling, so a search can be repeated.
        progress: show a progress line on stderr.
        in_order: ``None`` searches out-of-order delivery (``in_order=False``: a batch is handed out
            as soon as any worker has one) only with ``shuffle=True``; ``True`` never; ``False``
            searches it even without shuffling.
    """
    plan = make_plan(
        dataset, step, batch_size=batch_size, budget_s=budget_s, device=device, epochs=epochs,
        pretransform=pretransform, max_workers=max_workers, memory_budget_bytes=memory_budget_bytes,
        batch_timeout_s=batch_timeout_s, shuffle=shuffle, collate_fn=collate_fn, seed=seed,
        in_order=in_order,
    )
    ctx = plan.dist
    if ctx is not None and not ctx.leader:
        payload = distributed.follow(ctx, dataset, step=step, device=plan.device,
                                     shuffle=shuffle and not plan.iterable, collate_fn=collate_fn,
                                     seed=seed)
        return TuneResult.from_dict(payload)
    coordinator = distributed.Coordinator(ctx) if ctx is not None else None
    store = profiles.open_store(cache_dir=cache_dir, storage=storage) if cache else None
    try:
        return _tune(plan, store, coordinator, retune=retune, progress=progress)
    finally:
        if store is not None:
            store.close()  # a database's connections go now, not with the garbage collector


def _tune(plan: Plan, store: profiles.ProfileStore | None, coordinator: distributed.Coordinator | None,
          *, retune: bool, progress: bool) -> TuneResult:
    """The stored profile, or a search whose result is stored."""
    if store is not None and not retune:
        cached = lookup(store, plan.key)
        if cached is not None:
            if coordinator is not None:
                coordinator.finish(("result", cached.to_dict()))
            return cached

    space, settings = plan.search(store=store)
    bar = Progress(plan.budget_s, enabled=progress)
    try:
        outcome = run_search(plan.dataset, plan.step, space, settings, progress=bar,
                             evaluate=coordinator or measure)
    except BaseException as err:
        if coordinator is not None:
            coordinator.finish(("error", f"{type(err).__name__}: {err}"))
        raise
    finally:
        bar.close()
    result = TuneResult.from_outcome(outcome, plan, settings)
    if coordinator is not None:
        coordinator.finish(("result", result.to_dict()))
    if store is not None:
        store.put(plan.key, result.to_dict())
    log.info("autotune: best %s at %.0f samples/s (%.2fx the defaults)",
             outcome.best.candidate.label(), outcome.best.samples_per_s,
             outcome.speedup or float("nan"))
    return result


def lookup(store: profiles.ProfileStore, key: str) -> TuneResult | None:
    """The stored profile for ``key`` as a result, or ``None``."""
    record = store.get(key)
    if record is None:
        return None
    log.info("autotune: profile %s found in %s; not measuring", key, store.location)
    return TuneResult.from_dict(record, from_cache=True)
