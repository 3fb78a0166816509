"""Prefix caching: the cache's own bookkeeping, and an engine that reuses cached prefixes answering
exactly as one that recomputes every prompt (base model and mixes, whole and chunked prefill)."""

from __future__ import annotations

import torch

from skillpool.lora.mix import Mix
from skillpool.server.engines.hf import HFEngine
from skillpool.server.engines.prefix import BLOCK, PrefixCache
from tests.server.test_engine import make_engine, run

BASE = Mix.base()


def kv_of(tokens: int, seed: float, layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Per layer (1, 3 heads, tokens, 4): position j holds seed + j, so a block's origin is visible."""
    col = torch.arange(tokens, dtype=torch.float32).view(1, 1, tokens, 1) + seed
    return [(col.expand(1, 3, tokens, 4).clone(), -col.expand(1, 3, tokens, 4).clone()) for _ in range(layers)]


def test_lookup_returns_whole_cached_blocks_of_the_same_mix_and_leaves_one_token_to_compute() -> None:
    cache = PrefixCache(max_tokens=64 * BLOCK)
    prompt = list(range(3 * BLOCK))
    cache.insert(BASE, prompt, kv_of(len(prompt), 100.0))
    assert cache.cached_tokens == 3 * BLOCK
    n, kv = cache.lookup(BASE, prompt + [7])  # three whole blocks, then one token of its own
    assert n == 3 * BLOCK and kv[0][0].shape == (1, 3, 3 * BLOCK, 4)
    assert torch.equal(kv[1][0][0, 0, :, 0], torch.arange(3 * BLOCK, dtype=torch.float32) + 100.0)
    assert torch.equal(kv[1][1], -kv[1][0])
    assert cache.lookup(BASE, prompt)[0] == 2 * BLOCK  # the last token must be computed for its logits
    assert cache.lookup(BASE, prompt[:BLOCK] + [999] + prompt[BLOCK + 1 :])[0] == BLOCK  # diverges in block 2
    assert cache.lookup(Mix.of({"skill@1": 1.0}), prompt + [7])[0] == 0  # another mix computes other KV
    assert cache.lookup(BASE, [1] + prompt)[0] == 0
    assert cache.hit_tokens == 3 * BLOCK + 2 * BLOCK + BLOCK


def test_a_partial_block_is_not_cached_and_shared_blocks_are_stored_once() -> None:
    cache = PrefixCache(max_tokens=64 * BLOCK)
    a, b = list(range(2 * BLOCK + 5)), list(range(BLOCK)) + [500 + i for i in range(BLOCK + 3)]
    cache.insert(BASE, a, kv_of(len(a), 0.0))
    cache.insert(BASE, b, kv_of(len(b), 1000.0))
    assert cache.cached_tokens == 3 * BLOCK  # a's two blocks, b's second one; the shared first block once
    n, kv = cache.lookup(BASE, b + [1])
    assert n == 2 * BLOCK
    # the first block is a's (inserted first), the second b's own
    assert kv[0][0][0, 0, 0, 0] == 0.0 and kv[0][0][0, 0, BLOCK, 0] == 1000.0 + BLOCK


def test_memory_is_bounded_and_the_least_recently_used_leaves_go_first() -> None:
    cache = PrefixCache(max_tokens=4 * BLOCK)
    hot, cold, new = ([s * 1000 + i for i in range(2 * BLOCK)] for s in (1, 2, 3))
    cache.insert(BASE, hot, kv_of(2 * BLOCK, 0.0))
    cache.insert(BASE, cold, kv_of(2 * BLOCK, 0.0))
    assert cache.lookup(BASE, hot + [0])[0] == 2 * BLOCK  # hot is used again: cold is now the oldest
    cache.insert(BASE, new, kv_of(2 * BLOCK, 0.0))
    assert cache.cached_tokens == 4 * BLOCK
    assert cache.lookup(BASE, hot + [0])[0] == 2 * BLOCK
    assert cache.lookup(BASE, new + [0])[0] == 2 * BLOCK
    assert cache.lookup(BASE, cold + [0])[0] == 0  # both its blocks left, leaf first
    assert PrefixCache(max_tokens=0).cached_tokens == 0


def test_a_zero_size_cache_keeps_nothing() -> None:
    cache = PrefixCache(max_tokens=0)
    cache.insert(BASE, list(range(4 * BLOCK)), kv_of(4 * BLOCK, 0.0))
    assert cache.cached_tokens == 0 and cache.lookup(BASE, list(range(5 * BLOCK)))[0] == 0


INSTRUCTION = (
    "Definition: In this task you are given a short news article. Classify its topic as one of sports, "
    "politics, business or science, and answer with that single word only. Input: "
)
INPUTS = ["The striker scored twice in the final.", "Parliament passed the budget.", "Shares fell 4%.", "A comet"]


def test_an_engine_that_reuses_prefixes_answers_exactly_as_one_that_recomputes(tiny_base) -> None:  # type: ignore[no-untyped-def]
    cached, plain = make_engine(tiny_base), make_engine(tiny_base, prefix_cache_tokens=0)
    try:
        prompts = [INSTRUCTION + x for x in INPUTS]
        mixes = [(), (("one", 1.0),), (("one", 0.4), ("two", 0.6)), ()]
        want = [run(plain, [p], [m])[0] for p, m in zip(prompts, mixes)]
        assert run(cached, prompts[:1], mixes[:1]) == want[:1]  # fills the cache for the base model
        hits = cached.stats()["prefix_hit_tokens"]
        # together: the base rows hit, the mixes miss the first time (their KV differs), then hit
        assert run(cached, prompts, mixes) == want
        assert cached.stats()["prefix_hit_tokens"] > hits
        hits = cached.stats()["prefix_hit_tokens"]
        assert run(cached, prompts, mixes) == want
        assert cached.stats()["prefix_hit_tokens"] - hits >= len(prompts) * 2 * BLOCK
        assert plain.stats()["prefix_hit_tokens"] == 0 and plain.stats()["prefix_cached_tokens"] == 0
    finally:
        cached.close()
        plain.close()


def test_a_chunked_prompt_resumes_from_its_cached_prefix(tiny_base) -> None:  # type: ignore[no-untyped-def]
    small = make_engine(tiny_base, max_num_seqs=2, max_batched_tokens=24)  # prompts prefill in chunks of 24
    plain = make_engine(tiny_base, prefix_cache_tokens=0)
    try:
        prompts = [INSTRUCTION + x for x in INPUTS[:2]]
        assert len(small.encode_chat([{"role": "user", "content": prompts[0]}])) > 3 * 24
        for mix in [(), (("one", 0.5), ("three", 0.5))]:
            want = [run(plain, [p], [mix])[0] for p in prompts]
            assert [run(small, [p], [mix])[0] for p in prompts] == want
        assert small.stats()["prefix_hit_tokens"] >= 2 * 3 * BLOCK  # the second prompt of each mix, at least
    finally:
        small.close()
        plain.close()


def test_a_replaced_skill_does_not_reuse_its_old_versions_prefix(tiny_base) -> None:  # type: ignore[no-untyped-def]
    from tests.server.test_engine import adapter

    eng: HFEngine = make_engine(tiny_base)
    fresh = make_engine(tiny_base, prefix_cache_tokens=0)
    try:
        prompt, mix = INSTRUCTION + INPUTS[0], (("one", 1.0),)
        run(eng, [prompt], [mix])
        new = adapter(tiny_base, 4, 8, 42)
        for e in (eng, fresh):
            e.add_skill("one", lambda: new)
        assert run(eng, [prompt], [mix]) == run(fresh, [prompt], [mix])
    finally:
        eng.close()
        fresh.close()
