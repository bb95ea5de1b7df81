"""A background CPU hog: one busy core, for benchmarks of a machine that other jobs share.

# NOTE [ Loaded mode ]
# Shared workstations and CI runners rarely give a job the whole machine. A benchmark's loaded mode
# runs its measurements beside one process that keeps one core busy (a pure-Python busy loop, as
# ``python3 -c 'while True: pass'``), started and stopped by the benchmark itself: killed in
# ``finally``, so an error or Ctrl-C does not leave it running, and ending by itself when the process
# that started it is gone (it checks for that pid every few milliseconds), so even a benchmark killed
# with SIGKILL leaves nothing behind. What it did is recorded: its pid, command, how long it lived and
# the CPU seconds it used (about one per second when it had a core to itself).
# It is another process's load, not one of the benchmark's own: started through a launcher that
# exits at once, it is no descendant of the benchmark, so what autotune reads as others' load (NOTE
# [ Others' load ] in autotune/machine.py, which leaves out the run's own process tree) counts it,
# as it counts a job a user's neighbour started. It ends once the benchmark's pid is gone.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from typing import Any

import psutil

HOG_SOURCE = ("import os\n"
              "owner = {owner}\n"
              "def alive():\n"
              "    try:\n"
              "        os.kill(owner, 0)\n"
              "    except ProcessLookupError:\n"
              "        return False\n"
              "    except PermissionError:\n"
              "        pass\n"
              "    return True\n"
              "while alive():\n"
              "    for _ in range(200_000):\n"
              "        pass\n")
"""A busy loop that ends once the benchmark that started it is gone (NOTE [ Loaded mode ])."""

LAUNCHER_SOURCE = ("import subprocess, sys\n"
                   "hog = subprocess.Popen([sys.executable, '-c', sys.argv[1]], stdin=subprocess.DEVNULL,\n"
                   "                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,\n"
                   "                       start_new_session=True)\n"
                   "print(hog.pid, flush=True)\n")
"""Starts the hog and exits, so that the hog is not the benchmark's descendant."""

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
    source = HOG_SOURCE.format(owner=os.getpid())
    launcher = subprocess.run([sys.executable, "-c", LAUNCHER_SOURCE, source], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, check=True, timeout=60)
    pid = int(launcher.stdout.split()[0])
    started = time.monotonic()
    record.update(pid=pid, command=f"{sys.executable} -c {source!r}",
                  load_at_start=[round(x, 2) for x in os.getloadavg()])
    try:
        yield record
    finally:
        with contextlib.suppress(psutil.Error):
            proc = psutil.Process(pid)
            cpu = proc.cpu_times()
            record["cpu_s"] = round(cpu.user + cpu.system, 1)
        record["alive_s"] = round(time.monotonic() - started, 1)
        record["load_at_end"] = [round(x, 2) for x in os.getloadavg()]
        record["returncode"] = _kill(pid)


def _kill(pid: int) -> int | None:
    """Kill the hog and wait until it is gone (not ours to reap: its exit status is not ours to
    read, so the record says -SIGKILL once it has ended)."""
    try:
        proc = psutil.Process(pid)
        proc.kill()
    except psutil.NoSuchProcess:
        return -signal.SIGKILL
    deadline = time.monotonic() + STOP_TIMEOUT_S
    while time.monotonic() < deadline:
        try:
            if proc.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(0.02)
    else:
        return None
    return -signal.SIGKILL
