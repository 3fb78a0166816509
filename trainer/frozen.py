"""The frozen base's linear weights held in the compute dtype while a bfloat16-autocast run trains.

Autocast keeps a cast of a weight only for leaf tensors that require grad: the frozen base's float32 weights (most
of the model) are cast to bfloat16 anew in every forward, and again where a layer recomputes in backward. Holding
each frozen linear weight as a bfloat16 copy for the run does that cast once, and the products are the same: the
cast autocast would have made is that copy. LoRA factors, norms, embeddings and the output projection (tied to the
embeddings, and run in float32 by the loss) stay as they are; the float32 weights come back when the run ends, so a
forward outside the run sees the model it loaded.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn


@contextmanager
def frozen_linears_in(model: Any, dtype: torch.dtype, on: bool) -> Iterator[int]:
    """While the block holds (if `on`), every float32 `nn.Linear` weight of the HF `model` that does not require
    grad is a `dtype` copy; yields how many were swapped."""
    if not on:
        yield 0
        return
    head = model.get_output_embeddings()
    swapped: list[tuple[nn.Linear, torch.Tensor]] = []
    try:
        with torch.no_grad():
            for module in model.modules():
                if not isinstance(module, nn.Linear) or module is head:
                    continue
                weight = module.weight
                if weight.requires_grad or weight.dtype != torch.float32:
                    continue
                module.weight = nn.Parameter(weight.to(dtype), requires_grad=False)
                swapped.append((module, weight))
        yield len(swapped)
    finally:
        for module, weight in swapped:
            module.weight = weight
