"""Request ids and the access log, as a plain ASGI middleware around everything else.

Every response carries `x-request-id`: the caller's own when it sent a usable one (printable ASCII, at most 128
characters, as a proxy or a client library sets it), else a new one. The id is the handler's too
(`request.state.request_id`) and it ends each request's access-log line, so a caller finds its request in the
logs by the header it got back.
"""

from __future__ import annotations

import logging
import re
import time
import uuid

from starlette.types import ASGIApp, Message, Receive, Scope, Send

HEADER = b"x-request-id"
_USABLE = re.compile(rb"[\x21-\x7e]{1,128}")
access = logging.getLogger("skillpool.access")


def request_id(scope: Scope) -> str:
    """The caller's x-request-id if it is usable, else a fresh one."""
    given = dict(scope["headers"]).get(HEADER, b"")
    return given.decode() if _USABLE.fullmatch(given) else uuid.uuid4().hex


class RequestIds:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        rid, t0, status = request_id(scope), time.perf_counter(), 500
        scope.setdefault("state", {})["request_id"] = rid

        async def tagged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = int(message["status"])
                headers = [(k, v) for k, v in message.get("headers", []) if k.lower() != HEADER]
                message = {**message, "headers": [*headers, (HEADER, rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, tagged)
        finally:  # after the last byte: a stream's line comes when it ends
            client = scope.get("client")
            access.info(
                '%s "%s %s" %d %.1fms request_id=%s',
                f"{client[0]}:{client[1]}" if client else "-",
                scope["method"],
                scope["path"],
                status,
                (time.perf_counter() - t0) * 1000,
                rid,
            )
