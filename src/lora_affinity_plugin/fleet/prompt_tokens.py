"""How many model tokens a block of prompt text holds, learned per pod from the token counts its engine reports.

The rules count a prompt in blocks of `prefix_block_chars` bytes of text; the cost, the KV-room terms and the
prefix index's size need tokens. `prefix_chars_per_token` (4) is right for English under most tokenizers, but a
fleet's model, language or traffic can be far from it: code and Chinese run 1-3 bytes a token. Every answer from an
OpenAI-compatible engine says how many tokens its prompt held (`usage.prompt_tokens`: a response's, or a stream's
last chunk when the client asked for it), so each pod's ratio is learned from the requests this process sent it.
Pure bookkeeping, no I/O; each proxy process learns on its own (no clock, no record shared).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable

MIN_BLOCKS = 4
"""Prompts shorter than this many blocks teach nothing: the chat template's tokens and the partial last block (not
counted in blocks) would weigh too much."""
LEARNED_AFTER_CHARS = 16_384.0
"""A pod's ratio is used once this much prompt text has been counted there (about 16 prompts of 1 KB)."""
KEEP = 0.99
"""Each observation keeps this share of the earlier ones' weight: the ratio follows a change of traffic within a few
hundred requests."""
CHARS_PER_TOKEN_RANGE = (1.0, 64.0)
"""What a ratio may be (`prefix_chars_per_token`'s own bounds, about): a count outside it (an engine's or a proxy's
bug) is ignored."""


@dataclass(slots=True)
class _Sums:
    chars: float = 0.0
    tokens: float = 0.0


class PromptTokens:
    """Per pod, the counted text over the reported prompt tokens, each observation weighted by its size (a long
    prompt says more than a short one), older ones fading by `KEEP`."""

    def __init__(self) -> None:
        self._pods: dict[str, _Sums] = {}
        self._ratios: dict[str, float] = {}
        """The learned pods' ratios, kept as they change: what a request reads (`for_pods`), one lookup a pod."""

    def observe(self, pod: str, blocks: int, prompt_tokens: object, block_chars: int, max_chars: int) -> bool:
        """A request of `blocks` prefix blocks of `block_chars` bytes held `prompt_tokens` on `pod`'s engine.
        False (nothing learned): it was too short, cut at `max_chars` (its tokens cover text the blocks do not),
        or the count is not a plausible one."""
        if blocks < MIN_BLOCKS or (blocks + 1) * block_chars > max_chars:
            return False
        if not isinstance(prompt_tokens, int) or isinstance(prompt_tokens, bool) or prompt_tokens <= 0:
            return False
        chars = (blocks + 0.5) * block_chars  # the text past the last full block is not counted: half a block
        low, high = CHARS_PER_TOKEN_RANGE
        if not low <= chars / prompt_tokens <= high:
            return False
        sums = self._pods.get(pod)
        if sums is None:
            sums = self._pods[pod] = _Sums()
        sums.chars = sums.chars * KEEP + chars
        sums.tokens = sums.tokens * KEEP + prompt_tokens
        if sums.chars >= LEARNED_AFTER_CHARS:
            self._ratios[pod] = sums.chars / sums.tokens
        return True

    def chars_per_token(self, pod: str) -> float | None:
        """`pod`'s learned ratio; None until `LEARNED_AFTER_CHARS` have been counted there."""
        return self._ratios.get(pod)

    def learned(self) -> dict[str, float]:
        """Every pod's learned ratio (the pods still learning left out)."""
        return dict(self._ratios)

    def for_pods(self, pods: Iterable[str]) -> float | None:
        """The ratio a request to one of `pods` is counted at: the mean of their learned ones (the pods of one model
        group share a tokenizer); None while none has learned one."""
        ratios = self._ratios
        if not ratios:
            return None
        learned = [ratio for ratio in map(ratios.get, pods) if ratio is not None]
        return sum(learned) / len(learned) if learned else None
