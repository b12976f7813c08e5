"""What the ingress sends to an engine replica through a DeploymentHandle (and a replica to a peer: `ExportRequest`).
The router reads it too: `prompt_ids` for our prefix-aware router, `prompt` (text) for Ray's
PrefixCacheAffinityRouter; it sets `fetch`."""

from __future__ import annotations

from dataclasses import dataclass, field

from app.engine.request import SamplingParams


@dataclass
class GenerateRequest:
    prompt_ids: list[int]
    params: SamplingParams
    prompt: str = ""
    request_id: str | None = None
    hashes: list[int] = field(default_factory=list)  # block hashes (salted by params.cache_salt), from the ingress
    deadline: float | None = None  # absolute time.time() after which the engine gives the request up
    avoid: str | None = None  # a retry's: the replica (id) that failed it, which our router then skips
    stream: bool = True  # False: each sequence's first output, then the rest merged into one (AsyncEngine.generate)
    affinity: int | None = None  # the hashed prompt_cache_key (`RouteHint.key_hash`): a routing hint
    # a Responses continuation's: (replica that served the stored response, its prompt tokens, its prompt + output
    # tokens this prompt starts with, when it was stored (time.time())); see app/api/hints.py
    resume: tuple[str, int, int, float] | None = None
    # the router's: per replica that would pull this prompt's checkpoint from a peer first, were it to serve it,
    # (that peer, the entry's bytes, its depth in tokens; 0: the deepest the peer has); see peer_fetch.py. One plan
    # per candidate, not only the chosen one's: Ray sends a request to the next rank when the first is full
    fetch: dict[str, tuple] | None = None
    # a handle caller's (benchmarks, operators): the replica that must serve it; the router then leaves `fetch` as
    # the caller set it. Never set from the API.
    route_to: str | None = None


@dataclass
class ExportRequest:
    """A replica asking a peer (`route_to`: the router sends it there alone) for the deepest checkpoint of `salt`
    that `prompt_ids` starts with, at most `limit` deep (deployments/peer_fetch.py)."""

    route_to: str
    prompt_ids: list[int]
    limit: int
    salt: str | None = None


@dataclass
class FetchStatusRequest:
    """An operator's (or a fault scenario's) question to one replica, `route_to` (the router sends it there alone):
    its peer fetches under way and its fetch counters, live (`EngineReplica.peer_fetch_status`)."""

    route_to: str
