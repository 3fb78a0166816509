"""The router's MiniLM through ONNX Runtime: the same vectors as sentence-transformers' (so a store's keys and
routes stay as they are), exported once, on the thread count it is given."""

from __future__ import annotations

import numpy as np
import pytest

from skillpool.router.build import make_embedder
from skillpool.router.embedder import SentenceEmbedder
from skillpool.router.embedder_onnx import OnnxEmbedder, export_onnx
from skillpool.router.texts import route_text
from tests.datasets import read_task


@pytest.fixture(scope="module")
def onnx_embedder(tmp_path_factory, monkeypatch_module):  # type: ignore[no-untyped-def]
    monkeypatch_module.setenv("SKILLPOOL_CACHE", str(tmp_path_factory.mktemp("cache")))
    return OnnxEmbedder(threads=1)


@pytest.fixture(scope="module")
def monkeypatch_module():  # type: ignore[no-untyped-def]
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def test_the_same_vectors_as_sentence_transformers(onnx_embedder, embedder) -> None:  # type: ignore[no-untyped-def]
    rows = read_task("long_sequence", "agnews", "test", 12) + read_task("long_sequence", "yelp", "test", 12)
    texts = ["hi", "", *(route_text(r["messages"]) for r in rows), "word " * 600]  # 600 words: cut at 256 tokens
    got, want = onnx_embedder.embed(texts), embedder.embed(texts)
    assert got.shape == want.shape == (len(texts), embedder.dim) and got.dtype == np.float32
    assert np.abs(got - want).max() < 1e-5
    assert np.allclose(np.linalg.norm(got, axis=1), 1, atol=1e-5)
    assert onnx_embedder.model_id == embedder.model_id  # cached embeddings and stored keys stay valid
    assert onnx_embedder.embed([]).shape == (0, embedder.dim)


def test_one_batch_or_many_gives_the_same_vectors(onnx_embedder) -> None:  # type: ignore[no-untyped-def]
    texts = [f"request number {i} " * (1 + i % 7) for i in range(10)]
    small = OnnxEmbedder(threads=1, batch_size=3)
    assert np.abs(small.embed(texts) - onnx_embedder.embed(texts)).max() < 1e-5


def test_the_export_is_made_once_and_whole(onnx_embedder) -> None:  # type: ignore[no-untyped-def]
    path = export_onnx(*_model(onnx_embedder))
    stamp = path.stat().st_mtime_ns
    assert export_onnx(*_model(onnx_embedder)) == path and path.stat().st_mtime_ns == stamp
    assert [p.name for p in path.parent.iterdir()] == [path.name]  # no temporary file left beside it


def _model(e: OnnxEmbedder):  # type: ignore[no-untyped-def]
    from skillpool.router.embedder import packaged_minilm_path

    return packaged_minilm_path(), e.max_len


def test_it_runs_on_the_threads_it_is_given(onnx_embedder) -> None:  # type: ignore[no-untyped-def]
    assert onnx_embedder.session.get_session_options().intra_op_num_threads == 1
    two = OnnxEmbedder(threads=2)
    assert two.session.get_session_options().intra_op_num_threads == 2


def test_make_embedder_picks_onnx_on_a_cpu_and_refuses_what_cannot_run(onnx_embedder) -> None:  # type: ignore[no-untyped-def]
    assert isinstance(make_embedder("auto", "cpu"), OnnxEmbedder)
    assert isinstance(make_embedder("torch", "cpu"), SentenceEmbedder)
    with pytest.raises(ValueError, match="one of auto, onnx, torch"):
        make_embedder("openvino", "cpu")
    with pytest.raises(ValueError, match="at least 1"):
        make_embedder("onnx", "cpu", threads=0)
    with pytest.raises(ValueError, match="runs on the CPU"):
        make_embedder("onnx", "cuda")
