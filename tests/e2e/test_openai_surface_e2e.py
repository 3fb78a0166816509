"""The OpenAI surface end to end on both engines, through the unmodified openai client and the real SmolLM2:
n choices, logprobs (greedy token first among its alternatives), logit_bias moving the greedy token, penalties
changing a repetitive answer, completions' prompt logprobs (one per prompt token, equal to transformers' own
log-softmax of the same model), and the Responses API streamed and not.

The vllm rows run in the vllm tier: `.venv-vllm/bin/python -m pytest -m vllm --slow tests/e2e/test_openai_surface_e2e.py`.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

pytestmark = pytest.mark.slow

BASE = "SmolLM2-135M-Instruct"
# prompt logprobs against transformers' float32 log-softmax: the hf engine computes the same forward (batched
# differently: float32 sums in another order); vLLM's CPU kernels (attention, fused norms) differ more
TOLERANCE = {"hf": 1e-4, "vllm": 5e-3}
ENGINES = [pytest.param("hf", id="hf"), pytest.param("vllm", id="vllm", marks=pytest.mark.vllm)]


@pytest.fixture(scope="module", params=ENGINES)
def served(request, tmp_path_factory) -> Iterator[tuple[str, str]]:  # type: ignore[no-untyped-def]
    from skillpool.evaluation.process import ServerProcess

    engine = request.param
    flags = ["--engine", engine, "--max-batch-size", "8"]
    if engine == "vllm":
        pytest.importorskip("vllm", reason="vLLM is not installed: bash setup.sh --engine vllm")
        flags += ["--max-model-len", "1024"]
    data = Path(tmp_path_factory.mktemp(f"surface-{engine}")) / "data"
    with ServerProcess(data, flags, startup_s=900 if engine == "vllm" else 300) as srv:
        yield engine, srv.url


def openai(url: str) -> Any:
    from openai import OpenAI

    return OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=600)


def ask(client: Any, content: str, **kw: Any) -> Any:
    args = {"model": BASE, "messages": [{"role": "user", "content": content}], "temperature": 0, "max_tokens": 12}
    return client.chat.completions.create(**{**args, **kw})


def test_n_choices(served) -> None:  # type: ignore[no-untyped-def]
    _, url = served
    client = openai(url)
    r = ask(client, "Write a short poem about the sea.", n=3, temperature=1.0, seed=5, max_tokens=16)
    assert [c.index for c in r.choices] == [0, 1, 2]
    texts = [c.message.content for c in r.choices]
    assert all(texts) and len(set(texts)) > 1
    assert r.usage.completion_tokens >= 3
    greedy = ask(client, "Name a colour.", n=2)
    assert greedy.choices[0].message.content == greedy.choices[1].message.content


def test_logprobs_put_the_greedy_token_first(served) -> None:  # type: ignore[no-untyped-def]
    _, url = served
    client = openai(url)
    r = ask(client, "What is the capital of France?", logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    ended = r.choices[0].finish_reason == "stop"  # the end of sequence has a logprob too, but is no text or usage
    assert len(content) == r.usage.completion_tokens + ended
    assert "".join(t.token for t in content[: r.usage.completion_tokens]) == r.choices[0].message.content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3 and t.top_logprobs[0].token == t.token
        assert t.top_logprobs[0].logprob == pytest.approx(t.logprob, abs=1e-4)
        assert bytes(t.bytes).decode("utf-8", "replace") == t.token
    streamed = []
    for chunk in ask(client, "What is the capital of France?", logprobs=True, top_logprobs=3, stream=True):
        if chunk.choices and chunk.choices[0].logprobs:
            streamed += chunk.choices[0].logprobs.content
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-4)


def test_a_bias_of_minus_100_on_the_greedy_first_token_changes_it(served) -> None:  # type: ignore[no-untyped-def]
    _, url = served
    client = openai(url)
    first = ask(client, "Say hello.", logprobs=True, max_tokens=1).choices[0].logprobs.content[0].token
    tokens = httpx.post(url + "/tokenize", json={"prompt": first, "add_special_tokens": False}).json()["tokens"]
    assert len(tokens) == 1
    moved = ask(client, "Say hello.", logprobs=True, max_tokens=1, logit_bias={str(tokens[0]): -100})
    assert moved.choices[0].logprobs.content[0].token != first


def test_penalties_change_a_repetitive_answer(served) -> None:  # type: ignore[no-untyped-def]
    _, url = served
    client = openai(url)
    prompt = "Write the word 'hello' ten times."  # SmolLM2 writes it until max_tokens

    def most_repeated(text: str) -> int:
        words = re.findall(r"\w+", text.lower())
        return max(words.count(w) for w in set(words)) if words else 0

    plain = ask(client, prompt, max_tokens=40).choices[0].message.content
    assert most_repeated(plain) >= 5  # the model does repeat itself here
    for penalty in ({"frequency_penalty": 2.0}, {"presence_penalty": 2.0}):
        held = ask(client, prompt, max_tokens=40, **penalty).choices[0].message.content
        assert held != plain and most_repeated(held) < most_repeated(plain), (penalty, held)


def test_completions_echo_one_logprob_per_prompt_token_as_transformers_computes_them(served, smollm) -> None:  # type: ignore[no-untyped-def]
    import torch
    from transformers import AutoModelForCausalLM

    engine, url = served
    client = openai(url)
    prompt = "The quick brown fox jumps over the lazy dog because it"
    ids = httpx.post(url + "/tokenize", json={"prompt": prompt}).json()["tokens"]
    r = client.completions.create(model=BASE, prompt=prompt, echo=True, logprobs=1, max_tokens=0, temperature=0)
    lp = r.choices[0].logprobs
    assert r.choices[0].text == prompt and len(lp.tokens) == len(ids) == r.usage.prompt_tokens
    assert lp.token_logprobs[0] is None and all(v <= 0 for v in lp.token_logprobs[1:])
    model = AutoModelForCausalLM.from_pretrained(str(smollm.path), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    expected = ref[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]
    got = torch.tensor(lp.token_logprobs[1:])
    assert torch.allclose(got, expected, atol=TOLERANCE[engine]), (got - expected).abs().max()


def test_responses_streamed_and_not(served) -> None:  # type: ignore[no-untyped-def]
    _, url = served
    client = openai(url)
    args: dict[str, Any] = {
        "model": BASE,
        "instructions": "Answer briefly.",
        "input": "What is the capital of France?",
        "temperature": 0,
        "max_output_tokens": 16,
    }
    whole = client.responses.create(**args)
    messages = [{"role": "system", "content": args["instructions"]}, {"role": "user", "content": args["input"]}]
    chat = client.chat.completions.create(model=BASE, messages=messages, temperature=0, max_tokens=16)
    assert whole.output_text == chat.choices[0].message.content and whole.output_text
    assert whole.status == ("incomplete" if chat.choices[0].finish_reason == "length" else "completed")
    assert whole.model_extra["skillpool"]["reason"] == "base"
    deltas, kinds, last = [], [], None
    for event in client.responses.create(**args, stream=True):
        kinds.append(event.type)
        if event.type == "response.output_text.delta":
            deltas.append(event.delta)
        last = event
    assert kinds[0] == "response.created" and kinds[-1] == f"response.{whole.status}"
    assert last is not None and last.response.output_text == whole.output_text == "".join(deltas)
    if whole.status == "completed":  # the SDK's own stream helper, which ends at response.completed
        with client.responses.stream(**args) as stream:
            assert stream.get_final_response().output_text == whole.output_text
