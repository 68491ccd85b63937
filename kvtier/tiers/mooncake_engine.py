"""The Mooncake client side of the Mooncake tier: connecting, keeping the master, error codes.

``kvtier.tiers.mooncake`` decides what to move; this module holds what it takes to talk to a
``MooncakeDistributedStore`` client from the PyPI wheel ``mooncake-transfer-engine-non-cuda``
(the memory a transfer moves -- staging, registrations -- is ``kvtier.tiers.mooncake_memory``):

- ``master_endpoint``: the master's ``host:port``, checked once (``ConfigError`` otherwise).
- ``connect``: create and set up a client with a bounded RPC timeout (the client reads it from
  the environment at setup, so setups are serialized) and without the wheel's ~20 setup retries.
- ``MasterLink``: a tier's client, lent to each call and counted, so that ``close`` never
  closes it under a call (the client crashes the process if it is); ``close`` is bounded.
- ``Prober``: the thread that connects and, while the master is unreachable, finds out when it
  answers again, so that no caller waits for that: the client's own reconnect costs ~4 s per
  call against a dead master (three connection attempts a second apart), whatever
  ``rpc_timeout_s`` says. ``reachable`` is its cheap first check, a TCP connect.
- error codes (mooncake-store ``ErrorCode``) and ``check_down``, which tells an expected outcome
  (not found, no space, a lease, a foreign size) from an unreachable master (``ServerDown``);
  ``foreign_size``, which tells a failed read of a value kvtier never wrote.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import os
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, TypeVar

from kvtier.errors import ConfigError
from kvtier.tiers.breaker import CircuitBreaker
from kvtier.tiers.mooncake_memory import Registrations, StagingArena

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
#: the least time between two reconnect attempts (``cooldown_s`` 0 would spin a core)
MIN_RETRY_S = 0.1
T = TypeVar("T")


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
        self.name = name
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

    def close(self, wait_s: float | None = None) -> bool:
        """Stop the thread (callers get misses from now on); wait up to ``wait_s`` seconds
        (None: until it ends) for an attempt in flight. True if the thread has ended.
        Idempotent."""
        with self._cond:
            self._closed = True
            self.up.clear()
            self._cond.notify_all()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(wait_s)
        return not self._thread.is_alive()

    def _run(self) -> None:
        try:
            self._try()
        finally:
            self._first.set()
        while self._fatal is None:
            with self._cond:
                self._cond.wait_for(lambda: self._closed or not self.up.is_set())
                self._cond.wait_for(lambda: self._closed, max(self.breaker.cooldown_s, MIN_RETRY_S))
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


class MasterLink:
    """A tier's client of one master: set up, and kept, by a ``Prober`` off the callers'
    threads; lent to each call, and counted while lent.

    ``call(fn, fallback)`` is ``fn(client)`` -- each call gets its own reference, open until
    ``fn`` returns -- or ``fallback`` at once while the master is known to be unreachable and
    after ``close``; ``fn`` raising ``ServerDown`` is ``fallback`` too and hands recovery to
    the prober. ``close`` closes the client only once neither a call nor the prober uses it: the
    client crashes the process when it is closed under a transfer. Thread-safe.
    """

    def __init__(
        self,
        master: str,
        setup_args: Sequence[Any],
        rpc_timeout_s: float,
        probe_key: str,
        staging: StagingArena,
        regs: Registrations,
        replicas: int,
        breaker: CircuitBreaker,
    ) -> None:
        self.master = master
        self.rpc_timeout_s = rpc_timeout_s
        self._endpoint = master_endpoint(master)
        self._setup_args = tuple(setup_args)
        self._probe_key = probe_key
        self._staging = staging
        self._regs = regs
        self._replicas = replicas
        #: the ``ReplicateConfig`` of puts (set with the client)
        self.replicate: Any = None
        self._client: Any = None
        self._closed = False
        self._users = 0
        self._lock = threading.Lock()
        self._idle = threading.Condition(self._lock)
        #: the thread closing the client when ``close`` could not wait for it (for tests)
        self.closer: threading.Thread | None = None
        self.prober = Prober(f"kvtier-mooncake-{master}", self._attempt, breaker)
        weakref.finalize(self, self.prober.close, rpc_timeout_s)  # dropped without close()

    def start(self) -> None:
        """Start the prober; wait up to ``rpc_timeout_s`` for the first setup (see ``Prober``)."""
        self.prober.start(self.rpc_timeout_s)

    @property
    def client(self) -> Any:
        """The set-up client (None before the first setup and after ``close``); unlent."""
        return self._client

    @contextlib.contextmanager
    def lend(self) -> Iterator[Any]:
        """The client (None before the first setup and after ``close``), kept open until the
        block ends."""
        with self._lock:
            client = None if self._closed else self._client
            if client is not None:
                self._users += 1
        try:
            yield client
        finally:
            if client is not None:
                with self._lock:
                    self._users -= 1
                    if not self._users:
                        self._idle.notify_all()

    def call(self, fn: Callable[[Any], T], fallback: T) -> T:
        """``fn(client)``; ``fallback`` while the master is unreachable, after ``close``, or
        when ``fn`` finds it unreachable (``ServerDown``, reported to the prober)."""
        if not self.prober.allow():
            return fallback
        with self.lend() as client:
            if client is None:
                return fallback
            try:
                return fn(client)
            except ServerDown as exc:
                self.prober.lost(exc)
                return fallback

    def _attempt(self) -> None:
        """The prober's work (never a caller's): set up the client, or ask the master one cheap
        question once there is one. Raises ``ServerDown`` while it is unreachable."""
        if not reachable(self._endpoint, self.rpc_timeout_s):
            raise ServerDown(f"master {self.master} does not accept connections")
        client = self._client
        if client is None:
            self._connect()
            return
        check_down(client, client.batch_is_exist([self._probe_key]), self.master)

    def _connect(self) -> None:
        """Create and set up the client; ``ServerDown`` if the master did not answer."""
        from mooncake.store import ReplicateConfig

        client, rc = connect(self._setup_args, self.rpc_timeout_s)
        if rc != 0:
            raise ServerDown(f"setup with master {self.master} returned {rc}")
        if client.register_buffer(self._staging.base, self._staging.arena.nbytes) != 0:
            client.close()
            raise ConfigError("mooncake tier: the transfer engine refused the staging buffer")
        cfg = ReplicateConfig()
        cfg.replica_num = self._replicas
        with self._lock:
            if not self._closed:
                self.replicate, self._client = cfg, client
                return
        # closed while setting up: the client never served
        client.unregister_buffer(self._staging.base)
        client.close()

    def close(self) -> None:
        """Stop the prober; from now on calls are misses. Close the client once no call uses
        it (its mounted segment leaves the pool with it). Returns within about
        ``rpc_timeout_s`` plus the client's own close when the master answers (~1-2 s), at
        once when it is known down. When the master does not answer (known down, or a call,
        the prober or one last question stuck on it), a daemon thread closes the client once
        it answers again: the client's close against a silent master retries for ~4-20 s
        holding the GIL, which would stall every thread of the process. (If the master never
        returns, the client is left open.) Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
        was_up = self.prober.up.is_set()
        wait_s = self.rpc_timeout_s if was_up else 0.0  # known down: the closer thread waits
        deadline = time.monotonic() + wait_s
        settled = self.prober.close(wait_s)
        with self._lock:
            left = max(0.0, deadline - time.monotonic())
            settled = self._idle.wait_for(lambda: not self._users, left) and settled
            client, self._client = self._client, None
        if client is None:
            return
        if settled and was_up and self._answers(client):
            self._release(client)
            return
        log.warning(
            "%s: closed while the master does not answer; its client is closed once it does",
            self.prober.breaker.name,
        )
        self.closer = threading.Thread(
            target=self._release,
            args=(client, True),
            name=f"{self.prober.name}-close",
            daemon=True,
        )
        self.closer.start()

    def _answers(self, client: Any) -> bool:
        """Does the master answer one cheap question (within ``rpc_timeout_s``)? The question
        releases the GIL while it waits; the client's close does not."""
        if not reachable(self._endpoint, self.rpc_timeout_s):
            return False
        try:
            check_down(client, client.batch_is_exist([self._probe_key]), self.master)
        except ServerDown:
            return False
        return True

    def _release(self, client: Any, when_answering: bool = False) -> None:
        """Close ``client`` once the prober and every call are done with it (and, with
        ``when_answering``, once the master answers)."""
        self.prober.close()
        with self._lock:
            self._idle.wait_for(lambda: not self._users)
        while when_answering and not self._answers(client):
            time.sleep(max(self.prober.breaker.cooldown_s, MIN_RETRY_S))
        client.unregister_buffer(self._staging.base)
        self._regs.unpin_all(client)
        client.close()
