"""Output constraints in the hf engine: compiled once (a bounded cache), a token mask per row inside the batched
step, constrained and free rows (base and mixes) in one batch, and a grammar that allows nothing ends only its
row."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import jsonschema
import pytest
import torch
from transformers import AutoTokenizer

from skillpool.server.chat.structured import json_constraint
from skillpool.server.engines import Constraint, ConstraintError, SamplingParams
from skillpool.server.engines.grammar import GrammarCache, Masks, RowGrammar
from skillpool.server.engines.hf import HFEngine
from skillpool.server.engines.rows import sample
from tests.schema_family import schema_family
from tests.server.test_engine import Run, make_engine, run

CHOICES = ["positive", "negative", "neutral"]


@pytest.fixture(scope="module")
def tokenizer(tiny_base) -> Any:  # type: ignore[no-untyped-def]
    return AutoTokenizer.from_pretrained(str(tiny_base.path))


@pytest.fixture(scope="module")
def cache(tokenizer) -> GrammarCache:  # type: ignore[no-untyped-def]
    return GrammarCache(tokenizer)


@pytest.fixture(scope="module")
def engine(tiny_base) -> HFEngine:  # type: ignore[no-untyped-def]
    eng = make_engine(tiny_base)
    yield eng
    eng.close()


def ids(tokenizer: Any, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def test_a_constraint_compiles_once_and_the_cache_is_bounded(tokenizer) -> None:  # type: ignore[no-untyped-def]
    cache = GrammarCache(tokenizer, size=2)
    a, b, c = (Constraint("regex", r) for r in ("[0-9]+", "[a-z]+", "(yes|no)"))
    assert cache.compile(a) is cache.compile(a)
    assert (cache.compiles, cache.hits) == (1, 1)
    cache.compile(b)
    cache.compile(c)  # a, the least recently used, leaves
    assert len(cache) == 2 and cache.compiles == 3
    cache.compile(a)
    assert cache.compiles == 4


@pytest.mark.parametrize(
    ("constraint", "says"),
    [
        (Constraint("regex", "(abc"), "unclosed group"),
        (json_constraint({"type": "integer", "minimum": 5, "maximum": 3}), "minimum (5) is greater than maximum (3)"),
        (json_constraint({"$ref": "#/$defs/missing"}), "missing"),
        (Constraint("grammar", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_what_the_grammar_engine_refuses_is_a_constraint_error(cache: GrammarCache, constraint, says: str) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(ConstraintError, match=re.escape(says)):
        cache.compile(constraint)


def test_a_mask_allows_exactly_what_the_grammar_allows(cache: GrammarCache, tokenizer) -> None:  # type: ignore[no-untyped-def]
    masks = Masks(cache.vocab_size)
    g = cache.matcher(Constraint("choice", json.dumps(CHOICES)))
    logits = torch.zeros(2, cache.vocab_size)
    masks.apply(logits, [g, None])
    allowed = set(torch.nonzero(torch.isfinite(logits[0])).flatten().tolist())
    firsts = {ids(tokenizer, c)[0] for c in CHOICES}
    assert firsts <= allowed and len(allowed) < 50  # a few prefixes of the three words, nothing else
    assert tokenizer.eos_token_id not in allowed  # the row cannot end before its grammar accepts
    assert bool(torch.isfinite(logits[1]).all())  # the free row is untouched
    for t in ids(tokenizer, "negative"):
        assert g.advance(t)
    assert g.complete and g.error is None


def test_the_end_is_allowed_once_the_grammar_accepts(cache: GrammarCache, tokenizer) -> None:  # type: ignore[no-untyped-def]
    masks = Masks(cache.vocab_size)
    g = cache.matcher(Constraint("regex", "[0-9]+"))
    eos = tokenizer.eos_token_id

    def allows_end() -> bool:
        logits = torch.zeros(1, cache.vocab_size)
        masks.apply(logits, [g])
        return bool(torch.isfinite(logits[0, eos]))

    assert not allows_end()
    assert g.advance(ids(tokenizer, "7")[0])
    assert allows_end() and not g.complete  # accepting, and more digits may follow


def test_a_grammar_in_error_allows_nothing_and_its_row_fails_alone(cache: GrammarCache, tokenizer) -> None:  # type: ignore[no-untyped-def]
    masks = Masks(cache.vocab_size)
    bad, good = cache.matcher(Constraint("regex", "[0-9]+")), cache.matcher(Constraint("regex", "[0-9]+"))
    assert not bad.advance(ids(tokenizer, "x")[0])  # a token the grammar refuses: llguidance's error state
    assert bad.error is not None
    logits = torch.randn(3, cache.vocab_size, generator=torch.Generator().manual_seed(0))
    assert not bool(torch.isfinite(masks.apply(logits.clone(), [bad, good, None])[0]).any())

    class R:  # the attributes of a row that sample reads here, beside its parameters
        def __init__(self, g: RowGrammar | None) -> None:
            self.grammar, self.gen, self.answer = g, None, []
            params = SamplingParams(max_tokens=1, temperature=0.0)
            self.req = type("Req", (), {"params": params, "prompt_ids": [1, 2]})()

    got = sample(logits, [R(bad), R(good), R(None)], masks=masks)  # type: ignore[list-item]
    assert got[0] is None and got[1] is not None and got[2] is not None
    assert tokenizer.decode([got[1].token]).isdigit() and got[2].token == int(logits[2].argmax())


def test_a_constrained_row_whose_logits_are_not_finite_still_fails(cache: GrammarCache) -> None:
    masks = Masks(cache.vocab_size)
    g = cache.matcher(Constraint("regex", "[0-9]+"))
    logits = torch.zeros(1, cache.vocab_size)
    logits[0, 5] = math.nan  # a token the mask refuses: masking must not hide it
    masks.apply(logits, [g])
    assert bool(torch.isnan(logits[0]).all())


def constrained(engine: HFEngine, prompt: str, c: Constraint, mix=(), **kw) -> Run:  # type: ignore[no-untyped-def]
    engine.prepare(SamplingParams(max_tokens=1, constraint=c))
    return Run(engine, prompt, mix, constraint=c, **kw)


def test_constrained_and_free_rows_share_a_batch_and_free_rows_are_unchanged(engine: HFEngine) -> None:
    prompts = ["Hello there", "What is the topic of this news article about football?", "x"]
    mixes = [(), (("one", 1.0),), (("one", 0.5), ("two", 0.5))]
    alone = run(engine, prompts, mixes, max_tokens=16)
    schemas = schema_family(seed=1, n=3)
    runs: list[tuple[Run, Any]] = []
    for i, schema in enumerate(schemas):  # each constrained row beside a free one, base and mixes alike
        runs.append((constrained(engine, prompts[i], json_constraint(schema), mixes[i], max_tokens=400), schema))
        runs.append((Run(engine, prompts[i], mixes[i], max_tokens=16), None))
    choice = constrained(engine, "Pick one", Constraint("choice", json.dumps(CHOICES)), mixes[2], max_tokens=20)
    regex = constrained(engine, "A code", Constraint("regex", r"[A-Z]{2}-[0-9]{3}"), mixes[1], max_tokens=20)
    free = []
    for r, schema in runs:
        text, finish, _ = r.result()
        if schema is None:
            free.append((text, finish))
        else:
            assert finish == "stop", text
            jsonschema.validate(json.loads(text), schema)
    assert free == [(t, f) for t, f, _ in alone]
    assert choice.result()[:2] in [(c, "stop") for c in CHOICES]
    text, finish, _ = regex.result()
    assert finish == "stop" and re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text), text


def test_a_constrained_row_ends_at_max_tokens_with_length(engine: HFEngine) -> None:
    c = json_constraint({"type": "array", "items": {"type": "integer"}, "minItems": 50})
    text, finish, tokens = constrained(engine, "Numbers", c, max_tokens=5).result()
    assert (finish, tokens) == ("length", 5) and text.startswith("[")


def test_a_grammar_that_allows_nothing_ends_only_its_row(engine: HFEngine, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Fault injection: the poisoned row's grammar is driven into llguidance's error state (a token it refuses) as
    it takes its first token; from then on it allows no token at all."""
    c = Constraint("regex", "[a-z]{30}")
    advance = RowGrammar.advance
    poisoned: list[RowGrammar] = []

    def refusing(self: RowGrammar, token: int) -> bool:
        if self in poisoned and not self.matcher.is_error() and self.matcher.consume_token(token):
            self.matcher.consume_token(engine.tokenizer.convert_tokens_to_ids("0"))  # refused: error state
            return True
        return advance(self, token)

    monkeypatch.setattr(RowGrammar, "advance", refusing)
    matcher = engine.grammars.matcher
    monkeypatch.setattr(
        engine.grammars, "matcher", lambda cc: poisoned.append(matcher(cc)) or poisoned[-1] if cc == c else matcher(cc)
    )
    expected = run(engine, ["Hello there", "A longer prompt"], [(), (("two", 1.0),)], max_tokens=12)
    good = [Run(engine, "Hello there", max_tokens=12), Run(engine, "A longer prompt", (("two", 1.0),), max_tokens=12)]
    bad = constrained(engine, "Letters", c, max_tokens=12)
    text, finish, _ = bad.result()
    assert finish == "error" and "output constraint" in (bad.events[-1][1].error or "")
    assert [g.result() for g in good] == expected
    assert engine.healthy() and run(engine, ["Hi"], max_tokens=3)[0][1] == "length"
