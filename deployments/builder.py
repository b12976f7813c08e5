"""`build_app(args)`: validate the serve config's `args` and compose ingress -> router -> engine replicas.

Used by `serve run configs/config.yaml` (import_path: deployments.builder:build_app). Every field is
documented in the pydantic models below; `engine` takes the engine's knobs, defined once in
app/engine/config.py. configs/config.yaml shows the fields a CPU deployment usually sets.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, create_model, field_validator, model_validator
from pydantic.types import PositiveInt
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

from app.dasc.allowance import read_allowance
from app.engine.config import KNOBS, EngineConfig
from app.models.loader import resolve_model_dir
from deployments.controller import NAME as CONTROLLER_NAME
from deployments.ingress import Ingress
from deployments.replica import EngineReplica

ROUTERS = {
    "prefix": "deployments.router.PrefixAwareRouter",
    "pow2": "ray.serve._private.request_router.pow_2_router.PowerOfTwoChoicesRequestRouter",
    "prefix_affinity": "ray.llm._internal.serve.routing_policies.prefix_aware.prefix_aware_router."
                       "PrefixCacheAffinityRouter",
}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


_ENGINE_ARGS_DOC = """The engine's knobs, exactly the fields of `app.engine.config.EngineConfig` (see its docs).

Each value goes through the knob's own check, so a bad one is a validation error at `engine.<knob>`; then the
whole goes through `EngineConfig` for the checks that join knobs (a checkpoint budget unless slots are set).
"""


def _engine_args() -> type[BaseModel]:
    """`EngineArgs`, built from `app.engine.config.KNOBS`: one field per knob with its type (a Literal gives the
    allowed values), default, lower bound and doc as description."""
    fields = {k.name: (k.type, Field(k.default, description=k.doc, ge=k.ge)) for k in KNOBS.values()}
    validators = {"_check_knob": field_validator(*KNOBS)(_check_knob),
                  "_speculative": model_validator(mode="before")(_speculative_block),
                  "_check_config": model_validator(mode="after")(_check_config)}
    return create_model("EngineArgs", __base__=_Strict, __doc__=_ENGINE_ARGS_DOC, __validators__=validators,
                        **fields)


# `engine.speculative: {method: ngram, num_tokens: 4, ...}`: the spec_* knobs as one block
SPECULATIVE_KEYS = {"method": "spec", "num_tokens": "spec_tokens", "rollback": "spec_rollback",
                    "ngram_max": "spec_ngram_max", "ngram_min": "spec_ngram_min", "draft_cost": "spec_draft_cost",
                    "verify_cost": "spec_verify_cost",
                    "max_batch": "spec_max_batch"}


def _speculative_block(cls, data):
    """Spread an `engine.speculative` block onto the flat spec_* knobs (each then checked as a knob)."""
    if not isinstance(data, dict) or "speculative" not in data:
        return data
    data = dict(data)
    block = data.pop("speculative")
    if block is None:
        return data
    if not isinstance(block, dict):
        raise ValueError("speculative must be a mapping: {method: ngram, num_tokens: 4, ...}")
    unknown = sorted(set(block) - set(SPECULATIVE_KEYS))
    if unknown:
        raise ValueError(f"speculative has unknown keys {unknown}; known: {sorted(SPECULATIVE_KEYS)}")
    for key, value in block.items():
        knob = SPECULATIVE_KEYS[key]
        if knob in data:
            raise ValueError(f"speculative.{key} and {knob} are the same knob: set one")
        data[knob] = "off" if key == "method" and value is False else value  # YAML 1.1 reads `off` as false
    return data


def _check_knob(cls, value, info: ValidationInfo):
    KNOBS[info.field_name].check(value)
    return value


def _check_config(self):
    EngineConfig(**self.model_dump())
    return self


EngineArgs = _engine_args()


class RouterArgs(_Strict):
    kind: str = Field("prefix", description="prefix (ours) | pow2 (Ray default) | prefix_affinity (Ray LLM)")
    stats_period_s: float = Field(2.0, description="how often replicas publish queue length and digest")
    block_size: int = Field(16, description="tokens per hashed block in digests")
    affinity_credit: float = Field(0.5, ge=0, description="weight of KV held beyond a replica's checkpoint, in "
                                                          "prefill tokens (keeps a new prefix on one replica)")
    work_weight: float = Field(4.0, ge=0, description="weight of the prefill a request adds to a replica, beyond "
                               "its own wait (the work delays that replica's later requests too): favours hits over "
                               "a shorter queue")
    key_credit: float = Field(2.0, ge=0, description="prompts' worth of prefill credited to a replica that served the "
                              "request's prompt_cache_key lately (its requests stay there until the queue costs more)")
    remember_s: float = Field(30.0, gt=0, description="how long the router counts a prefix it sent as held there")
    settle_s: float = Field(2.0, ge=0, description="a sent prefix a later digest does not hold is forgotten after "
                                                   "this")
    fetch_fixed_s: float = Field(0.05, ge=0, description="a peer fetch's fixed cost until the replicas measure it "
                                 "(replicas with engine.peer_fetch pull a peer's checkpoint when that is cheapest)")
    fetch_s_per_byte: float = Field(1e-9, ge=0, description="a peer fetch's cost per byte until measured")
    fetch_max_bytes: int = Field(512 * 2**20, ge=0, description="no peer fetch of a larger entry (object store room)")


class ControllerArgs(_Strict):
    enabled: bool = Field(True, description="tune W_max / interval / nr-wr from live telemetry")
    window_s: float = Field(10.0, description="telemetry window length")
    max_w_nr: float = Field(128, description="largest W_max the controller may use with nr")
    max_w_wr: float = Field(512, description="largest W_max the controller may use with wr")
    trial_windows: int = 2
    warmup_windows: int = 1
    refill_windows: int = 3
    min_requests: int = 4
    judge_requests: int = Field(16, ge=1, description="requests a trial and its control are judged on, at least "
                                "(windows accumulate until then)")
    hysteresis: float = 0.05
    cooldown_windows: int = 10
    lookbacks: list[PositiveInt] = Field([16, 64, 256], description="lookbacks the controller may pick besides 0 "
                                         "(longer when requests branch further before stored prompt ends, 0 when "
                                         "lookback checkpoints go unreused); empty: it keeps engine.lookback")
    allowed: list[str] | None = Field(None, description="settings the controller may use (dense, nr-W16, wr-W512, "
                                      "...); unset: the model's allowance.json, and without one only dense")


class IngressArgs(_Strict):
    """The HTTP front door (FastAPI routes in app/api). Each open request, an SSE stream included, holds one of
    an ingress replica's `max_ongoing_requests` for its whole life, so this bounds how many clients are served
    at once; Ray's default (5) would make the sixth stream wait for one of the first five to end. Keep it above
    what the engine side takes (engine replicas x max_ongoing_requests + max_queued_requests): then overload
    shows as the engine queue's BackPressureError, which the API answers 429 with Retry-After, rather than
    as requests waiting in Serve's proxy."""

    replicas: int = Field(1, ge=1, description="ingress replicas (killing one does not stop the service)")
    max_ongoing_requests: int = Field(512, ge=1, description="requests one ingress replica serves at once, open "
                                                             "streams included")
    max_queued_requests: int = Field(2048, ge=1, description="requests Serve's HTTP proxy queues for the ingress "
                                                             "(a burst waits there while the proxy routes it: 128 "
                                                             "dropped 44 of a 256-request burst as plain-text 503s); "
                                                             "more are refused at once (503)")


class ApiArgs(_Strict):
    """The API's limits: the fields of `app.api.routes.ApiSettings` (docs/serving.md, API limits and security)."""

    api_key: str | list[str] | None = Field(None, description="Bearer key, or a list of keys any one of which is "
                                            "accepted (each sees only its own stored responses); the DASC_API_KEY "
                                            "environment variable also sets one")
    served_model_name: str | None = Field(None, description="the model name clients send (`model`; another is "
                                          "answered 404); unset: the `model` arg")
    max_prompt_tokens: int = Field(3072, ge=1, description="prompt tokens at most (413 beyond)")
    max_tokens_limit: int = Field(1024, ge=1, description="max_tokens at most")
    default_max_tokens: int = Field(16, ge=1, description="max_tokens when a request names none")
    max_body_bytes: int = Field(1 << 20, ge=1, description="request body bytes at most, chunked or not (413)")
    max_prompts: int = Field(16, ge=1, description="prompts in one completion request")
    max_sequences: int = Field(64, ge=1, description="prompts x n of one request")
    max_stops: int = Field(4, ge=0, description="stop strings per request")
    max_stop_chars: int = Field(256, ge=1, description="characters in one stop string")
    max_messages: int = Field(256, ge=1, description="messages in one chat request")
    max_cache_salt_chars: int = Field(256, ge=0, description="characters in cache_salt")
    cors_origins: list[str] = Field(default_factory=list, description="origins browsers may call from (empty: "
                                    "no CORS)")
    max_in_flight: int = Field(256, ge=1, description="generation requests open in one ingress process (429 "
                               "beyond)")
    queue_timeout_s: float = Field(60.0, gt=0, description="a request not started by then is answered 503")
    max_buffered_chunks: int = Field(256, ge=1, description="stream chunks a client may fall behind before its "
                                     "request is aborted")
    max_tools: int = Field(128, ge=0, description="functions in one request's tools")
    max_tools_chars: int = Field(65536, ge=0, description="characters of one request's tool JSON (413 beyond)")
    max_tool_calls: int = Field(16, ge=1, description="tool calls in one answer")
    max_grammar_compile_s: float = Field(5.0, gt=0, description="the tools' parameter schemas must compile into a "
                                         "grammar within this (400 beyond)")
    recall_tokens: int = Field(1 << 22, ge=0, description="ids of recent chat answers kept, so that a re-sent "
                               "answer resumes from the ids generated (0: off; docs/serving.md, Tool calls)")
    warm_next_turn: bool = Field(True, description="under a thinking chat template, also store the conversation "
                                 "as the next turn re-sends it (docs/serving.md, Thinking turns)")
    max_stored_responses: int = Field(10_000, ge=0, description="Responses API: stored responses at most (the "
                                      "oldest go first)")
    max_stored_response_bytes: int = Field(256 << 20, ge=0, description="Responses API: bytes of stored ids and "
                                           "text at most")
    stored_response_age_s: float = Field(24 * 3600.0, gt=0, description="Responses API: a stored response is kept "
                                         "this long at most")


class ServeArgs(_Strict):
    model: str = Field("kda-tiny", description="zoo name or checkpoint directory")
    replicas: int = Field(2, ge=1)
    replica_cpus: float = Field(1.0, description="CPUs reserved per replica")
    threads: int = Field(1, description="torch threads per replica")
    max_ongoing_requests: int = Field(
        64, ge=1, description="requests one engine replica holds at once (running and waiting in its engine); "
                              "Serve routes no more to it. Keep it at least the engine's max_running, or the "
                              "batch never fills")
    max_queued_requests: int = Field(
        64, ge=1, description="requests each ingress replica's handle queues while every engine replica is at "
                              "max_ongoing_requests; beyond it Ray raises BackPressureError, answered 429")
    health_check_period_s: float = Field(5.0, gt=0, description="how often Serve probes each engine replica's step "
                                                                "thread (EngineReplica.check_health)")
    health_check_timeout_s: float = Field(
        20.0, gt=0, description="a probe not answered within this fails; the step thread gets "
                                "health_check_timeout_s / 2 to come round its loop (a long step finishes first)")
    graceful_shutdown_timeout_s: float = Field(30.0, ge=0, description="on shutdown or replacement, how long an "
                                               "engine replica may finish the requests in flight")
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per replica (1: in-process)")
    placement: str = Field("off", description="TP placement of dasc checkpoints: off | storage | balanced")
    engine: EngineArgs = Field(default_factory=EngineArgs, description="engine knobs (app/engine/config.py)")
    router: RouterArgs = RouterArgs()
    controller: ControllerArgs = ControllerArgs()
    ingress: IngressArgs = IngressArgs()
    api: ApiArgs = ApiArgs()

    @model_validator(mode="after")
    def _limits_fit(self):
        if self.max_ongoing_requests < self.engine.max_running:
            raise ValueError(f"max_ongoing_requests ({self.max_ongoing_requests}) is below engine.max_running "
                             f"({self.engine.max_running}): the engine's batch could never fill")
        return self


def controller_config(cfg: ServeArgs) -> dict:
    """What the replicas and the ingress get about the tuning controller; "actor" is its constructor's kwargs."""
    c = cfg.controller
    knobs = {"max_w_nr": c.max_w_nr, "max_w_wr": c.max_w_wr, "interval": cfg.engine.interval,
             "lookback": cfg.engine.lookback, "lookbacks": tuple(c.lookbacks),
             "trial_windows": c.trial_windows, "warmup_windows": c.warmup_windows,
             "refill_windows": c.refill_windows, "min_requests": c.min_requests,
             "judge_requests": c.judge_requests,
             "hysteresis": c.hysteresis,
             "cooldown_windows": c.cooldown_windows, "max_running": cfg.engine.max_running}
    allowance = _allowance(cfg)
    knobs["allowed"] = tuple(allowance["allowed"]) if allowance else None
    initial = {"w_max": cfg.engine.w_max, "policy": cfg.engine.policy, "interval": cfg.engine.interval,
               "lookback": cfg.engine.lookback}
    return {"enabled": c.enabled, "window_s": c.window_s,
            "actor": {"knobs": knobs, "initial": initial, "enabled": c.enabled, "window_s": c.window_s,
                      "allowance": allowance}}


def build_app(args: dict) -> Application:
    cfg = ServeArgs(**(args or {}))
    if cfg.router.kind not in ROUTERS:
        raise ValueError(f"router.kind must be one of {sorted(ROUTERS)}, got {cfg.router.kind!r}")
    controller = controller_config(cfg)
    router_kwargs = {}
    if cfg.router.kind == "prefix":
        router_kwargs = {k: getattr(cfg.router, k) for k in ("block_size", "affinity_credit", "work_weight",
                                                             "key_credit", "remember_s", "settle_s", "fetch_fixed_s",
                                                             "fetch_s_per_byte", "fetch_max_bytes")}
    engine_dep = serve.deployment(EngineReplica).options(
        name="EngineReplica", num_replicas=cfg.replicas, max_ongoing_requests=cfg.max_ongoing_requests,
        max_queued_requests=cfg.max_queued_requests, health_check_period_s=cfg.health_check_period_s,
        health_check_timeout_s=cfg.health_check_timeout_s,
        graceful_shutdown_timeout_s=cfg.graceful_shutdown_timeout_s, **_replica_resources(cfg),
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[cfg.router.kind], request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=cfg.router.stats_period_s),
    ).bind(cfg.model, cfg.engine.model_dump(), cfg.router.block_size, controller, cfg.threads, cfg.tp_size,
           cfg.placement, alive_timeout_s=cfg.health_check_timeout_s / 2,
           drain_timeout_s=min(cfg.graceful_shutdown_timeout_s, 10.0))
    api = cfg.api.model_dump()
    api["api_key"] = api["api_key"] or os.environ.get("DASC_API_KEY") or None
    i = cfg.ingress
    ingress = serve.deployment(Ingress).options(
        name="Ingress", num_replicas=i.replicas, max_ongoing_requests=i.max_ongoing_requests,
        max_queued_requests=i.max_queued_requests, ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine_dep, cfg.model, api, cfg.router.block_size, controller)


def _allowance(cfg: ServeArgs) -> dict | None:
    """`controller.allowed` from the config, else the model's measured allowance.json; None: only dense."""
    if cfg.controller.allowed is not None:
        return {"allowed": list(cfg.controller.allowed), "source": "config: controller.allowed"}
    try:
        record = read_allowance(resolve_model_dir(cfg.model))
    except FileNotFoundError:  # the model is not on this node: the replicas will say so
        return None
    return None if record is None else {**record, "source": f"{cfg.model}/allowance.json"}


def _replica_resources(cfg: ServeArgs) -> dict:
    """What one replica reserves. TP ranks 1..T-1 are processes the replica starts itself.

    CPU: one placement-group bundle per rank keeps the ranks' CPUs on the replica's node and out of other
    replicas' hands. GPU: the replica actor takes all T GPUs (`num_gpus: tp_size`), because Ray exposes an
    actor's GPUs to it through CUDA_VISIBLE_DEVICES, which the rank processes inherit: rank r uses the r-th.
    """
    if cfg.engine.device != "cpu":
        return {"ray_actor_options": {"num_cpus": cfg.replica_cpus, "num_gpus": cfg.tp_size}}
    if cfg.tp_size == 1:
        return {"ray_actor_options": {"num_cpus": cfg.replica_cpus}}
    return {"ray_actor_options": {"num_cpus": cfg.replica_cpus},
            "placement_group_bundles": [{"CPU": cfg.replica_cpus}] * cfg.tp_size,
            "placement_group_strategy": "STRICT_PACK"}


__all__ = ["build_app", "ServeArgs", "CONTROLLER_NAME"]
