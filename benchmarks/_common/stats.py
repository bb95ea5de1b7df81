"""Rounds measured side by side: their order, and the ratios' median, spread and confidence interval.

# NOTE [ Paired ratio interval ]
# Two settings A and B measured in interleaved rounds (A then B, then B then A, ...) give one ratio
# per round, a_i / b_i, taken between neighbours in time, so a slow drift of a shared machine hits
# both alike. The interval is Student's t on the logarithms of those ratios: the mean log ratio m,
# their standard deviation s over n rounds, and m +- t(n - 1) * s / sqrt(n), t at the library's one-sided
# CONFIDENCE (autotune.decide, NOTE [ Decisions ]), so the low and high ends mean what the reports'
# speedup_low and speedup_high mean. One round gives a ratio and no interval.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

from autotune.decide import CONFIDENCE, interval_label, t_quantile


@dataclass(frozen=True)
class Interval:
    """A ratio (geometric mean of the per-round ratios) and its interval at ``confidence``."""

    ratio: float
    low: float
    high: float
    confidence: float
    rounds: int

    def contains(self, value: float) -> bool:
        return self.low <= value <= self.high

    def text(self) -> str:
        if self.rounds < 2:
            return f"{self.ratio:.2f}x (one round: no interval)"
        return f"{self.ratio:.2f}x ({interval_label(self.confidence)} {self.low:.2f}-{self.high:.2f}x)"

    def to_dict(self) -> dict[str, Any]:
        data = asdict(self)
        if not math.isfinite(self.high):  # JSON has no infinity
            data["high"] = None
        return data


def paired_interval(a: Sequence[float], b: Sequence[float]) -> Interval:
    """The ratio a / b over rounds measured side by side (NOTE [ Paired ratio interval ])."""
    if len(a) != len(b) or not a:
        raise ValueError(f"need one value of each per round; got {len(a)} and {len(b)}")
    logs = [math.log(x / y) for x, y in zip(a, b, strict=True)]
    mean = statistics.fmean(logs)
    if len(logs) < 2:
        return Interval(math.exp(mean), 0.0, math.inf, CONFIDENCE, len(logs))
    half = t_quantile(len(logs) - 1) * statistics.stdev(logs) / math.sqrt(len(logs))
    return Interval(math.exp(mean), math.exp(mean - half), math.exp(mean + half), CONFIDENCE, len(logs))


def spread(values: Sequence[float]) -> float:
    """(max - min) / median: how far repeated measurements of one thing lie apart."""
    med = statistics.median(values) if values else 0.0
    return (max(values) - min(values)) / med if med > 0 else 0.0


def rotated(items: Sequence[Any], r: int) -> list[Any]:
    """``items`` started at position ``r`` (mod its length): the order of round ``r``, so that every
    item leads once in ``len(items)`` rounds and a slow drift of the machine favours none."""
    k = r % len(items) if items else 0
    return [*items[k:], *items[:k]]
