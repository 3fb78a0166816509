"""bench_serving's like-for-like comparison of mixes with the base model runs a server without prefix caching."""

from __future__ import annotations

from load_tests.serving.bench_serving import like_for_like
from tests.server.test_cli import config


def test_like_for_like_server_keeps_no_prompt_kv() -> None:
    flags = ["--engine", "hf", "--max-batch-size", "16"]
    assert config(*flags).serving.prefix_cache_tokens > 0  # the other scenarios' server reuses shared prompt starts
    assert config(*like_for_like(flags)).serving.prefix_cache_tokens == 0
    assert like_for_like(flags)[: len(flags)] == flags  # the engine and batch size stay the same
