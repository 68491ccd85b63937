"""The Mooncake client side of the Mooncake tier: connecting, keeping the master, error codes.

``kvtier.tiers.mooncake`` decides what to move; this module holds what it takes to talk to a
``MooncakeDistributedStore`` client from the PyPI wheel ``mooncake-transfer-engine-non-cuda``
(the memory a transfer moves -- staging, registrations -- is ``kvtier.tiers.mooncake_memory``):

- ``master_endpoint``: the master's ``host:port``, checked once (``ConfigError`` otherwise).
- ``connect``: create and set up a client with a bounded RPC timeout (the client reads it from
  the environment at setup, so setups are serialized) and without the wheel's ~20 setup retries.
- ``Prober``: the thread that connects and, while the master is unreachable, finds out when it
  answers again, so that no caller waits for that: the client's own reconnect costs ~4 s per
  call against a dead master (three connection attempts a second apart), whatever
  ``rpc_timeout_s`` says. ``reachable`` is its cheap first check, a TCP connect.
- error codes (mooncake-store ``ErrorCode``) and ``check_down``, which tells an expected outcome
  (not found, no space, a lease, a foreign size) from an unreachable master (``ServerDown``);
  ``foreign_size``, which tells a failed read of a value kvtier never wrote.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import socket
import threading
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.tiers.breaker import CircuitBreaker

log = logging.getLogger(__name__)

OBJECT_NOT_FOUND = -704
BUFFER_TOO_SMALL = -600  # the stored object is larger than our buffers: foreign
TRANSFER_FAIL = -800
RPC_FAIL = -900  # master unreachable
RPC_TIMEOUT = -901  # master hung or overloaded past rpc_timeout_s
NO_SPACE = -200
OBJECT_HAS_LEASE = -706
LEASE_EXPIRED = -707
_EXPECTED = frozenset(
    {OBJECT_NOT_FOUND, BUFFER_TOO_SMALL, TRANSFER_FAIL, NO_SPACE, OBJECT_HAS_LEASE, LEASE_EXPIRED}
)
_ENV_LOCK = threading.Lock()  # MC_RPC_TIMEOUT_MS is process-global: one setup at a time


class ServerDown(Exception):
    """Raised inside a breaker-guarded call when the master is unreachable."""


def package_binary(name: str) -> Path | None:
    """A binary shipped in the ``mooncake`` package (``mooncake_master``, ``mooncake_client``)."""
    spec = importlib.util.find_spec("mooncake")
    for loc in (spec.submodule_search_locations or []) if spec is not None else []:
        p = Path(loc) / name
        if p.is_file():
            return p
    return None


def master_endpoint(master: str) -> tuple[str, int] | None:
    """``(host, port)`` of a ``host:port`` (or ``[v6]:port``) master address; ``None`` for an
    address with a scheme (discovery, left to the client). ``ConfigError`` naming the value for
    anything else: such a master could never be reached, which is not an outage to wait out."""
    if "://" in master and not any(c.isspace() for c in master):
        return None
    host, _, port = master.rpartition(":")
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    if not host or any(c.isspace() or c in "/@[]" for c in host) or not port.isdigit():
        raise ConfigError(
            f"mooncake tier master {master!r}: expected 'host:port' of mooncake_master, "
            "e.g. '10.0.0.1:50051'"
        )
    if not 0 < int(port) < 65536:
        raise ConfigError(f"mooncake tier master {master!r}: port must be 1..65535")
    return host, int(port)


def reachable(endpoint: tuple[str, int] | None, timeout: float) -> bool:
    """Does something accept TCP connections at ``endpoint``? (``None``: cannot tell, True.)

    A dead master answers this at once (connection refused) and an unreachable host within
    ``timeout``; a hung master still accepts (its kernel does), so only an RPC can tell that.
    """
    if endpoint is None:
        return True
    try:
        with socket.create_connection(endpoint, timeout=timeout):
            return True
    except (OSError, UnicodeError):  # UnicodeError: a host name IDNA cannot encode
        return False


def connect(setup_args: Sequence[Any], rpc_timeout_s: float) -> tuple[Any, int]:
    """A ``MooncakeDistributedStore`` and its ``setup(*setup_args)`` return code (0 = ready).

    On a non-zero code the client is already closed. Never raises for an unreachable master.
    """
    os.environ.setdefault("MC_LOG_LEVEL", "WARNING")  # the client logs every call at INFO
    os.environ.setdefault("MC_STORE_CLIENT_SETUP_RETRIES", "1")  # else ~20 x 4 s when down
    from mooncake.store import MooncakeDistributedStore

    with _ENV_LOCK:  # the client reads its RPC timeout from the environment at setup
        os.environ["MC_RPC_TIMEOUT_MS"] = str(max(1, int(rpc_timeout_s * 1000)))
        client = MooncakeDistributedStore()
        rc = int(client.setup(*setup_args))
    if rc != 0:
        client.close()
    return client, rc


def check_down(client: Any, codes: Sequence[int], master: str) -> None:
    """Raise ``ServerDown`` if a code is an unexpected error and the master is unreachable.

    Expected outcomes (not found, no space, leases, a foreign size) never cost a ping.
    """
    odd = [c for c in codes if c < 0 and c not in _EXPECTED]
    # health_check() reflects the client's last heartbeat, so it can still say 0 right
    # after the master died; an RPC failure or timeout is taken at its word.
    if odd and (RPC_FAIL in odd or RPC_TIMEOUT in odd or client.health_check() != 0):
        raise ServerDown(f"master {master} unreachable (codes {sorted(set(odd))})")


def foreign_size(client: Any, name: str, code: int, value_bytes: int) -> bool:
    """Whether a failed read of object ``name`` (``code``) found a value of another size than
    ``value_bytes`` (a value kvtier never wrote).

    Too large reads as ``BUFFER_TOO_SMALL``; too small fails the transfer, which a lost
    segment also does, so only then is the size asked for (off the hot path).
    """
    if code >= 0 or code == BUFFER_TOO_SMALL:
        return True
    if code == TRANSFER_FAIL:
        size = int(client.get_size(name))
        return size >= 0 and size != value_bytes
    return False


class Prober:
    """Keeps a tier's master connection: the first setup, and every recovery, off the callers'
    threads.

    ``attempt`` (a method of the tier, held weakly: a dropped tier is not kept alive by its
    prober) sets up the client or, once there is one, asks the master one cheap question; it
    raises ``ServerDown`` while the master is unreachable. The prober runs it at ``start`` and,
    after a caller reported ``lost``, every ``breaker.cooldown_s`` until it returns; then ``up``
    is set again. Callers ask ``allow()`` first and get a miss at once while it is False
    (counted in ``skipped``), so an outage costs one caller one failed call. ``breaker`` logs
    and counts the outages (``trips``: one per outage, plus one per failed attempt); no caller
    makes its trials. A ``ConfigError`` from ``attempt`` is fatal: raised by ``start`` if it
    comes within its wait, logged otherwise; the tier then stays down. Thread-safe.
    """

    def __init__(self, name: str, attempt: Callable[[], None], breaker: CircuitBreaker) -> None:
        self.breaker = breaker
        self.up = threading.Event()
        #: calls answered with a miss because the master was known to be unreachable
        self.skipped = 0
        self._attempt = weakref.WeakMethod(attempt)
        self._cond = threading.Condition()
        self._closed = False
        self._fatal: ConfigError | None = None
        self._odd_logged = False  # an unknown attempt failure is logged once per outage
        self._first = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self, wait_s: float) -> None:
        """Start the thread; wait up to ``wait_s`` for its first attempt (raising its
        ``ConfigError``). The master may still come up later."""
        self._thread.start()
        self._first.wait(wait_s)
        if self._fatal is not None:
            self.close()
            raise self._fatal

    def allow(self) -> bool:
        """May a caller talk to the master now? ``False`` (counted) while it is unreachable."""
        if self.up.is_set():
            return True
        with self._cond:
            self.skipped += 1
        return False

    def lost(self, exc: BaseException) -> None:
        """A caller found the master unreachable: callers get misses until the prober is back."""
        with self._cond:
            if not self.up.is_set():
                return  # another caller already reported this outage
            self.up.clear()
            self.breaker.failed(exc)
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread (callers get misses from now on); waits for an attempt in flight,
        at most about one RPC timeout. Idempotent."""
        with self._cond:
            self._closed = True
            self.up.clear()
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        try:
            self._try()
        finally:
            self._first.set()
        while self._fatal is None:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self.up.is_set())
                self._cond.wait_for(lambda: self._closed, self.breaker.cooldown_s)
                if self._closed:
                    return
            self._try()

    def _try(self) -> None:
        attempt = self._attempt()
        if attempt is None:  # the tier is gone
            self._closed = True
            return
        try:
            attempt()
        except ConfigError as exc:
            log.error("%s: %s; the tier stays out of service", self.breaker.name, exc)
            self._fatal = exc
            return
        except Exception as exc:  # ServerDown, or the client failing in a way we do not know
            if not isinstance(exc, ServerDown) and not self._odd_logged:
                self._odd_logged = True
                log.warning("%s: reconnect attempt failed", self.breaker.name, exc_info=True)
            self.breaker.failed(exc)
            return
        with self._cond:
            if not self._closed:
                self.breaker.succeeded()
                self._odd_logged = False
                self.up.set()
