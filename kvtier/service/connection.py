"""``Connection``: a client's session with ``kvtier serve`` -- the socket, the heartbeat, calls.

``Connection(url, identity=...)`` opens a ZeroMQ DEALER socket, says ``hello`` (registering the
engine's ``Identity``, from which the service derives every key, and its layout, which picks
the service's pool), maps the session's staging region and, in arena mode, the host arena of
that pool. ``call`` sends one request and
waits for its reply; ``start``/``finish`` let a transfer keep several in flight.

Failure: every call waits at most ``timeout`` seconds. A service that is down, restarting or
stalled makes a call return ``None`` (the caller serves a miss), never an exception or a hang;
after a timeout the session is dropped (an abandoned call may still write into its staging
region) and a background thread reconnects, with a new session, when the service answers
again. The same thread sends a heartbeat every quarter of the lease TTL, so the service keeps
the session's leases and transfers while this process lives. Caller mistakes the service found
raise the same ``TokenError``/``LayoutError``/``ConfigError`` as in-process.

Thread-safe: ``lock`` serialises the calls of one connection (one staging region).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

import zmq

from kvtier.errors import ConfigError, KVTierError, LayoutError
from kvtier.identity import Identity
from kvtier.layout import KVLayout
from kvtier.service.presence import PresenceMap
from kvtier.service.protocol import VERSION, endpoint, pack, raise_error, socket_path, unpack
from kvtier.service.staging import Staging
from kvtier.tiers.shm import SharedMemory

log = logging.getLogger(__name__)
_RETRY_S = 0.5  # how often a client whose service is down tries to reconnect
LONG_TOKEN_BYTES = 1 << 16  # token ids this long go in their own frame, or the token area


@dataclass(slots=True)
class Link:
    """One registered session: its socket, id, mapped staging region and (arena mode) the
    service's host arena."""

    sock: zmq.Socket[bytes]
    sid: bytes
    staging: Staging
    lease_ttl: float
    arena: SharedMemory | None = None
    presence: PresenceMap | None = None
    #: key roots of the scopes asked about, by (tenant, adapter, salt) (``None``: the session's)
    roots: dict[tuple[Any, ...], bytes] = field(default_factory=dict)
    poller: zmq.Poller = field(default_factory=zmq.Poller)  # kept: a poll builds none

    def __post_init__(self) -> None:
        self.poller.register(self.sock, zmq.POLLIN)

    def close(self) -> None:
        self.sock.close(0)
        self.staging.close()
        if self.arena is not None:
            self.arena.close()
        if self.presence is not None:
            self.presence.close()


class Connection:
    """A session with a kvtier service, renewed and re-made as needed. See the module doc."""

    def __init__(
        self,
        url: str,
        *,
        identity: Identity | None = None,
        tenant: str | None = None,
        layout: KVLayout | None = None,
        timeout: float = 5.0,
        name: str = "",
        direct: bool = True,
        presence: bool = True,
    ) -> None:
        """``direct``: map the service's host arena when it offers it (else always stage);
        ``presence``: its presence map (else every lookup is a round trip)."""
        self.url = url
        self.direct = direct
        self.presence = presence
        self._endpoint = endpoint(url)
        path = socket_path(url)
        if os.path.lexists(path) and not os.access(path, os.W_OK):
            st = os.stat(path)
            raise ConfigError(
                f"no permission to connect to {path} (mode {st.st_mode & 0o777:o}, uid "
                f"{st.st_uid}, gid {st.st_gid}): run as its owner, or set [service] group and "
                "add this user to it"
            )
        if identity is not None and not isinstance(identity, Identity):
            raise ConfigError(f"identity: expected a kvtier Identity, got {identity!r}")
        if not (isinstance(timeout, int | float) and timeout > 0):
            raise ConfigError(f"timeout: expected seconds > 0, got {timeout!r}")
        self.identity = identity
        self.timeout = float(timeout)
        self.name = name
        self._tenant = tenant
        self.tenant = tenant or "default"
        self._layout = layout
        self._ctx = zmq.Context()
        self._lock = threading.RLock()
        self._link: Link | None = None
        self._next_id = 0
        self._inflight: set[int] = set()  # ids of requests sent and not yet answered
        self._stash: dict[int, dict[str, Any]] = {}  # their replies, arrived out of turn
        self._restarted = False  # the last _finish found the session gone and made a new one
        self._last_ok = 0.0
        self._closed = threading.Event()
        self.counters = {"connects": 0, "timeouts": 0, "down_calls": 0, "local_misses": 0}
        #: misses answered from the presence map, by tenant: [lookups, tokens, loads, tokens]
        self._local_misses: dict[str, list[int]] = {}
        try:
            self._install(self._hello())
        except BaseException:  # a mismatch the caller must fix: nothing left running
            self._ctx.destroy(linger=0)
            raise
        self._beat = threading.Thread(target=self._heartbeat, name="kvtier-client", daemon=True)
        self._beat.start()

    @property
    def link(self) -> Link | None:
        """The current session (``None`` while the service is unreachable). Read under
        ``lock`` when it is used for more than one request."""
        return self._link

    @property
    def lock(self) -> threading.RLock:
        """Held for a whole call: one call at a time uses the session's staging region."""
        return self._lock

    @property
    def restarted(self) -> bool:
        """The last ``await_reply`` found the session gone and made a new one (its call may be
        resent from scratch)."""
        return self._restarted

    def clear_restarted(self) -> None:
        self._restarted = False

    @property
    def layout(self) -> KVLayout:
        """The service's layout; ``ConfigError`` if it was never reached and none was given."""
        if self._layout is None:
            raise ConfigError(
                f"the kvtier service at {self.url} has not answered yet, so its layout is "
                "unknown: start `kvtier serve`, or pass layout= to connect"
            )
        return self._layout

    @property
    def connected(self) -> bool:
        return self._link is not None

    def _request_id(self) -> int:
        self._next_id += 1
        return self._next_id

    @staticmethod
    def _send(sock: zmq.Socket[bytes], req: dict[str, Any], tokens: bytes | None) -> None:
        if tokens is None or len(tokens) < LONG_TOKEN_BYTES:  # one small frame
            if tokens is not None:
                req["tokens"] = tokens
            sock.send(pack(req))
        else:  # the token ids as a frame of their own, not copied into the header
            sock.send_multipart([pack(req), tokens], copy=False)

    def _recv(
        self,
        sock: zmq.Socket[bytes],
        req_id: int,
        timeout: float,
        poller: zmq.Poller | None = None,
    ) -> dict[str, Any] | None:
        """The reply to ``req_id``, ``None`` after ``timeout`` s. Replies to other calls in
        flight are kept for their own ``_recv``; replies to abandoned calls are dropped.
        ``poller``: one with ``sock`` registered (cheaper than ``sock.poll``)."""
        reply = self._stash.pop(req_id, None)
        if reply is not None:
            return reply
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ms = int(left * 1000) + 1
            if not (poller.poll(ms) if poller is not None else sock.poll(ms, zmq.POLLIN)):
                return None
            try:
                got = unpack(sock.recv())
            except ValueError:
                continue
            got_id = got.get("id")
            if got_id == req_id:
                return got
            if got_id in self._inflight:
                self._stash[got_id] = got

    def _roundtrip(
        self, sock: zmq.Socket[bytes], req: dict[str, Any], tokens: bytes | None, timeout: float
    ) -> dict[str, Any] | None:
        """Send ``req`` and wait for its reply; ``None`` after ``timeout`` seconds."""
        self._send(sock, req, tokens)
        return self._recv(sock, req["id"], timeout)

    def _hello(self) -> Link | None:
        """Register a session on a fresh socket; ``None`` if the service does not answer."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        req: dict[str, Any] = {
            "op": "hello",
            "id": -1,  # hello's ids are negative: never those of calls (from 1) in flight
            "version": VERSION,
            "identity": None if self.identity is None else _fields(self.identity),
            "tenant": self._tenant,
            # the service binds the session to the pool of this layout (none: its default)
            "layout": None if self._layout is None else asdict(self._layout),
            "pid": os.getpid(),
            "name": self.name,
        }
        staging: Staging | None = None
        arena: SharedMemory | None = None
        presence: PresenceMap | None = None
        try:
            reply = self._roundtrip(sock, req, None, self.timeout)
            if reply is None:
                sock.close(0)
                return None
            if "error" in reply:
                raise_error(reply)
                raise ConfigError(f"the service refused the session: {reply.get('message')}")
            layout = KVLayout(**reply["layout"])
            if self._layout is not None and layout != self._layout:
                raise LayoutError(
                    f"the kvtier service at {self.url} stores {layout}, this engine has "
                    f"{self._layout}: point it at a service configured for this model"
                )
            if reply["kv_bytes"] < layout.block_bytes:
                raise ConfigError(
                    f"[service] staging ({reply['kv_bytes']} bytes) is smaller than one "
                    f"block ({layout.block_bytes} bytes): raise it"
                )
            staging = Staging.attach(reply["staging"], reply["staging_bytes"], reply["kv_bytes"])
            arena = self._map_arena(reply)
            presence = self._map_presence(reply)
            sid = reply["sid"]
            done = self._roundtrip(sock, {"op": "attach", "id": -2, "sid": sid}, None, self.timeout)
            if done is None or "error" in done:
                raise OSError("the service did not confirm the staging region")
        except BaseException as exc:
            sock.close(0)
            if staging is not None:
                staging.close()
            if arena is not None:
                arena.close()
            if presence is not None:
                presence.close()
            if isinstance(exc, OSError | KeyError | TypeError):
                log.warning("kvtier service at %s: cannot set up a session: %s", self.url, exc)
                return None
            raise
        self._layout = layout
        self.tenant = reply["tenant"]
        self.identity = Identity(**reply["identity"])  # what the service keys our blocks by
        link = Link(sock, sid, staging, float(reply["lease_ttl"]), arena, presence)
        if presence is not None and isinstance(reply.get("root"), bytes):
            link.roots[(None, None, None)] = link.roots[(self.tenant, None, None)] = reply["root"]
        return link

    def _map_presence(self, reply: dict[str, Any]) -> PresenceMap | None:
        """The service's presence map (``None`` when it offers none, or it cannot be mapped:
        then every lookup asks the service)."""
        path = reply.get("presence")
        if not path or not self.presence:
            return None
        try:
            return PresenceMap.attach(str(path), int(reply["presence_bytes"]))
        except (OSError, ValueError) as exc:
            log.warning("kvtier service at %s: cannot map its presence map (%s)", self.url, exc)
            return None

    def _map_arena(self, reply: dict[str, Any]) -> SharedMemory | None:
        """The service's host arena, mapped (arena mode); ``None`` in staging mode or when this
        process may not map it (then transfers go through the staging region)."""
        path = reply.get("arena")
        if not path or not self.direct:
            return None
        try:
            # populated: a copy into a slot this process never touched costs no page faults
            return SharedMemory.attach(str(path), int(reply["arena_bytes"]), populate=True)
        except OSError as exc:
            log.warning(
                "kvtier service at %s: cannot map its host arena (%s); moving KV through the "
                "staging region instead (two copies per direction)",
                self.url,
                exc,
            )
            return None

    def _install(self, link: Link | None) -> None:
        with self._lock:
            if self._link is not None:
                self._link.close()
            self._link = link
            if link is not None:
                self.counters["connects"] += 1
                self._last_ok = time.monotonic()

    def _drop(self, why: str) -> None:
        """Forget the session (under the lock): misses until the heartbeat reconnects."""
        if self._link is not None:
            log.warning("kvtier service at %s: %s; serving misses until it is back", self.url, why)
            self._link.close()
            self._link = None
            self._inflight.clear()
            self._stash.clear()

    def _heartbeat(self) -> None:
        while not self._closed.wait(_RETRY_S if self._link is None else self._beat_s()):
            if self._link is None:
                try:
                    link = self._hello()
                except Exception as exc:  # a config mismatch: keep serving misses, say why
                    log.error("kvtier service at %s: %s", self.url, exc)
                    continue
                if link is not None and not self._closed.is_set():
                    self._install(link)
                elif link is not None:
                    link.close()
            elif time.monotonic() - self._last_ok >= self._beat_s() / 2:
                self.call("ping", {})

    def _beat_s(self) -> float:
        """Seconds between heartbeats: a quarter of the lease TTL, so three can be late (a
        busy machine descheduling this process) before the service gives up on us."""
        link = self._link
        return (link.lease_ttl if link else 3.0) / 4

    def call(
        self, op: str, fields: dict[str, Any], tokens: bytes | None = None
    ) -> dict[str, Any] | None:
        """One request on the current session; its reply, or ``None`` (a miss) when the
        service is down or does not answer in time. Raises the caller's mistakes."""
        with self._lock:
            for _ in range(2):  # once more on a new session if the service had restarted
                self.clear_restarted()
                req_id = self.send_request(op, dict(fields), tokens)
                reply = None if req_id is None else self.await_reply(op, req_id)
                if reply is not None or not self._restarted:
                    return reply
            return None

    def call_once(
        self, op: str, fields: dict[str, Any], tokens: bytes | None
    ) -> dict[str, Any] | None:
        """One request, never resent (it names this session's staging region)."""
        req_id = self.send_request(op, fields, tokens)
        return None if req_id is None else self.await_reply(op, req_id)

    def send_request(self, op: str, fields: dict[str, Any], tokens: bytes | None) -> int | None:
        """Send one request (under the lock); its id, or ``None`` when not connected. Long
        token ids go through the staging token area (shared memory beats a socket frame)."""
        link = self._link
        if link is None:
            self.counters["down_calls"] += 1
            return None
        req = {"op": op, "id": self._request_id(), "sid": link.sid, **fields}
        if self._local_misses:  # reported with the next call, whatever it is
            req["lm"] = [[t, *c] for t, c in self._local_misses.items()]
            self._local_misses = {}
        if (
            tokens is not None
            and len(tokens) >= LONG_TOKEN_BYTES
            and link.staging.put_tokens(tokens)
        ):
            req["tok"] = len(tokens) // 4
            tokens = None
        self._send(link.sock, req, tokens)
        self._inflight.add(req["id"])
        return int(req["id"])

    def notify(self, op: str, fields: dict[str, Any]) -> None:
        """Send a report whose reply no one waits for (dropped when it comes), under the lock:
        the service handles a session's requests in order, so the next call finds it done."""
        req_id = self.send_request(op, fields, None)
        if req_id is not None:
            self._inflight.discard(req_id)

    def await_reply(self, op: str, req_id: int) -> dict[str, Any] | None:
        """The reply to a request ``_start`` sent (under the lock); ``None`` for a miss."""
        link = self._link
        if link is None:  # dropped while this call was in flight
            self._inflight.discard(req_id)
            return None
        reply = self._recv(link.sock, req_id, self.timeout, link.poller)
        self._inflight.discard(req_id)
        if reply is None:
            self.counters["timeouts"] += 1
            # the abandoned call may still write into this staging region: a new one
            self._drop(f"{op} timed out after {self.timeout:g} s")
            return None
        self._last_ok = time.monotonic()
        if "error" in reply:
            if reply["error"] == "session":
                # the service restarted (or expired us): a new session now, so the next
                # call is served; this one is a miss unless _call can resend it
                self._drop("the service restarted")
                try:
                    self._install(self._hello())
                except KVTierError as exc:  # e.g. restarted with another layout: misses
                    log.error("kvtier service at %s: %s", self.url, exc)
                self._restarted = self._link is not None
                return None
            raise_error(reply)
            log.warning("kvtier service: %s failed: %s", op, reply.get("message"))
            return None
        return reply

    def drain(self, op: str, ids: Iterable[int]) -> None:
        """Wait out requests still in flight (their staging slice is reused next)."""
        for req_id in ids:
            with contextlib.suppress(KVTierError):
                self.await_reply(op, req_id)

    def close(self) -> None:
        """End the session (its leases are released) and the heartbeat. Idempotent."""
        if self._closed.is_set():
            return
        self._closed.set()
        self._beat.join(timeout=self.timeout + 1)
        with self._lock:
            if self._link is not None:
                with contextlib.suppress(Exception):
                    link = self._link
                    self._roundtrip(
                        link.sock,
                        {"op": "bye", "id": self._request_id(), "sid": link.sid},
                        None,
                        min(self.timeout, 1.0),
                    )
                self._link.close()
                self._link = None
        self._ctx.term()


def _fields(identity: Identity) -> dict[str, Any]:
    return identity.describe()
