"""Raw HTTP/1.1 over loopback, the classification of an answer, and a scenario's outcome record.

The bad-input catalogue needs bodies that no ordinary client sends (no Content-Length, chunked, invalid UTF-8,
a Content-Length that lies), so requests are written byte for byte here. Every request asks for
`Connection: close`: the answer is then everything the server writes until it closes, which keeps parsing a
pure function of bytes (`parse_response`) and makes "hang" one clear condition (no close before the deadline).
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import dataclass, field
from urllib.parse import urlsplit

FRAMINGS = ("length", "chunked", "none")
MAX_FINDINGS = 20


@dataclass(frozen=True)
class RawRequest:
    """One request as bytes go out. framing: "length" (Content-Length), "chunked" (Transfer-Encoding), "none"
    (neither: an HTTP/1.1 server must read no body). `content_length` overrides the header's value (a lie)."""

    name: str
    path: str
    body: bytes = b""
    method: str = "POST"
    headers: tuple[tuple[str, str], ...] = (("content-type", "application/json"),)
    framing: str = "length"
    content_length: int | None = None
    chunk: int = 65536

    def __post_init__(self) -> None:
        if self.framing not in FRAMINGS:
            raise ValueError(f"framing must be one of {FRAMINGS}, not {self.framing!r}")


def encode_request(req: RawRequest, host: str) -> bytes:
    """The request's bytes: request line, Host, the request's headers, framing headers, body."""
    lines = [f"{req.method} {req.path} HTTP/1.1", f"host: {host}", "connection: close"]
    lines += [f"{k}: {v}" for k, v in req.headers]
    body = req.body
    if req.framing == "length":
        lines.append(f"content-length: {len(body) if req.content_length is None else req.content_length}")
    elif req.framing == "chunked":
        lines.append("transfer-encoding: chunked")
        parts = [body[i: i + req.chunk] for i in range(0, len(body), req.chunk)]
        body = b"".join(b"%x\r\n%s\r\n" % (len(p), p) for p in parts) + b"0\r\n\r\n"
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


@dataclass
class Answer:
    """What came back: status 0 when the server closed without an answer; `hung` when it neither answered
    nor closed before the deadline."""

    status: int = 0
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    elapsed_s: float = 0.0
    hung: bool = False

    def json(self):
        return json.loads(self.body)


def parse_response(data: bytes) -> Answer:
    """An HTTP/1.1 response read to the connection's close: status, headers (lower-case names), de-chunked body."""
    head, sep, rest = data.partition(b"\r\n\r\n")
    if not sep or not head.startswith(b"HTTP/1."):
        return Answer()
    first, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        k, _, v = line.partition(":")
        headers[k.strip().lower()] = v.strip()
    status = int(first.split()[1])
    if headers.get("transfer-encoding", "").lower() == "chunked":
        rest = _dechunk(rest)
    elif "content-length" in headers:
        rest = rest[: int(headers["content-length"])]
    return Answer(status, headers, rest)


def _dechunk(data: bytes) -> bytes:
    out, i = [], 0
    while True:
        j = data.find(b"\r\n", i)
        if j < 0:
            break
        size = int(data[i:j].split(b";")[0] or b"0", 16)
        if size == 0:
            break
        out.append(data[j + 2: j + 2 + size])
        i = j + 2 + size + 2
    return b"".join(out)


async def send(url: str, req: RawRequest, timeout_s: float) -> Answer:
    """Send `req` to the server at `url` and read until it closes; bounded by `timeout_s` overall."""
    parts = urlsplit(url)
    t0 = time.perf_counter()
    writer = None
    try:
        async with asyncio.timeout(timeout_s):
            reader, writer = await asyncio.open_connection(parts.hostname, parts.port)
            reading = asyncio.ensure_future(_read_all(reader))  # a server may answer before the body is sent
            try:
                writer.write(encode_request(req, parts.netloc))
                await writer.drain()
            except (ConnectionError, OSError):
                pass  # it stopped reading (an early 413): its answer is still in `reading`
            data = await reading
    except TimeoutError:
        return Answer(hung=True, elapsed_s=time.perf_counter() - t0)
    except OSError:
        data = b""  # could not connect
    finally:
        if writer is not None:
            writer.transport.abort()
    answer = parse_response(data)
    answer.elapsed_s = time.perf_counter() - t0
    return answer


async def _read_all(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    try:
        while chunk := await reader.read(65536):
            chunks.append(chunk)
    except (ConnectionError, OSError):
        pass  # reset after (part of) an answer: keep what came
    return b"".join(chunks)


def is_openai_error(obj) -> bool:
    """`{"error": {"message": str, "type": str, "param": ..., "code": ...}}` and nothing else at the top."""
    if not isinstance(obj, dict) or set(obj) != {"error"} or not isinstance(obj["error"], dict):
        return False
    err = obj["error"]
    return {"message", "type", "param", "code"} <= set(err) and isinstance(err["message"], str) \
        and isinstance(err["type"], str)


def sse_events(body: bytes) -> list:
    """The `data:` payloads of an event stream, JSON-decoded ("[DONE]" kept as the string)."""
    events = []
    for line in body.decode("utf-8", "replace").splitlines():
        if line.startswith("data:"):
            payload = line[5:].strip()
            events.append(payload if payload == "[DONE]" else json.loads(payload))
    return events


def classify(answer: Answer) -> str:
    """One word per answer: "hang", "no_answer", "5xx", "not_json" (an error that is not OpenAI-style JSON, or a
    200 that is neither JSON nor an event stream of JSON), "stream_error" (a 200 stream carrying a server_error
    event), "ok" (a 200), "rejected" (a 4xx OpenAI-style JSON error)."""
    if answer.hung:
        return "hang"
    if answer.status == 0:
        return "no_answer"
    if answer.status >= 500:
        return "5xx"
    try:
        if answer.headers.get("content-type", "").startswith("text/event-stream"):
            events = sse_events(answer.body)
            if any(isinstance(e, dict) and e.get("error", {}).get("type") == "server_error" for e in events):
                return "stream_error"
            return "ok" if answer.status == 200 and events and events[-1] == "[DONE]" else "not_json"
        body = answer.json()
    except ValueError:
        return "not_json"
    if answer.status == 200:
        return "ok"
    return "rejected" if is_openai_error(body) else "not_json"


@dataclass
class Outcome:
    """A scenario's figures, its criteria (name -> {"want", "got", "pass"}) and findings (the requests behind
    a failure, at most MAX_FINDINGS)."""

    figures: dict = field(default_factory=dict)
    criteria: dict = field(default_factory=dict)
    findings: list = field(default_factory=list)
    skipped: str | None = None

    def check(self, name: str, passed: bool, want: str, got) -> None:
        self.criteria[name] = {"want": want, "got": got, "pass": bool(passed)}

    def find(self, **finding) -> None:
        if len(self.findings) < MAX_FINDINGS:
            self.findings.append(finding)

    @property
    def passed(self) -> bool:
        return self.skipped is None and all(c["pass"] for c in self.criteria.values())

    def as_dict(self) -> dict:
        return {"passed": self.passed, "skipped": self.skipped, "figures": self.figures, "criteria": self.criteria,
                "findings": self.findings}


def rss_bytes(pid: int) -> int:
    """Resident set size of process `pid` (Linux /proc), in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise ValueError(f"no VmRSS for pid {pid}")


def describe(req: RawRequest, limit: int = 300) -> str:
    """A finding's request in one line: method, path, framing and the body's start (escaped)."""
    body = req.body[:limit].decode("utf-8", "backslashreplace")
    more = f"... ({len(req.body)} bytes)" if len(req.body) > limit else ""
    return f"{req.method} {req.path} [{req.framing}] {body}{more}"


@dataclass
class Target:
    """Where a scenario points: the base URL; for a local server its pid (RSS); for a Ray app the
    `cluster.Cluster` that reaches replicas and processes (None: the scenarios that need one are skipped)."""

    url: str
    model: str = "kda-tiny"
    pid: int | None = None
    cluster: object | None = None


def tally(classes: list[str]) -> dict[str, int]:
    """How many answers of each class, in a stable order."""
    return {k: classes.count(k) for k in sorted(set(classes))}
