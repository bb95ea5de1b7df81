"""What tests/test_conformance.py runs on both loaders: datasets, samplers, worker functions, the
factory for the drop-in's states, and the checks (same output, hard time limits, leftovers).

Everything a worker process may call is defined at module level, so it pickles under ``spawn``.
"""

from __future__ import annotations

import atexit
import contextlib
import faulthandler
import gc
import glob
import itertools
import json
import os
import signal
import tempfile
import threading
import time
import traceback
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psutil
import torch
import torch.utils.data as tud
from shm_owners import others
from torch.utils.data import Dataset, IterableDataset, Sampler, get_worker_info

import autotune

SEED = 1234
"""The seed of the global RNG and of the generators both loaders get."""

N = 400
"""Samples in the usual dataset: at 4 per batch, 100 batches, served in the exploring state in
stretches by many candidates (test_exploring_serves_stretches_by_several_candidates)."""

SWITCH_EVERY = 7
"""Items per stretch of the exploring state's stand-in policy (see ``switching``)..."""

SPAWN_SWITCH_EVERY = 34
"""...with workers started by ``spawn`` or ``forkserver``, which import torch anew in every worker:
three switches an epoch, not fourteen, so a loaded machine still runs the test in its time limit."""

BATCH = 4
EPOCHS = 3

STATES = ("exploring", "settled-processes", "settled-threads")
"""The drop-in's states (see ``make``)."""

STREAM_STATES = ("exploring", "settled-processes")
"""The states a drop-in over an IterableDataset can be in: thread workers serve map-style datasets
only (NOTE [ Thread workers ] in autotune/threads.py), so no drop-in settles on them for a stream."""

# -- the loaders ----------------------------------------------------------------------------------


def make(state: str, dataset: Any, *, torch_threads: Any = "auto", **torch_kwargs: Any) -> Any:
    """A loader over ``dataset`` with the torch arguments ``torch_kwargs``.

    ``"torch"``: ``torch.utils.data.DataLoader``, the oracle. The drop-in's states are all built as a
    user builds it, ``autotune.DataLoader(dataset, **torch_kwargs)``, then: ``"exploring"``, served in
    stretches by several candidates (``switching``); ``"settled-processes"`` and
    ``"settled-threads"``, settled on two worker processes or two thread workers (``settled``), as a
    loader does when its search ends or it finds its profile. What the user's arguments fix is
    kept: workers given are those workers, a stream keeps the workers it was given, and where thread
    workers cannot serve (a ``worker_init_fn``, workers given, a stream) the threads state settles
    on what can.
    """
    if state == "torch":
        return tud.DataLoader(dataset, **torch_kwargs)
    if state not in STATES:
        raise ValueError(f"state={state!r} is not one of {('torch', *STATES)}")
    loader = autotune.DataLoader(dataset, cache=False, torch_threads=torch_threads, **torch_kwargs)
    if loader.untuned is not None:
        return loader  # torch's own iteration serves it (NOTE [ Untuned ]): no state to put it in
    if state == "exploring":
        return switching(loader)
    threads = None if torch_threads == "auto" else torch_threads
    return settled(loader, "thread" if state == "settled-threads" else "process", threads)


def _allowed(loader: Any, candidates: list[Any]) -> list[Any]:
    """The candidates the user's arguments allow, as the drop-in's own search keeps to them."""
    tuning = loader._tuning
    fixed = tuning.fixed.fields()
    stream = tuning.plan.iterable
    out = []
    for c in candidates:
        if any(getattr(c, k) != v for k, v in fixed.items()):
            continue
        if c.threaded and (not tuning.threads_allowed or stream):
            continue
        if stream and c.num_workers != tuning.baseline.num_workers:
            continue
        out.append(c)
    return list(dict.fromkeys(out))


def settled(loader: Any, kind: str, threads: Any) -> Any:
    """``loader`` settled on two workers of ``kind`` (or, where the arguments fix them, on what
    they allow), as a stored profile settles it: a stand-in for the search's outcome only."""
    from dataclasses import replace

    b = replace(loader._tuning.baseline, torch_threads=threads)
    persistent = loader.worker_init_fn is None  # kept workers would skip worker_init_fn's later calls
    wanted = [
        replace(b, num_workers=2, prefetch_factor=2, persistent_workers=False, worker_kind="thread"),
        replace(b, num_workers=2, prefetch_factor=2, persistent_workers=persistent, worker_kind="process"),
        # Workers the caller did not ask to keep alive are started afresh each epoch.
        replace(b, num_workers=2, prefetch_factor=2, persistent_workers=False, worker_kind="process"),
        replace(b, persistent_workers=persistent and b.num_workers > 0),
        b,
    ]
    if kind == "process":
        wanted = wanted[1:]
    c = _allowed(loader, wanted)[0]
    loader._tuning.settle_from_profile(None, c)
    loader._serving.settle(c)
    return loader


def switching(loader: Any) -> Any:
    """``loader`` with a stand-in for its search policy that never settles and switches candidate
    every SWITCH_EVERY items, round two worker processes, two thread workers, the main process, one
    worker process and the baseline, of what the user's arguments allow.

    A stand-in for the policy only (which candidate serves which stretch, decided by measurements
    that vary from run to run): the stretches, their inner loaders, the feed, the hand-overs and the
    fall-backs are the drop-in's own. It makes every epoch of the exploring state cross several
    candidates of every kind at fixed points, whatever the machine's load.
    """
    from dataclasses import replace

    b = loader._tuning.baseline
    options = [
        replace(b, num_workers=2, prefetch_factor=2, persistent_workers=False, worker_kind="process"),
        replace(b, num_workers=2, prefetch_factor=1, persistent_workers=False, worker_kind="thread"),
        replace(b, num_workers=0, prefetch_factor=None, persistent_workers=False, worker_kind="process"),
        replace(b, num_workers=1, prefetch_factor=2, persistent_workers=False, worker_kind="process"),
        b,
    ]
    context = loader.multiprocessing_context
    method = context if isinstance(context, str) else getattr(context, "get_start_method", lambda: "fork")()
    policy = Switching(_allowed(loader, options),
                       SPAWN_SWITCH_EVERY if method in ("spawn", "forkserver") else SWITCH_EVERY)
    tuning = loader._tuning
    tuning.next_candidate = policy.next_candidate
    tuning.stretch_length = policy.stretch_length
    tuning.end_search_epoch = policy.never
    tuning.record = policy.ignore
    return loader


class Switching:
    """The stand-in policy of ``switching``: module-level, so a loader using it still pickles."""

    def __init__(self, candidates: list[Any], every: int) -> None:
        self.candidates = candidates
        self.every = every
        self.k = 0

    def next_candidate(self) -> Any:
        c = self.candidates[self.k % len(self.candidates)]
        self.k += 1
        return c, "online"

    def stretch_length(self, c: Any, epoch_items: Any) -> int:
        return self.every

    def never(self) -> None:
        return None

    def ignore(self, outcome: Any) -> None:
        return None


def run(state: str, loop: Callable[[Any, torch.Generator | None], Any], dataset: Any, *,
        generator: bool = False, seed: int = SEED, torch_threads: Any = "auto",
        kwargs: Callable[[Any, torch.Generator | None], dict[str, Any]] | None = None) -> Any:
    """``loop(loader, generator)`` on a loader built in ``state``, after seeding the global RNG.

    ``kwargs(dataset, generator)`` gives the torch arguments, built afresh for each run (a sampler
    that holds the generator must hold this run's). The loader is dropped before returning, and
    an exception's frames are cleared, so that a failing run leaves no loader (and no workers)
    alive in a traceback that pytest keeps.
    """
    torch.manual_seed(seed)
    g = torch.Generator().manual_seed(seed) if generator else None
    loader = None
    try:
        loader = make(state, dataset, torch_threads=torch_threads,
                      **(kwargs(dataset, g) if kwargs is not None else {}))
        return loop(loader, g)
    except BaseException as err:
        traceback.clear_frames(err.__traceback__)
        raise
    finally:
        del loader


_oracle: dict[str, Any] = {}
"""torch's results kept by ``both(..., oracle_key=...)``: they depend on nothing but the seeds."""


def both(state: str, loop: Callable[[Any, torch.Generator | None], Any],
         dataset: Callable[[], Any], *, oracle_key: str | None = None,
         **options: Any) -> tuple[Any, Any]:
    """``(torch's result, the drop-in's result)`` of the same loop, each on a fresh dataset.

    With ``oracle_key``, torch's result is computed once per key and reused (for the slow loops,
    under ``spawn`` or a timeout, which every state compares with).
    """
    expected = oracle(oracle_key, lambda: run("torch", loop, dataset(), **options))
    got = run(state, loop, dataset(), **options)
    return expected, got


def oracle(key: str | None, compute: Callable[[], Any]) -> Any:
    """torch's result, computed once per ``key`` (every time where ``key`` is ``None``)."""
    if key is None:
        return compute()
    if key not in _oracle:
        _oracle[key] = compute()
    return _oracle[key]


def epochs(loader: Any, g: torch.Generator | None, n: int = EPOCHS) -> list[dict[str, Any]]:
    """``n`` whole epochs: each one's batches, and the global RNG and generator states after it."""
    out = []
    for _ in range(n):
        out.append({"batches": canon(list(loader)), **rng_states(g)})
    return out


def epoch_batches(loader: Any, g: torch.Generator | None, n: int = EPOCHS) -> list[Any]:
    """``n`` whole epochs' batches, for the tests whose subject is not the RNG (the RNG's own tests
    are the order tests), so that each test fails for the behaviour it is about."""
    return [canon(list(loader)) for _ in range(n)]


def rng_states(g: torch.Generator | None) -> dict[str, Any]:
    return {"global_rng": canon(torch.get_rng_state()),
            "generator": canon(g.get_state()) if g is not None else None}


# -- comparing ------------------------------------------------------------------------------------


def canon(x: Any) -> Any:
    """``x`` as plain data that compares by value: a tensor as its dtype, shape and values."""
    if isinstance(x, torch.Tensor):
        return ("tensor", str(x.dtype), tuple(x.shape), x.tolist())
    if isinstance(x, tuple):
        return ("tuple", *[canon(v) for v in x])
    if isinstance(x, list):
        return [canon(v) for v in x]
    if isinstance(x, dict):
        return {k: canon(v) for k, v in x.items()}
    return x


def first_difference(expected: Any, got: Any, path: str = "") -> str | None:
    """Where ``got`` first differs from ``expected`` (both from :func:`canon`), or ``None``."""
    if isinstance(expected, list) and isinstance(got, list):
        for i, (e, g) in enumerate(zip(expected, got, strict=False)):
            d = first_difference(e, g, f"{path}[{i}]")
            if d is not None:
                return d
        if len(expected) != len(got):
            return f"{path or 'the result'}: torch gave {len(expected)} items, the drop-in {len(got)}"
        return None
    if isinstance(expected, dict) and isinstance(got, dict):
        if expected.keys() != got.keys():
            return f"{path}: keys {sorted(expected)} (torch) != {sorted(got)} (the drop-in)"
        for k in expected:
            d = first_difference(expected[k], got[k], f"{path}.{k}")
            if d is not None:
                return d
        return None
    if _is_tensor(expected) and _is_tensor(got) and expected[1:3] == got[1:3] and expected != got:
        flat_e, flat_g = _flat(expected[3]), _flat(got[3])
        k = next(k for k, (e, g) in enumerate(zip(flat_e, flat_g, strict=True)) if e != g)
        return (f"{path}: a {expected[1]} tensor of shape {expected[2]} differs first at flat index {k}:"
                f" torch gave {flat_e[k]}, the drop-in {flat_g[k]}")
    if expected != got:
        return f"{path}: torch gave {_short(expected)}, the drop-in {_short(got)}"
    return None


def _is_tensor(x: Any) -> bool:
    return isinstance(x, tuple) and len(x) == 4 and x[0] == "tensor"


def _flat(values: Any) -> list[Any]:
    if isinstance(values, list):
        return [v for item in values for v in _flat(item)]
    return [values]


def assert_same(expected: Any, got: Any) -> None:
    difference = first_difference(expected, got)
    assert difference is None, difference


def assert_same_epochs(expected: list[dict[str, Any]], got: list[dict[str, Any]]) -> None:
    """Per-epoch results: every epoch's batches first, so that a difference in order is reported as
    one, then the rest (the RNG states after each epoch)."""
    difference = first_difference([e["batches"] for e in expected], [g["batches"] for g in got],
                                  path="batches")
    assert difference is None, difference
    assert_same(expected, got)


def _short(x: Any, limit: int = 160) -> str:
    if isinstance(x, tuple) and x and x[0] == "tensor":
        values = x[3]
        if isinstance(values, list) and len(values) > 8:
            values = f"{values[:8]}... ({len(values)} values)"
        x = f"tensor({values}, dtype={x[1]}, shape={x[2]})"
    text = repr(x) if not isinstance(x, str) else x
    return text if len(text) <= limit else text[:limit] + "..."


def indices(batch: Any) -> list[int]:
    """The sample indices a batch carries (every dataset here encodes its index)."""
    if isinstance(batch, dict):
        return indices(batch["i"])
    if isinstance(batch, (tuple, list)):
        return indices(batch[-1])
    if isinstance(batch, torch.Tensor):
        return [int(v) for v in batch.reshape(-1)] if batch.dim() <= 1 else [int(v) for v in batch[:, 0]]
    return [int(batch)]


# -- datasets -------------------------------------------------------------------------------------


class Indexed(Dataset):
    """Sample i is ``(torch.full((3,), float(i)), i)``."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3,), float(i)), i


class RandomTransform(Indexed):
    """Sample i carries noise drawn from torch's RNG, as a random augmentation does."""

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.rand(3) + i, i


class Fails(Indexed):
    """Reading sample ``bad`` raises ``error(message)``, wherever it is read."""

    def __init__(self, n: int, bad: int, error: type[Exception]) -> None:
        super().__init__(n)
        self.bad = bad
        self.error = error

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.bad:
            raise self.error(f"sample {i} is corrupt")
        return super().__getitem__(i)


class Sleeps(Indexed):
    """Reading sample ``slow`` takes ``sleep_s``: longer than the caller's ``timeout``."""

    def __init__(self, n: int, slow: int, sleep_s: float) -> None:
        super().__init__(n)
        self.slow = slow
        self.sleep_s = sleep_s

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == self.slow:
            time.sleep(self.sleep_s)
        return super().__getitem__(i)


class RecordsReaders(Indexed):
    """Every read appends ``"<index> <thread id>"`` to ``folder/<pid>``: who read what."""

    def __init__(self, n: int, folder: str) -> None:
        super().__init__(n)
        self.folder = folder

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        with open(os.path.join(self.folder, str(os.getpid())), "a") as f:
            f.write(f"{i} {threading.get_ident()}\n")
        return super().__getitem__(i)


def readers(folder: str) -> dict[int, list[tuple[int, int]]]:
    """What :class:`RecordsReaders` recorded: pid -> [(index, thread id)]."""
    out: dict[int, list[tuple[int, int]]] = {}
    for path in glob.glob(os.path.join(folder, "*")):
        with open(path) as f:
            out[int(os.path.basename(path))] = [tuple(map(int, line.split())) for line in f]  # type: ignore[misc]
    return out


class OpensInWorkers(Dataset):
    """h5py/LMDB style: the file is opened by ``worker_init_fn`` (:func:`open_handle`) in each worker,
    never in the main process; sample i is the int64 stored at position i, ``1000 + i``."""

    def __init__(self, path: str, n: int = N) -> None:
        self.path = path
        self.n = n
        self.fd: int | None = None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if self.fd is None:
            raise RuntimeError("the file is not open: worker_init_fn opens it in each worker")
        value = int.from_bytes(os.pread(self.fd, 8, 8 * i), "little")
        return torch.tensor([value]), i


def write_values(path: str, n: int = N) -> None:
    with open(path, "wb") as f:
        for i in range(n):
            f.write((1000 + i).to_bytes(8, "little"))


def open_handle(worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    info.dataset.fd = os.open(info.dataset.path, os.O_RDONLY)


_INITIALISED: set[tuple[int, int]] = set()
"""(pid, thread id) of the workers in which :func:`mark_initialised` ran with worker info set."""


def mark_initialised(worker_id: int) -> None:
    info = get_worker_info()
    if info is not None and info.id == worker_id:
        _INITIALISED.add((os.getpid(), threading.get_ident()))


class ChecksInit(Indexed):
    """Sample i is ``(..., initialised, i)``: ``initialised`` is 1 where torch would load it: in the
    main thread of the main process with no worker info (no workers), or in a worker in which
    ``worker_init_fn`` (:func:`mark_initialised`) ran with that worker's info set; 0 elsewhere."""

    def __init__(self, n: int = N) -> None:
        super().__init__(n)
        self.main_pid = os.getpid()
        _INITIALISED.clear()  # thread ids are reused: only this run's marks count

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int, int]:  # type: ignore[override]
        in_main = (os.getpid() == self.main_pid and threading.current_thread() is threading.main_thread()
                   and get_worker_info() is None)
        ok = in_main or (os.getpid(), threading.get_ident()) in _INITIALISED
        return torch.full((3,), float(i)), int(ok), i


def record_worker_init(folder: str, main_pid: int, worker_id: int) -> None:
    """A ``worker_init_fn`` (with ``functools.partial``) that writes what it saw to ``folder``."""
    info = get_worker_info()
    seen = {
        "worker_id": worker_id,
        "info_id": None if info is None else info.id,
        "num_workers": None if info is None else info.num_workers,
        "seed": None if info is None else info.seed,
        "initial_seed": torch.initial_seed(),
        "in_main_process": os.getpid() == main_pid,
    }
    with open(os.path.join(folder, f"init-{uuid.uuid4().hex}.json"), "w") as f:
        json.dump(seen, f)


def take_worker_inits(folder: str) -> list[dict[str, Any]]:
    """What :func:`record_worker_init` wrote since the last call, sorted; the files are removed."""
    out = []
    for path in glob.glob(os.path.join(folder, "init-*.json")):
        with open(path) as f:
            out.append(json.load(f))
        os.unlink(path)
    return sorted(out, key=lambda d: json.dumps(d, sort_keys=True))


class VariableLength(Dataset):
    """Sample i has ``i % 3 + 1`` values: only a bucketing batch sampler can batch them."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((i % 3 + 1,), float(i)), i


class Buckets(Sampler[list[int]]):
    """Batches of samples of one length (``VariableLength``), buckets in turn."""

    def __init__(self, n: int, batch_size: int = BATCH) -> None:
        self.n = n
        self.batch_size = batch_size

    def _batches(self) -> list[list[int]]:
        out = []
        for length in range(3):
            bucket = [i for i in range(self.n) if i % 3 == length]
            out += [bucket[k:k + self.batch_size] for k in range(0, len(bucket), self.batch_size)]
        return sorted(out, key=lambda b: (b[0] % 7, b[0]))

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class ByLength(Sampler[int]):
    """The indices of ``VariableLength`` grouped by length, shortest first, in order within a group."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return iter(sorted(range(self.n), key=lambda i: (i % 3, i)))

    def __len__(self) -> int:
        return self.n


class UnevenBatches(Sampler[list[int]]):
    """Batches of 1, 2, 3, ... samples, from the end of the dataset backwards."""

    def __init__(self, n: int) -> None:
        self.n = n

    def _batches(self) -> list[list[int]]:
        order = list(range(self.n - 1, -1, -1))
        out, pos = [], 0
        for size in itertools.count(1):
            if pos >= len(order):
                return out
            out.append(order[pos:pos + size])
            pos += size
        return out

    def __iter__(self) -> Iterator[list[int]]:
        return iter(self._batches())

    def __len__(self) -> int:
        return len(self._batches())


class EvensThenOdds(Sampler[int]):
    """Every even index, then every odd one."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        return itertools.chain(range(0, self.n, 2), range(1, self.n, 2))

    def __len__(self) -> int:
        return self.n


DRAW_CAP = 200_000
"""Indices :class:`Forever` yields before it stops a loader that draws it eagerly (250 times what
200 batches of 4 need; a lazy loader never gets near it)."""


class Forever(Sampler[int]):
    """An infinite sampler (detectron2's TrainingSampler is one): 0, 1, ..., n-1, 0, 1, ... forever.

    A loader that draws it lazily, as torch's does, takes what it needs. One that tries to draw it
    whole would never return and would fill the machine's memory; past ``DRAW_CAP`` indices this
    sampler raises instead, so such a loader fails quickly and says why.
    """

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[int]:
        for drawn in itertools.count():
            if drawn >= DRAW_CAP:
                raise RuntimeError(
                    f"the infinite sampler was drawn {DRAW_CAP} indices ahead: the loader draws it eagerly")
            yield drawn % self.n


def as_dict(samples: list[tuple[torch.Tensor, int]]) -> dict[str, Any]:
    """A collate_fn: a dict of the stacked values, the indices and the batch's length."""
    return {"x": torch.stack([s[0] for s in samples]) * 2, "i": torch.tensor([s[1] for s in samples]),
            "n": len(samples)}


class Stream(IterableDataset):
    """0..n-1, each as ``torch.tensor([i])``, sharded between workers by ``get_worker_info()``."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __iter__(self) -> Iterator[torch.Tensor]:
        info = get_worker_info()
        start, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(start, self.n, step):
            yield torch.tensor([i])


class UnshardedStream(Stream):
    """0..n-1 in every process that iterates it: it ignores ``get_worker_info()``, as many do."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        for i in range(self.n):
            yield torch.tensor([i])


class SizedStream(Stream):
    """A sharded stream that also has ``__len__`` (torch's ``len(loader)`` uses it)."""

    def __len__(self) -> int:
        return self.n


# -- hard time limits -----------------------------------------------------------------------------


class Hung(BaseException):
    """Raised in the main thread when a time limit runs out. A BaseException, so that no
    ``except Exception`` on the way (the drop-in's candidate handling) can take it for a failure and
    retry."""


_deadlines: list[float] = []
"""Absolute monotonic deadlines, innermost last."""

BACKSTOP_S = 30.0
"""If the main thread is stuck where a signal cannot reach it, faulthandler dumps every thread's
stack to ``HANG_LOG`` and ends the process this long after the limit: a hang stops the run, it never
stalls it."""

HANG_LOG = os.path.join(tempfile.gettempdir(), f"autotune-conformance-{os.getpid()}.hang")
"""Where that dump goes (pytest captures stderr, and a process that ends this way prints no report)."""

_hang_fd: int | None = None


def _hang_log() -> int:
    global _hang_fd
    if _hang_fd is None:
        _hang_fd = os.open(HANG_LOG, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        atexit.register(_drop_empty_hang_log)
    return _hang_fd


def _drop_empty_hang_log() -> None:
    with contextlib.suppress(OSError):
        if os.path.getsize(HANG_LOG) == 0:
            os.unlink(HANG_LOG)


def _arm() -> None:
    if not _deadlines:
        signal.setitimer(signal.ITIMER_REAL, 0)
        faulthandler.cancel_dump_traceback_later()
        return
    left = max(min(_deadlines) - time.monotonic(), 0.001)
    signal.setitimer(signal.ITIMER_REAL, left)
    faulthandler.dump_traceback_later(left + BACKSTOP_S, exit=True, file=_hang_log())


@contextlib.contextmanager
def time_limit(seconds: float, what: str) -> Iterator[None]:
    """Raise :class:`Hung` in the main thread if the block runs longer than ``seconds``."""

    def on_alarm(signum: int, frame: Any) -> None:
        raise Hung(f"{what} did not finish within {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, on_alarm)
    _deadlines.append(time.monotonic() + seconds)
    _arm()
    try:
        yield
    finally:
        _deadlines.pop()
        _arm()
        signal.signal(signal.SIGALRM, previous)


# -- what is left afterwards ----------------------------------------------------------------------

SHM_DIR = "/dev/shm"

SHM_PREFIXES = ("torch_", "psm_", "sem.mp-", "autotune")
"""Names of the shared-memory files a loader can create: torch's own (``torch_<pid>_<n>``, its
libshm/file_system segments, which a killed worker leaves behind), Python's ``shared_memory`` and
multiprocessing's semaphores (``spawn``), and any autotune would name after itself."""

SETTLE_S = 5.0
"""How long a clean-up may take to finish after the loaders are dropped (torch joins a worker for up
to 5 s, MP_STATUS_CHECK_INTERVAL)."""


@dataclass(frozen=True)
class Snapshot:
    children: frozenset[int]
    threads: frozenset[threading.Thread]
    shm: frozenset[str]


def shm_files() -> frozenset[str]:
    """Shared-memory files of ours. Folders are not: caches kept for the node live in folders there
    and outlive their loaders by design (NOTE [ Node caches ]); a test's own are removed when it ends."""
    try:
        names = os.listdir(SHM_DIR)
    except OSError:
        return frozenset()
    return frozenset(n for n in names
                     if n.startswith(SHM_PREFIXES) and not os.path.isdir(os.path.join(SHM_DIR, n)))


def live_children() -> dict[int, psutil.Process]:
    out = {}
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if p.status() != psutil.STATUS_ZOMBIE:
                out[p.pid] = p
    return out


def _process_wide_helper(p: psutil.Process) -> bool:
    """multiprocessing's resource tracker or forkserver: started once per process by the first
    ``spawn``/``forkserver`` queue (torch's loader starts it just the same), and kept for its life."""
    try:
        cmdline = " ".join(p.cmdline())
    except psutil.Error:
        return True
    return "resource_tracker" in cmdline or "forkserver" in cmdline


def snapshot() -> Snapshot:
    return Snapshot(frozenset(live_children()), frozenset(threading.enumerate()), shm_files())


def _ours_or_unknown(names: set[str]) -> list[str]:
    """The new files that are not another program's (these machines are shared: ``shm_owners``)."""
    return sorted(names - others(sorted(names)))


def leftovers(before: Snapshot, settle_s: float = SETTLE_S) -> list[str]:
    """What was started since ``before`` and is still there after ``settle_s``: child processes,
    threads, shared-memory files. Leftover processes are then killed, so the next test starts clean."""
    deadline = time.monotonic() + settle_s
    collect = False  # a full collection takes a good part of a second in a long suite: only when needed
    while True:
        if collect:
            gc.collect()
        collect = True
        children = {pid: p for pid, p in live_children().items()
                    if pid not in before.children and not _process_wide_helper(p)}
        threads = [t for t in threading.enumerate() if t not in before.threads and t.is_alive()]
        shm = _ours_or_unknown(set(shm_files() - before.shm))
        if not (children or threads or shm) or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    out = []
    if children:
        out.append(f"child processes: {_describe(children)}")
    if threads:
        out.append(f"threads: {[t.name for t in threads]}")
    if shm:
        out.append(f"files in {SHM_DIR}: {shm}")
    for p in children.values():
        with contextlib.suppress(psutil.Error):
            p.kill()
    return out


def _describe(children: dict[int, psutil.Process]) -> list[str]:
    out = []
    for pid, p in children.items():
        try:
            out.append(f"{pid} ({' '.join(p.cmdline())[:80]})")
        except psutil.Error:
            out.append(str(pid))
    return out


class SlowFirst(Indexed):
    """Sample 0 takes ``sleep_s``: longer than the drop-in's limit for a candidate's batch."""

    def __init__(self, n: int, sleep_s: float) -> None:
        super().__init__(n)
        self.sleep_s = sleep_s

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        if i == 0:
            time.sleep(self.sleep_s)
        return super().__getitem__(i)


class Mutable(Indexed):
    """Samples offset by ``start``, which the main process changes between epochs: workers kept
    alive (persistent) keep seeing the value they started with, as with torch."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.start = 0

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        x, y = super().__getitem__(i)
        return x + self.start, y


def nested_collate(samples: list[Any]) -> Any:
    """A batch of samples of their own lengths as one nested tensor, and their indices."""
    return torch.nested.nested_tensor([torch.zeros(1 + i % 3) for _, i in samples]), [i for _, i in samples]
