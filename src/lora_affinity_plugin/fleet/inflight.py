"""Requests in flight: counted per process, shared between proxy replicas through Redis.

Each proxy process counts the requests it sent to each pod that have not ended, keyed by LiteLLM's
call id: counted up when a pod is chosen (or when LiteLLM's pre-call deployment hook fires), ended
exactly once by whichever ending hook comes first (success, end of stream, failure, disconnect), moved
to the new pod when a retry goes elsewhere, and swept after `inflight_timeout_ms` if no hook ever came.

Sharing: every refresh a process writes its table to `{prefix}:inflight:<process>` (expiring after a
few intervals, so a dead process's counts vanish) and reads its peers' tables in the same Lua call that
reads the pod records and the settings: one round trip per interval. The rules add the requests any
process sent to a pod since that pod's last scrape, so replicas reading one snapshot stop herding.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

_RECENT_PER_POD = 512
"""At most this many not-yet-scraped dispatches per pod are shared (the count is always exact)."""


@dataclass(frozen=True, slots=True)
class Dispatch:
    pod: str
    adapter: str | None
    at: float
    """Unix time it was sent (seconds)."""
    blocks: int = 0
    """Prefix blocks its prompt was counted in (what its engine's token count is learned against)."""


class InFlight:
    """This process's unfinished requests by call id; pure bookkeeping, no I/O."""

    def __init__(self) -> None:
        self._calls: dict[str, Dispatch] = {}
        self.swept = 0

    def get(self, call_id: str) -> Dispatch | None:
        return self._calls.get(call_id)

    def begin(self, call_id: str, pod: str, adapter: str | None, at: float, blocks: int = 0) -> Dispatch | None:
        """Count `call_id` on `pod`; returns the dispatch it replaces (a retry of the same call)."""
        previous = self._calls.pop(call_id, None)
        self._calls[call_id] = Dispatch(pod, adapter, at, blocks)
        return previous

    def end(self, call_id: str) -> Dispatch | None:
        """Release `call_id`; later calls for the same id are no-ops (hooks overlap)."""
        return self._calls.pop(call_id, None)

    def sweep(self, started_before: float) -> list[tuple[str, Dispatch]]:
        """Release entries no ending hook released in time (a leak in the host, or a lost hook)."""
        stale = [(call_id, d) for call_id, d in self._calls.items() if d.at < started_before]
        for call_id, _ in stale:
            del self._calls[call_id]
        self.swept += len(stale)
        return stale

    def counts(self) -> dict[str, int]:
        """Unfinished requests per pod (read once per refresh, so counted then)."""
        return dict(Counter(d.pod for d in self._calls.values()))

    def __len__(self) -> int:
        return len(self._calls)


def encode_share(counts: Mapping[str, int], recent: Mapping[str, Sequence[tuple[float, str | None]]],
                 index_sizes: Mapping[str, int] | None = None, shift_s: float = 0.0) -> str:
    """What peers need: exact counts, and each pod's not-yet-scraped dispatches (newest kept); and for
    `status`, how many prefix blocks this process's index holds per pod. `shift_s` takes the dispatch
    times to Redis's clock (`clock.py`), which peers on other hosts read them by."""
    pods: dict[str, Any] = {}
    for pod in set(counts) | set(recent):
        entries = list(recent.get(pod, ()))[-_RECENT_PER_POD:]
        pods[pod] = {"n": counts.get(pod, 0), "recent": [[round(at + shift_s, 4), adapter] for at, adapter in entries]}
    return json.dumps({"pods": pods, "index": dict(index_sizes or {})}, separators=(",", ":"))


@dataclass(frozen=True, slots=True)
class PeerShare:
    counts: dict[str, int]
    recent: dict[str, list[tuple[float, str | None]]]
    processes: int = 1
    """How many peer processes this share sums."""


def decode_shares(raws: Iterable[bytes | None], shift_s: float = 0.0) -> PeerShare:
    """Peers' tables summed; an unreadable one is skipped (it expires by itself). `shift_s` takes their
    times from Redis's clock to this process's."""
    return merge_shares(share for share in (_decode_share(raw, shift_s) for raw in raws) if share is not None)


def _decode_share(raw: bytes | None, shift_s: float = 0.0) -> PeerShare | None:
    if raw is None:
        return None
    try:
        pods = json.loads(raw)["pods"]
        return PeerShare({pod: int(entry["n"]) for pod, entry in pods.items()},
                         {pod: [(float(at) + shift_s, adapter) for at, adapter in entry["recent"]]
                          for pod, entry in pods.items() if entry["recent"]})
    except (ValueError, TypeError, KeyError, AttributeError):
        return None


def merge_shares(shares: Iterable[PeerShare]) -> PeerShare:
    """Several processes' tables as one: counts summed, dispatches pooled."""
    counts: dict[str, int] = {}
    recent: dict[str, list[tuple[float, str | None]]] = {}
    processes = 0
    for share in shares:
        processes += share.processes
        for pod, n in share.counts.items():
            counts[pod] = counts.get(pod, 0) + n
        for pod, entries in share.recent.items():
            recent.setdefault(pod, []).extend(entries)
    return PeerShare(counts, recent, processes)


def inflight_key(prefix: str, process: str) -> str:
    return f"{{{prefix}}}:inflight:{process}"


def prefix_stream_key(prefix: str) -> str:
    return f"{{{prefix}}}:prefixes"


def applied_key(prefix: str, process: str) -> str:
    """Which live settings a proxy process applies (`epoch:version`), while it refreshes (`lora-affinity thresholds
    show` reads them)."""
    return f"{{{prefix}}}:applied:{process}"


def read_applied(client: Any, prefix: str) -> dict[str, str]:
    """Per proxy process refreshing now, the live settings it applies (`epoch:version`); a sync client."""
    start = len(applied_key(prefix, ""))
    keys = sorted(k.decode() if isinstance(k, bytes) else k for k in client.scan_iter(match=applied_key(prefix, "*")))
    values = client.mget(keys) if keys else []
    return {key[start:]: value.decode(errors="replace") for key, value in zip(keys, values) if value is not None}


def members_key(prefix: str) -> str:
    return f"{{{prefix}}}:inflight:members"


# One round trip per refresh. KEYS: members zset, own table, the prefix stream, the exact index's change stream,
# then keys to read (settings, pod records, peers' tables), all declared so a Cluster routes the call by their hash
# tag. ARGV: process id, own table ('' = not sharing), table ttl ms, own prefix entries ('' = none), last stream id
# read ('' = not reading; read inclusively and skipped, so Redis 5 serves it), the stream's least length, entries
# kept per member process, the last change set id read ('' = not reading; read inclusively, `kv/exact_share.py` skips
# it), change sets read at most, the live settings this process applies ('' = none yet; into KEYS[5], expiring like
# its table). Returns the members, the values read (KEYS[6] on), the new stream entries, Redis's TIME (`clock.py`)
# and the change sets.
REFRESH_SCRIPT = """
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
if ARGV[2] ~= '' then
  redis.call('SET', KEYS[2], ARGV[2], 'PX', ARGV[3])
  redis.call('ZADD', KEYS[1], now + tonumber(ARGV[3]), ARGV[1])
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local keep = math.max(tonumber(ARGV[6]), tonumber(ARGV[7]) * redis.call('ZCARD', KEYS[1]))
if ARGV[4] ~= '' then
  redis.call('XADD', KEYS[3], 'MAXLEN', '~', keep, '*', 'p', ARGV[1], 'e', ARGV[4])
end
local stream = {}
if ARGV[5] ~= '' then
  stream = redis.call('XRANGE', KEYS[3], ARGV[5], '+', 'COUNT', keep + 1)
  if #stream > 0 and stream[1][1] == ARGV[5] then
    table.remove(stream, 1)
  end
end
if ARGV[10] ~= '' then
  redis.call('SET', KEYS[5], ARGV[10], 'PX', ARGV[3])
end
local values = {}
for i = 6, #KEYS do
  values[#values + 1] = redis.call('GET', KEYS[i])
end
local changes = {}
if ARGV[8] ~= '' then
  changes = redis.call('XRANGE', KEYS[4], ARGV[8], '+', 'COUNT', ARGV[9])
end
return {redis.call('ZRANGE', KEYS[1], 0, -1), values, stream, t, changes}
"""


def read_shared(client: Any, prefix: str) -> tuple[int, dict[str, int]]:
    """(processes sharing, in-flight requests per pod) as peers see them; a sync client (ops, tests)."""
    processes, counts, _ = read_shared_tables(client, prefix)
    return processes, counts


def read_shared_tables(client: Any, prefix: str) -> tuple[int, dict[str, int], dict[str, int]]:
    """As `read_shared`, plus the largest prefix index any process holds per pod."""
    members = client.zrange(members_key(prefix), 0, -1)
    raws = client.mget([inflight_key(prefix, m.decode()) for m in members]) if members else []
    sizes: dict[str, int] = {}
    for raw in raws:
        try:
            for pod, size in (json.loads(raw).get("index") or {}).items() if raw else ():
                sizes[pod] = max(sizes.get(pod, 0), int(size))
        except (ValueError, TypeError, AttributeError):
            continue
    return sum(raw is not None for raw in raws), decode_shares(raws).counts, sizes
