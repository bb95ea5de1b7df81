"""``tune_loader`` and ``TuneResult``: the front door, glue only."""

from __future__ import annotations

import json
import logging
import math
import multiprocessing
import os
import pickle
import time
import types
import warnings
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import psutil
import torch
from torch.utils.data import DataLoader, IterableDataset, default_collate

from . import distributed, profiles
from . import pretransform as pt
from .exceptions import AutotuneWarning, ConfigurationError
from .machine import MachineInfo, detect_machine
from .measure import (
    DEFAULT_BATCH_TIMEOUT_S,
    MeasureLimits,
    measure,
    process_memory,
    quiet_worker_warning,
)
from .progress import Progress
from .space import Candidate, build_space
from .study import SearchSettings, TrialRecord, run_search

log = logging.getLogger("autotune")

DEFAULT_BUDGET_S = 60.0
"""A minute: enough for ~25 measured candidates on a small machine, short beside any training run."""

DEFAULT_EPOCHS = 10
"""Epochs a pre-transform cache and worker start-up are amortised over, when the user does not say."""

MEMORY_BUDGET_FRACTION = 0.5
"""Share of the RAM available at the start that the workers of one trial may add."""

CACHE_BUDGET_FRACTION = 0.25
"""Share of available RAM (or accelerator memory) a pre-transform cache may take."""

MAX_BUILD_FRACTION = 0.25
"""A pre-transform cache whose estimated build takes more of the budget than this is not tried."""

WINDOW_S_PER_BUDGET_S = 1.0 / 60.0
"""Each candidate's steady-state window is this share of the budget (1 s for the default minute)."""

MIN_WINDOW_S, MAX_WINDOW_S = 0.25, 2.0

PRETRANSFORM_CHOICES = ("auto", *pt.STRATEGIES)


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
        kw = self.loader_kwargs
        return Candidate(
            batch_size=int(kw["batch_size"]),
            num_workers=int(kw.get("num_workers", 0)),
            pin_memory=bool(kw.get("pin_memory", False)),
            prefetch_factor=kw.get("prefetch_factor"),
            persistent_workers=bool(kw.get("persistent_workers", False)),
            pretransform=self.pretransform,
            torch_threads=self.torch_threads,
        )

    def make_loader(self, dataset: Any, **overrides: Any) -> DataLoader[Any]:
        """A real DataLoader with the tuned settings; ``overrides`` win (``shuffle=True`` etc.).

        With a pre-transform, the dataset is wrapped (built once per process, then reused).
        """
        prepared = pt.prepare(dataset, self.pretransform, device=torch.device(self.device))
        kwargs: dict[str, Any] = dict(self.loader_kwargs)
        if prepared.collate_fn is not None:
            kwargs["collate_fn"] = prepared.collate_fn
        kwargs.update(overrides)
        if self.pretransform == "device" and kwargs.get("num_workers", 0):
            raise ConfigurationError(
                f"num_workers={kwargs['num_workers']} cannot be used with pretransform='device':"
                " worker processes cannot share CUDA tensors; keep num_workers=0."
            )
        if kwargs.get("num_workers", 0) == 0:
            kwargs.pop("prefetch_factor", None)
            kwargs.pop("persistent_workers", None)
        with quiet_worker_warning():
            return DataLoader(prepared.dataset, **kwargs)

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
        return data

    def to_json(self, **kwargs: Any) -> str:
        return json.dumps(self.to_dict(), default=str, **kwargs)

    @classmethod
    def from_dict(cls, data: dict[str, Any], **changes: Any) -> TuneResult:
        fields = {k: data[k] for k in cls.__dataclass_fields__ if k in data}
        fields["trials"] = tuple(TrialRecord.from_dict(t) for t in data.get("trials", ()))
        fields.update(changes)
        return cls(**fields)

    def table(self) -> str:
        """The trial table as text (see :mod:`autotune.report`)."""
        from .report import trial_table

        return trial_table(self)

    def plot(self, path: str) -> str:
        """Throughput against workers and busy fraction, saved to ``path`` (needs matplotlib)."""
        from .report import plot

        return plot(self, path)


def _dataset_len(dataset: Any) -> int | None:
    """``len(dataset)`` checked, or ``None`` for an iterable dataset without one."""
    if isinstance(dataset, IterableDataset):
        try:
            return len(dataset)  # type: ignore[arg-type]
        except TypeError:
            return None
    if not hasattr(dataset, "__getitem__"):
        if hasattr(dataset, "__iter__"):
            raise ConfigurationError(
                f"dataset of type {type(dataset).__name__} is iterable but not a"
                " torch.utils.data.IterableDataset; wrap it in an IterableDataset subclass, or"
                " give it __getitem__ and __len__."
            )
        raise ConfigurationError(
            f"dataset of type {type(dataset).__name__} is not a dataset: it needs __getitem__"
            " and __len__ (a map-style torch.utils.data.Dataset) or to be an IterableDataset."
        )
    try:
        n = len(dataset)
    except TypeError as err:
        raise ConfigurationError(
            f"dataset of type {type(dataset).__name__} has __getitem__ but no __len__; add"
            " __len__, or make it an IterableDataset."
        ) from err
    if n == 0:
        raise ConfigurationError(
            f"dataset of type {type(dataset).__name__} is empty (len 0); there is nothing to load."
        )
    return n


def _check_number(name: str, value: Any, *, minimum: float, fix: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ConfigurationError(f"{name}={value!r} is not a finite number; {fix}")
    if value < minimum or (minimum == 0 and value <= 0):
        rule = "> 0" if minimum == 0 else f">= {minimum:g}"
        raise ConfigurationError(f"{name}={value!r} must be {rule}; {fix}")
    return float(value)


def _resolve_device(device: str | torch.device | None) -> torch.device:
    if device is None:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as err:
        raise ConfigurationError(
            f"device={device!r} is not a torch device; use 'cpu', 'cuda' or 'cuda:N'."
        ) from err
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ConfigurationError(
            f"device={device!r} but CUDA is not available on this machine; use device='cpu'."
        )
    return dev


def _resolve_pretransforms(pretransform: str | Sequence[str]) -> tuple[str, ...]:
    names = [pretransform] if isinstance(pretransform, str) else list(pretransform)
    for name in names:
        if name not in PRETRANSFORM_CHOICES:
            raise ConfigurationError(
                f"pretransform={name!r} is not a pre-transform strategy; use one of"
                f" {PRETRANSFORM_CHOICES} ('auto' searches every strategy that applies)."
            )
    if "auto" in names:
        return pt.STRATEGIES
    return tuple(dict.fromkeys(names))


def _check_callable(name: str, value: Any, fix: str) -> None:
    if value is not None and not callable(value):
        raise ConfigurationError(f"{name}={value!r} is not callable; {fix}")


def _describe_sample(sample: Any, depth: int = 0) -> str:
    """A sample's structure for a message: ``(tensor[3, 32, 32] float32, int)``."""
    if isinstance(sample, torch.Tensor):
        dims = ", ".join(str(d) for d in sample.shape)
        return f"tensor[{dims}] {str(sample.dtype).removeprefix('torch.')}"
    if depth < 3 and isinstance(sample, tuple | list):
        inner = ", ".join(_describe_sample(v, depth + 1) for v in sample[:8])
        return f"({inner})" if isinstance(sample, tuple) else f"[{inner}]"
    if depth < 3 and isinstance(sample, dict):
        inner = ", ".join(f"{k!r}: {_describe_sample(v, depth + 1)}" for k, v in list(sample.items())[:8])
        return f"{{{inner}}}"
    return type(sample).__name__


def _check_collates(dataset: Any, n: int | None, batch_size: Any) -> None:
    """Collate two samples as a DataLoader would, so a dataset that cannot be batched fails now, with
    the shapes in the message, rather than under every candidate."""
    if n is None or n < 2 or isinstance(dataset, IterableDataset):
        return  # a stream is not read ahead of the search (it may be unbounded or one-shot)
    sizes = [batch_size] if isinstance(batch_size, int) else list(batch_size or [2])
    if all(isinstance(b, int) and b <= 1 for b in sizes):
        return  # batches of one never stack two samples
    last = n - 1
    try:
        samples = [dataset[0], dataset[last]]
    except Exception as err:
        err.add_note(f"autotune: raised while reading dataset[0] and dataset[{last}] before tuning.")
        raise
    try:
        default_collate(samples)
    except Exception as err:
        first = (str(err).strip().splitlines() or [""])[0][:200]
        raise ConfigurationError(
            f"samples of {type(dataset).__name__} cannot be batched by default_collate: dataset[0] is"
            f" {_describe_sample(samples[0])} and dataset[{last}] is {_describe_sample(samples[1])}"
            f" ({type(err).__name__}: {first}); pass collate_fn= that pads or packs them (for"
            " sequences, torch.nn.utils.rnn.pad_sequence), give every sample the same shape and types,"
            " or use batch_size=1."
        ) from err


class _Discard:
    def write(self, data: bytes) -> int:
        return len(data)


class _StructurePickler(pickle.Pickler):
    """Pickles everything but array data: whether a dataset can be pickled, without copying it."""

    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor | torch.UntypedStorage | torch.TypedStorage):
            return (tuple, ())
        if type(obj).__module__ == "numpy" and type(obj).__name__ == "ndarray":
            return (tuple, ())
        return NotImplemented


def _start_method() -> str:
    """The start method DataLoader workers will use, without fixing the process-wide default."""
    return multiprocessing.get_start_method(allow_none=True) or multiprocessing.get_all_start_methods()[0]


def _unpicklable_reason(dataset: Any, collate_fn: Any) -> str | None:
    """Why workers cannot receive the dataset (or collate_fn) under a start method that pickles them."""
    method = _start_method()
    if method == "fork":
        return None  # forked workers inherit the objects; nothing is pickled
    for name, obj in (("dataset", dataset), ("collate_fn", collate_fn)):
        if obj is None:
            continue
        try:
            _StructurePickler(_Discard(), protocol=pickle.HIGHEST_PROTOCOL).dump(obj)
        except Exception as err:  # noqa: BLE001 - TypeError, AttributeError, PicklingError, ...
            what = f"dataset of type {type(obj).__name__}" if name == "dataset" else f"collate_fn={obj!r}"
            return (
                f"{what} cannot be pickled ({type(err).__name__}: {err}); only num_workers=0 is"
                f" searched, because the {method!r} start method sends it pickled to every worker"
                " process. Make it picklable (no locks, lambdas or open files as attributes), or use"
                " multiprocessing.set_start_method('fork') where the platform has it."
            )
    return None


def _shards_by_worker(dataset: Any) -> bool:
    """Whether the dataset's ``__iter__`` calls ``get_worker_info`` (a heuristic: it reads the code)."""
    codes = [getattr(getattr(type(dataset), "__iter__", None), "__code__", None)]
    while codes:
        code = codes.pop()
        if isinstance(code, types.CodeType):
            if "get_worker_info" in code.co_names:
                return True
            codes.extend(c for c in code.co_consts if isinstance(c, types.CodeType))
    return False


def pretransform_choices(
    dataset: Any, requested: Sequence[str], *, device: torch.device, machine: MachineInfo,
    budget_s: float, memory_budget_bytes: int | None = None,
) -> tuple[tuple[str, ...], dict[str, str]]:
    """(strategies the search may use, {refused strategy: reason}) for ``dataset``.

    A strategy is refused when the dataset cannot be cached, when the cache would not fit
    CACHE_BUDGET_FRACTION of the free memory (or, with ``memory_budget_bytes``, what that ceiling
    leaves above this process's memory now), or when its estimated build would take more than
    MAX_BUILD_FRACTION of the budget.
    """
    ram_budget = int(CACHE_BUDGET_FRACTION * psutil.virtual_memory().available)
    if memory_budget_bytes is not None:
        ram_budget = min(ram_budget, max(0, memory_budget_bytes - process_memory()))
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
    build_s = pt.estimate_build_s(dataset) if any(
        reasons.get(s) is None for s in requested if s != "none") else None
    if build_s is not None and build_s > MAX_BUILD_FRACTION * budget_s:
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
    budget_s: float, *, memory_budget_bytes: int | None = None, batch_timeout_s: float | None = None,
    local_world_size: int = 1,
) -> MeasureLimits:
    """The limits every candidate of a ``budget_s`` search is measured with.

    The window is WINDOW_S_PER_BUDGET_S of the budget (within MIN_WINDOW_S..MAX_WINDOW_S); the
    memory ceiling is what this process uses now plus MEMORY_BUDGET_FRACTION of the free RAM, shared
    by the ranks on the node, unless ``memory_budget_bytes`` gives it.
    """
    window = min(MAX_WINDOW_S, max(MIN_WINDOW_S, budget_s * WINDOW_S_PER_BUDGET_S))
    if memory_budget_bytes is None:
        avail = psutil.virtual_memory().available
        memory_budget_bytes = process_memory() + int(MEMORY_BUDGET_FRACTION * avail / local_world_size)
    return MeasureLimits(
        window_s=window, memory_limit_bytes=memory_budget_bytes, trial_timeout_s=max(budget_s, 1.0),
        batch_timeout_s=DEFAULT_BATCH_TIMEOUT_S if batch_timeout_s is None else batch_timeout_s,
    )


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
) -> TuneResult:
    """Find the fastest DataLoader settings for ``dataset`` (and ``step``) on this machine.

    Args:
        dataset: a map-style dataset (``__getitem__`` + ``__len__``) or an ``IterableDataset``.
        step: called with every batch, already moved to ``device``: your training step. ``None``
            measures loading alone.
        batch_size: an int fixes it (batch size changes training, so it is only searched when
            asked); a list searches among those; ``None`` searches ``space.DEFAULT_BATCH_SIZES``.
        budget_s: wall-clock seconds for the whole call, respected within 10 %.
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
    """
    started = time.monotonic()
    n = _dataset_len(dataset)
    budget = _check_number("budget_s", budget_s, minimum=0,
                           fix="give the tuning a positive number of seconds, e.g. budget_s=60.")
    if isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1:
        raise ConfigurationError(
            f"epochs={epochs!r} must be a positive integer: the number of epochs you will train."
        )
    dev = _resolve_device(device)
    strategies = _resolve_pretransforms(pretransform)
    _check_callable("step", step, "pass a function that takes a batch (your training step), or None.")
    _check_callable("collate_fn", collate_fn, "pass a function that takes a list of samples, or None.")
    batch_timeout = DEFAULT_BATCH_TIMEOUT_S if batch_timeout_s is None else _check_number(
        "batch_timeout_s", batch_timeout_s, minimum=0,
        fix="give the longest a single batch may take, in seconds, or None for the default.")
    if collate_fn is None:
        _check_collates(dataset, n, batch_size)
    machine = detect_machine()
    iterable = isinstance(dataset, IterableDataset)
    ctx = distributed.context(budget)
    local_ranks = ctx.local_world_size if ctx is not None else 1

    fixed: dict[str, Any] = {
        "batch_size": batch_size if batch_size is None or isinstance(batch_size, int)
        else sorted(batch_size),
        "epochs": epochs,
        "pretransform": list(strategies),
        "max_workers": max_workers,
        "shuffle": shuffle,
        "collate_fn": getattr(collate_fn, "__qualname__", None if collate_fn is None else "custom"),
    }
    if ctx is not None:
        fixed["local_world_size"] = local_ranks  # the best per-rank setting depends on it
    workload = profiles.workload_fingerprint(dataset, step=step, device=str(dev), fixed=fixed)
    if ctx is not None and not ctx.leader:
        payload = distributed.follow(ctx, dataset, step=step, device=dev,
                                     shuffle=shuffle and not iterable, collate_fn=collate_fn,
                                     seed=seed)
        return TuneResult.from_dict(payload)
    coordinator = distributed.Coordinator(ctx) if ctx is not None else None
    key = profiles.profile_key(machine.fingerprint(), workload)
    store = profiles.open_store(cache_dir=cache_dir, storage=storage) if cache else None
    if store is not None and not retune:
        record = store.get(key)
        if record is not None:
            log.info("autotune: profile %s found in %s; not measuring", key, store.location)
            cached = TuneResult.from_dict(record, from_cache=True)
            if coordinator is not None:
                coordinator.finish(("result", cached.to_dict()))
            return cached

    cuda_data = not iterable and pt.holds_cuda_tensors(dataset)
    excluded: dict[str, str] = {}
    if cuda_data:
        max_workers = 0
        excluded["num_workers>0"] = (
            "the dataset already holds CUDA tensors, which worker processes cannot share"
            " (_share_filename_: only available on CPU); only num_workers=0 is searched"
        )
        log.info("autotune: %s", excluded["num_workers>0"])
    if max_workers != 0 and (why := _unpicklable_reason(dataset, collate_fn)) is not None:
        max_workers = 0
        excluded["num_workers>0"] = why
        warnings.warn(why, AutotuneWarning, stacklevel=2)
    if iterable and max_workers != 0 and not _shards_by_worker(dataset):
        warnings.warn(
            f"{type(dataset).__name__} is an IterableDataset whose __iter__ does not seem to shard the"
            " stream: with num_workers > 0 each worker replays all of it, so every sample comes"
            " num_workers times and the measured speed counts the copies. Shard it in __iter__ with"
            " torch.utils.data.get_worker_info(), or pass max_workers=0.",
            AutotuneWarning, stacklevel=2,
        )

    if memory_budget_bytes is not None:
        memory_budget_bytes = int(_check_number(
            "memory_budget_bytes", memory_budget_bytes, minimum=0,
            fix="give a positive number of bytes, or None for half the available RAM."))
    usable, refused = pretransform_choices(dataset, strategies, device=dev, machine=machine,
                                           budget_s=budget, memory_budget_bytes=memory_budget_bytes)
    space = build_space(
        machine, batch_size=batch_size, dataset_len=n, cuda=dev.type == "cuda",
        pretransforms=usable, max_workers=max_workers, excluded=excluded, epochs=epochs,
        local_world_size=local_ranks,
    )

    limits = measure_limits(budget, memory_budget_bytes=memory_budget_bytes,
                            batch_timeout_s=batch_timeout, local_world_size=local_ranks)
    settings = SearchSettings(
        budget_s=budget, epochs=epochs, dataset_len=n, device=dev, limits=limits, seed=seed,
        shuffle=shuffle and not iterable, collate_fn=collate_fn, usable_cpus=machine.usable_cpus,
        refused=refused,
        storage_url=store.study_storage_url() if store is not None else None,
        started_at=started,
        study_name=f"autotune-{key}-{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}",
    )
    bar = Progress(budget, enabled=progress)
    try:
        outcome = run_search(dataset, step, space, settings, progress=bar,
                             evaluate=coordinator or measure)
    except BaseException as err:
        if coordinator is not None:
            coordinator.finish(("error", f"{type(err).__name__}: {err}"))
        raise
    finally:
        bar.close()
    best, base = outcome.best, outcome.baseline
    result = TuneResult(
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
        device=str(dev),
        epochs=epochs,
        budget_s=budget,
        tuning_s=time.monotonic() - started,
        key=key,
        machine=machine.fingerprint(),
        workload=workload,
        study_name=outcome.study_name,
        storage_url=settings.storage_url if outcome.study_name else None,
    )
    if coordinator is not None:
        coordinator.finish(("result", result.to_dict()))
    if store is not None:
        store.put(key, result.to_dict())
    log.info("autotune: best %s at %.0f samples/s (%.2fx the defaults)",
             best.candidate.label(), best.samples_per_s, outcome.speedup or float("nan"))
    return result
