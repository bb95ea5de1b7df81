"""What the pre-transform knows about transform steps, and the per-sample steps a plan makes.

Which torchvision steps are deterministic, which only select pixels, which map each pixel on its own
(see NOTE [ Pre-transform split ] in ``__init__.py``), and the picklable steps that run per sample
in the workers: the random suffix, and RandomCrop's padding moved into the mapped space.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

DETERMINISTIC = frozenset(
    {
        "ToTensor",
        "PILToTensor",
        "ToImage",
        "ToDtype",
        "ConvertImageDtype",
        "Normalize",
        "Resize",
        "CenterCrop",
        "Grayscale",
        "Pad",
        "ToPureTensor",
    }
)
"""torchvision steps whose output depends on their input only."""

PER_PIXEL = frozenset(
    {"ToTensor", "PILToTensor", "ToImage", "ToDtype", "ConvertImageDtype", "Normalize", "ToPureTensor"}
)
"""Deterministic steps that map each pixel on its own: they commute with selecting pixels."""

SELECTING = frozenset({"RandomHorizontalFlip", "RandomVerticalFlip", "RandomCrop"})
"""Random steps that only select (and move) pixels: they commute with per-pixel steps."""

RANDOM = frozenset(
    {
        "ColorJitter",
        "GaussianBlur",
        "GaussianNoise",
        "AutoAugment",
        "RandAugment",
        "TrivialAugmentWide",
        "AugMix",
        "ElasticTransform",
        "MixUp",
        "CutMix",
        "JPEG",
    }
)
"""torchvision steps that are random without a Random* name."""


def step_name(step: Any) -> str:
    return type(step).__name__


def is_torchvision(step: Any) -> bool:
    # Exact torchvision classes only: a user's subclass may add randomness, so it gets probed.
    return type(step).__module__.startswith("torchvision.transforms")


def known_random(step: Any) -> bool:
    name = step_name(step)
    return name.startswith("Random") or (is_torchvision(step) and name in RANDOM)


def apply_steps(steps: Sequence[Callable[[Any], Any]], x: Any) -> Any:
    for step in steps:
        x = step(x)
    return x


class Chain:
    """The random suffix: steps applied in order (picklable, for worker processes)."""

    def __init__(self, steps: Sequence[Callable[[Any], Any]]) -> None:
        self.steps = tuple(steps)

    def __call__(self, x: Any) -> Any:
        return apply_steps(self.steps, x)

    def __repr__(self) -> str:
        return ", ".join(repr(s) if isinstance(s, (PadFill, PadMode)) else step_name(s) for s in self.steps)


class PadFill:
    """Constant padding in the mapped space: ``fill`` is the original fill mapped per channel."""

    def __init__(self, ltrb: tuple[int, int, int, int], fill: torch.Tensor) -> None:
        self.ltrb = ltrb
        self.fill = fill

    def __call__(self, img: torch.Tensor) -> torch.Tensor:
        left, top, right, bottom = self.ltrb
        *lead, h, w = img.shape
        out = torch.empty((*lead, h + top + bottom, w + left + right), dtype=img.dtype, device=img.device)
        out.copy_(self.fill.to(img.device, img.dtype).view(-1, 1, 1).expand_as(out))
        out[..., top : top + h, left : left + w] = img
        return out.as_subclass(type(img))

    def __repr__(self) -> str:
        return f"Pad({list(self.ltrb)}, fill={[round(float(v), 4) for v in self.fill]})"


class PadMode:
    """Reflect/edge/symmetric padding: copies pixel values, so it commutes with per-pixel steps."""

    def __init__(self, pad: Callable[..., Any], padding: list[int], mode: str) -> None:
        self.pad = pad
        self.padding = padding
        self.mode = mode

    def __call__(self, img: Any) -> Any:
        return self.pad(img, self.padding, padding_mode=self.mode)

    def __repr__(self) -> str:
        return f"Pad({self.padding}, {self.mode})"


def _ltrb(padding: Any) -> tuple[int, int, int, int]:
    """torchvision's padding argument (int, or 1, 2 or 4 values) as (left, top, right, bottom)."""
    if isinstance(padding, int):
        return (padding,) * 4
    p = [int(v) for v in padding]
    if len(p) == 1:
        return (p[0],) * 4
    if len(p) == 2:
        return (p[0], p[1], p[0], p[1])
    if len(p) == 4:
        return (p[0], p[1], p[2], p[3])
    raise ValueError(f"padding={padding!r}")


def unpadded_crop(step: Any, mapped_input: Any, moved_after: list[Any]) -> list[Any] | None:
    """``step`` (a RandomCrop) as [padding in the mapped space, the same crop unpadded], or None."""
    if step.pad_if_needed or isinstance(step.fill, dict):
        return None  # data-dependent padding, or per-type fills: not worth the risk, keep it as is
    crop = type(step)(step.size, padding=None, fill=step.fill, padding_mode=step.padding_mode)
    if step.padding is None:
        return [step]
    if "v2" in type(step).__module__:
        import torchvision.transforms.v2.functional as F2

        left, right, top, bottom = step.padding  # v2 stores [left, right, top, bottom]
        ltrb, pad = (left, top, right, bottom), F2.pad
    else:
        import torchvision.transforms.functional as F1

        ltrb, pad = _ltrb(step.padding), F1.pad
    if step.padding_mode != "constant":
        return [PadMode(pad, list(ltrb), step.padding_mode), crop]
    # One pixel of fill in the original space, carried through the moved steps, gives the fill to
    # use in the mapped space (bit for bit what those steps make of it).
    corner = apply_steps(moved_after, pad(mapped_input, [1], fill=step.fill, padding_mode="constant"))
    if not (isinstance(corner, torch.Tensor) and corner.dim() == 3):
        return None
    return [PadFill(ltrb, corner[:, 0, 0].clone()), crop]
