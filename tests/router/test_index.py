"""The key index's placement: on the GPU when faiss sees one, the CPU index itself otherwise."""

from __future__ import annotations

import faiss
import numpy as np

from skillpool.router.index import on_device


def test_the_key_index_moves_to_the_gpu_only_when_faiss_sees_one() -> None:
    keys = np.random.default_rng(0).standard_normal((50, 8)).astype(np.float32)
    cpu = faiss.IndexFlatIP(8)
    cpu.add(keys)
    placed = on_device(cpu)
    if hasattr(faiss, "StandardGpuResources") and faiss.get_num_gpus() > 0:
        assert placed is not cpu and "Gpu" in type(placed).__name__
    else:  # faiss-cpu (setup.sh on a machine without CUDA): the index itself
        assert placed is cpu
    query = keys[:5] + 0.01
    assert np.array_equal(placed.search(query, 3)[1], cpu.search(query, 3)[1])
