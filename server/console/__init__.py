"""The console: a web page over the JSON APIs, served by `skillpool serve` at /console from this package's files.

No build step: plain ES modules, CSS and SVG drawn by the page's own code. Every response under /console carries a
Content-Security-Policy that allows no inline script and no third-party origin, and nosniff; the page itself
renders every server string as text (textContent), never as HTML.
"""

from __future__ import annotations

from importlib.resources import files
from pathlib import Path

from fastapi import FastAPI
from starlette.responses import FileResponse
from starlette.staticfiles import StaticFiles
from starlette.types import ASGIApp, Message, Receive, Scope, Send

PREFIX = "/console"
PACKAGE = "skillpool.server.console"
CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; "
    "object-src 'none'; base-uri 'none'; frame-ancestors 'none'; form-action 'self'"
)
HEADERS = ((b"content-security-policy", CSP.encode()), (b"x-content-type-options", b"nosniff"))


def static_dir() -> Path:
    """The page's files as installed with the package (package data)."""
    return Path(str(files(PACKAGE).joinpath("static")))


class ConsoleHeaders:
    """Adds the CSP and nosniff to every response under /console (the page, its files, their 404s and redirects)."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] != "http" or not (path == PREFIX or path.startswith(PREFIX + "/")):
            await self.app(scope, receive, send)
            return

        async def with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                ours = {name for name, _ in HEADERS}
                kept = [(k, v) for k, v in message.get("headers", []) if k.lower() not in ours]
                message = {**message, "headers": [*kept, *HEADERS]}
            await send(message)

        await self.app(scope, receive, with_headers)


def install_console(app: FastAPI) -> None:
    """Serve the page at /console and its files at /console/static/; no key is needed for them (they hold no
    data of the pool: the page asks the guarded JSON APIs with the user's key)."""
    folder = static_dir()
    index = folder / "index.html"

    async def console_page() -> FileResponse:
        return FileResponse(index, media_type="text/html; charset=utf-8", headers={"cache-control": "no-cache"})

    app.add_api_route(PREFIX, console_page, methods=["GET"], include_in_schema=False)
    app.mount(PREFIX + "/static", StaticFiles(directory=folder), name="console-static")
    app.add_middleware(ConsoleHeaders)
