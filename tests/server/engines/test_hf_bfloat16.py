"""The hf engine with a bfloat16 model on a CPU: weights and KV stay bfloat16, the Linears multiply by weights packed
once for oneDNN, and batching, chunked prefill and prefix caching stay exact."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch
from transformers import AutoModelForCausalLM

from skillpool.server.engines.hf import HFEngine
from skillpool.server.engines.kv import KVBatch
from skillpool.server.engines.packed import PackedLinear
from tests.server.test_engine import MIXES, PROMPTS, make_engine, run, staggered


@pytest.fixture(scope="module")
def bf16(tiny_base) -> Iterator[HFEngine]:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base, dtype=torch.bfloat16)
    yield eng
    eng.close()


def test_weights_and_the_decode_batchs_kv_are_bfloat16(bf16: HFEngine) -> None:
    assert next(bf16.model.parameters()).dtype == torch.bfloat16
    linears = [m for m in bf16.model.modules() if isinstance(m, torch.nn.Linear)]
    # packed where oneDNN has a bf16 path on this CPU (AVX-512 or AVX-NE-CONVERT); elsewhere every Linear stays plain
    packs = torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    assert [isinstance(m, PackedLinear) for m in linears] == [packs] * len(linears)
    assert bf16.kv_dtype == torch.bfloat16
    seen: list[KVBatch] = []
    bf16.on_step = lambda n: seen.append(bf16._kv) if bf16._kv is not None else None  # type: ignore[func-returns-value]
    try:
        run(bf16, ["Hello there", "x"], max_tokens=4)
    finally:
        bf16.on_step = None
    assert seen and all(layer.keys.dtype == torch.bfloat16 for layer in seen[-1].cache.layers)  # type: ignore[union-attr]


def test_batched_greedy_equals_one_at_a_time(bf16: HFEngine) -> None:
    batched = run(bf16, PROMPTS, MIXES)
    for i, p in enumerate(PROMPTS):
        assert run(bf16, [p], [MIXES[i]])[0] == batched[i]


def test_chunked_and_prefix_cached_prefills_answer_as_a_whole_one(tiny_base, bf16: HFEngine) -> None:  # type: ignore[no-untyped-def]
    small = make_engine(tiny_base, dtype=torch.bfloat16, max_num_seqs=2, max_batched_tokens=8, prefix_cache_tokens=0)
    try:
        prompt = "What is the topic of this news article about football? Answer with one word, please."
        for mix in [(), (("one", 0.5), ("two", 0.5))]:
            whole = run(small, [prompt, "Hi"], [mix, ()])
            assert run(bf16, [prompt, "Hi"], [mix, ()]) == whole
            assert run(bf16, [prompt, "Hi"], [mix, ()]) == whole  # now from the prefix cache
    finally:
        small.close()
    assert bf16.prefix.hit_tokens > 0


def test_the_first_token_logits_match_transformers_own_bfloat16_forward(tiny_base, bf16: HFEngine) -> None:  # type: ignore[no-untyped-def]
    """Packed weights compute the model's function: the logits are those of the stock forward, to bfloat16's
    precision."""
    ids = bf16.encode_chat([{"role": "user", "content": PROMPTS[1]}])
    ref = AutoModelForCausalLM.from_pretrained(str(tiny_base.path), dtype=torch.bfloat16).eval()
    with torch.inference_mode():
        want = ref(input_ids=torch.tensor([ids])).logits[0, -1].float()
        got = bf16.model(input_ids=torch.tensor([ids])).logits[0, -1].float()
    assert ref.config._attn_implementation == "sdpa"
    assert torch.allclose(got, want, atol=0.05 * float(want.abs().max()))
    assert int(got.argmax()) == int(want.argmax())


def test_rows_joining_and_leaving_mid_decode_answer_as_alone(bf16: HFEngine) -> None:
    """Rows join a running batch (some longer than it) and leave at different lengths, in place."""
    specs = [
        ("x", (("one", 0.2), ("two", 0.3), ("three", 0.5)), 30),
        ("Hello there", (), 6),
        ("What is the topic of this news article about football? Answer in one word.", (("two", 1.0),), 20),
        ("Hi", (("one", 0.3), ("three", 0.7)), 12),
    ]
    solo = [run(bf16, [p], [m], max_tokens=n)[0] for p, m, n in specs]
    assert staggered(bf16, specs) == solo
