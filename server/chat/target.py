"""What a chat request's `model` asks for: routing ('auto'), the base model, one skill, or an explicit mix."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from skillpool.lora.mix import Mix

from ..errors import APIError
from ..routing import Target

if TYPE_CHECKING:
    from ..components import Components

# Weights are relative; a bound keeps their sum finite (1e308 twice overflowed to inf, and inf/inf is NaN).
MAX_MIX_WEIGHT = 1e6


def resolve_target(c: Components, model: str) -> Target:
    """'auto' routes; the base model id (or 'base') means no adapter; a skill name (or a fine-tuning job's
    fine_tuned_model id) forces that skill;
    'skill=weight,skill=weight' forces that mix (weights renormalized)."""
    if model == "auto":
        return "auto"
    if model in (c.base.model_id, "base"):
        return "base"
    if (skill := c.pool.resolve(model)) is not None:  # a skill name or its fine_tuned_model id
        return skill
    if "=" in model:
        return explicit_mix(c, model)
    raise APIError(
        404,
        f"The model '{model}' does not exist (use 'auto', '{c.base.model_id}' or a skill name)",
        "model",
        "model_not_found",
    )


def explicit_mix(c: Components, model: str) -> Mix:
    mix: dict[str, float] = {}
    for part in model.split(","):
        name, _, raw = part.partition("=")
        try:
            w = float(raw)
        except ValueError:
            w = math.nan
        if not math.isfinite(w) or w <= 0 or w > MAX_MIX_WEIGHT:
            raise APIError(
                400,
                f"mix weight for {name!r} must be a number in (0, {MAX_MIX_WEIGHT:g}], got {raw!r}",
                "model",
                "invalid_value",
            )
        if c.pool.get(name) is None:
            raise APIError(404, f"The model '{name}' in the mix does not exist", "model", "model_not_found")
        mix[name] = mix.get(name, 0.0) + w
    cap = c.cfg.serving.max_loaded_skills
    if cap is not None and len(mix) > cap:
        raise APIError(
            400, f"the mix names {len(mix)} skills; this server keeps {cap} loaded", "model", "invalid_value"
        )
    return Mix.of(mix)  # renormalized; responses list it heaviest first, ties as written
