"""The same MiniLM weights run by ONNX Runtime, for the router on a CPU.

Same tokenizer, truncation, mean pooling and normalization as SentenceEmbedder, on a graph exported once from
the packaged weights (cached beside the converted base model, keyed by the weights' digest): the vectors
equal torch's to float32 rounding, so stored keys stay valid and routes do not move. What it changes is the
cost and who runs it: ONNX Runtime keeps its own thread pool, sized here, apart from torch's, so the router
does not add a second full-width pool on the cores the engine's decode steps use (docs/routing.md).
"""

from __future__ import annotations

import hashlib
import json
import os
import threading
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from skillpool.runtime.base_model import cache_dir

from .embedder import embed_in_batches, packaged_minilm_path


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with (path / "model.safetensors").open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()[:16]


def export_onnx(model_path: Path, max_len: int) -> Path:
    """The ONNX graph of the MiniLM at `model_path` (last hidden state), exported once; an export is written
    to a temporary name and renamed, so a crash never leaves half a graph to load."""
    out = cache_dir() / "embedders" / f"{model_path.parent.name}-{_digest(model_path)}" / "minilm.onnx"
    if out.is_file():
        return out
    import torch
    from transformers import AutoModel, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(model_path))
    hf = AutoModel.from_pretrained(str(model_path)).eval()
    enc = tok(["a b c", "a"], padding=True, truncation=True, max_length=max_len, return_tensors="pt")

    class Hidden(torch.nn.Module):
        def __init__(self, m: Any) -> None:
            super().__init__()
            self.m = m

        def forward(self, ids: torch.Tensor, mask: torch.Tensor, tt: torch.Tensor) -> torch.Tensor:
            return self.m(input_ids=ids, attention_mask=mask, token_type_ids=tt).last_hidden_state

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_suffix(f".{os.getpid()}.tmp")
    dyn = {k: {0: "b", 1: "s"} for k in ("ids", "mask", "tt", "h")}
    with torch.no_grad(), warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the tracer's notes on Python branches: the equality tests cover padding
        torch.onnx.export(
            Hidden(hf),
            (enc["input_ids"], enc["attention_mask"], enc["token_type_ids"]),
            str(tmp),
            input_names=["ids", "mask", "tt"],
            output_names=["h"],
            dynamic_axes=dyn,
            opset_version=17,
            dynamo=False,
        )
    tmp.replace(out)
    return out


class OnnxEmbedder:
    """Mean-pooled, L2-normalized MiniLM embeddings through ONNX Runtime, each call on `threads` CPU threads;
    calls from several threads run at once (ONNX Runtime's sessions are safe to share)."""

    def __init__(self, model_path: str | Path | None = None, threads: int = 1, batch_size: int = 64) -> None:
        import onnxruntime as ort
        from transformers import AutoTokenizer

        path = Path(model_path or packaged_minilm_path())
        cfg = json.loads((path / "sentence_bert_config.json").read_text())
        self.max_len = int(cfg.get("max_seq_length", 256))
        self.tokenizer = AutoTokenizer.from_pretrained(str(path))
        self.dim = int(json.loads((path / "config.json").read_text())["hidden_size"])
        self.model_id = path.parent.name if path.name == "model" else path.name  # the same id: the same vectors
        self.device, self.batch_size, self.threads = "cpu", batch_size, threads
        opts = ort.SessionOptions()
        # one thread runs on the caller's thread: no pool of its own spinning beside the engine's
        opts.intra_op_num_threads, opts.inter_op_num_threads = threads, 1
        opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        # idle pool threads sleep instead of spinning: the cores they would spin on run the engine's steps
        opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
        self.session = ort.InferenceSession(
            str(export_onnx(path, self.max_len)), opts, providers=["CPUExecutionProvider"]
        )
        self._lock = threading.Lock()  # the tokenizer is not safe to share across threads; the session is

    def embed(self, texts: Sequence[str]) -> np.ndarray:
        """Unit-norm embeddings, `batch_size` texts per run, longest first (as sentence-transformers batches)."""
        return embed_in_batches(texts, self.batch_size, self.dim, self._encode)

    def _encode(self, texts: list[str]) -> np.ndarray:
        with self._lock:
            enc = self.tokenizer(texts, padding=True, truncation=True, max_length=self.max_len, return_tensors="np")
        mask = enc["attention_mask"].astype(np.int64)
        feed = {"ids": enc["input_ids"].astype(np.int64), "mask": mask, "tt": enc["token_type_ids"].astype(np.int64)}
        hidden = self.session.run(None, feed)[0]  # concurrent runs: one per routing worker, each on `threads`
        m = mask[..., None].astype(np.float32)
        v = (hidden * m).sum(1) / np.maximum(m.sum(1), 1e-9)
        v /= np.maximum(np.linalg.norm(v, axis=1, keepdims=True), 1e-12)
        return np.ascontiguousarray(v, dtype=np.float32)
