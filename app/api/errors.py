"""Errors of the API as OpenAI-style JSON, and how a failure from the engine or the cluster maps to a status.

400 bad input (what the client sent is at fault; `param` names the field), 401 missing or wrong key, 404 no
such route, 413 a body or prompt over its limit, 429 too many requests (`Retry-After`), 503 the engine cannot
serve now (`Retry-After`), 500 a fault of the server itself. No status is ever answered in plain text.

What a client reads of a failure is one line: the engine's own reason, or an exception's class and the first line
of its message, with file paths, IP addresses, pids and long hex ids (actor, node and object ids) taken out
(`public_reason`). Ray delivers a remote exception wrapped, its `str` the whole remote traceback; the reason is
read from the exception it wraps. The whole detail of a 5xx goes to the server's log, under the request's id.
"""

from __future__ import annotations

import logging
import math
import re
import traceback
from contextvars import ContextVar

from fastapi.responses import JSONResponse

from app.api.schemas import ErrorResponse, error_body
from app.engine.errors import EngineError, EngineUnavailable, Overloaded, QueueTimeout

RATE_LIMITED = "rate_limit_exceeded"  # OpenAI's `code` for a 429
REQUEST_ID: ContextVar[str] = ContextVar("request_id", default="-")  # the response id of the request served here
log = logging.getLogger("app.api.routes")
# what a client must not read: paths (two components or more), IPv4 addresses, pids, long hex ids; and a traceback's
# frames (`File "...", line N`)
_SCRUB = [(re.compile(r'File "[^"]*", line \d+'), "<frame>"),
          (re.compile(r"(?<![\w.])(?:~|\.{1,2})?(?:/[\w.@+\-]+){2,}/?"), "<path>"),
          (re.compile(r"\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b"), "<address>"),
          (re.compile(r"\bpid[=: ]+\d+", re.IGNORECASE), "pid=<pid>"),
          (re.compile(r"\b[0-9a-fA-F]{16,}\b"), "<id>")]
_DIED = ("RayActorError", "ActorDiedError", "ActorUnavailableError", "DeploymentUnavailableError")


class ApiError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None, retry_after_s: float | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.code, self.retry_after_s = code, retry_after_s


def error_response(exc: ApiError) -> JSONResponse:
    headers = {} if exc.retry_after_s is None else {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))}
    return JSONResponse(error_body(exc.message, exc.type, exc.param, exc.code), status_code=exc.status,
                        headers=headers)


def overloaded(message: str, retry_after_s: float = 1.0) -> ApiError:
    return ApiError(429, message, "rate_limit_error", code=RATE_LIMITED, retry_after_s=retry_after_s)


def _engine_error(exc: BaseException) -> EngineError | None:
    """The engine's refusal behind `exc`: the cause a remote call wrapped (Ray's RayTaskError, itself an instance of
    the cause's class, whose text is the remote traceback), or `exc` itself."""
    for candidate in (getattr(exc, "cause", None), exc.__cause__, exc):
        if isinstance(candidate, EngineError):
            return candidate
    return None


def unwrapped(exc: BaseException) -> BaseException:
    """The exception a remote call wrapped (Ray's `cause`), else `exc`."""
    cause = getattr(exc, "cause", None)
    return cause if isinstance(cause, BaseException) else exc


def scrub(text: str) -> str:
    """`text` without paths, addresses, pids and long hex ids."""
    for pattern, mark in _SCRUB:
        text = pattern.sub(mark, text)
    return text


def public_reason(exc: BaseException, limit: int = 300) -> str:
    """One line of `exc` (unwrapped) a client may read: its message's first line, scrubbed, at most `limit` chars."""
    text = str(unwrapped(exc)).strip()
    line = scrub(text.splitlines()[0].strip() if text else "")
    return line if len(line) <= limit else line[: limit - 3] + "..."


def _died(exc: BaseException) -> bool:
    """Ray's errors for a replica that died or a deployment with none to serve (matched by name: app/api never
    imports ray)."""
    return any(cls.__name__ in _DIED for cls in type(exc).__mro__)


def _is_back_pressure(exc: BaseException) -> bool:
    """Ray Serve's BackPressureError (its queue for a deployment is full), matched by name: app/api never
    imports ray."""
    return any(cls.__name__ == "BackPressureError" for cls in type(exc).__mro__)


def from_backend(exc: BaseException) -> ApiError:
    """The API error for an exception out of `Backend.generate` (a 5xx is logged in full with the request's id)."""
    if isinstance(exc, ApiError):
        return exc
    err = _mapped(exc)
    if err.status >= 500:
        log.warning("request %s failed (%d %s): %s", REQUEST_ID.get(), err.status, err.code or err.type,
                    "".join(traceback.format_exception(exc)).rstrip())
    return err


def _mapped(exc: BaseException) -> ApiError:
    original = unwrapped(exc)
    if isinstance(original, ValueError):
        return ApiError(400, public_reason(original))
    engine = _engine_error(exc)
    retry = engine.retry_after_s if engine is not None else None
    if isinstance(engine, Overloaded):
        return overloaded(f"the engine is overloaded: {public_reason(engine)}", retry or 1.0)
    if _is_back_pressure(exc):
        return overloaded(f"every engine replica is at capacity: {public_reason(exc)}")
    if isinstance(engine, QueueTimeout):
        return ApiError(503, f"the request waited too long to start: {public_reason(engine)}", "server_error",
                        code="queue_timeout", retry_after_s=retry or 5.0)
    if isinstance(engine, EngineUnavailable):
        return ApiError(503, f"the engine is unavailable: {public_reason(engine)}", "server_error",
                        code="engine_unavailable", retry_after_s=retry or 5.0)
    if _died(exc) or _died(original):
        return ApiError(503, f"the engine replica serving the request is gone ({type(original).__name__})",
                        "server_error", code="engine_unavailable", retry_after_s=5.0)
    return ApiError(503, f"generation failed: {type(original).__name__}: {public_reason(original)}", "server_error",
                    retry_after_s=1.0)


_DESCRIPTIONS = {400: "bad input (`param` names the field)", 401: "missing or wrong API key",
                 404: "no such route", 413: "request body or prompt over its limit",
                 429: "too many requests in flight; retry after `Retry-After` seconds",
                 500: "a fault of the server", 503: "the engine cannot serve now; retry after `Retry-After` seconds"}


def openapi_responses(*statuses: int) -> dict:
    """`responses=` for a route: each status with the error body's schema."""
    return {s: {"model": ErrorResponse, "description": _DESCRIPTIONS[s]} for s in statuses}


def strip_422(schema: dict) -> dict:
    """FastAPI documents 422 for every route with a body; this server answers 400 instead."""
    for path in schema.get("paths", {}).values():
        for op in path.values():
            op.get("responses", {}).pop("422", None)
    components = schema.get("components", {}).get("schemas", {})
    for name in ("HTTPValidationError", "ValidationError"):
        components.pop(name, None)
    return schema
