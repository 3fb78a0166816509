"""Every string a request brings is UTF-8 text, or the request is a 400 naming where it is not: one check, as a
plain ASGI middleware, where strings enter, before any endpoint sees them.

A lone surrogate is valid JSON (`"\\ud800"`) and decodes to a Python string that no encoder takes: left in, it
reaches a tokenizer or a response and raises there (a 500 and a reset connection). It can come in a JSON body (an
escape, or CESU bytes that the JSON parser lets through), in a path or a query (percent-encoded bytes that are not
UTF-8). A JSON body is parsed here only when it might hold one (its bytes are not UTF-8, or it has an escape in the
surrogates' range): others pass untouched. JSON inside a string field (a config) is checked where it is parsed
(server.errors.parse_json), and a dataset's lines by the dataset's own validation (trainer.datasets).
"""

from __future__ import annotations

import json
import re
from urllib.parse import parse_qsl, unquote_to_bytes

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skillpool.trainer.datasets import NOT_TEXT, unencodable

from .errors import envelope
from .middleware import send_json

_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F]")
_BODIES = ("POST", "PUT", "PATCH", "DELETE")


class RequestText:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        bad = _in_path(scope) or _in_query(scope)
        if bad is None and scope["method"] in _BODIES and _is_json(scope):
            body, receive = await _buffered(receive)
            bad = _in_body(body)
        if bad is not None:
            param, what = bad
            await send_json(send, 400, envelope(400, f"{what}: {NOT_TEXT}", param, "invalid_encoding"))
            return
        await self.app(scope, receive, send)


Problem = tuple[str | None, str]  # (the param the envelope names, the words for it)


def _in_path(scope: Scope) -> Problem | None:
    raw = scope.get("raw_path")
    try:
        if raw is not None:
            unquote_to_bytes(bytes(raw).split(b"?", 1)[0]).decode("utf-8")
        else:
            str(scope["path"]).encode("utf-8")
    except (UnicodeDecodeError, UnicodeEncodeError):
        return "path", "the URL path"
    return None


def _in_query(scope: Scope) -> Problem | None:
    query = bytes(scope.get("query_string", b"")).decode("latin-1")
    for name, value in parse_qsl(query, keep_blank_values=True, errors="surrogateescape"):
        if unencodable(name) is not None:
            return "query", "a query parameter's name"
        if unencodable(value) is not None:
            return name, f"query parameter {name}"
    return None


def _is_json(scope: Scope) -> bool:
    ctype = dict(scope["headers"]).get(b"content-type", b"").split(b";")[0].strip().lower()
    return ctype == b"application/json" or ctype.endswith(b"+json")


async def _buffered(receive: Receive) -> tuple[bytes, Receive]:
    """The whole body (BodyLimit, outside, has bounded it), and a receive that hands it to the app again."""
    chunks, more, last = [], True, None
    while more:
        message = await receive()
        if message["type"] != "http.request":  # the client went away: the app sees that after the body
            last = message
            break
        chunks.append(message.get("body", b""))
        more = message.get("more_body", False)
    body, replayed = b"".join(chunks), False

    async def replay() -> Message:
        nonlocal replayed
        if not replayed:
            replayed = True
            return {"type": "http.request", "body": body, "more_body": False}
        return last if last is not None else await receive()

    return body, replay


def _in_body(body: bytes) -> Problem | None:
    try:
        body.decode("utf-8")
        if not _SURROGATE_ESCAPE.search(body):
            return None
    except UnicodeDecodeError:
        pass
    try:  # bytes that are not UTF-8 become lone surrogates here, and are found where they sit like any other
        value = json.loads(body.decode("utf-8", "surrogateescape"))
    except (ValueError, RecursionError):
        return None  # not JSON at all: the endpoint's parser answers that, naming it
    where = unencodable(value)
    if where is None:
        return None
    return (where or None), (where or "the request body")
