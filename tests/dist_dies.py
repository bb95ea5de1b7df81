"""A cooperative tuning job in which rank 1 dies: run under ``torchrun``; rank 0 must not hang.

Usage: torchrun --standalone --nproc-per-node=2 tests/dist_dies.py before|during
Rank 0 prints ``TUNING FAILED: <reason>`` and exits 0 when tune_loader raises TuningFailed.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta

import torch.distributed as dist

import autotune.distributed as ad
from autotune import TuningFailed, tune_loader

sys.path.insert(0, os.path.dirname(__file__))
from dist_rank import Remote  # noqa: E402

ad.COLLECTIVE_MARGIN_S = 3.0  # the control group's timeout: budget + this


def main() -> None:
    when = sys.argv[1]
    dist.init_process_group("gloo", timeout=timedelta(seconds=60))
    if dist.get_rank() == 1:
        if when == "before":
            os._exit(0)
        ad.measure = lambda *args, **kwargs: os._exit(0)  # dies in its first measurement
    try:
        tune_loader(Remote(), batch_size=32, budget_s=4, progress=False, cache=False,
                    pretransform="none")
    except TuningFailed as err:
        print("TUNING FAILED:", err, flush=True)
        os._exit(0)
    os._exit(3)


if __name__ == "__main__":
    main()
