"""Thread workers: :class:`ThreadDataLoader`, a DataLoader that loads batches on a few threads.

# NOTE [ Thread workers ]
# Worker processes pay for what threads do not: a start per worker, the dataset pickled under
# ``spawn``, every batch copied through shared memory, memory per process, and no CUDA tensors at all.
# Where the per-sample work releases the GIL (PIL decoding and resizing, torch tensor ops, reads from
# storage), threads in the main process overlap it with the training step just as well.
#
# ``ThreadDataLoader`` is a ``torch.utils.data.DataLoader`` whose ``num_workers`` stays 0 (so torch's
# own checks and everything that reads the attribute see the truth: no worker processes). Its
# iterator hands index lists from the loader's own batch sampler to ``worker_threads`` threads, which
# fetch them with torch's own map-style fetcher (``__getitems__`` where the dataset has it, else
# ``dataset[i]`` per index) and the loader's ``collate_fn``, pin the batch when asked, and put it on
# a result queue. At most ``worker_threads * prefetch_per_thread`` batches are in flight or waiting.
# In order, batch k is handed out only after batches 0..k-1; out of order (``in_order=False``), each
# as soon as it is ready, so one slow sample does not hold back the batches behind it.
#
# Every wait polls (THREAD_POLL_S) and has a limit: the loader's ``timeout`` bounds the wait for a
# batch as it does for worker processes. An exception in a thread is re-raised in the caller, same
# type where possible, with the thread's traceback in the message (as torch does for processes).
# The threads are stopped and joined when the iterator is exhausted, closed, collected or leaves
# ``__next__`` by any exception (Ctrl-C included). A thread cannot be killed: one stuck inside the
# dataset (a read that never returns) is a daemon thread, left behind with a warning, that ends
# when that call returns (it then takes no new work) or with the process.
#
# Why not torchdata.nodes: ``ParallelMapper(method="thread")``, ``Prefetcher`` and ``PinMemory`` do
# this job, and measured side by side with the same settings over five workloads they were on par
# with this pool (benchmarks/results/parallelism/PARALLELISM.md). But autotune's required
# dependencies are torch, torchvision, optuna and psutil, and a second code path used only when
# torchdata happens to be installed would mean that what the search measured is not always what the
# user gets. The pool below is small, uses only public DataLoader attributes plus torch's fetcher,
# and is tested against every configuration the search can produce, including being collected from
# one of its own threads (torchdata.nodes 0.11's ParallelMapper raised "cannot join current thread"
# there in the benchmark).
#
# Randomness: transforms in the threads draw from the process-wide RNGs in whatever order the threads
# run, so a seed fixes the sample order (the sampler's generator) but not the augmentation, as with
# several worker processes.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import DataLoader, IterableDataset
from torch.utils.data._utils.pin_memory import pin_memory
from torch.utils.data.dataloader import _DatasetKind

from .exceptions import ConfigurationError

log = logging.getLogger(__name__)

DEFAULT_WORKER_THREADS = 2
"""Threads when the caller does not say: enough to overlap loading with the step on any machine."""

DEFAULT_PREFETCH_PER_THREAD = 2
"""Batches each thread keeps ready, like DataLoader's default ``prefetch_factor``."""

THREAD_POLL_S = 0.05
"""How often a waiting iterator or an idle thread looks whether it should stop."""

THREAD_JOIN_TIMEOUT_S = 2.0
"""How long closing waits for the threads to finish the batch in hand, before leaving them behind."""

THREAD_NAME_PREFIX = "autotune-thread-worker"
"""Every worker thread's name starts with this (tests and ``threading.enumerate()`` look for it)."""


def _positive_int(name: str, value: Any, fix: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigurationError(f"{name}={value!r} must be a positive integer; {fix}")
    return value


PINNED_WITHOUT_ACCELERATOR = ("'pin_memory' argument is set as true but no accelerator is found, then device"
                              " pinned memory won't be used.")
"""torch's warning, word for word, at each iterator's start where ``pin_memory=True`` cannot pin."""


class ThreadDataLoader(DataLoader[Any]):
    """A DataLoader whose batches are loaded by ``worker_threads`` threads (see NOTE [ Thread workers ]).

    Takes every ``torch.utils.data.DataLoader`` argument except the ones about worker processes
    (``num_workers`` must be 0, ``prefetch_factor``, ``persistent_workers`` and ``worker_init_fn``
    do not apply), plus ``worker_threads`` and ``prefetch_per_thread``. ``in_order=False`` hands
    out each batch as soon as it is ready. Map-style datasets only.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        *,
        worker_threads: int = DEFAULT_WORKER_THREADS,
        prefetch_per_thread: int = DEFAULT_PREFETCH_PER_THREAD,
        **kwargs: Any,
    ) -> None:
        if isinstance(dataset, IterableDataset):
            raise ConfigurationError(
                f"ThreadDataLoader needs a map-style dataset; {type(dataset).__name__} is an"
                " IterableDataset. Use torch.utils.data.DataLoader with num_workers for a stream."
            )
        if kwargs.get("num_workers", 0) != 0:
            raise ConfigurationError(
                f"num_workers={kwargs['num_workers']!r}: ThreadDataLoader starts no worker processes;"
                " set the thread count with worker_threads= and leave num_workers at 0."
            )
        for name, fix in (
            ("prefetch_factor", "use prefetch_per_thread= for the batches each thread keeps ready"),
            ("persistent_workers", "threads start in microseconds, so there is nothing to keep"),
            ("worker_init_fn", "it runs in worker processes; threads share the main process as is"),
        ):
            if kwargs.get(name) not in (None, False):
                raise ConfigurationError(
                    f"{name}={kwargs[name]!r} does not apply to thread workers; {fix}."
                )
            kwargs.pop(name, None)
        self.worker_threads = _positive_int(
            "worker_threads", worker_threads, "pass how many threads load batches, e.g. 2.")
        self.prefetch_per_thread = _positive_int(
            "prefetch_per_thread", prefetch_per_thread, "pass how many batches each thread keeps ready.")
        super().__init__(dataset, batch_size, shuffle, **kwargs)

    def __iter__(self) -> _ThreadLoaderIter:  # type: ignore[override]
        return _ThreadLoaderIter(self)


class _Pool:
    """The threads and their queues. Holds no reference to the iterator, so the iterator can be
    collected (and its finaliser stop the pool) while the threads run."""

    def __init__(self, fetch: Callable[[Any], Any], pin_device: str | None, threads: int) -> None:
        self.tasks: queue.SimpleQueue[tuple[int, Any] | None] = queue.SimpleQueue()
        self.results: queue.SimpleQueue[tuple[int, Any]] = queue.SimpleQueue()
        self.stopping = threading.Event()
        self.stopped = False
        """Set once a ``stop`` has run to its end (one cut short by a signal is run again)."""
        self.threads = [
            threading.Thread(
                target=_work, name=f"{THREAD_NAME_PREFIX}-{k}", daemon=True,
                args=(k, self.tasks, self.results, self.stopping, fetch, pin_device),
            )
            for k in range(threads)
        ]
        for t in self.threads:
            t.start()

    def alive(self) -> bool:
        return any(t.is_alive() for t in self.threads)

    def stop(self) -> list[threading.Thread]:
        """Stop every thread; the ones still inside the dataset after THREAD_JOIN_TIMEOUT_S are left."""
        if self.stopped:
            return []
        self.stopping.set()
        for _ in self.threads:
            self.tasks.put(None)
        deadline = time.monotonic() + THREAD_JOIN_TIMEOUT_S
        current = threading.current_thread()
        for t in self.threads:
            if t is not current:
                t.join(timeout=max(0.0, deadline - time.monotonic()))
        left = [t for t in self.threads if t.is_alive() and t is not current]
        if left:
            log.warning(
                "%d thread worker(s) still inside the dataset after %.0f s: %s; a thread cannot be"
                " stopped from outside, so each is left as a daemon thread that takes no new work and"
                " ends when its current call returns or with the process",
                len(left), THREAD_JOIN_TIMEOUT_S, [t.name for t in left],
            )
        # Batches nobody will take: release them now, not when the pool is collected.
        while True:
            try:
                self.results.get_nowait()
            except queue.Empty:
                break
        self.stopped = True
        return left


def _work(
    k: int,
    tasks: queue.SimpleQueue[tuple[int, Any] | None],
    results: queue.SimpleQueue[tuple[int, Any]],
    stopping: threading.Event,
    fetch: Callable[[Any], Any],
    pin_device: str | None,
) -> None:
    """One thread: fetch, collate and pin the batches it is given until it is told to stop."""
    while not stopping.is_set():
        try:
            task = tasks.get(timeout=THREAD_POLL_S)
        except queue.Empty:
            continue
        if task is None or stopping.is_set():
            return
        seq, index = task
        try:
            batch = fetch(index)
            if pin_device is not None:
                batch = pin_memory(batch, pin_device)
        except Exception:  # noqa: BLE001 - handed to the caller, who re-raises it
            results.put((seq, ExceptionWrapper(where=f"in DataLoader thread worker {k}")))
            continue
        except BaseException as err:  # SystemExit in a dataset must not end the caller's program
            wrapped = RuntimeError(f"DataLoader thread worker {k} ended with {type(err).__name__}")
            results.put((seq, ExceptionWrapper((RuntimeError, wrapped, err.__traceback__),
                                               where=f"in DataLoader thread worker {k}")))
            return
        results.put((seq, batch))
        del batch


class _ThreadLoaderIter:
    """One pass over a ThreadDataLoader (see NOTE [ Thread workers ])."""

    def __init__(self, loader: ThreadDataLoader) -> None:
        auto_collation = loader.batch_sampler is not None
        index_sampler: Any = loader.batch_sampler if auto_collation else loader.sampler
        self._index_sampler = index_sampler
        self._sampler_iter: Iterator[Any] = iter(index_sampler)
        # Drawn as torch's own iterators draw it (no worker uses it here): the generator and the global
        # RNG advance per epoch exactly as with torch's DataLoader.
        self._base_seed = torch.empty((), dtype=torch.int64).random_(generator=loader.generator).item()
        fetcher = _DatasetKind.create_fetcher(
            _DatasetKind.Map, loader.dataset, auto_collation, loader.collate_fn, loader.drop_last)
        pin_device: str | None = None
        if loader.pin_memory:
            available = torch.accelerator.is_available()
            accelerator = torch.accelerator.current_accelerator() if available else None
            if accelerator is None:
                warnings.warn(PINNED_WITHOUT_ACCELERATOR, stacklevel=3)
            else:
                pin_device = accelerator.type
        self._in_order = bool(loader.in_order)
        self._timeout = float(loader.timeout)
        self._max_in_flight = loader.worker_threads * loader.prefetch_per_thread
        self._pool = _Pool(fetcher.fetch, pin_device, loader.worker_threads)
        self._close = weakref.finalize(self, _Pool.stop, self._pool)
        self._sent = 0  # batches handed to the threads
        self._next = 0  # in order: the batch to hand out next
        self._in_flight = 0  # sent, not yet handed out
        self._ready: dict[int, Any] = {}
        self._sampler_done = False
        self._dispatch()

    def __iter__(self) -> _ThreadLoaderIter:
        return self

    def __len__(self) -> int:
        return len(self._index_sampler)

    def close(self) -> None:
        """Stop and join the threads (idempotent; a close cut short by a signal can be run again)."""
        self._close.detach()
        self._pool.stop()

    def __next__(self) -> Any:
        if self._pool.stopping.is_set():
            raise StopIteration
        try:
            return self._next_batch()
        except BaseException:
            # Exhausted, a thread's error, a timeout, Ctrl-C: no thread outlives the pass.
            self.close()
            raise

    def resume(self) -> None:
        """Send the threads what the sampler has again after it ran out (NOTE [ Continuing a
        stretch ] in epochs.py), up to the batches in flight it keeps."""
        self._sampler_done = False
        self._dispatch()

    def _dispatch(self) -> None:
        while not self._sampler_done and self._in_flight < self._max_in_flight:
            try:
                index = next(self._sampler_iter)
            except StopIteration:
                self._sampler_done = True
                return
            self._pool.tasks.put((self._sent, index))
            self._sent += 1
            self._in_flight += 1

    def _next_batch(self) -> Any:
        while True:
            if self._in_order and self._next in self._ready:
                value = self._ready.pop(self._next)
                break
            if not self._in_order and self._ready:
                value = self._ready.pop(next(iter(self._ready)))
                break
            if self._in_flight == 0:
                raise StopIteration
            seq, value = self._receive()
            self._ready[seq] = value
        self._next += 1
        self._in_flight -= 1
        self._dispatch()
        if isinstance(value, ExceptionWrapper):
            value.reraise()
        return value

    def _receive(self) -> tuple[int, Any]:
        waited_from = time.monotonic()
        while True:
            try:
                return self._pool.results.get(timeout=THREAD_POLL_S)
            except queue.Empty:
                pass
            if not self._pool.alive():
                raise RuntimeError(
                    "DataLoader thread workers exited unexpectedly with batches still to load")
            if self._timeout > 0 and time.monotonic() - waited_from > self._timeout:
                raise RuntimeError(f"DataLoader timed out after {self._timeout:g} seconds")
