"""DTKR keys: the preparation stage improves the selected keys' fit, and retrieval scores are exact."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from skillpool.router import Router, RouterSettings
from skillpool.router.dtkr import DTKRSettings, slot_scores, split_groups, train_dtkr_keys
from skillpool.router.router import whitening
from tests.datasets import read_task


def clustered(n: int = 400, d: int = 32, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    centers = rng.normal(size=(4, d))
    x = centers[rng.integers(0, 4, n)] + 0.3 * rng.normal(size=(n, d))
    return (x / np.linalg.norm(x, axis=1, keepdims=True)).astype(np.float32)


def fit(x: np.ndarray, keys: torch.Tensor, groups: int, top: int = 2) -> float:
    """Mean cosine of the top-k sub-keys per group: what the preparation stage maximizes."""
    cos = torch.einsum("ngd,kgd->ngk", split_groups(torch.from_numpy(x), groups), keys)
    return float(cos.topk(top, dim=-1).values.mean())


@pytest.mark.parametrize("init", ["kmeans", "orthogonal"])
def test_training_improves_fit_and_keeps_unit_subkeys(init: str) -> None:
    x = clustered()
    untrained = train_dtkr_keys(x, 8, DTKRSettings(groups=4, init=init, epochs=0))
    trained = train_dtkr_keys(x, 8, DTKRSettings(groups=4, init=init, epochs=5, lr=1e-2))
    assert trained.shape == (8, 4, 8)
    assert torch.allclose(trained.norm(dim=-1), torch.ones(8, 4), atol=1e-5)
    assert fit(x, trained, 4) > fit(x, untrained, 4) + (0.05 if init == "orthogonal" else 0.0)


def test_groups_must_divide_the_embedding() -> None:
    with pytest.raises(ValueError, match="divisible"):
        train_dtkr_keys(clustered(d=30), 4, DTKRSettings(groups=4))


def test_router_scores_are_the_mean_of_group_cosines(embedder) -> None:  # type: ignore[no-untyped-def]
    texts = [e["route_text"] for e in read_task("long_sequence", "agnews", "train", 60)]
    emb = embedder.embed(texts[:5])
    raw = Router(embedder, RouterSettings(mode="dtkr", top_k=1, whiten=False))
    tensors = raw.prepare_keys(texts)
    raw.add_skill("agnews", tensors)
    g = raw.settings.dtkr.groups
    want = slot_scores(emb, tensors["dtkr_keys"], g).max(axis=1)
    assert np.allclose([d.score for d in raw.route_embeddings(emb)], want, atol=1e-5)

    # whitened: the same mean of group cosines, after queries and keys are mapped through W = Σ^-½
    white = Router(embedder, RouterSettings(mode="dtkr", top_k=1, white_threshold_margin=2.0, white_gate_min_inputs=0))
    white.add_skill("agnews", tensors)
    d = embedder.dim
    w = whitening(tensors["input_cov"].double().numpy(), d / (d + 60))
    keys = split_groups(torch.from_numpy(tensors["dtkr_keys"].reshape(len(tensors["dtkr_keys"]), -1).numpy() @ w), g)
    want_w = slot_scores(emb @ w, keys, g).max(axis=1)
    assert np.allclose([d.score for d in white.route_embeddings(emb)], want_w, atol=1e-4)


def test_dtkr_mode_routes_held_out_inputs(embedder) -> None:  # type: ignore[no-untyped-def]
    router = Router(embedder, RouterSettings(mode="dtkr"))
    for task in ("agnews", "sst-2"):
        router.add_skill(
            task, router.prepare_keys([e["route_text"] for e in read_task("long_sequence", task, "train", 100)])
        )
    for task in ("agnews", "sst-2"):
        ds = router.route([e["route_text"] for e in read_task("long_sequence", task, "test", 40)])
        routed = [d.route[0][0] for d in ds if d.route]
        assert routed.count(task) == len(routed) and len(routed) >= 34, (task, len(routed))
