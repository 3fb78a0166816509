"""Fixtures of the server tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="module")
def hf_engine(smollm, skills):  # type: ignore[no-untyped-def]
    """The hf engine serving the requesting module's `skills`: the reference the vllm engine's answers must equal."""
    from skillpool.server.engines.hf import HFEngine

    eng = HFEngine(smollm.path, device="cpu")
    for name, a in skills.items():
        eng.add_skill(name, lambda a=a: a)
    yield eng
    eng.close()
