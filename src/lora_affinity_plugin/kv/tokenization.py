"""A prompt's token ids as its engine computes them, so the gateway names its blocks as the engine's KV events
do (`token_blocks.py`).

Per model group the settings name a `tokenizer.json` and the chat template the engine applies (`tokenizers`);
both are loaded once, from local files (a gateway fetches nothing). A chat is rendered by the template with
the generation prompt and tokenized without special tokens (the template writes them); a text completion's
prompt is tokenized as the server does, with them. LiteLLM hands routing a completion's prompt as one user
message, so such a request is tokenized both ways and each pod is matched by the better of the two.

A long prompt's head repeats (an app's instructions, a document, a conversation so far) while its tail is new:
the rendered chat is split after its first message, and the head's ids are kept, so only the tail is
tokenized per request. A prompt that is one message (a text completion, a RAG app's single user message) is
split before its last paragraph break instead: the document above it is the part that repeats. The split
falls where the template starts the next message (a newline and its role marker) or before a blank line,
boundaries a byte-level tokenizer's pre-tokenizer seldom merges across; where it does, the ids differ from
the engine's from that block on, and the match counts fewer blocks, never more.

The kept heads are bounded by their tokens as well as their number (ids and keys in arrays, not lists of
Python ints), so prompts that never repeat cost a bounded few megabytes.
"""

from __future__ import annotations

import fnmatch
import logging
from array import array
from collections import OrderedDict
from functools import lru_cache
from typing import Any, Generic, Hashable, Mapping, Sequence, TypeVar

from .prefixes import MAX_MESSAGES
from .token_blocks import chain_keys

logger = logging.getLogger("lora_affinity")

CACHED_HEADS = 256
"""Prompt heads (an app's instructions, a document) whose ids and block keys are kept."""
CACHED_HEAD_TOKENS = 2_000_000
"""At most this many kept ids (4 bytes each), and as many bytes of keys (8 each, one per block)."""
MIN_HEAD_CHARS = 64
PARAGRAPH = "\n\n"


class PromptTokenizer:
    def __init__(self, tokenizer_path: str, chat_template_path: str | None = None) -> None:
        from tokenizers import Tokenizer  # a LiteLLM dependency: every proxy has it

        self._tokenizer = Tokenizer.from_file(tokenizer_path)
        self._template = None
        if chat_template_path:
            import jinja2  # a LiteLLM dependency too

            with open(chat_template_path, encoding="utf-8") as f:
                self._template = jinja2.Environment(autoescape=False, keep_trailing_newline=True).from_string(f.read())
        self._heads: _Recent[tuple[str, bool], array] = _Recent(CACHED_HEADS, CACHED_HEAD_TOKENS)
        """Recent prompt heads' ids (a request's new tail is tokenized each time, and not kept)."""
        self._head_keys: _Recent[tuple[int, str, int], array] = _Recent(CACHED_HEADS, CACHED_HEAD_TOKENS // 2)
        """Recent heads' block keys, per chain seed (adapter, salt) and block size."""

    def chains(self, seed: int, messages: Any, block_size: int, max_chars: int | None = None) -> list[list[int]]:
        """The block keys (`token_blocks`) of the ids the engine may have computed for this request: the chat's,
        and when it is one user message (perhaps a text completion's prompt), the bare prompt's too. Only the
        first `max_chars` characters of each reading are tokenized (`prefix_max_chars`, as the inferred index
        hashes): the request path's work stays bounded whatever a prompt's size."""
        return [self._keys(seed, head, tail, special, block_size)
                for head, tail, special in _capped(self._parts(messages, max_chars), max_chars)]

    def candidates(self, messages: Any) -> list[list[int]]:
        """The token ids of those same readings (`chains` without the keys)."""
        return [self._ids(head, special).tolist() + (self.encode(tail, False) if tail else [])
                for head, tail, special in self._parts(messages)]

    def _parts(self, messages: Any, max_chars: int | None = None) -> list[tuple[str, str, bool]]:
        """Each reading as (head, tail, with special tokens); a chat of its first `MAX_MESSAGES` messages. With
        `max_chars`, only what can reach the first `max_chars` characters is rendered: each text cut there, and no
        message after the texts already fill them (the work stays bounded whatever the body's size)."""
        if not isinstance(messages, (list, tuple)) or not messages:
            return []
        several = len(messages) > 1
        messages = _within(messages[:MAX_MESSAGES], max_chars) if max_chars is not None else messages[:MAX_MESSAGES]
        if not messages:
            return []
        out = []
        if self._template is not None and all(isinstance(m, dict) for m in messages):
            try:
                text = self._template.render(messages=list(messages), add_generation_prompt=True)
            except Exception:  # a template that cannot render this request: no exact match for it
                text = None
            if text is not None:
                out.append((*_split(text, messages[0].get("content"), whole=several), False))
        if not several and isinstance(messages[0], dict) and isinstance(messages[0].get("content"), str):
            content = messages[0]["content"]
            cut = _paragraph_cut(content)
            out.append((content[:cut], content[cut:], True))
        return out

    def _keys(self, seed: int, head: str, tail: str, special: bool, block_size: int) -> list[int]:
        """The head's kept keys, and the tail's chained on from them (its ids without special tokens: those
        belong at the prompt's start, in the head)."""
        head_ids = self._ids(head, special)
        cached = (seed, head, block_size)
        keys = self._head_keys.get(cached)
        if keys is None:
            keys = array("Q", chain_keys(seed, head_ids, block_size))
            self._head_keys.put(cached, keys, len(keys))
        if not tail:
            return keys.tolist()
        rest = head_ids[len(keys) * block_size:].tolist() + self.encode(tail, False)
        return keys.tolist() + list(chain_keys(keys[-1] if keys else seed, rest, block_size))

    def _ids(self, text: str, special: bool) -> array:
        key = (text, special)
        ids = self._heads.get(key)
        if ids is None:
            ids = array("I", self.encode(text, special))
            self._heads.put(key, ids, len(ids))
        return ids

    def encode(self, text: str, special: bool) -> list[int]:
        return self._tokenizer.encode(text, add_special_tokens=special).ids


def _within(messages: Sequence[Any], max_chars: int) -> list[Any]:
    """The messages whose text can reach a rendering's first `max_chars` characters, each text cut there (a
    rendering holds every text in order, so what lies past them lies past the cut too)."""
    out, used = [], 0
    for message in messages:
        if used >= max_chars:
            break
        content = message.get("content") if isinstance(message, dict) else None
        if isinstance(content, str):
            if len(content) > max_chars:
                message = {**message, "content": content[:max_chars]}
            used += len(content)
        out.append(message)
    return out


def _capped(parts: list[tuple[str, str, bool]], max_chars: int | None) -> list[tuple[str, str, bool]]:
    """Each reading cut to its first `max_chars` characters (a token cut in two at the end costs at most the last
    block's match)."""
    if max_chars is None:
        return parts
    out = []
    for head, tail, special in parts:
        if len(head) >= max_chars:
            out.append((head[:max_chars], "", special))
        else:
            out.append((head, tail[:max_chars - len(head)], special))
    return out


def _split(text: str, first: Any, whole: bool) -> tuple[str, str]:
    """The rendered chat as (the head, the rest). `whole`: the head runs through the first message, where the
    template starts the next one (a newline, a marker); else (the prompt is that one message) up to the message's
    last paragraph break."""
    if isinstance(first, str) and len(first) >= MIN_HEAD_CHARS:
        at = text.find(first)
        if at >= 0:
            if not whole:
                cut = at + _paragraph_cut(first)
                return text[:cut], text[cut:]
            end = at + len(first)
            if end == len(text) or text[end] in "\n<":
                return text[:end], text[end:]
    return text, ""


def _paragraph_cut(content: str) -> int:
    """Where a one-message prompt's repeated part likely ends: before its last blank line (a question under a
    document), or its end when it has none past `MIN_HEAD_CHARS`."""
    cut = content.rfind(PARAGRAPH)
    return cut if cut >= MIN_HEAD_CHARS else len(content)


K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class _Recent(Generic[K, V]):
    """The most recently used entries, at most `entries` of them and `units` in all (each entry's size is
    given as it is put); the least recent go first."""

    def __init__(self, entries: int, units: int) -> None:
        self._entries, self._units, self._held = entries, units, 0
        self._data: OrderedDict[K, tuple[V, int]] = OrderedDict()

    def get(self, key: K) -> V | None:
        found = self._data.get(key)
        if found is None:
            return None
        self._data.move_to_end(key)
        return found[0]

    def put(self, key: K, value: V, units: int) -> None:
        if units > self._units:
            return  # larger than the whole cache: computed again when it comes back
        old = self._data.pop(key, None)
        if old is not None:
            self._held -= old[1]
        self._data[key] = (value, units)
        self._held += units
        while len(self._data) > self._entries or self._held > self._units:
            _, (_, gone) = self._data.popitem(last=False)
            self._held -= gone

    def __iter__(self):
        return iter(self._data)

    def __len__(self) -> int:
        return len(self._data)


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
