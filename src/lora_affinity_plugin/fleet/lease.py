"""One scraper at a time: a Redis lease with a fencing token.

Any number of scraper workers may run (one per proxy, or inside the proxies); only the lease holder
scrapes, so each vLLM replica is scraped once per interval however many gateways there are. The lease
is taken and renewed, and the records written, by one Lua script that checks the holder atomically with
the write: a former leader that was paused past its lease and wakes up finds another holder, and its
write is refused. Each new holder gets a larger token (`INCR`), which `status` shows.
"""

from __future__ import annotations

import os
import socket
import uuid
from dataclasses import dataclass
from typing import Sequence

from .clock import redis_seconds

# KEYS: lease, fence counter, settings, pod records...   ARGV: me, lease ms, record ttl ms, records...
_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if not holder then
  local token = redis.call('INCR', KEYS[2])
  holder = ARGV[1] .. '#' .. token
  redis.call('SET', KEYS[1], holder, 'PX', ARGV[2])
end
local mine = string.sub(holder, 1, string.len(ARGV[1]) + 1) == ARGV[1] .. '#'
local settings = redis.call('GET', KEYS[3])
if not mine then
  return {0, holder, settings, redis.call('TIME')}
end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
for i = 4, #KEYS do
  redis.call('SET', KEYS[i], ARGV[i], 'PX', ARGV[3])
end
return {1, holder, settings, redis.call('TIME')}
"""


# KEYS: lease, target   ARGV: holder, 'xadd' | 'hset', maxlen (xadd), field, value, ...
_FENCED_WRITE = """
if redis.call('GET', KEYS[1]) ~= ARGV[1] then
  return false
end
local unpack = unpack or table.unpack
if ARGV[2] == 'xadd' then
  return redis.call('XADD', KEYS[2], 'MAXLEN', '~', ARGV[3], '*', unpack(ARGV, 4))
end
if ARGV[2] == 'set' then
  return redis.call('SET', KEYS[2], ARGV[5], 'PX', ARGV[3])
end
if ARGV[2] == 'hreplace' then
  redis.call('DEL', KEYS[2])
end
redis.call('HSET', KEYS[2], unpack(ARGV, 4))
return 'OK'
"""


async def fenced_write(client, prefix: str, holder: str, op: str, key: str, fields: dict, maxlen: int = 0):
    """`XADD` (capped at `maxlen`), `HSET`, `hreplace` (the hash replaced by `fields`) or `set` (the one field's
    value, expiring after `maxlen` ms) into `key`, only while `holder` (worker#token) holds the scraper lease: one
    Lua call, so a former leader paused past its lease cannot write the KV index's change sets or snapshot over its
    successor's. None when another worker holds the lease (nothing written); else the entry id or "OK"."""
    flat = [str(part) if not isinstance(part, (bytes, str)) else part for pair in fields.items() for part in pair]
    return await client.eval(_FENCED_WRITE, 2, lease_key(prefix), key, holder, op, maxlen, *flat)


def lease_key(prefix: str) -> str:
    return f"{{{prefix}}}:scraper:lease"


def fence_key(prefix: str) -> str:
    return f"{{{prefix}}}:scraper:fence"


def worker_id() -> str:
    """Unique per process and start: a restarted worker is a new holder with a new token."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:6]}"


@dataclass(frozen=True)
class LeaseResult:
    leader: bool
    holder: str | None
    """`worker id#token` of the lease holder."""
    settings_raw: bytes | None
    redis_time: float
    """Redis's clock during the call (`clock.RedisClock`)."""


async def lease_and_write(client, prefix: str, me: str, lease_ms: int, ttl_ms: int, settings_key: str,
                          records: Sequence[tuple[str, bytes]] = ()) -> LeaseResult:
    """Take or renew the lease and, only while holding it, write `records` ((key, json) pairs)."""
    keys = [lease_key(prefix), fence_key(prefix), settings_key, *(key for key, _ in records)]
    args = [me, lease_ms, ttl_ms, *(body for _, body in records)]
    leader, holder, settings_raw, now = await client.eval(_SCRIPT, len(keys), *keys, *args)
    holder = holder.decode() if isinstance(holder, bytes) else holder
    return LeaseResult(bool(leader), holder, settings_raw, redis_seconds(now))


# The standby that follows the pods' KV events (`scraping/kv_follow.py`): one, so that a fleet with a scraper beside every
# proxy (or inside it) does not follow every pod's events once per worker. KEYS: the standby key. ARGV: me, ms,
# and 1 to hold (take or renew) or 0 to let go.
_STANDBY_SCRIPT = """
local holder = redis.call('GET', KEYS[1])
if ARGV[3] == '0' then
  if holder == ARGV[1] then redis.call('DEL', KEYS[1]) end
  return 0
end
if not holder or holder == ARGV[1] then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
"""


def standby_key(prefix: str) -> str:
    return f"{{{prefix}}}:scraper:kv-standby"


async def hold_standby(client, prefix: str, me: str, ms: int) -> bool:
    """Take or renew the KV-events standby role for `ms`; False while another worker holds it."""
    return bool(await client.eval(_STANDBY_SCRIPT, 1, standby_key(prefix), me, ms, 1))


async def release_standby(client, prefix: str, me: str) -> None:
    """Let go of the standby role (this worker took the lease): the next standby to ask gets it."""
    await client.eval(_STANDBY_SCRIPT, 1, standby_key(prefix), me, 0, 0)
