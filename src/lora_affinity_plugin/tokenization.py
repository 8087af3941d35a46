"""A prompt's token ids as its engine computes them, so the gateway names its blocks as the engine's KV events
do (`token_blocks.py`).

Per model group the settings name a `tokenizer.json` and the chat template the engine applies (`tokenizers`);
both are loaded once, from local files (a gateway fetches nothing). A chat is rendered by the template with
the generation prompt and tokenized without special tokens (the template writes them); a text completion's
prompt is tokenized as the server does, with them. LiteLLM hands routing a completion's prompt as one user
message, so such a request is tokenized both ways and each pod is matched by the better of the two.

A long prompt's head repeats (an app's instructions, a document, a conversation so far) while its tail is new:
the rendered chat is split after its first message, and the head's ids are kept, so only the tail is
tokenized per request. The split falls where the template starts the next message (a newline and its role
marker), a boundary a byte-level tokenizer's pre-tokenizer does not merge across; where it would, the ids
differ from the engine's at the tail only, and the match counts fewer blocks, never more.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Mapping

from .token_blocks import chain_keys

logger = logging.getLogger("lora_affinity")

CACHED_HEADS = 256
"""Prompt heads (an app's instructions, a document) whose ids and block keys are kept."""
MIN_HEAD_CHARS = 64


class PromptTokenizer:
    def __init__(self, tokenizer_path: str, chat_template_path: str | None = None) -> None:
        from tokenizers import Tokenizer  # a LiteLLM dependency: every proxy has it

        self._tokenizer = Tokenizer.from_file(tokenizer_path)
        self._template = None
        if chat_template_path:
            import jinja2  # a LiteLLM dependency too

            with open(chat_template_path, encoding="utf-8") as f:
                self._template = jinja2.Environment(autoescape=False, keep_trailing_newline=True).from_string(f.read())
        self._heads: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()
        """Recent prompt heads' ids (a request's new tail is tokenized each time, and not kept)."""
        self._head_keys: OrderedDict[tuple[int, str, int], list[int]] = OrderedDict()
        """Recent heads' block keys, per chain seed (adapter, salt) and block size."""

    def chains(self, seed: int, messages: Any, block_size: int) -> list[list[int]]:
        """The block keys (`token_blocks`) of the ids the engine may have computed for this request: the chat's,
        and when it is one user message (perhaps a text completion's prompt), the bare prompt's too."""
        return [self._keys(seed, head, tail, special, block_size) for head, tail, special in self._parts(messages)]

    def candidates(self, messages: Any) -> list[list[int]]:
        """The token ids of those same readings (`chains` without the keys)."""
        return [self._ids(head, True, special) + (self.encode(tail, special) if tail else [])
                for head, tail, special in self._parts(messages)]

    def _parts(self, messages: Any) -> list[tuple[str, str, bool]]:
        """Each reading as (head, tail, with special tokens)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            return []
        out = []
        if self._template is not None and all(isinstance(m, dict) for m in messages):
            try:
                text = self._template.render(messages=list(messages), add_generation_prompt=True)
            except Exception:  # a template that cannot render this request: no exact match for it
                text = None
            if text is not None:
                out.append((*_split(text, messages[0].get("content")), False))
        if len(messages) == 1 and isinstance(messages[0], dict) and isinstance(messages[0].get("content"), str):
            out.append((messages[0]["content"], "", True))
        return out

    def _keys(self, seed: int, head: str, tail: str, special: bool, block_size: int) -> list[int]:
        head_ids = self._ids(head, True, special)
        cached = (seed, head, block_size)
        keys = self._head_keys.get(cached)
        if keys is None:
            keys = self._head_keys[cached] = list(chain_keys(seed, head_ids, block_size))
            if len(self._head_keys) > CACHED_HEADS:
                self._head_keys.popitem(last=False)
        else:
            self._head_keys.move_to_end(cached)
        if not tail:
            return keys
        rest = head_ids[len(keys) * block_size:] + self.encode(tail, special)
        return keys + list(chain_keys(keys[-1] if keys else seed, rest, block_size))

    def _ids(self, text: str, keep: bool, special: bool) -> list[int]:
        key = (text, special)
        ids = self._heads.get(key)
        if ids is None:
            ids = self.encode(text, special)
            if keep:
                self._heads[key] = ids
                if len(self._heads) > CACHED_HEADS:
                    self._heads.popitem(last=False)
        else:
            self._heads.move_to_end(key)
        return ids

    def encode(self, text: str, special: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=special).ids


def _split(text: str, first: Any) -> tuple[str, str]:
    """The rendered chat as (head through the first message, the rest): where the template starts the next
    message (a newline, a marker), a boundary a byte-level pre-tokenizer does not merge across."""
    if isinstance(first, str) and len(first) >= MIN_HEAD_CHARS:
        at = text.find(first)
        if at >= 0:
            end = at + len(first)
            if end == len(text) or text[end] in "\n<":
                return text[:end], text[end:]
    return text, ""


@lru_cache(maxsize=16)
def _load(tokenizer_path: str, chat_template_path: str | None) -> PromptTokenizer | None:
    try:
        return PromptTokenizer(tokenizer_path, chat_template_path)
    except Exception as exc:  # a missing or unreadable file: that group keeps the inferred index
        logger.error("cannot load the tokenizer %s (chat template %s): %s: %s; its model group keeps the inferred "
                     "prefix index", tokenizer_path, chat_template_path, type(exc).__name__, exc)
        return None


def tokenizer_for(tokenizers: Mapping[str, Mapping[str, Any]], model: str) -> PromptTokenizer | None:
    """The tokenizer the settings name for `model`'s group (the first pattern that matches), loaded once."""
    for pattern, spec in tokenizers.items():
        if pattern == model or fnmatch.fnmatchcase(model, pattern):
            path = spec.get("tokenizer")
            if not path:
                return None
            return _load(str(path), spec.get("chat_template"))
    return None
