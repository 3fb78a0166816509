"""Schemathesis fuzzes every operation of a live server's OpenAPI schema over real HTTP: no input gives a 5xx.

The server runs the tiny LLaMA (generation is cheap) with a trainer and no admin key, so writes reach their
handlers; the checks are schemathesis' `not_a_server_error` only (4xx for bad input is the right answer)."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error

from skillpool.server.process import ServerProcess

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def live(tiny_base, tmp_path_factory) -> Iterator[ServerProcess]:  # type: ignore[no-untyped-def]
    data = tmp_path_factory.mktemp("fuzz") / "data"
    with ServerProcess(data, ["--model", str(tiny_base.path), "--default-max-tokens", "2"]) as srv:
        yield srv


def test_no_input_gives_a_server_error(live: ServerProcess) -> None:
    """Each operation's own hypothesis run (schemathesis' pytest plugin does not load under pytest 9)."""
    schema = schemathesis.openapi.from_url(live.url + "/openapi.json")
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 10  # chat, models, tasks, files, fine-tuning, health...
    seen: dict[str, set[int]] = {}
    for op in operations:
        _fuzz(op, live.url, seen)
    assert set(seen) == {op.label for op in operations}  # every operation was called
    assert not [label for label, codes in seen.items() if max(codes) >= 500], seen
    assert 200 in seen["POST /v1/chat/completions"], seen  # fuzzed bodies reached generation too


def _fuzz(op, url: str, seen: dict[str, set[int]]) -> None:  # type: ignore[no-untyped-def]
    @given(case=op.as_strategy(), routed=st.booleans())
    @settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
    def fuzz(case, routed: bool) -> None:  # type: ignore[no-untyped-def]
        if routed and op.label == "POST /v1/chat/completions" and isinstance(case.body, dict):
            # half the chat bodies name a model that exists and carry a user turn: they reach the engine
            case.body["model"] = "auto"
            case.body["messages"] = [*(case.body.get("messages") or []), {"role": "user", "content": "hello"}]
        response = case.call(base_url=url, timeout=120)
        seen.setdefault(op.label, set()).add(response.status_code)
        case.validate_response(response, checks=[not_a_server_error])

    fuzz()
