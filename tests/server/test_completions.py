"""POST /v1/completions on a tiny LLaMA: prompt forms, echo with the prompt's logprobs (equal to transformers'
log-softmax of the same model), max_tokens 0, n, stop, seed, streaming, and each bad input's 400."""

from __future__ import annotations

import math

import pytest
import torch
from fastapi.testclient import TestClient
from transformers import AutoModelForCausalLM

from tests.server.test_api import assert_error, streamed

PROMPT = "The capital of France is"
# float32 on both sides, the same weights and tokens: the engine's padded, cached forward differs from one plain
# forward only by the order of float32 sums
TOLERANCE = 1e-4


def complete(client: TestClient, **kw):  # type: ignore[no-untyped-def]
    body = {"model": "tiny-llama", "prompt": PROMPT, "max_tokens": 5, "temperature": 0, **kw}
    return client.post("/v1/completions", json=body)


def reference_logprobs(tiny_base, ids: list[int]) -> torch.Tensor:  # type: ignore[no-untyped-def]
    """transformers' own log-softmax of each next prompt token, float32."""
    model = AutoModelForCausalLM.from_pretrained(str(tiny_base.path), dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits, dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


def test_a_text_prompt_is_completed(client: TestClient) -> None:
    r = complete(client)
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    assert isinstance(choice["text"], str) and choice["text"]
    assert body["usage"]["completion_tokens"] == 5
    assert body["skillpool"]["reason"] == "base"
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    assert body["usage"]["prompt_tokens"] == len(ids)
    as_ids = complete(client, prompt=ids).json()
    assert as_ids["choices"][0]["text"] == choice["text"]  # the same tokens, given as ids


def test_echo_with_logprobs_gives_each_prompt_token_its_logprob(client: TestClient, tiny_base) -> None:  # type: ignore[no-untyped-def]
    ids = client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    r = complete(client, prompt=ids, echo=True, logprobs=2, max_tokens=0)
    assert r.status_code == 200, r.text
    [choice] = r.json()["choices"]
    lp = choice["logprobs"]
    assert choice["text"] == PROMPT and choice["finish_reason"] == "length"
    assert len(lp["tokens"]) == len(ids) and "".join(lp["tokens"]) == PROMPT
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    assert lp["text_offset"] == [sum(len(t) for t in lp["tokens"][:i]) for i in range(len(ids))]
    ref = reference_logprobs(tiny_base, ids)
    got = torch.tensor(lp["token_logprobs"][1:])
    assert torch.allclose(got, ref, atol=TOLERANCE), (got - ref).abs().max()
    for top, tok in zip(lp["top_logprobs"][1:], lp["tokens"][1:]):
        assert tok in top and 2 <= len(top) <= 3 and all(v <= 0 for v in top.values())
    assert r.json()["usage"]["completion_tokens"] == 0


def test_echo_then_the_answer_with_its_logprobs(client: TestClient) -> None:
    plain = complete(client, logprobs=1).json()["choices"][0]
    echoed = complete(client, echo=True, logprobs=1).json()["choices"][0]
    assert echoed["text"] == PROMPT + plain["text"]
    n_prompt = len(client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    assert len(echoed["logprobs"]["tokens"]) == n_prompt + 5 == n_prompt + len(plain["logprobs"]["tokens"])
    assert echoed["logprobs"]["token_logprobs"][n_prompt:] == pytest.approx(plain["logprobs"]["token_logprobs"])
    greedy_first = plain["logprobs"]["top_logprobs"][0]
    assert plain["logprobs"]["token_logprobs"][0] == pytest.approx(max(greedy_first.values()))


def test_loglikelihood_requests_get_a_logprob_for_the_generated_token_even_at_the_end(client: TestClient) -> None:
    """lm-evaluation-harness asks max_tokens 1 with echo and drops the last logprob: there must be one, also when
    the model ends the answer there (the end of sequence is no text, but it has its logprob, as in vLLM)."""
    eos = client.get("/tokenizer_info").json()["eos_token"]
    eos_id = client.post("/tokenize", json={"prompt": eos, "add_special_tokens": False}).json()["tokens"][0]
    n = len(client.post("/tokenize", json={"prompt": PROMPT}).json()["tokens"])
    for bias in ({}, {str(eos_id): 100}):
        r = complete(client, echo=True, logprobs=1, max_tokens=1, logit_bias=bias).json()
        lp = r["choices"][0]["logprobs"]
        assert len(lp["token_logprobs"]) == n + 1 and lp["token_logprobs"][-1] <= 0
    assert lp["tokens"][-1] == eos and r["choices"][0]["text"] == PROMPT and r["usage"]["completion_tokens"] == 0


def test_a_long_prompt_prefilled_in_chunks_gets_the_same_logprobs(components, tiny_base) -> None:  # type: ignore[no-untyped-def]
    from skillpool.server.engines import EngineRequest, SamplingParams
    from skillpool.server.engines.hf import HFEngine

    eng = HFEngine(tiny_base.path, device="cpu", max_num_seqs=2, max_batched_tokens=8)
    try:
        ids = components.vocab.encode(PROMPT + " and the capital of Italy is Rome, of Spain Madrid.")
        assert len(ids) > 2 * 8
        params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0)
        import asyncio

        async def run() -> list:  # type: ignore[type-arg]
            return [ev async for ev in eng.generate(EngineRequest("chunked", ids, params))]

        [ev] = [e for e in asyncio.run(run()) if e.prompt_logprobs is not None]
        got = torch.tensor([t.logprob for t in ev.prompt_logprobs or ()])
        assert [t.token for t in ev.prompt_logprobs or ()] == ids[1:]
        assert torch.allclose(got, reference_logprobs(tiny_base, ids), atol=TOLERANCE)
    finally:
        eng.close()


def test_a_list_of_prompts_and_n_choices_come_in_order(client: TestClient) -> None:
    prompts = [PROMPT, "Once upon a time"]
    r = complete(client, prompt=prompts, n=2, temperature=1.0, seed=11, max_tokens=4)
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2, 3]
    assert choices[0]["text"] != choices[1]["text"]  # two samples of one prompt (seed, seed + 1)
    again = complete(client, prompt=prompts, n=2, temperature=1.0, seed=11, max_tokens=4).json()["choices"]
    assert [c["text"] for c in again] == [c["text"] for c in choices]
    alone = complete(client, prompt=prompts[1], n=2, temperature=1.0, seed=11, max_tokens=4).json()["choices"]
    assert [c["text"] for c in alone] == [c["text"] for c in choices[2:]]
    assert all(c["skillpool"]["reason"] for c in choices)  # several prompts: each choice names its route


def test_stop_ends_a_completion(client: TestClient) -> None:
    text = complete(client, max_tokens=12).json()["choices"][0]["text"]
    stop = text[4:7]
    stopped = complete(client, max_tokens=12, stop=[stop]).json()["choices"][0]
    assert stopped["finish_reason"] == "stop" and text.startswith(stopped["text"]) and stop not in stopped["text"]


def test_streamed_equals_whole(client: TestClient) -> None:
    whole = complete(client, echo=True, logprobs=1, n=2, temperature=0.9, seed=3).json()
    body = {
        "model": "tiny-llama",
        "prompt": PROMPT,
        "max_tokens": 5,
        "temperature": 0.9,
        "seed": 3,
        "n": 2,
        "echo": True,
        "logprobs": 1,
        "stream_options": {"include_usage": True},
    }
    chunks = streamed(client, "/v1/completions", body)
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"] == whole["usage"]
    for c in whole["choices"]:
        mine = [ch["choices"][0] for ch in chunks if ch["choices"] and ch["choices"][0]["index"] == c["index"]]
        assert "".join(m["text"] for m in mine) == c["text"]
        assert [m["finish_reason"] for m in mine if m["finish_reason"]] == [c["finish_reason"]]
        lps = [v for m in mine if m["logprobs"] for v in m["logprobs"]["token_logprobs"]]
        assert lps == pytest.approx(c["logprobs"]["token_logprobs"])
        offsets = [v for m in mine if m["logprobs"] for v in m["logprobs"]["text_offset"]]
        assert offsets == c["logprobs"]["text_offset"]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        ({"prompt": []}, "prompt"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, 2, 10**6]}, "prompt"),
        ({"prompt": [[1, 2], [-1]]}, "prompt"),
        ({"prompt": [1, "a"]}, "prompt"),
        ({"suffix": "and then"}, "suffix"),
        ({"logprobs": 6}, "logprobs"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -1}, "max_tokens"),
        ({"n": 17}, "n"),
        ({"best_of": 3}, "best_of"),
        ({"echo": "yes"}, "echo"),
        ({"temperature": 2.5}, "temperature"),
        ({"logit_bias": {"1": 100.5}}, "logit_bias"),
        ({"max_tokens": 10**6}, "max_tokens"),
        ({"prompt": "x " * 600}, "prompt"),
    ],
)
def test_bad_input_is_a_400_naming_its_field(client: TestClient, extra: dict, param: str) -> None:
    assert_error(complete(client, **extra), 400, param)


def test_auto_routes_on_the_prompts_text(client: TestClient) -> None:
    r = complete(client, model="auto")
    assert r.status_code == 200, r.text
    assert r.json()["skillpool"]["reason"] == "no_skills" and r.headers["x-skillpool-route"] == "base"
    assert math.isfinite(r.json()["skillpool"]["score"])


def test_structured_outputs_constrain_every_prompts_answer(client: TestClient) -> None:
    labels = ["positive", "negative"]
    r = complete(client, prompt=["Review: great.", "Review: awful."], structured_outputs={"choice": labels}, n=2)
    assert r.status_code == 200, r.text
    assert [c["text"] for c in r.json()["choices"]] and all(c["text"] in labels for c in r.json()["choices"])
    regex = complete(client, guided_regex="[0-9]{3}", max_tokens=10)
    assert regex.status_code == 200 and len(regex.json()["choices"][0]["text"]) == 3
    assert regex.json()["choices"][0]["text"].isdigit()
    assert_error(complete(client, structured_outputs={"regex": "("}), 400, "structured_outputs.regex")
    assert_error(complete(client, structured_outputs={"choice": ["a"]}, echo=True, max_tokens=0), 400, "max_tokens")
