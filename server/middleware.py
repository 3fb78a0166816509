"""Bearer-key check and request counting as a plain ASGI middleware.

Not Starlette's BaseHTTPMiddleware: that one runs the endpoint behind its own receive channel, so a
handler's `request.is_disconnected()` never sees the client go away, and every response is re-wrapped
as a stream.
"""

from __future__ import annotations

import hmac
import time
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import envelope
from .metrics import Metrics

_GUARDED = ("/v1", "/tasks")
_MULTIPART = ("/tasks", "/v1/files")
# Writes that train, upload or change what is served: the admin key's alone once one is set.
_ADMIN_WRITES = ("/tasks", "/v1/files", "/v1/fine_tuning", "/v1/models")
_READS = ("GET", "HEAD", "OPTIONS")  # uploads: multipart/form-data, checked by their handlers


def json_required(scope: Scope) -> bool:
    """Whether this request carries a body that must be JSON and is not declared so: a 415, before anything
    reads it (a web page can post text/plain to a local server without a CORS preflight)."""
    path = str(scope["path"])
    if scope["method"] not in ("POST", "PUT", "PATCH") or not path.startswith("/v1") or path.startswith(_MULTIPART):
        return False
    headers = dict(scope["headers"])
    if headers.get(b"content-length", b"0") == b"0" and b"transfer-encoding" not in headers:
        return False  # no body (e.g. POST .../cancel): nothing to parse
    media = headers.get(b"content-type", b"").split(b";")[0].strip().lower()
    return not (media == b"application/json" or media.endswith(b"+json"))


class AuthAndCount:
    def __init__(self, app: ASGIApp, api_key: str | None, metrics: Metrics, admin_key: str | None = None) -> None:
        self.app, self.api_key, self.metrics = app, api_key, metrics
        self.accepted = [f"Bearer {k}".encode() for k in (api_key, admin_key) if k]  # the admin may do all a user may
        self.admin = f"Bearer {admin_key}".encode() if admin_key else b""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.api_key and str(scope["path"]).startswith(_GUARDED):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not any([hmac.compare_digest(given, k) for k in self.accepted]):  # a list: compare with every key
                await send_json(send, 401, envelope(401, "invalid or missing API key", None, "invalid_api_key"))
                return
            if self.admin and scope["method"] not in _READS and str(scope["path"]).startswith(_ADMIN_WRITES):
                if not hmac.compare_digest(given, self.admin):
                    msg = "this key may chat and read; uploads, training and model changes need the admin key"
                    await send_json(send, 403, envelope(403, msg, None, "permission_denied"))
                    return
        if json_required(scope):
            msg = "Content-Type must be application/json"
            await send_json(send, 415, envelope(415, msg, "content-type", "unsupported_media_type"))
            self.metrics.requests.labels("unmatched", "415").inc()
            return
        t0 = time.perf_counter()
        status, streaming = 500, False

        async def counted(message: Message) -> None:
            nonlocal status, streaming
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = dict(message.get("headers") or [])
                streaming = headers.get(b"content-type", b"").startswith(b"text/event-stream")
            await send(message)

        try:
            await self.app(scope, receive, counted)
        finally:
            route: Any = scope.get("route")
            endpoint = route.path if route is not None else "unmatched"
            self.metrics.requests.labels(endpoint, str(status)).inc()
            if not streaming:  # a stream's duration is the answer's, recorded by the chat handler
                self.metrics.request_seconds.labels(endpoint).observe(time.perf_counter() - t0)


async def send_json(send: Send, status: int, body: dict[str, Any]) -> None:
    import json

    raw = json.dumps(body).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(raw)).encode())]
    await send({"type": "http.response.start", "status": status, "headers": headers})
    await send({"type": "http.response.body", "body": raw})


def is_admin(headers: Any, admin_key: str | None) -> bool:
    """Whether a request may use admin actions (force, retire, rollback). Without an admin key every caller
    the API key admits is trusted: the single-tenant default."""
    if not admin_key:
        return True
    return hmac.compare_digest(str(headers.get("authorization", "")).encode(), f"Bearer {admin_key}".encode())
