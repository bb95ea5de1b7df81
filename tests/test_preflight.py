"""The checks run before anything is measured: clear errors that name the value, the rule, the fix."""

from __future__ import annotations

import threading

import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from autotune import preflight
from autotune.exceptions import ConfigurationError


class Plain(Dataset):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> int:
        return i


class Locked(Plain):
    def __init__(self) -> None:
        self.lock = threading.Lock()  # cannot be pickled


class Sharded(IterableDataset):
    def __iter__(self):  # noqa: ANN204
        info = get_worker_info()
        yield from range(info.id if info else 0, 10, info.num_workers if info else 1)


class Replays(IterableDataset):
    def __iter__(self):  # noqa: ANN204
        yield from range(10)


def test_what_is_not_a_dataset_is_refused_with_the_fix() -> None:
    with pytest.raises(ConfigurationError, match=r"is iterable but not a torch.utils.data.IterableDataset"):
        preflight.check_dataset(iter([1, 2]))
    with pytest.raises(ConfigurationError, match=r"is not a dataset"):
        preflight.check_dataset(42)
    with pytest.raises(ConfigurationError, match=r"is empty"):
        preflight.check_dataset([])
    assert preflight.check_dataset([], allow_empty=True) == 0
    assert preflight.check_dataset(Plain()) == 4


def test_numbers_devices_and_strategies() -> None:
    with pytest.raises(ConfigurationError, match=r"budget_s=-1 must be > 0"):
        preflight.check_number("budget_s", -1, minimum=0, fix="give seconds.")
    with pytest.raises(ConfigurationError, match=r"device='gpu0' is not a torch device"):
        preflight.resolve_device("gpu0")
    if not torch.cuda.is_available():
        with pytest.raises(ConfigurationError, match=r"CUDA is not available"):
            preflight.resolve_device("cuda")
    assert preflight.resolve_pretransforms("auto") == ("none", "ram", "device")
    with pytest.raises(ConfigurationError, match=r"pretransform='disk' is not a pre-transform strategy"):
        preflight.resolve_pretransforms("disk")


@pytest.mark.parametrize(("settings", "match"), [
    ({"num_workers": 1.5}, r"num_workers=1.5, which must be a non-negative integer"),
    ({"pin_memory": "yes"}, r"pin_memory='yes', which must be True or False"),
    ({"prefetch_factor": 0}, r"prefetch_factor=0, which must be a positive integer or None"),
    ({"num_workes": 2}, r"num_workes=2; the settings it may give are"),
])
def test_loader_settings_are_checked_as_torch_would(settings: dict, match: str) -> None:
    with pytest.raises(ConfigurationError, match=match):
        preflight.check_loader_settings("baseline", settings)
    preflight.check_loader_settings("baseline", {"num_workers": 4, "prefetch_factor": None})


def test_a_dataset_that_cannot_be_pickled_is_found_under_spawn_only() -> None:
    assert preflight.unpicklable_reason(Locked(), None, "fork") is None
    why = preflight.unpicklable_reason(Locked(), None, "spawn")
    assert why is not None and "cannot be pickled" in why and "'spawn' start method" in why
    assert preflight.unpicklable_reason(Plain(), None, "spawn") is None


def test_sharding_is_read_from_the_stream_s_code() -> None:
    assert preflight.shards_by_worker(Sharded()) and not preflight.shards_by_worker(Replays())


def test_samples_that_do_not_batch_are_refused_naming_both() -> None:
    class Ragged(Plain):
        def __getitem__(self, i: int) -> torch.Tensor:
            return torch.zeros(i + 1)

    with pytest.raises(ConfigurationError, match=r"cannot be batched by default_collate"):
        preflight.check_collates(Ragged(), 4, 2)
