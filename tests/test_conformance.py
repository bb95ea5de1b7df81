"""autotune.DataLoader against torch.utils.data.DataLoader: the same program, run with each.

The oracle is ``torch.utils.data.DataLoader`` built with the arguments the test writes, as a user
would write them. Each test runs one loop with it and the same loop with ``autotune.DataLoader``, in
each of the drop-in's states (``conformance_helpers.make``):

- ``exploring``: fresh, with no stored profile; its first epochs are served in consecutive stretches
  by different candidate configurations (worker processes, thread workers, caches, thread counts);
- ``settled-processes``: ``DataLoader.configured`` with two worker processes kept across epochs;
- ``settled-threads``: ``DataLoader.configured`` with two thread workers.

Where a test itself passes ``num_workers``, ``configured`` makes the workers processes (as a plain
DataLoader with that argument would start), so ``settled-threads`` is served by processes there.

What the two loaders deliver must be equal: the batches, in order (tensor-equal, with dtype and
shape), for map-style data with a seed, every epoch; the global RNG and the generator states after
every epoch; ``len()``; the errors, at the same batch, with torch's type and message; the same
multiset where the order is not defined (``in_order=False``, a sharded stream). Every dataset here
encodes the index in its samples, so order is checked by value.

What may legitimately differ:
- timing: how fast batches come (nothing here asserts a duration; time limits only stop a hang);
- what exploring reads: while it explores, the drop-in may call ``__getitem__`` more often than
  torch, in workers (a stretch's prefetched batches are read again by the next stretch), and it
  starts a pool of workers per stretch, so it calls ``worker_init_fn`` once per worker per stretch.
  No extra read may change a delivered sample or happen in the main process where torch would not
  read there;
- a random transform's values: workers draw from their own seeds, so where the drop-in moves the
  reads into workers the noise differs; those tests compare indices only.

Every test is also checked for what it leaves behind (the ``accounted`` fixture): no child process
it did not start, no thread, no new shared-memory file, and every test runs under a hard time limit.
"""

from __future__ import annotations

import functools
import gc
import itertools
import os
import pickle
import subprocess
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any

import psutil
import pytest
import torch
import torch.utils.data as tud
from conformance_helpers import (
    BATCH,
    EPOCHS,
    SHM_DIR,
    STATES,
    STREAM_STATES,
    Buckets,
    ByLength,
    ChecksInit,
    EvensThenOdds,
    Fails,
    Forever,
    Hung,
    Indexed,
    Mutable,
    N,
    OpensInWorkers,
    RandomTransform,
    RecordsReaders,
    SizedStream,
    Sleeps,
    SlowFirst,
    Stream,
    UnevenBatches,
    UnshardedStream,
    VariableLength,
    as_dict,
    assert_same,
    assert_same_epochs,
    both,
    canon,
    epoch_batches,
    epochs,
    indices,
    leftovers,
    make,
    mark_initialised,
    nested_collate,
    open_handle,
    oracle,
    readers,
    record_worker_init,
    rng_states,
    run,
    snapshot,
    take_worker_inits,
    time_limit,
    write_values,
)
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis import strategies as st

import autotune

TEST_LIMIT_S = 120.0
"""No test here may run longer (the usual one takes a second or two): past it, it fails as hung."""


@pytest.fixture(autouse=True)
def accounted(request: pytest.FixtureRequest) -> Iterator[None]:
    """Run the test under a hard time limit, then check it left no child process, thread or
    shared-memory file behind (after its loaders are dropped, as a user's go out of scope)."""
    before = snapshot()
    with time_limit(TEST_LIMIT_S, request.node.name):
        yield
    left = leftovers(before)
    assert not left, f"left behind after the test: {'; '.join(left)}"


@pytest.fixture(params=STATES)
def state(request: pytest.FixtureRequest) -> str:
    return request.param


@pytest.fixture(params=STREAM_STATES)
def stream_state(request: pytest.FixtureRequest) -> str:
    """The states of a drop-in over an IterableDataset (no thread workers: see STREAM_STATES)."""
    return request.param


# -- the checks can fail -------------------------------------------------------------------------


def test_the_leftover_check_sees_a_process_a_thread_and_a_segment() -> None:
    before = snapshot()
    stop = threading.Event()
    thread = threading.Thread(target=stop.wait, name="left-running")
    thread.start()
    child = subprocess.Popen(["sleep", "30"])
    segment = os.path.join(SHM_DIR, f"torch_{os.getpid()}_{child.pid}")
    open(segment, "w").close()
    try:
        left = leftovers(before, settle_s=0.2)
    finally:
        stop.set()
        thread.join()
        os.unlink(segment)
        child.kill()
        child.wait()
    assert len(left) == 3, left
    assert str(child.pid) in left[0] and "left-running" in left[1] and os.path.basename(segment) in left[2]


def test_a_hang_is_stopped_and_reported() -> None:
    with (pytest.raises(Hung, match="a loop that waits forever did not finish within 0.5 s"),
          time_limit(0.5, "a loop that waits forever")):
        threading.Event().wait()


# -- the states are what they say ----------------------------------------------------------------


def test_exploring_serves_stretches_by_several_candidates(tmp_path: Any) -> None:
    """The exploring state of the other tests crosses candidates of every kind within one epoch of N
    samples: reads in the main thread, on other threads, and in two or more worker processes."""
    torch.manual_seed(0)
    loader = make("exploring", RecordsReaders(N, str(tmp_path)), batch_size=BATCH, shuffle=True)
    assert sorted(i for b in loader for i in indices(b)) == list(range(N))
    del loader
    seen = readers(str(tmp_path))
    main = os.getpid()
    assert len(set(seen) - {main}) >= 2, seen.keys()  # worker processes of two stretches or more
    threads = {t for _, t in seen.get(main, [])}
    assert threading.main_thread().ident in threads and len(threads) >= 2, threads


@pytest.mark.parametrize("settled", ["settled-processes", "settled-threads"])
def test_settled_states_read_in_their_workers(settled: str, tmp_path: Any) -> None:
    """settled-processes reads in other processes, settled-threads on other threads of this one."""
    loader = make(settled, RecordsReaders(64, str(tmp_path)), batch_size=BATCH)
    for path in tmp_path.iterdir():  # what it reads at construction is another test's subject
        path.unlink()
    assert sorted(i for b in loader for i in indices(b)) == list(range(64))
    del loader
    seen = readers(str(tmp_path))
    main = os.getpid()
    if settled == "settled-processes":
        assert main not in seen and len(seen) == 2, seen.keys()
    else:
        assert list(seen) == [main], seen.keys()
        assert threading.main_thread().ident not in {t for _, t in seen[main]}


# -- the same batches, in the same order, with the same RNG afterwards ---------------------------

ORDER_CASES = {
    "sequential": lambda ds, g: {"batch_size": BATCH},
    "shuffle-global-seed": lambda ds, g: {"batch_size": BATCH, "shuffle": True},
    "shuffle-generator": lambda ds, g: {"batch_size": BATCH, "shuffle": True, "generator": g},
    "drop-last": lambda ds, g: {"batch_size": 7, "shuffle": True, "drop_last": True, "generator": g},
    "batch-size-none": lambda ds, g: {"batch_size": None, "shuffle": True, "generator": g},
    "sampler": lambda ds, g: {"batch_size": BATCH, "sampler": EvensThenOdds(len(ds))},
    "random-sampler-with-replacement": lambda ds, g: {
        "batch_size": BATCH, "sampler": tud.RandomSampler(ds, replacement=True, num_samples=300,
                                                          generator=g)},
    "batch-sampler": lambda ds, g: {"batch_sampler": UnevenBatches(len(ds))},
    "batch-sampler-over-random-sampler": lambda ds, g: {
        "batch_sampler": tud.BatchSampler(tud.RandomSampler(ds, generator=g), 5, drop_last=False)},
    "collate-fn": lambda ds, g: {"batch_size": BATCH, "shuffle": True, "collate_fn": as_dict,
                                 "generator": g},
    # The caller's own worker settings (the settled-threads state is served by processes here).
    "num-workers-given": lambda ds, g: {"batch_size": BATCH, "shuffle": True, "generator": g,
                                        "num_workers": 2},
    "persistent-workers-given": lambda ds, g: {"batch_size": BATCH, "shuffle": True, "generator": g,
                                               "num_workers": 2, "persistent_workers": True},
}


@pytest.mark.parametrize("case", list(ORDER_CASES))
def test_same_batches_and_rng_every_epoch(state: str, case: str) -> None:
    expected, got = both(state, epochs, Indexed, generator=True, kwargs=ORDER_CASES[case],
                         oracle_key=f"order-{case}")
    assert_same_epochs(expected, got)


def test_random_transform_same_indices(state: str) -> None:
    # Indices only: the noise comes from the RNG of whichever process or thread reads the sample,
    # which the drop-in legitimately changes by moving reads into workers (and the main process's
    # RNG is then advanced by fewer draws than torch's with no workers).
    def loop(loader: Any, g: Any) -> list[list[list[int]]]:
        return [[indices(b) for b in loader] for _ in range(EPOCHS)]

    expected, got = both(state, loop, RandomTransform, generator=True,
                         kwargs=lambda ds, g: {"batch_size": BATCH, "shuffle": True, "generator": g})
    assert_same(expected, got)


def test_random_transform_without_a_generator_same_first_epoch(state: str) -> None:
    # Without a generator the shuffle draws from the global RNG, which the transform draws from too
    # where it runs in the main process: the first epoch's order is torch's; the next follows the
    # state the reads left (README, "What may differ"), so it is compared as a set.
    def loop(loader: Any, g: Any) -> tuple[list[list[int]], list[int]]:
        first = [indices(b) for b in loader]
        return first, sorted(i for b in loader for i in indices(b))

    expected, got = both(state, loop, RandomTransform,
                         kwargs=lambda ds, g: {"batch_size": BATCH, "shuffle": True})
    assert_same(expected, got)


# -- len() -----------------------------------------------------------------------------------------

LEN_CASES = {
    "batch-size": (Indexed, lambda ds, g: {"batch_size": BATCH}),
    "drop-last": (Indexed, lambda ds, g: {"batch_size": 7, "drop_last": True}),
    "keep-last": (Indexed, lambda ds, g: {"batch_size": 7}),
    "batch-size-none": (Indexed, lambda ds, g: {"batch_size": None}),
    "batch-sampler": (Indexed, lambda ds, g: {"batch_sampler": UnevenBatches(len(ds))}),
}


def _lengths(loader: Any, g: Any) -> dict[str, Any]:
    out: dict[str, Any] = {"len": len(loader)}
    it = iter(loader)
    try:
        out["len_iter"] = len(it)
    except TypeError as err:  # torch's iterator over a stream has no length, though its loader has
        out["len_iter"] = f"TypeError: {err}"
    out["batches"] = len(list(it))
    out["len_after"] = len(loader)
    return out


@pytest.mark.parametrize("case", list(LEN_CASES))
def test_len_of_loader_and_iterator(state: str, case: str) -> None:
    dataset, kwargs = LEN_CASES[case]
    expected, got = both(state, _lengths, dataset, kwargs=kwargs)
    assert_same(expected, got)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_len_of_a_sized_stream(stream_state: str, drop_last: bool, workers: int) -> None:
    # torch's len(loader) for an IterableDataset with __len__ is len(dataset) over the batch size.
    expected, got = both(stream_state, _lengths, SizedStream,
                         kwargs=lambda ds, g: {"batch_size": 7, "drop_last": drop_last,
                                               "num_workers": workers})
    assert_same(expected, got)


# -- out of order, and streams: the same samples --------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_in_order_false_same_batches_as_a_multiset(state: str, shuffle: bool) -> None:
    # Out of order, a batch may come before an earlier one, but the batches are the sampler's.
    def loop(loader: Any, g: Any) -> list[dict[str, Any]]:
        out = []
        for _ in range(EPOCHS):
            out.append({"batches": sorted(tuple(indices(b)) for b in loader), **rng_states(g)})
        return out

    expected, got = both(state, loop, Indexed, generator=True, kwargs=lambda ds, g: {
        "batch_size": BATCH, "shuffle": shuffle, "generator": g, "in_order": False})
    assert_same_epochs(expected, got)


@pytest.mark.parametrize("drop_last", [False, True])
@pytest.mark.parametrize("workers", [0, 2])
def test_sharded_stream_same_samples(stream_state: str, drop_last: bool, workers: int) -> None:
    # 406 samples at 4 per batch: torch drops the last 2 with drop_last; a stream split between
    # workers drops each worker's remainder instead, other samples: the drop-in keeps the workers a
    # stream was given, so it drops what torch drops.
    def loop(loader: Any, g: Any) -> list[list[int]]:
        return [sorted(i for b in loader for i in indices(b)) for _ in range(EPOCHS)]

    expected, got = both(stream_state, loop, lambda: Stream(406),
                         kwargs=lambda ds, g: {"batch_size": BATCH, "drop_last": drop_last,
                                               "num_workers": workers})
    assert_same(expected, got)


# The drop-in may say, with an AutotuneWarning of its own, that it will not use workers for such a
# stream; what it delivers is what this test is about.
@pytest.mark.filterwarnings("ignore::autotune.AutotuneWarning")
@pytest.mark.parametrize("workers", [0, 2])
def test_unsharded_stream_delivered_exactly_as_torch(stream_state: str, workers: int) -> None:
    # A stream that ignores get_worker_info() is read whole by every worker: with no workers written
    # torch delivers it once, with two it delivers it twice, interleaved; so must the drop-in.
    expected, got = both(stream_state, epoch_batches, UnshardedStream,
                         kwargs=lambda ds, g: {"batch_size": BATCH, "num_workers": workers})
    assert_same(expected, got)


# -- iterator semantics ----------------------------------------------------------------------------


@pytest.mark.parametrize("shuffle", [False, True])
def test_two_live_iterators_zipped(state: str, shuffle: bool) -> None:
    def loop(loader: Any, g: Any) -> dict[str, Any]:
        return {"pairs": canon(list(zip(loader, loader, strict=False))), **rng_states(g)}

    expected, got = both(state, loop, Indexed, generator=True, kwargs=lambda ds, g: {
        "batch_size": BATCH, "shuffle": shuffle, "generator": g})
    assert_same(expected, got)


def test_peek_in_the_middle_of_an_epoch(state: str) -> None:
    # A common peek: next(iter(loader)) to look at a batch, while the epoch's iterator goes on.
    def loop(loader: Any, g: Any) -> dict[str, Any]:
        it = iter(loader)
        head = [next(it) for _ in range(10)]
        peek = next(iter(loader))
        rest = list(it)
        return {"head": canon(head), "peek": canon(peek), "rest": canon(rest),
                "next_epoch": canon(list(loader))}

    expected, got = both(state, loop, Indexed, kwargs=lambda ds, g: {"batch_size": BATCH})
    assert_same(expected, got)


BREAK_CASES = {
    "sequential": lambda ds, g: {"batch_size": BATCH},
    "shuffle-generator": lambda ds, g: {"batch_size": BATCH, "shuffle": True, "generator": g},
    # The settled-threads state is served by processes here.
    "persistent-workers-given": lambda ds, g: {"batch_size": BATCH, "shuffle": True, "generator": g,
                                               "num_workers": 2, "persistent_workers": True},
}


@pytest.mark.parametrize("case", list(BREAK_CASES))
def test_break_out_of_an_epoch_then_the_next(state: str, case: str) -> None:
    def loop(loader: Any, g: Any) -> list[dict[str, Any]]:
        out = []
        for stop in (10, None, 3, None):
            got = []
            for k, batch in enumerate(loader):
                if k == stop:
                    break
                got.append(batch)
            out.append({"batches": canon(got), **rng_states(g)})
        return out

    expected, got = both(state, loop, Indexed, generator=True, kwargs=BREAK_CASES[case])
    assert_same_epochs(expected, got)


# -- errors ----------------------------------------------------------------------------------------


def _until_error(loader: Any, g: Any, n_epochs: int = 2) -> list[dict[str, Any]]:
    """Per epoch: the batches before the first error, and the error's type and message."""
    out = []
    for _ in range(n_epochs):
        got: list[Any] = []
        error = None
        try:
            for batch in loader:
                got.append(batch)
        except Exception as err:  # noqa: BLE001 - compared with torch's below
            error = (type(err).__name__, str(err))
        out.append({"batches": canon(got), "error": error})
    return out


def _assert_same_errors(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    """The same batches before the error, the same error type, torch's message within the drop-in's
    (torch adds the worker's traceback to a message raised in a worker)."""
    assert_same([e["batches"] for e in expected], [e["batches"] for e in got])
    for epoch, (e, g) in enumerate(zip(expected, got, strict=True)):
        assert e["error"] is not None
        assert g["error"] is not None, f"epoch {epoch}: torch raised {e['error']}, the drop-in nothing"
        assert g["error"][0] == e["error"][0], f"epoch {epoch}: {g['error']} instead of {e['error']}"
        assert e["error"][1] in g["error"][1], f"epoch {epoch}: {g['error']} instead of {e['error']}"


@pytest.mark.parametrize("error", [ValueError, KeyError])
@pytest.mark.parametrize("bad", [10, 300], ids=["early", "late"])
def test_error_in_getitem_reaches_the_caller_at_the_same_batch(state: str, error: type, bad: int) -> None:
    expected, got = both(state, _until_error, lambda: Fails(N, bad, error),
                         kwargs=lambda ds, g: {"batch_size": BATCH})
    _assert_same_errors(expected, got)


def test_epoch_goes_on_after_a_failed_batch(state: str) -> None:
    # torch's iterator (with or without workers) skips a batch whose sample raised: the caller that
    # catches the error and calls next() again gets the rest of the epoch.
    def loop(loader: Any, g: Any) -> list[Any]:
        out: list[Any] = []
        it = iter(loader)
        while True:
            try:
                out.append(canon(next(it)))
            except StopIteration:
                return out
            except ValueError:
                out.append("ValueError")

    expected, got = both(state, loop, lambda: Fails(N, 300, ValueError),
                         kwargs=lambda ds, g: {"batch_size": BATCH})
    assert_same(expected, got)


CONSTRUCTION_ERRORS = {
    "negative-num-workers": (Indexed, {"num_workers": -1}),
    "batch-size-zero": (Indexed, {"batch_size": 0}),
    "sampler-and-shuffle": (Indexed, {"sampler": EvensThenOdds(N), "shuffle": True}),
    "batch-sampler-and-batch-size": (Indexed, {"batch_sampler": UnevenBatches(N), "batch_size": 4}),
    "batch-sampler-and-drop-last": (Indexed, {"batch_sampler": UnevenBatches(N), "drop_last": True}),
    "prefetch-factor-without-workers": (Indexed, {"prefetch_factor": 2}),
    "persistent-workers-without-workers": (Indexed, {"persistent_workers": True}),
    "context-without-workers": (Indexed, {"multiprocessing_context": "spawn"}),
    "unknown-context": (Indexed, {"multiprocessing_context": "teleport", "num_workers": 2}),
    "stream-with-shuffle": (Stream, {"shuffle": True}),
    "stream-with-sampler": (Stream, {"sampler": EvensThenOdds(N)}),
    "empty-dataset-with-shuffle": (lambda: Indexed(0), {"shuffle": True}),
}


@pytest.mark.parametrize("case", list(CONSTRUCTION_ERRORS))
def test_construction_errors_are_torch_s(state: str, case: str) -> None:
    dataset, kwargs = CONSTRUCTION_ERRORS[case]
    with pytest.raises(Exception) as torch_error:  # noqa: B017 - whatever torch raises is the oracle
        make("torch", dataset(), **kwargs)
    with pytest.raises(Exception) as ours:  # noqa: B017
        make(state, dataset(), **kwargs)
    assert isinstance(ours.value, torch_error.type), f"{ours.value!r} instead of {torch_error.value!r}"
    assert str(torch_error.value) in str(ours.value)


def test_user_timeout_raises_torch_s_error(state: str) -> None:
    # Sample 9 takes 3 s; the caller allows 1 s per batch, with one worker given (settled-threads is
    # served by a process here).
    with time_limit(30, "a loader whose batch times out"):
        expected, got = both(state, functools.partial(_until_error, n_epochs=1),
                             lambda: Sleeps(40, 9, 3.0), oracle_key="timeout",
                             kwargs=lambda ds, g: {"batch_size": BATCH, "num_workers": 1, "timeout": 1})
    assert expected[0]["error"][1].startswith("DataLoader timed out")
    _assert_same_errors(expected, got)


# -- worker processes: worker_init_fn, multiprocessing_context, persistent_workers -----------------


@pytest.mark.parametrize("persistent", [False, True], ids=["per-epoch", "persistent"])
def test_worker_init_fn_called_per_worker_process(state: str, persistent: bool, tmp_path: Any) -> None:
    # num_workers=2 given (settled-threads is served by processes here).
    folder = str(tmp_path)

    def loop(loader: Any, g: Any) -> list[dict[str, Any]]:
        out = []
        for _ in range(EPOCHS):
            batches = canon(list(loader))
            out.append({"inits": take_worker_inits(folder), "batches": batches})
        return out

    # Each call records the worker's id, its info, and its seed (torch's base seed, drawn from the
    # generator at the start of the epoch, plus the worker's id).
    init = functools.partial(record_worker_init, folder, os.getpid())
    expected, got = both(state, loop, Indexed, generator=True, kwargs=lambda ds, g: {
        "batch_size": BATCH, "generator": g, "num_workers": 2, "persistent_workers": persistent,
        "worker_init_fn": init})
    if state != "exploring":
        assert_same(expected, got)
        return
    # Exploring starts a pool of two workers per stretch, so worker_init_fn runs more often than
    # torch runs it (once per worker per stretch), each time in a worker with its info set.
    assert_same([e["batches"] for e in expected], [e["batches"] for e in got])
    for epoch in got:
        for call in epoch["inits"]:
            assert call["info_id"] == call["worker_id"] and call["num_workers"] == 2, call
            assert not call["in_main_process"] and call["seed"] == call["initial_seed"], call
    assert {c["worker_id"] for c in got[0]["inits"]} == {0, 1}


def test_samples_read_off_the_main_thread_see_worker_init_fn(state: str) -> None:
    """With a worker_init_fn and no workers given, torch reads every sample in the main thread. The
    drop-in may read in workers, but only in ones where worker_init_fn ran, with get_worker_info()
    set (what the function of a real script reads): each sample says whether that held."""
    expected, got = both(state, epoch_batches, ChecksInit, kwargs=lambda ds, g: {
        "batch_size": BATCH, "worker_init_fn": mark_initialised})
    assert_same(expected, got)


@pytest.mark.parametrize("context", ["fork", "spawn"])
def test_multiprocessing_context_with_workers(state: str, context: str) -> None:
    # num_workers=2 given (settled-threads is served by processes here). One epoch under spawn: its
    # workers import torch.
    n_epochs = 1 if context == "spawn" else 2
    expected, got = both(state, functools.partial(epoch_batches, n=n_epochs), Indexed,
                         oracle_key=f"context-{context}",
                         kwargs=lambda ds, g: {"batch_size": BATCH, "num_workers": 2,
                                               "multiprocessing_context": context})
    assert_same(expected, got)


# -- what is read in the main process --------------------------------------------------------------


def test_no_sample_read_in_the_main_process_with_workers_given(state: str, tmp_path: Any) -> None:
    # num_workers=2 given (settled-threads is served by processes here): torch reads no sample in the
    # main process, not even at construction.
    def loop(loader: Any, g: Any) -> dict[str, Any]:
        at_construction = readers(str(tmp_path))
        batches = epoch_batches(loader, g, n=2)
        main_reads = readers(str(tmp_path)).get(os.getpid(), [])
        for path in tmp_path.iterdir():
            path.unlink()
        return {"read_at_construction": sorted(at_construction), "batches": batches,
                "main_process_reads": sorted(i for i, _ in main_reads)}

    def dataset() -> RecordsReaders:
        return RecordsReaders(200, str(tmp_path))

    expected, got = both(state, loop, dataset, kwargs=lambda ds, g: {"batch_size": BATCH, "num_workers": 2})
    assert expected["read_at_construction"] == [] and expected["main_process_reads"] == []
    assert_same(expected, got)


def test_dataset_opened_in_worker_init_fn(state: str, tmp_path: Any) -> None:
    # h5py/LMDB style, num_workers=2 given (settled-threads is served by processes here): the main
    # process never has the file open, so a sample read there fails.
    path = str(tmp_path / "values.bin")
    write_values(path)
    expected, got = both(state, epoch_batches, lambda: OpensInWorkers(path),
                         kwargs=lambda ds, g: {"batch_size": BATCH, "num_workers": 2,
                                               "worker_init_fn": open_handle})
    assert_same(expected, got)


VARIABLE_LENGTH_CASES = {
    "bucketing-batch-sampler": (401, lambda ds, g: {"batch_sampler": Buckets(len(ds))}),
    # 136 samples of each length: batches of 4 in this order never mix two lengths.
    "sampler-sorted-by-length": (408, lambda ds, g: {"batch_size": BATCH, "sampler": ByLength(len(ds))}),
}


@pytest.mark.parametrize("case", list(VARIABLE_LENGTH_CASES))
def test_variable_length_samples_batched_by_length(state: str, case: str) -> None:
    # Samples of three lengths, each batch of one length: default_collate of a sample of one
    # length with a sample of another fails, but no batch here mixes them. The first and the last
    # sample differ in length.
    n, kwargs = VARIABLE_LENGTH_CASES[case]
    expected, got = both(state, epoch_batches, lambda: VariableLength(n), kwargs=kwargs)
    assert_same(expected, got)


def test_empty_dataset_yields_nothing(state: str) -> None:
    def loop(loader: Any, g: Any) -> dict[str, Any]:
        return {"len": len(loader), "epochs": epoch_batches(loader, g)}

    expected, got = both(state, loop, lambda: Indexed(0), kwargs=lambda ds, g: {"batch_size": BATCH})
    assert_same(expected, got)


# -- an infinite sampler --------------------------------------------------------------------------


def test_infinite_sampler_serves_what_is_taken(state: str) -> None:
    def loop(loader: Any, g: Any) -> Any:
        return canon(list(itertools.islice(loader, 200)))

    with time_limit(60, "200 batches from an infinite sampler"):
        expected, got = both(state, loop, Indexed,
                             kwargs=lambda ds, g: {"batch_size": BATCH, "sampler": Forever(len(ds))})
    assert_same(expected, got)


# -- pickling and typing --------------------------------------------------------------------------


def test_pickle_after_an_epoch(state: str) -> None:
    def loop(loader: Any, g: Any) -> dict[str, Any]:
        first = canon(list(loader))
        copy = pickle.loads(pickle.dumps(loader))
        return {"first": first, "copy": canon(list(copy))}

    expected, got = both(state, loop, Indexed, kwargs=lambda ds, g: {"batch_size": BATCH})
    assert_same(expected, got)


def test_generic_subscription() -> None:
    # A property of the class, the same in every state: DataLoader[T] in a type annotation or a
    # call, as torch's DataLoader is Generic[T_co].
    alias = autotune.DataLoader[tuple]
    assert_same(canon(list(tud.DataLoader[tuple](Indexed(8), batch_size=BATCH))),
                canon(list(alias(Indexed(8), batch_size=BATCH, cache=False))))


# -- the torch thread count -----------------------------------------------------------------------


@pytest.mark.parametrize("order", ["creation", "reverse", "collection"])
def test_torch_threads_restored_whatever_the_close_order(state: str, order: str) -> None:
    original = torch.get_num_threads()
    torch.set_num_threads(3)  # not 1, so that a loader using 1 thread changes it
    try:
        first = make(state, Indexed(64), torch_threads=1, batch_size=BATCH)
        second = make(state, Indexed(64), torch_threads=1, batch_size=BATCH)
        list(first)
        list(second)
        if order == "creation":
            first.close()
            second.close()
        elif order == "reverse":
            second.close()
            first.close()
        else:
            del first
            gc.collect()
            del second
            gc.collect()
        assert torch.get_num_threads() == 3
    finally:
        torch.set_num_threads(original)


class Tokens(tud.Dataset):
    """Sequences of byte values read with a little latency, so that the search explores."""

    def __len__(self) -> int:
        return 2048

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        time.sleep(0.0003)
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (128,), generator=g), i % 10


def _train(loader: Any, epochs: int, threads: int | None = None) -> torch.Tensor:
    """A small character-level model trained on ``loader``: its parameters after ``epochs``. Its
    convolutions sum in another order on another number of threads."""
    if threads is not None:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    embed = torch.nn.Embedding(256, 32)
    conv = torch.nn.Sequential(torch.nn.Conv1d(32, 64, 5, padding=2), torch.nn.ReLU(),
                               torch.nn.Conv1d(64, 64, 5, padding=2), torch.nn.ReLU())
    head = torch.nn.Linear(64, 10)
    params = [*embed.parameters(), *conv.parameters(), *head.parameters()]
    opt = torch.optim.SGD(params, lr=0.05)
    for _ in range(epochs):
        for x, y in loader:
            out = head(conv(embed(x).transpose(1, 2)).amax(dim=2))
            loss = torch.nn.functional.cross_entropy(out, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
    return torch.cat([p.detach().flatten() for p in params])


def test_torch_threads_none_trains_to_torch_s_parameters_bit_for_bit(monkeypatch: Any) -> None:
    # The real search explores worker processes and threads beside the step; with the thread count
    # left alone, the step computes exactly what it computes under torch. It explores however little
    # the step waits: on a busy machine the step slows, and the wait share alone would stop it.
    from autotune import online

    monkeypatch.setattr(online, "MIN_WAIT_TO_EXPLORE", 0.0)
    original = torch.get_num_threads()
    try:
        kwargs = {"batch_size": 32, "shuffle": True}
        expected = _train(tud.DataLoader(Tokens(), generator=torch.Generator().manual_seed(7), **kwargs), 2)
        with autotune.DataLoader(Tokens(), generator=torch.Generator().manual_seed(7), cache=False,
                                 torch_threads=None, **kwargs) as loader:
            got = _train(loader, 2)
            assert torch.get_num_threads() == original
            tried = {t.candidate for t in loader.tuning.trials}
        assert len(tried) > 1, "the search must have explored for this to test anything"
        assert torch.equal(got, expected)
        if original >= 2:  # the model is one whose result depends on the thread count
            batches = list(itertools.islice(tud.DataLoader(Tokens(), **kwargs), 8))
            assert not torch.equal(_train(batches, 1, threads=1), _train(batches, 1, threads=original))
    finally:
        torch.set_num_threads(original)


# -- what the user started ------------------------------------------------------------------------
# In order, with no shuffling: these tests are about what survives, not about the sample order.


def _sleeper() -> subprocess.Popen[bytes]:
    return subprocess.Popen(["sleep", "30"])


def test_user_processes_survive_an_epoch(state: str) -> None:
    # One started before the loop and three during it (at the start, a third and two thirds in, so
    # that some start while the exploring state serves a stretch by worker processes).
    def loop(loader: Any, g: Any) -> dict[str, Any]:
        mine = [_sleeper()]
        try:
            batches = []
            for k, batch in enumerate(loader):
                if k in (1, len(loader) // 3, 2 * len(loader) // 3):
                    mine.append(_sleeper())
                batches.append(batch)
            return {"batches": canon(batches), "exit_codes": [p.poll() for p in mine]}
        finally:
            for p in mine:
                p.kill()
                p.wait()

    expected, got = both(state, loop, Indexed, kwargs=lambda ds, g: {"batch_size": BATCH})
    assert expected["exit_codes"] == [None] * 4
    assert_same(expected, got)


@pytest.mark.parametrize("start", [0, 30], ids=["from-the-start", "mid-epoch"])
def test_a_plain_torch_loader_zipped_with_the_drop_in(state: str, start: int) -> None:
    # The plain loader's workers start with the epoch, or 30 batches into it (a loader the user
    # reads beside the drop-in from there, as a validation loop does): by then the exploring state
    # serves a stretch by worker processes of its own.
    def loop(loader: Any, g: Any) -> Any:
        plain = tud.DataLoader(Indexed(), batch_size=BATCH, num_workers=2)
        it = iter(loader)
        head = [next(it) for _ in range(start)]
        return {"head": canon(head), "pairs": canon(list(zip(it, plain, strict=False)))}

    expected, got = both(state, loop, Indexed, kwargs=lambda ds, g: {"batch_size": BATCH})
    assert_same(expected, got)


def _failed_trials(loader: Any) -> list[str]:
    """What a drop-in recorded as failed (torch's loader records nothing)."""
    tuning = getattr(loader, "tuning", None)
    return [f"{r.candidate.label()}: {r.reason}" for r in (tuning.trials if tuning else ())
            if r.state == "failed"]


def test_two_drop_ins_zipped(state: str) -> None:
    # Nothing here can fail: a candidate of one recorded as failed was broken by the other.
    def loop(kind: str, loader: Any, g: Any) -> Any:
        other = make(kind, Indexed(), batch_size=BATCH)
        pairs = [canon(list(zip(loader, other, strict=False))) for _ in range(2)]
        return {"pairs": pairs, "failed": _failed_trials(loader) + _failed_trials(other)}

    expected = run("torch", functools.partial(loop, "torch"), Indexed(), kwargs=lambda ds, g: {
        "batch_size": BATCH})
    got = run(state, functools.partial(loop, state), Indexed(), kwargs=lambda ds, g: {
        "batch_size": BATCH})
    assert_same(expected, got)


# -- properties -----------------------------------------------------------------------------------


@settings(max_examples=15, deadline=None,
          # Every example runs real loaders (about a second): shrinking a failure would take minutes,
          # so a failing example is reported as drawn.
          phases=[Phase.explicit, Phase.reuse, Phase.generate],
          # The function-scoped fixtures (the cache folder, the accounting) are for the whole test.
          suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(n=st.integers(1, 300), batch_size=st.integers(1, 9), drop_last=st.booleans(),
       shuffle=st.booleans(), seed=st.integers(0, 2**31 - 1), stop=st.integers(0, 40))
def test_property_same_index_order_while_exploring(n: int, batch_size: int, drop_last: bool,
                                                   shuffle: bool, seed: int, stop: int) -> None:
    def loop(loader: Any, g: Any) -> list[dict[str, Any]]:
        out = []
        for epoch in range(3):
            got: list[list[int]] = []
            for k, batch in enumerate(loader):
                if epoch == 0 and k == stop:
                    break
                got.append(indices(batch))
            out.append({"batches": got, **rng_states(g)})
        return out

    expected, got = both("exploring", loop, lambda: Indexed(n), generator=True, seed=seed,
                         kwargs=lambda ds, g: {"batch_size": batch_size, "drop_last": drop_last,
                                               "shuffle": shuffle, "generator": g})
    assert_same_epochs(expected, got)


# -- what torch's own DataLoader tests check, beyond the above -------------------------------------


def test_the_baseline_waits_as_long_as_the_user_s_loader_would(state: str) -> None:
    # No timeout written: torch waits for a slow first batch however long it takes. The drop-in's
    # limit for a hung candidate (batch_timeout_s, here 1 s) is never the user's own settings'.
    def loop(loader: Any, g: Any) -> list[Any]:
        return [canon(list(loader))]

    kwargs = {"batch_size": BATCH, "num_workers": 2}
    expected = oracle("slow-first",
                      lambda: run("torch", loop, SlowFirst(40, 2.5), kwargs=lambda ds, g: kwargs))
    got = run(state, loop, SlowFirst(40, 2.5), kwargs=lambda ds, g: {**kwargs, "batch_timeout_s": 1.0})
    assert_same(expected, got)


@pytest.mark.filterwarnings("ignore:The PyTorch API of nested tensors:UserWarning")  # torch's own notice
def test_nested_tensor_batches_are_served(state: str) -> None:
    def loop(loader: Any, g: Any) -> list[list[int]]:
        return [[i for _, idx in loader for i in idx] for _ in range(2)]

    expected, got = both(state, loop, lambda: Indexed(24),
                         kwargs=lambda ds, g: {"batch_size": 4, "collate_fn": nested_collate})
    assert_same(expected, got)


def test_a_sized_stream_warns_past_its_length_as_torch_does(stream_state: str) -> None:
    # Once len(loader) was asked, torch warns when a stream yields more than its length says.
    class Longer(SizedStream):
        def __len__(self) -> int:
            return 10

    def loop(loader: Any, g: Any) -> int:
        len(loader)
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            list(loader)
        return sum("Length of IterableDataset" in str(w.message) for w in seen)

    expected, got = both(stream_state, loop, Longer, kwargs=lambda ds, g: {"batch_size": 2})
    assert expected > 0 and got == expected


def test_kept_workers_warn_past_a_stream_s_length_asked_after_they_started(stream_state: str) -> None:
    # persistent_workers=True: torch resets the same iterator each epoch and takes the length asked
    # of the loader since then; the warning comes once len(loader) was asked, not before.
    class Longer(SizedStream):
        def __len__(self) -> int:
            return 10

    def loop(loader: Any, g: Any) -> list[int]:
        counts = []
        for ask in (False, True):
            if ask:
                len(loader)
            with warnings.catch_warnings(record=True) as seen:
                warnings.simplefilter("always")
                list(loader)
            counts.append(sum("Length of IterableDataset" in str(w.message) for w in seen))
        return counts

    kwargs = {"batch_size": 2, "num_workers": 2, "persistent_workers": True}
    expected, got = both(stream_state, loop, Longer, kwargs=lambda ds, g: kwargs)
    assert expected[0] == 0 and expected[1] > 0 and got == expected


def test_an_epoch_left_early_does_not_ask_a_stream_s_length(stream_state: str) -> None:
    # Only the user's len(loader) marks a stream's length as asked: an epoch left early (its
    # iterator collected) does not, so the next epoch warns as torch's does, not at all.
    class Longer(SizedStream):
        def __len__(self) -> int:
            return 10

    def loop(loader: Any, g: Any) -> int:
        for i, _ in enumerate(loader):
            if i == 1:
                break
        gc.collect()
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            list(loader)
        return sum("Length of IterableDataset" in str(w.message) for w in seen)

    expected, got = both(stream_state, loop, Longer, kwargs=lambda ds, g: {"batch_size": 2})
    assert expected == 0 and got == expected


def test_a_warning_shown_once_is_shown_once_as_torch_shows_it(state: str) -> None:
    # torch warns about pin_memory without an accelerator at every iter(); Python shows it once per
    # place under the default filter. Stretches built under catch_warnings would re-arm it each time.
    def loop(loader: Any, g: Any) -> dict[str, int]:
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("default")
            for _ in range(4):
                for _batch in loader:
                    pass
        shown: dict[str, int] = {}
        for w in seen:
            if not issubclass(w.category, autotune.AutotuneWarning):
                shown[str(w.message)] = shown.get(str(w.message), 0) + 1
        return shown

    expected, got = both(state, loop, lambda: Indexed(40), kwargs=lambda ds, g: {
        "batch_size": 4, "pin_memory": True})
    assert got == expected


def test_workers_kept_alive_see_the_dataset_as_they_started(state: str) -> None:
    # persistent_workers=True written: torch keeps the same worker processes for the run, so a change
    # the main process makes to the dataset between epochs never reaches them.
    def loop(loader: Any, g: Any) -> list[list[float]]:
        out = []
        for epoch in range(4):
            loader.dataset.start = epoch
            out.append(sorted(float(x[0, 0]) - float(i[0]) for x, i in loader))
        return out

    expected, got = both(state, loop, lambda: Mutable(40), kwargs=lambda ds, g: {
        "batch_size": 4, "num_workers": 2, "persistent_workers": True})
    assert_same(expected, got)


def test_dropping_the_iterator_and_the_loader_ends_kept_workers_at_once(state: str) -> None:
    loader = make(state, Indexed(40), batch_size=4, num_workers=2, persistent_workers=True)
    it = iter(loader)
    next(it)
    pids = {w.pid for w in getattr(it, "_workers", [])}
    assert pids, "the iterator's workers are readable, as torch's are"
    del it, loader  # no garbage collection: reference counts alone must let the workers go
    deadline = time.monotonic() + 10
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in pids):
        assert time.monotonic() < deadline, "workers still alive after the loader and iterator were dropped"
        time.sleep(0.1)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch's datapipes announce their deprecation
def test_a_datapipe_keeps_its_own_shuffle(stream_state: str) -> None:
    from torch.utils.data.datapipes.iter import IterableWrapper

    def loop(loader: Any, g: Any) -> dict[str, Any]:
        return {"epochs": [[int(x) for x in loader] for _ in range(3)], **rng_states(g)}

    expected, got = both(stream_state, loop, lambda: IterableWrapper(range(30)).shuffle(),
                         generator=True, kwargs=lambda ds, g: {"batch_size": None, "shuffle": True,
                                                               "generator": g})
    assert expected["epochs"][0] != list(range(30))  # shuffled
    assert_same(expected, got)


# -- a tuned choice changes speed only (NOTE [ Speed only ] in autotune/loader.py) -----------------


class Add:
    """A transform that adds a constant: swapped for another between epochs by the loops below."""

    def __init__(self, value: float) -> None:
        self.value = value

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.value


class WithTransform(Indexed):
    """Sample i is ``transform(torch.full((3,), float(i)))``, with a ``transform`` attribute."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.transform: Any = Add(0.0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return self.transform(x), y


def _offsets(loader: Any) -> list[float]:
    """Each batch's offset of its samples from their indices, in the order served."""
    return [float(x[0, 0]) - float(i[0]) for x, i in loader]


@pytest.mark.parametrize("written", [{}, {"num_workers": 2}], ids=["nothing-written", "workers-written"])
def test_workers_not_kept_alive_by_the_caller_see_every_change_between_epochs(
        state: str, written: dict[str, Any]) -> None:
    # torch starts its workers afresh every epoch, so they see what the main process changed in
    # between: an attribute, a swapped transform. Workers the drop-in kept alive on its own would
    # serve the dataset as it was when they started (a settled loader did, epoch after epoch).
    def loop(loader: Any, g: Any) -> list[list[float]]:
        out = []
        for epoch in range(4):
            loader.dataset.start = epoch
            loader.dataset.transform = Add(100.0 * epoch)
            out.append(_offsets(loader))
        return out

    class Both(WithTransform, Mutable):
        pass

    expected, got = both(state, loop, lambda: Both(40), kwargs=lambda ds, g: {
        "batch_size": 4, **written})
    assert [set(e) for e in expected] == [{101.0 * k} for k in range(4)]  # each epoch saw its change
    assert_same(expected, got)


class LongerThanItsLength(tud.Sampler[int]):
    """Yields every index of a dataset of ``n`` one and a half times, but says its length is ``n``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        yield from range(self.n)
        yield from range(self.n // 2)

    def __len__(self) -> int:
        return self.n


def test_a_sampler_longer_than_its_length_is_served_to_its_end(state: str) -> None:
    # torch serves what the sampler yields, whatever its __len__ says; so does the drop-in, exploring
    # and settled (a settled loader stopped at __len__ and dropped the rest without a word).
    def loop(loader: Any, g: Any) -> list[list[int]]:
        return [[int(i) for _, batch in loader for i in batch] for _ in range(3)]

    expected, got = both(state, loop, lambda: Indexed(40), kwargs=lambda ds, g: {
        "batch_size": 4, "sampler": LongerThanItsLength(40)})
    assert all(len(e) == 60 for e in expected)
    assert_same(expected, got)


def test_a_dataset_that_reseeds_the_global_rng_per_sample_is_served_as_torch_serves_it(state: str) -> None:
    # torchvision's FakeData seeds the global RNG per index and restores it: thread workers share
    # that state and race on it (a sample of one index drawn under another's seed), so the drop-in
    # never loads such a dataset on threads; the settled-threads state settles on processes instead.
    import torchvision

    def loop(loader: Any, g: Any) -> list[Any]:
        return epoch_batches(loader, g, 2)

    def fake() -> Any:
        return torchvision.datasets.FakeData(size=96, image_size=(3, 8, 8),
                                             transform=torchvision.transforms.PILToTensor())

    loader = make(state, fake(), batch_size=4)
    assert all(not c.threaded for c in _candidates_served(loader))
    del loader
    expected, got = both(state, loop, fake, kwargs=lambda ds, g: {"batch_size": 4, "shuffle": True,
                                                                 "generator": g}, generator=True)
    assert_same(expected, got)


def _candidates_served(loader: Any) -> list[Any]:
    """The candidates the loader serves: its settled one, or the exploring stand-in's rotation."""
    settled_on = loader._tuning.settled
    if settled_on is not None:
        return [settled_on]
    return list(loader._tuning.next_candidate.__self__.candidates)


# -- torch's leniencies and errors are torch's (NOTE [ Untuned ] in autotune/loader.py) ------------


class WithoutLength(tud.Dataset):
    """Map-style, with no ``__len__``: torch serves it through a sampler that has one."""

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([float(i)])


class LengthRaises(Indexed):
    def __len__(self) -> int:
        raise RuntimeError("this dataset cannot tell its length")


LENIENT = {
    "empty-dataset": (lambda: Indexed(0), {"batch_size": 4}),
    "no-len-with-a-sampler": (WithoutLength, {"batch_size": 2, "sampler": list(range(6))}),
    "num_workers=True": (lambda: Indexed(12), {"batch_size": 2, "num_workers": True}),
    "pin_memory='yes'": (lambda: Indexed(12), {"batch_size": 2, "pin_memory": "yes"}),
    "num_workers=2.5": (lambda: Indexed(12), {"batch_size": 2, "num_workers": 2.5}),
    "prefetch_factor=0": (lambda: Indexed(12), {"batch_size": 2, "num_workers": 2, "prefetch_factor": 0}),
    "len-raises": (lambda: LengthRaises(12), {"batch_size": 2}),
    "dataset=None": (lambda: None, {"batch_size": 2}),
}


def _outcome(make: Any, dataset: Any, kwargs: dict[str, Any]) -> tuple[str, Any]:
    """(where it failed, and with what type; or "served" and the epochs' batches)."""
    try:
        loader = make(dataset, **kwargs)
    except Exception as err:  # noqa: BLE001 - the type and the moment are what is compared
        return "construction", type(err).__name__
    try:
        return "served", [canon(list(loader)) for _ in range(2)]
    except Exception as err:  # noqa: BLE001
        return "iteration", type(err).__name__


@pytest.mark.filterwarnings("ignore:'pin_memory' argument is set as true:UserWarning")
@pytest.mark.parametrize("case", [
    pytest.param(case, marks=pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning"))
    # torch's own iterator, refused half-made, fails again when it is collected (torch's noise)
    if case == "prefetch_factor=0" else case
    for case in LENIENT
])
def test_what_torch_accepts_or_refuses_the_drop_in_accepts_or_refuses_alike(case: str) -> None:
    # The same batches where torch serves; the same error type, at the same moment, where it fails.
    dataset, kwargs = LENIENT[case]
    expected = _outcome(tud.DataLoader, dataset(), kwargs)
    got = _outcome(lambda ds, **kw: autotune.DataLoader(ds, cache=False, **kw), dataset(), kwargs)
    assert got == expected


def test_a_loader_pickles_and_deep_copies_after_an_epoch(state: str) -> None:
    # torch's loader pickles between epochs; a drop-in that explored or settled does too, and the
    # copy serves the same batches as the original would.
    import copy

    loader = make(state, Indexed(40), batch_size=4)
    first = canon(list(loader))
    for clone in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert canon(list(clone)) == first  # sequential sampler: the same batches every epoch


# -- a randomised differential test: datasets that change between epochs --------------------------


class Changing(Indexed):
    """Sample i is ``transform(data[i] + start)``: an attribute, a swappable transform and a tensor
    that the loops below change between epochs, as curricula and users do."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.data = torch.arange(n, dtype=torch.float32).repeat(3, 1).T.contiguous()
        self.start = 0.0
        self.transform: Any = Add(0.0)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return self.transform(self.data[i] + self.start), i


CHANGES = ("attribute", "transform", "in-place", "nothing")
WRITTEN: tuple[dict[str, Any], ...] = (
    {}, {"num_workers": 1}, {"num_workers": 2}, {"num_workers": 2, "persistent_workers": True},
    {"shuffle": True}, {"shuffle": True, "num_workers": 2},
)
CASES = tuple(itertools.product(CHANGES, WRITTEN, STATES))
"""Every change with every written setting in every state, once."""
CASE_PARTS = 3


def _change(ds: Changing, how: str, epoch: int) -> None:
    if how == "attribute":
        ds.start = 10.0 * epoch
    elif how == "transform":
        ds.transform = Add(100.0 * epoch)
    elif how == "in-place":
        ds.data.add_(1000.0)


@pytest.mark.parametrize("part", range(CASE_PARTS))
def test_datasets_changed_between_epochs_are_served_as_torch_serves_them(part: int) -> None:
    # Every case (a change made before every epoch, the settings a user wrote, the drop-in's state) over
    # a dataset of its own size; the drop-in must deliver torch's batches, epoch by epoch. In
    # CASE_PARTS tests, each well within the suite's per-test time limit on a busy machine.
    failures = []
    mine = CASES[part::CASE_PARTS]
    for how, written, state in mine:
        case = CHANGES.index(how) * len(WRITTEN) + WRITTEN.index(written)  # torch's result: one per case
        n = (16, 24, 30)[case % 3]

        def loop(loader: Any, g: Any, how: str = how) -> list[Any]:
            out = []
            for epoch in range(3):
                _change(loader.dataset, how, epoch)
                out.append(canon(list(loader)))
            return out

        expected, got = both(state, loop, lambda n=n: Changing(n), generator="shuffle" in written,
                             seed=case, oracle_key=f"changed-{case}",
                             kwargs=lambda ds, g, w=written: {"batch_size": 4, **w,
                                                              **({"generator": g} if g else {})})
        if got != expected:
            failures.append((case, how, written, state))
    assert not failures, f"{len(failures)} of {len(mine)} cases differ from torch: {failures[:5]}"
