"""Errors in the OpenAI envelope: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

import json
import logging
from typing import Any

import redis
from fastapi import Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from skillpool.adapters_store.diskio import StorageError
from skillpool.adapters_store.objects import StoreUnavailable
from skillpool.trainer.datasets import NOT_TEXT, unencodable

log = logging.getLogger(__name__)
STORE_RETRY_S = 5  # a store that is down: when a caller should try again

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable_error",
    507: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        **extra: Any,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.extra = status, message, param, code, extra
        self.headers = headers or {}


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def parse_json(
    raw: bytes | str,
    param: str | None = None,
    what: str = "request body",
    code: str = "invalid_json",
    constants: bool = False,
) -> Any:
    """JSON from a client: malformed text, nesting deeper than the parser's recursion limit, integers past
    Python's digit limit, a string that is not text (a lone surrogate: 400 invalid_encoding naming its field) and
    (unless `constants`: the caller checks each number and names its field) NaN and Infinity are a 400 naming
    `param`, never a 500."""
    try:
        value = json.loads(raw) if constants else json.loads(raw, parse_constant=_no_constant)
        if (where := unencodable(value, param or "")) is not None:
            raise APIError(400, f"{where or what}: {NOT_TEXT}", where or None, "invalid_encoding")
        return value
    except json.JSONDecodeError as e:
        raise APIError(
            400, f"{what} is not valid JSON: {e.msg} (line {e.lineno}, column {e.colno})", param, code
        ) from None
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        detail = "nested too deeply" if isinstance(e, RecursionError) else str(e).split(";")[0]
        raise APIError(400, f"{what} is not valid JSON: {detail}", param, code) from None


async def read_json(request: Request) -> Any:
    """The request body as strict JSON (see parse_json)."""
    return parse_json(await request.body())


def envelope(
    status: int, message: str, param: str | None = None, code: str | None = None, **extra: Any
) -> dict[str, Any]:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
            **extra,
        }
    }


def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(
        envelope(err.status, err.message, err.param, err.code, **err.extra), status_code=err.status, headers=err.headers
    )


def store_unavailable(detail: object, param: str | None = None) -> APIError:
    """The adapter store is down: callers get the code and a plain message; which store, where and which object
    (its endpoint, bucket and keys are the operator's business) go to the log."""
    log.warning("adapter store unavailable: %s", detail)
    return APIError(
        503,
        "the adapter store cannot be reached; retry later",
        param,
        "adapter_store_unavailable",
        {"Retry-After": str(STORE_RETRY_S)},
    )


def install_handlers(app: Any) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        loc = [str(p) for p in first.get("loc", ()) if p not in ("body", "query", "path")]
        param = ".".join(loc) or None
        msg = f"{param}: {first.get('msg', 'invalid value')}" if param else str(first.get("msg", "invalid request"))
        return JSONResponse(envelope(400, msg, param, "invalid_value"), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def _http(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code)
        return JSONResponse(envelope(exc.status_code, str(exc.detail), None, code), status_code=exc.status_code)

    @app.exception_handler(redis.ConnectionError)
    @app.exception_handler(redis.TimeoutError)
    async def _queue_down(_: Request, exc: redis.RedisError) -> JSONResponse:
        # the job queue (Redis) is down: what needs it waits and retries; chat and /v1/models never touch it
        body = envelope(
            503, f"the job queue is unreachable ({type(exc).__name__}); retry later", None, "queue_unavailable"
        )
        return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})

    @app.exception_handler(StorageError)
    async def _storage(_: Request, exc: StorageError) -> JSONResponse:
        # an upload or a job the data dir could not take (disk full): the store removed what it had begun
        why = "no space left on device" if exc.full else f"the data dir could not be written ({exc.strerror})"
        body = envelope(507, f"{why}: nothing was stored; retry later", None, "insufficient_storage")
        return JSONResponse(body, status_code=507)

    @app.exception_handler(StoreUnavailable)
    async def _store_down(_: Request, exc: StoreUnavailable) -> JSONResponse:
        return error_response(store_unavailable(exc))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        return JSONResponse(
            envelope(500, f"internal error: {type(exc).__name__}", None, "internal_error"), status_code=500
        )
