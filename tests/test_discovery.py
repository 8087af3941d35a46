"""discovery.py: which listings get the fleet's models, and the ASGI wrapper around LiteLLM's route."""

from __future__ import annotations

import json

from lora_affinity_plugin.discovery import (
    decode_served,
    listing_with_served,
    merge_listing,
    model_ids,
)


def listing(*ids: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}).encode()


def test_an_unrestricted_listing_gets_the_missing_served_names_once():
    merged = json.loads(merge_listing(listing("gpt-4"), {"sql-lora", "gpt-4", "base"}, ["gpt-4"]))
    assert [m["id"] for m in merged["data"]] == ["gpt-4", "base", "sql-lora"]


def test_a_key_limited_to_some_models_gets_litellms_answer_unchanged():
    assert merge_listing(listing("gpt-4"), {"sql-lora"}, ["gpt-4", "claude"]) is None


def test_other_shapes_and_nothing_new_are_left_alone():
    assert merge_listing(b'{"models": []}', {"a"}, []) is None
    assert merge_listing(b"not json", {"a"}, []) is None
    assert merge_listing(listing("a"), {"a"}, []) is None


def test_pod_answers_and_redis_values_are_read_defensively():
    assert model_ids('{"object": "list", "data": [{"id": "a"}, {"x": 1}, "junk"]}') == ["a"]
    assert decode_served(b'["a", 3, "b"]') == {"a", "b"}
    assert decode_served(b"{bad") == frozenset() and decode_served(None) == frozenset()


async def test_the_wrapper_rewrites_the_body_and_its_length():
    async def host(scope, receive, send):
        body = listing()
        await send({"type": "http.response.start", "status": 200,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]})
        await send({"type": "http.response.body", "body": body})

    sent = []

    async def send(message):
        sent.append(message)

    app = listing_with_served(host, lambda: {"sql-lora"}, lambda: [])
    await app({"type": "http", "method": "GET", "path": "/v1/models"}, None, send)
    body = sent[1]["body"]
    assert [m["id"] for m in json.loads(body)["data"]] == ["sql-lora"]
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(body)).encode()


async def test_other_paths_pass_through_untouched():
    calls = []

    async def host(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": listing()})

    sent = []

    async def send(message):
        sent.append(message)

    await listing_with_served(host, lambda: {"x"}, lambda: [])({"type": "http", "method": "POST", "path": "/v1/models"},
                                                                  None, send)
    await listing_with_served(host, lambda: {"x"}, lambda: [])({"type": "http", "method": "GET", "path": "/health"},
                                                                  None, send)
    assert calls == ["/v1/models", "/health"] and all(json.loads(m["body"])["data"] == []
                                                      for m in sent if m["type"] == "http.response.body")
