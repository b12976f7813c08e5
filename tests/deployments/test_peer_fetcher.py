"""`deployments/peer_fetch.py` without Ray: the fetcher's bookkeeping around one real engine per side, the holder's
answer handed over as Ray would (`pack`ed, its arrays read-only). A holder that dies mid-fetch or answers too late,
nothing held, an entry refused: each is counted by reason and the request goes on (recomputes); a fetch that
lands is filed and the request resumes from it; the link cost is fitted from the fetches' bytes and seconds."""

from __future__ import annotations

import asyncio

import pytest
import torch
from ray.exceptions import RayActorError

from app.engine.config import EngineConfig
from app.engine.engine import Engine
from app.engine.request import SamplingParams
from deployments.messages import GenerateRequest
from deployments.peer_fetch import LinkCosts, PeerFetcher, pack, unpack
from tests.engine.test_host_tier import _prompts
from tests.helpers import load_zoo

GREEDY = SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True)


class _Calls:
    """An AsyncEngine's `call` and `cache_call` over a plain engine."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine

    def call(self, fn):
        return fn(self.engine)

    cache_call = call


class _Response:
    def __init__(self, answer=None, error: Exception | None = None, delay_s: float = 0.0) -> None:
        self.answer, self.error, self.delay_s, self.cancelled = answer, error, delay_s, False

    def __await__(self):
        return self._wait().__await__()

    async def _wait(self):
        await asyncio.sleep(self.delay_s)
        if self.error is not None:
            raise self.error
        return self.answer

    def cancel(self) -> None:
        self.cancelled = True


class _Peers:
    """A handle whose `export_entry.remote` answers with `response` (read-only arrays, as the object store gives)."""

    def __init__(self, response: _Response) -> None:
        self.response = response
        self.export_entry = self
        self.asked = []

    def remote(self, ask):
        self.asked.append(ask)
        return self.response


@pytest.fixture(scope="module")
def holder():
    model, tok = load_zoo("kda-tiny")
    engine = Engine(model, tok, EngineConfig(compile_decode=False, compile_prefill=False, checkpoint_slots=4))
    prompt = _prompts(tok, 1)[0]
    engine.generate([prompt], GREEDY)
    return engine, prompt


def _fetcher(response: _Response, timeout_s: float = 5.0) -> tuple[PeerFetcher, Engine]:
    model, tok = load_zoo("kda-tiny")
    engine = Engine(model, tok, EngineConfig(compile_decode=False, compile_prefill=False, checkpoint_slots=4,
                                             peer_fetch=True))
    return PeerFetcher("b", _Calls(engine), lambda: _Peers(response), timeout_s=timeout_s), engine


def _request(prompt: list[int]) -> GenerateRequest:
    return GenerateRequest(prompt, GREEDY, fetch={"b": ("a", 0)})


def _read_only(wire: dict) -> dict:
    for _, _, raw in wire["tensors"].values():
        raw.flags.writeable = False
    return wire


def test_a_fetch_files_the_holders_entry_and_the_request_resumes_from_it(holder):
    engine, prompt = holder
    wire = _read_only(pack(engine.export_entry(prompt, len(prompt) - 1, None)))
    fetcher, mine = _fetcher(_Response(wire))
    assert asyncio.run(fetcher.fetch(_request(prompt), tail=0, plan=("a", 0)))
    assert fetcher.counters["fetches"] == 1 and fetcher.counters["fetched_bytes"] > 0
    out = mine.generate([prompt], GREEDY)[0][0]
    assert out.cached_tokens == len(prompt) - 1 and out.output_ids == engine.generate([prompt], GREEDY)[0][0].output_ids
    assert set(fetcher.stats()["fetch_costs"]) == {"a"}


@pytest.mark.parametrize("response, reason", [
    (_Response(error=RayActorError()), "holder"),  # the holder died mid-fetch
    (_Response(delay_s=5.0), "timeout"),
    (_Response(None), "not_held"),
    (_Response({"gone": True}), "holder"),  # the holder was gone: the router sent the call to another replica
], ids=["holder died", "timeout", "nothing held", "holder gone"])
def test_a_failed_fetch_is_counted_and_the_request_recomputes(holder, response, reason):
    _, prompt = holder
    fetcher, mine = _fetcher(response, timeout_s=0.2)
    assert not asyncio.run(fetcher.fetch(_request(prompt), tail=0, plan=("a", 0)))
    assert fetcher.counters["failed"] == {reason: 1} and fetcher.counters["fetches"] == 0
    assert response.cancelled == (reason == "timeout")
    assert mine.generate([prompt], GREEDY)[0][0].cached_tokens == 0  # computed as if cold
    mine.check_integrity()


def test_an_entry_beyond_the_object_stores_room_is_not_pulled(holder):
    engine, prompt = holder
    wire = pack(engine.export_entry(prompt, len(prompt) - 1, None))
    fetcher, _ = _fetcher(_Response(wire))
    fetcher.max_bytes = 1000
    assert not asyncio.run(fetcher.fetch(_request(prompt), tail=0, plan=("a", 5000, 0)))
    assert fetcher.counters["failed"] == {"too_large": 1}


def test_an_entry_for_another_salt_is_refused(holder):
    engine, prompt = holder
    wire = pack(engine.export_entry(prompt, len(prompt) - 1, None))
    fetcher, _ = _fetcher(_Response(wire))
    request = GenerateRequest(prompt, SamplingParams(**{**GREEDY.__dict__, "cache_salt": "tenant-b"}))
    assert not asyncio.run(fetcher.fetch(request, tail=0, plan=("a", 0)))
    assert fetcher.counters["failed"] == {"mismatched": 1}


def test_pack_round_trips_every_dtype_and_the_link_cost_fit():
    entry = {"tokens": [1], "tensors": {"a": torch.randn(3, 4).to(torch.bfloat16), "b": torch.arange(5),
                                        "c": torch.randint(-9, 9, (2, 3), dtype=torch.int8)}}
    back = unpack(_read_only(pack(entry)))
    assert all(torch.equal(back["tensors"][n], t) and back["tensors"][n].dtype == t.dtype
               for n, t in entry["tensors"].items())
    links = LinkCosts()
    for size in (1_000_000, 2_000_000, 4_000_000):
        links.add("a", size, 0.01 + 2e-9 * size)
    fixed, per_byte = links.fit("a")
    assert abs(fixed - 0.01) < 1e-9 and abs(per_byte - 2e-9) < 1e-15
    assert links.fit("nobody") is None


def test_requests_sharing_a_fetch_under_way_wait_for_it_instead_of_pulling_again(holder):
    """A burst on one prefix: the first request pulls the entry, the others join that fetch (one call to the
    holder, nothing recomputed for want of an in-flight slot), and every one of them resumes from it."""
    engine, prompt = holder
    wire = pack(engine.export_entry(prompt, len(prompt) - 1, None))
    response = _Response(wire, delay_s=0.2)
    model, tok = load_zoo("kda-tiny")
    mine = Engine(model, tok, EngineConfig(compile_decode=False, compile_prefill=False, checkpoint_slots=4,
                                           peer_fetch=True))
    peers = _Peers(response)
    fetcher = PeerFetcher("b", _Calls(mine), lambda: peers, max_inflight=1)

    async def burst():
        return await asyncio.gather(*(fetcher.fetch(_request(prompt), tail=0, plan=("a", 0)) for _ in range(4)))

    assert asyncio.run(burst()) == [True] * 4
    assert len(peers.asked) == 1 and fetcher.counters["joined"] == 3 and fetcher.counters["failed"] == {}
    outs = mine.generate([prompt] * 4, GREEDY)
    assert all(o[0].cached_tokens == len(prompt) - 1 for o in outs)


def test_a_request_without_a_plan_waits_for_a_fetch_that_brings_its_prefix(holder):
    """The router counts a fetched entry as the fetcher's from the first request on, so a later request sharing the
    prefix comes without a plan: it waits for the fetch under way (`join`) and then resumes from the entry."""
    engine, prompt = holder
    wire = pack(engine.export_entry(prompt, len(prompt) - 1, None))
    fetcher, mine = _fetcher(_Response(wire, delay_s=0.2))
    longer = GenerateRequest(prompt + [5, 6, 7], GREEDY)

    async def burst():
        first = asyncio.ensure_future(fetcher.fetch(_request(prompt), tail=0, plan=("a", 0)))
        await asyncio.sleep(0.05)
        assert fetcher.in_flight == 1
        return await asyncio.gather(first, fetcher.join(longer), fetcher.join(GenerateRequest([1, 2, 3], GREEDY)))

    assert asyncio.run(burst()) == [True, True, False]
    assert fetcher.counters["joined"] == 1
    out = mine.generate([longer.prompt_ids], GREEDY)[0][0]
    assert out.cached_tokens == len(prompt) - 1


def test_the_link_cost_leaves_out_the_holders_step_wait(holder):
    """The router prices the holder's wait (its step bookkeeping) itself; the fetcher's measured link cost must not
    count the wait the holder reports (`waited_s`) again (it did: a 0.3 s step wait showed as the link's fixed
    cost)."""
    engine, prompt = holder
    wire = pack(engine.export_entry(prompt, len(prompt) - 1, None)) | {"waited_s": 0.3}
    fetcher, _ = _fetcher(_Response(wire, delay_s=0.3))
    assert asyncio.run(fetcher.fetch(_request(prompt), tail=0, plan=("a", 0)))
    fixed, _ = fetcher.links.fit("a")
    assert fixed < 0.2
