"""The profile store: embedded JSON files and the SQLite flavour of the database store.

PostgreSQL has its own file, ``test_profiles_postgres.py``.
"""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from PIL import Image
from together import PRELUDE, run_together
from torch.utils.data import Dataset, IterableDataset

from autotune import profiles
from autotune.exceptions import ConfigurationError, ProfileStoreError, ProfileStoreWarning
from autotune.fingerprint import profile_key, workload_fingerprint
from autotune.profiles import (
    SCHEMA_VERSION,
    TMP_PREFIX,
    DatabaseProfileStore,
    EmbeddedProfileStore,
    ProfileStore,
    open_store,
    resolve_cache_dir,
)

MACHINE_FP = {"cpu_model": "Test CPU", "usable_cpus": 2, "accelerator": "none", "torch": "2.x"}

SUBPROCESS_TIMEOUT_S = 120


def _record(n: int = 0, payload: int = 0) -> dict[str, Any]:
    """A record shaped like the one tuning produces."""
    return {
        "machine": MACHINE_FP,
        "workload": {"dataset": "tests.Toy", "len": 100, "step": {"name": "m.step"}, "device": "cpu"},
        "loader_kwargs": {"batch_size": 32, "num_workers": n % 4, "pin_memory": False},
        "samples_per_s": 1000.0 + n,
        "trials": [{"n": n, "pad": "x" * payload}],
    }


def _temp_files(folder: Path) -> list[str]:
    if not folder.exists():
        return []
    return [name for name in os.listdir(folder) if name.startswith(TMP_PREFIX)]


def _run_python(code: str, *args: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", code, *args],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
        env=env,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(params=["embedded", "sqlite"])
def store(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[ProfileStore]:
    if request.param == "embedded":
        opened = open_store()
    else:
        opened = open_store(storage=f"sqlite:///{(tmp_path / 'profiles.db').as_posix()}")
    yield opened
    opened.close()


def _embedded(tmp_path: Path) -> EmbeddedProfileStore:
    return EmbeddedProfileStore(tmp_path / "cache")


# --------------------------------------------------------------------------------------------------
# Cache directory


def test_cache_dir_argument_then_env_then_platform(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "from-env"))
    assert resolve_cache_dir(tmp_path / "arg") == tmp_path / "arg"
    assert resolve_cache_dir() == tmp_path / "from-env"
    # Resolved per call: a change of the environment is seen by the next call.
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(tmp_path / "changed"))
    assert resolve_cache_dir() == tmp_path / "changed"
    assert open_store().location == str(tmp_path / "changed" / "profiles")
    monkeypatch.delenv("AUTOTUNE_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    if sys.platform.startswith("linux"):
        assert resolve_cache_dir() == tmp_path / "xdg" / "autotune"


@pytest.mark.parametrize(
    ("platform", "environ", "expected"),
    [
        ("linux", {"HOME": "/home/u"}, "/home/u/.cache/autotune"),
        ("linux", {"HOME": "/home/u", "XDG_CACHE_HOME": "/xdg"}, "/xdg/autotune"),
        # The XDG spec says a relative XDG_CACHE_HOME is invalid and must be ignored.
        ("linux", {"HOME": "/home/u", "XDG_CACHE_HOME": "rel"}, "/home/u/.cache/autotune"),
        ("darwin", {"HOME": "/Users/u"}, "/Users/u/Library/Caches/autotune"),
        ("win32", {"LOCALAPPDATA": "C:/Users/u/AppData/Local"}, "C:/Users/u/AppData/Local/autotune/Cache"),
    ],
)
def test_platform_cache_dir(platform: str, environ: dict[str, str], expected: str) -> None:
    assert profiles._platform_cache_dir(platform, environ) == Path(expected)


# --------------------------------------------------------------------------------------------------
# Both stores: the interface


def test_put_get_list_delete_clear(store: ProfileStore) -> None:
    assert store.get("a1") is None
    assert store.put("a1", _record(1)) is True
    assert store.put("b2", _record(2)) is True
    got = store.get("a1")
    assert got is not None
    assert got["schema"] == SCHEMA_VERSION and got["key"] == "a1" and got["created"]
    assert {k: got[k] for k in _record(1)} == _record(1)

    summaries = {s["key"]: s for s in store.list()}
    assert set(summaries) == {"a1", "b2"}
    summary = summaries["b2"]
    assert summary["machine"] == MACHINE_FP
    assert summary["workload"] == {"dataset": "tests.Toy", "len": 100, "step": "m.step", "device": "cpu"}
    assert summary["loader_kwargs"] == _record(2)["loader_kwargs"]
    assert summary["samples_per_s"] == 1002.0

    assert store.delete("a1") is True
    assert store.delete("a1") is False
    assert store.get("a1") is None
    assert store.clear() == 1
    assert store.list() == []


def test_put_replaces_and_keeps_given_created(store: ProfileStore) -> None:
    store.put("k", _record(1))
    store.put("k", {**_record(2), "created": "2024-01-01T00:00:00+00:00"})
    got = store.get("k")
    assert got is not None
    assert got["samples_per_s"] == 1002.0 and got["created"] == "2024-01-01T00:00:00+00:00"
    assert [s["key"] for s in store.list()] == ["k"]


@pytest.mark.parametrize("key", ["../escape", "a/b", "", "x" * 200, "a.json"])
def test_key_that_is_not_a_key_is_refused(store: ProfileStore, key: str) -> None:
    # Keys become file names: a path in one must never reach the file system.
    with pytest.raises(ConfigurationError, match="is not valid"):
        store.get(key)
    with pytest.raises(ConfigurationError, match="is not valid"):
        store.put(key, _record())


def test_record_that_is_not_json_is_an_error(store: ProfileStore) -> None:
    with pytest.raises(ProfileStoreError, match="only JSON values"):
        store.put("k", {"loader_kwargs": {"collate_fn": object()}})
    assert store.get("k") is None


# --------------------------------------------------------------------------------------------------
# Embedded store: files


def test_embedded_layout_and_no_temp_files(tmp_path: Path) -> None:
    store = _embedded(tmp_path)
    assert store.put("abc", _record()) is True
    path = tmp_path / "cache" / "profiles" / "abc.json"
    assert json.loads(path.read_text())["key"] == "abc"
    assert _temp_files(path.parent) == []
    assert store.study_storage_url() == f"sqlite:///{(tmp_path / 'cache' / 'studies.db').as_posix()}"


def test_opening_and_reading_touch_nothing(tmp_path: Path) -> None:
    store = _embedded(tmp_path)
    assert store.get("abc") is None
    assert store.list() == []
    assert not (tmp_path / "cache").exists()


@pytest.mark.parametrize(
    "content",
    [
        b'{"schema": 1, "key": "k", "loader_kwa',  # truncated by a crash mid-write (old versions)
        b"",
        b"\xff\xfe not utf-8",
        b"[1, 2]",
    ],
    ids=["truncated", "empty", "binary", "not-an-object"],
)
def test_corrupt_file_is_a_miss_with_one_warning(tmp_path: Path, content: bytes) -> None:
    store = _embedded(tmp_path)
    store.profiles_dir.mkdir(parents=True)
    store.path("k").write_bytes(content)
    with pytest.warns(ProfileStoreWarning, match="k.json"):
        assert store.get("k") is None
    # Once per file per process: reading it again is silent.
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.get("k") is None
        assert store.list() == []
    # The next tuning run replaces it.
    assert store.put("k", _record()) is True
    assert store.get("k") is not None


@pytest.mark.parametrize("schema", [0, SCHEMA_VERSION + 1, None, "1"])
def test_other_schema_is_a_miss_with_a_warning(tmp_path: Path, schema: Any) -> None:
    store = _embedded(tmp_path)
    store.profiles_dir.mkdir(parents=True)
    store.path("k").write_text(json.dumps({**_record(), "schema": schema, "key": "k"}))
    with pytest.warns(ProfileStoreWarning, match=f"schema {schema!r}.*reads schema {SCHEMA_VERSION}"):
        assert store.get("k") is None


def test_warning_points_at_the_caller(tmp_path: Path) -> None:
    store = _embedded(tmp_path)
    store.profiles_dir.mkdir(parents=True)
    store.path("k").write_text("{")
    with pytest.warns(ProfileStoreWarning) as caught:
        store.get("k")
    assert caught[0].filename == __file__


def _fail_with_enospc(*args: Any, **kwargs: Any) -> Any:
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.mark.parametrize("failing", ["write", "fsync", "replace"])
def test_full_disk_warns_and_leaves_nothing_partial(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failing: str
) -> None:
    store = _embedded(tmp_path)
    assert store.put("k", _record(1)) is True
    before = store.path("k").read_bytes()
    if failing == "write":
        real_write = os.write
        calls = []

        def write_some_then_fail(fd: int, data: Any) -> int:
            # The disk fills up part-way: the first chunk lands, the next one fails.
            calls.append(fd)
            if len(calls) == 1:
                return real_write(fd, bytes(data[:100]))
            return _fail_with_enospc()

        monkeypatch.setattr(os, "write", write_some_then_fail)
    else:
        monkeypatch.setattr(os, failing, _fail_with_enospc)

    with pytest.warns(ProfileStoreWarning, match="free some disk space"):
        assert store.put("k", _record(2, payload=10_000)) is False
    monkeypatch.undo()
    assert store.path("k").read_bytes() == before
    assert _temp_files(store.profiles_dir) == []


def test_unwritable_store_simulated_read_only_filesystem(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store = _embedded(tmp_path)
    assert store.put("k", _record(1)) is True
    real_open = os.open

    def read_only_open(path: Any, flags: int, *args: Any, **kwargs: Any) -> int:
        # Fake of a read-only mount (tests may run as root, which file modes do not stop).
        if flags & os.O_CREAT:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))
        return real_open(path, flags, *args, **kwargs)

    monkeypatch.setattr(os, "open", read_only_open)
    with pytest.warns(ProfileStoreWarning, match="make the folder writable"):
        assert store.put("k", _record(2)) is False
    got = store.get("k")
    assert got is not None and got["samples_per_s"] == 1001.0
    monkeypatch.undo()
    assert _temp_files(store.profiles_dir) == []


@pytest.mark.skipif(
    not hasattr(os, "geteuid") or os.geteuid() == 0,
    reason="root writes through file modes; the simulated read-only test covers this case",
)
def test_read_only_cache_dir(tmp_path: Path) -> None:
    store = _embedded(tmp_path)
    assert store.put("k", _record(1)) is True
    store.profiles_dir.chmod(0o555)
    try:
        got = store.get("k")
        assert got is not None
        with pytest.warns(ProfileStoreWarning, match="make the folder writable"):
            assert store.put("k", _record(2)) is False
        with pytest.warns(ProfileStoreWarning, match="make the folder writable"):
            assert store.put("other", _record(2)) is False
    finally:
        store.profiles_dir.chmod(0o755)
    assert store.get("k") == got
    assert _temp_files(store.profiles_dir) == []


def test_cache_path_blocked_by_a_file(tmp_path: Path) -> None:
    # A real OSError that even root gets: the cache folder's place is taken by a file.
    (tmp_path / "cache").write_text("not a folder")
    store = _embedded(tmp_path)
    with pytest.warns(ProfileStoreWarning, match="could not read the profile"):
        assert store.get("k") is None
    with pytest.warns(ProfileStoreWarning, match="could not save the profile"):
        assert store.put("k", _record()) is False


def test_clear_removes_stale_temp_files_only(tmp_path: Path) -> None:
    store = _embedded(tmp_path)
    store.put("k", _record())
    stale = store.profiles_dir / f"{TMP_PREFIX}1-dead.json"
    fresh = store.profiles_dir / f"{TMP_PREFIX}2-live.json"
    stale.write_text("{")
    fresh.write_text("{")
    old = stale.stat().st_mtime - 2 * profiles.STALE_TMP_S
    os.utime(stale, (old, old))
    assert [s["key"] for s in store.list()] == ["k"]  # temp files are never listed as profiles
    assert store.clear() == 1
    # A recent one may belong to a writer that is still running.
    assert _temp_files(store.profiles_dir) == [fresh.name]


# Child processes import autotune.profiles without running the package's __init__ (which imports
# torch and the tuner): these tests are about the store, and the import would dominate their time.
IMPORT_PROFILES_ONLY = f"""
import sys, types
_pkg = types.ModuleType("autotune")
_pkg.__path__ = [{str(Path(profiles.__file__).parent)!r}]
sys.modules["autotune"] = _pkg
"""

CACHE_HIT_CODE = """
import sys
import autotune
from autotune.workloads import CIFAR10Like, cifar_train_transform
result = autotune.tune_loader(CIFAR10Like(256, transform=cifar_train_transform()), batch_size=16,
                              budget_s=3, progress=False, pretransform="none", max_workers=1)
print(result.from_cache, "sqlalchemy" in {m.split(".")[0] for m in sys.modules})
"""


def test_a_cache_hit_is_a_file_read_with_no_database(tmp_path: Path) -> None:
    # The first run measures and stores the profile; the second, the way a user calls it, reads it:
    # no study, no database library loaded (the study's database is opened only to measure).
    assert _run_python(CACHE_HIT_CODE).split() == ["False", "True"]
    assert _run_python(CACHE_HIT_CODE).split() == ["True", "False"]


WRITER_CODE = (
    IMPORT_PROFILES_ONLY
    + PRELUDE
    + """
import sys, warnings
warnings.simplefilter("error")  # a corrupt read would warn: make it fail this writer
from autotune.profiles import open_store
writer = int(sys.argv[2])
storage, writes, payload = sys.argv[3], int(sys.argv[4]), int(sys.argv[5])
wait_for_start()
store = open_store(storage=storage or None)
for n in range(writes):
    record = {"writer": writer, "n": n, "samples_per_s": float(n), "pad": "x" * payload}
    assert store.put("shared", record), "put failed"
    assert store.put(f"own-{writer}", record), "put failed"
    got = store.get("shared")
    assert got is not None and got["pad"] == "x" * payload, got
store.close()
"""
)


@pytest.mark.parametrize("kind", ["embedded", "sqlite"])
def test_concurrent_writers_never_corrupt(tmp_path: Path, kind: str) -> None:
    writers, writes, payload = 4, 20, 50_000
    storage = "" if kind == "embedded" else f"sqlite:///{(tmp_path / 'p.db').as_posix()}"
    run_together(tmp_path, WRITER_CODE, [[storage, str(writes), str(payload)]] * writers)

    store = open_store(storage=storage or None)
    written = {(w, n) for w in range(writers) for n in range(writes)}
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        keys = {s["key"] for s in store.list()}
        assert keys == {"shared"} | {f"own-{w}" for w in range(writers)}
        for key in keys:
            got = store.get(key)
            assert got is not None
            assert (got["writer"], got["n"]) in written and got["pad"] == "x" * payload
            if key != "shared":
                # Each writer's own key ends with its last write.
                assert got["writer"] == int(key.split("-")[1]) and got["n"] == writes - 1
    store.close()
    if kind == "embedded":
        assert isinstance(store, EmbeddedProfileStore)
        for path in store.profiles_dir.iterdir():
            json.loads(path.read_text())  # every file parses
        assert _temp_files(store.profiles_dir) == []


# --------------------------------------------------------------------------------------------------
# Database store, SQLite flavour


def _sqlite_url(tmp_path: Path) -> str:
    return f"sqlite:///{(tmp_path / 'profiles.db').as_posix()}"


def test_database_store_shares_optuna_database(tmp_path: Path) -> None:
    import optuna
    import sqlalchemy as sa

    url = _sqlite_url(tmp_path)
    store = open_store(storage=url)
    assert isinstance(store, DatabaseProfileStore)
    assert store.study_storage_url() == url
    store.put("k", _record())
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=store.study_storage_url(), study_name="s")
    study.optimize(lambda t: t.suggest_float("x", 0, 1), n_trials=2)
    store.close()

    engine = sa.create_engine(url)
    try:
        tables = set(sa.inspect(engine).get_table_names())
        columns = {c["name"] for c in sa.inspect(engine).get_columns("autotune_profiles")}
    finally:
        engine.dispose()
    assert {"autotune_profiles", "studies", "trials"} <= tables
    assert columns == {"key", "schema", "created", "updated", "record"}
    reopened = open_store(storage=url)
    assert reopened.get("k") is not None
    assert len(optuna.load_study(study_name="s", storage=url).trials) == 2
    reopened.close()


def test_embedded_study_storage_url_works_with_optuna() -> None:
    import optuna

    url = open_store().study_storage_url()
    assert url == f"sqlite:///{(resolve_cache_dir() / 'studies.db').as_posix()}"
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    study = optuna.create_study(storage=url, study_name="s")
    assert study.study_name == "s"


@pytest.mark.parametrize(
    ("record_text", "schema", "match"),
    [
        ('{"schema": 1, "key": "k", "loader', 1, "corrupt"),
        (json.dumps({"schema": SCHEMA_VERSION + 1, "key": "k"}), SCHEMA_VERSION + 1, "schema"),
        (json.dumps({"schema": SCHEMA_VERSION, "key": "k"}), 0, "row has schema 0"),
    ],
)
def test_database_bad_row_is_a_miss_with_one_warning(
    tmp_path: Path, record_text: str, schema: int, match: str
) -> None:
    import sqlalchemy as sa

    url = _sqlite_url(tmp_path)
    store = open_store(storage=url)
    store.put("k", _record())
    engine = sa.create_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(
                sa.text("UPDATE autotune_profiles SET record = :r, schema = :s WHERE key = 'k'"),
                {"r": record_text, "s": schema},
            )
    finally:
        engine.dispose()
    with pytest.warns(ProfileStoreWarning, match=match):
        assert store.get("k") is None
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert store.get("k") is None
    store.close()


def test_database_unreachable_names_url_and_fix(tmp_path: Path) -> None:
    url = f"sqlite:///{(tmp_path / 'missing-folder' / 'p.db').as_posix()}"
    with pytest.raises(ProfileStoreError, match="could not connect.*missing-folder.*folder exists") as info:
        open_store(storage=url)
    assert info.value.__cause__ is not None


def test_database_missing_driver_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fake of an environment without PostgreSQL drivers: a None entry makes the import fail.
    for module in ("psycopg2", "psycopg"):
        monkeypatch.setitem(sys.modules, module, None)
    with pytest.raises(ProfileStoreError, match=r"pip install 'dataloader-autotune\[postgres\]'") as info:
        open_store(storage="postgresql://user:hunter2@db.example/profiles")
    assert "hunter2" not in str(info.value) and "***" in str(info.value)


def test_database_refused_connection_masks_password() -> None:
    if not (profiles._importable("psycopg2") or profiles._importable("psycopg")):
        pytest.skip("no PostgreSQL driver installed (pip install 'dataloader-autotune[postgres]')")
    # Port 1 on the loopback interface: nothing listens, the connection is refused at once.
    with pytest.raises(ProfileStoreError, match=r"postgresql://user:\*\*\*@127\.0\.0\.1:1/db") as info:
        open_store(storage="postgresql://user:hunter2@127.0.0.1:1/db")
    assert "hunter2" not in str(info.value)
    assert "running and reachable" in str(info.value)


SECRET_URL = "postgresql://me:hunter2@db.example/autotune?sslmode=require"


@pytest.mark.parametrize(
    ("url", "masked"),
    [
        (SECRET_URL, "postgresql://me:***@db.example/autotune?sslmode=require"),
        ("postgresql://db.example/x?user=me&password=hunter2&x=1",
         "postgresql://db.example/x?user=me&password=***&x=1"),
        ("postgresql+psycopg://me:hunter2@db.example:5432/x", "postgresql+psycopg://me:***@db.example:5432/x"),
        ("sqlite:////tmp/studies.db", "sqlite:////tmp/studies.db"),
    ],
)
def test_mask_url_hides_the_password_wherever_a_url_carries_it(url: str, masked: str) -> None:
    assert profiles.mask_url(url) == masked
    assert profiles.mask_url(f"could not reach {url}: refused") == f"could not reach {masked}: refused"


def test_a_password_in_a_record_is_neither_written_nor_read_back(store: ProfileStore, tmp_path: Path) -> None:
    # Tuning puts the study's storage URL into the record: the store keeps no password of it.
    record = {**_record(), "storage_url": SECRET_URL, "trials": [{"reason": f"lost {SECRET_URL}"}]}
    assert store.put("k", record)
    got = store.get("k")
    assert got is not None and "hunter2" not in json.dumps(got)
    assert got["storage_url"] == "postgresql://me:***@db.example/autotune?sslmode=require"
    for path in tmp_path.rglob("*"):  # the profile file or the SQLite database itself
        if path.is_file():
            assert b"hunter2" not in path.read_bytes(), path


def test_a_profile_stored_with_a_password_is_read_without_it(tmp_path: Path) -> None:
    # A profile written before passwords were masked still holds one on disk.
    store = _embedded(tmp_path)
    store.profiles_dir.mkdir(parents=True)
    old = {**_record(), "schema": SCHEMA_VERSION, "key": "k", "storage_url": SECRET_URL}
    store.path("k").write_text(json.dumps(old))
    got = store.get("k")
    assert got is not None and "hunter2" not in json.dumps(got)
    assert "hunter2" not in json.dumps(store.list())


def test_database_store_shows_no_password(monkeypatch: pytest.MonkeyPatch) -> None:
    # Fake of an environment without PostgreSQL drivers, so that no server is needed: the store
    # fails to open, and its message is what a user sees. The real server: test_profiles_postgres.py.
    for module in ("psycopg2", "psycopg"):
        monkeypatch.setitem(sys.modules, module, None)
    for url in (SECRET_URL, "postgresql://db.example/x?user=me&password=hunter2"):
        with pytest.raises(ProfileStoreError) as info:
            open_store(storage=url)
        assert "hunter2" not in str(info.value) and "***" in str(info.value)


@pytest.mark.parametrize(
    "url", ["not a url", "nosuchdialect://x/y", "postgresql//me:hunter2@db/x", "postgresql://me:hunter2@db:x/y"]
)
def test_bad_storage_url_is_a_configuration_error(url: str) -> None:
    with pytest.raises(ConfigurationError, match="database") as info:
        open_store(storage=url)
    assert "hunter2" not in str(info.value)


# --------------------------------------------------------------------------------------------------
# Workload fingerprint


class Toy(Dataset[Any]):
    """A small map-style dataset that counts how many samples were read."""

    def __init__(self, n: int = 8, transform: Any = None) -> None:
        self.n = n
        self.transform = transform
        self.reads = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        self.reads += 1
        x = torch.zeros(3, 4, 4)
        return (self.transform(x) if self.transform else x), i % 2


class AddOne:
    """A transform whose repr carries a memory address."""

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x + 1


class Scale:
    def __init__(self, factor: float) -> None:
        self.factor = factor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.factor

    def __repr__(self) -> str:
        return f"Scale(factor={self.factor})"


def step_a(batch: Any) -> None:
    batch[0].sum()


def step_b(batch: Any) -> None:
    batch[0].mean()


class Model(torch.nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2

    def train_step(self, batch: Any) -> None:
        self(batch[0])


def _key(dataset: Any, **kwargs: Any) -> str:
    return profile_key(MACHINE_FP, workload_fingerprint(dataset, **kwargs))


def test_fingerprint_same_workload_same_key() -> None:
    # Two separately built but identical workloads: the transform's repr differs only by address.
    a = workload_fingerprint(Toy(transform=AddOne()), step=step_a, fixed={"batch_size": 64})
    b = workload_fingerprint(Toy(transform=AddOne()), step=step_a, fixed={"batch_size": 64})
    assert a == b
    assert "0x" not in json.dumps(a)
    assert a["dataset"].endswith("test_profiles.Toy") and a["len"] == 8
    assert a["sample"]["items"][0] == {
        "type": "tensor",
        "shape": [3, 4, 4],
        "dtype": "torch.float32",
        "device": "cpu",
    }
    assert a["step"]["name"].endswith("test_profiles.step_a")
    assert len(profile_key(MACHINE_FP, a)) == 16


@pytest.mark.parametrize(
    "change",
    [
        {"dataset": Toy(n=9)},
        {"dataset": Toy(transform=Scale(2.0))},
        {"dataset": Toy(transform=Scale(3.0))},
        {"step": step_b},
        {"step": None},
        {"device": "cuda:0"},
        {"fixed": {"batch_size": 128}},
        {"fixed": {}},
    ],
    ids=["len", "transform", "transform-param", "step", "no-step", "device", "fixed", "not-fixed"],
)
def test_fingerprint_change_gives_new_key(change: dict[str, Any]) -> None:
    base: dict[str, Any] = {
        "dataset": Toy(transform=Scale(1.0)),
        "step": step_a,
        "device": "cpu",
        "fixed": {"batch_size": 64},
    }
    changed = {**base, **change}
    assert _key(base.pop("dataset"), **base) != _key(changed.pop("dataset"), **changed)


def test_fingerprint_edited_step_body_gives_new_key() -> None:
    # Same module and qualified name, different code: the key must change.
    first: dict[str, Any] = {}
    second: dict[str, Any] = {}
    exec("def step(batch):\n    return batch[0].sum()\n", first)
    exec("def step(batch):\n    return batch[0].sum() * 2\n", second)
    assert first["step"].__qualname__ == second["step"].__qualname__
    assert _key(Toy(), step=first["step"]) != _key(Toy(), step=second["step"])


def test_fingerprint_bound_method_and_module_use_the_class() -> None:
    one, two = Model(), Model()
    assert workload_fingerprint(Toy(), step=one.train_step) == workload_fingerprint(
        Toy(), step=two.train_step
    )
    step = workload_fingerprint(Toy(), step=one.train_step)["step"]
    assert step["name"].endswith("test_profiles.Model.train_step") and step["code"]
    module_step = workload_fingerprint(Toy(), step=one)["step"]
    assert module_step["name"].endswith("test_profiles.Model") and module_step["code"]
    assert workload_fingerprint(Toy(), step=one) == workload_fingerprint(Toy(), step=two)


def test_fingerprint_describes_sample_structure() -> None:
    sample = (
        Image.new("RGB", (32, 24)),
        {"label": 3, "weight": 0.5, "name": "cat", "extra": (torch.zeros(2, dtype=torch.int64), None)},
    )
    fp = workload_fingerprint(_Fixed(sample))
    assert fp["sample"] == {
        "type": "tuple",
        "len": 2,
        "items": [
            {"type": "PIL.Image", "size": [32, 24], "mode": "RGB"},
            {
                "type": "dict",
                "len": 4,
                "items": {
                    "extra": {
                        "type": "tuple",
                        "len": 2,
                        "items": [
                            {"type": "tensor", "shape": [2], "dtype": "torch.int64", "device": "cpu"},
                            {"type": "None"},
                        ],
                    },
                    "label": {"type": "int"},
                    "name": {"type": "str"},
                    "weight": {"type": "float"},
                },
            },
        ],
    }
    assert fp["transform"] is None and fp["step"] is None and fp["fixed"] == {}


class _Fixed(Dataset[Any]):
    def __init__(self, sample: Any) -> None:
        self.sample = sample

    def __len__(self) -> int:
        return 3

    def __getitem__(self, i: int) -> Any:
        return self.sample


class _Stream(IterableDataset[Any]):
    def __iter__(self) -> Iterator[Any]:
        yield from (torch.ones(4) for _ in range(1000))


def test_fingerprint_is_cheap_and_handles_iterable_datasets() -> None:
    toy = Toy(n=1000)
    workload_fingerprint(toy)
    assert toy.reads <= 2  # one or two samples, never the dataset
    fp = workload_fingerprint(_Stream())
    assert fp["len"] is None and fp["sample"]["shape"] == [4]
    assert workload_fingerprint(Toy(n=0))["sample"] == {"type": "None"}


def test_fingerprint_holds_the_fixed_arguments_as_plain_json() -> None:
    fixed = {"sizes": {64, 16, 32}, "collate": step_a, "limit": float("inf"), "where": AddOne(),
             2: ("a", None)}
    fp = workload_fingerprint(Toy(), fixed=fixed)
    assert fp["fixed"] == {
        "2": ["a", None],
        "collate": f"{__name__}.step_a",
        "limit": None,  # JSON has no inf
        "sizes": [16, 32, 64],
        "where": f"<{__name__}.AddOne object>",  # the repr, its address stripped
    }
    json.dumps(fp, allow_nan=False)  # strict JSON: any reader of a stored profile can parse it


def test_fingerprint_sees_the_transform_through_a_subset() -> None:
    a = torch.utils.data.Subset(Toy(transform=Scale(2.0)), [0, 1])
    b = torch.utils.data.Subset(Toy(transform=Scale(3.0)), [0, 1])
    assert workload_fingerprint(a)["transform"] == "Scale(factor=2.0)"
    assert _key(a) != _key(b)


def test_fingerprint_sees_the_transforms_of_the_datasets_joined() -> None:
    two, three = Toy(transform=Scale(2.0)), Toy(transform=Scale(3.0))
    joined = torch.utils.data.ConcatDataset([two, three, two])
    assert workload_fingerprint(joined)["transform"] == "Scale(factor=2.0) + Scale(factor=3.0)"
    assert _key(joined) != _key(torch.utils.data.ConcatDataset([two, two, two]))


WORKLOAD_MODULE = """
import torch
from torch.utils.data import Dataset
from torchvision import transforms


class Images(Dataset):
    def __init__(self):
        self.transform = transforms.Compose([transforms.Normalize((0.5,), (0.25,)), lambda x: x])

    def __len__(self):
        return 10

    def __getitem__(self, i):
        return self.transform(torch.zeros(1, 8, 8)), {"label": i, "kind": "a"}


def step(batch):
    # A set literal compiles to a frozenset constant, whose repr depends on string hashing.
    return batch[1]["kind"] in {"a", "b", "c", "d"}


def fingerprint():
    from autotune.fingerprint import profile_key, workload_fingerprint
    fp = workload_fingerprint(Images(), step=step, device="cpu", fixed={"batch_size": 32})
    return fp, profile_key({"m": 1}, fp)
"""


def test_fingerprint_is_stable_across_processes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "workload_mod.py").write_text(textwrap.dedent(WORKLOAD_MODULE))
    monkeypatch.syspath_prepend(str(tmp_path))
    import workload_mod

    here = workload_mod.fingerprint()
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "PYTHONHASHSEED": "12345"}
    code = "import json, workload_mod; print(json.dumps(workload_mod.fingerprint()))"
    there = json.loads(_run_python(code, env=env))
    assert [here[0], here[1]] == there
    assert "<lambda>" in here[0]["transform"] and "0x" not in here[0]["transform"]
