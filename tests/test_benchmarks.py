"""The benchmark suite runs end to end and records every figure; its helpers do what the protocol says.

The figures themselves are not checked here (speed claims live in benchmarks/results/): ``--quick``
only proves that every workload and every configuration is measured and written out.
"""

from __future__ import annotations

import importlib
import json
import math
import runpy
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psutil
import pytest
import torch
from test_imports import run_each_alone  # tests/ is on sys.path, as for conftest.py

from autotune.decide import Ledger, TrialRecord
from autotune.space import Candidate
from benchmarks.scripts import decisions, suite  # the checkout's root is on pytest's pythonpath (pyproject)

ROOT = Path(__file__).resolve().parent.parent
BENCHMARKS = ROOT / "benchmarks"
RESULTS = BENCHMARKS / "results"

CONFIGS = ("default", "workers=cpus", "rule-of-thumb", "over-provisioned", "tuned", "grid #1")


def test_quick_run_measures_every_workload_and_config(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / suite.FIGURES).read_text())
    assert list(data["workloads"]) == list(suite.WORKLOAD_NAMES)
    assert data["meta"]["quick"] is True
    for name, result in data["workloads"].items():
        configs = result["configs"]
        assert set(CONFIGS) <= set(configs), name
        for config, figures in configs.items():
            assert figures["median_samples_per_s"] > 0, (name, config, figures["failures"])
            assert len(figures["samples_per_s"]) == data["meta"]["rounds"], (name, config)
        # The tuned candidate lies in the space the grid covered, so the oracle is a fair bound.
        assert result["space"]["tuned_in_space"], name
        assert result["grid"]["size"] == result["space"]["size"] == len(result["grid"]["points"])
        assert result["tuning"]["tuning_s"] > 0 and result["grid"]["total_s"] > 0
        for key in ("tuned_over_oracle", "tuned_over_default", "tuned_over_best_heuristic",
                    "tuning_over_grid_time"):
            assert result["headline"][key] is not None, (name, key)
    report = (out / suite.PAGE).read_text()
    for name in suite.WORKLOAD_NAMES:
        assert f"### {name}" in report
    assert (out / suite.PLOT).stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gpu_mode_without_cuda_skips_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert suite.main(["--gpu", "--out", str(tmp_path / "bench")]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
    assert not (tmp_path / "bench").exists()  # nothing measured, nothing written


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Stand-ins for the measuring and the writing: the paths ``suite.main`` would write, in order.

    What is measured does not matter here, only where it goes; the real run is
    test_quick_run_measures_every_workload_and_config.
    """
    from benchmarks._common import output

    written: list[Path] = []

    def write(data: Any, path: Path) -> Path:
        written.append(Path(path))
        return path

    monkeypatch.setattr(suite, "make_workload",
                        lambda name, folder, **kw: SimpleNamespace(name=name))
    monkeypatch.setattr(suite, "run_workload", lambda w, settings: {"name": w.name})
    monkeypatch.setattr(suite, "with_strong_target", lambda result: result)
    for name in ("write_json", "write_markdown", "write_plot"):
        monkeypatch.setattr(output, name, write)
    return written


def test_quick_run_leaves_the_committed_results_alone(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    written = _record_writes(monkeypatch)
    assert suite.main(["--quick", "--workload", "tensor"]) == 0
    names = {p.name for p in written}
    assert names == {suite.FIGURES, suite.PAGE, suite.PLOT}
    # A smoke run's figures mean nothing: they go to a temporary folder, never over benchmarks/.
    for path in written:
        assert BENCHMARKS not in path.parents, path
        assert path.parent.name.startswith(suite.QUICK_OUT_PREFIX), path
    assert str(written[0].parent) in capsys.readouterr().out  # the run says where it wrote
    written[0].parent.rmdir()  # the stand-ins wrote nothing into it


def test_explicit_out_wins_over_the_quick_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    written = _record_writes(monkeypatch)
    assert suite.main(["--quick", "--workload", "tensor", "--out", str(tmp_path / "bench")]) == 0
    assert {p.parent for p in written} == {tmp_path / "bench"}


def test_a_full_run_writes_the_committed_results_by_default() -> None:
    assert suite.out_folder(suite.parse_args([])) == RESULTS / "suite"
    assert suite.out_folder(suite.parse_args(["--gpu"])) == RESULTS / "suite" / "gpu"
    # Rendering again writes beside the figures it reads.
    figures = RESULTS / "suite" / "gpu" / suite.FIGURES
    assert suite.out_folder(suite.parse_args(["--from-json", str(figures)])) == figures.parent


SCRIPTS = sorted(p.stem for p in (BENCHMARKS / "scripts").glob("*.py") if p.stem != "__init__")


def test_every_script_runs_from_its_path() -> None:
    # ``python benchmarks/scripts/x.py`` puts benchmarks/scripts/ on sys.path, not the repository root.
    # Each script runs so, by its path, in a fork of one process that imported torch and the like but
    # nothing of autotune or benchmarks.
    jobs = [{"name": s, "script": f"benchmarks/scripts/{s}.py", "argv": ["--help"]} for s in SCRIPTS]
    done = run_each_alone(ROOT, jobs, fresh=("autotune", "benchmarks"))
    assert set(done) == set(SCRIPTS)
    failures = {s: r["err"] for s, r in done.items() if r["code"] != 0 or "usage:" not in r["out"]}
    assert not failures, failures


def test_python_m_benchmarks_is_the_suite(monkeypatch: pytest.MonkeyPatch,
                                          capsys: pytest.CaptureFixture[str]) -> None:
    # What ``python -m benchmarks --help`` runs, in this process: benchmarks/__main__.py as __main__.
    monkeypatch.setattr(sys, "argv", ["benchmarks", "--help"])
    with pytest.raises(SystemExit) as exit_:
        runpy.run_module("benchmarks", run_name="__main__", alter_sys=True)
    assert exit_.value.code == 0
    out = capsys.readouterr().out
    assert "--quick" in out and "--gpu" in out


def test_every_results_folder_is_one_scripts_page_and_figures() -> None:
    # benchmarks/results/<name>/ is written by benchmarks/scripts/<name>.py alone: its page and its JSON.
    folders = sorted(p for p in RESULTS.iterdir() if p.is_dir())
    assert folders, RESULTS
    for folder in folders:
        assert folder.name in SCRIPTS, f"{folder} has no script benchmarks/scripts/{folder.name}.py"
        names = {p.name for p in folder.iterdir()}
        assert {f"{folder.name.upper()}.md", f"{folder.name}.json"} <= names, folder
    assert len(list(BENCHMARKS.iterdir())) - (BENCHMARKS / "__pycache__").exists() <= 10


@pytest.mark.parametrize("script, folder", [
    ("suite", "suite"), ("suite", "suite/gpu"), ("parallelism", "parallelism"), ("fill", "fill"),
    ("ranks", "ranks"), ("node", "node"),
])
def test_committed_pages_are_what_their_script_writes_from_the_figures(
    script: str, folder: str, tmp_path: Path
) -> None:
    committed = RESULTS / folder
    page = next(committed.glob("[A-Z]*.md"))
    figures = tmp_path / f"{script}.json"
    figures.write_bytes((committed / figures.name).read_bytes())
    option = "--from-json" if script == "suite" else "--render"
    module = importlib.import_module(f"benchmarks.scripts.{script}")
    assert module.main([option, str(figures)]) == 0
    assert (tmp_path / page.name).read_text() == page.read_text()


def test_rounds_rotate_so_every_config_leads_once() -> None:
    items = ["a", "b", "c"]
    from benchmarks._common.stats import rotated

    orders = [rotated(items, r) for r in range(3)]
    assert orders == [["a", "b", "c"], ["b", "c", "a"], ["c", "a", "b"]]
    assert {o[0] for o in orders} == set(items)


def test_rule_of_thumb_follows_cpus_and_local_world_size() -> None:
    configs = suite.heuristic_configs(64, cpus=2)
    assert configs["default"] == Candidate(batch_size=64)
    assert configs["workers=cpus"].num_workers == 2
    assert configs["rule-of-thumb"].num_workers == 1
    assert configs["over-provisioned"].num_workers == 20
    assert configs["over-provisioned"].batch_size == 16
    assert suite.heuristic_configs(64, cpus=16, local_world_size=4)["rule-of-thumb"].num_workers == 3
    assert suite.heuristic_configs(64, cpus=1)["rule-of-thumb"].num_workers == 1


def _point(workers: int, sps: float, score: float, state: str = "complete") -> dict:
    c = Candidate(64, workers, prefetch_factor=2 if workers else None)
    return {"candidate": c.to_dict(), "state": state, "samples_per_s": sps, "score": score}


def test_grid_finalists_take_the_best_scores_and_the_fastest_per_sample() -> None:
    points = [
        _point(0, 100, 100),
        _point(1, 300, 250),
        _point(2, 500, 150),  # fastest per sample, but a slow start-up costs it in the score
        _point(3, 0, 0, state="failed"),
        _point(4, 200, 200),
    ]
    finalists = suite.grid_finalists(points, top_k=2)
    assert [c.num_workers for c in finalists] == [1, 4, 2]


def test_time_target_is_an_upper_bound_and_the_others_lower_bounds() -> None:
    headline = {"tuned_over_oracle": 0.97, "tuned_over_default": 0.9,
                "tuned_over_best_heuristic": 1.2, "tuning_over_grid_time": 0.1}
    met = {label: t["met"] for label, t in suite.targets(headline).items()}
    assert met == {
        "tuned/oracle >= 0.95": True,
        "tuned/default >= 1.0": False,
        "tuned >= every rule of thumb": True,
        "tuning time <= 15 % of grid time": True,
    }


def test_a_missed_time_target_says_where_the_tuning_time_went() -> None:
    from benchmarks._common import output

    headline = {"tuned_over_oracle": 1.0, "tuned_over_default": 2.0,
                "tuned_over_best_heuristic": 1.5, "tuning_over_grid_time": 0.3}
    result = {
        "name": "w", "headline": headline, "targets": suite.targets(headline),
        "configs": {"tuned": {}},
        "tuning": {"tuning_s": 21.0, "winner_found_s": 7.0, "search_s": 14.0, "tried_after_winner": 9,
                   "final_s": 6.2},
        "grid": {"size": 68, "total_s": 70.0},
    }
    (line,) = output.misses([result])
    assert "0.30 against 0.15" in line
    assert "first measured 7 s in; the search tried 9 more candidates (7 s)" in line
    assert "re-measurement took 6 s" in line


# --------------------------------------------------------------------------------------------------
# The focused benchmarks: training runs, `autotune run`, repeatability. Their quick modes run end to
# end here (figures unchecked: they mean nothing on a shared machine); their helpers on exact figures.


def _quick(script: str, out: Path, *args: str) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run([sys.executable, f"benchmarks/scripts/{script}", "--quick", "--out", str(out),
                           *args],
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc


def test_training_quick_run_records_both_modes_and_stops_its_hog(tmp_path: Path) -> None:
    from benchmarks.scripts import training

    _quick("training.py", tmp_path)
    data = json.loads((tmp_path / "training.json").read_text())
    assert data["meta"]["quick"] is True
    (workload,) = data["workloads"]
    assert workload["name"] == "no-gain"
    assert list(workload["modes"]) == list(training.MODES)
    for mode, m in workload["modes"].items():
        (repeat,) = m["repeats"]
        assert set(repeat["runs"]) == set(training.RUNS), mode
        for one in repeat["runs"].values():
            assert len(one["epochs_s"]) == data["meta"]["epochs"] and one["wall_s"] > 0
        assert set(m["ratios"]) >= {name for name, _, _, _ in training.TARGETS}
    # The drop-in against the oracle is a target on the quiet machine only.
    assert "drop-in / oracle <= 1.05x" in workload["modes"]["quiet"]["targets"]
    assert "drop-in / oracle <= 1.05x" not in workload["modes"]["loaded"]["targets"]
    hog = workload["modes"]["loaded"]["hog"]
    assert hog["enabled"] and not workload["modes"]["quiet"]["hog"]["enabled"]
    assert not _alive(hog["pid"]), "the loaded mode's hog outlived the benchmark"
    report = (tmp_path / "TRAINING.md").read_text()
    assert "Quick mode" in report and "| no-gain | loaded |" in report


def test_autotune_run_quick_run_checks_the_reported_speedup(tmp_path: Path) -> None:
    from benchmarks.scripts import autotune_run

    _quick("autotune_run.py", tmp_path)
    data = json.loads((tmp_path / "autotune_run.json").read_text())
    assert data["quick"] is True and data["parts"] == list(autotune_run.PARTS)
    assert [c["workers"] for c in data["speedup"]] == list(autotune_run.QUICK_CHECK_WORKERS)
    for check in data["speedup"]:
        # Whatever the report decided, both settings were measured in every round.
        assert len(check["samples_per_s"]["script"]) == len(check["samples_per_s"]["reported"]) == 1
        assert check["measured"]["ratio"] > 0
        # Nothing reported (a baseline too big to measure in a tiny epoch) is a missed target, not a pass.
        assert check["met"] is (check["reported"] is not None and check["met"])
    report = (tmp_path / "AUTOTUNE_RUN.md").read_text()
    assert "Quick mode" in report and "## 4. The reported speed-up" in report


def test_repeat_quick_run_tunes_and_remeasures_with_both_drivers(tmp_path: Path) -> None:
    from benchmarks.scripts import repeat

    _quick("repeat.py", tmp_path)
    data = json.loads((tmp_path / "repeat.json").read_text())
    (workload,) = data["workloads"]
    assert [d["driver"] for d in workload["drivers"]] == list(repeat.DRIVERS)
    for d in workload["drivers"]:
        assert len(d["tunings"]) == len(d["picks"]) == repeat.QUICK["tunings"]
        defaults = Candidate(workload["batch_size"]).label()
        assert len(d["configs"][defaults]["samples_per_s"]) == repeat.QUICK["rounds"]
    assert "Quick mode" in (tmp_path / "REPEAT.md").read_text()


def test_startup_quick_run_measures_both_arms(tmp_path: Path) -> None:
    _quick("startup.py", tmp_path)
    data = json.loads((tmp_path / "startup.json").read_text())
    (workload,) = data["workloads"]
    assert set(workload["runs"]) == {"ahead", "in turn"}
    assert all(run["wall_s"] > 0 for runs in workload["runs"].values() for run in runs)
    # The arm that starts each candidate in its turn never starts one ahead.
    assert all(run["started_ahead"] == 0 for run in workload["runs"]["in turn"])
    assert "Quick mode" in (tmp_path / "STARTUP.md").read_text()


def test_spin_quick_run_measures_every_arm_in_its_own_process_and_stops_its_hog(tmp_path: Path) -> None:
    from benchmarks.scripts import spin

    _quick("spin.py", tmp_path)
    data = json.loads((tmp_path / "spin.json").read_text())
    (level,) = data["levels"]
    assert level["hogs"] == 1 and list(level["arms"]) == list(spin.ARMS)
    assert all(len(a["samples_per_s"]) == spin.QUICK["rounds"] for a in level["arms"].values())
    # Each arm ran as it says: the passive wait policy in its environment, one torch thread.
    assert level["arms"]["passive"]["ran_with"]["omp_wait_policy"] == "PASSIVE"
    assert level["arms"]["threads=1"]["ran_with"] == {"torch_threads": 1, "omp_wait_policy": None}
    assert level["arms"]["defaults"]["ran_with"]["omp_wait_policy"] is None
    assert level["hog_cpu_s"][0] is not None
    assert "Quick mode" in (tmp_path / "SPIN.md").read_text()


@pytest.mark.parametrize("script", ["training", "autotune_run", "repeat", "startup", "spin"])
def test_focused_benchmarks_write_their_results_folder_unless_quick(script: str) -> None:
    module = importlib.import_module(f"benchmarks.scripts.{script}")
    assert module.out_folder(module.parse_args([])) == RESULTS / script
    assert module.out_folder(module.parse_args(["--out", "elsewhere"])) == Path("elsewhere")
    quick = module.out_folder(module.parse_args(["--quick"]))
    # A smoke run's figures mean nothing: a new temporary folder, never benchmarks/.
    assert quick.name.startswith(module.QUICK_OUT_PREFIX) and BENCHMARKS not in quick.parents
    quick.rmdir()


def test_paired_interval_is_students_t_on_the_log_ratios() -> None:
    from benchmarks._common.stats import paired_interval

    # Per-round log ratios 0.1, 0.2, 0.3: mean 0.2, standard deviation 0.1, three rounds, so the
    # interval is exp(0.2 -+ 2.920 * 0.1 / sqrt(3)) (t with two degrees of freedom, one-sided 95 %).
    b = [100.0, 50.0, 10.0]
    a = [x * math.exp(d) for x, d in zip(b, (0.1, 0.2, 0.3), strict=True)]
    got = paired_interval(a, b)
    half = 2.920 * 0.1 / math.sqrt(3)
    assert got.ratio == pytest.approx(math.exp(0.2))
    assert (got.low, got.high) == (pytest.approx(math.exp(0.2 - half)), pytest.approx(math.exp(0.2 + half)))
    assert got.contains(1.3) and not got.contains(1.0)
    one = paired_interval([2.0], [1.0])
    assert one.ratio == 2.0 and one.contains(100.0) and one.to_dict()["high"] is None  # JSON has no infinity
    with pytest.raises(ValueError, match="one value of each per round"):
        paired_interval([1.0, 2.0], [1.0])


def test_cpu_hog_burns_a_core_and_is_killed_when_the_block_raises() -> None:
    from benchmarks._common.hog import cpu_hog

    with pytest.raises(RuntimeError, match="the benchmark failed"), cpu_hog() as record:
        pid = record["pid"]
        proc = psutil.Process(pid)
        # another process's load, as others' load reads it: not one of this process's descendants
        assert pid not in {p.pid for p in psutil.Process().children(recursive=True)}
        deadline = time.monotonic() + 30
        while sum(proc.cpu_times()[:2]) < 0.05 and time.monotonic() < deadline:
            time.sleep(0.05)  # it runs: CPU time accrues (slowly on a loaded machine)
        assert sum(proc.cpu_times()[:2]) >= 0.05
        raise RuntimeError("the benchmark failed")
    assert record["returncode"] is not None and record["alive_s"] > 0
    assert not _alive(pid)


def test_cpu_hog_ends_by_itself_when_its_parent_dies_without_cleaning_up() -> None:
    # A benchmark killed outright runs no `finally`: the hog notices its parent is gone.
    code = ("import os, sys\nfrom benchmarks._common.hog import cpu_hog\n"
            "with cpu_hog() as r:\n    print(r['pid'], flush=True)\n    os._exit(0)\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    pid = int(proc.stdout.split()[0])
    deadline = time.monotonic() + 30
    while _alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(pid), "an orphaned hog kept running"


def _alive(pid: int) -> bool:
    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def _runs(users: float, dropin: float, tune: float, oracle: float, second: float) -> dict[str, Any]:
    walls = (users, dropin, tune, oracle, second)
    return {"runs": {label: {"wall_s": w} for label, w in zip(
        ("user's settings", "drop-in", "tune+train", "oracle", "second run"), walls, strict=True)}}


def test_training_targets_use_the_median_over_repeats_and_the_quiet_only_oracle_bound() -> None:
    from benchmarks.scripts import training

    repeats = [_runs(100, 101, 120, 90, 91), _runs(100, 110, 120, 90, 90), _runs(100, 100, 120, 90, 92)]
    quiet = training.summarise(repeats, "quiet")
    assert quiet["ratios"]["drop-in / user's settings"] == {"median": 1.01, "min": 1.0, "max": 1.1}
    assert quiet["targets"] == {
        "drop-in / user's settings <= 1.02x": True,  # the median 1.01, though one repeat was 1.10
        "drop-in / oracle <= 1.05x": False,  # 101 / 90
        "second run / oracle <= 1.02x": True,
    }
    assert "drop-in / oracle <= 1.05x" not in training.summarise(repeats, "loaded")["targets"]


def test_repeatability_counts_the_differing_picks_and_judges_them_against_the_fastest() -> None:
    from benchmarks.scripts import repeat

    a, b, base = Candidate(64, 2, prefetch_factor=2), Candidate(64, 3, prefetch_factor=2), Candidate(64)
    tunings = [{"pick": c.to_dict(), "label": c.label()} for c in (a, a, b, a)]
    tunings.append({"pick": None, "label": None})  # a tuning that measured nothing
    per = {a: [100.0, 104.0, 98.0], b: [101.0, 99.0, 103.0], base: [50.0, 52.0, 49.0]}
    got = repeat.judge(tunings, per)
    assert got["distinct"] == 3 and got["most_common"] == a.label() and got["differs"] == 2
    assert got["fastest"] == b.label()  # median 101 against 100
    assert got["configs"][a.label()]["within_noise"] and got["all_within_noise"]
    assert "within_noise" not in got["configs"][base.label()]  # the defaults are context, not a pick
    per[a] = [80.0, 81.0, 79.0]  # now clearly slower than b in every round
    assert not repeat.judge(tunings, per)["all_within_noise"]


def test_decisions_quick_run_measures_the_folder_workload_as_a_script_writes_it(tmp_path: Path) -> None:
    # One run of the image folder (PNG files written by the child) with num_workers=2 written: the
    # user's loop, the drop-in's, the oracle and the plain-loop check all measured and written out.
    proc = subprocess.run(
        [sys.executable, "benchmarks/scripts/decisions.py", "--quick", "--workloads", "folder",
         "--written", "w2", "--out", str(tmp_path)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((tmp_path / "decisions.json").read_text())
    (run,) = data["modes"]["quiet"]["runs"]
    assert "error" not in run, run.get("error")
    assert (run["workload"], run["written"]) == ("folder", "w2")
    assert len(run["user_s"]) == len(run["tuned_s"]) and set(run["oracle_s"]) >= {"w=0", "w=2"}
    rounds = run["plain_loop_rounds"]  # the returned choice beside the user's settings, round by round
    assert rounds is None or (len(rounds) == decisions.QUICK.plain_rounds
                              and run["plain_loop_speedup"] == statistics.median(rounds))
    page = (tmp_path / "DECISIONS.md").read_text()
    assert "| folder | w2 |" in page and "Quick mode" in page
    if rounds is not None:  # each loader's short windows against its epochs, from the same rounds
        assert set(run["plain_loop_window_lean"]) == {"users", "made"}
    search = run["search"]  # the last search's trials: its ledger replays to the verdict it gave
    ledger = Ledger.replayed([TrialRecord.from_dict(t) for t in search["trials"]], search["dataset_len"],
                             decisions.EPOCHS, search["stop_per_worker_s"])
    assert ledger.tried()
    est = run["estimators"]
    if est and est["this_search"]:
        base = next(t.candidate for t in ledger.records if t.phase == "baseline")
        chosen = next(c for c in ledger.tried() if c.label() == run["chosen"])
        assert ledger.verdict(chosen, base, built=False).ratio == pytest.approx(est["this_search"])


def test_window_lean_reads_rare_stalls_high_and_bursts_low() -> None:
    # A loop that never stalls reads its epoch's rate in every window. One with a stall of 20 ms in
    # every 40 batches of 2 ms pays for the stalls over the epoch, but most short windows hold none:
    # they read faster. One whose batches come four at once after a wait reads slower in the median
    # window than the epoch, where it is the other way round.
    def arrivals(gaps: list[float]) -> list[float]:
        t, out = 0.0, []
        for g in gaps:
            t += g
            out.append(t)
        return out

    assert decisions.window_lean(arrivals([0.002] * 128), 16) == pytest.approx(1.0)
    stalls = [0.02 if i % 40 == 39 else 0.002 for i in range(128)]
    assert decisions.window_lean(arrivals(stalls), 16) > 1.1
    bursts = [0.008 if i % 4 == 0 else 0.0001 for i in range(128)]
    assert decisions.window_lean(arrivals(bursts), 3) < 1.0
    assert decisions.window_lean(arrivals([0.002] * 20), 16) is None  # too short for two windows


def test_decisions_refuses_an_unknown_workload_by_name() -> None:
    import tempfile

    before = set(Path(tempfile.gettempdir()).glob("autotune-decisions-*"))
    with pytest.raises(SystemExit) as exit_:
        decisions.main(["--quick", "--workloads", "folder,cifar"])
    assert exit_.value.code == 2  # argparse's usage error, with the message below on stderr
    assert set(Path(tempfile.gettempdir()).glob("autotune-decisions-*")) == before  # no folder left


def _decision_run(decision: str, gain: float, run_ratio: float) -> dict[str, Any]:
    return {"workload": "tabular", "written": "nothing", "oracle_gain": gain, "plain_loop_speedup": gain,
            "decision": decision, "chosen": "bs=32 w=0", "settled_in_epoch": 2, "run_ratio": run_ratio,
            "reported_speedup": gain if decision == "win" else 1.0, "reported_low": None}


def test_decisions_combines_pages_into_one_summary_per_case(tmp_path: Path) -> None:
    # Two pages of one repeat each (the figures written here, not measured): the combined page
    # counts both runs of the case, in its summary and its row, and marks each run with its commit.
    for name, commit, run in (("a", "aaa", _decision_run("win", 1.03, 1.04)),
                              ("b", "bbb", _decision_run("kept", 1.01, 1.02))):
        (tmp_path / name).mkdir()
        decisions._save({"when": "then", "machine": "this one", "commit": commit,
                         "modes": {"quiet": {"runs": [run], "summary": decisions.summarize([run])}}},
                        tmp_path / name)
    assert decisions.main(["--combine", str(tmp_path / "a"), str(tmp_path / "b"),
                           "--out", str(tmp_path / "both")]) == 0
    block = json.loads((tmp_path / "both" / "decisions.json").read_text())["modes"]["quiet"]
    assert block["summary"]["changed_with_nothing_to_win"] == "1 of 2"
    (case,) = block["cases"]
    assert (case["runs"], case["decisions"], case["run_ratio_worst"]) == (2, {"kept": 1, "win": 1}, 1.04)
    assert [r["commit"] for r in block["runs"]] == ["aaa", "bbb"]
    page = (tmp_path / "both" / "DECISIONS.md").read_text()
    assert "| tabular | nothing | 2 |" in page and "aaa, bbb" in page
    with pytest.raises(SystemExit, match="no decisions.json there"):
        decisions.main(["--combine", str(tmp_path / "missing"), "--out", str(tmp_path / "c")])
