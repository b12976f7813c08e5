"""`Guard`: the ASGI layer in front of the routes (and `RequestId`, X-Request-Id without Ray). In order, for
each HTTP request:

1. the API key of /v1/ routes and /tokenize, /detokenize (any one of the configured keys), compared with each
   in constant time (`hmac.compare_digest` on bytes: how long the comparison takes says nothing about how much
   of a guess was right);
2. the body size: a bad Content-Length is 400, one over `max_body_bytes` is 413 before anything is read, and a
   body without one (chunked) is counted as it arrives: past the limit the request is answered 413 at once and
   the rest is never read (a route reading the body sees an exception, and whatever it answers is replaced);
3. admission: at most `max_in_flight` generation requests open in this process (a stream counts until it
   ends); beyond that, 429 with Retry-After before the body is read;
4. a catch-all: an exception nothing else handled becomes a JSON 500 (Starlette would answer plain text).

A pure ASGI middleware, not `@app.middleware("http")`: that one reads bodies through its own wrapper and
cannot stop a chunked upload midway.
"""

from __future__ import annotations

import hmac
import logging
import uuid

from app.api.errors import ApiError, error_response, overloaded

log = logging.getLogger(__name__)
GENERATION_PATHS = frozenset({"/v1/completions", "/v1/chat/completions", "/v1/responses"})
KEYED = ("/v1/", "/tokenize", "/detokenize")  # routes that need the API key (when one is set)
MAX_REQUEST_ID_CHARS = 256


class BodyTooLarge(Exception):
    """Raised to the route reading a body past the limit (the guard answers 413 in its place)."""


class Guard:
    def __init__(self, app, api_key: str | tuple[str, ...] | None, max_body_bytes: int, max_in_flight: int) -> None:
        self.app = app
        keys = (api_key,) if isinstance(api_key, str) else tuple(api_key or ())
        self.expected = tuple(f"Bearer {k}".encode() for k in keys) or None  # several keys: any one of them
        self.max_body_bytes, self.max_in_flight = max_body_bytes, max_in_flight
        self.in_flight = 0  # generation requests open; one event loop per process, so no lock

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = _headers(scope)
        refusal = self._refusal(scope, headers)
        if refusal is not None:
            return await _send_error(send, refusal)
        generation = scope["method"] == "POST" and scope["path"] in GENERATION_PATHS
        if generation and self.in_flight >= self.max_in_flight:
            return await _send_error(send, overloaded(f"over {self.max_in_flight} requests in flight; retry later"))
        self.in_flight += generation
        try:
            await self._serve(scope, receive, send)
        finally:
            self.in_flight -= generation

    def _refusal(self, scope, headers: dict[bytes, list[bytes]]) -> ApiError | None:
        if self.expected is not None and scope["path"].startswith(KEYED):
            given = headers.get(b"authorization", [b""])
            matches = [hmac.compare_digest(given[0], key) for key in self.expected] if len(given) == 1 else []
            if not any(matches):  # every key compared, each in constant time
                return ApiError(401, "missing or invalid API key", "authentication_error")
        lengths = set(headers.get(b"content-length", []))
        if len(lengths) > 1 or any(not v.isdigit() for v in lengths):
            return ApiError(400, "bad Content-Length header")
        if lengths and int(lengths.pop()) > self.max_body_bytes:
            return ApiError(413, f"request body over {self.max_body_bytes} bytes")
        return None

    async def _serve(self, scope, receive, send) -> None:
        oversize = ApiError(413, f"request body over {self.max_body_bytes} bytes")
        received, too_large, started = 0, False, False

        async def counted_receive():
            nonlocal received, too_large
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_body_bytes:
                    too_large = True
                    raise BodyTooLarge(oversize.message)
            return message

        async def guarded_send(message):
            nonlocal started
            if too_large:  # the route's answer to the exception it saw: ours goes instead
                if not started:
                    started = True
                    await _send_error(send, oversize)
                return
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, counted_receive, guarded_send)
        except Exception as exc:
            if not too_large:
                log.exception("unhandled error in %s %s", scope["method"], scope["path"])
            if started:
                raise  # the response is under way: the server closes the connection
            started = True
            await _send_error(send, oversize if too_large else
                              ApiError(500, f"internal error ({type(exc).__name__})", "server_error"))
        if too_large and not started:
            await _send_error(send, oversize)


class RequestId:
    """X-Request-Id as Serve's proxy handles it, for servers without Ray (`app.api.local`): the client's id, or a
    new one, is put in the request's headers (the routes log it beside the response id) and echoed in the
    response's. An id that is not printable ASCII of at most MAX_REQUEST_ID_CHARS is refused (400), since it
    ends up in logs. Duplicates are fine: the response ids are the engine's own."""

    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        given = _headers(scope).get(b"x-request-id", [])
        if len(given) > 1 or any(len(v) > MAX_REQUEST_ID_CHARS or not all(32 < c < 127 for c in v) for v in given):
            return await _send_error(send, ApiError(400, f"X-Request-Id: one header of at most "
                                                         f"{MAX_REQUEST_ID_CHARS} printable ASCII characters",
                                                    param="X-Request-Id"))
        request_id = given[0] if given else uuid.uuid4().hex.encode()
        if not given:
            scope = {**scope, "headers": [*scope.get("headers", ()), (b"x-request-id", request_id)]}

        async def send_with_id(message):
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", request_id)]}
            await send(message)

        await self.app(scope, receive, send_with_id)


def _headers(scope) -> dict[bytes, list[bytes]]:
    out: dict[bytes, list[bytes]] = {}
    for name, value in scope.get("headers", ()):
        out.setdefault(name.lower(), []).append(value.strip())
    return out


async def _send_error(send, exc: ApiError) -> None:
    response = error_response(exc)
    await send({"type": "http.response.start", "status": response.status_code, "headers": response.raw_headers})
    await send({"type": "http.response.body", "body": response.body})
