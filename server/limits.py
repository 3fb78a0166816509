"""Request body limits enforced while the body streams in, as a plain ASGI middleware.

A declared Content-Length over the limit is refused before anything is read; a chunked body (no length) is
counted as the app reads it, and the request is answered 413 the moment it passes the limit, so an
oversized upload never reaches memory or disk. The app is told by an exception from `receive`; FastAPI
turns a failing body read into its own 400, so the response that follows is replaced by the 413.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from .errors import envelope
from .middleware import send_json

UPLOADS = ("/tasks", "/v1/files", "/v1/skills/import")  # multipart datasets and adapters: their own, larger limit
MULTIPART_SLACK = 64 * 1024  # boundaries and the small form fields beside the file


class BodyTooLarge(Exception):
    pass


class BodyLimit:
    def __init__(self, app: ASGIApp, upload_bytes: int, request_bytes: int) -> None:
        self.app, self.upload_bytes, self.request_bytes = app, upload_bytes, request_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        upload = str(scope["path"]).startswith(UPLOADS)
        limit = self.upload_bytes + MULTIPART_SLACK if upload else self.request_bytes
        what = "upload" if upload else "request body"
        param = "file" if upload else None
        code = "file_too_large" if upload else "request_too_large"
        body = envelope(413, f"{what} is larger than {limit} bytes", param, code)
        length = dict(scope["headers"]).get(b"content-length", b"")
        if length.isdigit() and int(length) > limit:
            await send_json(send, 413, body)
            return
        seen, over, started = 0, False, False

        async def counted() -> Message:
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > limit:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded(message: Message) -> None:
            nonlocal started
            if over:  # the app's answer to a failed body read: ours instead
                if message["type"] == "http.response.start" and not started:
                    started = True
                    await send_json(send, 413, body)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted, guarded)
        except BodyTooLarge:
            if not started:
                await send_json(send, 413, body)
