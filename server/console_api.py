"""The console's read-only endpoints: who the key is and what it may do, the pool's routing share and fallbacks
per time window, probe accuracy over time, and the confusion between skills (server.routing_log).

None of them shows request text, so every role may read them (server.auth); a wrong key is the middleware's 401.
"""

from __future__ import annotations

import re
from typing import Any

from fastapi import APIRouter, Request

from .auth import KeyRing, principal_of
from .components import components
from .errors import APIError
from .metrics import Metrics
from .routing_log import WINDOW_DEFAULT_S, WINDOW_MAX_S, WINDOW_MIN_S

api = APIRouter(prefix="/v1/skillpool")
_DIGITS = re.compile(r"[0-9]{1,6}")  # a plain integer of at most six digits: no sign, exponent or space


@api.get("/whoami")
async def whoami(request: Request) -> dict[str, Any]:
    """The caller's key name and role and the actions it allows (the console shows only those)."""
    keys: KeyRing = request.app.state.keys
    p = principal_of(request)
    admin = p.can("admin")
    return {
        "name": p.name,
        "role": p.role,
        "keys_configured": bool(keys.keys),
        "can": {"retire": admin, "rollback": admin, "train": p.can("train"), "fallback_clusters": admin},
    }


@api.get("/routing")
async def routing(request: Request, window: str | None = None) -> dict[str, Any]:
    """Routed `auto` requests of the last `window` seconds: per skill, the fallbacks, and 12 buckets."""
    c = components(request)
    seconds = WINDOW_DEFAULT_S if window is None else _window(window)
    return c.routing_log.window(seconds, [rec.name for rec in c.pool.records()])


@api.get("/routing/accuracy")
async def routing_accuracy(request: Request) -> dict[str, Any]:
    """Probe accuracy per skill, its history (one point per change of the pool), and labelled traffic."""
    c = components(request)
    return {**c.pool.probes.accuracy(), "labelled": _labelled(c.metrics)}


@api.get("/routing/confusion")
async def routing_confusion(request: Request) -> dict[str, Any]:
    """Where each skill's probe prompts were routed at the last measurement (top-1; "base" = fallback)."""
    return components(request).pool.probes.confusion()


def _window(raw: str) -> int:
    seconds = int(raw) if _DIGITS.fullmatch(raw) else None
    if seconds is None or not WINDOW_MIN_S <= seconds <= WINDOW_MAX_S:
        raise APIError(
            400,
            f"window must be a whole number of seconds from {WINDOW_MIN_S} to {WINDOW_MAX_S}, got {raw[:32]!r}",
            "window",
            "invalid_value",
        )
    return seconds


def _labelled(m: Metrics) -> dict[str, int] | None:
    """`auto` requests that named the skill they expect (metadata.expected_skill), since the server started;
    None when none did."""
    requests = correct = 0
    for family in m.labelled.collect():
        for sample in family.samples:
            if sample.name.endswith("_total"):
                requests += int(sample.value)
                correct += int(sample.value) if sample.labels.get("correct") == "true" else 0
    return {"requests": requests, "correct": correct} if requests else None
