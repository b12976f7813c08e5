"""Groundwork of the Responses API (issue 37): the bounded, per-key store of responses and the conversion of
Responses input items to the chat messages the templates render."""

from __future__ import annotations

import re

import pytest

from app.api.response_items import ItemError, to_messages
from app.api.response_store import ResponseStore, StoredResponse, key_digest


def _response(store: ResponseStore, key: str | None = "k", ids: int = 10) -> StoredResponse:
    return StoredResponse(store.new_id(), key_digest(key), list(range(ids)), [1, 2], [{"role": "user"}], {})


def test_ids_are_unguessable_and_a_response_is_visible_to_its_key_only():
    store = ResponseStore()
    ids = {store.new_id() for _ in range(100)}
    assert len(ids) == 100 and all(re.fullmatch(r"resp_[0-9a-f]{32}", i) for i in ids)
    mine, k, other, nobody = _response(store, "k"), key_digest("k"), key_digest("other"), key_digest(None)
    store.put(mine)
    assert store.get(mine.id, k) is mine
    assert store.get(mine.id, other) is None and store.get(mine.id, nobody) is None
    assert not store.delete(mine.id, other) and store.get(mine.id, k) is mine
    assert store.delete(mine.id, k) and store.get(mine.id, k) is None and not store.delete(mine.id, k)
    open_ = _response(store, None)  # no key configured: the id is the capability
    store.put(open_)
    assert store.get(open_.id, nobody) is open_ and store.get("resp_" + "0" * 32, nobody) is None


def test_the_bounds_evict_the_oldest():
    now = [0.0]
    store = ResponseStore(max_count=3, max_bytes=10_000, max_age_s=100.0, clock=lambda: now[0])
    made = []
    for _ in range(5):
        made.append(_response(store))
        store.put(made[-1])
        now[0] += 10
    assert [r.id for r in made if store.get(r.id, key_digest("k"))] == [r.id for r in made[2:]]  # count
    big = _response(store, ids=1500)  # 6000+ bytes of ids: the bytes bound leaves room for it alone
    store.put(big)
    assert store.get(big.id, key_digest("k")) is big and len(store) < 4
    now[0] += 101  # age
    assert store.get(big.id, key_digest("k")) is None and len(store) == 0
    assert not store.put(_response(store, ids=5000))  # larger than the whole bound: not kept


def test_items_become_the_chat_messages_a_chat_completion_would_send():
    items = [{"role": "user", "content": "Weather in Oslo?"},
             {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
             {"type": "function_call", "call_id": "call_2", "name": "add", "arguments": "{}"},
             {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
             {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Sunny."}]}]
    assert to_messages(items, "Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "add", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
        {"role": "assistant", "content": "Sunny."}]
    assert to_messages("hi") == [{"role": "user", "content": "hi"}]


@pytest.mark.parametrize("input_, path", [
    ([], "input"), (5, "input"), ([3], "input.0"), ([{"role": "wizard", "content": "x"}], "input.0.role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}], "input.0.content.0"),
    ([{"type": "function_call", "name": "f", "arguments": "{}"}], "input.0.call_id"),
    ([{"type": "web_search_call", "id": "x"}], "input.0.type"),
])
def test_items_the_server_cannot_render_are_refused_by_path(input_, path):
    with pytest.raises(ItemError) as e:
        to_messages(input_)
    assert e.value.path == path
