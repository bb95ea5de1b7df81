"""The search space: feasibility by construction, bounds, and clear errors for bad choices."""

from __future__ import annotations

import optuna
import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autotune.exceptions import ConfigurationError
from autotune.machine import detect_machine
from autotune.measure import quiet_worker_warning
from autotune.space import (
    MAX_WORKERS,
    WORKERS_PER_CPU,
    Candidate,
    build_space,
    resolve_batch_sizes,
    worker_bound,
)
from autotune.study import params_of, suggest, warm_starts

DATA = TensorDataset(torch.zeros(64, 2), torch.zeros(64))


def _space(cuda: bool = False, **kw):
    kw.setdefault("batch_size", [8, 16, 32])
    return build_space(detect_machine(), dataset_len=64, cuda=cuda,
                       pretransforms=("none", "ram", "device"), **kw)


@pytest.mark.parametrize("cuda", [False, True])
def test_every_grid_candidate_is_accepted_by_the_dataloader(cuda: bool) -> None:
    space = _space(cuda)
    grid = list(space.grid())
    assert len(grid) == len(set(grid)) == space.size()
    for c in grid:
        assert space.check(c) is None, c
        with quiet_worker_warning():  # PyTorch's advice on worker counts, not an error
            DataLoader(DATA, **c.loader_kwargs())  # raises on an invalid combination
    # pin_memory appears only with CUDA; the device strategy only with CUDA and without workers.
    assert any(c.pin_memory for c in grid) == cuda
    assert all(c.num_workers == 0 for c in grid if c.pretransform == "device")
    assert any(c.pretransform == "device" for c in grid) == cuda


@pytest.mark.parametrize("cuda", [False, True])
def test_every_sampled_candidate_is_feasible(cuda: bool) -> None:
    space = _space(cuda)
    study = optuna.create_study(direction="maximize",
                                sampler=optuna.samplers.RandomSampler(seed=1))
    for c in warm_starts(space, usable_cpus=2):
        study.enqueue_trial(params_of(c, space))
    for i in range(200):
        trial = study.ask()
        c = suggest(trial, space)
        assert space.check(c) is None, c
        with quiet_worker_warning():
            DataLoader(DATA, **c.loader_kwargs())
        study.tell(trial, float(i))


def test_warm_starts_reproduce_their_candidates_through_the_sampler() -> None:
    space = _space()
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
