"""A prompt's token ids as its engine computes them, so the gateway names its blocks as the engine's KV events
do (`token_blocks.py`).

Per model group the settings name a `tokenizer.json` and the chat template the engine applies (`tokenizers`);
both are loaded once, from local files (a gateway fetches nothing). A chat is rendered by the template with
the generation prompt and tokenized without special tokens (the template writes them); a text completion's
prompt is tokenized as the server does, with them. LiteLLM hands routing a completion's prompt as one user
message, so such a request is tokenized both ways and each pod is matched by the better of the two. Recent
prompts' ids are kept, so a repeated prompt is not tokenized again.
"""

from __future__ import annotations

import fnmatch
import logging
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Mapping

logger = logging.getLogger("lora_affinity")

CACHED_PROMPTS = 512


class PromptTokenizer:
    def __init__(self, tokenizer_path: str, chat_template_path: str | None = None) -> None:
        from tokenizers import Tokenizer  # a LiteLLM dependency: every proxy has it

        self._tokenizer = Tokenizer.from_file(tokenizer_path)
        self._template = None
        if chat_template_path:
            import jinja2  # a LiteLLM dependency too

            with open(chat_template_path, encoding="utf-8") as f:
                self._template = jinja2.Environment(autoescape=False, keep_trailing_newline=True).from_string(f.read())
        self._cache: OrderedDict[tuple[str, bool], list[int]] = OrderedDict()

    def encode(self, text: str, special: bool) -> list[int]:
        key = (text, special)
        ids = self._cache.get(key)
        if ids is None:
            ids = self._cache[key] = self._tokenizer.encode(text, add_special_tokens=special).ids
            if len(self._cache) > CACHED_PROMPTS:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return ids

    def candidates(self, messages: Any) -> list[list[int]]:
        """The token ids the engine may have computed for this request: the chat's, and when it is one user
        message (perhaps a text completion's prompt), the bare prompt's too."""
        if not isinstance(messages, (list, tuple)) or not messages:
            return []
        out = []
        if self._template is not None and all(isinstance(m, dict) for m in messages):
            try:
                text = self._template.render(messages=list(messages), add_generation_prompt=True)
            except Exception:  # a template that cannot render this request: no exact match for it
                text = None
            if text is not None:
                out.append(self.encode(text, special=False))
        if len(messages) == 1 and isinstance(messages[0], dict) and isinstance(messages[0].get("content"), str):
            out.append(self.encode(messages[0]["content"], special=True))
        return out


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
