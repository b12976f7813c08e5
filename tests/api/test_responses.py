"""The Responses API in process over a real kda-tiny engine, through the official `openai` client: text and
function-call outputs, a chain of `previous_response_id` continuations each resuming from the whole previous
prompt and output, GET and DELETE, who may see a stored response, and refusals by name."""

from __future__ import annotations

import openai
import pytest

from app.api.hints import RouteHint
from app.api.routes import ApiSettings, build_api
from tests.api.common import KEY, Recording, client, openai_client

pytestmark = pytest.mark.anyio
SETTINGS = ApiSettings(model_name="kda-tiny", api_key=KEY, max_tokens_limit=256, max_stored_responses=8)
TOOL = {"type": "function", "name": "get_weather", "description": "Weather of a city", "strict": True,
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}},
                       "required": ["city"], "additionalProperties": False}}


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, SETTINGS)


async def test_a_chain_of_continuations_resumes_each_from_the_last(app):
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.responses.create(model="kda-tiny", input="def add(a, b):", instructions="Write code.",
                                       max_output_tokens=12, temperature=0)
        assert r.status == "incomplete" and r.output_text and r.usage.output_tokens == 12
        for turn in range(4):
            previous = r.usage.input_tokens + r.usage.output_tokens
            r = await oai.responses.create(model="kda-tiny", previous_response_id=r.id, max_output_tokens=12,
                                           temperature=0, input=[{"role": "user", "content": f"And {turn}?"}])
            assert r.usage.input_tokens_details.cached_tokens >= previous - 1
        # an agent sends its tools with every request (they are not carried over): they render alike each turn
        first = await oai.responses.create(model="kda-tiny", tools=[TOOL], input="Weather in Oslo?",
                                           max_output_tokens=4, temperature=0)
        called = await oai.responses.create(model="kda-tiny", previous_response_id=first.id, tools=[TOOL],
                                            tool_choice="required", parallel_tool_calls=False, input="Use the tool.",
                                            max_output_tokens=64, temperature=0)
        assert called.usage.input_tokens_details.cached_tokens >= \
            first.usage.input_tokens + first.usage.output_tokens - 1
        call = called.output[-1]
        assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
        answer = await oai.responses.create(model="kda-tiny", previous_response_id=called.id, tools=[TOOL],
                                            max_output_tokens=8, temperature=0,
                                            input=[{"type": "function_call_output", "call_id": call.call_id,
                                                    "output": "sunny"}])
        assert answer.usage.input_tokens_details.cached_tokens >= \
            called.usage.input_tokens + called.usage.output_tokens - 1


async def test_get_delete_and_who_may_see_a_response(app):
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.responses.create(model="kda-tiny", input="x = 1", max_output_tokens=4, temperature=0)
        assert (await oai.responses.retrieve(r.id)).output_text == r.output_text
        stranger = await http.get(f"/v1/responses/{r.id}", headers={"Authorization": "Bearer another-key"})
        assert stranger.status_code == 401  # a wrong key is refused before anything is looked up
        await oai.responses.delete(r.id)
        for call in (oai.responses.retrieve(r.id), oai.responses.delete(r.id),
                     oai.responses.create(model="kda-tiny", input="y", previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError):
                await call
        unstored = await oai.responses.create(model="kda-tiny", input="x", max_output_tokens=2, store=False)
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(unstored.id)


async def test_a_stream_sends_openais_events_in_order(app):
    async with client(app) as http:
        oai = openai_client(http)
        plain = await oai.responses.create(model="kda-tiny", input="def add(a, b):", max_output_tokens=10,
                                           temperature=0)
        stream = await oai.responses.create(model="kda-tiny", input="def add(a, b):", max_output_tokens=10,
                                            temperature=0, stream=True)
        events = [e async for e in stream]
        kinds = [e.type for e in events]
        assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                             "response.content_part.added"]
        assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                              "response.incomplete"]
        assert [e.sequence_number for e in events] == list(range(len(events)))
        text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
        assert text == plain.output_text == events[-1].response.output_text
        async with oai.responses.stream(model="kda-tiny", input="Weather?", tools=[TOOL], tool_choice="required",
                                        parallel_tool_calls=False, max_output_tokens=64, temperature=0) as s:
            kinds = [e.type async for e in s]
            final = await s.get_final_response()
        call = final.output[-1]
        assert call.type == "function_call" and call.name == "get_weather"
        assert "response.function_call_arguments.delta" in kinds and kinds[-1] == "response.completed"
        assert (await oai.responses.retrieve(final.id)).output[-1].arguments == call.arguments


async def test_a_response_is_visible_to_the_key_that_made_it_only(backend):
    app = build_api(backend, ApiSettings(model_name="kda-tiny", api_key=(KEY, "second-key")))
    async with client(app) as http:
        mine, theirs = openai_client(http), openai_client(http, api_key="second-key")
        r = await mine.responses.create(model="kda-tiny", input="x = 1", max_output_tokens=2)
        for call in (theirs.responses.retrieve(r.id), theirs.responses.delete(r.id),
                     theirs.responses.create(model="kda-tiny", input="y", previous_response_id=r.id)):
            with pytest.raises(openai.NotFoundError):  # the same 404 as for an unknown id
                await call
        assert (await mine.responses.retrieve(r.id)).id == r.id
        assert (await theirs.responses.create(model="kda-tiny", input="y", max_output_tokens=1)).id != r.id
        with pytest.raises(openai.AuthenticationError):
            await openai_client(http, api_key="third").responses.retrieve(r.id)


async def test_routing_hints_name_the_stored_prefix_and_the_prompt_cache_key(backend):
    """What the router is told (app/api/hints.py): a continuation's hint carries the stored response's prompt and
    prompt + output lengths, which its prompt starts with; prompt_cache_key reaches the backend from all three
    generation routes, hashed with the salt (one tenant's key never steers another's)."""
    recording = Recording(backend)
    app = build_api(recording, SETTINGS)
    async with client(app) as http:
        oai = openai_client(http)
        r = await oai.responses.create(model="kda-tiny", input="x = 1", max_output_tokens=3, temperature=0,
                                       extra_body={"prompt_cache_key": "k1"})
        await oai.responses.create(model="kda-tiny", input="y", previous_response_id=r.id, max_output_tokens=1)
        await oai.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}],
                                          max_tokens=1, prompt_cache_key="k2")
        await oai.completions.create(model="kda-tiny", prompt="z", max_tokens=1, extra_body={"prompt_cache_key": "k3"})
    first, continued, chat, completion = recording.hints
    assert first.key == "k1" and first.prefix == 0
    stored = r.usage.input_tokens + r.usage.output_tokens
    assert (continued.key, continued.prompt, continued.prefix) == (None, r.usage.input_tokens, stored)
    assert recording.calls[1][0][:r.usage.input_tokens] == recording.calls[0][0] and len(recording.calls[1][0]) > stored
    assert (chat.key, completion.key) == ("k2", "k3")
    assert chat.key_hash("a") != chat.key_hash("b") and chat.key_hash(None) == RouteHint("k2").key_hash(None)


async def test_the_store_keeps_the_newest(app):
    async with client(app) as http:
        oai = openai_client(http)
        made = [await oai.responses.create(model="kda-tiny", input=f"v = {i}", max_output_tokens=1)
                for i in range(SETTINGS.max_stored_responses + 2)]
        with pytest.raises(openai.NotFoundError):
            await oai.responses.retrieve(made[0].id)
        assert (await oai.responses.retrieve(made[-1].id)).id == made[-1].id


@pytest.mark.parametrize("extra, param", [
    ({"include": ["reasoning.encrypted_content"]}, "include"), ({"reasoning": {"effort": "low"}}, "reasoning"),
    ({"stream": "yes"}, "stream"), ({"truncation": "auto"}, "truncation"),
    ({"text": {"format": {"type": "json_object"}}}, "text.format.type"),
    ({"tools": [{"type": "web_search"}]}, "tools.0.type"),
    ({"input": [{"type": "web_search_call", "id": "x"}]}, "input.0.type"),
])
async def test_unsupported_fields_are_refused_by_name(app, extra, param):
    async with client(app) as http:
        r = await http.post("/v1/responses", json={"model": "kda-tiny", "input": "x", **extra},
                            headers={"Authorization": f"Bearer {KEY}"})
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.json()
