"""`RouteHint`: what the API knows about where a request's prefix lives, handed to the backend with the request.
Behind Serve the prefix-aware router weighs it in its cost model (deployments/routing_policy.py); the local
server has one engine and ignores it.

- `key`: OpenAI's `prompt_cache_key`. Requests with the same key (and `cache_salt`) go to one replica while the
  queue there costs less than the prefill the key stands for.
- `replica`, `prompt`, `prefix`, `stored_at`: a Responses continuation's. The replica that served the stored
  response it continues, that response's prompt length and its prompt + output length (which this prompt starts
  with, exactly), and when it was stored (time.time()).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass


@dataclass(frozen=True)
class RouteHint:
    key: str | None = None
    replica: str | None = None
    prompt: int = 0
    prefix: int = 0
    stored_at: float = 0.0

    def key_hash(self, salt: str | None) -> int | None:
        """The key as the router and the replicas carry it: 63 bits of BLAKE2b over the salt and the key (one
        tenant's key never steers with another's)."""
        if self.key is None:
            return None
        digest = hashlib.blake2b(f"{salt or ''}\x00{self.key}".encode(), digest_size=8).digest()
        return int.from_bytes(digest, "big") >> 1
