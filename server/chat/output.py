"""The one conversion of a request's output fields into the engine's constraint, for every endpoint that takes them:
a response format (OpenAI's `response_format`, or vLLM's `structured_outputs` and its older `guided_*` fields) or
tools under `required` or a named function. At most one may constrain an answer."""

from __future__ import annotations

from typing import Any

from .structured import FormatError, OutputFormat, guided, response_format, structured_outputs
from .tools import ToolSpec


def output_constraint(
    fmt: Any = None, structured: Any = None, guided_fields: dict[str, Any] | None = None, tools: ToolSpec | None = None
) -> OutputFormat | None:
    """The constraint of a request, or None. `fmt`: response_format; `structured`: structured_outputs;
    `guided_fields`: vLLM's older guided_* fields by name; `tools`: the checked tools and choice. Raises FormatError naming the
    field at fault, also when two fields would constrain the same answer."""
    found = [
        f for f in (response_format(fmt), structured_outputs(structured), guided(guided_fields or {})) if f is not None
    ]
    fields = [f.param.split(".")[0] for f in found]
    if tools is not None and tools.active:
        if found:
            raise FormatError(
                f"{fields[0]} cannot be combined with tools (tool_choice 'none' answers in that format)", "tool_choice"
            )
        c = tools.constraint()
        return OutputFormat(c, "tools") if c is not None else None
    if len(found) > 1:
        raise FormatError(f"{fields[0]} and {fields[1]} both constrain the answer: give one", fields[1])
    return found[0] if found else None
