"""Integration: the built app on a real local Ray Serve (loopback), real HTTP, the official openai client.

Two replicas of kda-tiny behind the prefix-aware router. Checks the OpenAI API through the ingress and the
replicas' streams (completion, chat, streaming, cached_tokens on the prefix's replica), /metrics and /status
from the replicas' telemetry, prefix affinity after the stats refresh and the request ratio under skew; then a
second deployment whose working set exceeds dense capacity, where the tuning controller must move off dense
within a bounded number of windows; then one that stores only dasc checkpoints, and one with speculative
decoding. The routes alone (errors, echo, n > 1, include_usage) are tested in-process in tests/api.

Waits poll an observable condition until a deadline, never sleep a fixed time; the deadlines are generous,
so that a loaded machine only makes the tests slower.
"""

from __future__ import annotations

import json
import os
import random
import socket
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import httpx
import jsonschema
import openai
import pytest
import ray
import torch
from openai import OpenAI
from ray import serve

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from deployments import controller as controller_mod
from deployments.builder import build_app
from tests.helpers import load_zoo, metric_samples

KEY = "test-key"
KEY_CREDIT = 16.0  # the shared server's prompt_cache_key credit (default 2)
LONG = 2000  # max_tokens of the streams held open (with ignore_eos): tens of seconds of decoding here
pytestmark = pytest.mark.slow


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _wait_for(condition, what: str, timeout: float = 300.0):
    """Poll `condition()` until it returns something truthy (returned) or `timeout` seconds passed (TimeoutError).
    HTTP errors while polling count as not yet."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if result := condition():
                return result
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"{what} within {timeout:.0f} s")


def _get(url: str) -> httpx.Response:
    return httpx.get(url, timeout=30)


def _wait_ready(url: str) -> None:
    _wait_for(lambda: _get(f"{url}/health").status_code == 200, f"{url}/health answers")


def _replicas(url: str) -> dict:
    """Each replica's latest telemetry snapshot, as the controller holds it (/status), by replica id."""
    return _get(f"{url}/status").json()["replicas"]


@pytest.fixture(scope="module")
def cluster():
    os.environ.setdefault("RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S", "120")
    ray.init(address="local", num_cpus=4, include_dashboard=False, log_to_driver=False)
    try:
        port = _free_port()
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        serve.shutdown()
        ray.shutdown()


@contextmanager
def served(url: str, args: dict, replicas: int = 2):
    """`build_app(args)` deployed as "dasc" on the cluster at `url` until the block ends (every replica reporting
    telemetry first); then deleted, with its controller."""
    serve.run(build_app(args), name="dasc", route_prefix="/")
    try:
        _wait_ready(url)
        _wait_for(lambda: len(_replicas(url)) == replicas, f"{replicas} replicas push telemetry")
        yield url
    finally:
        serve.delete("dasc")
        _kill_controller()


@pytest.fixture(scope="module")
def server(cluster):
    with served(cluster, {
        "model": "kda-tiny", "replicas": 2, "replica_cpus": 0.5,
        "engine": {"checkpoint_budget_mb": 8},
        # key_credit: see test_requests_sharing_a_prompt_cache_key_land_on_one_replica (only keyed requests feel it)
        "router": {"stats_period_s": 0.5, "key_credit": KEY_CREDIT},
        "controller": {"enabled": False, "window_s": 0.5},
        # no queue deadline within a test's reach: what these tests check must not depend on how loaded the machine
        # is (the deadline itself: tests/deployments/test_error_bodies.py)
        "api": {"api_key": KEY, "max_prompt_tokens": 2048, "max_tokens_limit": LONG, "queue_timeout_s": 900.0},
    }):
        yield cluster


def _kill_controller() -> None:
    try:
        ray.kill(controller_mod.lookup(), no_restart=True)
    except ValueError:  # not running
        pass


def _client(url: str) -> OpenAI:
    return OpenAI(base_url=f"{url}/v1", api_key=KEY, max_retries=0, timeout=180)


def _prompt(seed: int, n: int = 300) -> str:
    rng = random.Random(seed)
    return "\n".join(f"value_{seed}_{i} = {rng.randint(0, 999)}" for i in range(n // 6))


def test_completion_chat_and_streaming(server):
    c = _client(server)
    r = c.completions.create(model="kda-tiny", prompt="def add(a, b):\n    return", max_tokens=8, temperature=0)
    assert r.object == "text_completion" and r.choices[0].finish_reason in ("length", "stop")
    assert r.usage.completion_tokens >= 1 and r.usage.prompt_tokens > 0
    chat = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hello"}],
                                     max_tokens=8, temperature=0)
    assert chat.choices[0].message.role == "assistant" and chat.usage.completion_tokens >= 1
    stream = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                       temperature=0, stream=True)
    chunks = list(stream)
    assert chunks[-1].choices[0].finish_reason is not None
    text = "".join(ch.choices[0].delta.content or "" for ch in chunks)
    again = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=8,
                                      temperature=0)
    assert text == again.choices[0].message.content  # greedy: streaming and not agree
    streamed = "".join(ch.choices[0].text for ch in c.completions.create(
        model="kda-tiny", prompt="import os\n", max_tokens=6, temperature=0, stream=True))
    assert streamed == c.completions.create(model="kda-tiny", prompt="import os\n", max_tokens=6,
                                            temperature=0).choices[0].text
    assert [m.id for m in c.models.list().data] == ["kda-tiny"]


def test_unsupported_fields_unknown_models_tokenize_and_request_ids(server):
    """Through Serve: a field the API does not support is a 400 naming it, an unknown model a 404 (the official
    client's exceptions); /tokenize and /detokenize answer; Serve's proxy echoes X-Request-Id, and two responses
    to one client id still have ids of their own."""
    c = _client(server)
    with pytest.raises(openai.BadRequestError) as e:
        c.completions.create(model="kda-tiny", prompt="x", max_tokens=1, suffix="end")
    assert e.value.body["param"] == "suffix"
    with pytest.raises(openai.NotFoundError):
        c.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    auth = {"Authorization": f"Bearer {KEY}", "X-Request-Id": "trace-42"}
    ids = httpx.post(f"{server}/tokenize", json={"prompt": "def f(x):"}, headers=auth, timeout=60).json()["tokens"]
    assert httpx.post(f"{server}/detokenize", json={"tokens": ids}, headers=auth,
                      timeout=60).json() == {"prompt": "def f(x):"}
    answers = [httpx.post(f"{server}/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=auth,
                          timeout=60) for _ in range(2)]
    assert [a.headers["x-request-id"] for a in answers] == ["trace-42", "trace-42"]
    assert answers[0].json()["id"] != answers[1].json()["id"]


def test_logprobs_through_serve_are_the_models(server):
    """Logprobs cross the replica boundary intact: each generated token's, and its top alternatives, and with
    echo each prompt token's, equal log_softmax of the model's logits at that position (one forward from zero
    state, in this process)."""
    model, tok = load_zoo("kda-tiny")
    prompt = "def area(radius):\n    return"
    out = _client(server).completions.create(model="kda-tiny", prompt=prompt, max_tokens=6, temperature=0,
                                             logprobs=2, extra_body={"ignore_eos": True})
    lp = out.choices[0].logprobs
    ids, p = [tok.token_id(t) for t in lp.tokens], tok.encode(prompt)
    with torch.no_grad():
        ref = torch.log_softmax(model.forward_train(torch.tensor([p + ids]))[0].float(), -1)[len(p) - 1 : -1]
    for pos, (token, chosen, top) in enumerate(zip(ids, lp.token_logprobs, lp.top_logprobs, strict=True)):
        assert abs(chosen - ref[pos, token].item()) < 1e-4
        best = ref[pos].topk(2)
        assert all(abs(top[tok.token_string(i)] - v) < 1e-4 for i, v in zip(best.indices.tolist(),
                                                                           best.values.tolist()))
    echoed = _client(server).completions.create(model="kda-tiny", prompt=prompt, max_tokens=1, logprobs=1,
                                                echo=True, temperature=0).choices[0].logprobs  # lm-eval's request
    assert echoed.token_logprobs[0] is None and len(echoed.tokens) == len(p) + 1
    with torch.no_grad():
        rows = torch.log_softmax(model.forward_train(torch.tensor([p]))[0].float(), -1)
    for j in range(len(p) - 1):  # row j: prompt token j + 1
        assert abs(echoed.token_logprobs[j + 1] - rows[j, p[j + 1]].item()) < 1e-4


PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 10},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150},
                                           "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]},
                                                    "maxItems": 3}},
          "required": ["name", "age", "tags"], "additionalProperties": False}


def test_json_schema_outputs_that_stop_parse_and_validate(server):
    """20 json_schema chat requests at temperature 1, concurrently across both replicas: every output that
    ends with "stop" parses and validates; the bounded strings and arrays let the tiny model end most of them
    within max_tokens (an output cut there says "length")."""
    c = _client(server)
    fmt = {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}}

    def ask(seed: int):
        r = c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": f"Person {seed}?"}],
                                      max_tokens=48, temperature=1.0, seed=seed, response_format=fmt)
        return r.choices[0]

    with ThreadPoolExecutor(8) as pool:
        choices = list(pool.map(ask, range(20)))
    stopped = 0
    for choice in choices:
        assert choice.finish_reason in ("stop", "length")
        if choice.finish_reason == "stop":
            jsonschema.validate(json.loads(choice.message.content), PERSON)
            stopped += 1
    assert stopped >= 10, [ch.message.content for ch in choices]


TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
              "type": "object", "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12}},
              "required": ["city"], "additionalProperties": False}}},
         {"type": "function", "function": {"name": "add", "parameters": {
              "type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"], "additionalProperties": False}}}]


def test_tool_calls_and_agent_turns_that_resume_where_the_last_ended(server):
    """required, named, none and auto (the zoo writes no call by itself: auto answers content) through Serve;
    a streamed call assembled by the SDK's helper equals the plain answer; each turn of a three-turn agent loop
    has the previous prompt and output cached (less the last token: the cache here is dense)."""
    c = _client(server)
    ask = {"model": "kda-tiny", "tools": TOOLS, "temperature": 0, "max_tokens": 120,
           "messages": [{"role": "user", "content": "Weather in Oslo?"}]}
    forced = c.chat.completions.create(**ask, tool_choice="required", parallel_tool_calls=False)
    assert forced.choices[0].finish_reason == "tool_calls" and len(forced.choices[0].message.tool_calls) == 1
    named = c.chat.completions.create(**ask, tool_choice={"type": "function", "function": {"name": "add"}},
                                      parallel_tool_calls=False)
    call = named.choices[0].message.tool_calls[0]
    assert call.function.name == "add" and json.loads(call.function.arguments)["a"] in range(10)
    for choice in ("none", "auto"):
        r = c.chat.completions.create(**{**ask, "max_tokens": 12}, tool_choice=choice)
        assert r.choices[0].message.tool_calls is None and r.choices[0].finish_reason in ("stop", "length")
    with c.chat.completions.stream(**ask, tool_choice="required", parallel_tool_calls=False) as stream:
        streamed = stream.get_final_completion().choices[0].message.tool_calls
    assert [(t.function.name, t.function.arguments) for t in streamed] == \
        [(t.function.name, t.function.arguments) for t in forced.choices[0].message.tool_calls]
    messages, previous = list(ask["messages"]), None
    for turn in range(3):
        r = c.chat.completions.create(**{**ask, "messages": messages}, tool_choice="required",
                                      parallel_tool_calls=False, extra_body={"cache_salt": "agent"})
        if previous is not None:
            assert r.usage.prompt_tokens_details.cached_tokens >= previous - 1
        previous = r.usage.prompt_tokens + r.usage.completion_tokens
        m = r.choices[0].message
        messages += [m.model_dump(exclude_none=True), {"role": "tool", "tool_call_id": m.tool_calls[0].id,
                                                        "content": f"result {turn}"}]
    r = httpx.post(f"{server}/v1/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=60,
                   json={**ask, "tool_choice": {"type": "function", "function": {"name": "nope"}}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "tool_choice.function.name"


def test_responses_chain_stream_tools_get_and_delete(server):
    """The Responses API through Serve: a chain of five continuations by previous_response_id, each resuming
    from the whole previous prompt and output; a streamed answer's events in order; a forced function call;
    GET and DELETE, after which the id is a 404."""
    c = _client(server)
    r = c.responses.create(model="kda-tiny", input="def add(a, b):", max_output_tokens=8, temperature=0)
    for turn in range(4):
        previous = r.usage.input_tokens + r.usage.output_tokens
        r = c.responses.create(model="kda-tiny", previous_response_id=r.id, input=f"# and {turn}",
                               max_output_tokens=8, temperature=0)
        assert r.usage.input_tokens_details.cached_tokens >= previous - 1
    kinds = [e.type for e in c.responses.create(model="kda-tiny", input="x = 1", max_output_tokens=4, stream=True)]
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.incomplete"
    tool = {"type": "function", "name": "add", "parameters": TOOLS[1]["function"]["parameters"]}
    called = c.responses.create(model="kda-tiny", input="2 + 3?", tools=[tool], tool_choice="required",
                                parallel_tool_calls=False, max_output_tokens=64, temperature=0)
    assert called.output[-1].type == "function_call" and called.output[-1].name == "add"
    assert c.responses.retrieve(called.id).output[-1].arguments == called.output[-1].arguments
    c.responses.delete(called.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve(called.id)


def test_requests_sharing_a_prompt_cache_key_land_on_one_replica_while_the_load_allows(server):
    """Issue 37: 20 requests, one at a time, sharing one prompt_cache_key and no prefix (each prompt its own) are
    all served by one replica (`system_fingerprint` names it); a second key is routed by the same rule.

    What is checked is the key's way through the ingress, the router's memory and the replicas' published keys, not
    the threshold (tests/deployments/test_routing_hints.py prices that): the credit here (KEY_CREDIT prompts) is
    above anything one request at a time can queue. At the default 2 the rule held only while the two replicas'
    measured step costs stayed within about 25% of each other, and a request the router still counted as queued
    (it finished before the replica's next stats) tipped it: 2 of 6 went to the other replica on a loaded machine."""
    c = _client(server)

    def served(i: int, key: str) -> str:
        r = c.completions.create(model="kda-tiny", prompt=_prompt(4000 + i, 120), max_tokens=1, temperature=0,
                                 extra_body={"prompt_cache_key": key})
        return r.system_fingerprint

    assert len({served(i, "agent-7") for i in range(20)}) == 1
    assert len({served(100 + i, "agent-8") for i in range(6)}) == 1


def test_a_request_with_several_prompts_is_answered(server):
    """Found by schema fuzzing: a completion with two different prompts hung with two replicas. The ingress runs
    the prompts' handle calls concurrently, and Serve gave them all the HTTP request's internal id, under which
    its request router indexes the calls waiting for a replica: the second call was never assigned."""
    out = _client(server).completions.create(model="kda-tiny", prompt=["abc", "abd", "x = 1"], max_tokens=3)
    assert [c.index for c in out.choices] == [0, 1, 2] and all(c.finish_reason for c in out.choices)


def test_repeated_prefix_reports_cached_tokens(server):
    c = _client(server)
    prompt = _prompt(1)
    first = c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=2, temperature=0)
    second = c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens > 0
    assert second.system_fingerprint == first.system_fingerprint  # the router kept the prefix's replica


def _wait_telemetry_settled(url: str, quiet_s: float = 2.0) -> None:
    """Wait until every replica's pushed prompt-token total has stayed the same for `quiet_s` seconds (several
    telemetry windows): what earlier requests did has then been reported."""
    def totals() -> dict:
        return {k: v.get("prompt_tokens") for k, v in _replicas(url).items()}

    state = {"seen": totals(), "since": time.monotonic()}

    def quiet() -> bool:
        now = totals()
        if now != state["seen"]:
            state["seen"], state["since"] = now, time.monotonic()
        return time.monotonic() - state["since"] >= quiet_s

    _wait_for(quiet, "the replicas' telemetry settles", timeout=120)


def test_metrics_expose_hit_rate_slots_and_ttft(server):
    """Our own names and vLLM's under `dasc:`, the latter labelled by model and serving replica: the ingress
    counts the request's tokens and latencies as its outputs pass, the replicas' telemetry brings its prefix
    cache queries and hits (per-replica series; the differences across this request are checked)."""
    c = _client(server)
    _wait_telemetry_settled(server)  # earlier tests' tokens reach the counters before `before`, not after
    before = metric_samples(_get(f"{server}/metrics").text)
    r = c.completions.create(model="kda-tiny", prompt=_prompt(2), max_tokens=2, temperature=0, extra_body={
        "ignore_eos": True})
    labels = frozenset({"model_name": "kda-tiny", "engine": r.system_fingerprint.removeprefix("dasc-")}.items())
    names = ("dasc_engine_hit_rate", "dasc_engine_checkpoint_slots", "dasc_ttft_seconds_bucket")

    def grew(page: dict, name: str) -> float:
        return page.get((name, labels), 0.0) - before.get((name, labels), 0.0)

    def metrics_with_all_names() -> dict | None:  # the engine metrics come from the replicas' telemetry windows
        text = _get(f"{server}/metrics").text
        page = metric_samples(text)
        queried = grew(page, "dasc:prefix_cache_queries_total") >= r.usage.prompt_tokens
        return page if queried and all(name in text for name in names) else None

    page = _wait_for(metrics_with_all_names, "/metrics shows the engine gauges, histograms and prefix cache counts")
    assert grew(page, "dasc:prompt_tokens_total") == r.usage.prompt_tokens
    assert grew(page, "dasc:generation_tokens_total") == r.usage.completion_tokens == 2
    assert grew(page, "dasc:time_to_first_token_seconds_count") == 1
    assert grew(page, "dasc:e2e_request_latency_seconds_count") == 1
    assert grew(page, "dasc:inter_token_latency_seconds_count") == 1  # two tokens, one gap
    assert grew(page, "dasc:prefix_cache_queries_total") == r.usage.prompt_tokens
    assert grew(page, "dasc:prefix_cache_hits_total") == r.usage.prompt_tokens_details.cached_tokens
    running = [dict(k) for name, k in page if name == "dasc:num_requests_running"]
    assert len(running) == 2 and all(k["model_name"] == "kda-tiny" for k in running)  # one series per replica
    status = _get(f"{server}/status").json()
    assert len(status["replicas"]) == 2


def test_prefix_affinity_after_stats_refresh(server):
    c = _client(server)
    a, b = _prompt(10, 400), _prompt(11, 400)
    home = {}
    for p in (a, b):
        home[p] = c.completions.create(model="kda-tiny", prompt=p, max_tokens=1, temperature=0).system_fingerprint
    _wait_digests(server, {fp.removeprefix("dasc-") for fp in home.values()}, since=time.time())
    for i in range(6):
        p = (a, b)[i % 2]
        r = c.completions.create(model="kda-tiny", prompt=p + f"\nextra_{i} = {i}", max_tokens=1, temperature=0)
        assert r.system_fingerprint == home[p], i
        assert r.usage.prompt_tokens_details.cached_tokens > 0


def _wait_digests(url: str, replicas: set[str], since: float) -> None:
    """Wait until each of `replicas` has published telemetry taken after `since` (the controller's clock: same
    machine). Its checkpoints of the prefixes served before `since` are then in that snapshot; the replicas
    publish their routing digests on the same period (stats_period_s = window_s = 0.5 s here), and until a
    digest shows a prefix the router remembers where it sent that prefix's blocks."""
    _wait_for(lambda: all(_replicas(url).get(r, {}).get("reported_at", 0.0) > since for r in replicas),
              f"replicas {sorted(replicas)} publish telemetry")


def test_a_hot_prefix_stays_on_its_holder_until_queued_work_spills_it(server):
    """Sent one at a time (queues empty), requests sharing a prefix (about 1300 tokens) all go to the replica holding
    its checkpoint; sixteen at once, each with a long tail of its own (about 1150 tokens against a prefix of 250),
    queue more prefill at the holder than (1 + work_weight) times what its checkpoint saves, and the router sends
    some to the other replica (there is no request-ratio cap: the balance is the queue's)."""
    c = _client(server)
    # one at a time, on a prefix long enough that what its checkpoint saves outweighs how far apart the replicas'
    # measured step costs (fits of their own noisy step times) may be
    long = _prompt(19, 600)
    home = c.completions.create(model="kda-tiny", prompt=long + "\nq = 0", max_tokens=1, temperature=0)
    _wait_digests(server, {home.system_fingerprint.removeprefix("dasc-")}, since=time.time())
    for i in range(4):
        r = c.completions.create(model="kda-tiny", prompt=long + f"\nq_{i} = {i}", max_tokens=1, temperature=0)
        assert r.system_fingerprint == home.system_fingerprint, i
    hot = _prompt(20, 120)
    c.completions.create(model="kda-tiny", prompt=hot + "\nq = 0", max_tokens=1, temperature=0)

    def one(i: int) -> str:
        return c.completions.create(model="kda-tiny", prompt=hot + "\n" + _prompt(300 + i, 500), max_tokens=1,
                                    temperature=0).system_fingerprint

    with ThreadPoolExecutor(16) as pool:
        counts = Counter(pool.map(one, range(16)))
    assert len(counts) == 2 and min(counts.values()) >= 3, counts


class HeldStream:
    """A completion streamed in a thread with long max_tokens and ignore_eos: `started` once its first token
    arrived, `finished` once it ended (a finish_reason, or [DONE], which follows an error event too); `events`
    holds what came; `close()` disconnects."""

    def __init__(self, url: str, prompt: str | list[str], max_tokens: int = LONG) -> None:
        self.body = {"model": "kda-tiny", "prompt": prompt, "max_tokens": max_tokens, "ignore_eos": True,
                     "temperature": 0, "stream": True}
        self.url, self.events = url, []
        self.started, self.finished, self._stop = threading.Event(), threading.Event(), threading.Event()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            with httpx.stream("POST", f"{self.url}/v1/completions", json=self.body, timeout=300,
                              headers={"Authorization": f"Bearer {KEY}"}) as r:
                for line in r.iter_lines():
                    if self._stop.is_set():
                        return
                    if not line.startswith("data: "):
                        continue
                    event = line.removeprefix("data: ")
                    self.events.append(event)
                    chunk = {} if event == "[DONE]" else json.loads(event)
                    if event == "[DONE]" or chunk.get("choices", [{}])[0].get("finish_reason"):
                        self.finished.set()
                    elif "choices" in chunk:
                        self.started.set()
        finally:
            self.finished.set()

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=60)


def test_a_ninth_request_is_answered_while_eight_streams_are_open(server):
    """Defect 3: with Ray's default of 5 ongoing requests per ingress replica, streams 6-8 and the ninth request
    waited for one of the first five to end. All 8 must stream at once, and the ninth be answered meanwhile."""
    streams = [HeldStream(server, f"stream {i}: " + "abc " * (i + 1)) for i in range(8)]
    try:
        def all_streaming() -> bool:
            assert not any(s.finished.is_set() for s in streams), "a stream ended before all 8 were streaming"
            return all(s.started.is_set() for s in streams)

        _wait_for(all_streaming, "8 streams streaming at once")
        ninth = _client(server).completions.create(model="kda-tiny", prompt="ninth", max_tokens=2, temperature=0)
        assert ninth.usage.completion_tokens >= 1
        assert not any(s.finished.is_set() for s in streams)
    finally:
        for s in streams:
            s.close()


def test_controller_moves_off_dense_under_pressure(cluster, server):
    serve.delete("dasc")
    _kill_controller()
    app = build_app({
        "model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5,
        "engine": {"checkpoint_budget_mb": 0.6},  # 3 dense kda-tiny checkpoints
        "controller": {"enabled": True, "window_s": 1.0, "trial_windows": 1, "min_requests": 2, "max_w_nr": 64,
                       "allowed": ["dense", "nr-W16", "nr-W64"]},  # the operator allows nr here (see the allowance)
    })
    serve.run(app, name="dasc", route_prefix="/")
    _wait_ready(cluster)
    c = OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=180)
    prompts = [_prompt(200 + i, 240) for i in range(8)]  # working set: 8 prefixes > 3 dense slots
    deadline = time.monotonic() + 300
    moved, state = False, None
    while time.monotonic() < deadline and not moved:
        for p in prompts:
            c.completions.create(model="kda-tiny", prompt=p, max_tokens=1, temperature=0)
        try:  # the replica creates the controller with its first telemetry window
            state = ray.get(controller_mod.lookup().state.remote())
        except ValueError:
            continue
        moved = state["current_label"] != "dense"
    assert moved, state
    promoted = [d for d in state["decisions"] if d["decision"] == "promote"]
    assert promoted  # (how many windows that took depends on the machine's load: not asserted)
    assert promoted[0]["trial_ttft"] < promoted[0]["control_ttft"]  # promoted because TTFT improved, live


def test_a_lossless_request_never_resumes_from_a_compressed_checkpoint(cluster, server):
    """A replica that stores only dasc checkpoints (W_max 16, controller off): a repeated prompt resumes from a
    compressed checkpoint and says so; the same prompt with `cache_lossless` is recomputed from the start (it
    may use exact KV, never a lossy state) and its answer equals the cold one; chat says the same."""
    serve.delete("dasc")
    _kill_controller()
    app = build_app({"model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5,
                     "engine": {"w_max": 16, "checkpoint_min_gap": 0}, "controller": {"enabled": False}})
    serve.run(app, name="dasc", route_prefix="/")
    _wait_ready(cluster)
    c = OpenAI(base_url=f"{cluster}/v1", api_key="none", max_retries=0, timeout=180)
    prompt = _prompt(300, 240)
    cold = c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=8, temperature=0)
    lossy = c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=8, temperature=0)
    exact = [c.completions.create(model="kda-tiny", prompt=prompt, max_tokens=8, temperature=0,
                                  extra_body={"cache_lossless": True}) for _ in range(3)]
    details = lambda r: r.usage.prompt_tokens_details.model_dump()  # noqa: E731
    assert details(cold)["compressed_checkpoint"] is False
    assert details(lossy)["compressed_checkpoint"] is True and details(lossy)["cached_tokens"] > 0
    for r in exact:
        assert details(r)["compressed_checkpoint"] is False and r.choices[0].text == cold.choices[0].text
    chat = [c.chat.completions.create(model="kda-tiny", messages=[{"role": "user", "content": prompt}],
                                      max_tokens=4, temperature=0, extra_body=extra)
            for extra in ({}, {}, {"cache_lossless": True})]
    assert details(chat[1])["compressed_checkpoint"] is True
    assert details(chat[2])["compressed_checkpoint"] is False
    assert chat[2].choices[0].message.content == chat[0].choices[0].message.content


def test_speculative_decoding_answers_as_plain_decoding_and_reports_accepted_drafts(cluster):
    """A replica with `engine.speculative: {method: ngram, num_tokens: 4}`. Per seed, greedy: the seed's
    continuation, then seed + continuation + seed, which the model continues by repeating itself, so prompt lookup
    drafts it and the drafts are accepted. Every answer equals a local engine's without speculation (the same 32
    tokens' text); once the replica reported after the last request, /metrics shows its verify pieces, drafts and
    accepted drafts as its telemetry (/status) counts them, and the acceptance length histogram: one observation
    per verify piece, summing to the accepted drafts, bucket by bucket the replica's per-verify counts (found by
    it: the replicas pushed only their snapshot's flat fields, so the histogram's counts never reached /metrics)."""
    serve.delete("dasc")
    _kill_controller()
    app = build_app({"model": "kda-tiny", "replicas": 1, "replica_cpus": 0.5,
                     "engine": {"speculative": {"method": "ngram", "num_tokens": 4}},
                     "controller": {"enabled": False, "window_s": 0.5}, "api": {"api_key": KEY}})
    serve.run(app, name="dasc", route_prefix="/")
    _wait_ready(cluster)
    c = _client(cluster)
    greedy = {"model": "kda-tiny", "max_tokens": 32, "temperature": 0, "extra_body": {"ignore_eos": True}}
    answers = []
    for seed in ("def area(radius):\n", "import os\n\n\nclass Cache:\n", "for i in range(10):\n"):
        first = c.completions.create(prompt=seed, **greedy)
        again = seed + first.choices[0].text + "\n\n" + seed
        answers += [(seed, first), (again, c.completions.create(prompt=again, **greedy))]
    done = time.time()
    model, tok = load_zoo("kda-tiny")
    plain = Engine(model, tok, EngineConfig(kv_slots=8192)).generate(
        [tok.encode(p) for p, _ in answers], SamplingParams(max_tokens=32, temperature=0, ignore_eos=True))
    for (prompt, r), [out] in zip(answers, plain, strict=True):
        assert r.choices[0].text == out.text, prompt
        assert r.usage.completion_tokens == len(out.output_ids) == 32
    replica = answers[-1][1].system_fingerprint.removeprefix("dasc-")
    _wait_digests(cluster, {replica}, since=done)  # its snapshot now holds every request's verify pieces
    snap = _replicas(cluster)[replica]
    page = metric_samples(_get(f"{cluster}/metrics").text)
    labels = frozenset({"model_name": "kda-tiny", "engine": replica}.items())
    drafts = page[("dasc:spec_decode_num_drafts_total", labels)]
    draft_tokens = page[("dasc:spec_decode_num_draft_tokens_total", labels)]
    accepted = page[("dasc:spec_decode_num_accepted_tokens_total", labels)]
    assert (drafts, draft_tokens, accepted) == (snap["spec_verifies"], snap["spec_drafted_tokens"],
                                                snap["spec_accepted_tokens"])
    assert 0 < drafts <= draft_tokens <= 4 * drafts
    assert 10 < accepted <= draft_tokens
    hist = {int(a): n for a, n in snap["spec_accepted_per_verify"].items()}  # JSON keys: accepted drafts
    assert page[("dasc:spec_decode_acceptance_length_count", labels)] == drafts == sum(hist.values())
    assert page[("dasc:spec_decode_acceptance_length_sum", labels)] == accepted == sum(a * n for a, n in hist.items())
    for (name, sample), v in page.items():
        if name == "dasc:spec_decode_acceptance_length_bucket" and dict(sample)["engine"] == replica:
            assert v == sum(n for a, n in hist.items() if a <= float(dict(sample)["le"])), dict(sample)["le"]
