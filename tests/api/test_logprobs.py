"""`logprobs` through the API and the official client, against log_softmax of the model's logits at the same
positions (one forward over prompt + output from zero state): completions (an int of top alternatives) and chat
(`logprobs` + `top_logprobs`), streamed and not."""

from __future__ import annotations

import json

import pytest
import torch

from app.api.logprobs import FLOOR
from app.api.routes import ApiSettings, build_api
from tests.api.common import AUTH, KEY, client, openai_client

pytestmark = pytest.mark.anyio
TOL = 1e-4
PROMPT = "def fibonacci(n):\n    if n < 2:\n        return n\n    return"


@pytest.fixture(scope="module")
def app(backend):
    return build_api(backend, ApiSettings(model_name="kda-tiny", api_key=KEY))


def _reference(backend, prompt: list[int], output: list[int]) -> torch.Tensor:
    model = backend.engine.engine.model
    with torch.no_grad():
        logits = model.forward_train(torch.tensor([prompt + output]))[0]
    return torch.log_softmax(logits.float(), dim=-1)[len(prompt) - 1 : len(prompt) + len(output) - 1]


async def test_completion_logprobs_are_the_models(app, backend):
    tok = backend.tokenizer
    async with client(app) as http:
        oai = openai_client(http)
        out = await oai.completions.create(model="kda-tiny", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=5,
                                           logprobs=3, extra_body={"ignore_eos": True})
        lp = out.choices[0].logprobs
        ids = [tok.token_id(t) for t in lp.tokens]
        assert tok.decode(ids) == out.choices[0].text and len(ids) == out.usage.completion_tokens
        ref = _reference(backend, tok.encode(PROMPT), ids)
        for pos, (token, chosen, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs, strict=True)):
            assert abs(chosen - ref[pos, token].item()) < TOL
            assert 3 <= len(top) <= 4 and top[lp.tokens[pos]] == chosen  # the sampled token is always there
            best = ref[pos].topk(3)
            for i, v in zip(best.indices.tolist(), best.values.tolist()):
                assert abs(top[tok.token_string(i)] - v) < TOL
        assert lp.text_offset == [len(tok.decode(ids[:k])) for k in range(len(ids))]
        # streamed: the same tokens and numbers, chunk by chunk
        chunks = [c async for c in await oai.completions.create(
            model="kda-tiny", prompt=PROMPT, max_tokens=8, temperature=0.7, seed=5, logprobs=3, stream=True,
            extra_body={"ignore_eos": True})]
        streamed = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        assert [t for s in streamed for t in s.tokens] == lp.tokens
        assert max(abs(a - b) for a, b in zip([x for s in streamed for x in s.token_logprobs], lp.token_logprobs,
                                                   strict=True)) < TOL
        assert [x for s in streamed for x in s.text_offset] == lp.text_offset


async def test_chat_logprobs_and_top_logprobs(app, backend):
    """Chat's numbers equal those of a completion of the same ids (checked against the model above), streamed
    and not; each entry carries its token's text and bytes."""
    tok = backend.tokenizer
    messages = [{"role": "user", "content": "write a function"}]
    async with client(app) as http:
        oai = openai_client(http)
        ref = (await oai.completions.create(model="kda-tiny", prompt=tok.encode_chat(messages), max_tokens=6,
                                            temperature=0, logprobs=2, extra_body={"ignore_eos": True})
               ).choices[0].logprobs
        for stream in (False, True):
            kw = dict(model="kda-tiny", messages=messages, max_tokens=6, temperature=0, logprobs=True,
                      top_logprobs=2, extra_body={"ignore_eos": True})
            if stream:
                content = [e for c in [c async for c in await oai.chat.completions.create(**kw, stream=True)]
                           if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
            else:
                content = (await oai.chat.completions.create(**kw)).choices[0].logprobs.content
            assert len(content) == 6
            for e, name, chosen, top in zip(content, ref.tokens, ref.token_logprobs, ref.top_logprobs, strict=True):
                raw = tok.token_bytes(tok.token_id(name))
                assert e.bytes == list(raw) and e.token == raw.decode("utf-8", "replace")
                assert abs(e.logprob - chosen) < TOL
                best = sorted(top.values(), reverse=True)[:2]
                assert max(abs(x.logprob - b) for x, b in zip(e.top_logprobs, best, strict=True)) < TOL
                assert e.top_logprobs[0].logprob == e.logprob  # greedy: the chosen token is the best


@pytest.mark.parametrize(("path", "extra", "param"), [
    ("/v1/completions", {"logprobs": 21}, "logprobs"),
    ("/v1/completions", {"logprobs": -1}, "logprobs"),
    ("/v1/completions", {"logprobs": True}, "logprobs"),
    ("/v1/completions", {"max_tokens": 0}, "max_tokens"),
    ("/v1/chat/completions", {"top_logprobs": 2}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": True, "top_logprobs": 21}, "top_logprobs"),
    ("/v1/chat/completions", {"logprobs": 1}, "logprobs"),
])
async def test_bad_logprobs_requests_are_refused(app, path, extra, param):
    body = {"prompt": "x", "max_tokens": 1} if path == "/v1/completions" else {
        "messages": [{"role": "user", "content": "x"}], "max_tokens": 1}
    async with client(app) as http:
        r = await http.post(path, content=json.dumps({**body, **extra}),
                            headers={**AUTH, "content-type": "application/json"})
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_the_floor_stands_for_minus_infinity():
    assert json.dumps(FLOOR) == "-9999.0"


async def test_echo_reports_the_prompts_logprobs_cold_and_repeated(app, backend):
    """lm-eval's loglikelihood request (echo, logprobs 1, max_tokens 1) and max_tokens 0: the prompt's tokens
    first (the first with nulls), each the model's log-probability; a repeated request, whose prompt the cache
    holds, recomputes it (cached_tokens 0) and reports the same numbers; streamed the same."""
    tok = backend.tokenizer
    ids = tok.encode(PROMPT)
    ref = _reference(backend, ids[:1], ids[1:])
    async with client(app) as http:
        oai = openai_client(http)
        runs = [await oai.completions.create(model="kda-tiny", prompt=PROMPT, max_tokens=1, logprobs=1, echo=True,
                                             temperature=0) for _ in range(2)]
        for out in runs:
            lp = out.choices[0].logprobs
            assert out.usage.prompt_tokens_details.cached_tokens == 0
            assert lp.tokens[: len(ids)] == [tok.token_string(t) for t in ids] and len(lp.tokens) == len(ids) + 1
            assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
            for j, chosen in enumerate(lp.token_logprobs[1 : len(ids)]):
                assert abs(chosen - ref[j, ids[j + 1]].item()) < TOL
            assert out.choices[0].text.startswith(PROMPT) and lp.text_offset[0] == 0
        assert max(abs(a - b) for a, b in zip(runs[0].choices[0].logprobs.token_logprobs[1:],
                                              runs[1].choices[0].logprobs.token_logprobs[1:])) < TOL
        alone = await oai.completions.create(model="kda-tiny", prompt=ids, max_tokens=0, echo=True, logprobs=0)
        assert alone.choices[0].text == PROMPT and alone.usage.completion_tokens == 0
        assert alone.choices[0].logprobs.tokens == lp.tokens[: len(ids)]
        assert alone.choices[0].finish_reason == "length"
        chunks = [c async for c in await oai.completions.create(model="kda-tiny", prompt=PROMPT, max_tokens=1,
                                                               logprobs=1, echo=True, temperature=0, stream=True)]
        streamed = [c.choices[0] for c in chunks if c.choices]
        assert streamed[0].text == PROMPT and streamed[0].logprobs.tokens == lp.tokens[: len(ids)]
        assert [t for c in streamed if c.logprobs for t in c.logprobs.tokens] == lp.tokens
