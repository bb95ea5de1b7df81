"""The search space: feasibility by construction, bounds, and clear errors for bad choices."""

from __future__ import annotations

import optuna
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autotune.exceptions import ConfigurationError
from autotune.machine import detect_machine
from autotune.measure import CandidateLoader
from autotune.space import (
    MAX_WORKERS,
    WORKERS_PER_CPU,
    Candidate,
    build_space,
    resolve_batch_sizes,
    resolve_in_order,
    worker_bound,
)
from autotune.study import params_of, suggest, warm_starts
from autotune.threads import ThreadDataLoader

DATA = TensorDataset(torch.zeros(64, 2), torch.zeros(64))


def _space(cuda: bool = False, **kw):
    kw.setdefault("batch_size", [8, 16, 32])
    return build_space(detect_machine(), dataset_len=64, cuda=cuda,
                       pretransforms=("none", "ram", "device"), **kw)


SPACES = {
    "processes": {},
    "threads-too": {"thread_workers": True, "in_order_choices": (True, False)},
    "threads-only": {"thread_workers": True, "max_workers": 0, "in_order_choices": (True, False)},
}
"""The kinds of space the caller builds: worker processes only (streams), both kinds (map-style
datasets), thread workers only (data on the GPU, or that cannot be pickled)."""


def _accepted(c: Candidate) -> None:
    """Build the loader the candidate's kwargs are for; both classes raise on an invalid combination."""
    assert c.loader_class.endswith((ThreadDataLoader if c.threaded else DataLoader).__name__)
    # without PyTorch's advice on worker counts, which is not an error
    (ThreadDataLoader if c.threaded else CandidateLoader)(DATA, **c.loader_kwargs())


@pytest.mark.parametrize("kind", SPACES)
@pytest.mark.parametrize("cuda", [False, True])
def test_every_grid_candidate_is_accepted_by_the_dataloader(cuda: bool, kind: str) -> None:
    space = _space(cuda, **SPACES[kind])
    grid = list(space.grid())
    assert len(grid) == len(set(grid)) == space.size()
    for c in grid:
        assert space.check(c) is None, c
        _accepted(c)
        assert Candidate.from_loader_kwargs(c.loader_kwargs(), pretransform=c.pretransform,
                                            torch_threads=c.torch_threads) == c
    # pin_memory appears only with CUDA; the device strategy only with CUDA and without worker
    # processes; threads and out-of-order delivery only where the caller allows them.
    assert any(c.pin_memory for c in grid) == cuda
    assert all(c.threaded for c in grid if c.pretransform == "device" and c.num_workers)
    assert any(c.pretransform == "device" for c in grid) == cuda
    assert any(c.threaded for c in grid) == (kind != "processes")
    assert any(c.num_workers and not c.threaded for c in grid) == (kind != "threads-only")
    assert any(not c.in_order for c in grid) == (kind != "processes")


@pytest.mark.parametrize("kind", SPACES)
@pytest.mark.parametrize("cuda", [False, True])
def test_every_sampled_candidate_is_feasible(cuda: bool, kind: str) -> None:
    space = _space(cuda, **SPACES[kind])
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=1))
    for c in warm_starts(space, usable_cpus=2):
        study.enqueue_trial(params_of(c, space))
    drawn = set()
    for i in range(200):
        trial = study.ask()
        c = suggest(trial, space)
        assert space.check(c) is None, c
        _accepted(c)
        drawn.add((c.worker_kind if c.num_workers else "none", c.in_order))
        study.tell(trial, float(i))
    # Every kind the space holds is actually drawn.
    expected = {("none", True), ("process", True), ("process", False), ("thread", True), ("thread", False)}
    assert drawn == {k for k in expected if any(
        (c.worker_kind if c.num_workers else "none", c.in_order) == k for c in space.grid())}


@pytest.mark.parametrize("kind", SPACES)
def test_warm_starts_reproduce_their_candidates_through_the_sampler(kind: str) -> None:
    space = _space(**SPACES[kind])
    starts = warm_starts(space, usable_cpus=2)
    study = optuna.create_study(direction="maximize")
    for c in starts:
        study.enqueue_trial(params_of(c, space))
    drawn = [suggest(study.ask(), space) for _ in starts]
    assert drawn == starts


def test_worker_bound_follows_usable_cpus_and_ranks() -> None:
    assert worker_bound(2) == 2 * WORKERS_PER_CPU
    assert worker_bound(8, local_world_size=4) == 2 * WORKERS_PER_CPU
    assert worker_bound(1000) == MAX_WORKERS
    assert worker_bound(1, local_world_size=8) == WORKERS_PER_CPU  # never below one CPU's worth


def test_infeasible_combinations_are_explained() -> None:
    space = _space(cuda=False)
    assert "CUDA" in (space.check(Candidate(8, pin_memory=True)) or "")
    assert "num_workers > 0" in (space.check(Candidate(8, 0, prefetch_factor=2)) or "")
    assert "outside" in (space.check(Candidate(8, space.max_workers + 1, False, 2, True)) or "")
    cuda_space = _space(cuda=True)
    reason = cuda_space.check(Candidate(8, 2, False, 2, True, "device"))
    assert reason is not None and "_share_filename_" in reason
    assert "thread workers" in (space.check(Candidate(8, 2, False, 2, False, worker_kind="thread")) or "")
    assert "out-of-order" in (space.check(Candidate(8, 2, False, 2, True, in_order=False)) or "")
    assert "num_workers=0" in (space.check(Candidate(8, worker_kind="thread")) or "")
    threads = _space(cuda=True, thread_workers=True, max_workers=0,
                     excluded={"num_workers>0": "the dataset holds CUDA tensors"})
    assert threads.check(Candidate(8, 2, False, 2, False, "device", worker_kind="thread")) is None
    assert "never persistent" in (threads.check(Candidate(8, 2, False, 2, True, worker_kind="thread")) or "")
    assert "holds CUDA tensors" in (threads.check(Candidate(8, 2, False, 2, True)) or "")


def test_out_of_order_is_searched_only_where_order_does_not_matter() -> None:
    assert resolve_in_order(None, shuffle=True) == (True, False)
    assert resolve_in_order(None, shuffle=False) == (True,)
    assert resolve_in_order(True, shuffle=True) == (True,)
    assert resolve_in_order(False, shuffle=False) == (True, False)
    with pytest.raises(ConfigurationError, match=r"in_order='yes' must be True, False or None"):
        resolve_in_order("yes", shuffle=True)  # type: ignore[arg-type]


def test_labels_and_kwargs_say_what_a_plain_dataloader_can_express() -> None:
    threaded = Candidate(64, 2, False, 2, False, worker_kind="thread", in_order=False)
    assert threaded.label() == "bs=64 w=2 thr pf=2 unordered"
    assert Candidate(64, 3, False, 2, True).label() == "bs=64 w=3 pf=2 persist"
    # A plain DataLoader takes in_order (torch >= 2.6) but has no thread workers: their kwargs are
    # ThreadDataLoader's and a plain DataLoader refuses them instead of silently loading without.
    DataLoader(DATA, **Candidate(8, 2, False, 2, True, in_order=False).loader_kwargs())
    with pytest.raises(TypeError, match="worker_threads"):
        DataLoader(DATA, **threaded.loader_kwargs())
    assert threaded.loader_kwargs()["num_workers"] == 0


def test_batch_size_resolution() -> None:
    assert resolve_batch_sizes(64, 1000) == ((64,), 64)
    sizes, baseline = resolve_batch_sizes(None, 100)
    assert max(sizes) <= 100 and baseline in sizes
    assert resolve_batch_sizes([128, 32], 1000) == ((32, 128), 32)


@pytest.mark.parametrize(
    ("value", "match"),
    [
        (0, r"batch_size=0 is not a positive integer"),
        (-4, r"batch_size=-4 is not a positive integer"),
        (2.5, r"batch_size=2.5 is not a positive integer"),
        (1000, r"batch_size=1000 is larger than the dataset \(64 samples\)"),
        ([], r"batch_size=\[\] is empty"),
    ],
)
def test_bad_batch_sizes_are_refused_with_the_value_and_the_fix(value, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        resolve_batch_sizes(value, 64)


def test_max_workers_caps_the_bound_and_is_validated() -> None:
    assert _space(max_workers=1).max_workers == 1
    with pytest.raises(ConfigurationError, match=r"max_workers=-1 must be a non-negative integer"):
        _space(max_workers=-1)
    assert _space(thread_workers=True, max_threads=3).max_threads == 3
    assert _space(max_threads=3).max_threads == 0  # thread workers only where the caller allows them
    with pytest.raises(ConfigurationError, match=r"max_threads=-2 must be a non-negative integer"):
        _space(thread_workers=True, max_threads=-2)


MIB = 1 << 20


def test_worker_processes_are_bounded_by_what_dev_shm_holds() -> None:
    # Samples of 1 MiB in batches of 16: every batch in flight takes 16 MiB of a 64 MiB /dev/shm.
    space = _space(batch_size=16, thread_workers=True, sample_bytes=MIB, shm_free_bytes=64 * MIB)
    assert space.check(Candidate(16, 2, False, 1, True)) is None  # 3 batches: 48 MiB
    assert space.check(Candidate(16, 2, False, 2, True)) == (
        "needs ~80 MiB of /dev/shm for 5 batches of 16 MiB in flight (2 workers x prefetch_factor 2"
        " + 1 held by the loop), more than the 64 MiB free; fewer workers, prefetch_factor=1 or thread"
        " workers need less, a larger /dev/shm (docker run --shm-size=1g) lifts it"
    )
    # Thread workers pass nothing through /dev/shm.
    assert space.check(Candidate(16, 4, False, 8, False, worker_kind="thread")) is None
    grid = list(space.grid())
    assert all(space.check(c) is None for c in grid)
    assert {(c.num_workers, c.prefetch_factor) for c in grid if c.num_workers and not c.threaded} == {
        (1, 1), (1, 2), (2, 1)}
    # The rule of thumb fits on 2 CPUs (1 worker); on 4 (3 workers, 7 batches) it is recorded as left out.
    assert space.left_out(usable_cpus=2) == []
    [(rule, why)] = space.left_out(usable_cpus=4)
    assert (rule.num_workers, rule.prefetch_factor) == (3, 2) and "of /dev/shm" in why
    # Without a sample size, /dev/shm bounds nothing ahead (a candidate that runs out fails instead).
    unknown = _space(batch_size=16, sample_bytes=None, shm_free_bytes=64 * MIB)
    assert unknown.check(Candidate(16, 8, False, 8, True)) is None


def test_where_no_worker_process_fits_dev_shm_none_is_searched() -> None:
    # Batches of 32 MiB: even one worker at prefetch_factor=1 keeps two of them, 64 MiB and more.
    space = _space(batch_size=16, thread_workers=True, sample_bytes=2 * MIB, shm_free_bytes=64 * MIB)
    assert not space.processes_fit()
    assert space.worker_kinds() == ("thread",)
    assert not any(c.num_workers and not c.threaded for c in space.grid())
    study = optuna.create_study(direction="maximize", sampler=optuna.samplers.RandomSampler(seed=1))
    for i in range(50):
        trial = study.ask()
        c = suggest(trial, space)
        assert space.check(c) is None, c
        study.tell(trial, float(i))
    [(rule, why)] = space.left_out(usable_cpus=2)
    assert rule == space.heuristic(usable_cpus=2)
    assert (rule.num_workers, rule.prefetch_factor) == (1, 2)
    assert why.startswith("needs ~96 MiB of /dev/shm for 3 batches of 32 MiB in flight (1 worker x")


def test_the_offline_plan_reads_what_a_sample_takes_in_a_batch() -> None:
    from autotune.plan import make_plan

    data = TensorDataset(torch.zeros(64, 3, 8, 8), torch.zeros(64, dtype=torch.int64))
    common = dict(batch_size=16, budget_s=5.0, device="cpu", epochs=2, pretransform="none", max_workers=None,
                  memory_budget_bytes=None, batch_timeout_s=None, shuffle=True, collate_fn=None, seed=0)
    space, _ = make_plan(data, None, **common).space()
    assert space.sample_bytes == 3 * 8 * 8 * 4 + 8  # the image's floats and the int64 target
    assert space.shm_free_bytes is not None
    # The drop-in reads no sample in this process: nothing is known ahead, unless it says.
    dropin = make_plan(data, None, read_samples=False, **common)
    assert dropin.space()[0].sample_bytes is None
    assert dropin.space(sample_bytes=1000)[0].sample_bytes == 1000
