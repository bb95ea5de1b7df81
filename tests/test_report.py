"""The trial table, the summary, the JSON and the plot that a tuning run is reported with."""

from __future__ import annotations

import json
import re
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from autotune import Candidate, Measurement, TrialRecord, TuneResult, report, tune_loader
from autotune.result import REASON_WIDTH

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def dataset(n: int = 512) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn((n, 8), generator=gen), torch.randint(0, 4, (n,), generator=gen))


@pytest.fixture(scope="module")
def tuned() -> TuneResult:
    """One real, small tuning run shared by the tests that only read it."""
    return tune_loader(dataset(), batch_size=[16, 64], budget_s=3, max_workers=2, cache=False,
                       progress=False)


def measurement(sps: float, busy: float = 0.5) -> Measurement:
    return Measurement(samples_per_s=sps, busy=busy, wait_fraction=1 - busy, step_ms=12.5, wait_ms=3.0,
                       startup_s=0.1, batches=20, samples=1280, window_s=1.0, peak_memory_bytes=10**8)


LONG_REASON = "TrialTimeout: a batch took longer than 60 s; " + "the storage did not answer " * 10


def handmade() -> TuneResult:
    """A result with every trial state, a pre-transform and a thread count in the winner."""
    base = Candidate(32)
    best = Candidate(64, 2, False, 2, True, "ram", 1)  # 2 workers: within the CPUs of any CI machine
    trials = (
        TrialRecord(0, "baseline", base, "complete", measurement(1000.0, 0.3), 990.0),
        TrialRecord(1, "search", best, "complete", measurement(2500.0, 0.9), 2400.0),
        TrialRecord(2, "search", Candidate(64, 8, False, 8, True), "failed", reason=LONG_REASON),
        TrialRecord(3, "search", Candidate(64, 1, False, 2, True), "pruned",
                    reason="pruned after 5 batches at 400 samples/s"),
        TrialRecord(4, "search", Candidate(256, 2, False, 2, True), "failed", reason=LONG_REASON),
        TrialRecord(5, "search", Candidate(32, 0, pretransform="device"), "infeasible",
                    reason="pretransform='device': needs CUDA"),
        TrialRecord(6, "final", best, "complete", measurement(2600.0, 0.92), 2500.0),
        TrialRecord(7, "final", base, "complete", measurement(1050.0, 0.31), 1040.0),
    )
    return TuneResult(
        loader_kwargs=best.loader_kwargs(), pretransform="ram", torch_threads=1, samples_per_s=2550.0,
        busy=0.91, wait_fraction=0.09, speedup=2.49, speedup_low=2.31, speedup_high=2.68, confidence=0.95,
        baseline_kwargs=base.loader_kwargs(), decision="bs=64 w=2 pf=2 persist ram t=1 beats the baseline",
        baseline_samples_per_s=1025.0, baseline_busy=0.3,
        baseline_wait_fraction=0.7, spread=0.04, trials=trials, tuning_s=59.0, key="0123456789abcdef",
        study_name="autotune-test", storage_url="postgresql://me:secret@db.example/autotune",
    )


def trial_rows(table: str) -> list[str]:
    return [ln for ln in table.splitlines() if re.match(r"^\s*\d+\*?\s", ln)]


# --------------------------------------------------------------------------------------------------
# Table


def test_the_table_has_the_headers_and_a_row_per_trial(tuned: TuneResult) -> None:
    table = tuned.table()
    headers = table.splitlines()[0].split()
    for name in ("#", "phase", "batch", "wrk", "ord", "pin", "pf", "pers", "pretf", "tthr",
                 "samples/s", "step", "busy%", "wait%", "score", "state"):
        assert name in headers
    rows = trial_rows(table)
    assert len(rows) == len(tuned.trials)
    for row, trial in zip(rows, tuned.trials, strict=True):
        assert row.split()[0].rstrip("*") == str(trial.number)
        assert trial.phase in row and trial.state in row


def test_numbers_are_right_aligned_and_lines_fit_100_columns() -> None:
    table = handmade().table()
    lines = table.splitlines()
    assert max(len(ln) for ln in lines) <= 100
    header = lines[0]
    end = header.index("samples/s") + len("samples/s")
    rows = trial_rows(table)
    # Right-aligned: every throughput figure ends where its header ends.
    for row in rows:
        assert row[end - 1] != " " and (len(row) == end or row[end] == " "), row
    assert "2,500" in rows[1]  # thousands separated


def test_failure_reasons_are_listed_once_and_shortened() -> None:
    table = handmade().table()
    rows = trial_rows(table)
    assert rows[2].endswith("failed [1]") and rows[4].endswith("failed [1]")  # one shared reason
    assert rows[3].endswith("pruned [2]") and rows[5].endswith("infeasible [3]")
    notes = [ln for ln in table.splitlines() if ln.startswith("[")]
    assert len(notes) == 3
    assert notes[0].startswith("[1] TrialTimeout: a batch took longer than 60 s")
    assert notes[0].endswith("...") and len(notes[0]) <= REASON_WIDTH
    assert notes[2] == "[3] pretransform='device': needs CUDA"


def test_the_chosen_configuration_is_starred() -> None:
    rows = trial_rows(handmade().table())
    starred = [r.split()[0] for r in rows if r.split()[0].endswith("*")]
    assert starred == ["1*", "6*"]


# --------------------------------------------------------------------------------------------------
# Summary and JSON


def pasted_code(text: str) -> str:
    """The indented code block of a summary that starts with ``loader = DataLoader(``."""
    lines = text.splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.strip().startswith("loader = DataLoader("))
    block = []
    for ln in lines[start:]:
        if not ln.startswith("    "):
            break
        block.append(ln[4:])
    return "\n".join(block)


@pytest.mark.parametrize("which", ["tuned", "handmade"])
def test_the_summary_code_builds_the_loader_it_describes(tuned: TuneResult, which: str) -> None:
    result = tuned if which == "tuned" else handmade()
    text = report.summary_text(result)
    namespace = {"DataLoader": DataLoader, "dataset": dataset(), "torch": torch}
    threads = torch.get_num_threads()
    try:
        exec(pasted_code(text), namespace)  # the code is meant to be pasted: it must run as written
    finally:
        torch.set_num_threads(threads)
    loader = namespace["loader"]
    assert isinstance(loader, DataLoader)
    for name, value in result.loader_kwargs.items():
        assert getattr(loader, name) == value
    assert "Speed-up:" in text and "Diagnosis:" in text


def test_the_summary_says_how_to_apply_threads_pretransform_and_where_it_came_from() -> None:
    result = handmade()
    text = report.summary_text(result)
    assert "torch.set_num_threads(1)" in text
    assert "result.make_loader(dataset" in text and "pretransform='ram'" in text
    assert "2.49x (90% interval 2.31-2.68x) over PyTorch's defaults for" in text
    assert "its build, paid once" in " ".join(text.split())  # a ram cache, its build unrecorded
    built = report.summary_text(replace(result, cache_build_s=2.04))
    assert "start-up included, its cache built (a 2.0 s build, paid once)" in " ".join(built.split())
    assert TuneResult.from_dict(result.to_dict(), cache_build_s=2.04).cache_build_s == 2.04
    assert "baseline: 1,025 samples/s" in text and "Decision:    bs=64 w=2" in text
    assert "spread 4%" in text and "median of 2 measurements" in text
    assert result.diagnosis() in text
    cached = report.summary_text(TuneResult.from_dict(result.to_dict(), from_cache=True))
    assert "from the stored profile 0123456789abcdef" in cached
    assert max(len(ln) for ln in text.splitlines()) <= 100


def test_json_has_the_result_and_a_summary_and_hides_passwords() -> None:
    result = handmade()
    text = report.to_json(result)
    data = json.loads(text)
    assert data["loader_kwargs"] == result.loader_kwargs
    assert len(data["trials"]) == len(result.trials)
    assert data["summary"]["speedup"] == 2.49
    assert data["summary"]["code"] == report.loader_code(result)
    assert "secret" not in text
    assert TuneResult.from_dict(data).loader_kwargs == result.loader_kwargs


def test_the_dashboard_hint() -> None:
    result = handmade()  # a URL with a password, as a profile stored before passwords were masked
    hint = report.dashboard_hint(result)
    assert "me:***@db.example" in hint and "secret" not in hint
    local = TuneResult.from_dict(result.to_dict(), storage_url="sqlite:////tmp/x/studies.db")
    assert report.dashboard_hint(local).startswith("See every trial: optuna-dashboard sqlite:////tmp/x/")
    memory = TuneResult.from_dict(result.to_dict(), storage_url=None, study_name=None)
    assert "kept in memory" in report.dashboard_hint(memory)


def test_the_dashboard_hint_says_how_to_install_the_dashboard() -> None:
    # optuna-dashboard is no dependency: the printed command comes with the extra that installs it.
    result = handmade()
    local = TuneResult.from_dict(result.to_dict(), storage_url="sqlite:////tmp/x/studies.db")
    for shown in (result, local):
        assert "pip install 'dataloader-autotune[dashboard]'" in report.dashboard_hint(shown)
    memory = TuneResult.from_dict(result.to_dict(), storage_url=None, study_name=None)
    assert "pip install" not in report.dashboard_hint(memory)  # no command, nothing to install


# --------------------------------------------------------------------------------------------------
# Plot


def test_plot_writes_a_png(tuned: TuneResult, tmp_path: Path) -> None:
    path = tuned.plot(str(tmp_path / "tuning.png"))
    assert path == str(tmp_path / "tuning.png")
    data = Path(path).read_bytes()
    assert data.startswith(PNG_SIGNATURE) and len(data) > 10_000


def test_plot_handles_every_trial_state_and_leaves_the_backend_alone(tmp_path: Path) -> None:
    import matplotlib

    before = matplotlib.get_backend()
    path = handmade().plot(tmp_path / "handmade.png")
    assert Path(path).read_bytes().startswith(PNG_SIGNATURE)
    # It draws on its own Agg canvas: a notebook's or script's backend is not switched.
    assert matplotlib.get_backend() == before


def test_plot_without_matplotlib_says_how_to_install_it(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for name in ("matplotlib", "matplotlib.figure", "matplotlib.backends.backend_agg"):
        monkeypatch.setitem(sys.modules, name, None)  # None in sys.modules makes the import fail
    with pytest.raises(ImportError, match=re.escape("pip install 'dataloader-autotune[plot]'")):
        handmade().plot(tmp_path / "nothing.png")
    assert not (tmp_path / "nothing.png").exists()


def test_thread_workers_are_pasted_as_the_loader_that_can_start_them() -> None:
    # A plain torch DataLoader cannot start thread workers: the code to paste names autotune's.
    result = TuneResult(loader_kwargs={"batch_size": 64, "num_workers": 0, "worker_threads": 2,
                                       "prefetch_per_thread": 2, "pin_memory": False})
    assert result.candidate.threaded
    code = report.loader_code(result)
    assert code.startswith("loader = ThreadDataLoader(dataset, batch_size=64,")
    text = report.summary_text(result)
    assert "from autotune import ThreadDataLoader" in text
    assert "cannot start threads" in text
    plain = TuneResult(loader_kwargs={"batch_size": 64, "num_workers": 2, "pin_memory": False,
                                      "prefetch_factor": 2, "persistent_workers": True})
    assert report.loader_code(plain).startswith("loader = DataLoader(dataset, batch_size=64, num_workers=2")
    assert "ThreadDataLoader" not in report.summary_text(plain)


def test_the_summary_says_what_the_limits_were_and_how_to_lift_a_small_dev_shm() -> None:
    machine = {"usable_cpus": 1, "cpu_quota": 1.0, "memory_limit_gib": 2, "shm_mib": 64}
    free = replace(handmade(), machine=machine)
    text = report.summary_text(free)
    assert "Limits:      1 CPU usable (cgroup quota 1.0), memory limit 2.0 GiB, /dev/shm 64 MiB" in text
    assert "docker run --shm-size" not in text  # nothing was bounded by /dev/shm here
    assert not report.summary(free)["shm_bound"] and report.summary(free)["shm_fix"] is None

    left_out = TrialRecord(8, "search", Candidate(64, 4, False, 2, True), "infeasible",
                           reason="num_workers=4 prefetch_factor=2: needs ~347 MiB of /dev/shm for 9 batches")
    bound = replace(free, trials=(*free.trials, left_out))
    text = report.summary_text(bound)
    assert "/dev/shm:    too small for the batches worker processes pass here" in text
    words = " ".join(text.split())  # the line is wrapped to the terminal
    assert "the fix: docker run --shm-size=1g (ipc: host in docker compose; in Kubernetes," in words
    assert max(len(ln) for ln in text.splitlines()) <= 100
    summary = json.loads(report.to_json(bound))["summary"]
    assert summary["shm_bound"] and summary["shm_fix"].startswith("docker run --shm-size=1g")
    assert summary["limits"] == "1 CPU usable (cgroup quota 1.0), memory limit 2.0 GiB, /dev/shm 64 MiB"
