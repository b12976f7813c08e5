"""Integration: tool calls under `tool_choice: auto` through a real Ray Serve app, on kda-tiny behind Qwen3-Next's
chat format (loadtest/family_checkpoints.py: the zoo's weights, a tokenizer with Qwen's one-token `<tool_call>`).
The zoo never opens a call by itself, so `logit_bias` on the opener makes it: with a strict tool the grammar
then writes the call whole (it parses and validates); without, what the model writes after it is not a call
and comes back as content."""

from __future__ import annotations

import json

import jsonschema
import pytest
from openai import OpenAI
from ray import serve

from deployments.builder import build_app
from loadtest.family_checkpoints import write_family_checkpoint
from tests.deployments.test_serve import KEY, _kill_controller, _wait_for, _wait_ready, cluster  # noqa: F401

pytestmark = pytest.mark.slow
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}


@pytest.fixture(scope="module")
def family(cluster, tmp_path_factory):  # noqa: F811 - the imported fixture
    model = write_family_checkpoint("qwen3_next", tmp_path_factory.mktemp("qwen-format"))
    app = build_app({"model": str(model), "replicas": 1, "replica_cpus": 0.5,
                     "engine": {"compile_decode": False, "compile_prefill": False},
                     "controller": {"enabled": False}, "api": {"api_key": KEY}})
    serve.run(app, name="dasc", route_prefix="/")
    _wait_ready(cluster)
    yield cluster
    serve.delete("dasc")
    _kill_controller()


def test_auto_reads_a_call_the_model_opens(family):
    c = OpenAI(base_url=f"{family}/v1", api_key=KEY, max_retries=0, timeout=180)
    opener = str(4096)  # `<tool_call>`, the first added token
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": CITY}}
    ask = {"model": _wait_for(lambda: c.models.list().data[0].id, "the model list"), "temperature": 0,
           "max_tokens": 48, "messages": [{"role": "user", "content": "Weather in Oslo?"}], "logit_bias": {opener: 100},
           "parallel_tool_calls": False}
    strict = c.chat.completions.create(**ask, tools=[{**tool, "function": {**tool["function"], "strict": True}}])
    choice = strict.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content in (None, "")
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), CITY)
    with c.chat.completions.stream(**ask, tools=[{**tool, "function": {**tool["function"], "strict": True}}]) as s:
        streamed = s.get_final_completion().choices[0].message.tool_calls
    assert [(t.function.name, t.function.arguments) for t in streamed] == [("get_weather", call.function.arguments)]
    loose = c.chat.completions.create(**ask, tools=[tool])  # the model writes on after the opener: not a call
    assert loose.choices[0].message.tool_calls is None
    assert loose.choices[0].message.content.startswith("<tool_call>")
