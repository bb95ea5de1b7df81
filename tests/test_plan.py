"""What both entry points share before measuring: the checks, the exclusions, the profile key."""

from __future__ import annotations

import warnings
from dataclasses import replace
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset

from autotune.exceptions import AutotuneWarning, ConfigurationError
from autotune.plan import CUDA_DATA, baseline_candidate, make_plan, ram_cache_budget
from autotune.space import Candidate

ARGS: dict[str, Any] = {
    "batch_size": 8, "budget_s": 10.0, "device": "cpu", "epochs": 3, "pretransform": "none",
    "max_workers": None, "memory_budget_bytes": None, "batch_timeout_s": None, "shuffle": True,
    "collate_fn": None, "seed": 0,
}


class Counted(Dataset):
    """Counts its reads: the drop-in's plan must make none."""

    def __init__(self, n: int = 40) -> None:
        self.n = n
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        return torch.full((3,), float(i)), i


class OnTheGpuStandIn(Counted):
    """A CPU stand-in for data already on an accelerator: its tensors say they are CUDA."""

    def __getitem__(self, i: int) -> Any:
        self.reads += 1
        return _FakeCuda()


class _FakeCuda(torch.Tensor):
    @property
    def is_cuda(self) -> bool:  # type: ignore[override]
        return True


class Unsharded(IterableDataset):
    def __iter__(self):  # noqa: ANN204 - every worker would replay it all
        yield from range(10)


def test_the_key_is_stable_and_changes_with_what_is_fixed() -> None:
    a = make_plan(Counted(), None, **ARGS)
    assert a.key == make_plan(Counted(), None, **ARGS).key
    assert a.key != make_plan(Counted(), None, **{**ARGS, "epochs": 4}).key
    assert a.key != make_plan(Counted(), None, **ARGS, baseline={"num_workers": 4}).key
    assert a.key != make_plan(Counted(50), None, **ARGS).key


def test_the_drop_in_s_plan_reads_no_sample() -> None:
    ds = Counted()
    plan = make_plan(ds, None, **{**ARGS, "budget_s": None}, read_samples=False)
    assert ds.reads == 0 and plan.budget_s is None
    assert "attributes" in plan.workload["sample"]  # described without a sample
    ds2 = Counted()
    make_plan(ds2, None, **ARGS)
    assert ds2.reads > 0  # tune_loader reads a sample or two, and checks they batch


def test_an_empty_dataset_is_refused_for_tuning_but_planned_for_the_drop_in() -> None:
    with pytest.raises(ConfigurationError, match="is empty"):
        make_plan(Counted(0), None, **ARGS)
    assert make_plan(Counted(0), None, **{**ARGS, "budget_s": None}, read_samples=False).dataset_len == 0


def test_bad_arguments_name_the_value_and_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"epochs=0 must be a positive integer"):
        make_plan(Counted(), None, **{**ARGS, "epochs": 0})
    with pytest.raises(ConfigurationError, match=r"baseline has num_workers=-2, which must be a non-neg"):
        make_plan(Counted(), None, **ARGS, baseline={"num_workers": -2})
    with pytest.raises(ConfigurationError, match=r"baseline has workers=2; the settings it may give"):
        make_plan(Counted(), None, **ARGS, baseline={"workers": 2})


def test_an_unsharded_stream_gets_no_workers_with_a_warning() -> None:
    with pytest.warns(AutotuneWarning, match="does not seem to shard"):
        plan = make_plan(Unsharded(), None, **{**ARGS, "batch_size": 2, "shuffle": False})
    assert plan.max_workers == 0 and "num_workers>0" in plan.excluded


def test_data_already_on_an_accelerator_gets_no_worker_processes() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the subclassed tensor's own deprecation noise, not ours
        try:
            plan = make_plan(OnTheGpuStandIn(), None, **{**ARGS, "collate_fn": list})
        except Exception:  # noqa: BLE001 - a stand-in torch may refuse to build
            pytest.skip("a CUDA stand-in tensor cannot be made on this torch")
    assert plan.max_workers == 0 and plan.excluded["num_workers>0"] == CUDA_DATA


def test_the_baseline_is_what_the_user_wrote_even_outside_the_space() -> None:
    c = baseline_candidate({"num_workers": 16, "pin_memory": True}, 32)
    assert c == Candidate(32, num_workers=16, pin_memory=True, prefetch_factor=2)
    assert baseline_candidate(None, 64) == Candidate(64)


def test_the_cache_budget_is_within_the_memory_budget() -> None:
    from autotune.supervise import process_memory

    assert ram_cache_budget(process_memory() + 1000) <= 1000
    assert ram_cache_budget(None) > 0


def test_pin_memory_written_is_feasible_without_cuda_and_never_proposed_there() -> None:
    pinned = Candidate(8, num_workers=2, prefetch_factor=2, pin_memory=True)
    written, _ = make_plan(Counted(), None, **ARGS, fixed={"pin_memory": True}).space(sample_bytes=12)
    searched, _ = make_plan(Counted(), None, **ARGS).space(sample_bytes=12)
    assert written.check(replace(pinned, persistent_workers=written.persistent)) is None
    assert searched.check(replace(pinned, persistent_workers=searched.persistent)) == "pin_memory needs CUDA"
