"""One rank of a cooperative tuning job: run under ``torchrun``; writes its result to OUT/rank<N>.json.

Usage: torchrun --nproc-per-node=2 tests/dist_rank.py OUT BUDGET_S
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
from torch.utils.data import Dataset

from autotune import tune_loader


class Remote(Dataset):
    """Every sample waits 2 ms, like a read from remote storage, and costs a little CPU."""

    def __len__(self) -> int:
        return 4096

    def __getitem__(self, i: int):
        time.sleep(0.002)
        x = torch.full((3, 16, 16), float(i))
        return x.sin().cos(), i % 10


def main() -> None:
    out, budget = sys.argv[1], float(sys.argv[2])
    dist.init_process_group("gloo", timeout=timedelta(seconds=120))
    rank = dist.get_rank()
    result = tune_loader(Remote(), batch_size=32, budget_s=budget, progress=False,
                         pretransform="none", cache=False)
    with open(os.path.join(out, f"rank{rank}.json"), "w") as fh:
        json.dump({"rank": rank, "result": result.to_dict(), "pid": os.getpid(),
                   "children": [p.pid for p in psutil.Process().children(recursive=True)]}, fh)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
