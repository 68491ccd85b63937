"""``ServiceClient``: the engine side of ``kvtier serve`` -- the ``TieredStore`` API over a socket.

``connect(url, identity=...)`` registers the engine's ``Identity`` (the service derives every key
from it; a client never sends a key) and maps the session's shared staging region. Then
``lookup/load/store/prefetch/lease/pin/stats/flush`` take the same arguments and return the same
values as ``TieredStore``'s.

Data path: a ``store`` copies the KV into the staging region and the service's store copies it
from there into the host tier; a ``load`` is the reverse. An engine that gathers its pages
straight into ``buffer(tokens)`` (a view of the staging region) and passes that buffer saves the
staging copy: the service reads (or fills) it in place. Transfers larger than the region go in
block-aligned chunks.

Failure: every call waits at most ``timeout`` seconds. A service that is down, restarting or
stalled makes calls misses (``lookup``/``load`` return ``start``, ``store`` returns 0, a lease holds
nothing), never an exception or a hang; a background thread keeps the session alive
(heartbeat) and reconnects when the service is back. Caller mistakes (bad tokens, a wrong
array, a bad tenant) raise the same ``TokenError``/``LayoutError``/``ConfigError`` as in-process.

Thread-safe: calls of one client are serialised (one staging region).
"""

from __future__ import annotations

import contextlib
import logging
import os
import threading
import time
from collections import deque
from collections.abc import Callable, Hashable, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import zmq

from kvtier.errors import ConfigError, KVTierError, LayoutError
from kvtier.identity import Identity
from kvtier.keys import TokenIds
from kvtier.kvarray import host_array
from kvtier.layout import KVLayout
from kvtier.lease import Lease
from kvtier.service.protocol import VERSION, endpoint, pack, raise_error, socket_path, unpack
from kvtier.service.staging import Staging
from kvtier.tiers.base import Array

log = logging.getLogger(__name__)
_RETRY_S = 0.5  # how often a client whose service is down tries to reconnect
_ZERO_COPY_BYTES = 1 << 16
_PROBE_BLOCKS = 16  # a lookup first sends this many blocks' tokens (a miss is cheap)
_DEPTH = 4  # staging slices (chunks in flight) of a transfer larger than its region


@dataclass(slots=True)
class _Link:
    """One registered session: its socket, id and mapped staging region."""

    sock: zmq.Socket[bytes]
    sid: bytes
    staging: Staging
    lease_ttl: float

    def close(self) -> None:
        self.sock.close(0)
        self.staging.close()


class ServiceClient:
    """A connection to a kvtier service with ``TieredStore``'s API. Use ``connect``."""

    def __init__(
        self,
        url: str,
        *,
        identity: Identity | None = None,
        tenant: str | None = None,
        layout: KVLayout | None = None,
        timeout: float = 5.0,
        name: str = "",
    ) -> None:
        self.url = url
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
        self._link: _Link | None = None
        self._next_id = 0
        self._inflight: set[int] = set()  # ids of requests sent and not yet answered
        self._stash: dict[int, dict[str, Any]] = {}  # their replies, arrived out of turn
        self._restarted = False  # the last _finish found the session gone and made a new one
        self._last_ok = 0.0
        self._closed = threading.Event()
        self.counters = {"connects": 0, "timeouts": 0, "down_calls": 0}
        try:
            self._install(self._hello())
        except BaseException:  # a mismatch the caller must fix: nothing left running
            self._ctx.destroy(linger=0)
            raise
        self._beat = threading.Thread(target=self._heartbeat, name="kvtier-client", daemon=True)
        self._beat.start()

    # -- connection ------------------------------------------------------------------------
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
        if tokens is None or len(tokens) < _ZERO_COPY_BYTES:  # one small frame
            if tokens is not None:
                req["tokens"] = tokens
            sock.send(pack(req))
        else:  # the token ids as a frame of their own, not copied into the header
            sock.send_multipart([pack(req), tokens], copy=False)

    def _recv(self, sock: zmq.Socket[bytes], req_id: int, timeout: float) -> dict[str, Any] | None:
        """The reply to ``req_id``, ``None`` after ``timeout`` s. Replies to other calls in
        flight are kept for their own ``_recv``; replies to abandoned calls are dropped."""
        reply = self._stash.pop(req_id, None)
        if reply is not None:
            return reply
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not sock.poll(int(left * 1000) + 1, zmq.POLLIN):
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

    def _hello(self) -> _Link | None:
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
            "pid": os.getpid(),
            "name": self.name,
        }
        staging: Staging | None = None
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
            sid = reply["sid"]
            done = self._roundtrip(sock, {"op": "attach", "id": -2, "sid": sid}, None, self.timeout)
            if done is None or "error" in done:
                raise OSError("the service did not confirm the staging region")
        except BaseException as exc:
            sock.close(0)
            if staging is not None:
                staging.close()
            if isinstance(exc, OSError | KeyError | TypeError):
                log.warning("kvtier service at %s: cannot set up a session: %s", self.url, exc)
                return None
            raise
        self._layout = layout
        self.tenant = reply["tenant"]
        self.identity = Identity(**reply["identity"])  # what the service keys our blocks by
        return _Link(sock, sid, staging, float(reply["lease_ttl"]))

    def _install(self, link: _Link | None) -> None:
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
                self._call("ping", {})

    def _beat_s(self) -> float:
        """Seconds between heartbeats: a quarter of the lease TTL, so three can be late (a
        busy machine descheduling this process) before the service gives up on us."""
        link = self._link
        return (link.lease_ttl if link else 3.0) / 4

    def _call(
        self, op: str, fields: dict[str, Any], tokens: bytes | None = None
    ) -> dict[str, Any] | None:
        """One request on the current session; its reply, or ``None`` (a miss) when the
        service is down or does not answer in time. Raises the caller's mistakes."""
        with self._lock:
            for _ in range(2):  # once more on a new session if the service had restarted
                self._restarted = False
                req_id = self._start(op, dict(fields), tokens)
                reply = None if req_id is None else self._finish(op, req_id)
                if reply is not None or not self._restarted:
                    return reply
            return None

    def _once(self, op: str, fields: dict[str, Any], tokens: bytes | None) -> dict[str, Any] | None:
        """One request, never resent (it names this session's staging region)."""
        req_id = self._start(op, fields, tokens)
        return None if req_id is None else self._finish(op, req_id)

    def _start(self, op: str, fields: dict[str, Any], tokens: bytes | None) -> int | None:
        """Send one request (under the lock); its id, or ``None`` when not connected. Long
        token ids go through the staging token area (shared memory beats a socket frame)."""
        link = self._link
        if link is None:
            self.counters["down_calls"] += 1
            return None
        req = {"op": op, "id": self._request_id(), "sid": link.sid, **fields}
        if (
            tokens is not None
            and len(tokens) >= _ZERO_COPY_BYTES
            and link.staging.put_tokens(tokens)
        ):
            req["tok"] = len(tokens) // 4
            tokens = None
        self._send(link.sock, req, tokens)
        self._inflight.add(req["id"])
        return int(req["id"])

    def _finish(self, op: str, req_id: int) -> dict[str, Any] | None:
        """The reply to a request ``_start`` sent (under the lock); ``None`` for a miss."""
        link = self._link
        if link is None:  # dropped while this call was in flight
            self._inflight.discard(req_id)
            return None
        reply = self._recv(link.sock, req_id, self.timeout)
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

    # -- helpers ---------------------------------------------------------------------------
    def _scope(
        self, tenant: str | None, adapter: str | None, salt: str | bytes | None, start: int
    ) -> dict[str, Any]:
        return {"tenant": tenant, "adapter": adapter, "salt": salt, "start": start}

    def _check_start(self, start: object, n_tokens: int) -> int:
        bt = self.layout.block_tokens
        if isinstance(start, bool) or not isinstance(start, int) or start < 0 or start % bt:
            raise LayoutError(
                f"start must be a non-negative multiple of block_tokens ({bt}), got {start!r}"
            )
        if start > n_tokens:
            raise LayoutError(f"start {start} is past the {n_tokens} tokens given")
        return start

    def _slices(self, link: _Link) -> tuple[int, int]:
        """(tokens per chunk, chunks in flight) of a transfer through the staging region: up
        to ``_DEPTH`` slices of it, so the client's copies overlap the service's (on other
        cores) and a call's first chunk starts moving before its last is copied."""
        lay = self.layout
        blocks = link.staging.kv_bytes // lay.block_bytes
        depth = max(1, min(_DEPTH, blocks))
        return (blocks // depth) * lay.block_tokens, depth

    def _token_fields(
        self, link: _Link, raw: bytes
    ) -> Callable[[int], tuple[dict[str, Any], bytes | None]]:
        """For a chunked call over ``raw`` token ids: long ids are put in the token area
        once, and each chunk names how many of them it covers."""
        if len(raw) >= _ZERO_COPY_BYTES and link.staging.put_tokens(raw):
            return lambda count: ({"tok": count}, None)
        return lambda count: ({}, raw[: 4 * count])

    def _drain(self, op: str, ids: Iterable[int]) -> None:
        """Wait out requests still in flight (their staging slice is reused next)."""
        for req_id in ids:
            with contextlib.suppress(KVTierError):
                self._finish(op, req_id)

    def _store_chunks(
        self, link: _Link, arr: Array, raw: bytes, scope: dict[str, Any], start: int, have: int
    ) -> int:
        """Store ``arr`` (not in the staging region) in chunks, several in flight (under the
        lock): the client fills one slice while the service stores from the others."""
        lay = self.layout
        step, depth = self._slices(link)
        tokens_of = self._token_fields(link, raw)
        pending: deque[int] = deque()
        held: list[int] = []  # leases on the chunks stored so far, until the call ends
        written = 0

        def done(reply: dict[str, Any] | None) -> bool:
            nonlocal written
            if reply is None:
                return False
            written += int(reply["written"])
            if "lid" in reply:
                held.append(int(reply["lid"]))
            return True

        try:
            for k, pos in enumerate(range(0, have, step)):
                # the slice chunk k uses is free once chunk k - depth is stored
                if len(pending) == depth and not done(self._finish("store", pending.popleft())):
                    return written
                n = min(step, have - pos)
                off = (k % depth) * step * lay.bytes_per_token
                np.copyto(link.staging.view(lay, off, n), arr[:, :, pos : pos + n])
                extra, toks = tokens_of(start + pos + n)
                fields = {**scope, "start": start + pos, "off": off, "n": n, **extra}
                req_id = self._start("store", {**fields, "hold": pos + n < have}, toks)
                if req_id is None:
                    return written
                pending.append(req_id)
            while pending:
                if not done(self._finish("store", pending.popleft())):
                    return written
            return written
        finally:
            self._drain("store", pending)
            if held and self._link is link:
                self._call("release", {"lids": held})

    def _load_chunks(
        self, link: _Link, arr: Array, raw: bytes, scope: dict[str, Any], start: int, want: int
    ) -> int:
        """Load into ``arr`` (not in the staging region) in chunks, several in flight (under the
        lock): the service fills slices while the client copies another out."""
        lay = self.layout
        step, depth = self._slices(link)
        tokens_of = self._token_fields(link, raw)
        chunks = list(range(0, want, step))
        pending: deque[int] = deque()

        def ask(k: int) -> bool:
            pos = chunks[k]
            n = min(step, want - pos)
            extra, toks = tokens_of(start + pos + n)
            off = (k % depth) * step * lay.bytes_per_token
            req_id = self._start(
                "load", {**scope, "start": start + pos, "off": off, "n": n, **extra}, toks
            )
            if req_id is not None:
                pending.append(req_id)
            return req_id is not None

        end = start
        try:
            for k in range(min(depth, len(chunks))):
                if not ask(k):
                    return end
            for k, pos in enumerate(chunks):
                reply = self._finish("load", pending.popleft())
                if reply is None:
                    return end
                n = min(step, want - pos)
                got = int(reply["end"]) - (start + pos)
                if got > 0:
                    off = (k % depth) * step * lay.bytes_per_token
                    src = link.staging.view(lay, off, n)[:, :, :got]
                    np.copyto(arr[:, :, pos : pos + got], src)
                end = start + pos + got
                if got < n:  # a miss ends the prefix; what a later chunk found is not used
                    return end
                if k + depth < len(chunks) and not ask(k + depth):
                    return end
            return end
        finally:
            self._drain("load", pending)

    def buffer(self, tokens: int) -> Array:
        """A KV array for ``tokens`` tokens in the staging region (``None``-free: raises
        ``ConfigError`` when the service is unreachable or the region is too small). A
        ``store`` of it or a ``load`` into it makes no staging copy. Its contents are valid
        until the next ``load``/``store`` of another array, and only for this session."""
        link = self._link
        if link is None:
            raise ConfigError(f"the kvtier service at {self.url} is not connected")
        if tokens * self.layout.bytes_per_token > link.staging.kv_bytes:
            raise ConfigError(
                f"{tokens} tokens do not fit the {link.staging.kv_bytes}-byte staging region; "
                "raise [service] staging"
            )
        return link.staging.view(self.layout, 0, tokens)

    # -- the store API -----------------------------------------------------------------------
    def lookup(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> int:
        """As ``TieredStore.lookup``; ``start`` when the service is unreachable.

        A long prompt is asked about in two steps: its first ``_PROBE_BLOCKS`` blocks after
        ``start``, then (only if they are all cached) the whole prompt, so a miss does not pay
        for converting and sending every token id."""
        toks = TokenIds(tokens)
        self._check_start(start, len(toks))
        scope = self._scope(tenant, adapter, salt, start)
        probe = start + _PROBE_BLOCKS * self.layout.block_tokens
        if len(toks) > probe:
            reply = self._call("lookup", scope, toks.chunk(0, probe))
            if reply is None or int(reply["end"]) < probe:
                return start if reply is None else int(reply["end"])
        reply = self._call("lookup", scope, toks.chunk(0, len(toks)))
        return start if reply is None else int(reply["end"])

    def locate(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> list[str]:
        """As ``TieredStore.locate``; ``[]`` when the service is unreachable."""
        toks = TokenIds(tokens)
        self._check_start(start, len(toks))
        reply = self._call(
            "locate", self._scope(tenant, adapter, salt, start), toks.chunk(0, len(toks))
        )
        return [] if reply is None else [str(t) for t in reply["tiers"]]

    def prefetch(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> int:
        """As ``TieredStore.prefetch``; 0 when the service is unreachable."""
        toks = TokenIds(tokens)
        self._check_start(start, len(toks))
        reply = self._call(
            "prefetch", self._scope(tenant, adapter, salt, start), toks.chunk(0, len(toks))
        )
        return 0 if reply is None else int(reply["tokens"])

    def load(
        self,
        tokens: Any,
        out: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> int:
        """As ``TieredStore.load``: fill ``out`` from ``start``, return the absolute end
        (``start`` when nothing, or when the service is unreachable)."""
        lay = self.layout
        toks = TokenIds(tokens)
        arr = host_array(out, lay, "out", writable=True)
        self._check_start(start, len(toks))
        bt = lay.block_tokens
        want = (len(toks) // bt) * bt - start
        if arr.shape[2] < want:
            raise LayoutError(
                f"out holds {arr.shape[2]} tokens but the {len(toks)} tokens given cover "
                f"{want} tokens of full blocks from {start}; pass a larger out or "
                f"tokens[:{start + arr.shape[2]}]"
            )
        raw = toks.chunk(0, start + want)
        scope = self._scope(tenant, adapter, salt, start)
        with self._lock:
            end = start
            for _ in range(2):  # once more, from scratch, on a new session after a restart
                self._restarted = False
                link = self._link
                if link is None or want <= 0:
                    self.counters["down_calls"] += link is None
                    return start
                off = link.staging.offset_of(arr)
                if off is not None:  # the engine gathered into our buffer: no staging copy
                    # never resent: after a restart the buffer is not in the new region
                    reply = self._once("load", {**scope, "off": off, "n": arr.shape[2]}, raw)
                    return start if reply is None else int(reply["end"])
                end = self._load_chunks(link, arr, raw, scope, start, want)
                if not self._restarted:
                    break
            return end

    def store(
        self,
        tokens: Any,
        kv: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
        reuse_class: Hashable | None = None,
    ) -> int:
        """As ``TieredStore.store``: store the full blocks of ``kv`` (covering
        ``tokens[start:]``), return the tokens written (0 when the service is unreachable)."""
        lay = self.layout
        toks = TokenIds(tokens)
        arr = host_array(kv, lay, "kv")
        self._check_start(start, len(toks))
        if start + arr.shape[2] > len(toks):
            raise LayoutError(
                f"kv covers {arr.shape[2]} tokens from {start} but only {len(toks)} token ids "
                "were given"
            )
        if not (reuse_class is None or isinstance(reuse_class, str | int | tuple)):
            raise ConfigError(
                f"reuse_class: over the service a str, int or tuple, got {reuse_class!r}"
            )
        toks.validate()
        bt = lay.block_tokens
        have = (arr.shape[2] // bt) * bt
        raw = toks.chunk(0, start + have)
        scope = {**self._scope(tenant, adapter, salt, start), "reuse_class": reuse_class}
        with self._lock:
            written = 0
            for _ in range(2):  # once more, from scratch, on a new session after a restart
                self._restarted = False
                link = self._link
                if link is None or have == 0:
                    self.counters["down_calls"] += link is None
                    return 0
                off = link.staging.offset_of(arr)
                if off is not None:  # the engine gathered into our buffer: no staging copy
                    # never resent: after a restart the buffer is not in the new region
                    reply = self._once("store", {**scope, "off": off, "n": arr.shape[2]}, raw)
                    return 0 if reply is None else int(reply["written"])
                written = self._store_chunks(link, arr, raw, scope, start, have)
                if not self._restarted:
                    break
            return written

    def lease(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> Lease:
        """As ``TieredStore.lease``; the lease belongs to this session (released by the
        service if this process dies). Holds nothing when the service is unreachable."""
        toks = TokenIds(tokens)
        self._check_start(start, len(toks))
        reply = self._call(
            "lease", self._scope(tenant, adapter, salt, start), toks.chunk(0, len(toks))
        )
        if reply is None:
            return Lease(start, start, lambda: None)
        sid = self._link.sid if self._link is not None else b""
        lid = int(reply["lid"])
        return Lease(int(reply["start"]), int(reply["end"]), lambda: self._release(sid, lid))

    def _release(self, sid: bytes, lid: int) -> None:
        with self._lock:
            if self._link is not None and self._link.sid == sid:
                self._call("release", {"lid": lid})
            # else: that session is gone, and the service released its leases with it

    @contextlib.contextmanager
    def pin(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
    ) -> Iterator[int]:
        """As ``TieredStore.pin``."""
        with self.lease(tokens, tenant, adapter=adapter, salt=salt) as held:
            yield held.end

    def ping(self) -> bool:
        """One empty round trip (renews the session); ``False`` when unreachable."""
        return self._call("ping", {}) is not None

    def flush(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout``, and this client's call timeout) until the service's
        pending moves have completed."""
        self._call("flush", {"timeout": timeout})

    def stats(self) -> dict[str, Any]:
        """The service's ``stats()`` (its store's, plus ``service``: every session's
        counters), and ``client``: this connection's state. Only ``client`` when the service
        is unreachable."""
        reply = self._call("stats", {})
        out: dict[str, Any] = {} if reply is None else dict(reply["stats"])
        out["client"] = {"url": self.url, "connected": self.connected, **self.counters}
        return out

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

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _fields(identity: Identity) -> dict[str, Any]:
    return identity.describe()


def connect(
    url: str,
    identity: Identity | None = None,
    *,
    model_id: str = "",
    revision: str = "",
    tenant: str | None = None,
    layout: KVLayout | None = None,
    timeout: float = 5.0,
    name: str = "",
) -> ServiceClient:
    """A client of the kvtier service at ``url`` (``unix:///path/kvtier.sock``).

    ``identity`` (or the short form ``model_id``/``revision``) says whose KV this engine's
    blocks are; omitted, the service's ``[store]`` identity applies. ``tenant`` is the default
    tenant of calls that name none (the service's default otherwise). ``layout``, when given,
    must match the service's (``LayoutError`` otherwise) and lets the client start while the
    service is down (misses until it is up); without it an unreachable service raises
    ``ConfigError``. ``timeout`` bounds every call (seconds).
    """
    if model_id or revision:
        if identity is not None:
            raise ConfigError("give either identity= or model_id=/revision=, not both")
        identity = Identity(model_id, revision=revision)
    client = ServiceClient(
        url, identity=identity, tenant=tenant, layout=layout, timeout=timeout, name=name
    )
    if not client.connected and layout is None:
        client.close()
        raise ConfigError(
            f"the kvtier service at {url} does not answer: start `kvtier serve --url {url}`, "
            "or pass layout= to start serving misses until it is up"
        )
    return client
