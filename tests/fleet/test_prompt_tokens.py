"""Each pod's characters a token, learned from the prompt token counts its engine reports (`prompt_tokens.py`), and
what reads them: the request's token estimates and the size of the pod's prefix index."""

from lora_affinity_plugin.config.settings import build_settings
from lora_affinity_plugin.fleet.prompt_tokens import LEARNED_AFTER_CHARS, MIN_BLOCKS, PromptTokens
from lora_affinity_plugin.fleet.request_builder import RequestBuilder
from lora_affinity_plugin.fleet.store import PodRecord
from lora_affinity_plugin.fleet.view import FleetView
from lora_affinity_plugin.routing.decision import RouteRequest
from lora_affinity_plugin.routing.placement import tokens_per_block
from lora_affinity_plugin.routing.podstate import PodMetrics
from lora_affinity_plugin.routing.ttft import predictions
from lora_affinity_plugin.routing.scheduling import Candidate

S = build_settings({})
BLOCK, MAX = S.prefix_block_chars, S.prefix_max_chars


def record(pod: str, at: float) -> PodRecord:
    return PodRecord(pod, at, PodMetrics(num_requests_waiting=0, num_requests_running=1, num_gpu_blocks=700,
                                         block_size=16))


def messages(i: int) -> list[dict]:
    """A 2-3 KB prompt of its own (a system prompt and a question)."""
    system = f"You answer for team {i}. " + " ".join(f"rule {i}.{j}: be brief and exact." for j in range(70 + i % 30))
    return [{"role": "system", "content": system}, {"role": "user", "content": f"question {i}?"}]


def rendered_chars(msgs: list[dict]) -> int:
    return sum(len(m["role"]) + len(m["content"]) + 2 for m in msgs)


def serve(fleet: FleetView, builder: RequestBuilder, pods: tuple[str, ...], count: int, chars_per_token: float,
          start: int = 0) -> RouteRequest:
    """`count` prompts sent to the pods in turn and answered by an engine counting `chars_per_token`; the last
    request as the rules saw it."""
    request = None
    for i in range(start, start + count):
        msgs = messages(i)
        request = builder.build(fleet, None, "base", msgs, {}, pods, fleet.settings, now=100.0)
        pod = pods[i % len(pods)]
        fleet.note_dispatch(pod, None, 100.0, f"call-{i}", request.prefix_blocks)
        served = fleet.end(f"call-{i}")
        fleet.learn_prompt(served, round(rendered_chars(msgs) / chars_per_token) + 8)  # (+ the chat template's)
    return request


def test_a_pods_ratio_is_learned_from_its_engines_counts_and_read_by_the_estimates_and_the_index_size():
    fleet, builder, pods = FleetView(S), RequestBuilder(), ("a", "b")
    fleet.update({pod: record(pod, 100.0) for pod in pods})
    assert fleet.prefixes.capacity("a") == int(700 * 16 * 4.0 // BLOCK)  # the settings' 4 until one is learned
    before = serve(fleet, builder, pods, 4, chars_per_token=2.5)
    assert before.chars_per_token is None and tokens_per_block(before, S) == BLOCK / 4.0

    after = serve(fleet, builder, pods, 40, chars_per_token=2.5, start=4)
    learned = fleet.prompt_tokens.chars_per_token("a")
    assert learned is not None and abs(learned - 2.5) < 0.1  # (the template's tokens and the uncounted tail: <4%)
    assert after.chars_per_token is not None and abs(after.chars_per_token - 2.5) < 0.1
    assert abs(tokens_per_block(after, S) - BLOCK / 2.5) < 5  # a block holds more tokens than at 4
    fleet.update({pod: record(pod, 101.0) for pod in pods})
    assert fleet.prefixes.capacity("a") == int(700 * 16 * learned // BLOCK)  # the index holds fewer blocks of text

    # The engines' tokenizer, or the traffic, changes: the ratio follows within a few hundred requests.
    serve(fleet, builder, pods, 400, chars_per_token=4.5, start=44)
    assert abs(fleet.prompt_tokens.chars_per_token("b") - 4.5) < 0.25


def test_with_learning_off_the_settings_ratio_stays():
    settings = build_settings({"learn_chars_per_token": False, "prefix_chars_per_token": 3.5})
    fleet, builder = FleetView(settings), RequestBuilder()
    fleet.update({"a": record("a", 100.0)})
    request = serve(fleet, builder, ("a",), 40, chars_per_token=2.0)
    assert fleet.prompt_tokens.chars_per_token("a") is None and request.chars_per_token is None
    assert tokens_per_block(request, settings) == BLOCK / 3.5
    assert fleet.prefixes.capacity("a") == int(700 * 16 * 3.5 // BLOCK)


def test_short_cut_and_implausible_counts_teach_nothing():
    learner = PromptTokens()
    assert not learner.observe("a", MIN_BLOCKS - 1, 300, BLOCK, MAX)  # the template's tokens would weigh too much
    assert not learner.observe("a", MAX // BLOCK, 10_000, BLOCK, MAX)  # cut at prefix_max_chars: tokens past it
    for tokens in (0, -5, True, 2.5, "300", None, 10 * 10_000):  # not a count, or more tokens than bytes
        assert not learner.observe("a", 10, tokens, BLOCK, MAX)
    assert not learner.observe("a", 10, 20, BLOCK, MAX)  # 134 bytes a token: no tokenizer's
    assert learner.chars_per_token("a") is None
    while learner._pods.get("a") is None or learner._pods["a"].chars < LEARNED_AFTER_CHARS:
        assert learner.chars_per_token("a") is None  # not before enough text
        assert learner.observe("a", 10, round(10.5 * BLOCK / 3), BLOCK, MAX)
    assert abs(learner.chars_per_token("a") - 3.0) < 0.01


def test_a_request_is_counted_at_the_mean_of_its_candidates_learned_ratios():
    learner = PromptTokens()
    for _ in range(100):
        learner.observe("a", 10, round(10.5 * BLOCK / 2), BLOCK, MAX)
        learner.observe("b", 10, round(10.5 * BLOCK / 4), BLOCK, MAX)
    assert abs(learner.for_pods(["a", "b", "unlearned"]) - 3.0) < 0.01
    assert learner.for_pods(["unlearned"]) is None


def test_the_learned_ratio_moves_the_prediction_and_what_counts_as_a_document():
    settings = build_settings({"rule_set": "predicted-ttft"})
    pod = Candidate("p", 0, 2, 0.5, frozenset(), kv_free_tokens=20_000, kv_cache_tokens=40_000)
    at_four = RouteRequest(None, prefix_blocks=100)
    at_two = RouteRequest(None, prefix_blocks=100, chars_per_token=2.0)
    four, two = predictions([pod], at_four, settings)["p"], predictions([pod], at_two, settings)["p"]
    assert four.uncached_tokens == 6400 and two.uncached_tokens == 12_800
    assert two.prefill_s > 1.9 * four.prefill_s


class _Raising:
    @property
    def usage(self):
        raise RuntimeError("a response object that breaks on reading")


async def test_the_proxy_reads_counts_from_answers_and_streams_that_asked_and_no_odd_answer_fails_a_request():
    """`ProxyPlugin`'s ending hooks: a plain answer's `usage`, a stream's last chunk only where the request asked the
    engine for usage; an answer with no count, a malformed one or one that raises on reading ends the call and
    teaches nothing, and never raises into LiteLLM."""
    from types import SimpleNamespace

    from lora_affinity_plugin.host.proxy_callback import ProxyPlugin

    plugin = ProxyPlugin()
    try:
        fleet = plugin._fleet = FleetView(S)
        sums = fleet.prompt_tokens._pods

        def sent(call_id: str) -> dict:
            fleet.note_dispatch("a", None, 100.0, call_id, blocks=10)
            return {"litellm_call_id": call_id}

        for i, odd in enumerate([None, {}, {"usage": "many"}, {"usage": {"prompt_tokens": "853"}}, _Raising(),
                                 SimpleNamespace(usage=SimpleNamespace(prompt_tokens=-1))]):
            assert await plugin.async_post_call_success_deployment_hook(sent(f"odd-{i}"), odd, "acompletion") is None
            assert fleet.inflight.get(f"odd-{i}") is None and not sums  # ended, nothing learned
        await plugin.async_post_call_success_deployment_hook(
            sent("plain"), SimpleNamespace(usage=SimpleNamespace(prompt_tokens=900)), "acompletion")
        assert sums["a"].tokens == 900

        async def stream():
            yield SimpleNamespace(usage=None)
            yield SimpleNamespace(usage=SimpleNamespace(prompt_tokens=900))

        unasked = {**sent("stream-unasked"), "stream": True}
        assert len([c async for c in plugin.async_post_call_streaming_iterator_hook(None, stream(), unasked)]) == 2
        assert fleet.inflight.get("stream-unasked") is None and sums["a"].tokens == 900  # (maybe LiteLLM's own guess)
        asked = {**sent("stream-asked"), "stream": True, "stream_options": {"include_usage": True}}
        assert len([c async for c in plugin.async_post_call_streaming_iterator_hook(None, stream(), asked)]) == 2
        assert sums["a"].tokens > 1700  # 900 faded by 1%, plus 900
    finally:
        plugin._watcher and plugin._watcher.cancel()
