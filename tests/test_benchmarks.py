"""The benchmark suite runs end to end and records every figure; its helpers do what the protocol says.

The figures themselves are not checked here (speed claims live in benchmarks/RESULTS.md): ``--quick``
only proves that every workload and every configuration is measured and written out.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from autotune.space import Candidate
from benchmarks import run, suite  # the checkout's root is on pytest's pythonpath (pyproject)

ROOT = Path(__file__).resolve().parent.parent

CONFIGS = ("default", "workers=cpus", "rule-of-thumb", "over-provisioned", "tuned", "grid #1")


def test_quick_run_measures_every_workload_and_config(tmp_path: Path) -> None:
    out = tmp_path / "bench"
    proc = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    data = json.loads((out / "results.json").read_text())
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
    report = (out / "RESULTS.md").read_text()
    for name in suite.WORKLOAD_NAMES:
        assert f"### {name}" in report
    assert (out / "results.png").stat().st_size > 0


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message shown without CUDA")
def test_gpu_mode_without_cuda_skips_cleanly(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert run.main(["--gpu", "--out", str(tmp_path / "bench")]) == 0
    assert "CUDA is not available" in capsys.readouterr().out
    assert not (tmp_path / "bench").exists()  # nothing measured, nothing written


def _record_writes(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Stand-ins for the measuring and the writing: the paths ``run.main`` would write, in order.

    What is measured does not matter here, only where it goes; the real run is
    test_quick_run_measures_every_workload_and_config.
    """
    from benchmarks import output

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
    assert run.main(["--quick", "--workload", "tensor"]) == 0
    names = {p.name for p in written}
    assert names == {"results.json", "RESULTS.md", "results.png"}
    # A smoke run's figures mean nothing: they go to a temporary folder, never over benchmarks/.
    for path in written:
        assert ROOT / "benchmarks" not in path.parents, path
        assert path.parent.name.startswith(run.QUICK_OUT_PREFIX), path
    assert str(written[0].parent) in capsys.readouterr().out  # the run says where it wrote
    written[0].parent.rmdir()  # the stand-ins wrote nothing into it


def test_explicit_out_wins_over_the_quick_default(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    written = _record_writes(monkeypatch)
    assert run.main(["--quick", "--workload", "tensor", "--out", str(tmp_path / "bench")]) == 0
    assert {p.parent for p in written} == {tmp_path / "bench"}


def test_a_full_run_writes_the_committed_results_by_default() -> None:
    assert run.out_folder(run.parse_args([])) == ROOT / "benchmarks"


def test_script_entry_point_finds_the_package() -> None:
    # ``python benchmarks/run.py`` puts benchmarks/ on sys.path, not the repository root.
    proc = subprocess.run([sys.executable, "benchmarks/run.py", "--help"], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert "--quick" in proc.stdout


def test_rounds_rotate_so_every_config_leads_once() -> None:
    items = ["a", "b", "c"]
    orders = [suite.rotated(items, r) for r in range(3)]
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
    from benchmarks import output

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
