"""A prompt's prefix as chained block hashes: what the prefix index stores and matches.

The router cannot see the replicas' tokenizer, so it cuts the prompt's text (chat messages rendered
canonically, or the completion prompt) into blocks of `prefix_block_chars` bytes of UTF-8 and hashes
them in a chain: block i's hash covers every byte before it. The chain is seeded by the adapter (or
base model) and the request's `cache_salt`, as vLLM's own block hash is, so the same text under
another adapter or salt never matches; with `prefix_isolation`, by the request's team or key too, so a
caller's prompt never follows another tenant's to its pod. A partial last block is not hashed.

Time is bounded whatever the request holds: at most `prefix_max_chars` of the prompt, from at most
its first 1024 messages, is rendered and hashed (a 10 MB prompt costs what its first
`prefix_max_chars` cost).
CRC-32 chains are cheap (one C call a block) and stable across processes; a 32-bit collision
costs at most one misplaced request, never a failed one.
"""

from __future__ import annotations

import zlib
from collections import OrderedDict
from typing import Any, Iterable

MAX_MESSAGES = 1024
"""At most this many messages are rendered (with `prefix_max_chars`, what bounds a decision's time)."""
_ROLE_END = "\x1f"
_MESSAGE_END = "\x1e"


def render_prompt(messages: Any, limit: int) -> str:
    """The first `limit` characters of a prompt in one canonical form, whatever the body holds.

    `messages` is LiteLLM's view of the request: chat messages, or a text completion's prompt wrapped
    as one user message. Content parts other than text (images, audio) render as their type and URL
    or data, so two prompts that differ only in an image differ here too. Anything malformed renders
    as what can be read of it; nothing raises.
    """
    if isinstance(messages, str):
        return messages[:limit]
    if not isinstance(messages, (list, tuple)):
        return ""
    out: list[str] = []
    size = 0
    for message in messages[:MAX_MESSAGES]:
        if size >= limit:
            break
        if not isinstance(message, dict):
            continue
        role = message.get("role")
        piece = (role if isinstance(role, str) else "") + _ROLE_END
        out.append(piece)
        size += len(piece)
        content = message.get("content")
        if isinstance(content, str):  # the common case, without the generator
            text = content[: limit - size]
            out.append(text)
            size += len(text)
        else:
            for text in _content_texts(content, limit - size):
                out.append(text)
                size += len(text)
                if size >= limit:
                    break
        out.append(_MESSAGE_END)
        size += 1
    return "".join(out)[:limit]


def _content_texts(content: Any, budget: int) -> Iterable[str]:
    if isinstance(content, str):
        yield content[:budget]
        return
    if not isinstance(content, (list, tuple)):
        return
    for part in content:
        if budget <= 0:
            return
        if isinstance(part, str):
            text = part[:budget]
        elif isinstance(part, dict):
            kind = part.get("type")
            value = part.get(kind) if isinstance(kind, str) else None
            if isinstance(value, dict):  # {"type": "image_url", "image_url": {"url": ...}}
                value = value.get("url") or value.get("data")
            text = f"<{kind}>{value[:budget] if isinstance(value, str) else ''}" if kind != "text" else \
                (part.get("text")[:budget] if isinstance(part.get("text"), str) else "")
        else:
            continue
        budget -= len(text)
        yield text


def prefix_hashes(text: str, scope: str, salt: str | None, block_chars: int) -> tuple[int, ...]:
    """Chained hashes of the text's full blocks, seeded by `scope` (adapter or model) and salt."""
    return _chain(text.encode("utf-8", "surrogatepass"), _seed(scope, salt), block_chars)[0]


def _seed(scope: str, salt: str | None) -> int:
    return zlib.crc32(f"{scope}\x00{salt or ''}\x00".encode("utf-8", "surrogatepass"))


def _chain(data: bytes, crc: int, block_chars: int) -> tuple[tuple[int, ...], int, bytes]:
    """(hashes of the full blocks, the chain's state after them, the bytes of the partial block left)."""
    full = len(data) - len(data) % block_chars
    view = memoryview(data)
    crc32 = zlib.crc32
    hashes = tuple([crc := crc32(view[start:start + block_chars], crc) for start in range(0, full, block_chars)])
    return hashes, crc, data[full:]


def _short(text: str | None) -> str | tuple[int, int] | None:
    """A key part a caller chooses (a `cache_salt`, a role, a model name), held as its length and hash past 256
    characters: the cache's memory stays bounded whatever a request carries."""
    return text if text is None or len(text) <= 256 else (len(text), hash(text))


class _HeadCache:
    """Chains of recent first messages (system prompts repeat; their questions do not).

    Keyed by scope, salt, block size, the first message's role and its content's length and Python hash
    (one pass over the content, kept on the string; the rendered message is built only on a miss), so a
    repeated 16 KB system prompt is neither copied, encoded nor hashed block by block again; bounded,
    LRU. (A 64-bit hash and the length: a collision is at most one misplaced request.)
    """

    def __init__(self, size: int = 1024) -> None:
        self.size = size
        self._entries: OrderedDict[tuple, tuple[tuple[int, ...], int, bytes]] = OrderedDict()

    def chain(self, role: str, content: str, scope: str, salt: str | None, block_chars: int
              ) -> tuple[tuple[int, ...], int, bytes]:
        key = (_short(scope), _short(salt), block_chars, _short(role), len(content), hash(content))
        entry = self._entries.get(key)
        if entry is None:
            data = (role + _ROLE_END + content + _MESSAGE_END).encode("utf-8", "surrogatepass")
            entry = self._entries[key] = _chain(data, _seed(scope, salt), block_chars)
            if len(self._entries) > self.size:
                self._entries.popitem(last=False)
        else:
            self._entries.move_to_end(key)
        return entry


_HEADS = _HeadCache()


def request_salt(request_kwargs: Any) -> str | None:
    """The request's `cache_salt` (top level or in `extra_body`); a non-string one is ignored."""
    if not isinstance(request_kwargs, dict):
        return None
    salt = request_kwargs.get("cache_salt")
    if salt is None and isinstance(request_kwargs.get("extra_body"), dict):
        salt = request_kwargs["extra_body"].get("cache_salt")
    return salt if isinstance(salt, str) else None


def request_tenant(request_kwargs: Any, isolation: str) -> str:
    """Who a request's cached prompts belong to under `prefix_isolation`: its LiteLLM team (`team`; a key in no
    team is a team of its own) or its API key's hash (`key`), from the metadata LiteLLM's proxy adds to every
    request. A request without either (a `litellm.Router` user's) is its own anonymous tenant, ""."""
    if not isinstance(request_kwargs, dict):
        return ""
    for bucket_name in ("metadata", "litellm_metadata"):
        bucket = request_kwargs.get(bucket_name)
        if not isinstance(bucket, dict):
            continue
        key = bucket.get("user_api_key_hash") or bucket.get("user_api_key")
        team = bucket.get("user_api_key_team_id") if isolation == "team" else None
        if team:
            return f"team:{team}"
        if key:
            return f"key:{key}"
    return ""


def placement_key(scope: str, hashes: tuple[int, ...]) -> int:
    """What gateways agree on when placing a new adapter or prefix: the scope and the first block."""
    return zlib.crc32(f"{scope}\x00{hashes[0] if hashes else ''}".encode("utf-8", "surrogatepass"))


def rendezvous(key: int, pod: str) -> int:
    """Highest-random-weight hashing: every gateway ranks the pods for `key` the same way."""
    x = (zlib.crc32(pod.encode("utf-8", "surrogatepass")) << 32 | key) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64  # splitmix64's finalizer: CRC alone is linear
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


_MASK64 = (1 << 64) - 1


def prompt_prefix(messages: Any, scope: str, request_kwargs: Any, settings: Any) -> tuple[int, ...]:
    """The request's chain under `settings` (empty when prefix affinity is off or the prompt is short)."""
    limit, block = settings.prefix_max_chars, settings.prefix_block_chars
    if not settings.prefix_affinity or not limit:
        return ()
    if settings.rule_set == "sglang-cache-aware":
        scope = ""  # its radix tree is per worker, not per adapter
    salt = request_salt(request_kwargs)
    if settings.prefix_isolation != "shared":
        salt = f"{salt or ''}\x00{request_tenant(request_kwargs, settings.prefix_isolation)}"
    head = _first_message(messages, limit)
    rendered = len(head[0]) + len(head[1]) + 2 if head is not None else 0
    if head is not None and 2 * block <= rendered:  # the common long prompt: a system prompt first
        hashes, crc, rest = _HEADS.chain(*head, scope, salt, block)
        tail = render_prompt(messages[1:MAX_MESSAGES], limit - rendered).encode("utf-8", "surrogatepass")
        hashes += _chain(rest + tail, crc, block)[0]
    else:
        hashes = prefix_hashes(render_prompt(messages, limit), scope, salt, block)
    return hashes if len(hashes) >= settings.prefix_min_blocks else ()


def instructions_blocks(messages: Any, block_chars: int) -> int:
    """About how many full blocks the first message fills when it is the app's instructions (a `system` or
    `developer` message with text content); 0 otherwise. Counted in characters (a byte count would encode
    the message again): for non-ASCII text an underestimate."""
    if not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], dict):
        return 0
    role, content = messages[0].get("role"), messages[0].get("content")
    if role not in ("system", "developer") or not isinstance(content, str):
        return 0
    return (len(role) + len(content) + 2) // block_chars


def is_later_turn(messages: Any) -> bool:
    """Whether the prompt carries an earlier turn of its conversation (an `assistant` message): a chat's next turn,
    whose history is what a pod holds of it."""
    if not isinstance(messages, (list, tuple)):
        return False
    for message in messages[:MAX_MESSAGES]:
        if isinstance(message, dict) and message.get("role") == "assistant":
            return True
    return False


def _first_message(messages: Any, limit: int) -> tuple[str, str] | None:
    """The first message's role and content (rendered by `render_prompt` as role, separator, content, end),
    when its content is plain text and the rendered message fits in `limit`."""
    if not isinstance(messages, (list, tuple)) or not messages or not isinstance(messages[0], dict):
        return None
    role, content = messages[0].get("role"), messages[0].get("content")
    role = role if isinstance(role, str) else ""
    if not isinstance(content, str) or len(role) + len(content) + 2 >= limit:
        return None
    return role, content
