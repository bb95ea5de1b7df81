"""The drop-in's inner loaders: the loader each stretch of an epoch is served by (built by the
search's own builder, ``measure.build_loader``), and the one a loader keeps for the run.

An inner loader is torch's ``DataLoader`` (or a ``ThreadDataLoader``) over the user's dataset, fed
the epoch's indices by a :class:`~autotune.epochs.FeedSampler`; the user's own settings reach it as
torch would apply them (timeout, worker_init_fn, context, pin-memory device, the epoch's base seed).
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING, Any

import torch
import torch.utils.data as tud

from . import pretransform as pt
from .epochs import FeedSampler, Stretch
from .measure import THREAD_COUNTS, build_loader
from .space import Candidate
from .supervise import stop_iterator

if TYPE_CHECKING:
    from .loader import DataLoader


class Held:
    """What a loader holds that must be let go: the settled configuration's inner loader (its
    persistent workers) and its place in the thread-count stack. Apart from the loader, so that it
    can be released when the loader is collected."""

    def __init__(self) -> None:
        self.inner: Any = None
        self.inner_for: Candidate | None = None
        self.sampler: FeedSampler | None = None

    def drop_inner(self) -> None:
        inner, self.inner, self.inner_for, self.sampler = self.inner, None, None, None
        if inner is not None:
            stop_iterator(getattr(inner, "_iterator", None))

    def release(self) -> None:
        self.drop_inner()
        THREAD_COUNTS.release(id(self))


def apply_threads(loader: DataLoader[Any], c: Candidate) -> None:
    """The torch thread count ``c`` was measured with, held for this loader (or let go)."""
    if c.torch_threads is not None:
        THREAD_COUNTS.hold(id(loader._held), c.torch_threads)
    else:
        THREAD_COUNTS.release(id(loader._held))


def inner_for(loader: DataLoader[Any], stretch: Stretch) -> tuple[Any, FeedSampler | None, bool]:
    """(inner loader, its sampler, whether it is the held one) for ``stretch``."""
    c = stretch.candidate
    held = loader._held
    if loader._user_persistent:
        # The caller keeps its workers for the run, and torch keeps the same processes: so does
        # this loader, for every stretch (only the main process's thread count is searched).
        keep = not stretch.private
    else:
        keep = (stretch.limit is None and stretch.phase is None and not stretch.private
                and c == loader._tuning.settled and c.persistent_workers)
    if keep:
        key = replace(c, torch_threads=None)
        prepared = getattr(held.inner, "_autotune_prepared", None)
        if held.inner is None or held.inner_for != key or (
                prepared is not None and prepared.stale_reason() is not None):
            held.drop_inner()
            held.sampler = FeedSampler(stretch.feed)
            held.inner, held.inner_for = build_inner(loader, c, held.sampler, stretch), key
        else:
            apply_threads(loader, c)
        assert held.sampler is not None
        held.sampler.feed, held.sampler.limit = stretch.feed, stretch.limit
        # A kept iterator is reset from its loader: the length torch warns against is the one
        # asked of this loader since (as build_inner carries it to a new one).
        held.inner._IterableDataset_len_called = loader._IterableDataset_len_called
        return held.inner, held.sampler, True
    sampler = FeedSampler(stretch.feed, stretch.limit) if stretch.feed is not None else None
    return build_inner(loader, c, sampler, stretch), sampler, False


def build_inner(loader: DataLoader[Any], c: Candidate, sampler: FeedSampler | None,
                stretch: Stretch) -> Any:
    """A new inner loader for ``c``, serving ``stretch`` from ``sampler``."""
    apply_threads(loader, c)
    if c.num_workers and stretch.limit is not None:
        c = replace(c, in_order=True)  # a measured stretch must know which items it handed out
    elif c.num_workers:
        c = replace(c, in_order=c.in_order and loader.in_order)
    device = loader._tuning.plan.device
    t = loader._tuning
    filling = t.filling_pass() if stretch.feed is not None else None
    if filling is not None and not filling.shared and c.num_workers and not c.threaded:
        filling = None  # in private memory: this process and its threads fill it, not workers
    if c.pretransform == "ram" or filling is not None:
        # The ram cache, filled by the samples this epoch loads anyway (NOTE [ Filling caches ]):
        # while it fills, every stretch loads through it; once full, a ram candidate reads it.
        prepared = pt.prepare(loader.dataset, "ram", device=device,
                              memory_budget_bytes=t.plan.cache_budget(), fill="pass", warn_stale=False)
        t.filling = prepared
    else:
        # Every inner loader is made through prepare: a cache the dataset outgrew is rebuilt here,
        # and no loader of this one serves it stale, so the rebuild is no cause for a warning.
        prepared = pt.prepare(loader.dataset, c.pretransform, device=device,
                              memory_budget_bytes=t.plan.cache_budget(), warn_stale=False)
    # The user's own timeout wins; the baseline and an unmeasured stretch wait as the user's loader
    # would; a candidate being explored is dropped after the batch time limit if it hangs.
    measured_candidate = stretch.phase is not None and not stretch.baseline
    timeout = loader.timeout or (loader._explore_timeout_s if measured_candidate else 0.0)
    kw: dict[str, Any] = {"worker_init_fn": loader.worker_init_fn,
                          "pin_memory_device": loader.pin_memory_device,
                          "generator": inner_generator(loader)}
    if c.num_workers and c.worker_kind == "process":
        kw["multiprocessing_context"] = loader.multiprocessing_context
    if c.threaded:
        kw.pop("worker_init_fn")
    if isinstance(loader.dataset, tud.IterableDataset):
        kw.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader._auto_collation:
        kw["batch_sampler"] = sampler
    else:
        kw.update(batch_size=None, sampler=sampler)
    inner = build_loader(loader.dataset, c, device=device, shuffle=False, collate_fn=loader.collate_fn,
                         batch_timeout_s=timeout, prepared=prepared, **kw)
    inner._autotune_prepared = prepared
    # torch warns when a stream yields more than its len(), once len(loader) was asked: the
    # flag lives on the loader the user asked, so the inner one carries it over.
    inner._IterableDataset_len_called = loader._IterableDataset_len_called
    return inner


def inner_generator(loader: DataLoader[Any]) -> torch.Generator:
    """A private generator whose first draw is the base seed the epoch drew, as torch's iterator
    would (so the first inner loader's workers are seeded as the user's own loader's would be);
    each later inner loader of the epoch starts one draw further. The user's RNGs are untouched."""
    g = torch.Generator()
    if loader._seed_state is not None:
        g.set_state(loader._seed_state)
    for _ in range(loader._inner_loaders):
        torch.empty((), dtype=torch.int64).random_(generator=g)
    loader._inner_loaders += 1
    return g
