"""What both entry points share before anything is measured.

``tune_loader`` (tuning ahead of time) and :class:`autotune.DataLoader` (tuning inside the user's
epochs) go through the same two stages, so neither copies the other:

1. :func:`make_plan`: every argument checked (before any profile is looked up, so a bad value is
   refused whether or not a profile exists), the machine read, what worker processes cannot do with
   this dataset, and the profile key of this machine and workload.
2. :meth:`Plan.search`: the pre-transform strategies that apply, the search space, the measurement
   limits and the search settings. Only needed when no stored profile answers, since it reads samples.
"""

from __future__ import annotations

import logging
import os
import secrets
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.data import IterableDataset, default_collate
from torch.utils.data.datapipes.datapipe import IterDataPipe

from . import distributed, fingerprint, preflight, profiles, shm
from . import pretransform as pt
from .exceptions import AutotuneWarning, ConfigurationError
from .machine import (
    CpuSnapshot,
    MachineInfo,
    cpu_snapshot,
    detect_machine,
    memory_available_bytes,
    shm_free_bytes,
)
from .pretransform.fresh import reseeds_global_rng
from .pretransform.split import rng_preserved
from .space import Candidate, SearchSpace, build_space, check_bound, resolve_batch_sizes, resolve_in_order
from .study import SearchSettings
from .supervise import DEFAULT_BATCH_TIMEOUT_S, MeasureLimits, process_memory

log = logging.getLogger("autotune")

MEMORY_BUDGET_FRACTION = 0.5
"""Share of the RAM available at the start that the workers of one trial may add."""

CACHE_BUDGET_FRACTION = 0.25
"""Share of available RAM (or accelerator memory) a pre-transform cache may take."""

MAX_BUILD_FRACTION = 0.25
"""A pre-transform cache whose estimated build takes more of the budget than this is not tried."""

WINDOW_S_PER_BUDGET_S = 1.0 / 60.0
"""Each candidate's steady-state window is this share of the budget (1 s for the default minute)."""

MIN_WINDOW_S, MAX_WINDOW_S = 0.25, 2.0

PROBE_SAMPLES = 2
"""Samples read to learn how many bytes a sample takes in a batch (their shapes are usually one)."""


@dataclass(frozen=True)
class Plan:
    """The checked arguments, the machine, the exclusions and the profile key of one workload."""

    dataset: Any
    step: Callable[[Any], Any] | None
    dataset_len: int | None
    batch_size: int | Sequence[int] | None
    budget_s: float | None
    """The offline search's time budget; ``None`` for the drop-in, which has none (its exploration
    is bounded by what it costs the run, NOTE [ Online search ] in online.py)."""
    epochs: int
    device: torch.device
    strategies: tuple[str, ...]
    """The pre-transform strategies asked for (``auto`` expanded)."""
    max_workers: int | None
    """The bound on worker processes: the user's, lowered to 0 where they cannot work (``excluded``)."""
    max_threads: int | None
    """The bound on thread workers: the user's ``max_workers`` (threads work wherever processes do,
    and also with CUDA tensors and data that cannot be pickled)."""
    in_order: bool | None
    memory_budget_bytes: int | None
    batch_timeout_s: float
    shuffle: bool
    collate_fn: Callable[[Any], Any] | None
    seed: int
    machine: MachineInfo
    dist: distributed.DistContext | None
    workload: dict[str, Any]
    key: str
    excluded: dict[str, str] = field(default_factory=dict)
    """Settings left out of the space for this dataset, each with the reason."""
    started_at: float = 0.0
    cpu_at_start: CpuSnapshot | None = None
    """The CPU times when planning began: others' load is read from them (NOTE [ Others' load ])."""
    persistent: bool | None = None
    """``persistent_workers`` as the user fixed it (``None``: decided by the epochs)."""
    baseline: dict[str, Any] | None = None
    """The DataLoader settings the user runs, to measure against (``None``: PyTorch's defaults)."""
    pinned: bool = False
    """Whether the user fixed ``pin_memory=True`` (SearchSpace's ``pinned``)."""
    read_samples: bool = True
    """Whether planning may read samples in this process (not for the drop-in: NOTE [ The drop-in's
    contract ] in loader.py)."""

    @property
    def iterable(self) -> bool:
        return isinstance(self.dataset, IterableDataset)

    @property
    def local_ranks(self) -> int:
        return self.dist.local_world_size if self.dist is not None else 1

    def cache_budget(self) -> int:
        """Bytes a ``ram`` cache may hold for this plan (:func:`ram_cache_budget`)."""
        return ram_cache_budget(self.memory_budget_bytes)

    def space(self, *, ram_budget_bytes: int | None = None,
              sample_bytes: int | None = None) -> tuple[SearchSpace, dict[str, str]]:
        """The search space of this plan and the pre-transform strategies refused, with the reasons
        (reads a few samples in this process to plan a cache, where caches were asked for).

        Worker processes are bounded by the free space of /dev/shm now, less what a ``ram`` cache
        will take there, for batches of ``sample_bytes`` per sample: by default two samples read
        here (where the plan may read samples); without it, /dev/shm bounds nothing ahead and a
        candidate that runs out of it fails with its reason (NOTE [ Shared memory ] in shm.py).
        """
        ram_budget = ram_budget_bytes if ram_budget_bytes is not None else self.cache_budget()
        usable, refused = pretransform_choices(
            self.dataset, self.strategies, device=self.device, machine=self.machine,
            budget_s=self.budget_s, ram_budget_bytes=ram_budget,
        )
        if sample_bytes is None and self.read_samples and not self.iterable:
            sample_bytes = probe_sample_bytes(self.dataset, self.collate_fn, self.dataset_len)
        free = shm_free_bytes()
        if free is not None and "ram" in usable:
            free = max(0, free - pt.shm_bytes(self.dataset))
        space = build_space(
            self.machine, batch_size=self.batch_size, dataset_len=self.dataset_len,
            cuda=self.device.type == "cuda", pretransforms=usable, max_workers=self.max_workers,
            excluded=self.excluded, epochs=self.epochs, local_world_size=self.local_ranks,
            thread_workers=not self.iterable, max_threads=self.max_threads,
            in_order_choices=resolve_in_order(self.in_order, shuffle=self.shuffle and not self.iterable),
            persistent=self.persistent, sample_bytes=sample_bytes, shm_free_bytes=free,
            pinned=self.pinned,
        )
        return space, refused

    def baseline_candidate(self, space: SearchSpace) -> Candidate:
        """What the user runs (``baseline``), or PyTorch's defaults, at the space's baseline batch size."""
        return baseline_candidate(self.baseline, space.baseline_batch_size)

    def search(
        self, *, store: profiles.ProfileStore | None = None, study_name: str | None = None
    ) -> tuple[SearchSpace, SearchSettings]:
        """The space and the settings of the offline search for this plan."""
        assert self.budget_s is not None, "the offline search has a budget"
        ram_budget = self.cache_budget()
        space, refused = self.space(ram_budget_bytes=ram_budget)
        limits = measure_limits(self.budget_s, memory_budget_bytes=self.memory_budget_bytes,
                                cache_budget_bytes=ram_budget, batch_timeout_s=self.batch_timeout_s,
                                local_world_size=self.local_ranks)
        settings = SearchSettings(
            budget_s=self.budget_s, epochs=self.epochs, dataset_len=self.dataset_len,
            device=self.device, limits=limits, seed=self.seed,
            shuffle=self.shuffle and not self.iterable, collate_fn=self.collate_fn,
            usable_cpus=self.machine.usable_cpus, refused=refused,
            storage_url=store.study_storage_url() if store is not None else None,
            started_at=self.started_at, baseline=self.baseline_candidate(space),
            # The second, the process and a random token: one process may tune the same workload
            # twice within a second (retune=True), and the storage refuses a name it already has.
            study_name=study_name or (f"autotune-{self.key}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
                                      f"-{secrets.token_hex(3)}"),
        )
        return space, settings


def make_plan(
    dataset: Any,
    step: Callable[[Any], Any] | None,
    *,
    batch_size: int | Sequence[int] | None,
    budget_s: float | None,
    device: str | torch.device | None,
    epochs: int,
    pretransform: str | Sequence[str],
    max_workers: int | None,
    memory_budget_bytes: int | None,
    batch_timeout_s: float | None,
    shuffle: bool,
    collate_fn: Callable[[Any], Any] | None,
    seed: int,
    in_order: bool | None = None,
    fixed: dict[str, Any] | None = None,
    baseline: dict[str, Any] | None = None,
    persistent: bool | None = None,
    read_samples: bool = True,
    multiprocessing_context: Any = None,
    stacklevel: int = 2,
) -> Plan:
    """Check every argument, read the machine, and key the workload (stage 1 of the module docstring).

    ``fixed`` adds to the profile key what else the caller holds fixed; ``baseline`` the settings to
    measure against. ``read_samples=False`` reads no sample in this process (the drop-in: the
    dataset's own reads are the user's, NOTE [ The drop-in's contract ] in loader.py): the samples are
    then not checked for batching, CUDA tensors are seen in the first batch instead, and the key
    describes the dataset without a sample. ``stacklevel`` points the warnings at the user's line,
    counted from the caller of this function.
    """
    started, cpu_at_start = time.monotonic(), cpu_snapshot()
    n = preflight.check_dataset(dataset, allow_empty=not read_samples)
    budget = None if budget_s is None else preflight.check_number(
        "budget_s", budget_s, minimum=0,
        fix="give the tuning a positive number of seconds, e.g. budget_s=60.")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigurationError(
            f"epochs={epochs!r} must be a positive integer: the number of epochs you will train."
        )
    dev = preflight.resolve_device(device)
    strategies = preflight.resolve_pretransforms(pretransform)
    preflight.check_callable("step", step,
                             "pass a function that takes a batch (your training step), or None.")
    preflight.check_callable("collate_fn", collate_fn,
                             "pass a function that takes a list of samples, or None.")
    batch_timeout = DEFAULT_BATCH_TIMEOUT_S if batch_timeout_s is None else preflight.check_number(
        "batch_timeout_s", batch_timeout_s, minimum=0,
        fix="give the longest a single batch may take, in seconds, or None for the default.")
    if memory_budget_bytes is not None:
        memory_budget_bytes = int(preflight.check_number(
            "memory_budget_bytes", memory_budget_bytes, minimum=0,
            fix="give a positive number of bytes, or None for half the available RAM."))
    if max_workers is not None:
        check_bound("max_workers", max_workers)
    if baseline is not None:
        preflight.check_loader_settings("baseline", baseline)
    resolve_in_order(in_order, shuffle=shuffle)
    # The batch sizes are checked against the dataset here, not first when the space is drawn.
    resolve_batch_sizes(batch_size, n if n else None)
    # Thread workers share the process's random state: not for a dataset that sets it per sample.
    max_threads = 0 if reseeds_global_rng(dataset) else max_workers
    if collate_fn is None and read_samples:
        preflight.check_collates(dataset, n, batch_size)

    machine = detect_machine()
    iterable = isinstance(dataset, IterableDataset)
    ctx = distributed.context(budget if budget is not None else distributed.DEFAULT_TIMEOUT_S)
    excluded: dict[str, str] = {}
    if read_samples and not iterable and pt.holds_cuda_tensors(dataset):
        max_workers = 0
        excluded["num_workers>0"] = CUDA_DATA
        log.info("autotune: %s", CUDA_DATA)
    # A datapipe goes to workers through dill where torch finds it; workers the caller fixed are
    # the caller's to start, and torch says so itself if they cannot be.
    searched = max_workers != 0 and not isinstance(dataset, IterDataPipe) and not (fixed or {}).get(
        "num_workers")
    if searched and (why := preflight.unpicklable_reason(dataset, collate_fn, multiprocessing_context)):
        max_workers = 0
        excluded["num_workers>0"] = why
        warnings.warn(why, AutotuneWarning, stacklevel=stacklevel + 1)
    if read_samples and iterable and max_workers != 0 and not preflight.shards_by_worker(dataset):
        max_workers = 0
        excluded["num_workers>0"] = (
            f"{type(dataset).__name__} is an IterableDataset whose __iter__ does not seem to shard the"
            " stream: with num_workers > 0 each worker would replay all of it, every sample coming"
            " num_workers times; only num_workers=0 is searched. Shard it in __iter__ with"
            " torch.utils.data.get_worker_info() to have workers searched")
        warnings.warn(excluded["num_workers>0"], AutotuneWarning, stacklevel=stacklevel + 1)

    key_fixed: dict[str, Any] = {
        "batch_size": batch_size if batch_size is None or isinstance(batch_size, int)
        else sorted(batch_size),
        "epochs": epochs,
        "pretransform": list(strategies),
        "max_workers": max_workers,
        "shuffle": shuffle,
        "collate_fn": getattr(collate_fn, "__qualname__", None if collate_fn is None else "custom"),
        **({"in_order": in_order} if in_order is not None else {}),
        **({"baseline": baseline} if baseline else {}),
        **(fixed or {}),
    }
    if ctx is not None:
        key_fixed["local_world_size"] = ctx.local_world_size  # the best per-rank setting depends on it
    workload = fingerprint.workload_fingerprint(dataset, step=step, device=str(dev), fixed=key_fixed,
                                                read_sample=read_samples)
    return Plan(
        dataset=dataset, step=step, dataset_len=n, batch_size=batch_size, budget_s=budget,
        epochs=epochs, device=dev, strategies=strategies, max_workers=max_workers,
        max_threads=max_threads, in_order=in_order, memory_budget_bytes=memory_budget_bytes,
        batch_timeout_s=batch_timeout, shuffle=shuffle, collate_fn=collate_fn, seed=seed,
        machine=machine, dist=ctx, workload=workload,
        key=fingerprint.profile_key(machine.fingerprint(), workload), excluded=excluded,
        started_at=started, cpu_at_start=cpu_at_start, persistent=persistent,
        baseline=dict(baseline) if baseline else None, read_samples=read_samples,
        pinned=bool((fixed or {}).get("pin_memory")),
    )


CUDA_DATA = ("the dataset already holds CUDA tensors, which worker processes cannot share"
             " (_share_filename_: only available on CPU); only num_workers=0 and thread workers are"
             " searched")
"""Why worker processes are left out for data that lives on the GPU."""


def baseline_candidate(settings: dict[str, Any] | None, batch_size: int) -> Candidate:
    """The candidate for DataLoader ``settings`` as a user writes them (``None``: PyTorch's defaults),
    whatever the search space: the baseline is measured even outside it."""
    s = dict(settings or {})
    workers = int(s.get("num_workers") or 0)
    return Candidate(
        batch_size=int(s.get("batch_size") or batch_size),
        num_workers=workers,
        pin_memory=bool(s.get("pin_memory", False)),
        prefetch_factor=(s.get("prefetch_factor") or 2) if workers else None,
        persistent_workers=bool(s.get("persistent_workers", False)) and workers > 0,
        in_order=bool(s.get("in_order", True)) or workers == 0,
    )


def ram_cache_budget(memory_budget_bytes: int | None = None) -> int:
    """The bytes a ``ram`` cache may hold: CACHE_BUDGET_FRACTION of the memory free now, within the
    container's limit (NOTE [ Container limits ] in machine.py); with ``memory_budget_bytes``, at
    most what that ceiling leaves above this process's memory now. A small /dev/shm does not bound
    it: a cache that would crowd the workers' batches there is kept in private memory instead
    (NOTE [ Shared memory ] 4 in shm.py)."""
    budget = int(CACHE_BUDGET_FRACTION * memory_available_bytes())
    if memory_budget_bytes is not None:
        budget = min(budget, max(0, memory_budget_bytes - process_memory()))
    return budget


def probe_sample_bytes(dataset: Any, collate_fn: Callable[[Any], Any] | None, n: int | None) -> int | None:
    """Bytes one sample takes in a collated batch, from PROBE_SAMPLES samples read here with the
    RNGs left as they were; ``None`` where they cannot be read or collated (the measurement then
    raises the user's own error where it belongs)."""
    if not n:
        return None
    with rng_preserved():
        try:
            samples = [dataset[i] for i in range(min(PROBE_SAMPLES, n))]
            batch = (collate_fn or default_collate)(samples)
        except Exception:  # noqa: BLE001 - the user's error, raised by the measurement instead
            return None
    return shm.nbytes(batch) // len(samples)


def pretransform_choices(
    dataset: Any, requested: Sequence[str], *, device: torch.device, machine: MachineInfo,
    budget_s: float | None, memory_budget_bytes: int | None = None, ram_budget_bytes: int | None = None,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """(strategies the search may use, {refused strategy: reason}) for ``dataset``.

    A strategy is refused when the dataset cannot be cached, when the cache would not fit
    ``ram_budget_bytes`` (by default ``ram_cache_budget(memory_budget_bytes)``) or
    CACHE_BUDGET_FRACTION of the accelerator's memory, or when its estimated build would take more
    than MAX_BUILD_FRACTION of the budget (with a budget: the drop-in has none, and weighs a build
    against what it can win instead).
    """
    ram_budget = ram_budget_bytes if ram_budget_bytes is not None else ram_cache_budget(memory_budget_bytes)
    # Only "none" asked for: nothing to plan, and the probes would read samples for nothing.
    reasons: dict[str, str | None] = {"none": None} if tuple(requested) == ("none",) else pt.strategies(
        dataset,
        cuda=device.type == "cuda",
        memory_budget_bytes=ram_budget,
        device_memory_budget_bytes=(
            int(CACHE_BUDGET_FRACTION * machine.accelerator_memory_bytes)
            if machine.accelerator_memory_bytes else None
        ),
    )
    build_s = pt.estimate_build_s(dataset) if budget_s is not None and any(
        reasons.get(s) is None for s in requested if s != "none") else None
    if build_s is not None and budget_s is not None and build_s > MAX_BUILD_FRACTION * budget_s:
        for s in requested:
            if s != "none" and reasons.get(s) is None:
                reasons[s] = (
                    f"building the cache would take ~{build_s:.0f} s (estimated from a few samples),"
                    f" more than {MAX_BUILD_FRACTION:.0%} of budget_s={budget_s:g}; raise budget_s so"
                    " the search can afford to try it"
                )
    usable = tuple(s for s in requested if reasons.get(s, "unknown strategy") is None) or ("none",)
    refused = {s: r for s in requested if (r := reasons.get(s)) is not None}
    if device.type != "cuda":
        refused.pop("device", None)  # not a refusal: the strategy does not exist without CUDA
    return usable, refused


def measure_limits(
    budget_s: float, *, memory_budget_bytes: int | None = None, cache_budget_bytes: int | None = None,
    batch_timeout_s: float | None = None, local_world_size: int = 1,
) -> MeasureLimits:
    """The limits every candidate of a ``budget_s`` search is measured with.

    The window is WINDOW_S_PER_BUDGET_S of the budget (within MIN_WINDOW_S..MAX_WINDOW_S); the
    memory ceiling is what this process uses now plus MEMORY_BUDGET_FRACTION of the free RAM, shared
    by the ranks on the node, unless ``memory_budget_bytes`` gives it; a ``ram`` cache's build stops
    above ``cache_budget_bytes`` (the budget its strategy was checked against; None: no ceiling).
    """
    window = min(MAX_WINDOW_S, max(MIN_WINDOW_S, budget_s * WINDOW_S_PER_BUDGET_S))
    if memory_budget_bytes is None:
        avail = memory_available_bytes()
        memory_budget_bytes = process_memory() + int(MEMORY_BUDGET_FRACTION * avail / local_world_size)
    return MeasureLimits(
        window_s=window, memory_limit_bytes=memory_budget_bytes, cache_budget_bytes=cache_budget_bytes,
        trial_timeout_s=max(budget_s, 1.0),
        batch_timeout_s=DEFAULT_BATCH_TIMEOUT_S if batch_timeout_s is None else batch_timeout_s,
    )
