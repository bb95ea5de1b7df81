"""Whose is a file in /dev/shm? The leftover checks count only what this test process's tree made.

These machines are shared: another program may create shared-memory files while a test runs (torch's
``torch_<pid>_...`` segments, multiprocessing's ``sem.mp-...`` semaphores). A file is another
program's when its name carries the pid of a live process outside this process tree, or when a live
process outside this tree has it mapped (an open semaphore or segment is mapped by its users).
A multiprocessing semaphore carries no owner, and its creator unlinks it when the object is
collected: one left by this process tree is one it still holds, mapped; one nobody maps was left by
a process that ended (never this test's, whose every process the test outlives).
"""

from __future__ import annotations

import contextlib
import os

import psutil

SHM_DIR = "/dev/shm"


def _tree() -> set[int]:
    me = psutil.Process()
    pids = {me.pid}
    with contextlib.suppress(psutil.Error):
        pids.update(p.pid for p in me.children(recursive=True))
    return pids


def _mapped_by(path: str, tree: set[int], *, inside: bool = False) -> bool:
    """Whether a live process outside ``tree`` (``inside``: in it) maps ``path``: by its inode, as a
    semaphore is mapped under the temporary name glibc created it with."""
    try:
        inode = str(os.stat(path).st_ino)
    except OSError:
        return False
    for pid in psutil.pids():
        if (pid in tree) != inside:
            continue
        with contextlib.suppress(OSError), open(f"/proc/{pid}/maps", encoding="utf-8", errors="replace") as f:
            for line in f:
                fields = line.split(None, 5)
                if len(fields) > 5 and fields[4] == inode and "/dev/shm/" in fields[5]:
                    return True
    return False


def others(names: list[str]) -> set[str]:
    """The names among ``names`` (files in /dev/shm) that belong to other programs."""
    tree = _tree()
    out = set()
    for name in names:
        parts = name.split("_")
        if name.startswith("torch_") and len(parts) > 1 and parts[1].isdigit():
            pid = int(parts[1])
            if pid not in tree and psutil.pid_exists(pid):
                out.add(name)
                continue
        path = os.path.join(SHM_DIR, name)
        if name.startswith("sem.mp-"):
            if not _mapped_by(path, tree, inside=True):
                out.add(name)
        elif _mapped_by(path, tree):
            out.add(name)
    return out
