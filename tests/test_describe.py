"""Describing samples and values for messages and profile keys: structure, never values."""

from __future__ import annotations

import json
import math

import numpy as np
import torch
from PIL import Image

from autotune.describe import (
    dataset_length,
    describe_sample,
    jsonable,
    qualname,
    sample_text,
    strip_addresses,
)


def test_a_sample_is_described_by_its_structure_not_its_values() -> None:
    a = (torch.zeros(3, 32, 32), 7)
    b = (torch.ones(3, 32, 32), 2)
    assert describe_sample(a) == describe_sample(b)  # labels and pixels differ per sample
    assert describe_sample(a) != describe_sample((torch.zeros(3, 16, 16), 7))
    assert sample_text(a) == "(tensor[3, 32, 32] float32, int)"


def test_arrays_images_dicts_and_deep_nesting() -> None:
    d = describe_sample({"img": Image.new("RGB", (5, 4)), "x": np.zeros((2, 3), dtype=np.uint8)})
    assert d["items"]["img"] == {"type": "PIL.Image", "size": [5, 4], "mode": "RGB"}
    assert d["items"]["x"] == {"type": "ndarray", "shape": [2, 3], "dtype": "uint8"}
    deep: object = 1
    for _ in range(20):
        deep = [deep]
    assert json.dumps(describe_sample(deep))  # bounded depth, still plain JSON
    assert describe_sample(list(range(100))) == {"type": "list", "len": 100}  # long: only its length


def test_jsonable_is_the_same_in_every_process() -> None:
    class Thing:
        pass

    value = {"b": {3, 1, 2}, "a": (1.5, math.inf), "f": len, "o": Thing()}
    out = jsonable(value)
    assert list(out) == ["a", "b", "f", "o"]
    assert out["a"] == [1.5, None] and out["b"] == [1, 2, 3] and out["f"] == "builtins.len"
    assert "0x" not in out["o"]  # no memory address in a key that must match across processes
    assert strip_addresses("<Thing object at 0x7f00deadbeef>") == "<Thing object>"
    assert qualname(Thing).endswith("test_jsonable_is_the_same_in_every_process.<locals>.Thing")


def test_dataset_length_is_none_without_a_length() -> None:
    class Stream:
        def __iter__(self):  # noqa: ANN204 - a minimal stream
            yield 1

    assert dataset_length([1, 2, 3]) == 3 and dataset_length(Stream()) is None

