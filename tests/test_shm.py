"""What worker processes need of /dev/shm, and how torch's failures there are told apart.

The real failures, in a real 64 MiB /dev/shm, are in tests/test_containers.py; here the arithmetic
and the texts torch writes (the older releases' among them, which this torch no longer produces).
"""

from __future__ import annotations

import numpy as np
import torch

from autotune import shm
from autotune.exceptions import WorkerFailed
from autotune.measure import map_loader_error

MIB = 1 << 20

BATCH = 16 * 3 * 224 * 224 * 4
"""16 float 3x224x224 images: 9.6 MB, the batches NOTE [ Shared memory ] was measured with."""


def test_the_estimate_matches_what_was_measured_in_64_mib() -> None:
    # NOTE [ Shared memory ] 1: 5 workers x prefetch 1 ran; 6 x 1 and 3 x 2 ran out.
    assert shm.worker_bytes(5, 1, BATCH) == 6 * BATCH
    assert shm.fits(shm.worker_bytes(5, 1, BATCH), 64 * MIB)
    assert not shm.fits(shm.worker_bytes(6, 1, BATCH), 64 * MIB)
    assert not shm.fits(shm.worker_bytes(3, 2, BATCH), 64 * MIB)
    assert shm.fits(10**12, None)  # no /dev/shm: nothing to fill


def test_bytes_of_a_batch_count_its_tensors_and_arrays() -> None:
    batch = {"image": torch.zeros(4, 3, 8, 8), "extra": [np.zeros(10, dtype=np.int16), 3, "label"]}
    assert shm.nbytes(batch) == 4 * 3 * 8 * 8 * 4 + 20
    assert shm.nbytes((torch.zeros(2, dtype=torch.int64), torch.zeros(2, dtype=torch.uint8))) == 18


WORKER = (
    "Caught RuntimeError in DataLoader worker process 1.\nOriginal Traceback (most recent call last):\n"
    '  File "worker.py", line 375, in _worker_loop\n    data = fetcher.fetch(index)\n'
    "RuntimeError: unable to allocate shared memory(shm) for file </torch_123_456_7>: No space left on"
    " device (28)\n"
)
OLDER = "unable to write to file </torch_123_456_7>: No space left on device (28)"
BUS = ("DataLoader worker (pid 123) is killed by signal: Bus error. It is possible that dataloader's"
       " workers are out of shared memory. Please try to raise your shared memory limit.")


def test_running_out_of_dev_shm_is_told_from_other_errors() -> None:
    for text in (WORKER, OLDER, BUS):
        assert shm.exhausted(RuntimeError(text)), text
    assert not shm.exhausted(RuntimeError("unable to write to file </torch_1_2_3>: Permission denied (13)"))
    assert not shm.exhausted(RuntimeError("Caught ValueError in DataLoader worker process 0."))


def test_the_failure_names_the_limit_the_fix_and_torchs_line() -> None:
    mapped = map_loader_error(RuntimeError(WORKER))
    assert isinstance(mapped, WorkerFailed)
    text = str(mapped)
    assert text.startswith("a worker process ran out of /dev/shm")
    assert "docker run --shm-size=1g" in text
    assert text.endswith("(RuntimeError: unable to allocate shared memory(shm) for file </torch_123_456_7>:"
                         " No space left on device (28))")
    assert "ran out of /dev/shm" in str(map_loader_error(RuntimeError(BUS)))
