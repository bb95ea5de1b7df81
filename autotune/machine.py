"""What this machine is: the facts the search space and the profile key are built from."""

from __future__ import annotations

import importlib.metadata
import os
import platform
from dataclasses import asdict, dataclass
from typing import Any

import psutil
import torch

RAM_ROUND_BYTES = 1 << 30
"""RAM enters the fingerprint rounded to whole GiB, so a few MiB of firmware reserve never splits a key."""


@dataclass(frozen=True)
class MachineInfo:
    """This machine, as far as DataLoader tuning cares.

    ``usable_cpus`` is what this *process* may run on (its affinity mask), not the number of cores in
    the box: containers and ``taskset`` restrict it, and it is the budget workers compete for.
    """

    usable_cpus: int
    logical_cpus: int
    physical_cores: int | None
    cpu_model: str
    ram_total_bytes: int
    ram_available_bytes: int
    accelerator: str  # "cuda" or "none"
    accelerator_name: str | None
    accelerator_count: int
    accelerator_memory_bytes: int | None
    torch_version: str
    torchvision_version: str | None
    python_version: str
    os: str

    @property
    def has_cuda(self) -> bool:
        return self.accelerator == "cuda"

    def fingerprint(self) -> dict[str, Any]:
        """The stable facts that decide which configuration is fastest (no momentary readings).

        The machine half of a profile key (:func:`autotune.fingerprint.profile_key`).
        """
        return {
            "cpu_model": self.cpu_model,
            "usable_cpus": self.usable_cpus,
            "physical_cores": self.physical_cores,
            "ram_gib": round(self.ram_total_bytes / RAM_ROUND_BYTES),
            "accelerator": self.accelerator,
            "accelerator_name": self.accelerator_name,
            "accelerator_count": self.accelerator_count,
            "torch": self.torch_version,
            "torchvision": self.torchvision_version,
            "os": self.os,
        }

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def usable_cpu_count() -> int:
    """Logical CPUs this process may run on: the affinity mask where the OS has one."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as fh:
            for line in fh:
                if line.lower().startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _torchvision_version() -> str | None:
    # The installed distribution's version: importing torchvision itself takes seconds.
    try:
        return importlib.metadata.version("torchvision")
    except importlib.metadata.PackageNotFoundError:  # pragma: no cover - a dependency
        return None


def detect_machine() -> MachineInfo:
    """Read the machine now. Cheap (a few ms): safe to call on every ``tune_loader`` call."""
    mem = psutil.virtual_memory()
    has_cuda = torch.cuda.is_available()
    name = None
    count = 0
    gpu_mem = None
    if has_cuda:
        count = torch.cuda.device_count()
        props = torch.cuda.get_device_properties(0)
        name = props.name
        gpu_mem = int(props.total_memory)
    return MachineInfo(
        usable_cpus=usable_cpu_count(),
        logical_cpus=os.cpu_count() or 1,
        physical_cores=psutil.cpu_count(logical=False),
        cpu_model=_cpu_model(),
        ram_total_bytes=int(mem.total),
        ram_available_bytes=int(mem.available),
        accelerator="cuda" if has_cuda else "none",
        accelerator_name=name,
        accelerator_count=count,
        accelerator_memory_bytes=gpu_mem,
        torch_version=str(torch.__version__),
        torchvision_version=_torchvision_version(),
        python_version=platform.python_version(),
        os=f"{platform.system()} {platform.release()}",
    )
