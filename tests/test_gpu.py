"""The CUDA paths, on a real GPU: CUDA-event step timing, pinned memory, the ``device`` cache, data that
lives on the GPU (``_share_filename_``), the drop-in and the command line with ``--device cuda``.

Every test is marked ``gpu`` and skips cleanly without a CUDA device.
"""

from __future__ import annotations

import json
import subprocess
import sys
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

import autotune
from autotune import Candidate, MeasureLimits, measure, tune_loader
from autotune import pretransform as pt
from autotune.measure import build_loader
from autotune.workloads import CIFAR10Like, cifar10_workload, cifar_train_transform

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

CUDA = torch.device("cuda")
SHORT = MeasureLimits(window_s=0.4, min_batches=4, batch_timeout_s=30, trial_timeout_s=60)


def _sleep_cycles_for(ms: float) -> int:
    """GPU clock cycles that ``torch.cuda._sleep`` needs to keep the device busy for ``ms``."""
    cycles = 1_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles)  # warm the kernel up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    torch.cuda.synchronize()
    per_ms = cycles / max(start.elapsed_time(end), 1e-3)
    return int(per_ms * ms)


def test_the_step_is_timed_on_the_device_not_on_the_host() -> None:
    # The step only enqueues work (the host returns at once); a host timer would see ~0 ms, CUDA
    # events see the device busy for the whole kernel.
    cycles = _sleep_cycles_for(5.0)

    def step(batch: Any) -> None:
        torch.cuda._sleep(cycles)

    data = torch.utils.data.TensorDataset(torch.randn(2048, 8))
    m = measure(data, Candidate(32), step=step, device=CUDA, limits=SHORT)
    assert 4.0 <= m.step_ms <= 15.0, m
    assert m.busy > 0.5, m  # the device, not the host, was the limit


def test_pinned_candidates_deliver_pinned_batches_and_measure() -> None:
    ds = CIFAR10Like(1024, transform=cifar_train_transform())
    for candidate in (Candidate(64, 0, True), Candidate(64, 2, True, 2, True)):
        loader = build_loader(ds, candidate, device=CUDA)
        x, y = next(iter(loader))
        assert x.is_pinned() and y.is_pinned()
        wl = cifar10_workload(1024, device="cuda")
        m = measure(wl.dataset, candidate, step=wl.step, device=CUDA, limits=SHORT)
        assert m.samples > 0 and 0 < m.busy <= 1


def test_the_device_cache_is_measured_and_serves_cuda_batches() -> None:
    ds = CIFAR10Like(1024, transform=cifar_train_transform())
    assert pt.strategies(ds, cuda=True)["device"] is None  # allowed: nothing refuses it
    candidate = Candidate(64, pretransform="device")
    batches = []
    for c, device in ((candidate, CUDA), (Candidate(64, pretransform="ram"), torch.device("cpu"))):
        torch.manual_seed(7)  # the random crops and flips are drawn in the same order by both
        batches.append(next(iter(build_loader(ds, c, device=device))))
    (x, y), (x_ram, y_ram) = batches
    assert x.is_cuda and x.shape == (64, 3, 32, 32)
    assert torch.equal(x.cpu(), x_ram) and torch.equal(y.cpu(), y_ram)
    wl = cifar10_workload(1024, device="cuda")
    m = measure(wl.dataset, candidate, step=wl.step, device=CUDA, limits=SHORT)
    assert m.cache_bytes > 0 and m.samples > 0


class OnTheGpu(Dataset[tuple[torch.Tensor, int]]):
    """The report's dataset: pre-transformed once and kept on the GPU."""

    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 3, 32, 32, device="cuda")
        self.y = torch.arange(n, device="cuda") % 10

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x[i], self.y[i]


def test_data_on_the_gpu_is_tuned_without_worker_processes() -> None:
    data = OnTheGpu(2048)
    step = cifar10_workload(16, device="cuda").step
    result = tune_loader(data, step, batch_size=64, budget_s=20, device="cuda", cache=False, progress=False)
    assert result.candidate.worker_kind == "thread" or result.candidate.num_workers == 0, result.loader_kwargs
    # No process candidate was measured as if it worked.
    for trial in result.trials:
        c = trial.candidate
        if c.num_workers > 0 and c.worker_kind == "process":
            assert trial.state != "complete", trial
    loader = result.make_loader(data)
    seen = torch.cat([y for _, y in loader]).cpu()
    assert len(seen) == len(data)


def test_tune_loader_on_cuda_end_to_end() -> None:
    wl = cifar10_workload(4096, device="cuda")
    result = tune_loader(wl.dataset, wl.step, batch_size=64, budget_s=30, device="cuda", cache=False,
                         progress=False)
    assert result.device.startswith("cuda")
    assert result.speedup is not None and result.samples_per_s > 0
    loader = result.make_loader(wl.dataset)
    try:
        n = sum(len(y) for _, y in loader)
    finally:
        loader.close()
    assert n == len(wl.dataset)


class Indexed(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        return torch.full((3, 32, 32), float(i)), i


def test_the_drop_in_trains_on_cuda_and_serves_every_sample_once() -> None:
    cycles = _sleep_cycles_for(1.0)
    ds = Indexed(3000)
    loader = autotune.DataLoader(ds, batch_size=50, shuffle=True, device="cuda", cache=False)
    with loader:
        for _ in range(3):
            seen: list[int] = []
            for x, y in loader:
                x = x.to("cuda", non_blocking=True)
                torch.cuda._sleep(cycles)
                seen.extend(y.tolist())
            assert sorted(seen) == list(range(len(ds)))


def test_the_command_tunes_on_cuda() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", "--device", "cuda", "--budget", "20", "--samples",
         "4096", "--no-cache", "--json", "--quiet"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    doc = json.loads(proc.stdout)
    assert str(doc.get("device", "")).startswith("cuda"), doc.keys()


def test_the_drop_in_over_data_on_the_gpu_never_starts_worker_processes() -> None:
    # The seed's report: pre-transformed data kept on the GPU made num_workers > 0 fail with
    # _share_filename_. The drop-in sees the CUDA tensors in its first batch and keeps to the main
    # process and threads; every sample comes once per epoch.
    data = OnTheGpu(4096)
    loader = autotune.DataLoader(data, batch_size=64, shuffle=True, device="cuda", cache=False)
    with loader:
        for _ in range(3):
            seen = torch.cat([y for _, y in loader]).cpu()
            assert len(seen) == len(data)
    trials = loader.tuning.trials if loader.tuning else ()
    assert all(not (t.candidate.num_workers and t.candidate.worker_kind == "process"
                    and t.state == "complete") for t in trials)
