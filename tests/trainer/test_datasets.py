"""Upload validation: every error case names its line and field; good files normalize to one shape."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from skillpool.trainer.datasets import DatasetError, parse_jsonl, route_text


def jl(*objs: object) -> bytes:
    return b"\n".join(o if isinstance(o, bytes) else json.dumps(o).encode() for o in objs)


GOOD_CHAT = {
    "messages": [
        {"role": "system", "content": "Classify."},
        {"role": "user", "content": "great film"},
        {"role": "assistant", "content": "positive"},
    ]
}
GOOD_INST = {"instruction": "Classify the review.", "input": "great film", "output": "positive"}


def test_both_formats_normalize_to_prompt_answer_and_route_text() -> None:
    chat, inst = parse_jsonl(jl(GOOD_CHAT, GOOD_INST))
    assert chat == {
        "messages": [{"role": "system", "content": "Classify."}, {"role": "user", "content": "great film"}],
        "answer": "positive",
        "route_text": "Classify.\ngreat film",
        "route_input": "great film",  # without the system prompt: what a paraphrase of it keeps
    }
    assert inst["messages"] == [{"role": "user", "content": "Classify the review.\ngreat film"}]
    assert inst["answer"] == "positive" and inst["route_text"] == "Classify the review.\ngreat film"
    assert inst["route_input"] == "great film"
    [bare] = parse_jsonl(jl({"instruction": "Say hi.", "output": "hi"}))
    assert bare["route_input"] == "Say hi."  # no input: the instruction is all there is


def test_blank_lines_are_skipped() -> None:
    assert len(parse_jsonl(jl(GOOD_INST) + b"\n\n" + jl(GOOD_INST) + b"\n")) == 2


@pytest.mark.parametrize(
    ("line", "field", "fragment"),
    [
        (b"{not json", "", "not valid JSON"),
        (b"[" * 100_000 + b"]" * 100_000, "", "nested too deeply"),
        (b'{"instruction": ' + b"9" * 5000 + b"}", "", "not valid JSON (Exceeds the limit"),
        (b"\xff\xfe", "", "UTF-8"),
        (b"[1, 2]", "", "JSON object"),
        (json.dumps({"text": "hi"}).encode(), "", "expected a 'messages'"),
        (json.dumps({"messages": []}).encode(), "messages", "non-empty list"),
        (json.dumps({"messages": ["hi"]}).encode(), "messages[0]", "object"),
        (json.dumps({"messages": [{"role": "bot", "content": "x"}]}).encode(), "messages[0].role", "must be one of"),
        (json.dumps({"messages": [{"role": "user", "content": 3}]}).encode(), "messages[0].content", "string"),
        (json.dumps({"messages": [{"role": "user", "content": "q"}]}).encode(), "messages[0]", "assistant answer"),
        (
            json.dumps(
                {"messages": [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]}
            ).encode(),
            "messages",
            "user message",
        ),
        (json.dumps({"instruction": "x", "output": ""}).encode(), "output", "non-empty"),
        (json.dumps({"instruction": "", "input": "", "output": "y"}).encode(), "instruction", "both empty"),
        (json.dumps({"instruction": 5, "output": "y"}).encode(), "instruction", "string"),
    ],
)
def test_each_bad_line_is_reported_with_line_and_field(line: bytes, field: str, fragment: str) -> None:
    with pytest.raises(DatasetError) as exc:
        parse_jsonl(jl(GOOD_INST, line, GOOD_CHAT))
    [err] = exc.value.errors
    assert err.line == 2 and err.field == field and fragment in err.message
    assert "line 2" in str(exc.value)


def test_every_bad_line_is_listed() -> None:
    with pytest.raises(DatasetError) as exc:
        parse_jsonl(jl(b"oops", GOOD_INST, b"{}", GOOD_INST, {"instruction": "x"}))
    assert [e.line for e in exc.value.errors] == [1, 3, 5]
    assert exc.value.total_errors == 3


def test_too_few_and_too_many_examples() -> None:
    with pytest.raises(DatasetError, match="at least 3"):
        parse_jsonl(jl(GOOD_INST, GOOD_INST), min_examples=3)
    with pytest.raises(DatasetError, match="at most 1"):
        parse_jsonl(jl(GOOD_INST, GOOD_INST), max_examples=1)
    with pytest.raises(DatasetError, match="at least 1"):
        parse_jsonl(b"\n\n")


def test_route_text_is_system_plus_last_user_turn() -> None:
    msgs = [
        {"role": "system", "content": "S"},
        {"role": "user", "content": "first"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "second"},
    ]
    assert route_text(msgs) == "S\nsecond"


def test_an_imported_adapters_examples_may_leave_the_answer_out() -> None:
    chat = {"messages": [{"role": "system", "content": "Classify."}, {"role": "user", "content": "great film"}]}
    inst = {"instruction": "Classify the review.", "input": "great film"}
    got = parse_jsonl(jl(chat, inst, GOOD_INST), answers_optional=True)
    assert [e["answer"] for e in got] == ["", "", "positive"]
    assert got[0]["messages"] == chat["messages"] and got[0]["route_input"] == "great film"
    assert got[1]["route_text"] == got[2]["route_text"]  # the same request, with or without its answer
    with pytest.raises(DatasetError) as e:  # an upload trains on its answers: none may be missing
        parse_jsonl(jl(chat, inst))
    assert [(x.line, x.field) for x in e.value.errors] == [(1, "messages[1]"), (2, "output")]
    with pytest.raises(DatasetError) as e:  # an answer given empty, or a chat without a user turn, is still wrong
        parse_jsonl(
            jl({**inst, "output": " "}, {"messages": [{"role": "system", "content": "x"}]}), answers_optional=True
        )
    assert [(x.line, x.field) for x in e.value.errors] == [(1, "output"), (2, "messages")]


@given(
    lone=st.sampled_from(["\ud800", "\udfff", "a\udc80b"]),
    row=st.sampled_from(
        [
            ({"instruction": "I", "input": "X", "output": "Y"}, ["instruction", "input", "output"]),
            ({"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}, []),
        ]
    ),
    where=st.integers(0, 10),
    line=st.integers(0, 4),
)
def test_a_string_that_is_not_text_is_a_bad_line_naming_its_field(
    lone: str, row: tuple[dict, list[str]], where: int, line: int
) -> None:
    """A lone surrogate is valid JSON but no text (a tokenizer raises on it): wherever it sits, its line is bad."""
    obj, fields = json.loads(json.dumps(row[0])), row[1]
    if fields:
        field = fields[where % len(fields)]
        obj[field] += lone
    else:
        i = where % 2
        obj["messages"][i]["content"] += lone
        field = f"messages[{i}].content"
    lines = [json.dumps({"instruction": "I", "input": str(n), "output": "Y"}) for n in range(5)]
    lines[line] = json.dumps(obj)  # escaped, as any JSON writer sends it
    with pytest.raises(DatasetError) as e:
        parse_jsonl("\n".join(lines).encode())
    assert [(x.line, x.field) for x in e.value.errors] == [(line + 1, field)]
