"""A process that fills or reads a node cache, for tests/test_pretransform_node.py.

    python tests/node_fill.py MODE DATASET [SEED]

MODE: ``epoch`` (one shuffled epoch of the cache with two worker processes, and the same epoch of
torch's DataLoader over the dataset itself), ``forever`` (epochs until killed, printing ``filling``
once the first batches came), ``dropin`` (two epochs of autotune.DataLoader and of torch's). Prints
one JSON line: the cache's fill counts before and after, and hashes of the batches.
DATASET: ``cifar`` (fixed-shape samples, a random rest per sample), ``plain`` (the same, deterministic:
the whole sample cached) or ``ragged`` (tensors of their own
sizes, about 1 MB each, so that a write takes a while).
"""

from __future__ import annotations

import hashlib
import json
import sys
import time
from typing import Any

import torch
import torchvision.transforms as T
import torchvision.transforms.v2 as v2
from torch.utils.data import DataLoader, Dataset

from autotune import pretransform as pt
from autotune.workloads import CIFAR_MEAN, CIFAR_STD, CIFAR10Like, cifar_train_transform


class Ragged(Dataset[Any]):
    """uint8 CHW tensors of their own sizes, made from a seed, cached as floats of about 1.4 MB each,
    with a random crop and flip per sample."""

    def __init__(self, n: int = 160) -> None:
        gen = torch.Generator().manual_seed(0)
        self.sizes = [(3, 300 + i % 7, 400 - i % 5) for i in range(n)]
        self.seeds = torch.randint(0, 2**31, (n,), generator=gen).tolist()
        self.transform = v2.Compose(
            [v2.ToDtype(torch.float32, scale=True), v2.RandomCrop(256), v2.RandomHorizontalFlip()])

    def __len__(self) -> int:
        return len(self.sizes)

    def __getitem__(self, index: int) -> Any:
        gen = torch.Generator().manual_seed(self.seeds[index])
        img = torch.randint(0, 256, self.sizes[index], dtype=torch.uint8, generator=gen)
        return (self.transform(img) if self.transform is not None else img), index


def make(name: str) -> Any:
    if name == "cifar":
        return CIFAR10Like(512, transform=cifar_train_transform())
    if name == "plain":  # deterministic: every loader gives the same batches, however it reads them
        return CIFAR10Like(512, transform=T.Compose([T.ToTensor(), T.Normalize(CIFAR_MEAN, CIFAR_STD)]))
    from node_fill import Ragged as Importable  # named as the tests name it, not as __main__'s

    return Importable()


def digest(batches: Any) -> str:
    h = hashlib.sha256()
    for batch in batches:
        for t in batch:
            h.update(t.contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def epoch(dataset: Any, collate: Any, seed: int, workers: int = 2) -> Any:
    torch.manual_seed(seed)
    loader = DataLoader(dataset, batch_size=8, shuffle=True, num_workers=workers, collate_fn=collate,
                        generator=torch.Generator().manual_seed(seed))
    yield from loader


def counts(prepared: Any) -> list[int]:
    c = prepared.fill_counts()
    return [c.filled, c.total]


def main() -> None:
    mode, name = sys.argv[1], sys.argv[2]
    seed = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    ds = make(name)
    if mode == "dropin":
        import autotune

        loader = autotune.DataLoader(ds, batch_size=8, shuffle=True,
                                     generator=torch.Generator().manual_seed(seed))
        before = [(e.filled, e.total) for e in pt.node.entries()]
        ours, theirs = [], []
        for e in range(2):
            torch.manual_seed(seed + e)
            ours.append(digest(list(loader)))
        torch_loader = DataLoader(ds, batch_size=8, shuffle=True,
                                  generator=torch.Generator().manual_seed(seed))
        for e in range(2):
            torch.manual_seed(seed + e)
            theirs.append(digest(list(torch_loader)))
        after = [(e.filled, e.total) for e in pt.node.entries()]
        print(json.dumps({"before": before, "after": after, "ours": ours, "torch": theirs}))
        return
    prepared = pt.prepare(ds, "ram", device=torch.device("cpu"), fill="pass")
    node = prepared.dataset.filler.node
    start = counts(prepared)
    if mode == "forever":
        while True:
            for k, _ in enumerate(epoch(prepared.dataset, prepared.collate_fn, seed)):
                if k == 2:
                    print("filling", flush=True)
            time.sleep(0.01)
    ours = digest(epoch(prepared.dataset, prepared.collate_fn, seed))
    theirs = digest(epoch(ds, None, seed))
    print(json.dumps({"before": start, "after": counts(prepared), "ours": ours, "torch": theirs,
                      "node": node.path if node is not None else None}))


if __name__ == "__main__":
    main()
