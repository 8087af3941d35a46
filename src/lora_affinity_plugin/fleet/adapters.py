"""Which adapter names are real, as far as this proxy knows: the ones the pods' /v1/models list (which every
gateway deals over the pods alike), the ones a pod reports, and the ones a pod served a request for.

A wildcard deployment passes any requested name to the pods; only a known name may enter a pod's residency
memory (`view.FleetView`), so names sprayed at the gateway cannot crowd real adapters out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Iterable

CONFIRMED_KEPT = 4096
"""Adapter names remembered as served (`confirm`): more than any fleet serves, bounded all the same."""


class AdapterCatalog:
    def __init__(self) -> None:
        self._dealing: dict[str, int] = {}
        """The adapters the pods list, each with its place in the deal."""
        self._reported: frozenset[str] = frozenset()
        """Adapters some pod reports (running, waiting or loaded), as of the last records."""
        self._confirmed: OrderedDict[str, None] = OrderedDict()
        """Adapters a pod served a request for, most recent last."""

    @property
    def served(self) -> int:
        """How many adapters the pods' /v1/models list."""
        return len(self._dealing)

    def known(self, adapter: str) -> bool:
        return adapter in self._dealing or adapter in self._reported or adapter in self._confirmed

    def serve(self, adapters: Iterable[str]) -> None:
        """The adapters the fleet serves (the pods' /v1/models, from discovery): what gateways deal."""
        self._dealing = {adapter: i for i, adapter in enumerate(sorted(adapters))}

    def report(self, reported: frozenset[str]) -> None:
        """What the pods' last records name."""
        self._reported = reported

    def confirm(self, adapter: str) -> bool:
        """A pod answered a request for `adapter`; True when that made it known."""
        if self.known(adapter):
            return False
        self._confirmed[adapter] = None
        if len(self._confirmed) > CONFIRMED_KEPT:
            self._confirmed.popitem(last=False)
        return True

    def dealt_pod(self, adapter: str, pods: Iterable[str]) -> str | None:
        """Served adapters dealt over the pods in order, like cards: every gateway deals alike."""
        index = self._dealing.get(adapter)
        if index is None:
            return None
        ordered = sorted(pods)
        return ordered[index % len(ordered)] if ordered else None
