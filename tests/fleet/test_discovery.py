"""discovery.py: which listings get the fleet's models, and the ASGI wrapper around LiteLLM's route."""

from __future__ import annotations

import json

import pytest

from lora_affinity_plugin.fleet.discovery import (
    decode_served,
    listing_with_served,
    merge_listing,
    model_ids,
)


def listing(*ids: str) -> bytes:
    return json.dumps({"object": "list", "data": [{"id": i, "object": "model"} for i in ids]}).encode()


def test_a_listing_gets_the_missing_callable_names_once():
    merged = json.loads(merge_listing(listing("gpt-4"), {"sql-lora", "gpt-4", "base"}))
    assert [m["id"] for m in merged["data"]] == ["gpt-4", "base", "sql-lora"]


def test_other_shapes_and_nothing_new_are_left_alone():
    assert merge_listing(b'{"models": []}', {"a"}) is None
    assert merge_listing(b"not json", {"a"}) is None
    assert merge_listing(listing("a"), {"a"}) is None
    assert merge_listing(listing("a"), set()) is None


WILDCARD_FLEET = [{"model_name": "*", "litellm_params": {"model": "hosted_vllm/*", "api_base": "http://pod-a:8000/v1"},
                   "model_info": {"access_groups": ["fleet"]}},
                  {"model_name": "gpt-4o", "litellm_params": {"model": "openai/gpt-4o", "api_key": "x"}}]
SERVED = frozenset({"meta-llama/Llama-2-7b-hf", "sql-lora", "sql-lora-v2", "tweet-summary"})


@pytest.mark.parametrize("token,expected", [
    ({"models": []}, SERVED),  # an unrestricted key (the master key's token has no models)
    ({"models": ["sql-lora"]}, {"sql-lora"}),
    ({"models": ["sql-*"]}, {"sql-lora", "sql-lora-v2"}),
    ({"models": ["gpt-4o"]}, set()),
    ({"models": [], "team_id": "t1", "team_models": ["tweet-summary"]}, {"tweet-summary"}),
    ({"models": ["sql-lora", "tweet-summary"], "team_id": "t1", "team_models": ["sql-*"]}, {"sql-lora"}),
    ({"models": ["fleet"]}, SERVED),  # an access group on the wildcard deployment
])
async def test_a_caller_sees_only_the_names_litellm_lets_it_call(token, expected):
    import litellm
    from litellm.proxy._types import UserAPIKeyAuth

    from lora_affinity_plugin.host.compat import token_may_call

    router = litellm.Router(model_list=WILDCARD_FLEET)
    auth = UserAPIKeyAuth(api_key="sk-test", **token)
    assert {name for name in SERVED if await token_may_call(auth, name, router)} == expected


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

    async def callable_by(scope, names):
        return [n for n in names if n.startswith("sql")]

    app = listing_with_served(host, lambda: {"sql-lora", "tweet-summary"}, callable_by)
    await app({"type": "http", "method": "GET", "path": "/v1/models"}, None, send)
    body = sent[1]["body"]
    assert [m["id"] for m in json.loads(body)["data"]] == ["sql-lora"]
    assert dict(sent[0]["headers"])[b"content-length"] == str(len(body)).encode()


async def _nothing(scope, names):
    return []


async def test_other_paths_pass_through_untouched():
    calls = []

    async def host(scope, receive, send):
        calls.append(scope["path"])
        await send({"type": "http.response.start", "status": 200, "headers": []})
        await send({"type": "http.response.body", "body": listing()})

    sent = []

    async def send(message):
        sent.append(message)

    await listing_with_served(host, lambda: {"x"}, _nothing)({"type": "http", "method": "POST", "path": "/v1/models"},
                                                                  None, send)
    await listing_with_served(host, lambda: {"x"}, _nothing)({"type": "http", "method": "GET", "path": "/health"},
                                                                  None, send)
    assert calls == ["/v1/models", "/health"] and all(json.loads(m["body"])["data"] == []
                                                      for m in sent if m["type"] == "http.response.body")
