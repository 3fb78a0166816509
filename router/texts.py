"""The text a request is routed on, shared by the trainer (keys), the server (requests) and the evaluation."""

from __future__ import annotations

from collections.abc import Mapping, Sequence


def route_text(messages: Sequence[Mapping[str, str]]) -> str:
    """What the router sees: the system prompt(s) plus the last user turn (same at train and serve time)."""
    system = [m["content"] for m in messages if m["role"] in ("system", "developer")]
    users = [m["content"] for m in messages if m["role"] == "user"]
    return "\n".join([*system, *users[-1:]])
