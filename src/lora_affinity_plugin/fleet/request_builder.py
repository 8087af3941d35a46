"""What the rules need to know about one request (`decision.RouteRequest`), built before the decision.

The prompt's keys come from its text (`prefixes.prompt_prefix`) and, where the pods' engines report their caches,
its tokens (`kv/tokenization.py`); the fleet's view only answers who holds those keys, what the pods serve and what
is still being computed where. Nothing here is kept between requests but the tokenizer's own caches.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

from ..config.settings import Settings
from ..kv.prefixes import (
    instructions_blocks,
    is_later_turn,
    placement_key,
    prompt_prefix,
    request_salt,
)
from ..kv.token_blocks import chain_seed
from ..kv.tokenization import tokenizer_for
from ..routing.decision import NO_SOURCES, RouteRequest
from .view import FleetView


class RequestBuilder:
    """Builds a `RouteRequest` from a LiteLLM request and a `FleetView`. A subclass may read prompts' tokens
    another way (`tokenizer`) or match them against other caches (`exact_matches`): the benchmark's references do."""

    def build(self, fleet: FleetView, adapter: str | None, scope: str, messages: Any, request_kwargs: Any,
              pods: Iterable[str], settings: Settings, sheddable: bool = False, model: str | None = None,
              now: float | None = None) -> RouteRequest:
        """The request's adapter, class and prompt prefix, and who holds it. A pod whose engine publishes KV events
        is matched by what it holds (`exact_matches`), the others by the inferred index. `now` (this process's
        clock): the prompts still being computed where they were sent count too."""
        hashes = prompt_prefix(messages, scope, request_kwargs, settings)
        gateways = 1 + fleet.peer_processes
        home = fleet.adapters.dealt_pod(adapter, pods) if gateways > 1 and adapter is not None else None
        served = fleet.adapters.served
        dealt = served if home is not None else 0
        if not hashes:
            return RouteRequest(adapter, sheddable, placement_key=placement_key(scope, ()), gateways=gateways,
                                home=home, dealt_adapters=dealt, served_adapters=served)
        matches = fleet.prefixes.matches(hashes, pods)
        sources = NO_SOURCES
        if settings.kv_events:  # (read once: the request path of a fleet without events pays nothing more)
            matches, sources = self._with_exact(fleet, matches, len(hashes), model or scope, adapter, messages,
                                                request_kwargs, pods, settings)
        return RouteRequest(
            adapter, sheddable, prefix_blocks=len(hashes), placement_key=placement_key(scope, hashes),
            prefix_matches=matches, match_sources=sources, prefix_hashes=hashes,
            prefix_sizes=fleet.prefixes.size_view(), gateways=gateways, home=home, dealt_adapters=dealt,
            served_adapters=served, instructions_blocks=instructions_blocks(messages, settings.prefix_block_chars),
            later_turn=is_later_turn(messages),
            prefilling=fleet.prefilling(now) if now is not None else {},
            chars_per_token=fleet.prompt_tokens.for_pods(pods) if settings.learn_chars_per_token else None)

    def _with_exact(self, fleet: FleetView, matches: Mapping[str, int], blocks: int, model: str, adapter: str | None,
                    messages: Any, request_kwargs: Any, pods: Iterable[str], settings: Settings
                    ) -> tuple[Mapping[str, int], Mapping[str, str]]:
        """`matches` with the reporting pods' exact figures in the prefix blocks' unit, and which pods those are
        (`partial`: a pod whose exact figure is a floor, raised to the inferred one where that is more).
        The share of the prompt's tokens a pod holds becomes that share of its `blocks`: the tokenizer's own count,
        not the `prefix_chars_per_token` estimate, which is off for code or other languages."""
        exact = self.exact_matches(fleet, model, adapter, messages, request_kwargs, pods, settings)
        if not exact:
            return matches, NO_SOURCES
        inferred, matches, sources = matches, dict(matches), {}
        for pod, share in exact.items():
            held = min(blocks, int(blocks * share))
            sources[pod] = "exact"
            if fleet.held.partial(pod):
                # Its events were joined late or lost past the replay buffer: what it holds from before is
                # unseen, so what these proxies sent there still counts, where it is more.
                sources[pod] = "partial"
                held = max(held, inferred.get(pod, 0))
            if held:
                matches[pod] = held
            else:
                matches.pop(pod, None)
        return matches, sources

    def exact_matches(self, fleet: FleetView, model: str, adapter: str | None, messages: Any, request_kwargs: Any,
                      pods: Iterable[str], settings: Settings) -> dict[str, float]:
        """Per pod whose engine reports its cache, the share of the prompt's full blocks of tokens it holds from
        the start (empty: none does, no tokenizer is set for the group, or callers are isolated from each other's
        prompts)."""
        if not settings.kv_events or settings.prefix_isolation != "shared":
            return {}
        held = fleet.held
        reporting = [pod for pod in pods if held.has(pod)]
        if not reporting:
            return {}
        tokenizer = self.tokenizer(model, settings)
        if tokenizer is None:
            return {}
        seed = chain_seed(adapter, request_salt(request_kwargs))
        out: dict[str, float] = {}
        chains: dict[int, list[list[int]]] = {}
        for pod in reporting:
            size = held.block_size(pod) or 16
            readings = chains.get(size)
            if readings is None:
                readings = chains[size] = tokenizer.chains(seed, messages, size, settings.prefix_max_chars)
            best = 0.0
            for keys in readings:  # (one reading but for a single user message)
                if keys:
                    share = held.match(pod, keys) / len(keys)
                    if share > best:
                        best = share
            out[pod] = best
        return out

    def tokenizer(self, model: str, settings: Settings) -> Any:
        """The model group's tokenizer (`tokenization.PromptTokenizer`), from the settings' files; None: none."""
        return tokenizer_for(settings.tokenizers, model)
