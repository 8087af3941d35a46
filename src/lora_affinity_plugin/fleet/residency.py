"""Which adapters an idle pod still holds, for servers that do not report it: per pod, the adapters it ran most
recently, an LRU of `max_lora` slots (like vLLM's GPU slots) times `residency_memory` (vLLM keeps more adapters
in CPU memory, loaded back at little cost).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable


class ResidencyMemory:
    def __init__(self) -> None:
        self._recent: dict[str, OrderedDict[str, None]] = {}

    def touch(self, pod: str, adapter: str, slots: int) -> None:
        """`pod` ran (or was sent) `adapter`: it is the pod's most recent, and the oldest past `slots` is forgotten."""
        recent = self._recent.get(pod)
        if recent is None:
            recent = self._recent[pod] = OrderedDict()
        recent[adapter] = None
        recent.move_to_end(adapter)
        while len(recent) > slots:
            recent.popitem(last=False)

    def remember(self, pod: str, active: Iterable[str], slots: int) -> frozenset[str]:
        """The adapters `pod` holds, now that it reports `active` running or waiting."""
        for adapter in sorted(active):
            self.touch(pod, adapter, slots)
        return frozenset(self._recent.get(pod, ()))
