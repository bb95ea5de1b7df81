"""Datasets for the scripts ``tests/test_containers.py`` runs in a private mount namespace with a
64 MiB /dev/shm. Module-level, so that worker processes can receive them.
"""

from __future__ import annotations

import mmap
import os
from typing import Any

import torch
from torch.utils.data import Dataset
from torchvision import transforms

SIDE = 224
"""Image side: a batch of 64 float images is 38.5 MB, two of them more than a 64 MiB /dev/shm."""


class BigImages(Dataset[tuple[torch.Tensor, int]]):
    """``n`` uint8 3x224x224 images made from their index, served as floats (deterministic: a ``ram``
    cache can hold them) flipped at random; the target is the index, so a test sees which samples
    came. As torchvision's datasets, it serves the raw image where ``transform`` is None."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.transform: Any = transforms.Compose([
            transforms.ConvertImageDtype(torch.float32),
            transforms.RandomHorizontalFlip(),
        ])

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Any, int]:
        if not 0 <= index < self.n:
            raise IndexError(index)
        g = torch.Generator().manual_seed(index)
        image: Any = torch.randint(0, 256, (3, SIDE, SIDE), dtype=torch.uint8, generator=g)
        if self.transform is not None:
            image = self.transform(image)
        return image, index


BUS_FILE = "/dev/shm/autotune-test-unreserved"
"""The segment :class:`UnreservedWrites` maps; the test removes it."""


class UnreservedWrites(Dataset[torch.Tensor]):
    """Every read writes 128 MiB into a segment of /dev/shm mapped without reserving its pages first,
    as code that does not ``fallocate`` does: on a 64 MiB /dev/shm the kernel kills the writer with
    SIGBUS when the tmpfs runs out."""

    def __len__(self) -> int:
        return 64

    def __getitem__(self, index: int) -> torch.Tensor:
        size = 128 << 20
        fd = os.open(BUS_FILE, os.O_CREAT | os.O_RDWR, 0o600)
        try:
            os.ftruncate(fd, size)
            with mmap.mmap(fd, size) as m:
                for start in range(0, size, 1 << 20):
                    m[start:start + (1 << 20)] = b"\1" * (1 << 20)
        finally:
            os.close(fd)
        return torch.zeros(4)
