"""`response_format` through the API on a real kda-tiny engine: OpenAI's json_object and json_schema shapes
with the official client (chat, completions, streamed), the outputs that stop parse and validate, and what is
refused: a schema the grammar cannot take (400 naming `response_format`), malformed shapes, and fields that could
end the output elsewhere than where the JSON value ends (400 naming each)."""

from __future__ import annotations

import json

import jsonschema
import openai
import pytest

from app.api.routes import ApiSettings, build_api
from tests.api.common import AUTH, KEY, client, openai_client

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=64)
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 8},
                                           "n": {"type": "integer", "minimum": 0, "maximum": 9}},
          "required": ["name", "n"], "additionalProperties": False}
JSON_SCHEMA = {"type": "json_schema", "json_schema": {"name": "person", "schema": SCHEMA, "strict": True}}
CHAT = {"model": "kda-tiny", "messages": [{"role": "user", "content": "A person as JSON."}], "max_tokens": 32}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


def _valid_if_stopped(text: str, finish_reason: str, schema: dict) -> bool:
    if finish_reason == "stop":
        jsonschema.validate(json.loads(text), schema)
        return True
    assert finish_reason == "length"
    return False


async def test_chat_json_schema_and_json_object_with_the_official_client(app):
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.chat.completions.create(**CHAT, response_format=JSON_SCHEMA, n=4, temperature=1.0, seed=1)
        stopped = [_valid_if_stopped(c.message.content, c.finish_reason, SCHEMA) for c in r.choices]
        assert any(stopped), [c.message.content for c in r.choices]
        r = await oai.chat.completions.create(**CHAT, response_format={"type": "json_object"}, temperature=0)
        c = r.choices[0]
        assert c.message.content.startswith("{")
        _valid_if_stopped(c.message.content, c.finish_reason, {"type": "object"})


async def test_streamed_completion_follows_the_schema(app):
    async with client(app) as http:
        oai = openai_client(http)
        stream = await oai.completions.create(model="kda-tiny", prompt="A person as JSON:\n", max_tokens=32,
                                              temperature=1.0, seed=3, n=2, stream=True,
                                              extra_body={"response_format": JSON_SCHEMA})
        text, reasons = {0: "", 1: ""}, {}
        async for chunk in stream:
            for c in chunk.choices:
                text[c.index] += c.text
                if c.finish_reason:
                    reasons[c.index] = c.finish_reason
        for i in (0, 1):
            assert text[i].startswith("{")
            _valid_if_stopped(text[i], reasons[i], SCHEMA)


async def _post(app, path: str, body: dict):
    async with client(app) as http:
        return await http.post(path, content=json.dumps(body).encode(),
                               headers={**AUTH, "content-type": "application/json"})


REFUSED = [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "frobnicate"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nowhere"}}}},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "json_schema"}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format.type"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "bad name!", "schema": {}}}},
     "response_format.json_schema.name"),
    ({"response_format": {"type": "json_object"}, "stop": ["}"]}, "stop"),
    ({"response_format": {"type": "json_object"}, "stop_token_ids": [5]}, "stop_token_ids"),
    ({"response_format": {"type": "json_object"}, "ignore_eos": True}, "ignore_eos"),
    ({"response_format": {"type": "json_object"}, "min_tokens": 2}, "min_tokens"),
]


@pytest.mark.parametrize(("extra", "param"), REFUSED, ids=lambda x: x if isinstance(x, str) else None)
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
async def test_refusals_name_the_field(app, path, extra, param):
    body = CHAT if path == "/v1/chat/completions" else {"model": "kda-tiny", "prompt": "x", "max_tokens": 4}
    r = await _post(app, path, {**body, **extra})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()


async def test_text_is_neutral(app):
    with_text = await _post(app, "/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 6,
                                                          "response_format": {"type": "text"}})
    plain = await _post(app, "/v1/chat/completions", {**CHAT, "temperature": 0, "max_tokens": 6})
    assert with_text.status_code == 200 and plain.status_code == 200
    assert with_text.json()["choices"][0]["message"] == plain.json()["choices"][0]["message"]


async def test_the_openai_client_surfaces_a_bad_schema_as_a_400(app):
    async with client(app) as http:
        with pytest.raises(openai.BadRequestError) as e:
            await openai_client(http).chat.completions.create(
                **CHAT, response_format={"type": "json_schema", "json_schema": {
                    "name": "x", "schema": {"type": "string", "minLength": 5, "maxLength": 2}}})
        assert e.value.body["param"] == "response_format" and "minLength" in e.value.body["message"]
