"""Shared fixtures: every test gets its own profile cache (and node caches), and leaks of worker
processes fail it."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path

import psutil
import pytest


@pytest.fixture(autouse=True)
def _isolated_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """Point the profile cache at a temporary folder so tests never touch the user's cache."""
    cache = tmp_path / "autotune-cache"
    monkeypatch.setenv("AUTOTUNE_CACHE_DIR", str(cache))
    # Node caches (NOTE [ Node caches ]) in the test's own folder, which the processes it starts
    # inherit: none is left in /dev/shm, and no other run's is touched. Tests of where they go by
    # default unset it.
    monkeypatch.setenv("AUTOTUNE_NODE_CACHE_DIR", str(tmp_path / "node-caches"))
    yield cache
    from autotune.pretransform import node

    node.clear(cache)  # the node caches the test made where it chose the default (in /dev/shm too)


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


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """Ctrl-C raises KeyboardInterrupt in this test, as in a terminal: a suite started in the
    background by a non-interactive shell inherits SIGINT ignored, and a signal the test sends
    itself would then be lost."""
    old = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)
