"""Where the per-sample transform runs: ``none`` (per sample, in the workers), ``ram``, ``device``.

Interface used by the rest of the package (keep these names and shapes):

- ``STRATEGIES``: the strategy names, ``("none", "ram", "device")``.
- ``strategies(dataset, *, cuda, memory_budget_bytes, device_memory_budget_bytes) -> dict[str, str|None]``
  every strategy name mapped to ``None`` when usable for this dataset, or the reason it is refused.
- ``prepare(dataset, strategy, *, device, memory_budget_bytes=None, progress=None) -> Prepared``: the
  wrapped dataset (built once per process and dataset, rebuilt when what it froze changed), the
  collate function to use with it, the build time and the cache size. A ``ram`` build stops above
  ``memory_budget_bytes`` (None: no ceiling): the caller passes the budget it checked with
  ``strategies``.
- ``prepare(..., fill="pass")`` (``ram`` only): the cache allocated and returned at once, filled by
  the pass that loads the samples (NOTE [ Filling caches ] in filling.py);
  ``Prepared.fill_counts() -> FillCounts`` and ``Prepared.filled_fraction() -> float`` say how far.
- ``Prepared.loader_parts(collate_fn) -> (dataset, collate_fn)``: what to hand to a DataLoader, with
  or without the user's own collate function; ``Prepared.gathers_batches(collate_fn) -> bool``: whether
  each batch is then one gather, with nothing left to run per sample.
- ``Prepared.stale_reason() -> str | None`` and ``Prepared.check_fresh() -> bool``: whether the cache
  still matches the dataset (cheap; call at each epoch start), see NOTE [ Fresh caches ] in fresh.py.
- ``estimate_build_s(dataset) -> float | None``: seconds a cache build would take.
- ``shm_bytes(dataset) -> int``: bytes a ``ram`` cache would take from /dev/shm when built (0 when it
  would be kept in private memory, see NOTE [ Shared memory ] in ``autotune/shm.py``).
- ``clear_builds()``: drop every stored plan and cache.
- ``holds_cuda_tensors(dataset) -> bool``: samples already live on an accelerator (no workers then).

The parts: ``choose.py`` (the interface above), ``split.py`` (a :class:`CachePlan` for a dataset:
planning and proof), ``build.py`` (a cache built from a plan), ``filling.py`` (a cache filled by the
pass that loads the samples), ``reuse.py`` (plans and builds kept per dataset), ``steps.py`` (what is
known about transform steps, and the steps that run per sample), ``stores.py`` (fixed-shape and
ragged storage), ``sources.py`` (raw-source adapters: vision datasets, image folders, Hugging Face
tables), ``wrapped.py`` (the datasets handed to the DataLoader), ``fresh.py`` (fingerprints of what a
cache froze).

# NOTE [ Pre-transform split ]
# A sample is ``transform(raw)`` (plus untouched fields such as the target). The transform pipeline
# (a torchvision ``Compose``, v1 or v2, or one transform) is split into a deterministic prefix, applied
# once per sample when the cache is built, and a random suffix, applied per sample per epoch as before.
#
# 1. Leading prefix: steps from the start while each is known to be deterministic (ToTensor, Normalize,
#    Resize, ...) or proven so: applied to the probe samples under several RNG states, its outputs are
#    identical. A step named Random*, or otherwise known to be random, is never probed and never frozen.
# 2. Reordering: after the first random step, a run of random steps that only *select* pixels (flips,
#    RandomCrop) commutes exactly with later per-pixel steps (ToTensor, ToDtype, ConvertImageDtype,
#    Normalize): selecting then mapping each pixel equals mapping every pixel then selecting. Those
#    per-pixel steps are moved into the prefix. RandomCrop's padding is not a selection: it becomes its
#    own per-sample step in the mapped space, with the constant fill mapped through the moved steps
#    (fill=0 followed by ToTensor and Normalize pads with (0 - mean) / std per channel), and the crop
#    runs unpadded on the padded image. The crop draws its offsets from the same image size with the
#    same RNG calls, so under one seed the output is the original's, value for value.
# 3. Decoded samples: when the raw read itself is the cost (a file decoded: an ImageFolder's loader, a
#    Hugging Face ``Image`` column, or a raw read that takes a large share of a sample's time), an
#    empty prefix is a plan too: the decoded samples are cached as they are (uint8 pixels, each image
#    its own size, stored ragged) and the whole transform runs per sample on them, receiving the same
#    type as before (a PIL image, a tensor, an array).
# 4. Proof: every plan is checked before use. The wrapped dataset built from the probe samples must
#    return exactly ``dataset[i]`` (and, without a suffix, exactly the default-collated batch) under
#    the same seed. A reordered plan that fails falls back to the plain prefix, which falls back to
#    caching whole samples (only if ``dataset[i]`` itself is proven deterministic), which falls back to
#    a refusal. Nothing is ever cached on an unproven claim.
# The proof is only as good as its probes: hidden randomness that rarely shows (say, one call in a
# thousand), or that draws from outside Python's, NumPy's and torch's RNGs, can escape it.
"""

from .build import Prepared
from .choose import (
    FILLS,
    STRATEGIES,
    estimate_build_s,
    holds_cuda_tensors,
    prepare,
    shm_bytes,
    strategies,
)
from .filling import FillCounts
from .reuse import clear_builds
from .sources import reads_alike_anywhere

__all__ = [
    "FILLS",
    "FillCounts",
    "Prepared",
    "STRATEGIES",
    "clear_builds",
    "estimate_build_s",
    "holds_cuda_tensors",
    "prepare",
    "reads_alike_anywhere",
    "shm_bytes",
    "strategies",
]
