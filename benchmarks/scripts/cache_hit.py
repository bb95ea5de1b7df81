"""How long ``tune_loader`` takes when the profile is already stored (a cache hit), after import.

    python benchmarks/scripts/cache_hit.py [--calls 50]

Tunes a small CIFAR-10-shaped workload once into a temporary cache folder, then times repeated calls
that find the stored profile, and prints the median and the 95th percentile in milliseconds.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time

TARGET_MS = 50.0
"""A cache hit should cost less than this: well under a training step's start-up."""


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=50)
    args = parser.parse_args(argv)

    from autotune import tune_loader
    from autotune.workloads import cifar10_workload

    w = cifar10_workload(4096, seed=0)
    with tempfile.TemporaryDirectory(prefix="autotune-cache-hit-") as cache:
        first = tune_loader(w.dataset, w.step, batch_size=w.batch_size, budget_s=6, cache_dir=cache,
                            progress=False)
        times = []
        for _ in range(args.calls):
            t0 = time.perf_counter()
            hit = tune_loader(w.dataset, w.step, batch_size=w.batch_size, budget_s=6, cache_dir=cache,
                              progress=False)
            times.append((time.perf_counter() - t0) * 1000.0)
            if not hit.from_cache or hit.loader_kwargs != first.loader_kwargs:
                print("a call missed the stored profile", file=sys.stderr)
                return 1
    times.sort()
    median = statistics.median(times)
    p95 = times[min(len(times) - 1, int(0.95 * len(times)))]
    print(json.dumps({"calls": args.calls, "median_ms": round(median, 2), "p95_ms": round(p95, 2),
                      "max_ms": round(times[-1], 2), "target_ms": TARGET_MS,
                      "met": p95 < TARGET_MS}))
    return 0 if p95 < TARGET_MS else 1


if __name__ == "__main__":
    sys.exit(main())
