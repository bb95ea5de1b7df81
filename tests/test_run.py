"""``autotune run``: real scripts, written to a temporary folder, run through the command in a subprocess.

The scripts are small (512 samples with a short sleep per sample, so that loading matters, and one or
two epochs); the tests check what a user relies on (the script's own output, exit code and traceback,
a report per loader on stderr, nothing left behind), not which configuration wins.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import psutil
import pytest
import torch
from torch.utils.data import DataLoader as TorchDataLoader

from autotune import TuneResult
from autotune.cli import main
from autotune.decide import TrialRecord
from autotune.loader import MIN_TUNE_BATCHES
from autotune.measure import Measurement
from autotune.space import Candidate
from autotune.supervise import SHM_DIR

REPO = Path(__file__).resolve().parent.parent

RUN_TIMEOUT_S = 240
"""A run of a small script takes seconds; this only stops a hung one from hanging the suite."""

DATASET = """\
import time
import torch
from torch.utils.data import Dataset


class Slow(Dataset):
    # Simulated slow storage: a short wait per sample, so that workers help.
    def __init__(self, n=512, delay_s=0.002):
        self.n, self.delay_s = n, delay_s

    def __len__(self):
        return self.n

    def __getitem__(self, i):
        time.sleep(self.delay_s)
        return torch.full((8,), float(i % 7)), i % 2
"""

TRAIN = """\
import atexit
import sys

import torch
from torch.utils.data import DataLoader

from data import Slow  # beside the script: its folder is on sys.path, as with python

print("name", __name__, "argv", sys.argv[1:], flush=True)
print("threads at start", torch.get_num_threads(), flush=True)
atexit.register(lambda: print("threads at exit", torch.get_num_threads(), flush=True))

train = DataLoader(Slow(), batch_size=16, shuffle=True, num_workers=1)  # train-loader
evaluate = DataLoader(Slow(128), batch_size=32)  # eval-loader
model = torch.nn.Linear(8, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.01)
try:
    for epoch in range(int(sys.argv[1])):
        for x, y in train:
            loss = torch.nn.functional.cross_entropy(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
        print("epoch", epoch, flush=True)
    print("evaluated", sum(len(x) for x, _ in evaluate), flush=True)  # read once
    print("trained", flush=True)
finally:
    print("finally ran", flush=True)
"""


def _write(folder: Path, name: str, text: str) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / name
    path.write_text(textwrap.dedent(text))
    return path


def _line_of(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


def _env() -> dict[str, str]:
    env = dict(os.environ)  # AUTOTUNE_CACHE_DIR comes from the test's fixture
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("PYTHONWARNINGS", None)
    return env


def autotune_run(cwd: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "autotune", "run", *args], cwd=cwd, env=_env(), capture_output=True,
        text=True, timeout=RUN_TIMEOUT_S,
    )


def _left_behind(tag: str) -> list[int]:
    """Processes whose command line names ``tag``: forked workers carry their parent's."""
    out = []
    for p in psutil.process_iter(["cmdline"]):
        cmdline = p.info.get("cmdline") or []
        if any(tag in arg for arg in cmdline):
            out.append(p.pid)
    return out


def _orphan_segments() -> set[str]:
    """Shared-memory segments of workers that no longer run (the names supervise.py cleans up)."""
    out = set()
    for path in Path(SHM_DIR).glob("torch_*_*") if os.path.isdir(SHM_DIR) else ():
        pid = path.name.split("_")[1]
        if pid.isdigit() and not psutil.pid_exists(int(pid)):
            out.add(path.name)
    return out


def _assert_nothing_left(tmp_path: Path, segments_before: set[str]) -> None:
    deadline = time.monotonic() + 5.0
    while _left_behind(str(tmp_path)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _left_behind(str(tmp_path)), "a process of the run outlived it"
    assert not _orphan_segments() - segments_before


@pytest.fixture
def nothing_left(tmp_path: Path) -> Iterator[None]:
    """Fail the test if a process of the run, or a dead worker's shared memory, outlives it. Scripts
    are run by their absolute path, which is in every forked worker's command line."""
    before = _orphan_segments()
    yield
    _assert_nothing_left(tmp_path, before)


# --------------------------------------------------------------------------------------------------
# A plain training loop with two loaders, --json, and the second run from the stored profile


def test_a_training_loop_is_tuned_and_reported_and_the_script_keeps_its_output(
    tmp_path: Path, nothing_left: None
) -> None:
    project = tmp_path / "project"
    _write(project, "data.py", DATASET)
    script = _write(project, "train.py", TRAIN)
    report = tmp_path / "report.json"
    done = autotune_run(tmp_path, "--json", str(report), str(script), "2", "--json", "is-the-script's")

    assert done.returncode == 0, done.stderr
    # stdout is the script's alone, in its order; the thread count is the script's again at exit.
    lines = done.stdout.splitlines()
    assert lines[0] == "name __main__ argv ['2', '--json', \"is-the-script's\"]"
    assert lines[2:] == ["epoch 0", "epoch 1", "evaluated 128", "trained", "finally ran",
                         lines[1].replace("at start", "at exit")]
    train_at = f"project/train.py:{_line_of(script, 'train-loader')}"
    eval_at = f"project/train.py:{_line_of(script, 'eval-loader')}"
    err = done.stderr
    assert f"DataLoader 1, built at {train_at}" in err
    assert "the script's settings: batch_size=16, num_workers=1" in err
    assert "best found:" in err and "your settings (num_workers=1)" in err and "decision:" in err
    assert "the next `autotune run` starts there" in err
    # Read once, 4 batches: too short, and said so rather than guessed.
    assert f"DataLoader 2, built at {eval_at}" in err
    assert f"iterated too little to tune: 4 batches served, {MIN_TUNE_BATCHES} needed" in err

    doc = json.loads(report.read_text())
    assert doc["ended"] == "finished" and doc["exit_code"] == 0 and doc["args"][0] == "2"
    first, second = doc["loaders"]
    assert (first["origin"], first["status"]) == (train_at, "tuned")
    assert first["script_settings"] == {"num_workers": 1}
    assert first["served_batches"] == 64 and first["best"]["batch_size"] == 16
    assert set(first["training_args"]) == {"dataloader_num_workers", "dataloader_pin_memory",
                                           "dataloader_persistent_workers", "dataloader_prefetch_factor"}
    assert first["tuning"]["trials"][0]["phase"] == "baseline"
    assert (second["origin"], second["status"], second["served_batches"]) == (eval_at, "too-short", 4)
    assert "best" not in second

    # The profile was stored by the loader: the second run starts at it and explores nothing.
    again = autotune_run(tmp_path, str(script), "1")
    assert again.returncode == 0, again.stderr
    assert f"the DataLoader at {train_at} starts at its stored profile" in again.stderr
    assert "best (stored profile):" in again.stderr


# --------------------------------------------------------------------------------------------------
# --stop-when-tuned and Ctrl-C


def test_stop_when_tuned_ends_the_script_once_its_loader_settled_and_its_finally_runs(
    tmp_path: Path, nothing_left: None
) -> None:
    _write(tmp_path, "data.py", DATASET)
    script = _write(tmp_path, "train.py", TRAIN)
    started = time.monotonic()
    done = autotune_run(tmp_path, "--stop-when-tuned", str(script), "200")  # 200 epochs: minutes
    assert done.returncode == 0, done.stderr
    assert "trained" not in done.stdout and "finally ran" in done.stdout
    assert "was stopped: every DataLoader it iterates is tuned (--stop-when-tuned)" in done.stderr
    assert "best found:" in done.stderr
    assert time.monotonic() - started < RUN_TIMEOUT_S / 2


def test_ctrl_c_reports_what_was_measured_and_leaves_nothing(tmp_path: Path, nothing_left: None) -> None:
    _write(tmp_path, "data.py", DATASET)
    script = _write(tmp_path, "train.py", TRAIN)
    # As in a terminal: a test runner started in the background ignores SIGINT, and its children
    # would inherit that (Python then installs no KeyboardInterrupt handler).
    proc = subprocess.Popen([sys.executable, "-m", "autotune", "run", str(script), "200"], cwd=tmp_path,
                            env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith("epoch 0"):  # by now workers were explored
                break
        proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=RUN_TIMEOUT_S)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 130, err
    assert "KeyboardInterrupt" in err and "finally ran" in out
    assert "was interrupted (exit code 130)" in err and "DataLoader 1, built at train.py:" in err


# --------------------------------------------------------------------------------------------------
# The script's own ending: exceptions, exit codes, no loader


@pytest.mark.parametrize(
    ("body", "code", "stderr_has"),
    [
        ("import sys\nprint('before')\nsys.exit(3)\n", 3, "exited with code 3"),
        ("import sys\nprint('before')\nsys.exit('bad config: lr < 0')\n", 1, "bad config: lr < 0\n"),
        ("print('before')\n", 0, "It built no torch DataLoader, so there was nothing to tune."),
    ],
    ids=["exit-code", "exit-message", "no-loader"],
)
def test_the_exit_code_is_the_script_s_own(tmp_path: Path, body: str, code: int, stderr_has: str) -> None:
    script = _write(tmp_path, "job.py", "import torch.utils.data\n" + body)
    done = autotune_run(tmp_path, str(script))
    assert done.returncode == code, done.stderr
    assert done.stdout == "before\n"
    assert stderr_has in done.stderr


def test_a_subclass_of_dataloader_in_the_script_stays_torch_s_and_is_not_tuned(tmp_path: Path) -> None:
    # A subclass may replace the iteration the drop-in tunes (torchdata's StatefulDataLoader does):
    # it keeps torch's DataLoader as its base, and isinstance and DataLoader[T] work as in torch.
    script = _write(tmp_path, "sub.py", """\
        import torch
        from torch.utils.data import DataLoader, TensorDataset

        class Mine(DataLoader):
            pass

        class Typed(DataLoader[int]):
            pass

        data = TensorDataset(torch.arange(8.0))
        mine, plain = Mine(data, batch_size=4), DataLoader(data, batch_size=4)
        print(Mine.__bases__[0].__module__, Typed.__mro__[1].__module__)
        print(isinstance(mine, DataLoader), isinstance(plain, DataLoader), type(plain) is DataLoader)
        print(sum(len(b[0]) for b in mine), sum(len(b[0]) for b in plain))
        """)
    done = autotune_run(tmp_path, str(script))
    assert done.returncode == 0, done.stderr
    torch_s = "torch.utils.data.dataloader"
    assert done.stdout == f"{torch_s} {torch_s}\nTrue True True\n8 8\n"
    assert f"DataLoader 1, built at sub.py:{_line_of(script, 'mine, plain =')}" in done.stderr
    assert "DataLoader 2" not in done.stderr  # Mine is not a drop-in
    assert "iterated too little to tune: 2 batches served" in done.stderr


def test_a_script_that_raises_shows_its_own_traceback_and_exits_1(tmp_path: Path) -> None:
    script = _write(tmp_path, "boom.py", """\
        import torch

        def load_shard(n):
            raise ValueError(f"shard {n} is corrupt")

        try:
            load_shard(7)
        finally:
            print("finally ran")
        """)
    done = autotune_run(tmp_path, str(script))
    assert done.returncode == 1
    assert done.stdout == "finally ran\n"
    err = done.stderr
    # As python prints it: the script's frames only, from its first line.
    tb = err[err.index("Traceback (most recent call last):"):]
    frames = [ln.strip() for ln in tb.splitlines() if ln.strip().startswith("File ")]
    assert frames[0].startswith(f'File "{script}", line 7, in <module>'), tb
    assert frames[1].endswith("in load_shard") and len(frames) == 2, tb
    assert "ValueError: shard 7 is corrupt" in err
    assert "raised ValueError: shard 7 is corrupt (exit code 1)" in err
    assert "It built no torch DataLoader before building one" in err


# --------------------------------------------------------------------------------------------------
# Bad input


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["no_such_train.py", "--epochs", "1"], "cannot open 'no_such_train.py': no such file"),
        (["-m", "no_such_pkg_for_autotune.train"], "no module named 'no_such_pkg_for_autotune'"),
        ([], "give the script to run"),
        (["--json", "no/such/dir.json", "x.py"], "--json 'no/such/dir.json': its folder does not exist"),
    ],
    ids=["no-script", "no-module", "nothing", "json-folder"],
)
def test_bad_input_is_a_usage_error_before_anything_runs(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], argv: list[str],
    message: str,
) -> None:
    # In this process, through the command's main(): nothing of a script runs in these cases.
    monkeypatch.chdir(tmp_path)
    assert main(["run", *argv]) == 2
    out, err = capsys.readouterr()
    assert out == "" and message in err and "usage: autotune run" in err
    assert torch.utils.data.DataLoader is TorchDataLoader  # torch's own again


def test_a_module_runs_as_python_m_runs_it_with_its_arguments_after_the_dashes(tmp_path: Path) -> None:
    _write(tmp_path / "mypkg", "__init__.py", "")
    _write(tmp_path / "mypkg", "train.py", """\
        import sys
        print(__name__, sys.argv[0].endswith("train.py"), sys.argv[1:])
        raise SystemExit(4)
        """)
    done = autotune_run(tmp_path, "-m", "mypkg.train", "--", "--lr", "0.1")
    assert done.returncode == 4, done.stderr
    assert done.stdout == "__main__ True ['--lr', '0.1']\n"


# --------------------------------------------------------------------------------------------------
# The trainers people use


def test_a_lightning_fit_with_a_plain_dataloader_is_tuned(tmp_path: Path, nothing_left: None) -> None:
    pytest.importorskip("lightning")
    _write(tmp_path, "data.py", DATASET)
    script = _write(tmp_path, "fit.py", """\
        import warnings

        # The script's own filters (pytest's -W error does not reach a subprocess): Lightning's
        # advice about workers and logging intervals, which this small run triggers.
        warnings.filterwarnings("ignore", message=".*does not have many workers.*")
        warnings.filterwarnings("ignore", message=".*smaller than the logging interval.*")

        import lightning as L
        import torch
        from torch.utils.data import DataLoader

        from data import Slow


        class Model(L.LightningModule):
            def __init__(self):
                super().__init__()
                self.net = torch.nn.Linear(8, 2)

            def training_step(self, batch, _):
                x, y = batch
                return torch.nn.functional.cross_entropy(self.net(x), y)

            def configure_optimizers(self):
                return torch.optim.SGD(self.parameters(), lr=0.01)


        torch.manual_seed(0)
        trainer = L.Trainer(max_epochs=2, accelerator="cpu", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(Model(), DataLoader(Slow(), batch_size=16, shuffle=True))  # the loader
        print("fitted", trainer.current_epoch)
        """)
    done = autotune_run(tmp_path, str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout == "fitted 2\n"
    assert "Traceback" not in done.stderr and "Warning" not in done.stderr, done.stderr
    assert f"DataLoader 1, built at fit.py:{_line_of(script, 'the loader')}" in done.stderr
    # Lightning stops asking after len(loader) batches; the epoch still ends and the loader settles.
    assert "best found:" in done.stderr, done.stderr
    assert any(said in done.stderr for said in (
        "paste into the DataLoader(...) at fit.py", "ThreadDataLoader", "nothing to change in the script",
        "use `from autotune import DataLoader` there"))


HF_TRAIN = """\
    import time
    import warnings

    warnings.filterwarnings("ignore", category=FutureWarning)

    import torch
    from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments


    class Tokens(torch.utils.data.Dataset):
        # Token ids made from the index: nothing downloaded, no tokenizer.
        def __len__(self):
            return 512

        def __getitem__(self, i):
            time.sleep(0.002)
            ids = torch.randint(0, 100, (16,), generator=torch.Generator().manual_seed(i))
            return {"input_ids": ids, "attention_mask": torch.ones(16, dtype=torch.long), "labels": i % 2}


    torch.manual_seed(0)
    config = BertConfig(vocab_size=100, hidden_size=16, num_hidden_layers=1, num_attention_heads=2,
                        intermediate_size=32)
    args = TrainingArguments(output_dir="out", num_train_epochs=2, per_device_train_batch_size=8,
                             report_to=[], use_cpu=True, save_strategy="no", logging_strategy="no",
                             disable_tqdm=True, dataloader_num_workers=1)
    trainer = Trainer(model=BertForSequenceClassification(config), args=args, train_dataset=Tokens())
    trainer.train()  # the call
    print("trained")
    """


def test_a_transformers_trainer_s_own_loader_is_tuned_and_reported_as_training_arguments(
    tmp_path: Path, nothing_left: None
) -> None:
    pytest.importorskip("transformers")
    pytest.importorskip("accelerate", reason="transformers.Trainer needs accelerate (pip install accelerate)")
    script = _write(tmp_path, "hf.py", HF_TRAIN)
    report = tmp_path / "hf.json"
    done = autotune_run(tmp_path, "--json", str(report), str(script))
    assert done.returncode == 0, done.stderr
    assert done.stdout.splitlines()[-1] == "trained"
    assert "Traceback" not in done.stderr
    err = done.stderr
    # The Trainer built the loader (and accelerate rebuilt it): reported once, where the script called.
    assert err.count("DataLoader 1, built at transformers/trainer.py:") == 1 and "DataLoader 2" not in err
    assert f"(called from hf.py:{_line_of(script, 'the call')})" in err
    assert "the script's settings: batch_size=8, num_workers=1" in err
    # Which settings win is measured (test_the_trainer_s_loader_is_reported_as_training_arguments
    # renders a fixed result): kept, the report says there is nothing to change; else what to paste.
    if "(the script's own settings: nothing beat them with confidence)" in err:
        assert "nothing to change in the script" in err and "paste into" not in err
    else:
        assert "paste into TrainingArguments(...):" in err and "dataloader_num_workers=" in err
    (loader,) = json.loads(report.read_text())["loaders"]
    assert loader["builder"].startswith("transformers.") and loader["served_batches"] == 128
    assert loader["status"] == "tuned"

    from transformers import TrainingArguments

    args = TrainingArguments(output_dir=str(tmp_path / "out"), **loader["training_args"])
    assert args.dataloader_num_workers == loader["training_args"]["dataloader_num_workers"]


# --------------------------------------------------------------------------------------------------
# TuneResult.training_args


def test_the_trainer_s_loader_is_reported_as_training_arguments() -> None:
    from autotune.run import LoaderRecord, _paste_lines

    record = LoaderRecord(number=1, origin="transformers/trainer.py:1051", called_from="hf.py:30",
                          builder="transformers.trainer", script_settings={"num_workers": 1},
                          batch_size=16, epoch_batches=64)
    chosen = Candidate(batch_size=16, num_workers=3, prefetch_factor=4, persistent_workers=True)
    result = TuneResult(loader_kwargs=chosen.loader_kwargs(), trials=(_trial(0, chosen, 1000.0),))
    lines = _paste_lines(record, result)
    assert lines[0] == "  the Trainer builds this loader; paste into TrainingArguments(...):"
    assert lines[1].strip() == ("dataloader_num_workers=3, dataloader_pin_memory=False,"
                                " dataloader_persistent_workers=True, dataloader_prefetch_factor=4")


def test_a_loader_measuring_again_when_the_script_ended_reports_the_choice_that_stands() -> None:
    # Settled and stored, then measuring its filled cache when the script ended: the settled
    # choice is the answer, not the check's provisional pick, and the report says what was measured.
    from autotune.run import LoaderRecord, _loader_section

    chosen = Candidate(batch_size=16, torch_threads=1)
    record = LoaderRecord(number=1, origin="fit.py:32", called_from=None, builder="__main__",
                          script_settings={}, batch_size=16, epoch_batches=64, served_batches=100,
                          settled=False, settled_before=True,
                          measuring_again=f"its filled cache against {chosen.label()}",
                          tuning=TuneResult(loader_kwargs=chosen.loader_kwargs(), torch_threads=1,
                                            trials=(_trial(0, chosen, 1000.0),), key="k"))
    assert record.status == "tuned"
    text = "\n".join(_loader_section(record))
    assert "best found: w=0 t=1\n" in text, text
    assert "measured again when the script ended: its filled cache against bs=16 w=0 t=1" in text, text
    assert "stored as profile k" in text and "provisional" not in text
    record.settled_before, record.measuring_again = False, None
    assert record.status == "exploring"


def _trial(number: int, c: Candidate, score: float) -> TrialRecord:
    m = Measurement(samples_per_s=score, busy=0.5, wait_fraction=0.5, step_ms=1.0, wait_ms=1.0,
                    startup_s=0.1, batches=10, samples=160, window_s=1.0, peak_memory_bytes=0)
    return TrialRecord(number, "online", c, "complete", m, score)


PLAIN = Candidate(batch_size=16, num_workers=3, prefetch_factor=4, persistent_workers=True)
THREADS = Candidate(batch_size=16, num_workers=2, prefetch_factor=2, worker_kind="thread")


@pytest.mark.parametrize(
    ("chosen", "trials", "expected"),
    [
        (PLAIN, (), {"dataloader_num_workers": 3, "dataloader_pin_memory": False,
                     "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 4}),
        (Candidate(batch_size=16), (), {"dataloader_num_workers": 0, "dataloader_pin_memory": False,
                                        "dataloader_persistent_workers": False,
                                        "dataloader_prefetch_factor": None}),
        # Threads cannot be expressed in a Trainer: the best measured worker-process setting instead.
        (THREADS, (PLAIN, replace(PLAIN, num_workers=1, prefetch_factor=2)),
         {"dataloader_num_workers": 3, "dataloader_pin_memory": False,
          "dataloader_persistent_workers": True, "dataloader_prefetch_factor": 4}),
    ],
    ids=["processes", "no-workers", "threads-won"],
)
def test_training_args_are_exactly_the_four_trainer_keys_and_transformers_accepts_them(
    tmp_path: Path, chosen: Candidate, trials: tuple[Candidate, ...], expected: dict[str, object]
) -> None:
    records = tuple(_trial(i, c, 1000.0 - 100 * i) for i, c in enumerate((chosen, *trials)))
    result = TuneResult(loader_kwargs=chosen.loader_kwargs(), trials=records)
    assert result.training_args() == expected
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    args = transformers.TrainingArguments(output_dir=str(tmp_path), use_cpu=True, **result.training_args())
    assert (args.dataloader_num_workers, args.dataloader_prefetch_factor) == (
        expected["dataloader_num_workers"], expected["dataloader_prefetch_factor"])
