"""The router modes behind one interface: each name in MODES has its class, chosen once by the router."""

from __future__ import annotations

import numpy as np

from skillpool.router import MODES, RouterSettings
from skillpool.router.modes import CentroidMode, DTKRMode, SAPTMode, mode_class, mode_for


def test_every_mode_name_has_its_class() -> None:
    assert {m: mode_class(m) for m in MODES} == {"dtkr": DTKRMode, "sapt": SAPTMode, "centroid": CentroidMode}
    assert [m for m in MODES if mode_class(m).learns_projector] == ["sapt"]


def test_only_dtkr_scores_in_a_whitened_grouped_space() -> None:
    emb = np.random.default_rng(0).standard_normal((3, 384)).astype(np.float32)
    for name in ("centroid", "sapt"):
        mode = mode_for(RouterSettings(mode=name))
        assert not mode.whitened and mode.query_vectors(emb) is emb
    dtkr = mode_for(RouterSettings(mode="dtkr"))
    assert dtkr.whitened and not mode_for(RouterSettings(mode="dtkr", whiten=False)).whitened
    assert dtkr.query_vectors(emb).shape == emb.shape
