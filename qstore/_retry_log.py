"""One log line per failure episode of a background task, not one per attempt.

A background sync, sweep or compaction on a full disk fails at every
interval until space comes back; logging a traceback each time would bury
everything else (and fill the disk further). :class:`RetryLog` logs the first
failure of an episode and, when an attempt works again, how many failed.
"""

from __future__ import annotations

import logging


class RetryLog:
    def __init__(self, logger: logging.Logger, what: str, interval: float) -> None:
        self._log = logger
        self._what = what
        self._interval = interval
        self.failures = 0  # in a row

    def failed(self, exc: BaseException) -> None:
        if not self.failures:
            self._log.error("%s failed: %s; retried every %g s, logged again when it works",
                            self._what, exc, self._interval)
        self.failures += 1

    def worked(self) -> None:
        if self.failures:
            self._log.warning("%s works again after %d failed attempt(s)", self._what,
                              self.failures)
            self.failures = 0
