"""The database profile store on a real PostgreSQL server.

Runs when ``AUTOTUNE_TEST_POSTGRES_URL`` names one (``postgresql://user:password@host/db``) and skips
otherwise. When the variable is set, an unreachable server fails these tests: it is never a skip.
Each test uses keys of its own and deletes them, so a shared database keeps its other profiles.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from together import PRELUDE, run_together

from autotune.profiles import DatabaseProfileStore, open_store, profile_key

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
        assert first.storage_url == store.study_storage_url() and first.study_name
        second = tune_loader(_Tiny(), **kwargs)
        assert second.from_cache and second.loader_kwargs == first.loader_kwargs
    finally:
        store.delete(first.key)
