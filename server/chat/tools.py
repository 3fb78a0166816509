"""Function calling: OpenAI's `tools`, `tool_choice` and `parallel_tool_calls`, assistant `tool_calls` and `tool`
messages, rendered for the model and read back from its answer.

A chat template that takes tools renders them itself (the engine's `takes_tools`); otherwise they go into the
system prompt in one documented default format, the Hermes one many open models are trained on (Qwen2.5's
template writes the same): the tools as JSON inside <tools></tools>, each call the model makes as
`<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>`, each result as a user turn inside
<tool_response></tool_response>. The answer is read in that format whatever the template: `required` and a named
function are a grammar over it (every call then parses and its arguments follow the function's schema); under
`auto` a call that does not parse, names no tool or whose arguments fail its schema stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from jsonschema import Draft202012Validator
from jsonschema.validators import validator_for

from ..engines import Constraint
from ..engines.grammar import json_text
from .structured import FUNCTION_NAME, JSON_STYLE, FormatError, check_schema, closed

MAX_TOOLS = 128  # OpenAI's limit
OPEN, CLOSE = "<tool_call>", "</tool_call>"
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}}
TOOLS_PROMPT = """# Tools

You may call one or more functions to assist with the user query.

You are provided with function signatures within <tools></tools> XML tags:
<tools>
{tools}
</tools>

For each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:
<tool_call>
{{"name": <function-name>, "arguments": <args-json-object>}}
</tool_call>"""


@dataclass(frozen=True)
class FunctionTool:
    name: str
    description: str | None
    parameters: dict[str, Any]

    def as_openai(self) -> dict[str, Any]:
        fn: dict[str, Any] = {"name": self.name}
        if self.description is not None:
            fn["description"] = self.description
        fn["parameters"] = self.parameters
        return {"type": "function", "function": fn}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict[str, Any]
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def as_openai(self) -> dict[str, Any]:
        arguments = json.dumps(self.arguments, ensure_ascii=False)
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": arguments}}


def check_tools(value: Any) -> list[FunctionTool]:
    """OpenAI's `tools`: at most MAX_TOOLS function tools, each with a valid, unique name and a valid schema."""
    if not isinstance(value, list) or len(value) > MAX_TOOLS:
        raise FormatError(f"tools must be a list of at most {MAX_TOOLS} tools", "tools")
    out: list[FunctionTool] = []
    for i, t in enumerate(value):
        at = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise FormatError(f"{at} must be {{'type': 'function', 'function': {{...}}}}", f"{at}.type")
        fn = t["function"]
        name = fn.get("name")
        if not isinstance(name, str) or not FUNCTION_NAME.fullmatch(name):
            raise FormatError(
                f"{at}.function.name must be 1 to 64 letters, digits, underscores or dashes, got {name!r}",
                f"{at}.function.name",
            )
        if any(o.name == name for o in out):
            raise FormatError(f"{at}.function.name {name!r} is given twice", f"{at}.function.name")
        description = fn.get("description")
        if description is not None and not isinstance(description, str):
            raise FormatError(f"{at}.function.description must be a string", f"{at}.function.description")
        strict = fn.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise FormatError(f"{at}.function.strict must be a boolean", f"{at}.function.strict")
        params = fn.get("parameters")
        params = NO_PARAMETERS if params is None else check_schema(params, f"{at}.function.parameters")
        out.append(FunctionTool(name, description, params))  # strict or not, a forced call's objects are closed
    return out


def check_tool_choice(value: Any, tools: Sequence[FunctionTool]) -> str:
    """`none`, `auto`, `required`, or the name of the one function a named choice forces."""
    if value is None:
        return "auto" if tools else "none"
    if not tools:
        raise FormatError("tool_choice is only allowed when tools are given", "tool_choice")
    if value in ("none", "auto", "required"):
        return str(value)
    fn = value.get("function") if isinstance(value, dict) and value.get("type") == "function" else None
    name = fn.get("name") if isinstance(fn, dict) else None
    if not isinstance(name, str):
        raise FormatError(
            "tool_choice must be none, auto, required or {'type': 'function', 'function': {'name': ...}}",
            "tool_choice",
        )
    if not any(t.name == name for t in tools):
        raise FormatError(f"tool_choice names {name!r}, which is not one of the tools", "tool_choice.function.name")
    return f"function:{name}"


def check_tool_call(call: Any, at: str) -> tuple[str, str, dict[str, Any]]:
    """An assistant message's tool call: (id, function name, arguments)."""
    if not isinstance(call, dict) or not isinstance(call.get("id"), str) or not call["id"]:
        raise FormatError(f"{at}.id must be a non-empty string", f"{at}.id")
    fn = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise FormatError(f"{at} must be {{'id', 'type': 'function', 'function': {{'name', 'arguments'}}}}", at)
    raw = fn.get("arguments", "{}")
    try:
        args = json.loads(raw) if isinstance(raw, str) else None
    except (json.JSONDecodeError, RecursionError):
        args = None
    if not isinstance(args, dict):
        raise FormatError(f"{at}.function.arguments must be a JSON object as a string", f"{at}.function.arguments")
    return call["id"], fn["name"], args


def check_tool_messages(messages: Sequence[dict[str, Any]]) -> None:
    """Every `tool` message answers a call of an earlier assistant message that no other tool message answered."""
    open_calls: set[str] = set()
    for i, m in enumerate(messages):
        calls = m.get("tool_calls")
        if calls is not None and (m.get("role") != "assistant" or not isinstance(calls, list)):
            raise FormatError(
                f"messages[{i}].tool_calls: only an assistant message carries a list of calls",
                f"messages[{i}].tool_calls",
            )
        if m.get("role") == "assistant":
            for j, call in enumerate(calls or []):
                open_calls.add(check_tool_call(call, f"messages[{i}].tool_calls[{j}]")[0])
        elif m.get("role") == "tool":
            cid = m.get("tool_call_id")
            if not isinstance(cid, str) or cid not in open_calls:
                raise FormatError(
                    f"messages[{i}] is a tool message whose tool_call_id {cid!r} answers no earlier assistant tool call",
                    f"messages[{i}].tool_call_id",
                )
            open_calls.discard(cid)


@dataclass(frozen=True)
class ToolSpec:
    """A request's tools and what it asks of them."""

    tools: tuple[FunctionTool, ...]
    choice: str  # none | auto | required | function:NAME
    parallel: bool = True

    @property
    def active(self) -> bool:
        """Whether the model is offered the tools (and its answer read for calls)."""
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> tuple[FunctionTool, ...]:
        """The functions a grammar restricts the answer to: one for a named choice, all under `required`."""
        if self.choice == "required":
            return self.tools
        if self.choice.startswith("function:"):
            return tuple(t for t in self.tools if t.name == self.choice.removeprefix("function:"))
        return ()

    def constraint(self) -> Constraint | None:
        """The grammar of `required` and of a named function: calls in the default format, each call's arguments
        by its function's schema; one call, or one or more under `required` with parallel calls."""
        tools = self.forced
        if not tools:
            return None
        alternatives = " | ".join(f"%json {json_text(call_schema(t))}" for t in tools)
        many = self.choice == "required" and self.parallel
        start = 'start: call ("\\n" call)*' if many else "start: call"
        return Constraint("grammar", f'{start}\ncall: "{OPEN}\\n" ({alternatives}) "\\n{CLOSE}"\n')

    def schemas(self) -> dict[str, dict[str, Any]]:
        return {t.name: t.parameters for t in self.tools}


def call_schema(t: FunctionTool) -> dict[str, Any]:
    """The JSON of one call to `t`: {"name": its name, "arguments": by its schema}. The arguments' `$defs` move to
    the call's root, where their `#/$defs/...` references point."""
    params = dict(closed(t.parameters))
    defs: dict[str, Any] = {k: params.pop(k) for k in ("$defs", "definitions") if k in params}
    params.pop("$schema", None)
    return {
        "type": "object",
        "properties": {"name": {"const": t.name}, "arguments": params},
        "required": ["name", "arguments"],
        "additionalProperties": False,
        **defs,
        "x-guidance": JSON_STYLE,
    }


def render(
    messages: Sequence[dict[str, Any]], spec: ToolSpec | None, takes_tools: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages (roles, text, calls and results) as the chat template takes them, and the tools to pass it:
    the template's own way where it takes tools, else the default format written into the messages."""
    tools = [t.as_openai() for t in spec.tools] if spec is not None and spec.active else None
    if takes_tools:
        return [_hf_message(m) for m in messages], tools
    out: list[dict[str, Any]] = []
    for m in messages:
        if m["role"] == "tool":
            text = f"<tool_response>\n{m['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):  # results in a row make one user turn
                out[-1]["content"] += "\n" + text
            else:
                out.append({"role": "user", "content": text, "tool_results": True})
        elif m["role"] == "assistant" and m.get("tool_calls"):
            calls = [_call_text(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in m["tool_calls"]]
            out.append({"role": "assistant", "content": "\n".join([m["content"], *calls] if m["content"] else calls)})
        else:
            out.append({"role": m["role"], "content": m["content"]})
    for m in out:
        m.pop("tool_results", None)
    if tools:
        block = TOOLS_PROMPT.format(tools="\n".join(json.dumps(t, ensure_ascii=False) for t in tools))
        if out and out[0]["role"] == "system":
            out[0] = {"role": "system", "content": f"{out[0]['content']}\n\n{block}" if out[0]["content"] else block}
        else:
            out.insert(0, {"role": "system", "content": block})
    return out, None


def _hf_message(m: dict[str, Any]) -> dict[str, Any]:
    """A message in transformers' chat format: tool calls with their arguments as objects."""
    out = {"role": m["role"], "content": m["content"]}
    if m.get("tool_calls"):
        out["tool_calls"] = [
            {
                "id": c["id"],
                "type": "function",
                "function": {"name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])},
            }
            for c in m["tool_calls"]
        ]
    if m["role"] == "tool":
        out["tool_call_id"] = m["tool_call_id"]
    return out


def _call_text(name: str, arguments: dict[str, Any]) -> str:
    return f"{OPEN}\n{json.dumps({'name': name, 'arguments': arguments}, ensure_ascii=False)}\n{CLOSE}"


_CALL = re.compile(re.escape(OPEN) + r"(.*?)" + re.escape(CLOSE), re.S)


class CallReader:
    """Reads calls out of an answer's text: a block that parses, names a tool and whose arguments follow its
    schema is a call; anything else stays text."""

    def __init__(self, spec: ToolSpec) -> None:
        self.spec = spec
        self.validators = {n: validator_for(s, default=Draft202012Validator)(s) for n, s in spec.schemas().items()}

    def call(self, block: str) -> ToolCall | None:
        try:
            obj = json.loads(block)
        except (json.JSONDecodeError, RecursionError):
            return None
        if not isinstance(obj, dict) or set(obj) - {"name", "arguments"}:
            return None
        name, args = obj.get("name"), obj.get("arguments", {})
        v = self.validators.get(name) if isinstance(name, str) else None
        if v is None or not isinstance(args, dict) or not v.is_valid(args):
            return None
        return ToolCall(str(name), args)

    def read(self, text: str) -> tuple[str, list[ToolCall]]:
        """(the text outside the calls, the calls): at most one call unless parallel calls are allowed."""
        calls: list[ToolCall] = []
        kept: list[str] = []
        at = 0
        for m in _CALL.finditer(text):
            call = self.call(m.group(1))
            if call is None or (calls and not self.spec.parallel):
                continue
            kept.append(text[at : m.start()])
            at = m.end()
            calls.append(call)
        kept.append(text[at:])
        return ("".join(kept).strip() if calls else text), calls


class CallStream:
    """The calls of a streamed answer as they complete: text goes out as content at once, except what may begin a
    call (held back until it does or cannot); a call goes out whole when its closing tag arrives, or as text when
    it does not parse."""

    def __init__(self, spec: ToolSpec) -> None:
        self.reader = CallReader(spec)
        self.buffer = ""
        self.calls: list[ToolCall] = []

    def push(self, text: str) -> Iterable[str | ToolCall]:
        self.buffer += text
        while self.buffer:
            start = self.buffer.find(OPEN)
            if start == -1:
                keep = _partial_open(self.buffer)
                out, self.buffer = self.buffer[: len(self.buffer) - keep], self.buffer[len(self.buffer) - keep :]
                if out:
                    yield from self._text(out)
                return
            if start:
                yield from self._text(self.buffer[:start])
                self.buffer = self.buffer[start:]
            end = self.buffer.find(CLOSE)
            if end == -1:
                return  # inside a call: wait for its end
            block, self.buffer = self.buffer[: end + len(CLOSE)], self.buffer[end + len(CLOSE) :]
            call = self.reader.call(block[len(OPEN) : end])
            if call is None or (self.calls and not self.reader.spec.parallel):
                yield from self._text(block)
            else:
                self.calls.append(call)
                yield call

    def finish(self) -> Iterable[str | ToolCall]:
        """What is still held when the answer ends: an unfinished call is text."""
        rest, self.buffer = self.buffer, ""
        if rest:
            yield from self._text(rest)

    def _text(self, text: str) -> Iterable[str]:
        # whitespace between calls, and after the last one, is not content
        if self.calls and not text.strip():
            return
        yield text


def _partial_open(text: str) -> int:
    """How many trailing characters may be the start of OPEN."""
    for k in range(min(len(OPEN) - 1, len(text)), 0, -1):
        if text.endswith(OPEN[:k]):
            return k
    return 0
