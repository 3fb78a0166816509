"""A seeded family of JSON schemas for structured-output tests: nested objects, enums, arrays with bounds, integers
with bounds, short strings, booleans, every property required and no others allowed. Every schema is bounded (no
unbounded string or array), so any model, even a random one, ends its answer within a few hundred tokens."""

from __future__ import annotations

import random
from typing import Any

WORDS = ["alpha", "bravo", "city", "delta", "echo", "fox", "gold", "hotel", "ink", "jade", "kilo", "lime"]


def schema_family(seed: int, n: int, max_depth: int = 3) -> list[dict[str, Any]]:
    """n object schemas drawn with `seed`."""
    rng = random.Random(seed)

    def node(depth: int) -> dict[str, Any]:
        kinds = ["integer", "enum", "string", "boolean", "array"] + (["object"] if depth < max_depth else [])
        kind = rng.choice(kinds)
        if kind == "integer":
            low = rng.randint(-50, 50)
            return {"type": "integer", "minimum": low, "maximum": low + rng.randint(0, 500)}
        if kind == "enum":
            return {"type": "string", "enum": rng.sample(WORDS, rng.randint(1, 4))}
        if kind == "string":
            least = rng.randint(0, 3)
            return {"type": "string", "minLength": least, "maxLength": least + rng.randint(1, 10)}
        if kind == "boolean":
            return {"type": "boolean"}
        if kind == "array":
            least = rng.randint(0, 2)
            return {"type": "array", "items": node(depth + 1), "minItems": least, "maxItems": least + rng.randint(1, 2)}
        return obj(depth + 1)

    def obj(depth: int) -> dict[str, Any]:
        props = {f"{rng.choice(WORDS)}_{i}": node(depth) for i in range(rng.randint(1, 4))}
        return {"type": "object", "properties": props, "required": list(props), "additionalProperties": False}

    return [obj(1) for _ in range(n)]
