"""An epoch's items: the :class:`Feed` drawn lazily from the loader's own sampler, and the
:class:`FeedSampler` an inner loader takes its share of them through (NOTE [ Epochs and stretches ] in
epochs.py)."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from typing import Any

import torch.utils.data as tud


class Feed:
    """The epoch's items, drawn lazily from the sampler; items given back come out first.

    Inner loaders take items ahead of the user (their workers prefetch) but never past the
    sampler's length: the draw that tells a sampler's end (a RandomSampler draws once more there)
    happens only when the user asks for an item after the last (:meth:`drained`), as with torch.
    """

    def __init__(self, source: Iterator[Any], length: int | None = None) -> None:
        self._source = source
        self._length = length
        self._pulled = 0
        self._back: collections.deque[Any] = collections.deque()
        self._ended = False

    def take(self) -> Any:
        if self._back:
            return self._back.popleft()
        if self._ended or (self._length is not None and self._pulled >= self._length):
            raise StopIteration
        return self._pull()

    def _pull(self) -> Any:
        try:
            item = next(self._source)
        except StopIteration:
            self._ended = True
            raise
        self._pulled += 1
        return item

    def has_more(self) -> bool:
        """Whether items are known to be left, without drawing from the sampler (``False`` where the
        sampler has no length and only a draw could tell)."""
        return bool(self._back) or (not self._ended and self._length is not None
                                    and self._pulled < self._length)

    def exhausted(self) -> bool:
        """Whether every item the sampler's length promises was taken and none given back (the
        sampler may still yield more past its length: :meth:`drained` tells)."""
        return not self._back and (self._ended or (self._length is not None and self._pulled >= self._length))

    def untouched(self) -> bool:
        """Whether no item has left it yet (those drawn ahead by :meth:`prime` are back)."""
        return self._pulled == len(self._back)

    def give_back(self, items: list[Any]) -> None:
        self._back.extendleft(reversed(items))

    def prime(self, n: int) -> None:
        """Draw ``n`` items now, as torch's worker iterator does when it starts."""
        drawn = []
        for _ in range(n):
            try:
                drawn.append(self.take())
            except StopIteration:
                break
        self.give_back(drawn)

    def drained(self) -> bool:
        """Whether the epoch has no item left; asked when the user wants the next item, so it may
        draw from the sampler as torch's own ``next()`` would (past the length, its end)."""
        if self._back:
            return False
        if not self._ended:
            try:
                self._back.append(self._pull())
            except StopIteration:
                return True
            if self._length is not None and self._pulled > self._length:
                # The sampler yields more than its __len__ says: its own end decides, as in torch.
                self._length = None
        return not self._back


class FeedSampler(tud.Sampler[Any]):
    """An inner loader's sampler: up to ``limit`` items of the feed, each recorded as taken.

    A persistent inner loader keeps its sampler across epochs: each epoch points ``feed`` at its own.
    Its iterator stops at ``limit`` and goes on where the limit is raised later (a stretch that
    continues on the same inner loader: NOTE [ Continuing a stretch ] in epochs.py).
    """

    def __init__(self, feed: Feed | None, limit: int | None = None) -> None:
        self.feed = feed
        self.limit = limit
        self.taken: list[Any] = []

    def __iter__(self) -> Iterator[Any]:
        self.taken = []
        return _Taking(self)

    def __len__(self) -> int:
        if self.limit is None:
            raise TypeError("a stretch of an epoch has no length of its own")
        return self.limit

    def at_limit(self) -> bool:
        """Whether it took as many items as its limit allows (never, without a limit)."""
        return self.limit is not None and len(self.taken) >= self.limit


class _Taking:
    """One pass of a :class:`FeedSampler`: each ``next()`` takes an item from the feed while the
    sampler is under its limit. Not a generator: one that stopped at the limit resumes once the limit
    is raised, where a generator would have ended for good."""

    def __init__(self, sampler: FeedSampler) -> None:
        self._sampler = sampler

    def __iter__(self) -> _Taking:
        return self

    def __next__(self) -> Any:
        s = self._sampler
        if s.feed is None or s.at_limit():
            raise StopIteration
        item = s.feed.take()  # StopIteration at the epoch's end
        s.taken.append(item)
        return item
