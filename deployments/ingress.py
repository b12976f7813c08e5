"""`Ingress`: the OpenAI API (routes in `app.api`) in front of the engine replicas.

It tokenizes, validates, computes the prompt's block hashes once, and calls the engine deployment through
a DeploymentHandle with a `GenerateRequest`, so the request router sees the tokens. /metrics and /status
read the tuning controller, which holds every replica's latest telemetry."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

from ray import serve

from app.api.metrics import ApiMetrics
from app.api.routes import ApiSettings, build_api
from app.cache.digest import block_hashes
from app.engine.request import RequestOutput, SamplingParams
from app.models.loader import read_config, resolve_model_dir
from app.models.tokenizer import Tokenizer
from deployments import controller as controller_mod
from deployments.messages import GenerateRequest


class RayBackend:
    def __init__(self, handle, tokenizer: Tokenizer, max_model_len: int, digest_block: int, controller_cfg: dict):
        self.handle = handle.options(stream=True)
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len
        self.digest_block = digest_block
        self.controller_cfg = controller_cfg
        self.metrics = ApiMetrics()
        self._controller = None

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        if len(prompt_ids) + params.max_tokens > self.max_model_len:
            raise ValueError(f"prompt ({len(prompt_ids)} tokens) + max_tokens ({params.max_tokens}) exceeds the "
                             f"context length {self.max_model_len}")

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> AsyncIterator[RequestOutput]:
        req = GenerateRequest(prompt_ids, params, prompt=self.tokenizer.decode(prompt_ids),
                              hashes=block_hashes(prompt_ids, self.digest_block))
        start, first = time.perf_counter(), True
        try:
            async for out in self.handle.generate.remote(req):
                if first:
                    self.metrics.ttft.observe(time.perf_counter() - start)
                    first = False
                yield RequestOutput(**out)
            self.metrics.requests.labels(route="generate", outcome="ok").inc()
        except Exception:
            self.metrics.requests.labels(route="generate", outcome="error").inc()
            raise

    async def _state(self) -> dict:
        if self._controller is None:
            self._controller = controller_mod.get_or_create(**self.controller_cfg["actor"])
        return await self._controller.state.remote()

    async def metrics_text(self) -> str:
        state = await self._state()
        flat = {k: v for k, v in state.items() if isinstance(v, (int, float, bool))}
        return self.metrics.render(state.get("replicas", {}), flat)

    async def status(self) -> dict:
        return await self._state()


@serve.ingress()
class Ingress:
    def __init__(self, engine, model: str, api: dict, digest_block: int, controller: dict) -> None:
        model_dir = resolve_model_dir(model)
        cfg = read_config(model_dir)
        max_len = int(cfg.get("max_position_embeddings") or cfg.get("model_max_length") or 4096)
        self.backend = RayBackend(engine, Tokenizer.from_dir(model_dir), max_len, digest_block, controller)
        self.settings = ApiSettings(model_name=model, **api)

    def __serve_build_asgi_app__(self):
        return build_api(self.backend, self.settings)
