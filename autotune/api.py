"""``tune_loader`` and ``TuneResult``: the front door, glue only."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

import torch

from . import distributed, profiles
from .machine import others_load
from .measure import measure
from .plan import Plan, make_plan
from .progress import Progress
from .result import DEFAULT_BUDGET_S, DEFAULT_EPOCHS, TuneResult, from_decision, lookup
from .study import SearchOutcome, SearchSettings, run_search

__all__ = ["DEFAULT_BUDGET_S", "DEFAULT_EPOCHS", "TuneResult", "tune_loader"]

log = logging.getLogger("autotune")


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
    baseline: dict[str, Any] | None = None,
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
        baseline: the DataLoader settings you run now (``{"num_workers": 16}``, say): measured even
            where they lie outside the search space, and what the speed-up is against; a
            configuration replaces them only when it wins with confidence (NOTE [ Decisions ] in
            decide.py). ``None``: PyTorch's defaults.
    """
    plan = make_plan(
        dataset, step, batch_size=batch_size, budget_s=budget_s, device=device, epochs=epochs,
        pretransform=pretransform, max_workers=max_workers, memory_budget_bytes=memory_budget_bytes,
        batch_timeout_s=batch_timeout_s, shuffle=shuffle, collate_fn=collate_fn, seed=seed,
        in_order=in_order, baseline=baseline,
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
    bar = Progress(plan.budget_s or 0.0, enabled=progress)
    try:
        outcome = run_search(plan.dataset, plan.step, space, settings, progress=bar,
                             evaluate=coordinator or measure)
    except BaseException as err:
        if coordinator is not None:
            coordinator.finish(("error", f"{type(err).__name__}: {err}"))
        raise
    finally:
        bar.close()
    result = _result(outcome, plan, settings)
    if coordinator is not None:
        coordinator.finish(("result", result.to_dict()))
    if store is not None:
        store.put(plan.key, result.to_dict())
    log.info("autotune: best %s: %s", outcome.best.candidate.label(), outcome.decision.reason)
    return result


def _result(outcome: SearchOutcome, plan: Plan, settings: SearchSettings) -> TuneResult:
    """The result of a finished search; the storage URL only ever with its password masked."""
    return from_decision(
        outcome.decision, outcome.trials, device=str(plan.device), epochs=plan.epochs,
        budget_s=plan.budget_s, tuning_s=time.monotonic() - plan.started_at, key=plan.key,
        machine=plan.machine.fingerprint(), workload=plan.workload, study_name=outcome.study_name,
        load_average=others_load(plan.cpu_at_start),
        storage_url=(profiles.mask_url(settings.storage_url)
                     if outcome.study_name and settings.storage_url else None),
    )
