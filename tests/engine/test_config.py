"""Engine knobs are defined once: the CLI's flags and the serve config's `EngineArgs` come from `KNOBS` with the
same names, defaults and allowed values; bad values are refused naming the knob; `Engine.retune` drops stored
checkpoints only when `checkpoint_settings` changes."""

from __future__ import annotations

import typing
from dataclasses import fields, replace
from pathlib import Path

import pytest
from pydantic import ValidationError

from app.cli import build_parser, engine_config
from app.engine.config import KNOBS, CheckpointSettings, EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from deployments.builder import EngineArgs, ServeArgs
from tests.helpers import load_zoo


def _parse(*flags: str):
    return build_parser().parse_args(["generate", *flags])


def _bad_values(k) -> list:
    """Values the knob's own definition refuses: outside its Literal, below its bound, off its pattern."""
    out = []
    if k.choices is not None or k.pattern is not None:
        out.append("bogus")
    if k.ge is not None:
        out.append(k.ge - 1)
    return out


BAD_CASES = [(k.name, v) for k in KNOBS.values() for v in _bad_values(k)]


def test_knobs_are_the_config_fields():
    assert list(KNOBS) == [f.name for f in fields(EngineConfig)]
    assert all(k.doc and "\n" not in k.doc for k in KNOBS.values())
    assert {f.name for f in fields(CheckpointSettings)} <= set(KNOBS)
    assert BAD_CASES, "some knobs have Literals, bounds or patterns"


def test_cli_defaults_are_the_config_defaults():
    assert engine_config(_parse()) == EngineConfig()


@pytest.mark.parametrize("name", list(KNOBS))
def test_every_knob_is_a_cli_flag_with_its_choices(name):
    k = KNOBS[name]
    if k.base is bool:
        assert getattr(_parse(k.cli_flag), name) is (not k.default)
        return
    values = k.choices or [k.base(1) if k.default is None else k.default]
    for value in values:
        assert getattr(_parse(k.cli_flag, str(value)), name) == value
    if k.choices is not None:
        with pytest.raises(SystemExit):
            _parse(k.cli_flag, "bogus")


def test_todays_cli_flags_keep_their_meaning():
    args = _parse("--interval", "32", "--admission", "second_hit", "--eviction", "flop_aware",
                  "--checkpoint-budget-mb", "8", "--no-cache", "--w-max", "16", "--policy", "wr", "--quant", "int8",
                  "--layout", "padded", "--selector", "random:3", "--device", "cpu", "--dtype", "bfloat16",
                  "--decode-graphs", "--compile-decode", "--max-tokens", "5")
    assert engine_config(args) == EngineConfig(
        interval=32, admission="second_hit", eviction="flop_aware", checkpoint_budget_mb=8.0, enable_cache=False,
        w_max=16.0, policy="wr", quant="int8", layout="padded", selector="random:3", device="cpu", dtype="bfloat16",
        decode_graphs=True, compile_decode=True)
    assert args.max_tokens == 5


@pytest.mark.parametrize("name", list(KNOBS))
def test_engine_args_field_is_the_knob(name):
    k, f = KNOBS[name], EngineArgs.model_fields[name]
    assert f.default == k.default and f.description == k.doc
    assert f.annotation == k.type
    if k.choices is not None:
        assert typing.get_args(f.annotation) == k.choices
        for value in k.choices:
            assert getattr(ServeArgs(engine={name: value}).engine, name) == value


def test_engine_args_are_exactly_the_knobs():
    assert list(EngineArgs.model_fields) == list(KNOBS)
    assert EngineConfig(**EngineArgs().model_dump()) == EngineConfig()
    with pytest.raises(ValidationError) as err:
        ServeArgs(engine={"no_such_knob": 1})
    assert err.value.errors()[0]["loc"] == ("engine", "no_such_knob")


@pytest.mark.parametrize("name, value", BAD_CASES)
def test_bad_values_are_refused_naming_the_knob(name, value):
    with pytest.raises(ValueError, match=name):
        EngineConfig(**{name: value})
    with pytest.raises(ValidationError) as err:
        ServeArgs(engine={name: value})
    assert [e["loc"] for e in err.value.errors()] == [("engine", name)]


def test_checks_that_join_knobs_run_at_the_boundary():
    with pytest.raises(ValueError, match="checkpoint_budget_mb"):
        EngineConfig(checkpoint_budget_mb=None)
    with pytest.raises(ValidationError, match="checkpoint_budget_mb"):
        ServeArgs(engine={"checkpoint_budget_mb": None})
    assert ServeArgs(engine={"checkpoint_budget_mb": None, "checkpoint_slots": 4}).engine.checkpoint_slots == 4
    with pytest.raises(ValueError, match="max_running"):
        EngineConfig(max_running=None)


def test_checkpoint_settings_group_what_a_checkpoint_holds():
    base = EngineConfig(w_max=16)
    assert base.checkpoint_settings == EngineConfig(w_max=16.0, policy="wr", interval=64).checkpoint_settings
    for change in ({"w_max": 32}, {"quant": "int8"}, {"layout": "padded"}, {"selector": "random:1"},
                   {"checkpoint_slots": 4}, {"checkpoint_budget_mb": 1.0}):
        assert replace(base, **change).checkpoint_settings != base.checkpoint_settings


@pytest.fixture(scope="module")
def zoo():
    return load_zoo("kda-tiny")


def _stored(engine: Engine) -> int:
    return sum(node.checkpoint is not None for node in engine.cache.tree.nodes())


PARAMS = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)


def test_retune_policy_keeps_checkpoints(zoo):
    model, tok = zoo
    prompt = tok.encode(open(__file__).read())[:160]
    engine = Engine(model, tok, EngineConfig(w_max=16, checkpoint_slots=8))
    engine.generate([prompt], PARAMS)
    stored = _stored(engine)
    assert stored > 0
    engine.retune(policy="wr", interval=32)
    assert _stored(engine) == stored and engine.snapshot()["dasc"]["policy"] == "wr"
    assert engine.generate([prompt], PARAMS)[0][0].cached_tokens > 0
    assert engine.snapshot()["wr_replay_tokens"] > 0


@pytest.mark.parametrize("change", [{"w_max": 32}, {"quant": "int8"}, {"layout": "padded"}, {"w_max": None}])
def test_retune_of_what_a_checkpoint_holds_drops_them(zoo, change):
    model, tok = zoo
    prompt = tok.encode(open(__file__).read())[:160]
    cfg = EngineConfig(w_max=16, checkpoint_slots=8)
    engine = Engine(model, tok, cfg)
    engine.generate([prompt], PARAMS)
    assert _stored(engine) > 0
    engine.retune(**change)
    assert _stored(engine) == 0 and engine.cfg == replace(cfg, **change)
    engine.generate([prompt], PARAMS)
    assert _stored(engine) > 0
    engine.check_integrity()


def test_the_design_docs_knob_table_matches_the_knobs():
    """docs/design.md lists every knob once, with the default the code has."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "design.md").read_text()
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 4 and cells[0].startswith("`") and cells[0].strip("`") in KNOBS:
            rows[cells[0].strip("`")] = cells[2].strip("`")
    assert set(rows) == set(KNOBS)
    assert {name: str(k.default) for name, k in KNOBS.items()} == rows


def test_the_shipped_concurrency_limits_reach_serve():
    """Serve's defaults (5 ongoing requests per replica; the proxy holding 128 requests for the ingress) made 5
    open streams block every client, and dropped 44 of a 256-request burst as plain-text 503s before the API
    could answer 429. The shipped config's limits must be the deployments' options, the ingress admitting more
    than the engine side takes, so that overload is answered by the API."""
    import yaml

    from deployments.builder import build_app

    config = Path(__file__).resolve().parents[2] / "configs" / "config.yaml"
    args = yaml.safe_load(config.read_text())["applications"][0]["args"]
    ingress = build_app(args)._bound_deployment
    engine = ingress.init_args[0]._bound_deployment
    options = {d.name: d._deployment_config for d in (ingress, engine)}
    assert options["Ingress"].max_ongoing_requests == args["ingress"]["max_ongoing_requests"] >= 256
    assert options["Ingress"].max_queued_requests == args["ingress"]["max_queued_requests"] >= 1024
    assert options["EngineReplica"].max_ongoing_requests == args["max_ongoing_requests"] >= 32
    engine_side = args["replicas"] * args["max_ongoing_requests"] + args["max_queued_requests"]
    assert options["Ingress"].max_ongoing_requests > engine_side


def test_the_speculative_block_sets_the_spec_knobs():
    """`engine.speculative: {method, num_tokens, ...}` spreads onto the spec_* knobs (YAML's bare `off` is False);
    unknown keys, a non-mapping and the same knob set both ways are refused naming `speculative`; the CLI's
    `--spec ngram --spec-tokens 4` give the same config."""
    block = {"method": "ngram", "num_tokens": 6, "rollback": "snapshot", "ngram_max": 5, "ngram_min": 3,
             "draft_cost": 0.2, "max_batch": 2}
    engine = ServeArgs(engine={"speculative": block}).engine
    assert (engine.spec, engine.spec_tokens, engine.spec_rollback, engine.spec_ngram_max, engine.spec_ngram_min,
            engine.spec_draft_cost, engine.spec_max_batch) == ("ngram", 6, "snapshot", 5, 3, 0.2, 2)
    assert ServeArgs(engine={"speculative": {"method": False}}).engine.spec == "off"
    for bad in ({"method": "ngram", "depth": 3}, ["ngram"], {"method": "draft_model"}):
        with pytest.raises(ValidationError, match="spec"):
            ServeArgs(engine={"speculative": bad})
    with pytest.raises(ValidationError, match="same knob"):
        ServeArgs(engine={"speculative": {"num_tokens": 3}, "spec_tokens": 3})
    with pytest.raises(ValidationError, match="spec_tokens"):
        ServeArgs(engine={"speculative": {"num_tokens": 17}})
    assert engine_config(_parse("--spec", "ngram", "--spec-tokens", "4")) == EngineConfig(spec="ngram", spec_tokens=4)
