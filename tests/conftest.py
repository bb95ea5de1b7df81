"""Shared fixtures: every test gets its own profile cache, and leaks of worker processes fail it."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the profile cache at a temporary folder so tests never touch the user's cache."""
    cache = tmp_path / "autotune-cache"
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(cache))
    yield cache


@pytest.fixture
def no_leaked_children() -> Iterator[None]:
    """Fail the test if it leaves a child process of this one behind."""
    before = {p.pid for p in psutil.Process(os.getpid()).children(recursive=True)}
    yield
    after = [
        p
        for p in psutil.Process(os.getpid()).children(recursive=True)
        if p.pid not in before and p.status() != psutil.STATUS_ZOMBIE
    ]
    assert not after, f"child processes left behind: {[p.pid for p in after]}"
