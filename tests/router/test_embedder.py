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


def test_a_long_list_is_embedded_a_batch_at_a_time_and_lets_a_short_one_in() -> None:
    """An upload's embedding must not hold the model for its whole length: the routing stage's request gets
    it between two batches. The results are the unbatched ones, in the caller's order."""
    import threading

    emb = SentenceEmbedder(batch_size=8)
    texts = [f"review {i}: " + "a fine film " * (i % 7 + 1) for i in range(400)]
    one_go = np.concatenate([emb.embed(texts[i : i + 8]) for i in range(0, 16, 8)])
    long_done, short_done_first = threading.Event(), []

    def upload() -> None:
        vecs = emb.embed(texts)
        assert np.allclose(vecs[:16], one_go, atol=1e-5)  # same vectors, same order as asked
        long_done.set()

    worker = threading.Thread(target=upload)
    worker.start()
    while not emb._lock.locked():  # the upload has started encoding
        pass
    emb.embed(["is this routed while the upload embeds?"])
    short_done_first.append(not long_done.is_set())
    worker.join()
    assert long_done.is_set() and short_done_first == [True]
