"""A weighted mix of LoRA skills written as ONE plain LoRA, for engines that take one adapter per request (vLLM).

For a mix [(adapter_i, w_i)], per module:  A = [A_1; ...; A_k]  (rank rows stacked),
B = [w_1·s_1·B_1, ..., w_k·s_k·B_k]  (columns), rank R = Σ r_i. Then B @ A = Σ w_i s_i B_i A_i exactly: the
same delta as our own mix layer (mixed_layer.py). The folder says r = lora_alpha = R and use_rslora = false, so any
reader's scaling is R / R = 1 and the weights are taken as they are.

Not PEFT's add_weighted_adapter(..., "cat"): it copies use_rslora from the first adapter, so a mix whose first
skill was trained with rsLoRA would be rescaled by sqrt(R) / R ... silently.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from .adapter import LoRAAdapter, LoRAFactors


def adapter_rank(adapter: LoRAAdapter) -> int:
    """The rank a skill takes in a concatenation: its largest block (smaller blocks are zero-padded)."""
    return max(f.rank for f in adapter.modules.values())


def concat_mix(parts: Sequence[tuple[LoRAAdapter, float]]) -> LoRAAdapter:
    """One adapter of rank Σ r_i and scaling 1 whose every module's delta is Σ w_i s_i B_i A_i.

    A module that some skills lack gets zero blocks for them, so every module has the same rank R (PEFT and
    vLLM read one r per adapter)."""
    if not parts:
        raise ValueError("a concatenated mix needs at least one adapter")
    ranks = [adapter_rank(a) for a, _ in parts]
    paths = sorted({p for a, _ in parts for p in a.modules})
    modules: dict[str, LoRAFactors] = {}
    for path in paths:
        shapes = {(f.A.shape[1], f.B.shape[0]) for a, _ in parts if (f := a.modules.get(path)) is not None}
        if len(shapes) != 1:
            raise ValueError(f"{path}: the mixed adapters disagree on its shape {sorted(shapes)}")
        ((n_in, n_out),) = shapes
        A_blocks, B_blocks = [], []
        for (adapter, w), r in zip(parts, ranks):
            A = torch.zeros(r, n_in, dtype=torch.float32)
            B = torch.zeros(n_out, r, dtype=torch.float32)
            f = adapter.modules.get(path)
            if f is not None:
                A[: f.rank] = f.A.float()
                B[:, : f.rank] = (w * f.scaling) * f.B.float()  # fp32: the product is taken once, exactly rounded
            A_blocks.append(A)
            B_blocks.append(B)
        modules[path] = LoRAFactors(A=torch.cat(A_blocks, 0), B=torch.cat(B_blocks, 1), scaling=1.0)
    return LoRAAdapter(modules=modules)


def zero_adapter(like: LoRAAdapter | None, shapes: dict[str, tuple[int, int]] | None = None) -> LoRAAdapter:
    """A rank-1 adapter whose delta is exactly zero, on `like`'s modules or on `shapes` {path: (in, out)}."""
    shapes = shapes or {p: (f.A.shape[1], f.B.shape[0]) for p, f in (like.modules.items() if like else ())}
    if not shapes:
        raise ValueError("a zero adapter needs at least one module")
    return LoRAAdapter(
        modules={p: LoRAFactors(torch.zeros(1, i), torch.zeros(o, 1), scaling=1.0) for p, (i, o) in shapes.items()}
    )
