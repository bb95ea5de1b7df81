"""Where the per-sample transform runs: ``none`` (per sample, in the workers), ``ram``, ``device``.

Interface used by the rest of the package (keep these names and shapes):

- ``strategies(dataset, *, cuda, memory_budget_bytes, device_memory_budget_bytes) -> dict[str, str|None]``
  every strategy name mapped to ``None`` when usable for this dataset, or the reason it is refused.
- ``prepare(dataset, strategy, *, device) -> Prepared``: the wrapped dataset (built once per process
  and dataset, then reused), the collate function to use with it, the build time and the cache size.
- ``holds_cuda_tensors(dataset) -> bool``: samples already live on an accelerator (no workers then).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.data import Dataset

from .exceptions import ConfigurationError

STRATEGIES = ("none", "ram", "device")


@dataclass(frozen=True)
class Prepared:
    """A dataset ready to be loaded with one strategy."""

    dataset: Any
    strategy: str
    collate_fn: Callable[[Any], Any] | None = None
    build_s: float = 0.0
    nbytes: int = 0


def strategies(
    dataset: Dataset[Any],
    *,
    cuda: bool,
    memory_budget_bytes: int | None = None,
    device_memory_budget_bytes: int | None = None,
) -> dict[str, str | None]:
    reasons: dict[str, str | None] = {"none": None}
    reasons["ram"] = "pre-transform caching is not available yet"
    reasons["device"] = "pre-transform caching is not available yet"
    return reasons


def prepare(dataset: Dataset[Any], strategy: str, *, device: torch.device) -> Prepared:
    if strategy == "none":
        return Prepared(dataset=dataset, strategy="none")
    raise ConfigurationError(
        f"pretransform={strategy!r} is not available; use one of {STRATEGIES[:1]}."
    )


def _contains_cuda(obj: Any) -> bool:
    if isinstance(obj, torch.Tensor):
        return obj.is_cuda
    if isinstance(obj, dict):
        return any(_contains_cuda(v) for v in obj.values())
    if isinstance(obj, (list, tuple)):
        return any(_contains_cuda(v) for v in obj)
    return False


def holds_cuda_tensors(dataset: Dataset[Any]) -> bool:
    """Whether the first sample holds a CUDA tensor (then workers would fail to share it)."""
    try:
        sample = dataset[0]
    except Exception:  # noqa: BLE001 - the measurement will raise the user's error properly
        return False
    return _contains_cuda(sample)
