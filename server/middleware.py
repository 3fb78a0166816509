"""Bearer-key check (server.auth: which key, which role) and request counting as a plain ASGI middleware.

Not Starlette's BaseHTTPMiddleware: that one runs the endpoint behind its own receive channel, so a
handler's `request.is_disconnected()` never sees the client go away, and every response is re-wrapped
as a stream.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterable
from typing import Any

from starlette.routing import compile_path
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .auth import METRICS, KeyRing, denial, required_role
from .errors import envelope
from .metrics import Metrics

_GUARDED = ("/v1", "/tasks", "/tokenize", "/detokenize", "/tokenizer_info")
_UNCOUNTED = frozenset({"/healthz", "/readyz", "/metrics", "/health", "/version"})  # probes and scrapes: not traffic
_JSON_ONLY = ("/v1", "/tokenize", "/detokenize")
_MULTIPART = ("/tasks", "/v1/files", "/v1/skills/import")


def json_required(scope: Scope) -> bool:
    """Whether this request carries a body that must be JSON and is not declared so: a 415, before anything
    reads it (a web page can post text/plain to a local server without a CORS preflight)."""
    path = str(scope["path"])
    if (
        scope["method"] not in ("POST", "PUT", "PATCH")
        or not path.startswith(_JSON_ONLY)
        or path.startswith(_MULTIPART)
    ):
        return False
    headers = dict(scope["headers"])
    if headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers:
        return False  # no body (e.g. POST .../cancel): nothing to parse
    media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    return not (media == b"application/json" or media.endswith(b"+json"))


class AuthAndCount:
    def __init__(
        self, app: ASGIApp, keys: KeyRing, metrics: Metrics, templates: Callable[[], Iterable[str]] = tuple
    ) -> None:
        self.app, self.keys, self.metrics = app, keys, metrics
        self.templates = templates  # the app's path templates: a refused request is counted under its endpoint
        self._compiled: list[tuple[str, re.Pattern[str]]] | None = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path, t0 = str(scope["path"]), time.perf_counter()
        if path in _UNCOUNTED:
            if path == METRICS and not self.keys.open_metrics:  # the pool's names, the job in training, routing
                principal = self.keys.principal(dict(scope["headers"]).get(b"authorization", b""))
                if (why := denial(principal, required_role(str(scope["method"]), path))) is not None:
                    status, msg, code = why
                    await send_json(send, status, envelope(status, msg, None, code))
                    return
            await self.app(scope, receive, send)
            return
        if path.startswith(_GUARDED):
            principal = self.keys.principal(dict(scope["headers"]).get(b"authorization", b""))
            need = required_role(str(scope["method"]), path)
            if need == "anonymous" and not self.keys.anonymous_chat:
                need = "chat"  # chat keys exist: no key, no chat
            if (why := denial(principal, need)) is not None:
                status, msg, code = why
                await send_json(send, status, envelope(status, msg, None, code))
                self._count(self._endpoint(path), status, t0)
                return
            scope.setdefault("state", {})["principal"] = principal  # request.state.principal (server.auth)
        if json_required(scope):
            msg = "Content-Type must be application/json"
            await send_json(send, 415, envelope(415, msg, "content-type", "unsupported_media_type"))
            self._count("unmatched", 415, t0)
            return
        status = 500

        async def counted(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:  # after the last byte: a stream's duration is its whole answer's
            route: Any = scope.get("route")
            self._count(route.path if route is not None else "unmatched", status, t0)

    def _count(self, endpoint: str, status: int, t0: float) -> None:
        """The one place a request is counted and timed: once each, whether refused, answered or streamed."""
        self.metrics.requests.labels(endpoint, str(status)).inc()
        self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)

    def _endpoint(self, path: str) -> str:
        """The path template a refused request matches (the label it would have had once routed), or "unmatched"."""
        if self._compiled is None:  # on the first refusal: every route is installed by then
            self._compiled = [(t, compile_path(t)[0]) for t in self.templates()]
        return next((t for t, rx in self._compiled if rx.match(path)), "unmatched")


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    import json

    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})
