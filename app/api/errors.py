"""Errors of the API as OpenAI-style JSON, and how a failure from the engine or the cluster maps to a status.

400 bad input (what the client sent is at fault; `param` names the field), 401 missing or wrong key, 404 no
such route, 413 a body or prompt over its limit, 429 too many requests (`Retry-After`), 503 the engine cannot
serve now (`Retry-After`), 500 a fault of the server itself. No status is ever answered in plain text.
"""

from __future__ import annotations

import math

from fastapi.responses import JSONResponse

from app.api.schemas import ErrorResponse, error_body
from app.engine.errors import EngineError, EngineUnavailable, Overloaded, QueueTimeout

RATE_LIMITED = "rate_limit_exceeded"  # OpenAI's `code` for a 429


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
    """The engine's refusal behind `exc`: itself, or the cause a remote call wrapped (Ray's RayTaskError)."""
    for candidate in (exc, getattr(exc, "cause", None), exc.__cause__):
        if isinstance(candidate, EngineError):
            return candidate
    return None


def _is_back_pressure(exc: BaseException) -> bool:
    """Ray Serve's BackPressureError (its queue for a deployment is full), matched by name: app/api never
    imports ray."""
    return any(cls.__name__ == "BackPressureError" for cls in type(exc).__mro__)


def from_backend(exc: BaseException) -> ApiError:
    """The API error for an exception out of `Backend.generate`."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, ValueError):
        return ApiError(400, str(exc))
    engine = _engine_error(exc)
    retry = engine.retry_after_s if engine is not None else None
    if isinstance(engine, Overloaded):
        return overloaded(f"the engine is overloaded: {engine}", retry or 1.0)
    if _is_back_pressure(exc):
        return overloaded(f"every engine replica is at capacity: {exc}")
    if isinstance(engine, QueueTimeout):
        return ApiError(503, f"the request waited too long to start: {engine}", "server_error", code="queue_timeout",
                        retry_after_s=retry or 5.0)
    if isinstance(engine, EngineUnavailable):
        return ApiError(503, f"the engine is unavailable: {engine}", "server_error", code="engine_unavailable",
                        retry_after_s=retry or 5.0)
    return ApiError(503, f"generation failed: {exc}", "server_error")


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
