"""Which strategies a dataset can use, and the dataset prepared for one (the package's interface)."""

from __future__ import annotations

import logging
import warnings
from typing import Any

import torch
from torch.utils.data import Dataset

from ..describe import contains_cuda
from ..exceptions import CandidateInfeasible, ConfigurationError, StaleCacheWarning
from .build import (
    Prepared,
    build,
    build_seconds,
    complete_filling,
    fill_in_pass,
    in_shm,
    ram_reserve_bytes,
    stale_message,
)
from .reuse import keep_build, plan_for, stored_build
from .split import CachePlan
from .stores import ProgressFn, fmt_bytes, is_ragged

log = logging.getLogger("autotune")

STRATEGIES = ("none", "ram", "device")

FILLS = ("build", "pass")
"""How a cache is filled: built before it is used, or by the pass that loads the samples."""

RAM_ONLY = (
    "samples of their own sizes (decoded images) are cached in RAM only; use pretransform='ram'"
)


def strategies(
    dataset: Dataset[Any],
    *,
    cuda: bool,
    memory_budget_bytes: int | None = None,
    device_memory_budget_bytes: int | None = None,
) -> dict[str, str | None]:
    """Every strategy mapped to ``None`` when usable for ``dataset``, else the reason it is refused.

    Cheap: it reads a few samples (PROBE_SAMPLES, through the deterministic prefix). The memory a
    cache needs is estimated from them: bytes per sample times ``len(dataset)``, exact for fixed-size
    samples, the probes' mean for samples of their own sizes (the spread is reported). Once a cache
    was built, its real size replaces the estimate. A budget of None sets no ceiling.
    """
    reasons: dict[str, str | None] = {"none": None}
    plan, _ = plan_for(dataset)
    budgets = {
        "ram": (memory_budget_bytes, "memory budget"),
        "device": (device_memory_budget_bytes, "device memory budget"),
    }
    for strategy, (budget, what) in budgets.items():
        if strategy == "device" and not cuda:
            reasons[strategy] = "needs CUDA"
        elif plan.reason is not None:
            reasons[strategy] = plan.reason
        elif strategy == "device" and (plan.table is not None or is_ragged(plan.layout)):
            reasons[strategy] = RAM_ONLY
        elif budget is not None and (need := _needed(plan)) > budget:
            how = "measured when it was built" if plan.real_bytes is not None else plan.estimate().describe()
            reasons[strategy] = (
                f"a cache would need ~{fmt_bytes(need)} ({how}), over the {what} of {fmt_bytes(budget)}"
            )
        else:
            reasons[strategy] = None
    return reasons


def _needed(plan: CachePlan) -> int:
    return plan.real_bytes if plan.real_bytes is not None else plan.estimate().total


def prepare(
    dataset: Dataset[Any],
    strategy: str,
    *,
    device: torch.device,
    memory_budget_bytes: int | None = None,
    progress: ProgressFn | None = None,
    fill: str = "build",
    warn_stale: bool = True,
) -> Prepared:
    """The dataset to load with ``strategy``; a cache is built once per process and dataset.

    ``ram`` caches on the CPU in shared memory (forked workers read it without a copy); ``device``
    caches on ``device`` (``num_workers=0``; a CPU device is accepted as a stand-in). A second call
    for the same dataset object, strategy and device returns the first build while the dataset is
    alive and nothing the cache froze has changed (NOTE [ Fresh caches ]); after a change it warns
    (StaleCacheWarning, naming what changed) and builds again. A ``ram`` build stops when it outgrows
    ``memory_budget_bytes`` (None: no ceiling); ``progress`` is called with (samples done, samples in
    all) while it runs. Raises ``ConfigurationError`` for an unknown strategy and
    ``CandidateInfeasible`` when the dataset cannot be cached. ``warn_stale=False``: a caller that
    makes every loader through this call (the drop-in) serves nothing stale, so a rebuild is logged,
    not warned of.

    ``fill="pass"`` (``ram`` only) builds nothing: the cache is allocated, sized from the plan's
    estimate within the budget, and returned at once, and each sample is stored the first time a
    DataLoader over ``Prepared.dataset`` loads it, by whichever process loads it (NOTE [ Filling
    caches ]): one epoch fills it (``Prepared.fill_counts``), and every sample, stored or not, is the
    dataset's own. A second call returns the same cache, however far it is filled; a ``fill="build"``
    call on a cache still filling stores the rest now. A Hugging Face table is built before use
    either way (its cached rows are rebuilt from columns read in one pass).
    """
    if strategy not in STRATEGIES:
        raise ConfigurationError(
            f"pretransform={strategy!r} is not a pre-transform strategy; use one of {STRATEGIES}"
            " ('none' runs the transform per sample as given)."
        )
    if fill not in FILLS:
        raise ConfigurationError(
            f"fill={fill!r} is not a way to fill a cache; use 'build' (before use) or 'pass' (by the"
            " pass that loads the samples)."
        )
    if fill == "pass" and strategy == "device":
        raise ConfigurationError(
            "fill='pass' fills a cache from the worker processes that load the samples, which a"
            " 'device' cache does not have; use fill='build' with pretransform='device'."
        )
    if strategy == "none":
        return Prepared(dataset=dataset, strategy="none")
    device = torch.device(device)
    key = (id(dataset), strategy, str(device) if strategy == "device" else "cpu")
    stored = stored_build(dataset, key)
    plan, stale = plan_for(dataset)
    if stored is not None:
        if stored[0] is plan:
            if fill == "build" and not stored[1].fill_counts().complete:
                completed = complete_filling(stored[1])
                keep_build(dataset, key, plan, completed)
                return completed
            return stored[1]
        if stale is not None and warn_stale:
            warnings.warn(stale_message(strategy, stale), StaleCacheWarning, stacklevel=2)
        elif stale is not None:  # the caller builds its loaders anew from each call: nothing is stale
            log.info("autotune: the pretransform=%r cache is rebuilt: %s", strategy, stale)
    if plan.reason is not None:
        raise CandidateInfeasible(f"pretransform={strategy!r}: {plan.reason}")
    if strategy == "device" and (plan.table is not None or is_ragged(plan.layout)):
        raise CandidateInfeasible(f"pretransform='device': {RAM_ONLY}")
    if fill == "pass" and plan.table is None:
        prepared = fill_in_pass(dataset, plan, memory_budget_bytes=memory_budget_bytes)
    else:
        prepared = build(
            dataset, plan, strategy, device=device,
            memory_budget_bytes=memory_budget_bytes if strategy == "ram" else None, progress=progress,
        )
    keep_build(dataset, key, plan, prepared)
    return prepared


def shm_bytes(dataset: Dataset[Any]) -> int:
    """Bytes a ``ram`` cache of ``dataset`` would take from /dev/shm when built: 0 when it is built
    already (then it is no longer free space), cannot be built, or would be kept in private memory
    (NOTE [ Shared memory ] 4 in shm.py)."""
    if stored_build(dataset, (id(dataset), "ram", "cpu")) is not None:
        return 0
    plan, _ = plan_for(dataset)
    if plan.reason is not None:
        return 0
    need = ram_reserve_bytes(plan)
    return need if in_shm(need) else 0


def estimate_build_s(dataset: Dataset[Any]) -> float | None:
    """Seconds a cache build would take: a few samples read and pre-transformed, times the length.

    ``None`` when the dataset cannot be cached at all. Like the memory estimate, it assumes the
    probed samples are typical; a dataset whose early samples are cached by the OS reads faster here.
    """
    plan, _ = plan_for(dataset)
    return build_seconds(dataset, plan) if plan.reason is None else None


def holds_cuda_tensors(dataset: Dataset[Any]) -> bool:
    """Whether the first sample holds a CUDA tensor (then workers would fail to share it)."""
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - the measurement will raise the user's error properly
        return False
    return contains_cuda(sample)
