"""Build a router from its settings: shared by the server and the trainer worker, which both route."""

from __future__ import annotations

from skillpool.adapters_store.base_model import BaseModel

from .embedder import Embedder, SentenceEmbedder
from .modes import mode_class
from .router import Router
from .sapt import TokenPooler
from .types import RouterSettings


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
