"""Per-request mixes to per-token (slot, weight) tables, in the process that runs the model (no vLLM imports).

A request's mix arrives as `SamplingParams.extra_args[MIX_KEY]` = [[lora_int_id, weight], ...]; the worker
keeps it by request id until the request finishes, and each step turns the batch's rows into `idx[T, K]`
(slot, −1 padding) and `w[T, K]` (float32, 0 padding) in the row order vLLM built its LoRA mapping with.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

MIX_KEY = "skillpool_mix"
MAX_K = 16  # pairs per request; the engine refuses more than its slots long before this

Pairs = tuple[tuple[int, float], ...]


def parse_mix(extra_args: Mapping[str, Any] | None) -> Pairs | None:
    """The request's [(lora_int_id, weight)] or None; anything malformed is an error, not a silent base row."""
    if not extra_args or MIX_KEY not in extra_args:
        return None
    raw = extra_args[MIX_KEY]
    if not isinstance(raw, (list, tuple)) or len(raw) > MAX_K:
        raise ValueError(f"{MIX_KEY} must be a list of at most {MAX_K} [lora_int_id, weight] pairs")
    pairs = []
    for item in raw:
        if not isinstance(item, (list, tuple)) or len(item) != 2:
            raise ValueError(f"{MIX_KEY} entries must be [lora_int_id, weight], got {item!r}")
        lid, w = item
        if isinstance(lid, bool) or not isinstance(lid, int) or lid <= 0:
            raise ValueError(f"{MIX_KEY}: lora_int_id must be a positive int, got {lid!r}")
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w):
            raise ValueError(f"{MIX_KEY}: weight must be a finite number, got {w!r}")
        pairs.append((lid, float(w)))
    return tuple(pairs)


def token_tables(
    req_ids: Sequence[str],
    num_tokens: Sequence[int],
    token_lora_ids: Sequence[int],
    mixes: Mapping[str, Pairs],
    slot_of: Mapping[int, int],
) -> tuple[np.ndarray, np.ndarray]:
    """idx/w for the batch's tokens. Rows without a mix keep vLLM's single adapter (the token mapping's id,
    weight 1); id 0 is a base row, which gets no slot (vLLM's CPU ops would give it the last slot's)."""
    total = int(sum(int(n) for n in num_tokens))
    if len(token_lora_ids) != total:
        raise ValueError(f"token mapping has {len(token_lora_ids)} entries, the rows schedule {total}")
    k = max([len(mixes[r]) for r in req_ids if r in mixes] + [1])
    idx = np.full((total, k), -1, dtype=np.int32)
    w = np.zeros((total, k), dtype=np.float32)
    start = 0
    for rid, n in zip(req_ids, num_tokens, strict=True):
        n = int(n)
        pairs = mixes.get(rid)
        if pairs is None:
            lid = int(token_lora_ids[start]) if n else 0
            pairs = ((lid, 1.0),) if lid > 0 else ()
        for j, (lid, weight) in enumerate(pairs):
            if lid not in slot_of:
                raise RuntimeError(f"request {rid}: LoRA id {lid} is not resident in vLLM's slots")
            idx[start : start + n, j] = slot_of[lid]
            w[start : start + n, j] = weight
        start += n
    return idx, w
