"""Fixtures of the server tests."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from skillpool.server.app import create_app
from skillpool.server.bootstrap import build_components
from skillpool.server.config import ServerConfig


@pytest.fixture(scope="module")
def hf_engine(smollm, skills):  # type: ignore[no-untyped-def]
    """The hf engine serving the requesting module's `skills`: the reference the vllm engine's answers must equal."""
    from skillpool.server.engines.hf import HFEngine

    eng = HFEngine(smollm.path, device="cpu")
    for name, a in skills.items():
        eng.add_skill(name, lambda a=a: a)
    yield eng
    eng.close()


@pytest.fixture(scope="module")
def components(request, tiny_base, embedder, tmp_path_factory):  # type: ignore[no-untyped-def]
    """A server's parts on the tiny LLaMA, one per test module: a module's tests share its skills and jobs. A module
    sets DEFAULT_MAX_TOKENS for a shorter default answer (default 8)."""
    max_tokens = getattr(request.module, "DEFAULT_MAX_TOKENS", 8)
    cfg = ServerConfig.of(
        data_dir=tmp_path_factory.mktemp("data"), max_upload_bytes=300_000, default_max_tokens=max_tokens
    )
    c = build_components(cfg, base=tiny_base, embedder=embedder)
    yield c
    c.close()


@pytest.fixture(scope="module")
def client(components):  # type: ignore[no-untyped-def]
    """Those parts behind the real FastAPI app, through the ASGI test client."""
    with TestClient(create_app(components)) as cl:
        yield cl
