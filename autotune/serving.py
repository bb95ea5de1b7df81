"""What a drop-in loader serves with: its serving state, and the inner loaders its epochs are served by.

# NOTE [ Serving state ]
# torch's iterator copies what it needs from its loader when it starts and never calls the loader
# back; the drop-in's epochs do the same. An epoch copies the user's torch settings when it starts
# (``iter()``, or a kept iterator's reset) into :class:`EpochSettings`, and is given the loader's
# :class:`Serving`: what outlives an epoch and is not the search's (``Tuning`` in tuning.py holds
# that): the inner loader kept for the run and the loader's place in the thread-count stack
# (``Held``), the epoch's base-seed state, the live iterators and the batches served. The loader
# makes its serving state once and reads it; the epochs change it through its methods; neither calls
# the other. The loader hears that it settled through ``on_settled``, which holds it weakly: the
# loader holds its serving state, and a cycle would keep the workers alive until the garbage
# collector ran.
#
# An inner loader is torch's ``DataLoader`` (or a ``ThreadDataLoader``) over the user's dataset, fed
# the epoch's indices by a :class:`~autotune.feed.FeedSampler`, built by the search's own builder
# (``measure.build_loader``); the user's own settings reach it as torch would apply them (timeout,
# worker_init_fn, context, pin-memory device, the epoch's base seed).
"""

from __future__ import annotations

import math
import time
import weakref
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any, NamedTuple, Protocol

import torch
import torch.utils.data as tud

from . import pretransform as pt
from .feed import Feed, FeedSampler
from .measure import THREAD_COUNTS, build_loader
from .space import Candidate
from .supervise import process_memory, stop_iterator
from .tuning import Tuning

MEMORY_REREAD_S = 5.0
"""A candidate's memory (the main process's and its workers', for its measurements) is read again
once its last reading is this old. Reading a process's PSS takes milliseconds (4 ms for a process
that imported torch, more as it holds more), in the user's loop, where a short epoch measures a
stretch every few tenths of a second; what a candidate holds changes far more slowly."""


@dataclass(frozen=True)
class EpochSettings:
    """The user's loader as one epoch serves it, copied when the epoch starts, as torch's iterator
    copies it (NOTE [ Serving state ])."""

    dataset: Any
    index_sampler: Any
    auto_collation: bool
    batch_size: int | None
    drop_last: bool
    collate_fn: Any
    timeout: float
    worker_init_fn: Any
    multiprocessing_context: Any
    pin_memory_device: str
    in_order: bool
    generator: torch.Generator | None
    length_asked: int | None
    """A stream's ``len(loader)``, once asked: torch warns when the stream yields more."""

    @classmethod
    def of(cls, loader: tud.DataLoader[Any]) -> EpochSettings:
        return cls(
            dataset=loader.dataset, index_sampler=loader._index_sampler,
            auto_collation=loader._auto_collation, batch_size=loader.batch_size,
            drop_last=loader.drop_last, collate_fn=loader.collate_fn, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn, multiprocessing_context=loader.multiprocessing_context,
            pin_memory_device=loader.pin_memory_device, in_order=loader.in_order,
            generator=loader.generator, length_asked=loader._IterableDataset_len_called,
        )

    def length(self) -> int:
        """``len(loader)`` as torch computes it (``TypeError`` where there is none), without marking
        a stream's length as asked: only the user's ``len(loader)`` does that, as with torch."""
        stream = isinstance(self.dataset, tud.IterableDataset)
        if not stream:
            return len(self.index_sampler)
        n = len(self.dataset)  # a stream without __len__ raises TypeError
        if self.batch_size is None:
            return n
        return n // self.batch_size if self.drop_last else math.ceil(n / self.batch_size)


class Held:
    """What a loader holds that must be let go: the settled configuration's inner loader (its
    persistent workers) and its place in the thread-count stack. Apart from the rest of the serving
    state, so that it can be released when the loader is collected."""

    def __init__(self) -> None:
        self.inner: Any = None
        self.candidate: Candidate | None = None
        """What ``inner`` was built for, the thread count aside."""
        self.sampler: FeedSampler | None = None
        self.prepared: pt.Prepared | None = None
        """The cache ``inner`` reads, or the dataset as it is."""

    def drop_inner(self) -> None:
        inner, self.inner, self.candidate, self.sampler, self.prepared = self.inner, None, None, None, None
        if inner is not None:
            stop_iterator(getattr(inner, "_iterator", None))

    def release(self) -> None:
        self.drop_inner()
        THREAD_COUNTS.release(id(self))


class Inner(NamedTuple):
    """The inner loader a stretch is served by."""

    loader: Any
    sampler: FeedSampler | None
    held: bool
    """Whether it is the held one (its workers outlive the stretch)."""
    prepared: pt.Prepared | None
    """The cache it reads (or the dataset as it is): a candidate's cache build is its cost."""


class LiveEpoch(Protocol):
    """A live iterator of the loader (``epochs.EpochIterator``), as the serving state knows it."""

    def finish(self) -> None: ...

    def finish_if_served(self) -> None: ...


def _nothing() -> None:
    pass


class Serving:
    """A drop-in loader's serving state (NOTE [ Serving state ]): made once by the loader, given to
    each of its epochs."""

    def __init__(self, tuning: Tuning, *, user_workers: int, user_prefetch: int, user_persistent: bool,
                 explore_timeout_s: float, on_settled: Callable[[], None] = _nothing) -> None:
        self.tuning = tuning
        self.user_workers = user_workers
        """Worker processes the user's own settings start (torch starts them in ``iter()``)."""
        self.user_prefetch = user_prefetch
        self.user_persistent = user_persistent
        """Whether the user's settings keep workers alive (torch keeps one iterator and resets it)."""
        self.explore_timeout_s = explore_timeout_s
        """The batch time limit of a candidate being explored."""
        self.on_settled = on_settled
        """Called each time the loader settles (the loader tells its listeners)."""
        self.held = Held()
        self.live: weakref.WeakSet[LiveEpoch] = weakref.WeakSet()
        """The loader's iterators whose epoch has not ended."""
        self.served_batches = 0
        self.seed_state: torch.Tensor | None = None
        """The generator's (or global RNG's) state before this epoch's base seed was drawn."""
        self.inner_loaders = 0
        """Inner loaders built in this epoch (each takes the base-seed draw one further)."""
        self.memory_read: dict[Candidate, tuple[float, int]] = {}
        """Each candidate's latest memory reading: when (monotonic), and the bytes."""

    @property
    def eager_start(self) -> bool:
        """Whether torch would start loading in ``iter()`` (worker processes written by the user)."""
        return self.user_workers > 0

    def memory(self, c: Candidate, workers: Callable[[], set[int]]) -> int:
        """What the main process and ``c``'s worker processes (``workers()``, alike) hold, read
        again once the last reading of ``c`` is MEMORY_REREAD_S old."""
        now = time.monotonic()
        read = self.memory_read.get(c)
        if read is None or now - read[0] >= MEMORY_REREAD_S:
            read = self.memory_read[c] = (now, process_memory(children=workers(), alike=True))
        return read[1]

    def live_iterators(self) -> int:
        return len(self.live)

    def finish_epochs(self) -> None:
        """End every live epoch (``close()``, or a run's end)."""
        for it in list(self.live):
            it.finish()

    def release(self) -> None:
        """Shut the held workers down and put back the torch thread count this loader changed."""
        self.held.release()

    def draw_base_seed(self, generator: torch.Generator | None, *, datapipe: bool) -> None:
        """A new iterator's base seed, drawn from the user's generator (or the global RNG) as torch's
        iterator draws it (a datapipe's shared seed first); the inner loaders start from the state
        before it (``_generator``)."""
        rng = generator if generator is not None else torch.default_generator
        self.seed_state = rng.get_state()
        self.inner_loaders = 0
        if datapipe:
            torch.empty((), dtype=torch.int64).random_(generator=generator)
        torch.empty((), dtype=torch.int64).random_(generator=generator)

    def settle(self, c: Candidate) -> None:
        """Serve ``c`` from now on: its thread count held, an inner loader kept for another let go."""
        self.apply_threads(c)
        if self.held.candidate is not None and self.held.candidate != replace(c, torch_threads=None):
            self.held.drop_inner()
        self.on_settled()

    def apply_threads(self, c: Candidate) -> None:
        """The torch thread count ``c`` was measured with, held for this loader (or let go)."""
        if c.torch_threads is not None:
            THREAD_COUNTS.hold(id(self.held), c.torch_threads)
        else:
            THREAD_COUNTS.release(id(self.held))

    def inner_for(self, c: Candidate, settings: EpochSettings, feed: Feed | None, limit: int | None, *,
                  measured: bool, baseline: bool, private: bool) -> Inner:
        """The inner loader serving ``c`` over up to ``limit`` items of ``feed`` (``None``: to the end).

        ``measured``: the stretch is measured for the search; ``baseline``: ``c`` is the baseline;
        ``private``: never the held loader (another iterator of the loader may be using it).
        """
        held = self.held
        if self.user_persistent:
            # The caller keeps its workers for the run, and torch keeps the same processes: so does
            # this loader, for every stretch (only the main process's thread count is searched).
            keep = not private
        else:
            keep = (limit is None and not measured and not private
                    and c == self.tuning.settled and c.persistent_workers)
        if keep:
            key = replace(c, torch_threads=None)
            if held.inner is None or held.candidate != key or (
                    held.prepared is not None and held.prepared.stale_reason() is not None):
                held.drop_inner()
                held.sampler = FeedSampler(feed)
                held.inner, held.prepared = self._build(c, settings, held.sampler, feed, limit,
                                                        explored=measured and not baseline)
                held.candidate = key
            else:
                self.apply_threads(c)
            assert held.sampler is not None
            held.sampler.feed, held.sampler.limit = feed, limit
            # A kept iterator is reset from its loader: the length torch warns against is the one
            # asked of this loader since (as _build carries it to a new one).
            held.inner._IterableDataset_len_called = settings.length_asked
            return Inner(held.inner, held.sampler, True, held.prepared)
        sampler = FeedSampler(feed, limit) if feed is not None else None
        inner, prepared = self._build(c, settings, sampler, feed, limit, explored=measured and not baseline)
        return Inner(inner, sampler, False, prepared)

    def _build(self, c: Candidate, settings: EpochSettings, sampler: FeedSampler | None, feed: Feed | None,
               limit: int | None, *, explored: bool) -> tuple[Any, pt.Prepared]:
        """A new inner loader for ``c``, serving from ``sampler``, and the cache it reads;
        ``explored``: a candidate being explored, dropped if a batch hangs."""
        self.apply_threads(c)
        if c.num_workers and limit is not None and (settings.in_order or c.threaded):
            c = replace(c, in_order=True)  # a measured stretch must know which items it handed out
        elif c.num_workers:
            # The user's in_order=False holds in measured stretches of worker processes too: one
            # ended early gives back what torch's iterator had not handed out (``Stretch.close``).
            c = replace(c, in_order=c.in_order and settings.in_order)
        t = self.tuning
        device = t.plan.device
        filling = t.filling_pass() if feed is not None else None
        if filling is not None and not filling.shared and c.num_workers and not c.threaded:
            filling = None  # in private memory: this process and its threads fill it, not workers
        if c.pretransform == "ram" or filling is not None:
            # The ram cache, filled by the samples this epoch loads anyway (NOTE [ Filling caches ]):
            # while it fills, every stretch loads through it; once full, a ram candidate reads it.
            prepared = pt.prepare(settings.dataset, "ram", device=device,
                                  memory_budget_bytes=t.plan.cache_budget(), fill="pass", warn_stale=False)
            t.filling = prepared
        else:
            # Every inner loader is made through prepare: a cache the dataset outgrew is rebuilt here,
            # and no loader of this one serves it stale, so the rebuild is no cause for a warning.
            prepared = pt.prepare(settings.dataset, c.pretransform, device=device,
                                  memory_budget_bytes=t.plan.cache_budget(), warn_stale=False)
        # The user's own timeout wins; the baseline and an unmeasured stretch wait as the user's loader
        # would; a candidate being explored is dropped after the batch time limit if it hangs.
        timeout = settings.timeout or (self.explore_timeout_s if explored else 0.0)
        kw: dict[str, Any] = {"worker_init_fn": settings.worker_init_fn,
                              "pin_memory_device": settings.pin_memory_device,
                              "generator": self._generator()}
        if c.processes:
            kw["multiprocessing_context"] = settings.multiprocessing_context
        if c.threaded:
            kw.pop("worker_init_fn")
        if isinstance(settings.dataset, tud.IterableDataset):
            kw.update(batch_size=settings.batch_size, drop_last=settings.drop_last)
        elif settings.auto_collation:
            kw["batch_sampler"] = sampler
        else:
            kw.update(batch_size=None, sampler=sampler)
        inner = build_loader(settings.dataset, c, device=device, shuffle=False,
                             collate_fn=settings.collate_fn, batch_timeout_s=timeout, prepared=prepared, **kw)
        # torch warns when a stream yields more than its len(), once len(loader) was asked: the
        # flag lives on the loader the user asked, so the inner one carries it over.
        inner._IterableDataset_len_called = settings.length_asked  # type: ignore[assignment]  # torch types it None
        return inner, prepared

    def _generator(self) -> torch.Generator:
        """A private generator whose first draw is the base seed the epoch drew, as torch's iterator
        would (so the first inner loader's workers are seeded as the user's own loader's would be);
        each later inner loader of the epoch starts one draw further. The user's RNGs are untouched."""
        g = torch.Generator()
        if self.seed_state is not None:
            g.set_state(self.seed_state)
        for _ in range(self.inner_loaders):
            torch.empty((), dtype=torch.int64).random_(generator=g)
        self.inner_loaders += 1
        return g

    # -- pickling: the state travels, what runs does not (as the loader's own pickling) ------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("held", "live", "on_settled", "memory_read"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self.held = Held()
        self.live = weakref.WeakSet()
        self.on_settled = _nothing
        self.memory_read = {}
