"""Inside a container's limits, for real: a 64 MiB /dev/shm and a memory limit below free RAM.

Each test runs a small script in a child process inside the limit: a private mount namespace whose
/dev/shm is a 64 MiB tmpfs (Docker's default), or a child cgroup with a memory limit, made by the
helpers the containers benchmark uses (benchmarks/scripts/containers.py). They skip, with the reason, where
the limit cannot be made (not root, no unshare, no such controller). The host's /dev/shm is never
touched: the tmpfs goes with the child's namespace.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from collections.abc import Sequence
from pathlib import Path

import psutil
import pytest

from benchmarks.scripts.containers import Unavailable, child_cgroup, in_cgroup, small_shm

REPO = Path(__file__).resolve().parent.parent
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests")])}

PREAMBLE = """\
import glob, json, os, sys
import torch
torch.set_num_threads(1)  # two busy CPUs shared with other work: no intra-op threads fighting
from shm_workload import BigImages

def segments():
    return sorted(glob.glob("/dev/shm/torch_*"))
"""
"""What every script starts with: ``segments()`` lists what torch left in /dev/shm."""


@pytest.fixture(scope="module")
def shm64() -> list[str]:
    """The command prefix that runs a command with a 64 MiB /dev/shm; skips where none can be made."""
    try:
        prefix = small_shm(64)
    except Unavailable as err:
        pytest.skip(str(err))
    probe = subprocess.run([*prefix, "true"], capture_output=True, text=True, timeout=60)
    if probe.returncode != 0:
        pytest.skip(f"cannot mount a private /dev/shm here: {probe.stderr.strip()[-300:]}")
    return prefix


def _run(prefix: Sequence[str], argv: Sequence[str]) -> subprocess.CompletedProcess[str]:
    # The environment as it is now: the test's own profile folder (and node caches), set per test.
    env = {**os.environ, "PYTHONPATH": ENV["PYTHONPATH"]}
    proc = subprocess.run([*prefix, *argv], capture_output=True, text=True, timeout=600, env=env, cwd=REPO)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def _script(prefix: Sequence[str], body: str) -> dict:
    """Run PREAMBLE + ``body`` under ``prefix``; the JSON its last line prints."""
    proc = _run(prefix, [sys.executable, "-c", PREAMBLE + textwrap.dedent(body)])
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_the_drop_in_trains_through_a_small_dev_shm(shm64: list[str]) -> None:
    # Batches of 64 3x224x224 float images are 38.5 MB: no worker process can pass two of them
    # through 64 MiB. The loader explores in the user's epochs; what runs out of /dev/shm is a
    # failed candidate, and the epochs go on, every sample once.
    seen = _script(shm64, """
        from autotune import DataLoader
        n = 1920  # 30 batches an epoch: room for a measured stretch of two worker processes
        loader = DataLoader(BigImages(n), batch_size=64, shuffle=True, epochs=3, cache=False,
                            torch_threads=None)
        epochs = []
        for _ in range(3):
            indices = []
            for images, index in loader:
                assert images.shape[1:] == (3, 224, 224) and images.dtype == torch.float32
                indices += index.tolist()
            epochs.append(sorted(indices) == list(range(n)))
        result = loader.tuning
        loader.close()
        print(json.dumps({"epochs": epochs, "left": segments(),
                          "reasons": [t.reason for t in result.trials if t.reason],
                          "decision": result.decision}))
    """)
    assert seen["epochs"] == [True, True, True]  # training completed, every sample once an epoch
    assert seen["left"] == []
    named = [r for r in seen["reasons"] + [seen["decision"]] if "/dev/shm (64 MiB)" in r]
    assert named, seen
    assert "docker run --shm-size=1g" in named[0]


def test_the_users_own_workers_get_torchs_error(shm64: list[str]) -> None:
    # num_workers=2 written: the baseline is what the user runs, and its failure is the user's, as
    # torch raises it (torch is the oracle: the same error from a plain DataLoader). Batches of 128
    # (77 MB) do not fit at all, so torch's error comes from every worker's collate, deterministically
    # (with smaller ones, torch itself may lose a batch in a worker's queue and wait for ever).
    seen = _script(shm64, """
        import re
        import torch.utils.data as tud
        from autotune import DataLoader

        def first_error(loader):
            try:
                for _ in loader:
                    pass
            except Exception as err:
                head = re.sub(r"process \\d+", "process N", str(err).splitlines()[0])
                return [f"{type(err).__module__}.{type(err).__qualname__}", head,
                        "No space left on device" in str(err)]
            return None

        print(json.dumps({
            "ours": first_error(DataLoader(BigImages(256), batch_size=128, num_workers=2, cache=False)),
            "torch": first_error(tud.DataLoader(BigImages(256), batch_size=128, num_workers=2)),
        }))
    """)
    assert seen["torch"] == ["builtins.RuntimeError", "Caught RuntimeError in DataLoader worker process N.",
                             True]
    assert seen["ours"] == seen["torch"]


def test_a_stopped_iterator_leaves_nothing_in_dev_shm(shm64: list[str]) -> None:
    # A worker whose batch does not fit raises an error naming the segment torch created and could
    # not fill. An iterator stopped before that error is read (a stretch that is over) would leave
    # the segment in /dev/shm for good: torch's own shut-down does (the segments seen below).
    seen = _script(shm64, """
        import time
        import torch.utils.data as tud
        from autotune.supervise import stop_iterator
        it = iter(tud.DataLoader(BigImages(640), batch_size=64, num_workers=2))
        deadline = time.monotonic() + 60
        while not segments() and time.monotonic() < deadline:
            time.sleep(0.1)
        failed = segments()  # visible only when failed: torch unlinks a segment it filled at once
        stop_iterator(it)
        print(json.dumps({"failed": failed, "left": segments()}))
    """)
    assert seen["failed"], "no worker ran out of /dev/shm: nothing was tested"
    assert seen["left"] == []


def test_tune_loader_leaves_out_the_workers_dev_shm_cannot_hold(shm64: list[str]) -> None:
    seen = _script(shm64, """
        from autotune import report, tune_loader
        result = tune_loader(BigImages(640), batch_size=64, budget_s=15, epochs=3, cache=False,
                             progress=False)
        summary = report.summary(result)
        print(json.dumps({"left": segments(), "shm_bound": report.shm_bound(result),
                          "text": report.summary_text(result), "limits": summary["limits"],
                          "fix": summary["shm_fix"], "chosen": result.candidate.to_dict(),
                          "reasons": [t.reason for t in result.trials if t.reason]}))
    """)
    assert seen["left"] == []
    assert seen["shm_bound"]
    # The rule of thumb's worker processes are recorded with the figures that rule them out.
    assert any("of /dev/shm for 3 batches of 36 MiB in flight" in r for r in seen["reasons"]), seen
    chosen = seen["chosen"]
    assert chosen["num_workers"] == 0 or chosen["worker_kind"] == "thread"
    assert "/dev/shm 64 MiB" in seen["limits"]
    assert seen["fix"].startswith("docker run --shm-size=1g")
    assert "Limits:" in seen["text"] and "docker run --shm-size=1g" in seen["text"]


def test_the_command_line_reports_the_limits(shm64: list[str]) -> None:
    # The default workload with 10 000 samples: its ram cache (~120 MB) is more than a 64 MiB
    # /dev/shm can spare, so it is built in private memory; the header and the JSON name the limit.
    done = _run(shm64, ["sh", "-c", f'"{sys.executable}" -m autotune tune --json --samples 10000'
                        ' --budget 8 --no-cache && ls /dev/shm'])
    out = done.stdout
    document, listing = out[: out.rindex("}") + 1], out[out.rindex("}") + 1:]
    data = json.loads(document)
    assert "/dev/shm 64 MiB" in data["summary"]["limits"]
    assert "limits: " in done.stderr and "/dev/shm 64 MiB (" in done.stderr  # the header, with free space
    assert "torch_" not in listing


def test_a_cache_too_big_for_dev_shm_is_read_by_forked_workers_without_a_copy(shm64: list[str]) -> None:
    seen = _script(shm64, """
        from test_pretransform import BigTensors, _copy_cache, _worker_uss
        from autotune import pretransform as pt
        from autotune.exceptions import CandidateInfeasible
        from autotune.measure import build_loader
        from autotune.space import Candidate

        ds = BigTensors(2048)  # 96 MiB of images: more than the 64 MiB /dev/shm holds
        prepared = pt.prepare(ds, "ram", device=torch.device("cpu"))
        shared = _worker_uss(prepared, worker_init_fn=None)
        copied = _worker_uss(prepared, worker_init_fn=_copy_cache)
        try:
            build_loader(ds, Candidate(64, 2, prefetch_factor=2), prepared=prepared,
                         multiprocessing_context="spawn")
            refused = None
        except CandidateInfeasible as err:
            refused = str(err)
        print(json.dumps({"nbytes": prepared.nbytes, "in_shm": prepared.shared,
                          "fields_shared": [f.is_shared() for f in prepared.dataset.fields],
                          "shared": shared, "copied": copied, "refused": refused, "left": segments()}))
    """)
    assert not seen["in_shm"] and seen["fields_shared"] == [False, False]
    # As the shared cache's test: a private copy would show ~100 % (the control) or >= 50 % in USS.
    assert all(uss < 0.25 * seen["nbytes"] for uss in seen["shared"]), seen
    assert all(uss > 0.9 * seen["nbytes"] for uss in seen["copied"]), seen
    # Spawned workers would each get the cache copied through /dev/shm: refused with the reason.
    assert seen["refused"] is not None and "'spawn'" in seen["refused"]
    assert seen["left"] == []


def test_a_cache_filled_while_loading_fills_in_private_memory_where_dev_shm_cannot_spare_it(
        shm64: list[str]) -> None:
    # The drop-in fills its ram cache from the samples the epochs load (NOTE [ Filling caches ]).
    # Too big for a quarter of 64 MiB, and kept private to the process (no node cache), it is kept in
    # private memory: this process and its threads fill it; worker processes would fill copies of
    # their own, so they do not load through it.
    seen = _script(shm64, """
        os.environ["AUTOTUNE_NODE_CACHE"] = "off"
        from test_pretransform import BigTensors
        from autotune import pretransform as pt
        from autotune.exceptions import CandidateInfeasible
        from autotune.measure import build_loader
        from autotune.space import Candidate

        ds = BigTensors(512)  # 24 MiB of images
        prepared = pt.prepare(ds, "ram", device=torch.device("cpu"), fill="pass")
        try:
            build_loader(ds, Candidate(64, 2, prefetch_factor=2), prepared=prepared)
            refused = None
        except CandidateInfeasible as err:
            refused = str(err)
        thread = build_loader(ds, Candidate(64, 2, prefetch_factor=2, worker_kind="thread"),
                              prepared=prepared)
        got = sum(len(labels) for _, labels in thread)
        counts = prepared.fill_counts()
        same = all(torch.equal(prepared.dataset[i][0], ds[i][0]) for i in (0, 255, 511))
        print(json.dumps({"in_shm": prepared.shared, "refused": refused, "every": got == 512,
                          "complete": counts.complete, "same": same, "left": segments()}))
    """)
    assert seen["in_shm"] is False
    assert seen["refused"] is not None and "private memory" in seen["refused"]
    assert seen["every"] and seen["complete"] and seen["same"]
    assert seen["left"] == []


def test_a_node_cache_too_big_for_dev_shm_is_a_file_that_worker_processes_fill(
        shm64: list[str]) -> None:
    # The same cache kept for the node (NOTE [ Node caches ]): /dev/shm cannot spare it, so it is a
    # file under the profile folder, mapped by every process: worker processes fill it, and nothing
    # of it is left in /dev/shm.
    seen = _script(shm64, """
        os.environ.pop("AUTOTUNE_NODE_CACHE_DIR", None)  # where it goes by default
        from test_pretransform import BigTensors
        from autotune import pretransform as pt
        from autotune.measure import build_loader
        from autotune.space import Candidate

        ds = BigTensors(512)  # 24 MiB of images
        prepared = pt.prepare(ds, "ram", device=torch.device("cpu"), fill="pass")
        where = prepared.dataset.filler.node.path
        loader = build_loader(ds, Candidate(64, 2, prefetch_factor=2), prepared=prepared)
        got = sum(len(labels) for _, labels in loader)
        del loader
        counts = prepared.fill_counts()
        same = all(torch.equal(prepared.dataset[i][0], ds[i][0]) for i in (0, 255, 511))
        print(json.dumps({"where": where, "every": got == 512, "complete": counts.complete,
                          "same": same, "left": segments(), "cache_dir": os.environ["AUTOTUNE_CACHE_DIR"]}))
    """)
    assert seen["where"].startswith(os.path.join(seen["cache_dir"], "node-caches"))
    assert seen["every"] and seen["complete"] and seen["same"]
    assert seen["left"] == []


def test_running_out_of_dev_shm_is_the_candidates_failure(shm64: list[str]) -> None:
    seen = _script(shm64, """
        import os
        from shm_workload import BUS_FILE, UnreservedWrites
        from autotune.exceptions import CandidateError
        from autotune.measure import map_loader_error, measure
        from autotune.space import Candidate
        from autotune.supervise import MeasureLimits

        limits = MeasureLimits(window_s=0.5, min_batches=3, batch_timeout_s=60, trial_timeout_s=120)

        def failure(dataset, candidate):
            try:
                measure(dataset, candidate, limits=limits)
            except CandidateError as err:
                return f"{type(err).__name__}: {err}"
            return None

        out = {"worker": failure(BigImages(256), Candidate(64, 2, prefetch_factor=2))}
        out["left after worker"] = segments()
        # Code that maps /dev/shm without reserving it is killed by SIGBUS when the tmpfs runs out.
        out["bus"] = failure(UnreservedWrites(), Candidate(4, 1, prefetch_factor=1))
        os.unlink(BUS_FILE)
        # In this process: torch names the segment it could not fill, and leaves it behind.
        try:
            torch.empty(100 << 20, dtype=torch.uint8).share_memory_()
        except RuntimeError as err:
            out["left by torch"] = segments()
            mapped = map_loader_error(err)
            out["main"] = f"{type(mapped).__name__}: {mapped}"
        out["left"] = segments()
        print(json.dumps(out))
    """)
    assert seen["worker"].startswith("WorkerFailed: a worker process ran out of /dev/shm (64 MiB)")
    assert "docker run --shm-size=1g" in seen["worker"]
    assert seen["left after worker"] == []
    assert seen["bus"].startswith("WorkerFailed: a worker process ran out of /dev/shm (64 MiB)")
    assert "SIGBUS" in seen["bus"]
    assert len(seen["left by torch"]) == 1  # the cleanup check can fail: torch does leave one
    assert seen["main"].startswith("CandidateInfeasible: the main process ran out of /dev/shm (64 MiB)")
    assert seen["left"] == []


CACHE_BUDGET = """\
from autotune import pretransform as pt
from autotune.plan import ram_cache_budget
budget = ram_cache_budget()
print(json.dumps({"budget": budget,
                  "ram": pt.strategies(BigImages(4096), cuda=False, memory_budget_bytes=budget)["ram"]}))
"""
"""The ram cache's budget here and whether a cache of 4096 3x224x224 float images (2.5 GB) fits it."""


def test_a_memory_limit_below_free_ram_bounds_the_cache() -> None:
    limit = 1 << 30
    if psutil.virtual_memory().available < 12 * limit:
        pytest.skip("less than 12 GiB of free RAM: the 2.5 GB cache would not fit a quarter of it anyway")
    try:
        with child_cgroup("memory", {"v1": {"memory.limit_in_bytes": str(limit)},
                                     "v2": {"memory.max": str(limit)}},
                          f"autotune-test-{os.getpid()}-memory") as path:
            inside = _script(in_cgroup(path), CACHE_BUDGET)
    except Unavailable as err:
        pytest.skip(str(err))
    outside = _script([], CACHE_BUDGET)
    # Outside, a quarter of the free RAM holds the cache; under the 1 GiB limit a quarter of what
    # the limit leaves does not, and the refusal names that budget.
    assert outside["ram"] is None
    assert inside["budget"] <= limit // 4
    assert inside["ram"] is not None and "over the memory budget of" in inside["ram"]
