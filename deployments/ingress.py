"""`Ingress`: the OpenAI API (routes in `app.api`) in front of the engine replicas.

It tokenizes, validates, computes the prompt's block hashes once (salted with the request's `cache_salt`, so one
tenant's prefixes never match another's), and calls the engine deployment through a DeploymentHandle with a
`GenerateRequest`, so the request router sees the tokens. /metrics and /status read the tuning controller, which
holds every replica's latest telemetry; a dead controller is re-resolved (recreated) on the next call. A request
whose replica dies or cannot step before the client saw a token is retried once on another replica
(`GenerateRequest.avoid` keeps our router off the one that failed): a streamed request before its first token, a
request that is not streamed at any point (its outputs are held until the end, so a partial answer is dropped and
the request starts over); a streamed request after its first token cannot be (the client has part of an answer),
and the error reaches the routes, which end the stream with an error event. A request's
`RouteHint` (a prompt_cache_key, a Responses continuation's replica) goes to the router with it
(`GenerateRequest.affinity`, `.resume`); a retry drops the continuation's. Stored responses live in a named actor
(deployments/response_store.py), not here. Ray's `BackPressureError` (the engine deployment's `max_queued_requests`
is full) is passed through untouched: the API answers it with 429.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator

from ray import serve
from ray.exceptions import RayActorError
from ray.serve import context as serve_context

from app.api.hints import RouteHint
from app.api.metrics import ApiMetrics
from app.api.routes import ApiSettings, build_api
from app.cache.digest import block_hashes
from app.engine.errors import EngineUnavailable
from app.engine.request import RequestOutput, SamplingParams
from app.models.loader import read_config, resolve_model_dir
from app.models.tokenizer import Tokenizer
from deployments.controller import ControllerClient
from deployments.logs import through_serve
from deployments.messages import GenerateRequest
from deployments.response_store import ActorResponses

log = logging.getLogger("ray.serve")
# A replica that died (RayActorError: ActorDiedError, ActorUnavailableError) or whose engine cannot step
# (EngineUnavailable, raised by the replica before any output): another replica may serve the request.
RETRYABLE = (RayActorError, EngineUnavailable)
SERVING = {"HEALTHY", "UPSCALING", "DOWNSCALING"}  # engine deployment statuses in which every replica serves


class RayBackend:
    def __init__(self, handle, tokenizer: Tokenizer, max_model_len: int, digest_block: int, controller_cfg: dict,
                 model_name: str):
        """`model_name`: the served model name, as the metrics label it."""
        self.handle = handle.options(stream=True)
        self.app_name, self.deployment_name = handle.app_name, handle.deployment_name
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.digest_block = digest_block
        self.metrics = ApiMetrics(model_name)
        self.controller = ControllerClient(controller_cfg["actor"])

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context length {self.max_model_len}")

    def _hashes(self, prompt_ids: list[int], params: SamplingParams) -> list[int]:
        return block_hashes(prompt_ids, self.digest_block, salt=params.cache_salt)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, deadline: float | None = None,
                       stream: bool = True, hint: RouteHint | None = None) -> AsyncIterator[RequestOutput]:
        """Stream the request's outputs; `deadline` (absolute time.time()) and `stream` go to the engine, `hint`
        to the router."""
        req = GenerateRequest(prompt_ids, params, prompt=self.tokenizer.decode(prompt_ids),
                              hashes=self._hashes(prompt_ids, params), deadline=deadline, stream=stream)
        if hint is not None:
            req.affinity = hint.key_hash(params.cache_salt)
            if hint.replica is not None:
                req.resume = (hint.replica, hint.prompt, hint.prefix, hint.stored_at)
        meter, streamed, retried = self.metrics.meter(params.n, stream), False, False
        _own_routing_id()
        while True:
            response, finished, held = self.handle.generate.remote(req), False, []
            try:
                async for wired in response:
                    out = RequestOutput(**wired)
                    meter.observe(out)
                    if stream:
                        streamed = True
                        yield out
                    else:  # the client sees nothing before the end: a replica lost mid-generation is retried
                        held.append(out)
                finished = True
                self.metrics.requests.labels(route="generate", outcome="ok").inc()
                for out in held:
                    yield out
                return
            except RETRYABLE as exc:
                if streamed or retried or (deadline is not None and time.time() >= deadline):
                    self.metrics.requests.labels(route="generate", outcome="error").inc()
                    raise
                log.warning("replica failed before the client saw a token, retrying once on another: %r", exc)
                self.metrics.retries.inc()
                retried, req.avoid = True, _failed_replica(exc)
                req.resume = None  # the replica it named may be the one that failed
            except Exception as exc:
                outcome = "rejected" if type(exc).__name__ == "BackPressureError" else "error"
                self.metrics.requests.labels(route="generate", outcome=outcome).inc()
                raise
            finally:
                if not finished:  # the reader left (client gone, overflow, error): stop the replica's generation
                    response.cancel()

    async def health(self) -> None:
        """Raise unless every engine replica can step.

        Serve's view of the engine deployment decides: each replica's `check_health` probes its engine's step
        thread (`AsyncEngine.check_alive`) every `health_check_period_s`, and a failed probe makes the
        deployment UNHEALTHY until Serve has replaced that replica. Asking Serve costs one controller call and
        needs no private API to address replicas one by one; the price is a lag of up to one health-check
        period after an engine stops."""
        status = await asyncio.to_thread(serve.status)
        app = status.applications.get(self.app_name)
        dep = app.deployments.get(self.deployment_name) if app else None
        if dep is None:
            raise EngineUnavailable(f"engine deployment {self.deployment_name!r} not found")
        if getattr(dep.status, "value", dep.status) not in SERVING or not dep.replica_states.get("RUNNING"):
            raise EngineUnavailable(f"engine deployment is {dep.status}: {dep.message or dep.replica_states}")

    async def metrics_text(self) -> str:
        state = await self.status()
        flat = {k: v for k, v in state.items() if isinstance(v, (int, float, bool))}
        return self.metrics.render(state.get("replicas", {}), flat)

    async def status(self) -> dict:
        return await self.controller.call("state")


def _own_routing_id() -> None:
    """Give the handle calls of the running task a Serve internal request id of their own.

    Serve stamps every handle call made while serving a request with that request's internal id, and Ray 2.60's
    request router indexes the calls waiting for a replica by it: two calls of one HTTP request waiting at the
    same time (the prompts of a multi-prompt request run concurrently) collide there, the second is never
    assigned, and the request hangs. Each generation runs in its own task (`app.api.streams.Outputs`), so setting
    the context variable here changes only that task. Serve's cancellation of a cancelled parent's child calls
    finds them by the parent's id and so no longer reaches these; `RayBackend.generate` cancels its own call
    whenever its reader leaves before the end (dropping the response generator also stops it in Ray 2.60, but
    that rests on the object being collected at once)."""
    ctx = serve_context._get_serve_request_context()
    serve_context._serve_request_context.set(dataclasses.replace(ctx, _internal_request_id=uuid.uuid4().hex))


def _failed_replica(exc: Exception) -> str | None:
    """The replica id an EngineUnavailable names (the replica sets it; Ray wraps the exception as `cause`). A
    replica that died needs none: Serve's router drops it by itself."""
    return getattr(exc, "replica", None) or getattr(getattr(exc, "cause", None), "replica", None)


@serve.ingress()
class Ingress:
    def __init__(self, engine, model: str, api: dict, digest_block: int, controller: dict) -> None:
        model_dir = resolve_model_dir(model)
        cfg = read_config(model_dir)
        max_len = int(cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 4096)
        api = dict(api)
        served = api.pop("served_model_name", None) or model
        self.backend = RayBackend(engine, Tokenizer.from_dir(model_dir), max_len, digest_block, controller, served)
        # Serve's proxy takes, makes and echoes X-Request-Id (RequestIdMiddleware); the routes' log of it goes to
        # the replica's log through Serve's logger
        self.settings = ApiSettings(model_name=served, request_id_header=False, **api)
        s = self.settings  # stored responses live in a named actor: they outlive this replica
        self.backend.responses = ActorResponses(s.max_stored_responses, s.max_stored_response_bytes,
                                                s.stored_response_age_s)
        through_serve("app.api.routes")

    def __serve_build_asgi_app__(self):
        return build_api(self.backend, self.settings)
