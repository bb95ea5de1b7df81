"""Dataset factories for ``autotune tune --dataset cli_fixtures:NAME`` in tests/test_cli.py.

Everything a DataLoader worker touches is module-level, so it pickles into worker processes.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils.data import Dataset, TensorDataset

CALLS: list[str] = []
"""Names of the factories called in this process, so a test can tell that its factory ran."""


def tensors(n: int = 512) -> TensorDataset:
    gen = torch.Generator().manual_seed(0)
    return TensorDataset(torch.randn((n, 16), generator=gen), torch.randint(0, 4, (n,), generator=gen))


def make_dataset() -> TensorDataset:
    """A dataset alone: loading is measured without a step. It prints, as user code often does."""
    CALLS.append("make_dataset")
    print("building the dataset...")
    return tensors()


class LinearStep:
    """A small training step for :func:`tensors`: a linear model and one SGD update per batch."""

    def __init__(self) -> None:
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            self.model = torch.nn.Linear(16, 4)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.01)
        self.calls = 0

    def __call__(self, batch: Any) -> None:
        self.calls += 1
        x, y = batch
        self.optimizer.zero_grad()
        torch.nn.functional.cross_entropy(self.model(x), y).backward()
        self.optimizer.step()


STEP = LinearStep()
"""The step :func:`make_pair` returns; a test reads ``STEP.calls`` to see that tuning ran it."""


def make_pair() -> tuple[TensorDataset, LinearStep]:
    """A ``(dataset, step)`` pair."""
    CALLS.append("make_pair")
    return tensors(), STEP


def broken_step(batch: Any) -> None:
    raise RuntimeError("the model diverged: loss is nan")


def make_broken_pair() -> tuple[TensorDataset, Any]:
    """A step that raises under every candidate: the user's own error, so tuning fails with it."""
    return tensors(), broken_step


class Empty(Dataset[Any]):
    def __len__(self) -> int:
        return 0

    def __getitem__(self, index: int) -> Any:
        raise IndexError(index)


def make_empty() -> Empty:
    """An empty dataset: tune_loader refuses it with a ConfigurationError."""
    return Empty()


def factory_that_raises() -> None:
    raise OSError("the data volume is not mounted")


def interrupted() -> None:
    """Stands for the user pressing Ctrl-C while the dataset is being built."""
    raise KeyboardInterrupt


NOT_CALLABLE = 42
