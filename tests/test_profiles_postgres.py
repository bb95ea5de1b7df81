"""The database profile store on a real PostgreSQL server.

Runs when ``AUTOTUNE_TEST_POSTGRES_URL`` names one (``postgresql://user:password@host/db``) and skips
otherwise. When the variable is set, an unreachable server fails these tests: it is never a skip.
Each test uses keys of its own and deletes them, so a shared database keeps its other profiles.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import uuid
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
from together import PRELUDE, run_together

from autotune.fingerprint import profile_key
from autotune.profiles import DatabaseProfileStore, mask_url, open_store

pytestmark = pytest.mark.postgres

URL_ENV = "AUTOTUNE_TEST_POSTGRES_URL"
SUBPROCESS_TIMEOUT_S = 120
MACHINE_FP = {"cpu_model": "Test CPU", "usable_cpus": 2, "accelerator": "none"}


@pytest.fixture
def pg_url() -> str:
    url = os.environ.get(URL_ENV)
    if not url:
        pytest.skip(f"{URL_ENV} is not set; set it to a PostgreSQL URL to run these tests")
    return url


@pytest.fixture
def store(pg_url: str) -> Iterator[DatabaseProfileStore]:
    opened = open_store(storage=pg_url)  # an unreachable server raises here: the test fails
    assert isinstance(opened, DatabaseProfileStore)
    yield opened
    opened.close()


@pytest.fixture
def keys(store: DatabaseProfileStore) -> Iterator[list[str]]:
    """Fresh keys for one test, deleted afterwards."""
    made = [f"test-{uuid.uuid4().hex[:12]}-{i}" for i in range(4)]
    yield made
    for key in made:
        store.delete(key)


def _record(n: int, **extra: Any) -> dict[str, Any]:
    return {
        "machine": MACHINE_FP,
        "workload": {"dataset": "tests.Toy", "len": 100, "device": "cpu"},
        "loader_kwargs": {"batch_size": 32, "num_workers": n % 4},
        "samples_per_s": float(n),
        **extra,
    }


WRITER_CODE = PRELUDE + """
import sys, warnings
warnings.simplefilter("error")
from autotune.profiles import open_store
writer, url, key, writes = int(sys.argv[2]), sys.argv[3], sys.argv[4], int(sys.argv[5])
store = open_store(storage=url)
wait_for_start()
for n in range(writes):
    assert store.put(key, {"writer": writer, "n": n, "samples_per_s": float(n), "pad": "x" * 20000})
store.close()
"""

READER_CODE = """
import json, sys
from autotune.profiles import open_store
store = open_store(storage=sys.argv[1])
print(json.dumps(store.get(sys.argv[2])))
store.close()
"""


def test_two_processes_put_same_key_at_once_leave_one_row(
    store: DatabaseProfileStore, pg_url: str, keys: list[str], tmp_path: Path
) -> None:
    import sqlalchemy as sa

    key, writers, writes = keys[0], 2, 25
    # Both connect first, then write at the same moment.
    run_together(tmp_path, WRITER_CODE, [[pg_url, key, str(writes)]] * writers)

    engine = sa.create_engine(store.study_storage_url())
    try:
        with engine.connect() as conn:
            rows = conn.execute(
                sa.text("SELECT key, schema, record FROM autotune_profiles WHERE key = :k"), {"k": key}
            ).all()
    finally:
        engine.dispose()
    assert len(rows) == 1
    record = json.loads(rows[0].record)
    # One writer's complete record, never a mix of the two.
    assert record["key"] == key and record["schema"] == rows[0].schema
    assert record["writer"] in range(writers) and record["n"] in range(writes)
    assert record["pad"] == "x" * 20000
    assert store.get(key) == record


def test_second_fingerprint_is_kept_apart(store: DatabaseProfileStore, keys: list[str]) -> None:
    first = profile_key(MACHINE_FP, {"dataset": "a.A", "len": 10, "nonce": keys[0]})
    second = profile_key(MACHINE_FP, {"dataset": "a.A", "len": 11, "nonce": keys[0]})
    keys.extend([first, second])  # deleted by the fixture
    assert first != second
    assert store.put(first, _record(1))
    assert store.put(second, _record(2))
    got_first, got_second = store.get(first), store.get(second)
    assert got_first is not None and got_first["samples_per_s"] == 1.0
    assert got_second is not None and got_second["samples_per_s"] == 2.0
    listed = {s["key"] for s in store.list()}
    assert {first, second} <= listed


def test_profile_read_back_by_a_fresh_process(
    store: DatabaseProfileStore, pg_url: str, keys: list[str]
) -> None:
    key = keys[0]
    assert store.put(key, _record(7, trials=[{"n": 1}]))
    proc = subprocess.run(
        [sys.executable, "-c", READER_CODE, pg_url, key],
        capture_output=True,
        text=True,
        timeout=SUBPROCESS_TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout) == store.get(key)
    assert json.loads(proc.stdout)["trials"] == [{"n": 1}]


def test_study_storage_is_the_same_database(store: DatabaseProfileStore) -> None:
    import optuna

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    name = f"autotune-test-{uuid.uuid4().hex[:12]}"
    storage = optuna.storages.RDBStorage(store.study_storage_url())
    study = optuna.create_study(storage=storage, study_name=name)
    try:
        study.optimize(lambda t: t.suggest_int("w", 0, 4), n_trials=2)
        assert len(optuna.load_study(study_name=name, storage=storage).trials) == 2
    finally:
        optuna.delete_study(study_name=name, storage=storage)
        storage.engine.dispose()  # close the pooled connections now, not at garbage collection


class _Tiny(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 256

    def __getitem__(self, i: int):
        return torch.full((4,), float(i)), i % 2


def test_tune_loader_keeps_profile_and_study_in_the_database(
    store: DatabaseProfileStore, pg_url: str
) -> None:
    from autotune import tune_loader

    kwargs = {"batch_size": 16, "budget_s": 4, "progress": False, "max_workers": 1,
              "pretransform": "none", "storage": pg_url}
    first = tune_loader(_Tiny(), retune=True, **kwargs)
    try:
        assert not first.from_cache and first.key is not None
        assert first.storage_url == mask_url(store.study_storage_url()) and first.study_name
        second = tune_loader(_Tiny(), **kwargs)
        assert second.from_cache and second.loader_kwargs == first.loader_kwargs
    finally:
        store.delete(first.key)


# --------------------------------------------------------------------------------------------------
# No password in anything shown or stored


@dataclass(frozen=True)
class Secret:
    """A URL with a password, and the texts that would give the password away."""

    url: str
    needles: tuple[str, ...]

    def assert_absent(self, *texts: object) -> None:
        for text in texts:
            for needle in self.needles:
                assert needle not in str(text), f"{needle!r} shown in {str(text)[:2000]!r}"


@pytest.fixture
def secret(store: DatabaseProfileStore, pg_url: str) -> Iterator[Secret]:
    """A login of its own with a password found nowhere else, so that any trace of it is a leak.

    The role is a member of the server's test user, so it reaches the same tables. Where the test
    user may not create roles, the URL of ``AUTOTUNE_TEST_POSTGRES_URL`` is used, and the password
    is looked for where a URL or a connection string would carry it.
    """
    import sqlalchemy as sa
    from sqlalchemy.engine import make_url

    role = f"autotune_test_{uuid.uuid4().hex[:12]}"
    password = f"pw{uuid.uuid4().hex}"
    engine = sa.create_engine(store.study_storage_url())
    try:
        try:
            with engine.begin() as conn:
                user = conn.execute(sa.text("SELECT current_user")).scalar_one()
                conn.execute(sa.text(f"CREATE ROLE {role} LOGIN PASSWORD '{password}' IN ROLE \"{user}\""))
        except sa.exc.DBAPIError:  # no CREATEROLE here: fall back to the given URL's password
            given = make_url(pg_url).password
            if not given:
                pytest.skip(f"{URL_ENV} has no password to hide and its user may not create a role")
            yield Secret(pg_url, (f":{given}@", f"password={given}", f"password='{given}'"))
            return
        url = make_url(pg_url).set(username=role, password=password).render_as_string(hide_password=False)
        try:
            yield Secret(url, (password,))
        finally:
            with engine.begin() as conn:
                conn.execute(sa.text(f"REASSIGN OWNED BY {role} TO \"{user}\""))
                conn.execute(sa.text(f"DROP OWNED BY {role}"))
                conn.execute(sa.text(f"DROP ROLE {role}"))
    finally:
        engine.dispose()


def _raw_record(store: DatabaseProfileStore, key: str) -> str:
    """The stored row's record, read past the store."""
    import sqlalchemy as sa

    engine = sa.create_engine(store.study_storage_url())
    try:
        with engine.connect() as conn:
            return str(conn.execute(
                sa.text("SELECT record FROM autotune_profiles WHERE key = :k"), {"k": key}
            ).scalar_one())
    finally:
        engine.dispose()


def _write_raw(store: DatabaseProfileStore, key: str, record: dict[str, Any]) -> None:
    """A row as a version that stored passwords wrote it."""
    import sqlalchemy as sa

    engine = sa.create_engine(store.study_storage_url())
    try:
        with engine.begin() as conn:
            conn.execute(sa.text("UPDATE autotune_profiles SET record = :r WHERE key = :k"),
                         {"r": json.dumps(record), "k": key})
    finally:
        engine.dispose()


def test_the_store_shows_no_password(secret: Secret, keys: list[str]) -> None:
    opened = open_store(storage=secret.url)
    try:
        assert isinstance(opened, DatabaseProfileStore)
        secret.assert_absent(repr(opened), opened.location, str(opened))
        assert "***" in opened.location
        assert opened.put(keys[0], {**_record(1), "storage_url": secret.url})
        secret.assert_absent(_raw_record(opened, keys[0]), opened.get(keys[0]), opened.list())
        _write_raw(opened, keys[0], {"schema": 1, "key": keys[0], "storage_url": secret.url})
        secret.assert_absent(opened.get(keys[0]), opened.list())
        _write_raw(opened, keys[0], {"schema": 999})
        with pytest.warns(Warning) as caught:
            assert opened.get(keys[0]) is None  # a bad row: warned, with the store's location
        secret.assert_absent(*(w.message for w in caught))
    finally:
        opened.delete(keys[0])
        opened.close()


def test_a_refused_login_does_not_show_the_password(secret: Secret) -> None:
    from sqlalchemy.engine import make_url

    wrong = f"wrong{uuid.uuid4().hex}"
    url = make_url(secret.url).set(password=wrong).render_as_string(hide_password=False)
    with pytest.raises(Exception) as info:  # noqa: PT011 - whatever it is, it must not show it
        open_store(storage=url)
    assert wrong not in str(info.value) and wrong not in repr(info.value)
    assert "***" in str(info.value)


def test_tuning_against_the_database_stores_and_shows_no_password(
    store: DatabaseProfileStore, secret: Secret, capsys: pytest.CaptureFixture[str],
    caplog: pytest.LogCaptureFixture,
) -> None:
    import optuna

    from autotune import report, tune_loader
    from autotune.cli import main

    kwargs = {"batch_size": 16, "budget_s": 4, "progress": True, "max_workers": 1,
              "pretransform": "none", "storage": secret.url}
    caplog.set_level(logging.DEBUG)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = tune_loader(_Tiny(), retune=True, **kwargs)
    key = first.key
    assert key is not None and first.study_name and not first.from_cache
    try:
        # The search still reached the database with the password: the study is there.
        storage = optuna.storages.RDBStorage(store.study_storage_url())
        try:
            assert first.study_name in optuna.get_all_study_names(storage)
        finally:
            storage.engine.dispose()  # close the pooled connections now, not at garbage collection
        assert first.storage_url is not None and "***" in first.storage_url
        shown = [first, first.to_dict(), first.to_json(), report.to_json(first), report.summary(first),
                 report.summary_text(first), report.dashboard_hint(first), _raw_record(store, key)]
        secret.assert_absent(*shown, caplog.text, *capsys.readouterr(), *(w.message for w in caught))

        # A row from a version that stored the password: shown without it, on a hit and by the command.
        _write_raw(store, key, {**json.loads(_raw_record(store, key)), "storage_url": secret.url})
        second = tune_loader(_Tiny(), **kwargs)
        assert second.from_cache
        secret.assert_absent(second, second.to_json(), report.to_json(second),
                             report.dashboard_hint(second), caplog.text, *capsys.readouterr())
        for argv in (["list"], ["list", "--json"], ["show", key], ["show", key, "--json"]):
            assert main(["profiles", *argv, "--storage", secret.url]) == 0
            out, err = capsys.readouterr()
            assert key in out, argv
            secret.assert_absent(out, err)
        assert main(["profiles", "clear", key, "--storage", secret.url]) == 0
        secret.assert_absent(*capsys.readouterr())
    finally:
        store.delete(key)


def test_the_command_shows_no_password(store: DatabaseProfileStore, secret: Secret,
                                       capsys: pytest.CaptureFixture[str]) -> None:
    from autotune.cli import main

    quick = ["tune", "--dataset", "tensor", "--samples", "256", "--no-step", "--batch-size", "16",
             "--budget", "3", "--max-workers", "1", "--storage", secret.url, "--retune"]
    keys = []
    try:
        for extra in ([], ["--json"], ["--verbose"]):
            assert main([*quick, *extra]) == 0
            out, err = capsys.readouterr()
            secret.assert_absent(out, err)
            if extra == ["--json"]:
                keys.append(json.loads(out)["key"])
                assert "***" in json.loads(out)["storage_url"]
        secret.assert_absent(_raw_record(store, keys[0]))
    finally:
        for key in keys:
            store.delete(key)
