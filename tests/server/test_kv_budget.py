"""The hf engine admits requests by KV memory: what does not fit waits for rows to finish, what can never fit
is refused at submit (a 400 through the API), on the tiny random LLaMA."""

from __future__ import annotations

import itertools
import threading

import pytest

from skillpool.lora.mix import Mix
from skillpool.server.engines import EngineEvent, EngineRequest, RequestTooLarge, SamplingParams
from skillpool.server.engines.hf import HFEngine
from skillpool.server.engines.kv import SPARE
from skillpool.server.engines.kv_budget import COPIES, KVBudget

_ids = itertools.count()
PROMPT, MAX_TOKENS = 20, 8  # each request reserves 28 tokens
TINY_KV_BYTES = 2 * 2 * 2 * 16 * 4  # 2 × layers × kv_heads × head_dim × float32 of make_tiny_base
TWO_ROWS = COPIES * 2 * (PROMPT + MAX_TOKENS + SPARE)  # what two such rows take at their peak, in tokens


def request(prompt: int = PROMPT, max_tokens: int = MAX_TOKENS) -> EngineRequest:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return EngineRequest(f"kv{next(_ids)}", list(range(100, 100 + prompt)), params, Mix.base())


def test_rows_cost_the_longest_padded_row_twice() -> None:
    budget = KVBudget(1000 * 8, 8, prefix_tokens=0, max_context=512)
    assert budget.cost([10, 30]) == COPIES * 2 * (30 + SPARE)
    assert budget.fits([10, 30]) and not budget.fits([10, 30, 30, 30, 30, 30])
    assert budget.max_request == 1000 // COPIES - SPARE
    assert budget.refusal(request(prompt=20, max_tokens=budget.max_request - 20)) is None
    too_long = budget.refusal(request(prompt=20, max_tokens=budget.max_request - 19))
    assert too_long is not None and "--kv-cache-memory-bytes" in too_long


def test_the_prefix_cache_comes_off_the_budget_and_a_budget_too_small_is_refused() -> None:
    assert KVBudget(1000 * 8, 8, prefix_tokens=400, max_context=512).tokens == 600
    with pytest.raises(ValueError, match="--kv-cache-memory-bytes"):
        KVBudget(100 * 8, 8, prefix_tokens=0, max_context=512)


def test_no_budget_admits_everything() -> None:
    budget = KVBudget(None, 8, prefix_tokens=4096, max_context=512)
    assert budget.fits([512] * 1000) and budget.max_request is None


@pytest.mark.parametrize("chunked", [False, True])
def test_six_requests_with_room_for_two_all_finish_never_more_than_two_at_once(tiny_base, chunked: bool) -> None:  # type: ignore[no-untyped-def]
    rows: list[int] = []
    engine = HFEngine(
        tiny_base.path,
        device="cpu",
        prefix_cache_tokens=0,
        kv_cache_memory_bytes=(TWO_ROWS + 10) * TINY_KV_BYTES,
        on_step=rows.append,
        # chunked: a step's 12 tokens are fewer than a prompt's 20, so every prompt is prefilled in chunks
        **({"max_num_seqs": 4, "max_batched_tokens": 12} if chunked else {}),
    )
    try:
        assert engine.kv_budget.bytes_per_token == TINY_KV_BYTES
        finished: list[EngineEvent] = []
        done = threading.Semaphore(0)

        def sink(ev: EngineEvent) -> None:
            if ev.finish_reason is not None:
                finished.append(ev)
                done.release()

        for _ in range(6):
            engine.submit(request(), sink)
        for _ in range(6):
            assert done.acquire(timeout=120)
        assert [(ev.finish_reason, ev.tokens) for ev in finished] == [("length", MAX_TOKENS)] * 6
        assert max(rows) == 2  # two decoded together, a third never joined them
    finally:
        engine.close()


def test_a_request_that_can_never_fit_is_refused_and_the_context_shrinks_to_the_budget(tiny_base) -> None:  # type: ignore[no-untyped-def]
    engine = HFEngine(
        tiny_base.path, device="cpu", prefix_cache_tokens=0, kv_cache_memory_bytes=(TWO_ROWS + 10) * TINY_KV_BYTES
    )
    try:
        most = engine.kv_budget.max_request
        assert most is not None and engine.max_context == most  # the API's context check and default max_tokens
        with pytest.raises(RequestTooLarge, match="max_tokens"):
            engine.submit(request(max_tokens=most), lambda ev: None)
        assert engine.stats()["waiting"] == 0  # refused before it was queued
    finally:
        engine.close()


def test_through_the_api_too_much_is_a_400_and_a_default_max_tokens_fits(tiny_base, embedder, tmp_path) -> None:  # type: ignore[no-untyped-def]
    from fastapi.testclient import TestClient

    from skillpool.server.app import create_app
    from skillpool.server.bootstrap import build_components
    from skillpool.server.config import ServerConfig

    budget = (COPIES * 200 + 4096) * TINY_KV_BYTES  # one request of 200 - SPARE tokens, beside the prefix cache
    cfg = ServerConfig.of(data_dir=tmp_path, kv_cache_memory_bytes=budget, default_max_tokens=4096)
    c = build_components(cfg, base=tiny_base, embedder=embedder)
    try:
        with TestClient(create_app(c)) as http:
            ask = {"model": "auto", "messages": [{"role": "user", "content": "Hello"}], "temperature": 0}
            resp = http.post("/v1/chat/completions", json={**ask, "max_tokens": 200})
            assert resp.status_code == 400
            assert resp.json()["error"]["code"] == "context_length_exceeded"
            resp = http.post("/v1/chat/completions", json=ask)  # 4096 by default: clamped to what fits
            assert resp.status_code == 200
            assert resp.json()["usage"]["total_tokens"] <= 200 - SPARE
    finally:
        c.close()
