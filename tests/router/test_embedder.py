"""The packaged MiniLM: where it runs, and its unit vectors."""

from __future__ import annotations

import numpy as np
import torch

from skillpool.router.embedder import SentenceEmbedder


def test_device_defaults_to_cuda_when_available_and_cpu_gives_unit_vectors() -> None:
    assert SentenceEmbedder().device == ("cuda" if torch.cuda.is_available() else "cpu")
    cpu = SentenceEmbedder(device="cpu")
    assert str(cpu.model.device) == "cpu"
    vecs = cpu.embed(["a review of a phone", "the match ended 2-1"])
    assert vecs.shape == (2, cpu.dim) and np.allclose(np.linalg.norm(vecs, axis=1), 1, atol=1e-5)
