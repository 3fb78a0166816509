"""Tools as the API takes them: checks that name the field, the default rendering and the template's own, the grammar
of required and named calls, and reading calls back from whole and streamed answers."""

from __future__ import annotations

import json
from typing import Any

import pytest
from transformers import AutoTokenizer

from skillpool.server.chat.protocol import ChatCompletionRequest
from skillpool.server.chat.tools import CallReader, CallStream, FunctionTool, ToolCall, ToolSpec, render
from skillpool.server.engines.chat_template import encode_chat, takes_tools
from skillpool.server.engines.grammar import GrammarCache
from skillpool.server.errors import APIError

USER = {"role": "user", "content": "Weather in Paris?"}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"enum": ["c", "f"]}},
            "required": ["city"],
        },
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}
CALLED = {
    "role": "assistant",
    "content": None,
    "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_1", "content": "18 C, sunny"}


def parse(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.parse({"model": "auto", "messages": [USER], **fields})


def spec(choice: str = "auto", parallel: bool = True) -> ToolSpec:
    r = parse(tools=[WEATHER, TIME], tool_choice=choice if choice in ("auto", "required", "none") else None)
    assert r.tool_spec is not None
    return ToolSpec(r.tool_spec.tools, choice, parallel)


@pytest.mark.parametrize(
    ("fields", "param", "says"),
    [
        ({"tools": {"a": 1}}, "tools", "list of at most 128"),
        ({"tools": [WEATHER] * 129}, "tools", "at most 128"),
        ({"tools": [{"type": "custom", "custom": {}}]}, "tools[0].type", "'type': 'function'"),
        (
            {"tools": [{"type": "function", "function": {"name": "get weather"}}]},
            "tools[0].function.name",
            "letters, digits",
        ),
        ({"tools": [{"type": "function", "function": {"name": "x" * 65}}]}, "tools[0].function.name", "1 to 64"),
        ({"tools": [WEATHER, WEATHER]}, "tools[1].function.name", "given twice"),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": 3}}}]},
            "tools[0].function.parameters",
            "not a valid JSON schema",
        ),
        ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
        ({"tools": [WEATHER], "tool_choice": "always"}, "tool_choice", "none, auto, required"),
        (
            {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
            "tool_choice.function.name",
            "not one of the tools",
        ),
        (
            {"tools": [WEATHER], "response_format": {"type": "json_object"}},
            "tool_choice",
            "cannot be combined with tools",
        ),
        ({"tools": [WEATHER], "parallel_tool_calls": "no"}, "parallel_tool_calls", "must be a boolean"),
        ({"messages": [USER, RESULT]}, "messages[1].tool_call_id", "answers no earlier assistant tool call"),
        ({"messages": [USER, {**USER, "tool_calls": []}]}, "messages[1].tool_calls", "only an assistant message"),
        ({"messages": [USER, CALLED, RESULT, RESULT]}, "messages[3].tool_call_id", "answers no earlier"),
        (
            {
                "messages": [
                    USER,
                    {**CALLED, "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "[1]"}}]},
                ]
            },
            "messages[1].tool_calls[0].function.arguments",
            "JSON object",
        ),
        (
            {"messages": [USER, {**CALLED, "tool_calls": [{"function": {"name": "f"}}]}]},
            "messages[1].tool_calls[0].id",
            "non-empty string",
        ),
    ],
)
def test_each_bad_tool_field_is_a_400_naming_it(fields: dict[str, Any], param: str, says: str) -> None:
    with pytest.raises(APIError) as e:
        parse(**fields)
    assert (e.value.status, e.value.param) == (400, param) and says in e.value.message, e.value.message


def test_tool_choice_defaults_and_what_each_constrains() -> None:
    assert parse(tools=[WEATHER]).tool_spec.choice == "auto"  # type: ignore[union-attr]
    assert parse(tools=[WEATHER]).output is None  # auto: free text, calls read back
    assert parse(tools=[WEATHER], tool_choice="none").tool_spec.active is False  # type: ignore[union-attr]
    named = parse(tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}})
    assert named.output is not None and named.output.constraint.kind == "grammar"
    assert [t.name for t in named.tool_spec.forced] == ["get_time"]  # type: ignore[union-attr]
    required = parse(tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert [t.name for t in required.tool_spec.forced] == ["get_weather", "get_time"]  # type: ignore[union-attr]
    assert required.tool_spec.parallel is False  # type: ignore[union-attr]


def call_text(name: str, args: dict[str, Any]) -> str:
    return f"<tool_call>\n{json.dumps({'name': name, 'arguments': args})}\n</tool_call>"


@pytest.mark.parametrize("parallel", [True, False])
def test_the_grammar_of_required_takes_calls_by_their_schemas_only(smollm, parallel: bool) -> None:  # type: ignore[no-untyped-def]
    tok = AutoTokenizer.from_pretrained(str(smollm.path))
    cache = GrammarCache(tok)
    c = spec("required", parallel).constraint()
    assert c is not None

    def takes(text: str) -> bool:
        g = cache.matcher(c)
        return all(g.advance(t) for t in tok(text, add_special_tokens=False)["input_ids"]) and g.matcher.is_accepting()

    one = call_text("get_weather", {"city": "Paris", "unit": "c"})
    assert takes(one) and takes(call_text("get_time", {}))
    assert takes(one + "\n" + call_text("get_time", {})) is parallel
    assert not takes(call_text("get_weather", {"unit": "c"}))  # city is required
    assert not takes(call_text("get_weather", {"city": "Paris", "unit": "k"}))
    assert not takes(call_text("get_news", {}))
    assert not takes(call_text("get_time", {"extra": 1}))  # objects are closed in a forced call
    assert not takes("It is sunny.")


def test_pydantic_defs_move_to_the_call_root_where_their_references_point(smollm) -> None:  # type: ignore[no-untyped-def]
    params = {
        "$defs": {"Unit": {"enum": ["c", "f"], "type": "string"}},
        "properties": {"unit": {"$ref": "#/$defs/Unit"}},
        "required": ["unit"],
        "type": "object",
    }
    tool = FunctionTool("convert", None, params)
    c = ToolSpec((tool,), "function:convert").constraint()
    assert c is not None
    GrammarCache(AutoTokenizer.from_pretrained(str(smollm.path))).compile(c)  # the reference resolves


def test_calls_are_read_back_and_anything_broken_stays_text() -> None:
    reader = CallReader(spec())
    text = "Let me look.\n" + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_time", {})
    content, calls = reader.read(text)
    assert content == "Let me look."
    assert [(c.name, c.arguments) for c in calls] == [("get_weather", {"city": "Paris"}), ("get_time", {})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("call_") for c in calls)
    out = calls[0].as_openai()
    assert out["type"] == "function" and json.loads(out["function"]["arguments"]) == {"city": "Paris"}
    for broken in (
        call_text("get_weather", {"unit": "c"}),  # fails its schema
        call_text("get_news", {}),  # no such tool
        "<tool_call>\n{not json}\n</tool_call>",
        "<tool_call>\n" + json.dumps({"name": "get_time", "arguments": {}}),  # never closed
    ):
        assert reader.read(broken) == (broken, [])
    one_only = CallReader(spec(parallel=False))
    content, calls = one_only.read(text)
    assert len(calls) == 1 and call_text("get_time", {}) in content


def test_a_stream_sends_text_at_once_and_each_call_whole() -> None:
    text = "Checking." + call_text("get_weather", {"city": "Paris"}) + "\n" + call_text("get_time", {}) + "\n"
    for size in (1, 3, 7, len(text)):
        stream = CallStream(spec())
        items: list[str | ToolCall] = []
        for i in range(0, len(text), size):
            items.extend(stream.push(text[i : i + size]))
        items.extend(stream.finish())
        content = "".join(x for x in items if isinstance(x, str))
        calls = [x for x in items if isinstance(x, ToolCall)]
        assert content == "Checking." and [c.name for c in calls] == ["get_weather", "get_time"]
    stream = CallStream(spec())
    held = list(stream.push("a <tool_"))
    assert held == ["a "]  # what may open a call waits
    assert list(stream.push("nothing>")) == ["<tool_nothing>"]
    assert list(stream.push("<tool_call>\n{bad")) == [] and list(stream.finish()) == ["<tool_call>\n{bad"]


def test_default_rendering_puts_tools_in_the_system_prompt_and_results_in_a_user_turn() -> None:
    r = parse(messages=[{"role": "system", "content": "Be brief."}, USER, CALLED, RESULT], tools=[WEATHER])
    messages, tools = r.template_input(takes_tools=False)
    assert tools is None
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "user"]
    assert messages[0]["content"].startswith("Be brief.\n\n# Tools")
    assert json.dumps(WEATHER) in messages[0]["content"]
    assert messages[2]["content"] == call_text("get_weather", {"city": "Paris"})
    assert messages[3]["content"] == "<tool_response>\n18 C, sunny\n</tool_response>"
    none, _ = parse(messages=[USER, CALLED, RESULT], tools=[WEATHER], tool_choice="none").template_input(False)
    assert "# Tools" not in json.dumps(none)  # none: the tools are not offered, the conversation still renders


def test_a_template_that_takes_tools_renders_them_itself(smollm) -> None:  # type: ignore[no-untyped-def]
    tok = AutoTokenizer.from_pretrained(str(smollm.path))
    assert not takes_tools(tok)  # SmolLM2's template: the default format
    tok.chat_template = (
        "{% for t in tools %}TOOL {{ t.function.name }}\n{% endfor %}"
        "{% for m in messages %}{{ m.role }}:{% if m.tool_calls %}{% for c in m.tool_calls %}CALL {{ c.function.name }}"
        "({{ c.function.arguments.city }}){% endfor %}{% else %}{{ m.content }}{% endif %}\n{% endfor %}"
    )
    assert takes_tools(tok)
    r = parse(messages=[USER, CALLED, RESULT], tools=[WEATHER])
    messages, tools = r.template_input(takes_tools=True)
    assert tools == [WEATHER]
    text = tok.decode(encode_chat(tok, messages, tools))
    assert "TOOL get_weather" in text and "CALL get_weather(Paris)" in text and "tool:18 C, sunny" in text
    assert parse(messages=[USER], tools=[WEATHER], tool_choice="none").template_input(True)[1] is None
    assert render([USER], None, True) == ([{"role": "user", "content": USER["content"]}], None)
