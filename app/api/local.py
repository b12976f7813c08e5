"""A `Backend` over one in-process engine: `python -m app.api.local --model kda-tiny --port 8000` serves the
OpenAI API without Ray (handy for development; the product runs through `deployments/`).

Its engine runs with compiled decode steps and compiled prefill passes (`compile_decode`, `compile_prefill`, as
configs/config.yaml ships them). It serves at once: the first start on a machine builds their packages in the
background (minutes on two cores, at idle priority) and swaps each in as it lands, serving eagerly meanwhile; later
starts load them from the compile cache (seconds). On SIGINT or SIGTERM it stops gracefully: with a disk tier
(`disk_dir`), what the pools and the host tier hold is written to it for the next start."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable

from app.api.metrics import LOCAL, ApiMetrics
from app.api.routes import ApiSettings, build_api
from app.engine.async_engine import AsyncEngine
from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import RequestOutput, SamplingParams
from app.models.loader import load_model, resolve_model_dir
from app.models.tokenizer import Tokenizer

# where this server's engine differs from EngineConfig's defaults (which tests and embedders get): as shipped in
# configs/config.yaml, plus lookback checkpoints (a new few-shot header's first query resumes inside the header),
# which the Ray service leaves off until its controller tunes them
SERVER_DEFAULTS = {"compile_decode": True, "compile_prefill": True, "lookback": 64}


class LocalBackend:
    def __init__(self, engine: Engine | Callable[[], Engine], health_timeout_s: float = 10.0,
                 model_name: str = LOCAL) -> None:
        """An engine, or a factory: then the engine is built in its step thread (see AsyncEngine).
        `health_timeout_s`: how long `health` waits for the step thread to come round its loop. `model_name`:
        the served model name, as the metrics label it."""
        self.engine = AsyncEngine(engine)
        self.health_timeout_s = health_timeout_s
        self.tokenizer = self.engine.engine.tokenizer
        self.max_model_len = self.engine.engine.max_model_len
        self.metrics = ApiMetrics(model_name)

    def validate(self, prompt_ids: list[int], params: SamplingParams) -> None:
        self.engine.engine.validate(prompt_ids, params)

    async def generate(self, prompt_ids: list[int], params: SamplingParams, *, deadline: float | None = None,
                       stream: bool = True, hint=None) -> AsyncIterator[RequestOutput]:
        """One engine: `hint` (app/api/hints.py) has nothing to choose between."""
        meter = self.metrics.meter(params.n, stream)
        async for out in self.engine.generate(prompt_ids, params, deadline=deadline, stream=stream):
            meter.observe(out)
            yield out

    async def health(self) -> None:
        """Raises EngineUnavailable unless the step thread comes round its loop (waits in a worker thread, so
        the event loop serves on meanwhile)."""
        await asyncio.to_thread(self.engine.check_alive, self.health_timeout_s)

    async def metrics_text(self) -> str:
        return self.metrics.render({LOCAL: self.engine.snapshot()})

    async def status(self) -> dict:
        return {"replicas": {LOCAL: self.engine.snapshot()}}

    async def close(self) -> None:
        """The server stops (SIGINT, SIGTERM): the engine's graceful stop, which persists the pools and the host
        tier to the disk tier, if there is one (`AsyncEngine.stop`)."""
        await self.engine.stop()


def _log_to_stderr() -> None:
    """This server's own log lines (warnings, errors with their request ids, the background compile's progress) on
    stderr beside uvicorn's."""
    handler = logging.StreamHandler()
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    app_log = logging.getLogger("app")
    app_log.setLevel(logging.WARNING)
    app_log.handlers, app_log.propagate = [handler], False
    logging.getLogger("app.engine.compile").setLevel(logging.INFO)


def main(argv=None) -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="kda-tiny")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None)
    p.add_argument("--served-model-name", default=None, help="the model name clients send (default: --model)")
    p.add_argument("--cors-origin", action="append", default=[], help="allow browser calls from this origin")
    p.add_argument("--engine", type=json.loads, default={}, metavar="JSON",
                   help='engine knobs as a JSON object, as under `engine:` in configs/config.yaml, e.g. '
                        '\'{"w_max": 16, "policy": "wr"}\' (app/engine/config.py), over this server\'s defaults '
                        f'{json.dumps(SERVER_DEFAULTS)}')
    args = p.parse_args(argv)
    _log_to_stderr()
    model_dir = resolve_model_dir(args.model)
    served = args.served_model_name or args.model
    try:
        config = EngineConfig(**{**SERVER_DEFAULTS, **args.engine})
    except (TypeError, ValueError) as e:  # an unknown knob, a bad value
        p.error(f"--engine: {e}")
    backend = LocalBackend(lambda: Engine(load_model(model_dir), Tokenizer.from_dir(model_dir), config),
                           model_name=served)
    app = build_api(backend, ApiSettings(model_name=served, api_key=args.api_key,
                                               cors_origins=tuple(args.cors_origin)))
    uvicorn.run(app, host="127.0.0.1", port=args.port)


if __name__ == "__main__":
    main()
