"""Prompt shapes for the LoRA scenarios: what adapter traffic sends, not only the seed's question.

- ``seed``: the seed's 17-token question, every request the same.
- ``unique``: each request its own text of ``chars`` characters (a document to summarise, a ticket to
  classify): no pod has seen it.
- ``instruction``: a per-adapter instruction of ``chars`` characters, then the seed's question (an
  adapter's own system prompt).
- ``mix``: the three in turn, by request index.

Texts are deterministic in (seed, request index, adapter), so every strategy sees the same prompts.
"""

from __future__ import annotations

import random

SHAPES = ("seed", "unique", "instruction", "mix")
_WORDS = ("the", "order", "shipped", "late", "customer", "refund", "invoice", "query", "table", "join",
          "select", "report", "weekly", "summary", "ticket", "priority", "account", "billing", "error",
          "timeout", "server", "region", "latency", "model", "adapter", "batch", "token", "review")


def _text(rng: random.Random, chars: int) -> str:
    words: list[str] = []
    size = 0
    while size < chars:
        word = rng.choice(_WORDS)
        words.append(word)
        size += len(word) + 1
    return " ".join(words)[:chars]


def lora_prompt(shape: str, chars: int, seed: int, index: int, adapter: str, question: str) -> str:
    """The prompt of request `index` for `adapter` under `shape`."""
    if shape == "mix":
        shape = SHAPES[index % 3]
    if shape == "seed":
        return question
    if shape == "unique":
        return _text(random.Random(f"{seed}-unique-{index}"), chars)
    if shape == "instruction":
        return _text(random.Random(f"instruction-{adapter}"), chars) + "\n\n" + question
    raise ValueError(f"prompt shape {shape!r}: choose one of {', '.join(SHAPES)}")
