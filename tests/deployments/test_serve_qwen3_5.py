"""Integration: configs/qwen3_5-cpu.yaml under real Ray Serve on loopback, on a random Qwen3.5 checkpoint that the
fixture writes (the hub's vision-language layout, with vision-tower and MTP tensors; Qwen3.5's chat template and
added tokens over the zoo vocabulary), through the official openai client: a chat answer with its reasoning split
off, the same answer streamed, a forced tool call in Qwen3.5's XML format, and a 400 for image content. The
shipped TP8 config's head and expert counts divide over its 8 ranks on Qwen3.5-35B-A3B's published config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import jsonschema
import openai
import pytest
import torch
import yaml
from openai import OpenAI
from ray import serve

from app.models.loader import build_model
from app.models.shard import check_divisible
from app.models.tokenizer import Tokenizer
from deployments.builder import build_app
from loadtest.family_checkpoints import write_family_tokenizer
from loadtest.qwen3_5_configs import QWEN3_5_35B_A3B
from loadtest.synth_model import qwen3_5_config, write
from tests.deployments.test_serve import KEY, _kill_controller, _wait_for, _wait_ready, cluster  # noqa: F401

pytestmark = pytest.mark.slow
CONFIGS = Path(__file__).resolve().parents[2] / "configs"
SHAPE = dict(hidden=64, layers=4, heads=4, kv_heads=2, head_dim=16, linear_k_heads=2, linear_v_heads=4,
             linear_head_dim=16, intermediate=96)
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
NO_THINKING = {"chat_template_kwargs": {"enable_thinking": False}}


def write_checkpoint(out: Path) -> Path:
    """A random Qwen3.5 checkpoint whose vocabulary is the Qwen3.5 tokenizer's (the zoo's plus Qwen3.5's tokens)."""
    tok = write_family_tokenizer("qwen3_5", out / "tokenizer", jinja_file=True)
    config = qwen3_5_config(**SHAPE)
    config["text_config"]["vocab_size"] = Tokenizer.from_dir(tok).vocab_size
    model, _ = write(out / "model", config, seed=2)
    for f in tok.iterdir():
        shutil.copy(f, model / f.name)
    return model


@pytest.fixture(scope="module")
def qwen(cluster, tmp_path_factory):  # noqa: F811 - the imported fixture
    args = yaml.safe_load((CONFIGS / "qwen3_5-cpu.yaml").read_text())["applications"][0]["args"]
    model = write_checkpoint(tmp_path_factory.mktemp("qwen3.5"))
    args.update(model=str(model), replica_cpus=0.5, threads=1, api={**args["api"], "api_key": KEY})
    args["engine"].update(compile_decode=False, compile_prefill=False)  # compiled steps: tests/engine
    serve.run(build_app(args), name="dasc", route_prefix="/")
    _wait_ready(cluster)
    c = OpenAI(base_url=f"{cluster}/v1", api_key=KEY, max_retries=0, timeout=180)
    yield c, _wait_for(lambda: c.models.list().data[0].id, "the model list")
    serve.delete("dasc")
    _kill_controller()


def test_chat_and_its_stream_give_the_same_answer_with_the_reasoning_split_off(qwen):
    c, model = qwen
    ask = {"model": model, "temperature": 0, "max_tokens": 12, "messages": [{"role": "user", "content": "Hi!"}]}
    answer = c.chat.completions.create(**ask)
    choice = answer.choices[0]
    assert choice.finish_reason == "length" and answer.usage.completion_tokens == 12
    # thinking is on by default: the prompt opens <think>, and 12 random tokens do not close it
    reasoning = choice.message.model_extra["reasoning_content"]
    assert reasoning and choice.message.content is None
    parts = [d.choices[0].delta for d in c.chat.completions.create(**ask, stream=True) if d.choices]
    assert "".join(p.model_extra.get("reasoning_content") or "" for p in parts) == reasoning
    assert not any(p.content for p in parts)
    plain = c.chat.completions.create(**ask, extra_body=NO_THINKING).choices[0].message
    assert plain.content and not plain.model_extra.get("reasoning_content")


def test_a_forced_tool_call_comes_back_in_openai_form(qwen):
    c, model = qwen
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY, "strict": True}}
    answer = c.chat.completions.create(
        model=model, temperature=0, max_tokens=256, messages=[{"role": "user", "content": "Weather in Oslo?"}],
        tools=[tool], tool_choice={"type": "function", "function": {"name": "get_weather"}}, parallel_tool_calls=False,
        extra_body=NO_THINKING)
    choice = answer.choices[0]
    assert choice.finish_reason == "tool_calls" and len(choice.message.tool_calls) == 1
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)


def test_image_content_is_refused_naming_the_part(qwen):
    c, model = qwen
    image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,iVBORw0KGgo="}}
    with pytest.raises(openai.BadRequestError) as e:
        c.chat.completions.create(model=model, max_tokens=4, messages=[
            {"role": "user", "content": [{"type": "text", "text": "What is this?"}, image]}])
    assert "messages.0.content.1" in e.value.body["message"]


def test_the_tp8_config_divides_qwen3_5_35b_a3b_over_its_ranks():
    args = yaml.safe_load((CONFIGS / "qwen3_5-gpu-tp8.yaml").read_text())["applications"][0]["args"]
    assert args["model"].endswith("Qwen3.5-35B-A3B")
    with torch.device("meta"):  # the published shape, no weights
        model = build_model(QWEN3_5_35B_A3B)
    check_divisible(model, args["tp_size"])
    with pytest.raises(ValueError, match="do not divide over tp_size 3"):
        check_divisible(model, 3)
