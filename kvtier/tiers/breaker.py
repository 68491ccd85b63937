"""Circuit breaker for tiers that talk to a server: a dead or slow server costs one bounded timeout.

States::

    closed --(an I/O call fails)--> open --(cooldown_s elapsed)--> half-open
      ^                                                               |
      +------------------(the one trial call succeeds)---------------+
                          (the trial fails: open again, cooldown restarts)

While *open* every call is skipped at once and answered with the caller's fallback (a miss,
``False``); the tier reports ``healthy`` False. After the cool-down exactly one caller is let
through as a trial; the others keep getting the fallback until it has finished.

``healthy`` answers "would a call reach the server now?": True while closed, and True again as
soon as the cool-down has elapsed (half-open, no trial yet in flight) even though nothing has
touched the server since -- the next call *is* the trial. Callers that only send work to
healthy tiers (write-through planning) must see this, or a node whose sole traffic is such work
would never make the trial call and never resume. A failed trial turns it False again. The timeout
itself is the client's (socket / read timeouts configured by the tier), so the worst cost of an
outage to one caller is one timeout, and to everyone else nothing.

``call`` never lets an exception of ``errors`` escape: the inference path sees misses, never an
exception. Thread-safe.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TypeVar

log = logging.getLogger(__name__)

T = TypeVar("T")


class CircuitBreaker:
    """Skip a failing server for ``cooldown_s`` seconds after each failure, then retry once."""

    def __init__(
        self, name: str, cooldown_s: float = 5.0, clock: Callable[[], float] = time.monotonic
    ) -> None:
        if cooldown_s < 0:
            raise ValueError(f"{name}: cooldown_s must be >= 0, got {cooldown_s}")
        self.name = name
        self.cooldown_s = cooldown_s
        self._clock = clock
        self._lock = threading.Lock()
        self._open_until: float | None = None  # None = closed
        self._trial_running = False
        #: how many times the breaker opened (closed -> open, or a failed trial)
        self.trips = 0
        #: calls answered with the fallback without touching the server
        self.skipped = 0

    @property
    def healthy(self) -> bool:
        """True while closed, or half-open with no trial in flight (the next call is the trial).

        A query: it claims nothing, so the trial still goes to whichever caller comes first."""
        with self._lock:
            return self._open_until is None or (
                not self._trial_running and self._clock() >= self._open_until
            )

    def allow(self) -> bool:
        """May the caller touch the server now? (``True`` when closed or for the one trial.)"""
        return self._admit() is not None

    def _admit(self) -> bool | None:
        """``allow``, saying which: None (skip), False (closed), True (this is the trial)."""
        with self._lock:
            if self._open_until is None:
                return False
            if not self._trial_running and self._clock() >= self._open_until:
                self._trial_running = True
                return True
            self.skipped += 1
            return None

    def succeeded(self) -> None:
        """Record a successful call; closes the breaker."""
        with self._lock:
            if self._open_until is not None:
                log.info("%s: server reachable again, tier back in service", self.name)
            self._open_until = None
            self._trial_running = False

    def failed(self, exc: BaseException, trial: bool = True) -> None:
        """Record a failed call; opens the breaker for ``cooldown_s``. ``trial`` False: a call
        let through while the breaker was closed, which leaves a trial in flight the only one."""
        with self._lock:
            was_closed = self._open_until is None
            self._open_until = self._clock() + self.cooldown_s
            if trial:
                self._trial_running = False
            self.trips += 1
        if was_closed:
            log.warning(
                "%s: server call failed (%s: %s); skipping the tier for %.1fs",
                self.name,
                type(exc).__name__,
                exc,
                self.cooldown_s,
            )

    def call(
        self,
        fn: Callable[[], T],
        fallback: T,
        errors: tuple[type[BaseException], ...] = (Exception,),
    ) -> T:
        """``fn()`` if the breaker allows it and it succeeds, else ``fallback``."""
        trial = self._admit()
        if trial is None:
            return fallback
        try:
            result = fn()
        except errors as exc:
            self.failed(exc, trial)
            return fallback
        except BaseException:
            if trial:  # a caller mistake or interrupt: do not wedge the half-open trial
                with self._lock:
                    self._trial_running = False
            raise
        self.succeeded()
        return result
