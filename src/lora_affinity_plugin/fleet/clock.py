"""One clock for the fleet: Redis's.

The scraper and the proxies run on different hosts whose clocks drift apart. A record's age, and
whether a scrape already counts a request a proxy sent, compare times taken on different hosts, so
every time that crosses Redis is on Redis's own clock (`TIME`, read inside the Lua calls each process
already makes): a writer converts its local times to Redis time, a reader converts them back to its own.
Each process learns its offset from those round trips, as NTP does: Redis's time is taken to fall
half-way through the round trip, and of the recent round trips the shortest (the least uncertain) wins.
The error is at most half that round trip, against seconds of skew between hosts.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Sequence

SAMPLES = 16
"""Round trips remembered; the offset is the shortest one's (a slow round trip says little)."""


def redis_seconds(time_reply: Sequence[Any]) -> float:
    """Redis's `TIME` reply ([seconds, microseconds], as bytes or numbers) in seconds."""
    seconds, micros = time_reply[0], time_reply[1]
    return int(seconds) + int(micros) / 1e6


class RedisClock:
    """This process's offset to Redis's clock. Until a round trip is seen it is 0 (the local clock)."""

    __slots__ = ("_samples", "offset_s")

    def __init__(self) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=SAMPLES)
        self.offset_s = 0.0
        """Redis's clock minus this process's."""

    @property
    def known(self) -> bool:
        return bool(self._samples)

    @property
    def error_s(self) -> float:
        """How far off `offset_s` may be: half the round trip it was read in."""
        return min(self._samples)[0] / 2 if self._samples else 0.0

    def observe(self, redis_time: float, sent: float, received: float) -> None:
        """A round trip that left at `sent` and came back at `received` (local) read Redis at `redis_time`."""
        round_trip = max(0.0, received - sent)
        self._samples.append((round_trip, redis_time - (sent + received) / 2))
        self.offset_s = min(self._samples)[1]

    def to_redis(self, local: float) -> float:
        return local + self.offset_s

    def to_local(self, redis: float) -> float:
        return redis - self.offset_s
