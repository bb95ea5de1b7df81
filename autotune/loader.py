"""The drop-in DataLoader: ``from autotune import DataLoader`` tunes itself inside the user's epochs.

# NOTE [ The drop-in's contract ]
# The loader is a torch.utils.data.DataLoader built by torch's own constructor with the arguments the
# user wrote (so torch's checks, messages, attributes, len() and warnings are torch's), and only its
# iteration differs, in speed alone:
# - the same items in the same order as torch for the same sampler, generator and seed, every epoch;
#   the generator and the global RNG advanced as torch advances them (a base seed drawn per new
#   iterator, the sampler drawn lazily; workers' random transforms draw from their own seeds, as
#   torch's workers do, so the draws a transform would have made in the main process are not made
#   there, and without a generator the next epoch's shuffle follows the state they leave);
# - iterators as torch's for the settings written: independent ones, or, with persistent workers
#   written, one that is reset; a second live iterator is served plainly and spoils no measurement;
# - no sample read in the main process when the user's own settings read in workers (num_workers > 0
#   written); otherwise the reads a cache's planning needs (a few probe samples) are the only extra;
# - nothing touched that the loader did not start: its inner loaders' workers are stopped by torch's
#   own shut-down, and the torch thread count is held as a stack (NOTE [ Thread count ] in measure.py);
# - a stream keeps the workers it was given (more would replay an IterableDataset that does not shard).
# How it tunes: NOTE [ Epochs and stretches ] (epochs.py), NOTE [ Online search ] (online.py), NOTE
# [ Decisions ] (decide.py) and NOTE [ Settled means proven ] (tuning.py).
#
# NOTE [ Untuned ]
# Torch's constructor runs first, with the arguments as written: what it refuses is refused with its
# own error. Then autotune's own arguments are checked (a mistake there is raised at once). What
# torch accepts but the tuner cannot plan for (an empty dataset, a map-style dataset without
# ``__len__`` given a sampler, a worker count torch only refuses when it iterates, a ``__len__`` that
# raises) makes an untuned loader: ``loader.untuned`` says why, ``loader.tuning`` is ``None``, and
# every epoch is torch's own iterator, so torch's leniencies and torch's errors, where and when torch
# raises them, are the user's, unchanged.
#
# NOTE [ Exploring under torchrun ]
# Every rank has its own drop-in over its DistributedSampler shard, and their workers share the node's
# CPUs, so the ranks explore together (as tune_loader tunes cooperatively, NOTE [ Cooperative tuning ]
# in distributed.py): the worker bound is per rank; rank 0's space and cache estimate are broadcast;
# stretches have a fixed length in items and are served whole (no early end, no abandoning), so every
# rank ends each stretch at the same point of the epoch; there the outcomes are gathered and reduced
# (the slowest rank decides, a failure on any rank is a failure for all), so every rank's explorer sees
# the same records and makes the same choices; rank 0 alone writes the profile, and the checks after
# each settled epoch take the slowest rank's figures. This assumes, as DDP does, that every rank runs
# the same loop over the same number of items per epoch.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
import warnings
import weakref
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from typing import Any, TypeVar

import torch
import torch.utils.data as tud

from . import preflight
from . import pretransform as pt
from .describe import dataset_length
from .epochs import EpochIterator
from .exceptions import ConfigurationError
from .plan import baseline_candidate, make_plan
from .result import DEFAULT_EPOCHS, TuneResult, build_loaders_with
from .serving import Serving
from .space import Candidate
from .supervise import interrupt_held
from .threads import PINNED_WITHOUT_ACCELERATOR
from .tuning import Fixed, Tuning

T_co = TypeVar("T_co", covariant=True)

log = logging.getLogger("autotune")

AUTO = "auto"
"""Pass this for a setting to have it tuned even where passing nothing would not."""

EXPLORE_BATCH_TIMEOUT_S = 20.0
"""While exploring, a candidate whose next batch takes longer than this has hung and is dropped
(``batch_timeout_s`` overrides it; the baseline and the settled configuration wait as the user's
loader would)."""

MIN_TUNE_BATCHES = 12
"""A loader that never served this many batches is reported as too short to tune."""

_NOT_GIVEN: Any = object()
"""The default of a tunable argument: it was not given, so it is tuned."""


TUNABLE = ("num_workers", "pin_memory", "prefetch_factor", "persistent_workers")
"""The torch arguments the drop-in tunes unless they are written."""


@dataclass(frozen=True)
class Written:
    """The tunable settings the caller wrote: the one name for them.

    ``settings``: each one written, as written (``"auto"`` included); ``given``: those given a value
    (``"auto"`` left out), as torch's constructor takes them; ``read()``: those values as torch reads
    them (a worker count of True is one worker, a flag its truth value).
    """

    settings: dict[str, Any]

    @classmethod
    def of(cls, **arguments: Any) -> Written:
        """From the constructor's arguments (an argument left at its default was not written)."""
        settings = {k: v for k, v in arguments.items() if v is not _NOT_GIVEN}
        for name, value in settings.items():
            if isinstance(value, str) and value != AUTO and name in ("num_workers", "prefetch_factor"):
                raise ConfigurationError(
                    f"{name}={value!r} is not a setting; pass a value, or {AUTO!r} to have it tuned.")
        return cls(settings)

    @property
    def given(self) -> dict[str, Any]:
        return {k: v for k, v in self.settings.items() if v != AUTO}

    def read(self) -> dict[str, Any]:
        values = self.given
        for name in ("pin_memory", "persistent_workers"):
            if name in values:
                values[name] = bool(values[name])
        if isinstance(values.get("num_workers"), bool):
            values["num_workers"] = int(values["num_workers"])
        return values


class Listener:
    """Told about every drop-in loader of this process (``autotune run`` reports with it)."""

    def built(self, loader: DataLoader) -> None:
        """``loader`` was just constructed."""

    def settled(self, loader: DataLoader) -> None:
        """``loader`` finished exploring, or found its profile: then inside its constructor, before
        :meth:`built`; it serves its best configuration from now on."""


_listeners: list[Listener] = []


def add_listener(listener: Listener) -> None:
    _listeners.append(listener)


def remove_listener(listener: Listener) -> None:
    with contextlib.suppress(ValueError):
        _listeners.remove(listener)


def _notify(event: str, loader: DataLoader) -> None:
    for listener in list(_listeners):
        with contextlib.suppress(Exception):
            getattr(listener, event)(loader)


class DataLoader(tud.DataLoader[T_co]):
    """``torch.utils.data.DataLoader`` that tunes itself while you train (NOTE [ The drop-in's contract ]).

    Takes every argument torch's DataLoader takes. ``num_workers``, ``pin_memory`` and
    ``prefetch_factor`` are tuned unless you pass them (pass ``"auto"`` to have a passed one tuned
    too); workers are kept alive between epochs only where you pass ``persistent_workers`` (``True``,
    or ``"auto"`` to have it tried), since kept workers would not see changes to the dataset;
    ``batch_size``, ``shuffle``, samplers, ``collate_fn``, ``drop_last``
    and everything else are yours and never change. What you pass is also the baseline every
    configuration is measured against: one replaces it only when it is faster with confidence.
    autotune's own keyword arguments:

    Args:
        pretransform: ``"auto"`` (every cache strategy that applies), ``"none"``, or names, as for
            :func:`autotune.tune_loader`.
        torch_threads: the main process's torch thread count, tuned (``"auto"``), fixed (an int), or
            left as it is (``None``).
        device: where your step runs (decides ``pin_memory`` and the ``device`` cache); ``None``:
            CUDA when available.
        epochs: the training length that worker start-up, a cache build and exploring are weighed
            against.
        cache, cache_dir, storage, retune: the profile store, as for :func:`autotune.tune_loader`.
        batch_timeout_s: a candidate whose next batch takes longer than this has hung and is dropped.

    ``loader.tuning`` is a :class:`~autotune.TuneResult` once a configuration has been measured.
    ``close()`` (or leaving a ``with`` block) shuts the workers down and restores the torch thread
    count; the loader also does that when it is collected.
    """

    explicit_settings_are_fixed: bool = True
    """Whether the tunable settings the caller passes are fixed (True) or starting points (False)."""

    default_epochs: int = DEFAULT_EPOCHS
    """``epochs`` when the caller gives none (``autotune run --epochs`` sets it for a script)."""

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int | str = _NOT_GIVEN,
        collate_fn: Callable[[Any], Any] | None = None,
        pin_memory: bool | str = _NOT_GIVEN,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | str | None = _NOT_GIVEN,
        persistent_workers: bool | str = _NOT_GIVEN,
        pin_memory_device: str = "",
        in_order: bool = True,
        pretransform: str | Sequence[str] = AUTO,
        torch_threads: int | str | None = AUTO,
        device: str | torch.device | None = None,
        epochs: int | None = None,
        cache: bool = True,
        cache_dir: str | None = None,
        storage: str | None = None,
        retune: bool = False,
        batch_timeout_s: float | None = None,
        _configured: Candidate | None = None,
        _written: Written | None = None,
    ) -> None:
        written = Written.of(num_workers=num_workers, pin_memory=pin_memory, prefetch_factor=prefetch_factor,
                             persistent_workers=persistent_workers)
        self.script_settings = dict(written.settings)
        """The tunable settings as the caller wrote them (``autotune run`` reports them)."""
        given = written.given
        workers_needed = (multiprocessing_context is not None or given.get("prefetch_factor") is not None
                          or bool(given.get("persistent_workers")))
        auto_workers = written.settings.get("num_workers") == AUTO
        # torch's own constructor, with what the user wrote: its checks, messages and attributes.
        super().__init__(
            dataset, batch_size, shuffle, sampler, batch_sampler,
            given.get("num_workers", 1 if workers_needed and auto_workers else 0),
            collate_fn, given.get("pin_memory", False), drop_last, timeout, worker_init_fn,
            multiprocessing_context, generator, prefetch_factor=given.get("prefetch_factor"),
            persistent_workers=given.get("persistent_workers", False),
            pin_memory_device=pin_memory_device, in_order=in_order,
        )
        self._origin = _origin()
        self._epoch_iterator: weakref.ref[EpochIterator] | None = None
        """The iterator torch would keep with persistent workers (held weakly: the iterator holds
        the loader, and a cycle would keep the workers alive until the garbage collector ran)."""
        self._iterated = False
        # What the caller wrote decides torch's iteration semantics (its workers start in iter(), a
        # base seed per new iterator, one iterator reset with persistent workers); a loader built
        # from a result (``configured``) shows the tuned settings but iterates as its caller wrote.
        iterates_as = (written if _written is None else _written).read()
        user_workers = _workers(iterates_as.get("num_workers", 0))
        # autotune's own arguments: a mistake in them is the caller's to see, at once.
        _check_own(torch_threads=torch_threads, pretransform=pretransform, epochs=epochs, device=device,
                   batch_timeout_s=batch_timeout_s)
        self.untuned: str | None = None
        """Why this loader serves exactly as torch's does and tunes nothing (NOTE [ Untuned ]), or
        ``None``."""
        self._serving: Serving | None = None
        """What its epochs serve with (NOTE [ Serving state ] in serving.py); ``None`` where it is
        untuned."""
        try:
            self._tuning: Tuning = self._make_tuning(
                dataset, written, torch_threads, batch_size=batch_size, shuffle=shuffle,
                sampler=sampler, collate_fn=collate_fn, worker_init_fn=worker_init_fn,
                multiprocessing_context=multiprocessing_context, pretransform=pretransform,
                device=device, epochs=epochs, cache=cache, cache_dir=cache_dir, storage=storage,
                batch_timeout_s=batch_timeout_s, configured=_configured, user_workers=user_workers)
        except Exception as err:  # noqa: BLE001 - NOTE [ Untuned ]: torch's iteration raises its own
            self.untuned = f"{type(err).__name__}: {err}"
            log.debug("autotune: the loader at %s is served as torch serves it, untuned: %s",
                      self._origin, self.untuned)
        else:
            serving = self._serving = Serving(
                self._tuning, user_workers=user_workers,
                user_prefetch=int(iterates_as.get("prefetch_factor") or 2),
                user_persistent=bool(iterates_as.get("persistent_workers")) and user_workers > 0,
                explore_timeout_s=(batch_timeout_s if batch_timeout_s is not None
                                   else EXPLORE_BATCH_TIMEOUT_S),
                on_settled=_announce_settled(self))
            # Collected without close(): the workers still go and the thread count is still put back.
            weakref.finalize(self, serving.release)
            if _configured is not None:
                self._tuning.settle_from_profile(None, _configured)
                serving.settle(_configured)
            elif not retune:
                hit = self._tuning.lookup()
                if hit is not None:
                    self._tuning.settle_from_profile(hit, hit.candidate)
                    serving.settle(hit.candidate)
        _notify("built", self)

    def _make_tuning(self, dataset: Any, written: Written,
                     torch_threads: int | str | None, *, batch_size: int | None, shuffle: bool | None,
                     sampler: Any, collate_fn: Any, worker_init_fn: Any, multiprocessing_context: Any,
                     pretransform: str | Sequence[str], device: Any, epochs: int | None, cache: bool,
                     cache_dir: str | None, storage: str | None, batch_timeout_s: float | None,
                     configured: Candidate | None, user_workers: int) -> Tuning:
        """The loader's tuning state: its settings checked, its plan made, its baseline."""
        if dataset_length(dataset) == 0:
            raise ConfigurationError("the dataset is empty: there is nothing to measure")
        values = written.read()
        fixed = _fixed(values if self.explicit_settings_are_fixed else {}, torch_threads)
        if "persistent_workers" not in written.settings:
            # NOTE [ Speed only ]: torch's workers start afresh every epoch and see the dataset as
            # the main process left it (an attribute, a swapped transform, a tensor changed in
            # place, a worker_init_fn run again); workers kept alive would not. Nothing proves a
            # dataset unchanged between epochs, so they are kept alive only where the caller asks.
            fixed = replace(fixed, persistent_workers=False)
        if fixed.persistent_workers and fixed.num_workers:
            # Workers the caller keeps alive see the dataset as it was when they started, and torch
            # never restarts them: what would need new workers is not searched.
            fixed = replace(fixed, pin_memory=bool(values.get("pin_memory", False)),
                            prefetch_factor=values.get("prefetch_factor") or 2)
            pretransform = "none"
        if configured is not None:
            fixed = replace(fixed, torch_threads=configured.torch_threads,
                            leave_threads=configured.torch_threads is None)
        plan = make_plan(
            dataset, None, batch_size=_plan_batch_size(dataset, batch_size), budget_s=None,
            device=device, epochs=self.default_epochs if epochs is None else epochs,
            pretransform=pretransform,
            max_workers=fixed.num_workers if fixed.num_workers else None, memory_budget_bytes=None,
            batch_timeout_s=batch_timeout_s, shuffle=bool(shuffle) or sampler is not None,
            collate_fn=collate_fn, seed=0, fixed=fixed.to_dict(), persistent=fixed.persistent_workers,
            read_samples=False, multiprocessing_context=multiprocessing_context, stacklevel=4,
        )
        baseline = replace(baseline_candidate(
            {**{k: v for k, v in values.items() if k != "prefetch_factor" or v is not None},
             "batch_size": batch_size or 1, "in_order": True}, batch_size or 1),
            torch_threads=fixed.torch_threads)
        # With ``explicit_settings_are_fixed=False`` (``autotune run``) the script's settings are the
        # baseline, measured first and searched around; otherwise what is written is fixed as well.
        return Tuning(
            plan, fixed, baseline,
            store_args=({"cache_dir": cache_dir, "storage": storage}
                        if cache and configured is None else None),
            origin=self._origin,
            # Samples are read in the main process only where the user's loader reads them there,
            # or where that changes nothing the workers read (pt.reads_alike_anywhere); a
            # worker_init_fn may set up state in the workers that the cache's wrapper would hide.
            reads_in_main=(user_workers == 0 or not self.explicit_settings_are_fixed
                           or (worker_init_fn is None and pt.reads_alike_anywhere(dataset))),
            # A worker_init_fn runs in worker processes; a dataset that sets the process's random
            # state per sample (the plan reads its code) would race with itself on threads.
            threads_allowed=worker_init_fn is None and plan.max_threads != 0,
        )

    @classmethod
    def configured(cls, dataset: Any, candidate: Candidate, *, device: str | torch.device | None = None,
                   **kwargs: Any) -> DataLoader[Any]:
        """A loader fixed to ``candidate`` (it explores nothing); torch arguments in ``kwargs`` win.

        What :meth:`from_result` builds. A tunable torch argument in ``kwargs``
        (``num_workers``, ``pin_memory``, ``prefetch_factor``, ``persistent_workers``) replaces the
        candidate's: ``num_workers`` makes them worker processes, as a plain DataLoader would start.
        """
        c = candidate
        written = Written.of(**{k: v for k, v in kwargs.items() if k in TUNABLE})
        if kwargs.get("worker_init_fn") is not None:
            # It runs in each worker process, every epoch unless the caller keeps workers alive:
            # threads cannot run it as torch does, and kept workers would skip its later calls.
            if c.threaded:
                c = replace(c, worker_kind="process")
            if "persistent_workers" not in written.settings:
                c = replace(c, persistent_workers=False)
        if "num_workers" in kwargs:
            n = kwargs.pop("num_workers")
            c = replace(c, num_workers=n, worker_kind="process", in_order=True,
                        prefetch_factor=(c.prefetch_factor or 2) if n else None,
                        persistent_workers=bool(n) and c.persistent_workers)
        for name in ("pin_memory", "prefetch_factor", "persistent_workers"):
            if name in kwargs:
                c = replace(c, **{name: kwargs.pop(name)})
        if "in_order" in kwargs:
            c = replace(c, in_order=bool(kwargs.pop("in_order")))
        kwargs.setdefault("batch_size", c.batch_size)
        c = replace(c, batch_size=kwargs["batch_size"] if kwargs["batch_size"] is not None else 1)
        # Written as a user would write them, so the loader's attributes say what it runs.
        processes = c.num_workers if not c.threaded else 0
        kwargs.update(num_workers=processes, pin_memory=c.pin_memory)
        if processes:
            kwargs.update(prefetch_factor=c.prefetch_factor, persistent_workers=c.persistent_workers,
                          in_order=c.in_order)
        return cls(dataset, pretransform=c.pretransform, device=device, cache=False,
                   torch_threads=c.torch_threads, _configured=c, _written=written, **kwargs)

    @classmethod
    def from_result(cls, result: TuneResult, dataset: Any, **overrides: Any) -> DataLoader[Any]:
        """A loader with ``result``'s settings, as measured; ``overrides`` win (``shuffle=True`` etc.).

        What :meth:`autotune.TuneResult.make_loader` returns: a loader fixed to the result (it
        explores nothing), built by the same builder the search measured with (:meth:`configured`).
        """
        return cls.configured(dataset, result.candidate, device=result.device, **overrides)

    # -- public ------------------------------------------------------------------------------------

    @property
    def tuning(self) -> TuneResult | None:
        """What was tried and chosen (``None`` before the first measurement)."""
        return self._tuning.partial_result() if self.untuned is None else None

    @property
    def origin(self) -> str:
        """``file:line`` where the loader was built."""
        return self._origin

    @property
    def settled(self) -> bool:
        """Whether exploration is over and the best configuration is being served."""
        if self.untuned is not None:
            return False
        return self._tuning.serving_settled

    @property
    def served_batches(self) -> int:
        return self._serving.served_batches if self._serving is not None else 0

    def close(self) -> None:
        """Shut the workers down and put back the torch thread count this loader changed."""
        self._finish_epoch()
        if self._serving is not None:
            self._serving.release()

    def _finish_epoch(self) -> None:
        if self._serving is not None:
            self._serving.finish_epochs()

    def __enter__(self) -> DataLoader[T_co]:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # -- iteration (torch's _get_iterator idiom) ---------------------------------------------------

    def __iter__(self) -> Any:
        serving = self._serving
        if serving is None:  # NOTE [ Untuned ]
            return super().__iter__()
        if serving.user_persistent:  # torch keeps one iterator and resets it
            it = self._epoch_iterator() if self._epoch_iterator is not None else None
            if it is None:
                it = self._get_iterator()
                self._epoch_iterator = weakref.ref(it)
            else:
                it._reset(self)
            return it
        return self._get_iterator()

    def _get_iterator(self) -> Any:
        serving = self._serving
        if serving is None:  # NOTE [ Untuned ]: torch's own iterator, as torch makes it, except
            with interrupt_held():  # that a Ctrl-C while its workers start is not lost (supervise.py)
                return super()._get_iterator()
        if serving.user_workers > 0:
            self.check_worker_number_rationality()  # torch's warning, where torch gives it
        if self.pin_memory and not torch.accelerator.is_available():
            # torch's warning at each iterator's start; the stretches themselves never pin here
            warnings.warn(PINNED_WITHOUT_ACCELERATOR, stacklevel=3)
        # With persistent workers written, one iterator is reset from epoch to epoch and torch draws
        # its base seed once: an iterator made again (the last one was dropped) draws none either.
        fresh = not (serving.user_persistent and self._iterated)
        self._iterated = True
        return EpochIterator(self, serving, fresh=fresh)

    # -- pickling: the configuration travels, the running state does not -------------------------

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        for name in ("_iterator", "_epoch_iterator"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._epoch_iterator = None
        if self._serving is not None:  # its pickling keeps its state and drops what runs
            self._serving.on_settled = _announce_settled(self)
            weakref.finalize(self, self._serving.release)


def _announce_settled(loader: DataLoader[Any]) -> Callable[[], None]:
    """Tells the listeners that ``loader`` settled, holding it weakly (NOTE [ Serving state ] in
    serving.py)."""
    ref = weakref.ref(loader)

    def announce() -> None:
        settled = ref()
        if settled is not None:
            _notify("settled", settled)

    return announce


build_loaders_with(DataLoader.from_result)  # NOTE [ A result's loader ] in result.py


def _origin() -> str:
    """``file:line`` of the user's code that built the loader (the first frame outside autotune)."""
    here = os.path.dirname(os.path.abspath(__file__))
    torch_dir = os.path.dirname(os.path.abspath(torch.__file__))
    frame = inspect.currentframe()
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith((here, torch_dir)) and "<frozen" not in path:
            rel = os.path.relpath(path)
            return f"{rel if not rel.startswith('..') else path}:{frame.f_lineno}"
        frame = frame.f_back
    return "?"


def _plan_batch_size(dataset: Any, batch_size: int | None) -> int:
    """The batch size as the plan sees it: torch serves a batch larger than the dataset as one
    short batch, and so does this loader, so the plan's check must not refuse it."""
    n = dataset_length(dataset)
    size = batch_size if batch_size is not None else 1
    return min(size, n) if n else size


def _workers(value: Any) -> int:
    """The worker count torch starts for ``value`` (one it cannot take starts none here: its own
    iteration raises then, NOTE [ Untuned ])."""
    return int(value) if isinstance(value, int) and value > 0 else 0


def _check_own(*, torch_threads: int | str | None, pretransform: str | Sequence[str], epochs: int | None,
               device: Any, batch_timeout_s: float | None) -> None:
    """autotune's own arguments, checked with a clear error (torch checks its own)."""
    if torch_threads not in (AUTO, None) and (
            isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1):
        raise ConfigurationError(
            f"torch_threads={torch_threads!r} must be a positive integer, or {AUTO!r} to have it"
            " tuned, or None to leave it as it is.")
    if epochs is not None and (isinstance(epochs, bool) or not isinstance(epochs, int) or epochs < 1):
        raise ConfigurationError(
            f"epochs={epochs!r} must be a positive integer: the number of epochs you will train.")
    preflight.resolve_pretransforms(pretransform)
    preflight.resolve_device(device)
    if batch_timeout_s is not None:
        preflight.check_number("batch_timeout_s", batch_timeout_s, minimum=0,
                               fix="give the longest a single batch may take, in seconds, or None.")


def _fixed(values: dict[str, Any], torch_threads: int | str | None) -> Fixed:
    """The settings the caller fixed (``Written.read``), checked, with a clear error (torch checks
    the rest)."""
    for name, value in values.items():
        if name == "num_workers":
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ConfigurationError(
                    f"num_workers={value!r} must be a non-negative integer, or {AUTO!r} to have it"
                    " tuned; use num_workers=0 to load in the main process.")
        elif name == "prefetch_factor":
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ConfigurationError(
                    f"prefetch_factor={value!r} must be a positive integer, None, or {AUTO!r}.")
        elif not isinstance(value, bool):
            raise ConfigurationError(f"{name}={value!r} must be True or False, or {AUTO!r}.")
    threads: int | None = None
    if torch_threads not in (AUTO, None):
        if isinstance(torch_threads, bool) or not isinstance(torch_threads, int) or torch_threads < 1:
            raise ConfigurationError(
                f"torch_threads={torch_threads!r} must be a positive integer, or {AUTO!r} to have it"
                " tuned, or None to leave it as it is.")
        threads = torch_threads
    return Fixed(
        num_workers=values.get("num_workers"), pin_memory=values.get("pin_memory"),
        prefetch_factor=values.get("prefetch_factor"), persistent_workers=values.get("persistent_workers"),
        torch_threads=threads, leave_threads=torch_threads is None,
    )
