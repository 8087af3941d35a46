"""Redis clients from one `redis_url`: a single server, Redis Sentinel or Redis Cluster.

    redis://[user:password@]host:port/db            rediss://... (TLS)     unix:///path/redis.sock
    redis+sentinel://[user:password@]host:port[,host:port...]/service_name[/db][?sentinel_password=...]
    redis+cluster://[user:password@]host:port[,host:port...]              rediss+cluster://... (TLS)

Every key the plugin uses carries the `{prefix}` hash tag, so in a Cluster each Lua call and pipeline
lands on one slot; Sentinel clients ask the sentinels for the current master and follow failovers.
Timeouts are short: the plugin must fall back, never hang a request.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs, unquote

import redis
import redis.asyncio as aioredis
from redis.asyncio.cluster import ClusterNode as AsyncClusterNode
from redis.asyncio.sentinel import Sentinel as AsyncSentinel
from redis.cluster import ClusterNode
from redis.sentinel import Sentinel

SCHEMES = ("redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://", "rediss+cluster://")


@dataclass(frozen=True)
class RedisTarget:
    kind: str
    """"server", "sentinel" or "cluster"."""
    url: str
    nodes: tuple[tuple[str, int], ...] = ()
    service: str | None = None
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None
    ssl: bool = False


def parse_redis_url(url: str) -> RedisTarget:
    """Split a Sentinel or Cluster URL into its parts; ValueError names what is wrong."""
    scheme, sep, rest = url.partition("://")
    if not sep or url.startswith(("redis://", "rediss://", "unix://")):
        return RedisTarget("server", url)
    kind = scheme.split("+", 1)[1] if "+" in scheme else ""
    if f"{scheme}://" not in SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; allowed: {', '.join(s[:-3] for s in SCHEMES)}")
    rest, _, query = rest.partition("?")
    creds, _, rest = rest.rpartition("@")
    username, _, password = creds.partition(":") if creds else ("", "", "")
    hosts, _, path = rest.partition("/")
    nodes = []
    for host in hosts.split(","):
        name, _, port = host.rpartition(":")
        if not name or not port.isdigit():
            raise ValueError(f"{host!r} is not host:port")
        nodes.append((name, int(port)))
    parts = [p for p in path.split("/") if p]
    service, db = None, 0
    if kind == "sentinel":
        if not parts:
            raise ValueError("a Sentinel URL names the master's service after the hosts: .../mymaster")
        service = parts[0]
        parts = parts[1:]
    if parts:
        if kind == "cluster" or len(parts) > 1 or not parts[0].isdigit():
            raise ValueError(f"unexpected path {path!r}" + ("; a Cluster has only db 0" if kind == "cluster" else ""))
        db = int(parts[0])
    options = parse_qs(query)
    return RedisTarget(kind, url, tuple(nodes), service, db, unquote(username) or None, unquote(password) or None,
                       unquote(options["sentinel_password"][0]) if "sentinel_password" in options else None,
                       scheme.startswith("rediss"))


@dataclass(frozen=True)
class _Flavour:
    """redis-py's classes for one I/O style: the asyncio ones or the blocking ones."""

    from_url: Any
    sentinel: Any
    cluster: Any
    node: Any


_ASYNC = _Flavour(aioredis.from_url, AsyncSentinel, aioredis.RedisCluster, AsyncClusterNode)
_SYNC = _Flavour(redis.Redis.from_url, Sentinel, redis.RedisCluster, ClusterNode)


def async_client(url: str, timeout_s: float, *, blocking: bool = False) -> Any:
    """An asyncio client; `blocking` ones (pub/sub) wait for messages without a read timeout."""
    return _client(_ASYNC, url, {"socket_timeout": None if blocking else timeout_s,
                                 "socket_connect_timeout": timeout_s}, health_check_interval=30)


def sync_client(url: str, timeout_s: float = 5.0) -> Any:
    """A blocking client for the command line (`thresholds`, `status`, `explain`)."""
    return _client(_SYNC, url, {"socket_timeout": timeout_s, "socket_connect_timeout": timeout_s})


def _client(flavour: _Flavour, url: str, options: dict[str, Any], **server_options: Any) -> Any:
    target = parse_redis_url(url)
    if target.kind == "server":
        return flavour.from_url(url, **server_options, **options)
    auth = {"username": target.username, "password": target.password}
    if target.kind == "sentinel":
        sentinel = flavour.sentinel(list(target.nodes), sentinel_kwargs={"password": target.sentinel_password, **options},
                                    **options)
        return sentinel.master_for(target.service, db=target.db, **auth)
    return flavour.cluster(startup_nodes=[flavour.node(h, p) for h, p in target.nodes], ssl=target.ssl,
                           **auth, **options)
