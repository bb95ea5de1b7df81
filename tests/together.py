"""Start several real processes so that they do their work at the same moment.

Each process runs ``code`` with ``sys.argv[1]`` = the start-signal path and ``sys.argv[2]`` = its
index, then its own arguments. It must call ``wait_for_start()`` (defined in :data:`PRELUDE`, which
the code should include) after its imports: that marks it ready and waits for the signal, so the
processes' slow start-up never staggers the part under test.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path

TIMEOUT_S = 120

PRELUDE = """
import os as _os, sys as _sys, time as _time
def wait_for_start():
    go, index = _sys.argv[1], _sys.argv[2]
    open(go + ".ready-" + index, "w").close()
    deadline = _time.monotonic() + 60
    while not _os.path.exists(go):
        assert _time.monotonic() < deadline, "never told to start"
        _time.sleep(0.005)
"""


def run_together(tmp_path: Path, code: str, args: Sequence[Sequence[str]]) -> None:
    """Run one process per entry of ``args`` at the same moment; fail if any exits non-zero."""
    go = tmp_path / "go"
    logs = [tmp_path / f"proc-{i}.log" for i in range(len(args))]
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for i, (log, extra) in enumerate(zip(logs, args, strict=True)):
            with open(log, "wb") as out:
                argv = [sys.executable, "-c", code, str(go), str(i), *extra]
                procs.append(subprocess.Popen(argv, stdout=out, stderr=out))
        ready = [Path(f"{go}.ready-{i}") for i in range(len(args))]
        deadline = time.monotonic() + TIMEOUT_S
        while not all(p.exists() for p in ready):
            assert all(p.poll() is None for p in procs), [log.read_text() for log in logs]
            assert time.monotonic() < deadline, "the processes never got ready"
            time.sleep(0.01)
        go.touch()
        for proc, log in zip(procs, logs, strict=True):
            assert proc.wait(timeout=TIMEOUT_S) == 0, log.read_text()
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
