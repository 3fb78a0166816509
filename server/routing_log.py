"""What the console's routing view reads, kept in memory and bounded: the `auto` requests routed per second and
per minute (by the heaviest skill of their route; none = a fallback to the base model), and the probe accuracy
of each time the pool's routing was measured, with the confusion between skills of the last measurement.

Nothing here holds request text: every role may read it (server.console_api).
"""

from __future__ import annotations

import math
import threading
import time
from collections import Counter, deque
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from skillpool.router import Decision

BASE = "base"  # the confusion matrix's column (and row) for the base model: a fallback
WINDOW_MIN_S, WINDOW_MAX_S, WINDOW_DEFAULT_S = 60, 86_400, 3_600
BUCKETS = 12  # a window is shown as this many buckets, oldest first
FINE_S, FINE_UPTO_S = 1, 720  # windows up to 12 minutes are counted to the second (buckets of at least 5 s) ...
COARSE_S = 60  # ... longer ones to the minute (buckets of more than 60 s)
HISTORY = 256  # probe measurements kept: one per change of the pool


@dataclass
class _Slot:
    n: int  # the slot's number: its start time // its width
    requests: int = 0
    fallbacks: int = 0
    skills: Counter[str] = field(default_factory=Counter)


class _Ring:
    """The newest `size` slots of `width` seconds that saw a request; older ones fall off."""

    def __init__(self, width: int, size: int) -> None:
        self.width = width
        self.slots: deque[_Slot] = deque(maxlen=size)

    def add(self, t: float, skill: str | None) -> None:
        n = int(t // self.width)
        if not self.slots or n > self.slots[-1].n:
            self.slots.append(_Slot(n))
        slot = self.slots[-1]  # a clock stepped back counts in the newest slot: never out of order
        slot.requests += 1
        if skill is None:
            slot.fallbacks += 1
        else:
            slot.skills[skill] += 1

    def between(self, t0: float, t1: float) -> Iterator[tuple[int, _Slot]]:
        """(start time, slot) of the slots that start in [t0, t1)."""
        for slot in self.slots:
            start = slot.n * self.width
            if t0 <= start < t1:
                yield start, slot


class RoutingLog:
    """Routed requests over the last day, for shares and fallbacks per window. Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # room for the longest window of each resolution plus one bucket of alignment
        self._fine = _Ring(FINE_S, (FINE_UPTO_S + FINE_UPTO_S // BUCKETS) // FINE_S + 2)
        self._coarse = _Ring(COARSE_S, (WINDOW_MAX_S + WINDOW_MAX_S // BUCKETS) // COARSE_S + 2)

    def record(self, d: Decision, t: float | None = None) -> None:
        """One `auto` request's route: its heaviest skill, or a fallback when the base model serves it."""
        t = time.time() if t is None else t
        skill = d.route[0][0] if d.route else None  # routes are sorted heaviest first
        with self._lock:
            self._fine.add(t, skill)
            self._coarse.add(t, skill)

    def slots(self) -> int:
        """How many slots are held (bounded whatever the traffic)."""
        return len(self._fine.slots) + len(self._coarse.slots)

    def window(self, seconds: int, served: Sequence[str] = (), now: float | None = None) -> dict[str, Any]:
        """The last `seconds` in BUCKETS buckets of seconds/BUCKETS, aligned so that a bucket keeps its start
        from one call to the next; `served` skills are listed even without a request."""
        if not WINDOW_MIN_S <= seconds <= WINDOW_MAX_S:
            raise ValueError(f"window must be {WINDOW_MIN_S} to {WINDOW_MAX_S} seconds, not {seconds}")
        now = time.time() if now is None else now
        width = seconds / BUCKETS
        end = (math.floor(now / width) + 1) * width  # the end of the bucket that holds now
        start = end - seconds
        ring = self._fine if seconds <= FINE_UPTO_S else self._coarse
        buckets = [{"start": round(start + i * width, 3), "requests": 0, "fallbacks": 0} for i in range(BUCKETS)]
        skills: Counter[str] = Counter({name: 0 for name in served})
        with self._lock:
            for t, slot in ring.between(start, end):
                b = buckets[min(BUCKETS - 1, int((t - start) // width))]
                b["requests"] += slot.requests
                b["fallbacks"] += slot.fallbacks
                skills.update(slot.skills)
        requests = sum(b["requests"] for b in buckets)
        fallbacks = sum(b["fallbacks"] for b in buckets)
        return {
            "window": seconds,
            "requests": requests,
            "fallbacks": fallbacks,
            "fallback_share": fallbacks / requests if requests else 0.0,
            "skills": [
                {"skill": name, "requests": n, "share": n / requests if requests else 0.0}
                for name, n in sorted(skills.items(), key=lambda kv: (-kv[1], kv[0]))
            ],
            "buckets": buckets,
        }


class ProbeHistory:
    """Probe accuracy each time it is measured (server.skills.SkillPool.measure_routing) and the last
    measurement's confusion: rows the skill whose probe it was, columns where the router sent it (top-1)."""

    def __init__(self, size: int = HISTORY) -> None:
        self._lock = threading.Lock()
        self._history: deque[dict[str, Any]] = deque(maxlen=size)
        self._skills: dict[str, float] = {}
        self._labels: list[str] = [BASE]
        self._matrix: list[list[int]] = [[0]]

    def record(
        self, accuracy: Mapping[str, float], confusion: Mapping[str, Mapping[str, int]], skills: Sequence[str], t: float
    ) -> None:
        """`skills`: every served skill, in the order shown (with or without probes); `confusion`: probe skill ->
        top-1 skill (or BASE) -> count."""
        labels = [*skills, BASE]
        matrix = [[int(confusion.get(row, {}).get(col, 0)) for col in labels] for row in labels]
        entry = {"t": t, "mean": _mean(accuracy), "skills": dict(accuracy)} if accuracy else None
        with self._lock:
            self._skills, self._labels, self._matrix = dict(accuracy), labels, matrix
            if entry is not None:  # an empty pool has no accuracy to plot
                self._history.append(entry)

    def accuracy(self) -> dict[str, Any]:
        with self._lock:
            return {
                "skills": dict(self._skills),
                "mean": _mean(self._skills) if self._skills else None,
                "history": list(self._history),
            }

    def confusion(self) -> dict[str, Any]:
        with self._lock:
            return {"source": "probes", "labels": list(self._labels), "matrix": [list(r) for r in self._matrix]}


def _mean(values: Mapping[str, float]) -> float:
    return sum(values.values()) / len(values)
