"""Upload validation: every line of a JSONL task file is checked before anything is stored.

Two formats are accepted, one per line (they may not be mixed silently: each line is checked alone):
  OpenAI chat fine-tuning:  {"messages": [{"role": "system"|"user"|"assistant", "content": str}, ...]}
                            (the last message is the assistant answer that is learned)
  instruction:              {"instruction": str, "input": str, "output": str}
Every example is normalized to {"messages": prompt messages, "answer": str, "route_text": str, "route_input": str}:
route_text is what the router sees, route_input the same without the instruction (the router's format gate
and keys use it to follow paraphrased instructions).
An imported adapter's examples (`answers_optional`) may leave the answer out: a chat row then ends with its user
turn, an instruction row has no `output`, and the example's answer is "".
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from skillpool.router.texts import route_text

from .records import Example

__all__ = ["DatasetError", "Example", "LineError", "parse_jsonl", "route_text", "unencodable"]

ROLES = frozenset({"system", "developer", "user", "assistant"})
MAX_REPORTED_ERRORS = 50


@dataclass(frozen=True)
class LineError:
    line: int
    field: str
    message: str

    def __str__(self) -> str:
        if self.line == 0:  # a whole-file problem
            return f"{self.field}: {self.message}"
        return f"line {self.line}: {self.field}: {self.message}" if self.field else f"line {self.line}: {self.message}"


class DatasetError(ValueError):
    def __init__(self, errors: list[LineError], total_errors: int | None = None) -> None:
        self.errors = errors
        self.total_errors = total_errors if total_errors is not None else len(errors)
        shown = "; ".join(str(e) for e in errors[:10])
        more = f" (and {self.total_errors - 10} more)" if self.total_errors > 10 else ""
        super().__init__(f"invalid dataset: {self.total_errors} bad line(s): {shown}{more}")


NOT_TEXT = "not valid UTF-8 text (a lone surrogate such as \\ud800, or bytes that are not UTF-8)"


def unencodable(value: Any, path: str = "") -> str | None:
    """Where the first string of a JSON value (a key or a value) that UTF-8 cannot encode is, or None when every
    one is text. A lone surrogate (JSON's `"\\ud800"`) is valid JSON but no text: a tokenizer or a response raises
    on it. The place is a path below `path`, `messages[0].content`; a key names the object that holds it."""
    todo: list[tuple[Any, str]] = [(value, path)]  # a stack, not recursion: JSON may nest as deep as its parser allows
    while todo:
        item, path = todo.pop()
        if isinstance(item, str):
            if not _text(item):
                return path
        elif isinstance(item, dict):
            if not all(_text(k) for k in item):
                return path
            todo.extend((v, f"{path}.{k}" if path else k) for k, v in reversed(item.items()))
        elif isinstance(item, list):
            todo.extend((v, f"{path}[{i}]") for i, v in reversed(list(enumerate(item))))
    return None


def _text(s: str) -> bool:
    if s.isascii():
        return True
    try:
        s.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def _from_messages(obj: dict[str, Any], line: int, errs: list[LineError], optional: bool) -> Example | None:
    msgs = obj["messages"]
    if not isinstance(msgs, list) or not msgs:
        errs.append(LineError(line, "messages", "must be a non-empty list"))
        return None
    clean: list[dict[str, str]] = []
    for i, m in enumerate(msgs):
        where = f"messages[{i}]"
        if not isinstance(m, dict):
            errs.append(LineError(line, where, "must be an object"))
            return None
        role, content = m.get("role"), m.get("content")
        if role not in ROLES:
            errs.append(LineError(line, f"{where}.role", f"must be one of system, user, assistant (got {role!r})"))
            return None
        if not isinstance(content, str):
            errs.append(LineError(line, f"{where}.content", "must be a string"))
            return None
        clean.append({"role": "system" if role == "developer" else role, "content": content})
    if optional and clean[-1]["role"] != "assistant":
        clean.append({"role": "assistant", "content": ""})  # a request without its answer
    elif clean[-1]["role"] != "assistant" or not clean[-1]["content"].strip():
        errs.append(
            LineError(line, f"messages[{len(clean) - 1}]", "the last message must be a non-empty assistant answer")
        )
        return None
    prompt = clean[:-1]
    if not any(m["role"] == "user" and m["content"].strip() for m in prompt):
        errs.append(LineError(line, "messages", "needs a non-empty user message before the assistant answer"))
        return None
    users = [m["content"] for m in prompt if m["role"] == "user"]
    return {
        "messages": prompt,
        "answer": clean[-1]["content"],
        "route_text": route_text(prompt),
        "route_input": users[-1],  # the routed text without the system prompt (the instruction, if any)
    }


def _from_instruction(obj: dict[str, Any], line: int, errs: list[LineError], optional: bool) -> Example | None:
    for key in ("instruction", "input", "output"):
        if key in obj and not isinstance(obj[key], str):
            errs.append(LineError(line, key, "must be a string"))
            return None
    instruction, inp, output = obj.get("instruction", ""), obj.get("input", ""), obj.get("output", "")
    if not (instruction.strip() or inp.strip()):
        errs.append(LineError(line, "instruction", "instruction and input are both empty"))
        return None
    if not output.strip() and not (optional and "output" not in obj):
        errs.append(LineError(line, "output", "must be a non-empty string"))
        return None
    user = "\n".join(p for p in (instruction, inp) if p)
    prompt = [{"role": "user", "content": user}]
    return {"messages": prompt, "answer": output, "route_text": route_text(prompt), "route_input": inp or instruction}


def parse_jsonl(
    data: bytes, min_examples: int = 1, max_examples: int | None = None, answers_optional: bool = False
) -> list[Example]:
    """Parse and validate a whole upload; raise DatasetError listing every bad line (1-based). `answers_optional`:
    rows may leave out the answer (an imported adapter's examples)."""
    errs: list[LineError] = []
    examples: list[Example] = []
    total = 0
    for n, raw in enumerate(data.split(b"\n"), start=1):
        if not raw.strip():
            continue
        before = len(errs)
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            errs.append(LineError(n, "", f"not valid UTF-8 ({e.reason} at byte {e.start})"))
            continue
        try:
            obj = json.loads(text)
        except json.JSONDecodeError as e:
            errs.append(LineError(n, "", f"not valid JSON ({e.msg}, column {e.colno})"))
            continue
        except (ValueError, RecursionError) as e:  # an integer past 4,300 digits, nesting past the parser's depth
            why = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
            errs.append(LineError(n, "", f"not valid JSON ({why})"))
            continue
        if not isinstance(obj, dict):
            errs.append(LineError(n, "", "must be a JSON object"))
            continue
        if (where := unencodable(obj)) is not None:
            errs.append(LineError(n, where, NOT_TEXT))
            continue
        if "messages" in obj:
            ex = _from_messages(obj, n, errs, answers_optional)
        elif any(k in obj for k in ("instruction", "input", "output")):
            ex = _from_instruction(obj, n, errs, answers_optional)
        else:
            errs.append(LineError(n, "", "expected a 'messages' list or 'instruction'/'input'/'output' fields"))
            ex = None
        if ex is not None and len(errs) == before:
            examples.append(ex)
        total += 1
    if errs:
        raise DatasetError(errs[:MAX_REPORTED_ERRORS], total_errors=len(errs))
    if len(examples) < min_examples:
        raise DatasetError([LineError(0, "file", f"needs at least {min_examples} examples, got {len(examples)}")])
    if max_examples is not None and len(examples) > max_examples:
        raise DatasetError([LineError(0, "file", f"at most {max_examples} examples are accepted, got {len(examples)}")])
    return examples
