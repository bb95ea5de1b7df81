"""The node cache: a ``ram`` cache that outlives its process and is shared by every process on the
node (NOTE [ Node caches ] in autotune/pretransform/node.py).

Real processes throughout: a second process reads what the first filled, a process killed with
SIGKILL in mid-fill, two unrelated fillers at once; torch's DataLoader over the dataset itself is the
oracle for every batch.
"""

from __future__ import annotations

import gc
import json
import os
import shutil
import signal
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torchvision.transforms as T
from node_fill import Ragged
from test_pretransform import same

from autotune import cli
from autotune import pretransform as pt
from autotune.pretransform import node, reuse, split
from autotune.pretransform.filling import FILLED
from autotune.workloads import CIFAR_MEAN, CIFAR_STD, CIFAR10Like, cifar_train_transform, write_image_folder

CPU = torch.device("cpu")
HELPER = str(Path(__file__).with_name("node_fill.py"))


@pytest.fixture(autouse=True)
def _default_place(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where node caches go by default (/dev/shm, named by the test's own profile folder; conftest
    removes them when the test ends)."""
    monkeypatch.delenv(node.NODE_DIR_ENV, raising=False)


@pytest.fixture(autouse=True)
def _fresh_builds() -> Iterator[None]:
    pt.clear_builds()
    yield
    pt.clear_builds()
    gc.collect()


def helper(*args: str, env: dict[str, str] | None = None, timeout: float = 240) -> dict[str, Any]:
    """Run tests/node_fill.py in a new process; its JSON line."""
    out = subprocess.run([sys.executable, HELPER, *args], capture_output=True, text=True, timeout=timeout,
                         env={**os.environ, **(env or {})}, check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout.strip().splitlines()[-1])


def _plain(n: int = 64, seed: int = 0, mean: Any = CIFAR_MEAN) -> CIFAR10Like:
    return CIFAR10Like(n, seed=seed, transform=T.Compose([T.ToTensor(), T.Normalize(mean, CIFAR_STD)]))


# ------------------------------------------------------------------------------ between processes


@pytest.mark.parametrize("dataset", ["cifar", "ragged"])
def test_a_second_process_reads_what_the_first_filled(dataset: str) -> None:
    first = helper("epoch", dataset)
    assert first["before"][0] == 0 and first["after"][0] == first["after"][1]  # filled by one epoch
    assert first["ours"] == first["torch"]  # the same batches as torch's loader, random rest included
    assert first["node"] is not None and os.path.exists(first["node"])
    assert first["node"].startswith(str(node.folders()[0]))  # in /dev/shm, where it fits
    second = helper("epoch", dataset)
    assert second["node"] == first["node"]
    assert second["before"] == first["after"]  # nothing to fill: the first process's samples
    assert second["ours"] == second["torch"] == first["torch"]


def test_the_drop_in_in_a_second_process_starts_from_the_filled_cache() -> None:
    first = helper("dropin", "plain")
    assert first["ours"] == first["torch"]
    assert [tuple(e) for e in first["after"]] == [(512, 512)]
    second = helper("dropin", "plain")
    assert second["before"] == first["after"]  # complete before its first batch
    assert second["after"] == first["after"]  # one cache: nothing made again
    assert second["ours"] == second["torch"] == first["torch"]


def test_a_fill_killed_with_sigkill_leaves_no_sample_that_was_not_written_whole() -> None:
    proc = subprocess.Popen([sys.executable, HELPER, "forever", "ragged"], stdout=subprocess.PIPE, text=True,
                            start_new_session=True)
    assert proc.stdout is not None
    with proc.stdout:
        try:
            assert proc.stdout.readline().strip() == "filling"
        finally:
            os.killpg(proc.pid, signal.SIGKILL)  # the process and its workers, mid-write
            proc.wait(timeout=30)
    ds = Ragged()
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    filler = prepared.dataset.filler
    assert filler.node is not None
    filled = [i for i in range(len(ds)) if filler.flag(i) == FILLED]
    assert 0 < len(filled) < len(ds)  # killed in mid-fill
    view = filler.view
    column = filler.fields[0]
    for i in filled:  # every sample flagged is exactly what the dataset's prefix gives
        assert torch.equal(column.get(i), view[i][0]) and filler.fields[1][i] == i
    # The rest is filled by a rerun, whose batches are torch's.
    rerun = helper("epoch", "ragged")
    assert rerun["before"][0] >= len(filled) and rerun["after"] == [len(ds), len(ds)]
    assert rerun["ours"] == rerun["torch"]


def test_two_unrelated_fillers_at_once_stay_correct() -> None:
    procs = [subprocess.Popen([sys.executable, HELPER, "epoch", "ragged", str(seed)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for seed in (1, 2)]
    outs = [p.communicate(timeout=240) for p in procs]
    assert all(p.returncode == 0 for p in procs), [o[1][-2000:] for o in outs]
    results = [json.loads(o[0].strip().splitlines()[-1]) for o in outs]
    assert all(r["ours"] == r["torch"] for r in results)
    assert results[0]["node"] == results[1]["node"]
    ds = Ragged()
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert prepared.fill_counts().complete
    for i in range(len(ds)):
        assert torch.equal(prepared.dataset.filler.fields[0].get(i), prepared.dataset.filler.view[i][0])


# ------------------------------------------------------------------------------------------- keys


def _key(ds: Any) -> str:
    plan, _ = reuse.plan_for(ds)
    assert plan.reason is None, plan.reason
    plan.fingerprint = split.fingerprint(ds, plan)
    return node.key_of(plan, ds)


def test_datasets_that_differ_never_share_a_key_and_equal_ones_do() -> None:
    key = _key(_plain())
    assert _key(_plain()) == key  # made again the same: the same key, in any process
    assert _key(_plain(n=65)) != key  # the length
    assert _key(_plain(seed=1)) != key  # the data
    assert _key(_plain(mean=(0.5, 0.5, 0.5))) != key  # a frozen step's parameter
    changed = _plain()
    changed.data[40, 0, 0, 0] ^= 1  # one byte no probe reads
    assert _key(changed) != key
    augmented = CIFAR10Like(64, transform=cifar_train_transform())
    assert _key(augmented) != key


class Scaled(torch.utils.data.Dataset[Any]):
    def __init__(self) -> None:
        self.x = torch.arange(32, dtype=torch.float32).reshape(8, 4)

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> Any:
        return self.x[i] * 2


class ScaledOtherCode(Scaled):
    def __getitem__(self, i: int) -> Any:
        return self.x[i] * 3


def test_the_datasets_code_is_in_the_key() -> None:
    one, other = Scaled(), ScaledOtherCode()
    type(other).__qualname__ = "Scaled"  # the same name: only the code differs
    assert _key(one) != _key(other)


# ---------------------------------------------------------------------------------- faults, budget


def test_a_folder_that_cannot_be_written_means_a_private_cache_with_one_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    monkeypatch.setenv(node.NODE_DIR_ENV, str(blocker / "caches"))
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        got = []
        for seed in (0, 1):
            ds = _plain(seed=seed)
            prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
            assert prepared.dataset.filler.node is None
            got.append((prepared, ds))
    ours = [w for w in seen if issubclass(w.category, node.NodeCacheWarning)]
    assert len(ours) == 1 and str(blocker) in str(ours[0].message)
    for prepared, ds in got:  # still the dataset's samples
        assert all(same(prepared.dataset[i][0], ds[i][0]) for i in range(0, 64, 5))


def test_a_full_folder_means_a_private_cache_with_one_warning(tmp_path: Path) -> None:
    # A file-size limit makes the reservation fail as a full disk would (and no SIGXFSZ kills it):
    # above the private cache's one field (64 images of 3x32x32 floats), below the node file that
    # holds it with its header and flags.
    limit = 64 * 3 * 32 * 32 * 4 + (32 << 10)
    code = (
        "import resource, signal, warnings, torch, sys\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "from autotune import pretransform as pt\n"
        "from autotune.workloads import CIFAR10Like\n"
        "import torchvision.transforms as T\n"
        "warnings.simplefilter('always')\n"
        "with warnings.catch_warnings(record=True) as seen:\n"
        "    warnings.simplefilter('always')\n"
        "    ds = CIFAR10Like(64, transform=T.ToTensor())\n"
        "    p = pt.prepare(ds, 'ram', device=torch.device('cpu'), fill='pass')\n"
        "    assert p.dataset.filler.node is None\n"
        "    assert all(torch.equal(p.dataset[i][0], ds[i][0]) for i in range(64))\n"
        "print(sum('cannot hold a cache' in str(w.message) for w in seen))\n"
    )
    env = {**os.environ, node.NODE_DIR_ENV: str(tmp_path / "caches")}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120,
                         check=False)
    assert out.returncode == 0, out.stderr[-3000:]
    assert out.stdout.strip().splitlines()[-1] == "1"
    assert not list((tmp_path / "caches").glob("*.cache"))


def _specs(mib: int) -> list[node.Spec]:
    return [("flags", 8, torch.uint8), ("field0", mib << 20, torch.uint8)]


def test_the_least_recently_used_caches_make_room(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node.NODE_DIR_ENV, str(tmp_path / "caches"))
    monkeypatch.setattr(node, "budget_bytes", lambda folder: 25 << 20)  # room for two caches of 10 MiB

    def make(name: str, age_s: float = 0.0) -> node.NodeFile | None:
        got = node.place(name, _specs(10), lineage=None, detail=name)
        if got is not None and age_s:
            os.utime(got.path, (time.time() - age_s, time.time() - age_s))
        return got

    assert make("a", age_s=100) is not None  # dropped at once: no process maps it
    b = make("b", age_s=50)  # kept mapped: in use, so never evicted
    assert b is not None
    gc.collect()
    assert {e.key: e.in_use for e in node.entries()} == {"a": False, "b": True}
    assert make("c") is not None  # a, the least recently used, made room
    gc.collect()
    assert {e.key for e in node.entries()} == {"b", "c"}
    assert make("d") is not None  # c made room: b is older but in use
    gc.collect()
    assert {e.key for e in node.entries()} == {"b", "d"}
    assert node.place("e", _specs(30), lineage=None, detail="e") is None  # over the budget alone
    del b


def test_a_changed_dataset_gets_a_new_cache_and_the_stale_one_is_removed(tmp_path: Path) -> None:
    root = tmp_path / "images"
    write_image_folder(root, n=24, classes=2, size=16, fmt="PNG")
    transform = T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)])
    from torchvision.datasets import ImageFolder

    ds = ImageFolder(str(root), transform=transform)
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    old = prepared.dataset.filler.node.path
    list(torch.utils.data.DataLoader(prepared.dataset, batch_size=8, collate_fn=prepared.collate_fn))
    assert prepared.fill_counts().complete
    del prepared, ds
    pt.clear_builds()
    gc.collect()
    path = sorted(root.rglob("*.png"))[3]
    stat = path.stat()
    os.utime(path, (stat.st_atime, stat.st_mtime + 10))  # a file rewritten
    ds = ImageFolder(str(root), transform=transform)
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    assert prepared.dataset.filler.node.path != old and prepared.fill_counts().filled == 0
    assert not os.path.exists(old)  # the stale cache is removed, never read


def test_the_caches_of_a_profile_directory_that_is_gone_leave_memory(tmp_path: Path) -> None:
    # Two runs, each from a profile directory of its own; one directory is deleted as the run ends
    # (a temporary one). Its cache would stay in /dev/shm until the machine restarts: the next cache
    # made on the node removes it, and keeps the cache whose directory is still there.
    made = {}
    for name in ("gone", "kept"):
        (tmp_path / name).mkdir()
        made[name] = Path(helper("epoch", "plain", env={"AUTOTUNE_CACHE_DIR": str(tmp_path / name)})["node"])
    try:
        for name, path in made.items():
            assert path.exists() and path.parent.name.startswith(node._shm_prefix())
            assert (path.parent / node.OWNER).read_text().strip() == str(tmp_path / name)
        (tmp_path / "gone").rmdir()
        prepared = pt.prepare(_plain(), "ram", device=CPU, fill="pass")  # a new cache, in this process
        assert prepared.dataset.filler.node is not None
        assert not made["gone"].parent.exists()  # its folder went with its cache
        assert made["kept"].exists()
    finally:
        for path in made.values():
            shutil.rmtree(path.parent, ignore_errors=True)


def test_the_cache_command_lists_and_clears(capsys: pytest.CaptureFixture[str]) -> None:
    ds = _plain()
    prepared = pt.prepare(ds, "ram", device=CPU, fill="pass")
    list(torch.utils.data.DataLoader(prepared.dataset, batch_size=16, collate_fn=prepared.collate_fn))
    assert cli.main(["cache", "list"]) == 0
    out = capsys.readouterr().out
    assert "64/64" in out and "1 cache," in out and "yes" in out  # this process maps it
    assert cli.main(["cache", "list", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["filled"] == 64
    assert cli.main(["cache", "clear"]) == 0
    assert "Removed 1 node cache" in capsys.readouterr().out
    assert node.entries() == []
    assert cli.main(["cache", "list"]) == 0 and "No node caches" in capsys.readouterr().out
    assert cli.main(["cache"]) == 2


def test_off_keeps_every_cache_private(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(node.NODE_CACHE_ENV, "off")
    prepared = pt.prepare(_plain(), "ram", device=CPU, fill="pass")
    assert prepared.dataset.filler.node is None and node.entries() == []
