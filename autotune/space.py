"""The search space: which DataLoader settings exist on this machine, for this workload.

A :class:`Candidate` is one point; a :class:`SearchSpace` says which points are feasible. Infeasible
combinations are excluded here, by construction, so the search never samples one (see
``SearchSpace.check``): ``prefetch_factor`` and ``persistent_workers`` exist only with workers,
``pin_memory`` only with CUDA, the ``device`` pre-transform only with CUDA and without worker
processes, thread workers only where the caller allows them (map-style datasets), out-of-order
delivery only with workers and where the order of batches does not matter (see NOTE [ Worker kinds ]),
worker processes only as many, with as many batches in flight, as /dev/shm holds (NOTE [ Shared
memory ] in shm.py).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any, Literal

from . import shm
from .exceptions import ConfigurationError
from .machine import MachineInfo

Strategy = Literal["none", "ram", "device"]
"""Where the transform's deterministic part runs: per sample, once into RAM, once onto the GPU."""

WorkerKind = Literal["process", "thread"]
"""Worker processes (torch's DataLoader) or threads in the main process (autotune.threads)."""

PRETRANSFORMS: tuple[Strategy, ...] = ("none", "ram", "device")
"""Where the deterministic part of the transform runs: per sample, once into RAM, once onto the GPU."""

DEFAULT_BATCH_SIZES = (16, 32, 64, 128, 256)
"""Searched when ``batch_size=None``: powers of two around the common 32-128 range."""

BASELINE_BATCH_SIZE = 32
"""The batch size the PyTorch-defaults baseline uses when the batch size is searched, not fixed."""

WORKER_KINDS: tuple[WorkerKind, ...] = ("process", "thread")
"""Worker processes (torch's DataLoader) or threads in the main process (autotune.threads)."""

PREFETCH_FACTORS = (1, 2, 4, 8)
"""Batches each worker keeps ready. PyTorch's default is 2; more only helps bursty samples."""

WORKERS_PER_CPU = 4
"""The worker bound is this many per usable CPU (see NOTE [ Worker bound ])."""

MAX_WORKERS = 64
"""Hard ceiling on the worker bound, whatever the core count."""

THREADS_PER_CPU = 4
"""The thread bound is this many per usable CPU: as for processes, a thread waiting on storage uses
no CPU, and a CPU-bound one past one per core only competes (see NOTE [ Worker bound ])."""

MAX_THREADS = 32
"""Hard ceiling on the thread bound: past it the GIL hand-offs between threads cost more than they hide."""

# NOTE [ Worker bound ]
# num_workers is searched from 0 to min(WORKERS_PER_CPU * cpus, MAX_WORKERS), where cpus is the number
# of CPUs usable by this process (its affinity mask) divided by the number of ranks sharing the node.
# Past one worker per core, CPU-bound datasets only lose (the workers compete with each other and with
# the step), but a dataset that waits on storage or the network keeps scaling, because a waiting worker
# uses no CPU: the simulated 5 ms remote-storage read needs 4+ workers per core to saturate a core.
# Beyond four per core, per-worker memory and start-up time outweigh any gain we have seen.

# NOTE [ Worker kinds ]
# Worker processes pay a start per worker, pickling under spawn, a copy of every batch through shared
# memory, and cannot share CUDA tensors; thread workers (autotune.threads) pay none of that but share
# the GIL, so they help where the per-sample work releases it (decoding, tensor ops, I/O). Both are
# searched where both apply, with the same prefetch choices; a candidate's ``num_workers`` counts its
# workers of either kind. Thread workers need a map-style dataset; they are the only workers for data
# that lives on the GPU (the ``device`` cache, CUDA tensors) or that cannot be pickled. The caller
# decides where they apply (``build_space(thread_workers=...)``), this module how many.
# ``in_order=False`` hands out each batch as soon as any worker has one (torch >= 2.6 for processes),
# so a slow sample no longer stalls the ones behind it; it is searched only where the caller says the
# order of batches does not matter (``resolve_in_order``), and only with workers.

# NOTE [ persistent_workers is decided, not searched ]
# persistent_workers changes nothing in the steady state; its only effect on speed is that workers start
# once instead of once per epoch, which the score accounts for exactly (NOTE [ Score ] in study.py), and
# the memory it keeps between epochs is the memory the trial already measured. So with workers it is
# True whenever more than one epoch is expected, and the search spends its trials on settings that
# need measuring. A dataset that must be re-read by fresh workers every epoch can still override it.
# Thread workers start in microseconds: they are never persistent.


@dataclass(frozen=True)
class Candidate:
    """One DataLoader configuration, plus the two settings around it that the tuner also decides.

    ``num_workers`` counts the workers of kind ``worker_kind``: ``"process"`` (torch's worker
    processes) or ``"thread"`` (threads of :class:`autotune.threads.ThreadDataLoader`); with no workers
    the kind is ``"process"``. ``in_order=False`` hands out batches as soon as they are ready.
    ``torch_threads`` is the intra-op thread count for the main process (``None``: leave it as it is).
    It matters on CPU-only machines, where the step competes with the workers for the same cores.
    """

    batch_size: int
    num_workers: int = 0
    pin_memory: bool = False
    prefetch_factor: int | None = None
    persistent_workers: bool = False
    pretransform: Strategy = "none"
    torch_threads: int | None = None
    worker_kind: WorkerKind = "process"
    in_order: bool = True

    @property
    def threaded(self) -> bool:
        """Whether the workers are threads (then a plain torch DataLoader cannot express it)."""
        return self.worker_kind == "thread" and self.num_workers > 0

    @property
    def processes(self) -> bool:
        """Whether the workers are processes (torch starts them by forking where it may)."""
        return self.worker_kind == "process" and self.num_workers > 0

    @property
    def loader_class(self) -> str:
        """The class ``loader_kwargs()`` is for, as it would be imported in a script."""
        return "autotune.ThreadDataLoader" if self.threaded else "torch.utils.data.DataLoader"

    def loader_kwargs(self) -> dict[str, Any]:
        """The keyword arguments for :attr:`loader_class`; only the ones that apply.

        For process workers (or none) they are ``torch.utils.data.DataLoader``'s (``in_order`` is
        given only when False; torch >= 2.6 accepts it). Thread workers cannot be expressed with a
        plain DataLoader: their kwargs are ``ThreadDataLoader``'s (``worker_threads`` and
        ``prefetch_per_thread``; ``num_workers`` is 0 there, since no worker process is started), so
        pasting them into a plain DataLoader fails loudly instead of loading without the threads.
        """
        kwargs: dict[str, Any] = {"batch_size": self.batch_size}
        if self.threaded:
            kwargs["num_workers"] = 0
            kwargs["worker_threads"] = self.num_workers
            kwargs["prefetch_per_thread"] = self.prefetch_factor
        else:
            kwargs["num_workers"] = self.num_workers
        kwargs["pin_memory"] = self.pin_memory
        if self.num_workers > 0 and not self.threaded:
            kwargs["prefetch_factor"] = self.prefetch_factor
            kwargs["persistent_workers"] = self.persistent_workers
        if not self.in_order:
            kwargs["in_order"] = False
        return kwargs

    @classmethod
    def from_loader_kwargs(
        cls, kwargs: dict[str, Any], *, pretransform: Strategy = "none", torch_threads: int | None = None
    ) -> Candidate:
        """The candidate whose :meth:`loader_kwargs` are ``kwargs`` (either loader class)."""
        threads = int(kwargs.get("worker_threads", 0) or 0)
        return cls(
            batch_size=int(kwargs["batch_size"]),
            num_workers=threads or int(kwargs.get("num_workers", 0)),
            pin_memory=bool(kwargs.get("pin_memory", False)),
            prefetch_factor=kwargs.get("prefetch_per_thread") if threads else kwargs.get("prefetch_factor"),
            persistent_workers=bool(kwargs.get("persistent_workers", False)),
            pretransform=pretransform,
            torch_threads=torch_threads,
            worker_kind="thread" if threads else "process",
            in_order=bool(kwargs.get("in_order", True)),
        )

    def label(self) -> str:
        """A short, human-readable name: ``bs=64 w=3 pf=2 persist pin ram t=1``, ``w=2 thr pf=2 unordered``
        (``thr``: thread workers; ``unordered``: batches handed out as soon as they are ready)."""
        parts = [f"bs={self.batch_size}", f"w={self.num_workers}"]
        if self.threaded:
            parts.append("thr")
        if self.num_workers > 0:
            parts.append(f"pf={self.prefetch_factor}")
            if self.persistent_workers:
                parts.append("persist")
            if not self.in_order:
                parts.append("unordered")
        if self.pin_memory:
            parts.append("pin")
        if self.pretransform != "none":
            parts.append(self.pretransform)
        if self.torch_threads is not None:
            parts.append(f"t={self.torch_threads}")
        return " ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Candidate:
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class SearchSpace:
    """Every setting the search may choose, with the constraints between them."""

    batch_sizes: tuple[int, ...]
    max_workers: int
    """The most worker processes searched; 0: none (loading stays in the main process or threads)."""
    cuda: bool = False
    pretransforms: tuple[Strategy, ...] = ("none",)
    prefetch_factors: tuple[int, ...] = PREFETCH_FACTORS
    torch_threads: tuple[int | None, ...] = (None,)
    persistent: bool = True
    """``persistent_workers`` for every candidate with workers (see NOTE [ persistent_workers ... ])."""
    baseline_batch_size: int = BASELINE_BATCH_SIZE
    excluded: dict[str, str] = field(default_factory=dict)
    """Settings left out of the space, each with the reason (logged and reported)."""
    max_threads: int = 0
    """The most thread workers searched; 0: none (see NOTE [ Worker kinds ])."""
    in_order_choices: tuple[bool, ...] = (True,)
    """``(True,)``, or ``(True, False)`` where out-of-order delivery is searched too."""
    sample_bytes: int | None = None
    """Bytes one sample takes in a collated batch, what worker processes pass through /dev/shm
    (``None``: not known, and /dev/shm bounds nothing; see NOTE [ Shared memory ] in shm.py)."""
    shm_free_bytes: int | None = None
    """The free space of /dev/shm the workers' batches may take, read when the space was made
    (``None``: no /dev/shm)."""
    pinned: bool = False
    """``pin_memory=True`` as the user wrote it, kept on every candidate: without CUDA torch pins
    nothing (it warns), and the search is not refused for the user's own setting."""

    def __post_init__(self) -> None:
        if not self.batch_sizes or any(b < 1 for b in self.batch_sizes):
            raise ConfigurationError(
                f"batch_sizes={self.batch_sizes!r} must be a non-empty list of positive integers."
            )
        if self.max_workers < 0:
            raise ConfigurationError(f"max_workers={self.max_workers} must be >= 0.")
        if self.max_threads < 0:
            raise ConfigurationError(f"max_threads={self.max_threads} must be >= 0.")
        unknown = set(self.pretransforms) - set(PRETRANSFORMS)
        if unknown or not self.pretransforms:
            raise ConfigurationError(
                f"pretransforms={self.pretransforms!r}: each must be one of {PRETRANSFORMS}."
            )
        if self.in_order_choices not in ((True,), (True, False)):
            raise ConfigurationError(
                f"in_order_choices={self.in_order_choices!r} must be (True,) or (True, False):"
                " in-order delivery is always possible, out-of-order only where it is searched."
            )

    def worker_kinds(self, pretransform: str = "none") -> tuple[WorkerKind, ...]:
        """The kinds of workers that exist with ``pretransform`` (worker processes never share the
        ``device`` cache)."""
        kinds: list[WorkerKind] = []
        if self.max_workers > 0 and pretransform != "device" and self.processes_fit():
            kinds.append("process")
        if self.max_threads > 0:
            kinds.append("thread")
        return tuple(kinds)

    def check(self, c: Candidate) -> str | None:
        """The reason ``c`` is infeasible in this space, or ``None`` when it is feasible."""
        if c.batch_size not in self.batch_sizes and c.batch_size != self.baseline_batch_size:
            return f"batch_size={c.batch_size} is not among {self.batch_sizes}"
        if c.worker_kind not in WORKER_KINDS:
            return f"worker_kind={c.worker_kind!r} is not one of {WORKER_KINDS}"
        if c.num_workers < 0:
            return f"num_workers={c.num_workers} is negative"
        if c.num_workers == 0:
            if c.prefetch_factor is not None or c.persistent_workers:
                return "prefetch_factor and persistent_workers need num_workers > 0"
            if c.worker_kind != "process" or not c.in_order:
                return ("worker_kind and in_order describe workers: with num_workers=0 they stay at"
                        " their defaults")
        elif c.worker_kind == "thread":
            if self.max_threads == 0:
                reason = self.excluded.get("thread workers", "they are not searched for this dataset")
                return f"thread workers: {reason}"
            if c.num_workers > self.max_threads:
                return f"{c.num_workers} thread workers is outside 1..{self.max_threads}"
            if c.persistent_workers:
                return "thread workers are never persistent: they start in microseconds"
        else:
            if c.num_workers > self.max_workers:
                why = self.excluded.get("num_workers>0")
                if self.max_workers == 0 and why:
                    return f"num_workers={c.num_workers}: {why}"
                return f"num_workers={c.num_workers} is outside 0..{self.max_workers}"
            if c.persistent_workers != self.persistent:
                return (
                    f"persistent_workers={c.persistent_workers}: it is {self.persistent} for every"
                    " candidate with workers, as the expected number of epochs decides"
                )
            if (why := self.shm_reason(c)) is not None:
                return why
        if c.num_workers > 0 and c.prefetch_factor not in self.prefetch_factors:
            return f"prefetch_factor={c.prefetch_factor} is not among {self.prefetch_factors}"
        if c.in_order not in self.in_order_choices:
            return ("in_order=False: out-of-order delivery is searched only where the order of batches"
                    " does not matter")
        if c.pin_memory and not self.cuda and not self.pinned:
            return "pin_memory needs CUDA"
        if c.pretransform not in self.pretransforms and c.pretransform != "none":
            reason = self.excluded.get(f"pretransform={c.pretransform}", "not available")
            return f"pretransform={c.pretransform!r}: {reason}"
        if c.pretransform == "device" and c.pin_memory:
            return "pretransform='device' keeps batches on the GPU already: pin_memory does not apply"
        if c.pretransform == "device" and c.num_workers > 0 and not c.threaded:
            return (
                "pretransform='device' needs num_workers=0 or thread workers: worker processes cannot"
                " share CUDA tensors (_share_filename_: only available on CPU)"
            )
        if c.torch_threads not in self.torch_threads and c.torch_threads is not None:
            return f"torch_threads={c.torch_threads} is not among {self.torch_threads}"
        return None

    def shm_reason(self, c: Candidate) -> str | None:
        """Why the batches ``c``'s worker processes pass do not fit /dev/shm, or ``None`` when they do
        (or use none: threads, no workers). See NOTE [ Shared memory ] in shm.py."""
        if c.num_workers == 0 or c.threaded or not self.sample_bytes or self.shm_free_bytes is None:
            return None
        batch = c.batch_size * self.sample_bytes
        pf = c.prefetch_factor or 2
        if shm.fits(shm.worker_bytes(c.num_workers, pf, batch), self.shm_free_bytes):
            return None
        return shm.workers_reason(c.num_workers, pf, batch, self.shm_free_bytes)

    def processes_fit(self) -> bool:
        """Whether the fewest batches in flight (one worker, the least prefetch, the smallest batch)
        fit /dev/shm: where not even they do, worker processes are not searched at all."""
        least = Candidate(min(self.batch_sizes), num_workers=1, prefetch_factor=min(self.prefetch_factors))
        return self.shm_reason(least) is None

    def left_out(self, usable_cpus: int) -> list[tuple[Candidate, str]]:
        """The configuration people write (the rule of thumb, :meth:`heuristic`) with the reason, where
        /dev/shm rules it out: the drivers record it, so the result says what bound the search."""
        rule = self.heuristic(usable_cpus)
        why = self.shm_reason(rule)
        return [] if why is None else [(rule, why)]

    def baseline(self) -> Candidate:
        """PyTorch's own defaults at the workload's batch size: no workers, nothing pinned."""
        return Candidate(batch_size=self.baseline_batch_size)

    def heuristic(self, usable_cpus: int) -> Candidate:
        """A common rule of thumb: one worker per core but one, default prefetch, kept alive."""
        workers = min(self.max_workers, max(1, usable_cpus - 1)) if self.max_workers else 0
        return Candidate(
            batch_size=self.baseline_batch_size,
            num_workers=workers,
            pin_memory=self.cuda,
            prefetch_factor=2 if workers else None,
            persistent_workers=self.persistent and bool(workers),
            torch_threads=self.torch_threads[-1],
        )

    def workers(self, kind: str, count: int, prefetch: int | None, in_order: bool = True) -> dict[str, Any]:
        """The worker fields of a candidate with ``count`` workers of ``kind`` (none when 0)."""
        if count == 0:
            return {"num_workers": 0, "prefetch_factor": None, "persistent_workers": False,
                    "worker_kind": "process", "in_order": True}
        return {"num_workers": count, "prefetch_factor": prefetch,
                "persistent_workers": self.persistent and kind == "process", "worker_kind": kind,
                "in_order": in_order}

    def grid(self) -> Iterator[Candidate]:
        """Every feasible candidate, in a fixed order (the exhaustive search benchmarks compare to)."""
        pins = (False, True) if self.cuda else (False,)
        for bs, pt, threads, pin in itertools.product(
            self.batch_sizes, self.pretransforms, self.torch_threads, pins
        ):
            if pt == "device" and pin:
                continue
            base = Candidate(bs, pin_memory=pin, pretransform=pt, torch_threads=threads)
            yield base
            for kind in self.worker_kinds(pt):
                bound = self.max_workers if kind == "process" else self.max_threads
                for workers, pf, in_order in itertools.product(
                    range(1, bound + 1), self.prefetch_factors, self.in_order_choices
                ):
                    c = replace(base, **self.workers(kind, workers, pf, in_order))
                    if self.shm_reason(c) is None:
                        yield c

    def size(self) -> int:
        return sum(1 for _ in self.grid())

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def cpus_per_rank(usable_cpus: int, local_world_size: int = 1) -> int:
    """The CPUs one rank of ``local_world_size`` on this node may count on: at least one."""
    return max(1, usable_cpus // max(1, local_world_size))


def worker_bound(usable_cpus: int, local_world_size: int = 1) -> int:
    """The largest ``num_workers`` searched (see NOTE [ Worker bound ])."""
    per_rank = cpus_per_rank(usable_cpus, local_world_size)
    return min(WORKERS_PER_CPU * per_rank, MAX_WORKERS)


def thread_bound(usable_cpus: int, local_world_size: int = 1) -> int:
    """The largest number of thread workers searched (see THREADS_PER_CPU)."""
    per_rank = cpus_per_rank(usable_cpus, local_world_size)
    return min(THREADS_PER_CPU * per_rank, MAX_THREADS)


def resolve_in_order(in_order: bool | None, *, shuffle: bool) -> tuple[bool, ...]:
    """The ``in_order`` values to search, from the user's ``in_order`` argument.

    ``None``: out-of-order delivery too only with ``shuffle=True`` (the order is random anyway);
    ``True``: never; ``False``: search it even without shuffling (the user says order does not matter).
    """
    if in_order is not None and not isinstance(in_order, bool):
        raise ConfigurationError(
            f"in_order={in_order!r} must be True, False or None; None searches out-of-order delivery"
            " only with shuffle=True, False searches it whatever the order, True never."
        )
    if in_order is None:
        return (True, False) if shuffle else (True,)
    return (True,) if in_order else (True, False)


def thread_choices(machine: MachineInfo, local_world_size: int = 1) -> tuple[int | None, ...]:
    """Main-process torch thread counts to search: only on CPU-only machines (see Candidate)."""
    if machine.has_cuda:
        return (None,)
    per_rank = cpus_per_rank(machine.usable_cpus, local_world_size)
    return tuple(sorted({1, max(1, per_rank // 2), per_rank}))


def resolve_batch_sizes(
    batch_size: int | Sequence[int] | None, dataset_len: int | None
) -> tuple[tuple[int, ...], int]:
    """(batch sizes to search, baseline batch size) from the user's ``batch_size`` argument."""
    if batch_size is None:
        sizes = tuple(b for b in DEFAULT_BATCH_SIZES if dataset_len is None or b <= dataset_len)
        if not sizes:
            sizes = (max(1, dataset_len or 1),)
        baseline = BASELINE_BATCH_SIZE if BASELINE_BATCH_SIZE in sizes else sizes[0]
        return sizes, baseline
    values: list[Any] = (
        list(batch_size) if isinstance(batch_size, (list, tuple, range)) else [batch_size]
    )
    if not values:
        raise ConfigurationError(
            "batch_size=[] is empty; pass an int to fix the batch size, a list of ints to search"
            " among them, or None to search the defaults."
        )
    for v in values:
        if isinstance(v, bool) or not isinstance(v, int) or v < 1:
            raise ConfigurationError(
                f"batch_size={v!r} is not a positive integer; pass an int >= 1, a list of them, or"
                " None to search."
            )
        if dataset_len is not None and v > dataset_len:
            raise ConfigurationError(
                f"batch_size={v} is larger than the dataset ({dataset_len} samples); pass a batch"
                f" size of at most {dataset_len}."
            )
    sizes = tuple(sorted({int(v) for v in values}))
    baseline = sizes[0] if len(sizes) == 1 else (
        BASELINE_BATCH_SIZE if BASELINE_BATCH_SIZE in sizes else sizes[0]
    )
    return sizes, baseline


def build_space(
    machine: MachineInfo,
    *,
    batch_size: int | Sequence[int] | None,
    dataset_len: int | None,
    cuda: bool,
    pretransforms: Sequence[str] = ("none",),
    max_workers: int | None = None,
    local_world_size: int = 1,
    excluded: dict[str, str] | None = None,
    epochs: int = 10,
    thread_workers: bool = False,
    max_threads: int | None = None,
    in_order_choices: Sequence[bool] = (True,),
    persistent: bool | None = None,
    sample_bytes: int | None = None,
    shm_free_bytes: int | None = None,
    pinned: bool = False,
) -> SearchSpace:
    """The space for this machine and the user's fixed choices.

    ``max_workers`` bounds the worker processes (0 where they cannot be used); ``thread_workers``
    says whether thread workers apply (map-style datasets), ``max_threads`` bounds them below the
    machine's :func:`thread_bound`; ``in_order_choices`` comes from :func:`resolve_in_order`;
    ``persistent`` is ``persistent_workers`` as the user fixed it (``None``: more than one epoch);
    ``sample_bytes`` and ``shm_free_bytes`` bound the worker processes by /dev/shm (SearchSpace's);
    ``pinned``: the user wrote ``pin_memory=True`` (SearchSpace's).
    """
    sizes, baseline = resolve_batch_sizes(batch_size, dataset_len)
    bound = worker_bound(machine.usable_cpus, local_world_size)
    if max_workers is not None:
        check_bound("max_workers", max_workers)
        bound = min(bound, max_workers)
    threads = thread_bound(machine.usable_cpus, local_world_size) if thread_workers else 0
    if max_threads is not None:
        check_bound("max_threads", max_threads)
        threads = min(threads, max_threads)
    pts: tuple[Strategy, ...] = tuple(p for p in PRETRANSFORMS if p in pretransforms)
    if "device" in pts and not cuda:
        pts = tuple(p for p in pts if p != "device")
    return SearchSpace(
        batch_sizes=sizes,
        max_workers=bound,
        cuda=cuda,
        pretransforms=pts or ("none",),
        torch_threads=(None,) if cuda else thread_choices(machine, local_world_size),
        persistent=epochs > 1 if persistent is None else persistent,
        baseline_batch_size=baseline,
        excluded=dict(excluded or {}),
        max_threads=threads,
        in_order_choices=(True, False) if False in tuple(in_order_choices) else (True,),
        sample_bytes=sample_bytes,
        shm_free_bytes=shm_free_bytes,
        pinned=pinned,
    )


def check_bound(name: str, value: Any) -> None:
    """Refuse a worker or thread bound that is not a non-negative integer, naming the fix."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ConfigurationError(
            f"{name}={value!r} must be a non-negative integer; use 0 to keep loading in the main process."
        )
