"""Trailing-slash redirects with a relative Location: `/console/` → `/console`, never `http://<Host>/console`.

Starlette's router builds the redirect from the request's Host header, so a request with `Host: evil.example` was
sent to another site. The same redirect is made here from the path alone (Starlette's escapes kept, and a path
that would read as another host, `//x` or `/\\x`, kept on this one).
"""

from __future__ import annotations

from fastapi import FastAPI
from starlette.responses import RedirectResponse
from starlette.routing import Match
from starlette.types import Receive, Scope, Send


def install_slash_redirects(app: FastAPI) -> None:
    router = app.router
    router.redirect_slashes = False
    not_found = router.default

    async def default(scope: Scope, receive: Receive, send: Send) -> None:
        path = str(scope.get("path", ""))
        if scope["type"] == "http" and path not in ("", "/"):
            other = {**scope, "path": path.rstrip("/") if path.endswith("/") else path + "/"}
            if any(route.matches(other)[0] is not Match.NONE for route in router.routes):
                await RedirectResponse(_relative(other))(scope, receive, send)
                return
        await not_found(scope, receive, send)

    router.default = default


def _relative(scope: Scope) -> str:
    """The path and query of `scope` as a Location on this host."""
    path = "/" + str(scope["path"]).replace("?", "%3F").replace("#", "%23").replace("\\", "%5C").lstrip("/")
    query = bytes(scope.get("query_string", b"")).decode("latin-1")
    return f"{path}?{query}" if query else path
