"""One rank of a training job with the drop-in DataLoader: run under ``torchrun``; writes OUT/rank<N>.json.

Usage: torchrun --nproc-per-node=2 tests/dist_loader_rank.py OUT
"""

from __future__ import annotations

import json
import os
import sys
import time
from datetime import timedelta

import psutil
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, DistributedSampler

from autotune import DataLoader


class Remote(Dataset):
    """Every sample waits 2 ms, like a read from remote storage."""

    def __len__(self) -> int:
        return 2048

    def __getitem__(self, i: int):
        time.sleep(0.002)
        return torch.full((4,), float(i)), i % 10


def main() -> None:
    out = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    ds = Remote()
    sampler = DistributedSampler(ds, shuffle=True, seed=1)
    loader = DataLoader(ds, batch_size=16, sampler=sampler, cache=False, pretransform="none")
    epochs = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        expected = [int(i) for i in sampler]
        seen = []
        for x, _ in loader:
            seen.extend(int(v) for v in x[:, 0])
            time.sleep(0.004)  # the step
        epochs.append(seen == expected)
    tuning = loader.tuning
    loader.close()
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "epochs_exact": epochs, "settled": loader.settled,
                   "settled_before": loader._tuning.settled_before(),
                   "trials": [t.to_dict() for t in tuning.trials] if tuning else [],
                   "chosen": tuning.candidate.to_dict() if tuning else None, "pid": os.getpid(),
                   "children": [p.pid for p in psutil.Process().children(recursive=True)]}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
