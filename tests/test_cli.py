"""The ``autotune`` command: every sub-command and flag family, run in-process through ``main``.

Budgets are tiny and datasets small: these tests check what the command prints and returns, not
which configuration wins (that needs a quiet machine; see benchmarks/).
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from autotune import workloads
from autotune.cli import main

TESTS = Path(__file__).parent

# Small and fast: a 512-sample dataset, at most two workers, a few seconds per run. Runs with the
# small CNN step get more time: on a busy 2-core machine its first measurement alone can take seconds.
QUICK = ["--budget", "3", "--samples", "512", "--max-workers", "2"]
QUICK_STEP = ["--budget", "5", "--samples", "512", "--max-workers", "2"]
QUICK_FILES = ["--budget", "3", "--max-workers", "2"]
QUICK_FILES_STEP = ["--budget", "5", "--max-workers", "2"]


@pytest.fixture(autouse=True)
def _fixtures_importable(monkeypatch: pytest.MonkeyPatch) -> None:
    """`--dataset cli_fixtures:NAME` imports tests/cli_fixtures.py, as it would a user's module."""
    monkeypatch.syspath_prepend(str(TESTS))


def _flat(text: str) -> str:
    """The printed code on one line, however the summary wrapped it."""
    return re.sub(r"\s+", " ", re.sub(r"\(\s+", "(", text))


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def profile_keys(capsys: pytest.CaptureFixture[str], *extra: str) -> list[str]:
    code, out, _ = run(capsys, "profiles", "list", "--json", *extra)
    assert code == 0
    return [p["key"] for p in json.loads(out)]


# --------------------------------------------------------------------------------------------------
# tune


def test_tune_prints_the_table_the_settings_and_the_dashboard_line_then_hits_the_cache(
    capsys: pytest.CaptureFixture[str], no_leaked_children: None
) -> None:
    # The default workload (CIFAR-10-shaped images and a small CNN); a small fixed batch keeps steps short.
    code, out, err = run(capsys, "tune", *QUICK_STEP, "--batch-size", "16")
    assert code == 0, err
    assert "samples/s" in out and "state" in out.splitlines()[0]
    # DataLoader, or autotune's ThreadDataLoader where thread workers won: which is a measurement.
    assert re.search(r"loader = (Thread)?DataLoader\(dataset, batch_size=16, num_workers=", _flat(out))
    assert "over PyTorch's defaults" in out
    assert "optuna-dashboard sqlite:///" in out
    assert "autotune [" in err  # the progress line goes to stderr, never stdout
    assert "autotune [" not in out
    [key] = profile_keys(capsys)
    assert f"stored as profile {key}" in out

    code, out, err = run(capsys, "tune", *QUICK_STEP, "--batch-size", "16")
    assert code == 0, err
    assert f"from the stored profile {key}" in out
    assert "optuna-dashboard sqlite:///" in out  # the stored run's study is still there to look at

    code, out, err = run(capsys, "tune", *QUICK_STEP, "--batch-size", "16", "--retune", "--quiet")
    assert code == 0, err
    assert "measured now" in out
    assert err == ""  # --quiet: no progress line


def test_json_prints_one_document_and_nothing_else_and_plot_writes_a_png(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    png = tmp_path / "plot.png"
    code, out, err = run(capsys, "tune", *QUICK, "--no-step", "--json", "--plot", str(png))
    assert code == 0, err
    data = json.loads(out)  # fails if anything but the one document is on stdout
    assert data["samples_per_s"] > 0
    assert data["loader_kwargs"]["batch_size"] >= 1
    assert data["trials"] and data["workload"]["step"] is None  # --no-step
    summary = data["summary"]
    assert summary["from_cache"] is False
    # Which class the snippet names follows what won (thread workers need autotune's): not asserted.
    cls = "ThreadDataLoader" if "worker_threads" in data["loader_kwargs"] else "DataLoader"
    assert summary["code"].startswith(f"loader = {cls}(dataset, batch_size=")
    assert summary["speedup"] == pytest.approx(data["speedup"])
    assert "autotune [" in err
    assert png.read_bytes().startswith(b"\x89PNG\r\n\x1a\n")


def test_no_cache_stores_nothing_and_verbose_logs_to_stderr(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "tune", *QUICK, "--no-step", "--no-cache", "--quiet", "-v",
                         "--batch-size", "auto", "--epochs", "3", "--seed", "7", "--device", "cpu")
    assert code == 0, err
    assert "kept in memory" in out  # no store, so no study database to open in the dashboard
    assert "autotune: best" in err  # the INFO log line
    assert "autotune [" not in err  # --quiet
    assert profile_keys(capsys) == []


def test_cache_dir_and_storage_flags_choose_where_profiles_live(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    cache = tmp_path / "elsewhere"
    code, out, err = run(capsys, "tune", *QUICK, "--no-step", "--quiet", "--cache-dir", str(cache))
    assert code == 0, err
    assert f"sqlite:///{cache.as_posix()}/studies.db" in out
    assert len(profile_keys(capsys, "--cache-dir", str(cache))) == 1
    assert profile_keys(capsys) == []  # not in the default (AUTOTUNE_CACHE_DIR) folder

    url = f"sqlite:///{(tmp_path / 'shared.db').as_posix()}"
    code, out, err = run(capsys, "tune", *QUICK, "--no-step", "--quiet", "--storage", url)
    assert code == 0, err
    assert url in out
    assert len(profile_keys(capsys, "--storage", url)) == 1


# --------------------------------------------------------------------------------------------------
# --dataset


def test_module_callable_returning_a_dataset(capsys: pytest.CaptureFixture[str]) -> None:
    import cli_fixtures

    code, out, err = run(capsys, "tune", *QUICK_FILES, "--dataset", "cli_fixtures:make_dataset", "--json",
                         "--quiet")
    assert code == 0, err
    data = json.loads(out)  # what the factory printed went to stderr, leaving stdout to the JSON
    assert "building the dataset..." in err
    assert data["workload"]["dataset"].endswith("TensorDataset")
    assert data["workload"]["len"] == 512
    assert "make_dataset" in cli_fixtures.CALLS


def test_module_callable_returning_a_dataset_and_step(capsys: pytest.CaptureFixture[str]) -> None:
    import cli_fixtures

    before = cli_fixtures.STEP.calls
    code, out, err = run(capsys, "tune", *QUICK_FILES, "--dataset", "cli_fixtures:make_pair",
                         "--batch-size", "32", "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["loader_kwargs"]["batch_size"] == 32
    assert data["workload"]["step"] is not None
    assert cli_fixtures.STEP.calls > before  # the step was measured with every batch


def test_imagefolder(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    root = workloads.write_image_folder(tmp_path / "images", n=64, classes=4, size=40)
    code, out, err = run(capsys, "tune", *QUICK_FILES_STEP, "--dataset", f"imagefolder:{root}",
                         "--image-size", "24", "--batch-size", "16", "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["workload"]["dataset"].endswith("ImageFolder")
    assert data["workload"]["len"] == 64
    assert data["workload"]["sample"]["items"][0]["shape"] == [3, 24, 24]
    assert data["workload"]["step"] is not None  # a SmallCNN step, since --no-step was not given


def test_cifar10_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    workloads.write_cifar10_files(tmp_path, n_train=320, n_test=10)
    code, out, err = run(capsys, "tune", *QUICK_FILES_STEP, "--dataset", "cifar10", "--root", str(tmp_path),
                         "--batch-size", "16", "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["workload"]["dataset"].endswith("CIFAR10Files")
    assert data["workload"]["len"] == 320
    assert data["workload"]["step"] is not None


def test_fake_data(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "tune", *QUICK, "--dataset", "fake", "--no-step", "--json", "--quiet")
    assert code == 0, err
    data = json.loads(out)
    assert data["workload"]["dataset"].endswith("FakeData")
    assert data["workload"]["len"] == 512


def test_a_missing_cifar10_folder_is_named(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, err = run(capsys, "tune", "--dataset", "cifar10", "--root", str(tmp_path / "nowhere"))
    assert code == 2
    assert out == ""
    assert str(tmp_path / "nowhere" / "cifar-10-batches-py") in err
    assert "write_cifar10_files" in err  # and how to get the files


# --------------------------------------------------------------------------------------------------
# Errors and exit codes


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        ([], "give a command"),
        (["frobnicate"], "invalid choice"),
        (["tune", "--batch-size", "abc"], "'abc' is not a batch size"),
        (["tune", "--batch-size", "0"], "at least 1"),
        (["tune", "--budget", "-1"], "positive"),
        (["tune", "--max-workers", "many"], "not an integer"),
        (["tune", "--bogus"], "unrecognized arguments"),
        (["tune", "--no-cache", "--retune"], "contradict"),
        (["tune", "--dataset", "mnist"], "not a dataset autotune knows"),
        (["tune", "--dataset", "imagefolder:"], "needs the folder"),
        (["tune", "--dataset", "cifar10", "--samples", "100"], "--samples applies to generated"),
        (["tune", "--dataset", "no_such_module_here:f"], "no module named 'no_such_module_here'"),
        (["tune", "--dataset", "cli_fixtures:nothing"], "has no attribute 'nothing'"),
        (["tune", "--dataset", "cli_fixtures:NOT_CALLABLE"], "not a callable"),
        (["profiles"], "give an action"),
        (["profiles", "clear"], "--all"),
        (["profiles", "clear", "somekey", "--all"], "not both"),
    ],
)
def test_usage_errors_exit_2_with_the_usage_line(
    capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    code, out, err = run(capsys, *argv)
    assert code == 2
    assert out == ""
    assert "usage: autotune" in err
    assert message in err


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message for a machine without CUDA")
def test_asking_for_cuda_without_it_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "tune", "--device", "cuda")
    assert code == 2
    assert "CUDA is not available" in err


def test_a_configuration_error_from_tuning_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "tune", "--dataset", "cli_fixtures:make_empty", "--budget", "3")
    assert code == 2
    assert out == ""
    assert "autotune: error:" in err and "is empty" in err


def test_the_users_step_failing_everywhere_exits_1_with_its_error(
    capsys: pytest.CaptureFixture[str], no_leaked_children: None
) -> None:
    code, out, err = run(capsys, "tune", *QUICK_FILES, "--dataset", "cli_fixtures:make_broken_pair",
                         "--quiet")
    assert code == 1
    assert out == ""
    assert "autotune: tuning failed: RuntimeError: the model diverged: loss is nan" in err


def test_the_users_factory_failing_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = run(capsys, "tune", "--dataset", "cli_fixtures:factory_that_raises")
    assert code == 1
    assert "autotune: tuning failed:" in err and "the data volume is not mounted" in err


def test_ctrl_c_exits_130_with_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(capsys, "tune", "--dataset", "cli_fixtures:interrupted")
    assert code == 130
    assert out == ""
    assert err.strip() == "autotune: interrupted"


def test_help_and_version_exit_0(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "tune", "--help")
    assert code == 0
    assert "--batch-size N|auto" in out and "module:callable" in out
    code, out, _ = run(capsys, "--version")
    assert code == 0 and out.startswith("autotune ")


# --------------------------------------------------------------------------------------------------
# profiles


def test_profiles_list_show_clear_round_trip(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    code, out, _ = run(capsys, "profiles", "list")
    assert code == 0 and "No stored profiles" in out

    for batch in ("16", "32"):
        code, _, err = run(capsys, "tune", *QUICK, "--no-step", "--quiet", "--batch-size", batch)
        assert code == 0, err
    keys = profile_keys(capsys)
    assert len(keys) == 2

    code, out, _ = run(capsys, "profiles", "list")
    assert code == 0
    header = out.splitlines()[0].split()
    assert header == ["key", "created", "machine", "workload", "best", "samples/s"]
    for key in keys:
        assert key in out
    assert "CIFAR10Like[512]" in out and "bs=16" in out and "bs=32" in out

    code, out, _ = run(capsys, "profiles", "show", keys[0])
    assert code == 0
    assert "Machine:" in out and "cpu_model" in out and "usable_cpus" in out
    assert "Workload:" in out and "CIFAR10Like" in out
    assert re.search(r"loader = (Thread)?DataLoader\(dataset, batch_size=", _flat(out))
    assert "from the stored profile" in out

    code, out, _ = run(capsys, "profiles", "show", keys[0], "--json")
    assert code == 0 and json.loads(out)["key"] == keys[0]

    code, out, err = run(capsys, "profiles", "show", "0123456789abcdef")
    assert code == 1
    assert "no profile with key '0123456789abcdef'" in err and "autotune profiles list" in err

    code, out, _ = run(capsys, "profiles", "clear", keys[0])
    assert code == 0 and keys[0] in out
    assert profile_keys(capsys) == keys[1:]

    code, _, err = run(capsys, "profiles", "clear", keys[0])
    assert code == 1 and "no profile with key" in err

    code, out, _ = run(capsys, "profiles", "clear", "--all")
    assert code == 0 and "Removed 1 profile " in out
    assert profile_keys(capsys) == []


def test_profiles_commands_take_cache_dir(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    cache = tmp_path / "other"
    code, _, err = run(capsys, "tune", *QUICK, "--no-step", "--quiet", "--cache-dir", str(cache))
    assert code == 0, err
    [key] = profile_keys(capsys, "--cache-dir", str(cache))
    code, out, _ = run(capsys, "profiles", "show", key, "--cache-dir", str(cache))
    assert code == 0 and key in out
    code, _, _ = run(capsys, "profiles", "clear", "--all", "--cache-dir", str(cache))
    assert code == 0
    assert profile_keys(capsys, "--cache-dir", str(cache)) == []


def test_profiles_commands_never_show_a_stored_password(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    # A profile written before passwords were masked holds its study's URL with the password.
    from autotune import Candidate, TuneResult, profiles

    secret = "postgresql://me:hunter2@db.example/autotune"
    result = TuneResult(loader_kwargs=Candidate(32).loader_kwargs(), samples_per_s=100.0,
                        key="0123456789abcdef", study_name="autotune-old")
    store = profiles.open_store()
    assert isinstance(store, profiles.EmbeddedProfileStore)
    store.profiles_dir.mkdir(parents=True, exist_ok=True)
    old = {**result.to_dict(), "storage_url": secret, "schema": profiles.SCHEMA_VERSION,
           "key": result.key, "created": "2026-01-01T00:00:00+00:00"}
    store.path("0123456789abcdef").write_text(json.dumps(old))
    for argv in (["show", "0123456789abcdef"], ["show", "0123456789abcdef", "--json"], ["list"],
                 ["list", "--json"]):
        code, out, err = run(capsys, "profiles", *argv)
        assert code == 0, err
        assert "hunter2" not in out + err, argv
    code, out, _ = run(capsys, "profiles", "show", "0123456789abcdef", "--json")
    assert json.loads(out)["storage_url"] == "postgresql://me:***@db.example/autotune"


# --------------------------------------------------------------------------------------------------
# A real process


def test_python_dash_m_autotune_tune_json(tmp_path: Path) -> None:
    # The default workload at its default size, as a user would run it; AUTOTUNE_CACHE_DIR (set by
    # conftest.py) is inherited, so the user's own cache is untouched.
    proc = subprocess.run(
        [sys.executable, "-m", "autotune", "tune", "--budget", "8", "--json"],
        capture_output=True, text=True, timeout=120, env=os.environ.copy(),
    )
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    expected = {"loader_kwargs", "samples_per_s", "speedup", "trials", "machine", "workload", "summary"}
    assert expected <= set(data)
    assert data["samples_per_s"] > 0
    assert data["workload"]["len"] == 10_000
    assert "autotune [" in proc.stderr  # progress on stderr


def test_the_baseline_is_the_settings_given_and_the_report_says_so(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "tune", "--budget", "8", "--samples", "512", "--max-workers", "2",
                         "--batch-size", "16", "--baseline",
                         "num_workers=1,pin_memory=False", "--json", "--quiet", "--no-cache")
    assert code == 0, err
    doc = json.loads(out)
    assert doc["baseline_kwargs"]["num_workers"] == 1
    assert doc["trials"][0]["phase"] == "baseline" and doc["trials"][0]["candidate"]["num_workers"] == 1
    assert doc["summary"]["decision"] and "speedup_low" in doc["summary"]
    code, _, err = run(capsys, "tune", "--baseline", "num_workers=many")
    assert code == 2 and "num_workers='many': a value is an integer, True, False or None" in err


def test_a_plot_to_a_missing_folder_is_refused_before_tuning(capsys: pytest.CaptureFixture[str],
                                                             tmp_path: Path) -> None:
    started = time.monotonic()
    code, out, err = run(capsys, "tune", *QUICK_STEP, "--plot", str(tmp_path / "no" / "such" / "p.png"))
    assert code == 2 and "its folder does not exist" in err and out == ""
    assert time.monotonic() - started < 30  # refused up front, not after a whole tuning run
    assert profile_keys(capsys) == []
