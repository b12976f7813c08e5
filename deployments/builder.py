"""`build_app(args)`: validate the serve config's `args` and compose ingress -> router -> engine replicas.

Used by `serve run configs/config.yaml` (import_path: deployments.builder:build_app). Every field is
documented in the pydantic models below; configs/config.yaml shows them all.
"""

from __future__ import annotations

import os

from pydantic import BaseModel, ConfigDict, Field
from ray import serve
from ray.serve import Application
from ray.serve.config import RequestRouterConfig

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


class EngineArgs(_Strict):
    """Fields of `app.engine.config.EngineConfig` (see its docstring)."""

    max_running: int = Field(32, description="sequences running at once per replica")
    chunk_size: int = Field(512, description="prefill tokens per sequence per step")
    max_tokens_per_step: int = Field(2048, description="token budget of one engine step")
    kv_slots: int = Field(65536, description="attention KV capacity in tokens")
    checkpoint_budget_mb: float = Field(16.0, description="state checkpoint pool budget (MiB)")
    interval: int = Field(0, description="checkpoint every N tokens (0: prompt ends, branches, ends)")
    admission: str = Field("always", description="always | second_hit")
    eviction: str = Field("lru", description="lru | flop_aware")
    checkpoint_min_gap: int = Field(16, description="skip branch/generation-end checkpoints closer than this")
    w_max: float | None = Field(None, description="None: dense checkpoints; a number: dasc W_max")
    policy: str = Field("nr", description="nr | wr")
    quant: str = Field("none", description="none | int8")
    layout: str = Field("ragged", description="ragged | padded")
    device: str = Field("cpu", description="cpu | cuda (a replica takes tp_size GPUs; rank r uses GPU r)")
    dtype: str = Field("float32", description="float32 | bfloat16 weights and KV")
    decode_graphs: bool = Field(False, description="replay decode steps from CUDA graphs (tp 1, no routed experts)")
    compile_decode: bool = Field(False, description="decode steps through torch.compile, compiled at replica start "
                                                    "(tp 1, no routed experts; needs a C++ compiler on the CPU)")


class RouterArgs(_Strict):
    kind: str = Field("prefix", description="prefix (ours) | pow2 (Ray default) | prefix_affinity (Ray LLM)")
    stats_period_s: float = Field(2.0, description="how often replicas publish queue length and digest")
    block_size: int = Field(16, description="tokens per hashed block in digests")
    min_match_tokens: int = Field(32, description="shorter matches route by load")
    max_queue_gap: int = Field(4, description="affinity only within this queue-length gap")
    max_ratio: float = Field(1.4, description="bound on the request ratio between replicas under skew")


class ControllerArgs(_Strict):
    enabled: bool = Field(True, description="tune W_max / interval / nr-wr from live telemetry")
    window_s: float = Field(10.0, description="telemetry window length")
    max_w_nr: float = Field(128, description="largest W_max the controller may use with nr")
    max_w_wr: float = Field(512, description="largest W_max the controller may use with wr")
    trial_windows: int = 2
    warmup_windows: int = 1
    refill_windows: int = 3
    min_requests: int = 4
    hysteresis: float = 0.05
    cooldown_windows: int = 10


class ApiArgs(_Strict):
    api_key: str | None = Field(None, description="Bearer key; the DASC_API_KEY environment variable also sets it")
    max_prompt_tokens: int = 3072
    max_tokens_limit: int = 1024
    default_max_tokens: int = 16
    max_body_bytes: int = 1 << 20


class ServeArgs(_Strict):
    model: str = Field("kda-tiny", description="zoo name or checkpoint directory")
    replicas: int = Field(2, ge=1)
    replica_cpus: float = Field(1.0, description="CPUs reserved per replica")
    threads: int = Field(1, description="torch threads per replica")
    max_ongoing_requests: int = 64
    tp_size: int = Field(1, ge=1, description="tensor-parallel ranks per replica (1: in-process)")
    placement: str = Field("off", description="TP placement of dasc checkpoints: off | storage | balanced")
    engine: EngineArgs = EngineArgs()
    router: RouterArgs = RouterArgs()
    controller: ControllerArgs = ControllerArgs()
    api: ApiArgs = ApiArgs()


def build_app(args: dict) -> Application:
    cfg = ServeArgs(**(args or {}))
    if cfg.router.kind not in ROUTERS:
        raise ValueError(f"router.kind must be one of {sorted(ROUTERS)}, got {cfg.router.kind!r}")
    c = cfg.controller
    knobs = {"max_w_nr": c.max_w_nr, "max_w_wr": c.max_w_wr, "interval": cfg.engine.interval,
             "trial_windows": c.trial_windows, "warmup_windows": c.warmup_windows,
             "refill_windows": c.refill_windows, "min_requests": c.min_requests,
             "hysteresis": c.hysteresis,
             "cooldown_windows": c.cooldown_windows}
    initial = {"w_max": cfg.engine.w_max, "policy": cfg.engine.policy, "interval": cfg.engine.interval}
    controller = {"enabled": c.enabled, "window_s": c.window_s,
                  "actor": {"knobs": knobs, "initial": initial, "enabled": c.enabled, "window_s": c.window_s}}
    router_kwargs = {}
    if cfg.router.kind == "prefix":
        router_kwargs = {k: getattr(cfg.router, k) for k in ("block_size", "min_match_tokens", "max_queue_gap",
                                                             "max_ratio")}
    engine_dep = serve.deployment(EngineReplica).options(
        name="EngineReplica", num_replicas=cfg.replicas, max_ongoing_requests=cfg.max_ongoing_requests,
        **_replica_resources(cfg),
        request_router_config=RequestRouterConfig(
            request_router_class=ROUTERS[cfg.router.kind], request_router_kwargs=router_kwargs,
            request_routing_stats_period_s=cfg.router.stats_period_s),
    ).bind(cfg.model, cfg.engine.model_dump(), cfg.router.block_size, controller, cfg.threads, cfg.tp_size,
           cfg.placement)
    api = cfg.api.model_dump()
    api["api_key"] = api["api_key"] or os.environ.get("DASC_API_KEY") or None
    ingress = serve.deployment(Ingress).options(name="Ingress", ray_actor_options={"num_cpus": 0})
    return ingress.bind(engine_dep, cfg.model, api, cfg.router.block_size, controller)


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
