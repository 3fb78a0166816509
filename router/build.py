"""Build a router from its settings: shared by the server and the trainer worker, which both route."""

from __future__ import annotations

import importlib.util
import logging

from skillpool.runtime.base_model import BaseModel, resolve_device

from .embedder import Embedder, SentenceEmbedder
from .modes import mode_class
from .router import Router
from .sapt import TokenPooler
from .types import RouterSettings

log = logging.getLogger(__name__)

EMBEDDERS = ("auto", "onnx", "torch")


def make_embedder(kind: str = "auto", device: str | None = None, threads: int = 1) -> Embedder:
    """The router's MiniLM: ONNX Runtime on `threads` CPU threads (kind onnx, or auto on a CPU with onnxruntime
    installed) or sentence-transformers on `device`. Both give the same vectors (float32 rounding apart), so a
    store's keys serve either."""
    if kind not in EMBEDDERS:
        raise ValueError(f"embedder must be one of {', '.join(EMBEDDERS)}, not {kind!r}")
    if threads < 1:
        raise ValueError(f"router threads must be at least 1, not {threads}")
    on_cpu = resolve_device(device) == "cpu"
    if kind == "onnx" and not on_cpu:
        raise ValueError("the onnx embedder runs on the CPU: use --embedder torch (or auto) with --device cuda")
    if kind == "onnx" or (kind == "auto" and on_cpu and importlib.util.find_spec("onnxruntime") is not None):
        from .embedder_onnx import OnnxEmbedder

        try:
            return OnnxEmbedder(threads=threads)
        except Exception:  # auto: a failed export or session serves the same vectors through torch instead
            if kind == "onnx":
                raise
            log.warning("the onnx embedder could not start; the router's MiniLM runs in torch", exc_info=True)
    return SentenceEmbedder(device=device)


def make_router(
    settings: RouterSettings, base: BaseModel, embedder: Embedder | None = None, device: str | None = None
) -> Router:
    """The router for these settings (MiniLM on `device`); sapt also reads the base model's token-embedding table."""
    pooler = (
        TokenPooler.from_checkpoint(base.path, settings.sapt.max_tokens, settings.sapt.pool)
        if mode_class(settings.mode).learns_projector
        else None
    )
    return Router(embedder or SentenceEmbedder(device=device), settings, pooler)
