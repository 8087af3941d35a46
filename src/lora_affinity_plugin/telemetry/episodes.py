"""Log a failure once per episode, not once per request."""

from __future__ import annotations

import logging


class Episode:
    """Tracks one kind of failure (Redis down, no metrics...) and logs only its edges."""

    __slots__ = ("_logger", "_what", "active", "count")

    def __init__(self, logger: logging.Logger, what: str) -> None:
        self._logger = logger
        self._what = what
        self.active = False
        self.count = 0

    def fail(self, reason: object, exc_info: BaseException | None = None) -> None:
        """Logs the first failure of an episode (with `exc_info`'s traceback, when given); the rest are counted."""
        if not self.active:
            self.active = True
            self.count += 1
            self._logger.warning("%s: %s", self._what, reason, exc_info=exc_info)

    def recover(self) -> None:
        if self.active:
            self.active = False
            self._logger.warning("%s: recovered", self._what)
