"""Engine device and dtype: config validation, clear errors without a GPU, bfloat16 on the CPU, explicit
devices in every worker verb, the replica's resource reservation and the shipped configs. The GPU checks
themselves are in tests/engine/test_cuda.py.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from app.engine.worker import Worker
from app.models.loader import load_model
from deployments.builder import ServeArgs, _replica_resources
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def _prompts(tok):
    ids = tok.encode(open(__file__).read())
    return [ids[:200], ids[:260], ids[40:240]]


@pytest.mark.parametrize("field, value", [("device", "tpu"), ("device", "cuda:x"), ("dtype", "float16")])
def test_config_rejects_unknown_device_and_dtype(field, value):
    with pytest.raises(ValueError, match=field):
        EngineConfig(**{field: value})


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without CUDA")
def test_cuda_without_a_gpu_is_a_clear_error():
    model, tok = load_zoo("kda-tiny")
    with pytest.raises(RuntimeError, match="sees no CUDA device"):
        Engine(model, tok, EngineConfig(device="cuda"))
    cli = subprocess.run([sys.executable, "-m", "app.cli", "generate", "--prompt", "x", "--device", "cuda"],
                         capture_output=True, text=True, timeout=120)
    assert cli.returncode == 2 and "sees no CUDA device" in cli.stderr


@pytest.mark.parametrize("name", ["kda-tiny", "gdn-tiny"])
def test_bfloat16_engine_hits_equal_cold_and_track_fp32(name):
    model, tok = load_zoo(name)
    prompts = _prompts(tok)
    ref = Engine(model, tok, EngineConfig(enable_cache=False))
    first_fp32 = [o[0].output_ids[0] for o in ref.generate(prompts, GREEDY)]
    engine = Engine(load_model(name), tok, EngineConfig(dtype="bfloat16", interval=64))
    assert engine.model.model.embed_tokens.weight.dtype == torch.bfloat16
    decay = [p.dtype for n, p in engine.model.named_parameters() if n.endswith(("A_log", "dt_bias"))]
    assert decay and set(decay) == {torch.float32}  # kept fp32, as transformers keeps them
    cold = [o[0] for o in engine.generate(prompts, GREEDY)]
    hot = [o[0] for o in engine.generate(prompts, GREEDY)]
    assert all(o.cached_tokens > 0 for o in hot)
    assert [o.output_ids for o in hot] == [o.output_ids for o in cold]
    assert [o.output_ids[0] for o in cold] == first_fp32


def _under_meta_default(verb):
    @functools.wraps(verb)
    def run(*args, **kwargs):
        with torch.device("meta"):
            return verb(*args, **kwargs)
    return run


@pytest.mark.parametrize("name, cfg", [
    ("kda-tiny", dict(interval=32, chunk_size=48)),
    ("gdn-tiny", dict(interval=32, chunk_size=48, w_max=16, quant="int8", policy="wr")),
    ("kda-tiny", dict(w_max=16, policy="wr", layout="padded")),
])
def test_worker_verbs_create_no_tensor_on_the_default_device(name, cfg, monkeypatch):
    """The worker places every tensor it makes explicitly (on a GPU a default-device mode would cost a Python
    call per op). Here each verb runs with the default device set to `meta`: a tensor made without a device
    would land there and the step would fail or its output would differ from the plain run."""
    model, tok = load_zoo(name)
    prompts = _prompts(tok)
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True, n=2)
    plain = Engine(model, tok, EngineConfig(**cfg))
    want = [[o.output_ids for o in outs] for outs in plain.generate(prompts, params)]
    want_hits = [[o.output_ids for o in outs] for outs in plain.generate(prompts, params)]  # lossy codecs: != want
    for verb in ["_allocate", "configure_checkpoints", "set_policy", "store", "load", "zero", "store_snapshot",
                 "copy_state", "run", "refresh"]:
        monkeypatch.setattr(Worker, verb, _under_meta_default(getattr(Worker, verb)))
    engine = Engine(model, tok, EngineConfig(**cfg))
    first = [[o.output_ids for o in outs] for outs in engine.generate(prompts, params)]
    again = engine.generate(prompts, params)
    assert first == want and [[o.output_ids for o in outs] for outs in again] == want_hits
    assert all(outs[0].cached_tokens > 0 for outs in again)
    snap = engine.snapshot()
    assert snap["checkpoint_loads"] > 0 and snap["checkpoint_stores"] > 0
    assert cfg.get("policy") != "wr" or snap["wr_replay_tokens"] > 0


def test_replica_reserves_gpus_or_cpu_bundles():
    gpu = ServeArgs(tp_size=8, replica_cpus=8, engine={"device": "cuda"})
    assert _replica_resources(gpu) == {"ray_actor_options": {"num_cpus": 8, "num_gpus": 8}}
    cpu = _replica_resources(ServeArgs(tp_size=2, replica_cpus=1))
    assert cpu["placement_group_bundles"] == [{"CPU": 1}, {"CPU": 1}]
    assert "num_gpus" not in cpu["ray_actor_options"]
    assert _replica_resources(ServeArgs()) == {"ray_actor_options": {"num_cpus": 1.0}}


@pytest.mark.parametrize("path", sorted(Path("configs").glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    args = yaml.safe_load(path.read_text())["applications"][0]["args"]
    cfg = ServeArgs(**args)
    EngineConfig(**cfg.engine.model_dump())
    if path.name == "gpu-tp8.yaml":
        assert (cfg.tp_size, cfg.engine.device, cfg.placement) == (8, "cuda", "balanced")
        assert _replica_resources(cfg)["ray_actor_options"]["num_gpus"] == 8
