"""tune_loader end to end: real studies, real loaders, real worker processes."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, Dataset, get_worker_info

from autotune import ConfigurationError, TuneResult, tune_loader

BUDGET = 6.0
QUICK = {"progress": False, "cache": False, "pretransform": "none"}


class Remote(Dataset):
    """Simulated remote storage: every sample waits 3 ms."""

    def __init__(self, n: int = 2048) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(0.003)
        return torch.full((8,), float(i)), i % 10


class FailsWithManyWorkers(Remote):
    """Breaks in any loader with more than two workers: a candidate-specific failure."""

    def __getitem__(self, i: int):
        info = get_worker_info()
        if info is not None and info.num_workers > 2:
            raise RuntimeError("too many readers for this storage")
        return super().__getitem__(i)


def test_a_real_search_measures_the_baseline_searches_and_reports_against_it(no_leaked_children) -> None:
    # Which configuration wins is a measurement on a shared machine (test_study.py and the stand-in
    # below decide it on exact figures); here the search runs for real, every phase of it.
    result = tune_loader(Remote(), batch_size=32, budget_s=2 * BUDGET, **QUICK)
    assert isinstance(result, TuneResult)
    assert result.loader_kwargs["batch_size"] == 32
    assert result.baseline_kwargs == {"batch_size": 32, "num_workers": 0, "pin_memory": False}
    assert result.speedup is not None and result.decision and result.baseline_samples_per_s
    assert {"baseline", "search"} <= {t.phase for t in result.trials}
    assert result.trials[0].phase == "baseline" and result.trials[0].candidate.num_workers == 0


class _LatencyStandIn:
    """A stand-in for ``measure`` (the noise is what the decision rule is about): samples/s of the
    latency-bound workload, where each worker overlaps another wait, with a fixed 2 % wobble."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, dataset: Any, c: Any, **kwargs: Any) -> Any:
        from autotune.measure import Measurement

        self.calls += 1
        sps = 300.0 * (1 + min(c.num_workers, 6)) * (1.02 if self.calls % 2 else 0.98)
        return Measurement(samples_per_s=sps, busy=0.2, wait_fraction=0.8, step_ms=1.0, wait_ms=4.0,
                           startup_s=0.0, batches=20, samples=640, window_s=640 / sps,
                           peak_memory_bytes=0)


def _on_a_clock(monkeypatch: pytest.MonkeyPatch, stand_in: _LatencyStandIn, seconds: float) -> list[float]:
    """``stand_in`` as the measurement, each call taking ``seconds`` of a search clock the test
    controls: the search's budget is spent by measurements alone, whatever the machine's load."""
    import autotune.api
    import autotune.study

    clock = [1000.0]

    def measure(*args: Any, **kwargs: Any) -> Any:
        clock[0] += seconds
        return stand_in(*args, **kwargs)

    monkeypatch.setattr(autotune.api, "measure", measure)
    monkeypatch.setattr(autotune.study.time, "monotonic", lambda: clock[0])
    return clock


def test_workers_win_a_latency_bound_search_with_confidence(monkeypatch: pytest.MonkeyPatch) -> None:
    _on_a_clock(monkeypatch, _LatencyStandIn(), 0.1)
    result = tune_loader(Remote(), batch_size=32, budget_s=2 * BUDGET, **QUICK)
    # The stand-in does not tell processes from threads: either kind of worker wins.
    assert result.candidate.num_workers >= 2 and not result.kept_baseline
    assert result.speedup is not None and result.speedup > 1.5
    assert result.speedup_low is not None and result.speedup_low > 1.0 and result.confidence == 0.95
    assert {"baseline", "search", "final"} <= {t.phase for t in result.trials}


def test_the_budget_is_a_ceiling_on_the_search(monkeypatch: pytest.MonkeyPatch) -> None:
    # Each stand-in measurement takes one second of a clock the test controls: the search must stop
    # at the budget, whatever the machine's speed.
    stand_in = _LatencyStandIn()
    clock = _on_a_clock(monkeypatch, stand_in, 1.0)
    started = clock[0]
    result = tune_loader(Remote(), batch_size=16, budget_s=BUDGET,
                         **{**QUICK, "max_workers": 8})
    assert clock[0] - started <= BUDGET + 1.0  # at most the trial that was running at the deadline
    assert isinstance(result, TuneResult) and stand_in.calls >= 3


def test_a_failing_candidate_is_a_failed_trial_and_the_search_goes_on(no_leaked_children) -> None:
    result = tune_loader(FailsWithManyWorkers(), batch_size=16, budget_s=BUDGET, seed=3, **QUICK)
    failed = [t for t in result.trials if t.state == "failed"]
    assert failed, "the warm start with the worker bound must have failed"
    assert all("too many readers" in (t.reason or "") for t in failed)
    assert all(t.candidate.num_workers > 2 for t in failed)
    assert result.loader_kwargs["num_workers"] <= 2


def test_the_users_step_error_is_raised_when_every_candidate_fails(no_leaked_children) -> None:
    class StepBug(ValueError):
        pass

    def step(batch):
        raise StepBug("shape mismatch in my model")

    with pytest.raises(StepBug, match="shape mismatch in my model") as info:
        tune_loader(Remote(256), step, batch_size=8, budget_s=4, **QUICK)
    notes = " ".join(getattr(info.value, "__notes__", []))
    assert "raised under candidate bs=8" in notes


def test_the_result_builds_a_real_loader_and_round_trips_through_json() -> None:
    data = Remote(128)
    result = tune_loader(data, batch_size=16, budget_s=4, max_workers=2, **QUICK)
    loader = result.make_loader(data, shuffle=True)
    assert isinstance(loader, DataLoader)
    assert loader.batch_size == 16 and loader.num_workers == result.loader_kwargs["num_workers"]
    x, y = next(iter(loader))
    assert x.shape == (16, 8)
    again = TuneResult.from_dict(json.loads(result.to_json()))
    assert again.loader_kwargs == result.loader_kwargs
    assert [t.candidate for t in again.trials] == [t.candidate for t in result.trials]
    assert again.trials[0].measurement == result.trials[0].measurement


def test_progress_goes_to_stderr(capsys) -> None:
    tune_loader(Remote(128), batch_size=16, budget_s=3, cache=False, max_workers=1, pretransform="none")
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "autotune [" in captured.err and "tried" in captured.err


class NotADataset:
    pass


class Unsized(Dataset):
    def __getitem__(self, i):
        return i


class Empty(Dataset):
    def __len__(self):
        return 0

    def __getitem__(self, i):
        raise IndexError(i)


@pytest.mark.parametrize(
    ("dataset", "kwargs", "match"),
    [
        (NotADataset(), {}, r"is not a dataset: it needs __getitem__ and __len__"),
        (iter([1, 2]), {}, r"is iterable but not a torch.utils.data.IterableDataset"),
        (Unsized(), {}, r"has __getitem__ but no __len__"),
        (Empty(), {}, r"is empty \(len 0\)"),
        (Remote(64), {"budget_s": 0}, r"budget_s=0 must be > 0"),
        (Remote(64), {"budget_s": float("nan")}, r"budget_s=nan is not a finite number"),
        (Remote(64), {"batch_size": 65}, r"batch_size=65 is larger than the dataset \(64 samples\)"),
        (Remote(64), {"batch_size": 0}, r"batch_size=0 is not a positive integer"),
        (Remote(64), {"pretransform": "gpu"}, r"pretransform='gpu' is not a pre-transform strategy"),
        (Remote(64), {"epochs": 0}, r"epochs=0 must be a positive integer"),
        (Remote(64), {"device": "tpu:x"}, r"device='tpu:x' is not a torch device"),
    ],
)
def test_bad_input_is_a_clear_error(dataset, kwargs, match) -> None:
    with pytest.raises(ConfigurationError, match=match):
        tune_loader(dataset, progress=False, cache=False, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_clear_error() -> None:
    with pytest.raises(ConfigurationError, match=r"CUDA is not available on this machine"):
        tune_loader(Remote(64), device="cuda", **QUICK)


def test_a_cache_over_the_memory_budget_is_refused_with_its_reason(no_leaked_children) -> None:
    from autotune.supervise import process_memory
    from autotune.workloads import CIFAR10Like, cifar_train_transform

    # 8,000 normalised 32x32 RGB images need ~94 MiB as float32: more than the 40 MiB left here.
    data = CIFAR10Like(8000, transform=cifar_train_transform())
    result = tune_loader(data, batch_size=64, budget_s=4, progress=False, cache=False,
                         max_workers=0, pretransform=["none", "ram"],
                         memory_budget_bytes=process_memory() + 40 * 2**20)
    refused = [t for t in result.trials if t.candidate.pretransform == "ram"]
    assert refused and all(t.state == "infeasible" for t in refused)
    assert "over the memory budget" in (refused[0].reason or "")
    assert result.pretransform == "none"


def test_the_cifar_shaped_workload_measures_the_ram_cache_and_serves_it(no_leaked_children) -> None:
    from autotune.space import Candidate
    from autotune.workloads import CIFAR10Like, cifar_train_transform

    # Whether the cache wins is measured in benchmarks/results/suite/SUITE.md; here it is tried and served.
    data = CIFAR10Like(2048, transform=cifar_train_transform())
    result = tune_loader(data, batch_size=64, budget_s=12, progress=False, cache=False, max_workers=1)
    ram = [t for t in result.trials if t.candidate.pretransform == "ram"]
    assert ram and any(t.state == "complete" and t.measurement and t.measurement.build_s > 0 for t in ram)
    loader = TuneResult(loader_kwargs=Candidate(64).loader_kwargs(), pretransform="ram").make_loader(
        data, shuffle=True)
    x, y = next(iter(loader))
    assert x.shape == (64, 3, 32, 32) and y.shape == (64,)
    loader.close()


BAD_ARGUMENTS = [
    ({"memory_budget_bytes": -5}, r"memory_budget_bytes=-5 must be > 0"),
    ({"batch_timeout_s": 0}, r"batch_timeout_s=0 must be > 0"),
    ({"max_workers": -1}, r"max_workers=-1 must be a non-negative integer"),
    ({"batch_size": 4096}, r"batch_size=4096 is larger than the dataset"),
]


def test_arguments_are_checked_before_a_stored_profile_answers() -> None:
    # The first call stores a profile for this workload; the second would be a cache hit, and a bad
    # argument must be refused all the same (none of these arguments is part of the profile key).
    ds = Remote(256)
    tune_loader(ds, batch_size=32, budget_s=3.0, progress=False, pretransform="none", max_workers=1)
    hit = tune_loader(ds, batch_size=32, budget_s=3.0, progress=False, pretransform="none",
                      max_workers=1)
    assert hit.from_cache
    for kwargs, match in BAD_ARGUMENTS:
        call = {"batch_size": 32, "budget_s": 3.0, "progress": False, "pretransform": "none",
                "max_workers": 1, **kwargs}
        with pytest.raises(ConfigurationError, match=match):
            tune_loader(ds, **call)


def test_the_baseline_is_what_the_user_runs_even_outside_the_space(monkeypatch: pytest.MonkeyPatch) -> None:
    import autotune.api

    # 16 workers on a machine that searches far fewer: still measured, and the speed-up is against it.
    monkeypatch.setattr(autotune.api, "measure", _LatencyStandIn())
    result = tune_loader(Remote(), batch_size=32, budget_s=2 * BUDGET, max_workers=2,
                         baseline={"num_workers": 16}, **QUICK)
    base = result.trials[0]
    assert base.phase == "baseline" and base.candidate.num_workers == 16 and base.state == "complete"
    assert result.baseline_kwargs is not None and result.baseline_kwargs["num_workers"] == 16
    # The stand-in gives 16 workers the speed of 6: nothing in 0..2 workers beats it, so it is kept.
    assert result.kept_baseline and result.loader_kwargs["num_workers"] == 16
    with pytest.raises(ConfigurationError, match=r"baseline has num_workers=-1"):
        tune_loader(Remote(), batch_size=32, baseline={"num_workers": -1}, **QUICK)


def test_a_stored_profile_with_unusable_settings_is_ignored_and_measured_again(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import autotune.api
    from autotune import ProfileStoreWarning, open_store

    monkeypatch.setattr(autotune.api, "measure", _LatencyStandIn())
    args = {"batch_size": 16, "budget_s": BUDGET, "progress": False, "pretransform": "none"}
    first = tune_loader(Remote(), **args)
    assert first.key is not None
    store = open_store()
    record = store.get(first.key)
    assert record is not None
    record["loader_kwargs"]["num_workers"] = -3  # parses, but no loader accepts it
    store.put(first.key, record)
    with pytest.warns(ProfileStoreWarning, match=r"num_workers=-3 must be a non-negative integer"):
        again = tune_loader(Remote(), **args)
    assert not again.from_cache and again.loader_kwargs["num_workers"] >= 0
    assert tune_loader(Remote(), **args).from_cache  # the re-measured profile replaced it


def test_tuning_the_same_workload_twice_within_a_second_keeps_both_studies(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A study is named by the workload, the second and the process; the storage refuses a name it
    # has, so two searches in one second (retune=True) need more than that. The clock is held still.
    import autotune.api
    import autotune.plan

    monkeypatch.setattr(autotune.api, "measure", _LatencyStandIn())
    monkeypatch.setattr(autotune.plan.time, "strftime", lambda fmt, *a: "20261202T000000")
    args = {"batch_size": 16, "budget_s": BUDGET, "progress": False, "pretransform": "none", "retune": True}
    first, second = tune_loader(Remote(), **args), tune_loader(Remote(), **args)  # -W error: no warning
    assert first.study_name and second.study_name and first.study_name != second.study_name
