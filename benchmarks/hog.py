"""A background CPU hog: one busy core, for benchmarks of a machine that other jobs share.

# NOTE [ Loaded mode ]
# Shared workstations and CI runners rarely give a job the whole machine. A benchmark's loaded mode
# runs its measurements beside one process that keeps one core busy (a pure-Python busy loop, as
# ``python3 -c 'while True: pass'``), started and stopped by the benchmark itself: killed in
# ``finally``, so an error or Ctrl-C does not leave it running, and ending by itself when the process
# that started it is gone (it checks its parent every few milliseconds), so even a benchmark killed
# with SIGKILL leaves nothing behind. What it did is recorded: its pid, command, how long it lived and
# the CPU seconds it used (about one per second when it had a core to itself).
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil

HOG_SOURCE = ("import os\n"
              "parent = {parent}\n"
              "while os.getppid() == parent:\n"
              "    for _ in range(200_000):\n"
              "        pass\n")
"""A busy loop that ends once its parent is gone (NOTE [ Loaded mode ])."""

STOP_TIMEOUT_S = 10.0
"""A killed hog is reaped within this; it never takes more than a moment."""


@contextlib.contextmanager
def cpu_hog(enabled: bool = True) -> Iterator[dict[str, Any]]:
    """Run one busy core while the block runs; yields the record that says what it did.

    With ``enabled`` false nothing is started and the record says so, so that callers write one path
    for the quiet and the loaded mode.
    """
    record: dict[str, Any] = {"enabled": enabled}
    if not enabled:
        yield record
        return
    source = HOG_SOURCE.format(parent=os.getpid())
    proc = subprocess.Popen([sys.executable, "-c", source], stdin=subprocess.DEVNULL,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started = time.monotonic()
    record.update(pid=proc.pid, command=f"{sys.executable} -c {source!r}",
                  load_at_start=[round(x, 2) for x in os.getloadavg()])
    try:
        yield record
    finally:
        with contextlib.suppress(psutil.Error):
            cpu = psutil.Process(proc.pid).cpu_times()
            record["cpu_s"] = round(cpu.user + cpu.system, 1)
        record["alive_s"] = round(time.monotonic() - started, 1)
        record["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
        proc.kill()
        proc.wait(timeout=STOP_TIMEOUT_S)
        record["returncode"] = proc.returncode
