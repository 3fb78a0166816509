"""Attention in float32 while a bfloat16-autocast step trains on a CPU.

Under CPU autocast, SDPA runs in bfloat16, and torch's CPU flash-attention backward is then about twice as slow
as in float32 (docs/design/decisions.md); float32 is also the more precise of the two. So while the loop trains with
bfloat16 autocast on a CPU, the model's attention casts its inputs up, runs with autocast off, and hands back
its output in the dtype it came in.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

FLOAT32_SDPA = "skillpool_sdpa_float32"


def _float32_sdpa(
    module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *args: Any, **kw: Any
) -> Any:
    with torch.autocast(query.device.type, enabled=False):
        f = torch.float32
        out, weights = sdpa_attention_forward(module, query.to(f), key.to(f), value.to(f), *args, **kw)
    return out.to(query.dtype), weights


AttentionInterface.register(FLOAT32_SDPA, _float32_sdpa)
AttentionMaskInterface.register(FLOAT32_SDPA, sdpa_mask)


@contextmanager
def float32_attention(model: Any, on: bool) -> Iterator[None]:
    """The HF model attends with FLOAT32_SDPA while the block holds (if `on` and it uses SDPA), as it came after."""
    before = getattr(model.config, "_attn_implementation", None)
    if not on or before != "sdpa":  # eager or a kernel of the caller's choice: not the loop's to change
        yield
        return
    model.set_attn_implementation(FLOAT32_SDPA)
    try:
        yield
    finally:
        model.set_attn_implementation(before)
