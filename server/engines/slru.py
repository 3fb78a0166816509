"""The order resident adapters leave in: a segmented LRU, so one pass over the pool's tail does not flush the skills
that are used again and again.

A skill enters on probation; a second use while it is still resident promotes it to the protected segment, which
holds at most `capacity` less a probation share. Victims come from probation first (least recently used first),
then from the protected segment. Under plain LRU every lookup of a rarely used skill takes the place of the least
recent one, however popular; with a Zipf-popular pool most lookups are of that kind, so the popular skills keep
leaving (load_tests/placement/bench_placement.py, `--gpu-tier`; its figures are in docs/benchmarks.md).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Hashable, Iterator
from typing import Generic, TypeVar

PROBATION = 0.1  # the share of the slots kept for skills used once since they came in
K = TypeVar("K", bound=Hashable)


class SegmentedLRU(Generic[K]):
    """Recency with two segments; the owner holds the entries and decides when to evict."""

    def __init__(self, capacity: int | None, probation: float = PROBATION) -> None:
        """`capacity` None: unbounded, nothing is ever protected (no order matters); `probation` in (0, 1]."""
        if not 0 < probation <= 1:
            raise ValueError(f"the probation share must be in (0, 1], not {probation}")
        if capacity is not None and capacity < 1:
            raise ValueError(f"capacity must be at least 1, not {capacity}")
        self.protected_max = 0 if capacity is None else capacity - max(1, math.ceil(probation * capacity))
        self._probation: OrderedDict[K, None] = OrderedDict()
        self._protected: OrderedDict[K, None] = OrderedDict()

    def __contains__(self, key: object) -> bool:
        return key in self._probation or key in self._protected

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __iter__(self) -> Iterator[K]:
        """The eviction order: probation, then protected, each least recently used first."""
        yield from list(self._probation)
        yield from list(self._protected)

    def touch(self, key: K) -> None:
        """A use of `key`: a new key goes on probation, one on probation is promoted, a protected one refreshed."""
        if key in self._protected:
            self._protected.move_to_end(key)
            return
        if key not in self._probation:
            self._probation[key] = None
            return
        del self._probation[key]
        if self.protected_max == 0:
            self._probation[key] = None
            return
        self._protected[key] = None
        while len(self._protected) > self.protected_max:  # the protected segment's least recent goes back on probation
            old, _ = self._protected.popitem(last=False)
            self._probation[old] = None

    def first(self) -> K | None:
        """The next to leave, if any (without copying the order)."""
        for segment in (self._probation, self._protected):
            for key in segment:
                return key
        return None

    def discard(self, key: K) -> None:
        self._probation.pop(key, None)
        self._protected.pop(key, None)

    def protected(self) -> list[K]:
        return list(self._protected)
