"""DTKR (SLM): grouped sub-keys trained in a preparation stage on a skill's own inputs.

The query vector is cut into G contiguous chunks; each skill owns K slots, each slot one sub-key
per group. Training (per skill, no LLM involved): cosine between each query chunk and each of the
skill's sub-keys in that group, a random mask hides a fraction p of the scores (so every key gets
picked sometimes), the top-k per group are selected and −mean(cosine) of the selected ones is
minimized; only selected keys receive gradient. The keys end up estimating centroids of the task's
input distribution, so k-means centroids are the initialization.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch
from torch.nn import functional as F

from .keys import centroid_keys


@dataclass(frozen=True)
class DTKRSettings:
    groups: int = 4  # G: the 384-d MiniLM vector is cut into 4 chunks of 96
    mask_p: float = 0.2  # fraction of scores masked to -inf during training
    topk_per_group: int = 2
    lr: float = 1e-3
    weight_decay: float = 0.01
    epochs: int = 3
    batch_size: int = 32
    init: str = "kmeans"  # kmeans | orthogonal
    seed: int = 0


def split_groups(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(..., d) → (..., G, d/G) with every chunk L2-normalized."""
    d = x.shape[-1]
    if d % groups:
        raise ValueError(f"embedding size {d} is not divisible into {groups} groups")
    return F.normalize(x.reshape(*x.shape[:-1], groups, d // groups), dim=-1)


def _init(emb: np.ndarray, n_keys: int, s: DTKRSettings) -> torch.Tensor:
    if s.init == "kmeans":
        return split_groups(torch.from_numpy(centroid_keys(emb, n_keys, seed=s.seed)), s.groups)
    if s.init == "orthogonal":
        g = torch.Generator().manual_seed(s.seed)
        d = emb.shape[1] // s.groups
        keys = torch.stack(
            [torch.linalg.qr(torch.randn(d, max(d, n_keys), generator=g).T)[0][:n_keys] for _ in range(s.groups)], dim=1
        )
        return F.normalize(keys, dim=-1)
    raise ValueError(f"unknown DTKR init {s.init!r} (kmeans | orthogonal)")


def train_dtkr_keys(
    emb: np.ndarray, n_keys: int, s: DTKRSettings, check_stop: Callable[[], None] | None = None
) -> torch.Tensor:
    """Return (K, G, d/G) unit sub-keys for one skill, trained on its input embeddings (n, d). `check_stop`:
    called before the init and each epoch; it raises to stop."""
    if check_stop is not None:
        check_stop()
    keys = _init(emb, n_keys, s)
    k = keys.shape[0]
    if s.epochs <= 0 or len(emb) < 2:
        return keys
    keys = torch.nn.Parameter(keys.clone())
    q = split_groups(torch.from_numpy(np.ascontiguousarray(emb, dtype=np.float32)), s.groups)  # (n, G, dg)
    opt = torch.optim.AdamW([keys], lr=s.lr, weight_decay=s.weight_decay)
    steps_per_epoch = max(1, -(-len(q) // s.batch_size))
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=steps_per_epoch, gamma=0.5)  # step decay per epoch
    g = torch.Generator().manual_seed(s.seed)
    top = min(s.topk_per_group, k)
    for _ in range(s.epochs):
        if check_stop is not None:
            check_stop()
        for idx in torch.randperm(len(q), generator=g).split(s.batch_size):
            cos = torch.einsum("bgd,kgd->bgk", q[idx], F.normalize(keys, dim=-1))  # (b, G, K)
            masked = cos.masked_fill(torch.rand(cos.shape, generator=g) < s.mask_p, float("-inf"))
            sel = masked.topk(top, dim=-1).indices
            picked = cos.gather(-1, sel)
            loss = -picked[torch.isfinite(masked.gather(-1, sel))].mean()
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
    return F.normalize(keys.detach(), dim=-1)


def slot_scores(query: torch.Tensor | np.ndarray, keys: torch.Tensor, groups: int) -> np.ndarray:
    """Mean over groups of the chunk cosines: (n, d) queries × (S, G, dg) sub-keys → (n, S)."""
    q = split_groups(torch.as_tensor(np.asarray(query, dtype=np.float32)), groups)
    return torch.einsum("ngd,sgd->ns", q, keys).div(groups).numpy()
