"""``ServiceClient``: the engine side of ``kvtier serve`` -- the ``TieredStore`` API over a socket.

``connect(url, identity=...)`` opens a session (``kvtier.service.connection``: registration,
heartbeat, reconnects, bounded timeouts). Then ``lookup/locate/load/store/prefetch/lease/pin/
stats/flush`` take the same arguments and return the same values as ``TieredStore``'s; a
service that is unreachable makes them misses (``lookup``/``load`` return ``start``, ``store``
returns 0, a lease holds nothing), never an exception or a hang. Caller mistakes (bad tokens,
a wrong array, a bad tenant) raise the same ``TokenError``/``LayoutError``/``ConfigError`` as
in-process.

Data path, chosen per call:

- arena mode (the service's default): the client copies KV straight between the caller's
  array and the service's shared host arena, with the host tier's fused copy + checksum: one
  copy per direction, as in-process (``kvtier.service.arena_io``);
- an array from ``buffer(tokens)`` (a view of the session's staging region), a service in
  ``data = "staging"`` mode, and blocks held below the host tier go through the staging region
  (``kvtier.service.staged``): the service copies between it and its store.

Thread-safe: calls of one client are serialised (one session, one staging region).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator
from itertools import islice
from typing import Any

import numpy as np

from kvtier.config import DEFAULT_WORKERS
from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity
from kvtier.keys import TokenIds, iter_chain
from kvtier.kvarray import host_array
from kvtier.layout import KVLayout
from kvtier.lease import Lease
from kvtier.service.arena_io import ArenaCopier, load_direct, store_direct
from kvtier.service.connection import Connection
from kvtier.service.staged import load_chunks, store_chunks
from kvtier.tiers.base import Array

_PROBE_BLOCKS = 16  # a lookup first sends this many blocks' tokens (a miss is cheap)
_LOCAL_BLOCKS = 16  # the presence map is read for a call starting within this many blocks
_ROOTS = 4096  # bound on a session's cached key roots (per-request salts are many)


class ServiceClient(Connection):
    """A connection to a kvtier service with ``TieredStore``'s API. Use ``connect``.

    ``workers``: threads (besides the caller's) copying KV into and out of the shared arena,
    as an in-process store's transfer engine; ``direct=False`` never maps the arena,
    ``presence=False`` never the presence map."""

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
        workers: int = DEFAULT_WORKERS,
        presence: bool = True,
    ) -> None:
        super().__init__(
            url,
            identity=identity,
            tenant=tenant,
            layout=layout,
            timeout=timeout,
            name=name,
            direct=direct,
            presence=presence,
        )
        self._workers = workers
        self._copier: ArenaCopier | None = None

    @property
    def data_path(self) -> str:
        """``"arena"`` when this session maps the service's host arena, else ``"staging"``."""
        link = self.link
        return "arena" if link is not None and link.arena is not None else "staging"

    def _arena_copier(self) -> ArenaCopier:
        if self._copier is None:
            self._copier = ArenaCopier(self.layout, self._workers)
        return self._copier

    # -- helpers ---------------------------------------------------------------------------
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

    def buffer(self, tokens: int) -> Array:
        """A KV array for ``tokens`` tokens in the staging region (``None``-free: raises
        ``ConfigError`` when the service is unreachable or the region is too small). A
        ``store`` of it or a ``load`` into it makes no staging copy: the service copies
        between it and the arena. Its contents are valid until the next ``load``/``store`` of
        another array, and only for this session."""
        link = self.link
        if link is None:
            raise ConfigError(f"the kvtier service at {self.url} is not connected")
        if tokens * self.layout.bytes_per_token > link.staging.kv_bytes:
            raise ConfigError(
                f"{tokens} tokens do not fit the {link.staging.kv_bytes}-byte staging region; "
                "raise [service] staging"
            )
        return link.staging.view(self.layout, 0, tokens)

    def _present(
        self, toks: TokenIds, tenant: str | None, adapter: str | None, salt: Any, start: int
    ) -> bool | None:
        """What the service's presence map (``kvtier.service.presence``) says of the block at
        ``start``: ``False`` if it is surely not cached (no key counts in its slot: the call is
        a miss with no round trip), ``True`` if it may be, ``None`` if the map was not read
        (none offered, a block far into the prompt, no full block there)."""
        link = self.link
        bt = self.layout.block_tokens
        first = start // bt
        if link is None or link.presence is None or first >= _LOCAL_BLOCKS:
            return None
        if len(toks) < (first + 1) * bt:
            return None
        scope = (tenant, adapter, salt)
        root = link.roots.get(scope)
        if root is None:
            reply = self.call("root", {"tenant": tenant, "adapter": adapter, "salt": salt})
            if reply is None or self.link is not link:
                return None
            root = reply["root"]
            if len(link.roots) >= _ROOTS:
                link.roots.clear()
            link.roots[scope] = root
        key = next(islice(iter_chain(root, bt, toks), first, None))
        return link.presence.may_hold(key)

    def _count_local(self, tenant: str | None, lookup_tokens: int, load_tokens: int) -> None:
        """A miss served here, reported to the service with the next call (its counters)."""
        with self.lock:
            self.counters["local_misses"] += 1
            row = self._local_misses.setdefault(tenant or self.tenant, [0, 0, 0, 0])
            if load_tokens:
                row[2] += 1
                row[3] += load_tokens
            else:
                row[0] += 1
                row[1] += lookup_tokens

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

        A first block the presence map says is not cached is a miss answered here. Without
        the map, a long prompt is asked about in two steps: its first ``_PROBE_BLOCKS`` blocks
        after ``start``, then (only if they are all cached) the whole prompt, so a miss does not
        pay for converting and sending every token id."""
        toks = TokenIds(tokens)
        self._check_start(start, len(toks))
        present = self._present(toks, tenant, adapter, salt, start)
        if present is False:
            bt = self.layout.block_tokens
            self._count_local(tenant, (len(toks) // bt) * bt - start, 0)
            return start
        scope = self._scope(tenant, adapter, salt, start)
        probe = start + _PROBE_BLOCKS * self.layout.block_tokens
        n = len(toks)
        if n > probe and present is None:
            reply = self._ask("lookup", scope, tokens, toks, probe)
            if reply is None or int(reply["end"]) < probe:
                return start if reply is None else int(reply["end"])
        reply = self._ask("lookup", scope, tokens, toks, n)
        return start if reply is None else int(reply["end"])

    def _ask(
        self, op: str, fields: dict[str, Any], tokens: Any, toks: TokenIds, stop: int
    ) -> dict[str, Any] | None:
        """One call about ``tokens[:stop]``. The ids of a numpy array are written into the
        staging token area in one pass (checked with a min and a max, no bytes built in
        between); anything else, or an id out of range, takes ``TokenIds``' checked path,
        which names a bad id."""
        if isinstance(tokens, np.ndarray):
            ids = tokens.reshape(-1)[:stop]
            with self.lock:
                for _ in range(2):  # once more on a new session if the service restarted
                    self.clear_restarted()
                    link = self.link
                    if link is None or not link.staging.put_token_array(ids):
                        break
                    reply = self.call_once(op, {**fields, "tok": stop}, None)
                    if not self.restarted:
                        return reply
        return self.call(op, fields, toks.chunk(0, stop))

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
        scope = self._scope(tenant, adapter, salt, start)
        reply = self._ask("locate", scope, tokens, toks, len(toks))
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
        scope = self._scope(tenant, adapter, salt, start)
        reply = self._ask("prefetch", scope, tokens, toks, len(toks))
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
        if want > 0 and self._present(toks, tenant, adapter, salt, start) is False:
            self._count_local(tenant, 0, want)
            return start
        raw = toks.chunk(0, start + want)
        scope = self._scope(tenant, adapter, salt, start)
        with self.lock:
            end = start
            for _ in range(2):  # once more, from scratch, on a new session after a restart
                self.clear_restarted()
                link = self.link
                if link is None or want <= 0:
                    self.counters["down_calls"] += link is None
                    return start
                off = link.staging.offset_of(arr)
                if off is not None:  # the engine gathered into our buffer: no staging copy
                    # never resent: after a restart the buffer is not in the new region
                    reply = self.call_once("load", {**scope, "off": off, "n": arr.shape[2]}, raw)
                    return start if reply is None else int(reply["end"])
                more = True
                if link.arena is not None:
                    copier = self._arena_copier()
                    got, more = load_direct(self, copier, arr, raw, scope, want // bt)
                    end = start + got * bt
                link = self.link  # a new session if acquire found the service restarted
                if more and link is not None and end < start + want:
                    rest = {**scope, "start": end}
                    end = load_chunks(
                        self, link, arr[:, :, end - start :], raw, rest, end, start + want - end
                    )
                if not self.restarted:
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
        with self.lock:
            written = 0
            for _ in range(2):  # once more, from scratch, on a new session after a restart
                self.clear_restarted()
                link = self.link
                if link is None or have == 0:
                    self.counters["down_calls"] += link is None
                    return 0
                off = link.staging.offset_of(arr)
                if off is not None:  # the engine gathered into our buffer: no staging copy
                    # never resent: after a restart the buffer is not in the new region
                    reply = self.call_once("store", {**scope, "off": off, "n": arr.shape[2]}, raw)
                    return 0 if reply is None else int(reply["written"])
                if link.arena is not None:
                    return store_direct(self, self._arena_copier(), arr, raw, {**scope, "n": have})
                written = store_chunks(self, link, arr, raw, scope, start, have)
                if not self.restarted:
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
        reply = self.call(
            "lease", self._scope(tenant, adapter, salt, start), toks.chunk(0, len(toks))
        )
        if reply is None:
            return Lease(start, start, lambda: None)
        sid = self.link.sid if self.link is not None else b""
        lid = int(reply["lid"])
        return Lease(int(reply["start"]), int(reply["end"]), lambda: self._release(sid, lid))

    def _release(self, sid: bytes, lid: int) -> None:
        with self._lock:
            if self.link is not None and self.link.sid == sid:
                self.call("release", {"lid": lid})
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
        return self.call("ping", {}) is not None

    def flush(self, timeout: float | None = None) -> None:
        """Wait (at most ``timeout``, and this client's call timeout) until the service's
        pending moves have completed."""
        self.call("flush", {"timeout": timeout})

    def stats(self) -> dict[str, Any]:
        """The service's ``stats()`` (its store's, plus ``service``: every session's
        counters), and ``client``: this connection's state. Only ``client`` when the service
        is unreachable."""
        reply = self.call("stats", {})
        out: dict[str, Any] = {} if reply is None else dict(reply["stats"])
        out["client"] = {"url": self.url, "connected": self.connected, **self.counters}
        return out

    def close(self) -> None:
        """End the session (its leases are released) and the heartbeat. Idempotent."""
        super().close()
        if self._copier is not None:
            self._copier.close()
            self._copier = None

    def __enter__(self) -> ServiceClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


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
    direct: bool = True,
    presence: bool = True,
) -> ServiceClient:
    """A client of the kvtier service at ``url`` (``unix:///path/kvtier.sock``).

    ``identity`` (or the short form ``model_id``/``revision``) says whose KV this engine's
    blocks are; omitted, the ``[store]`` identity of the service's pool applies. ``tenant`` is
    the default tenant of calls that name none (the service's default otherwise). ``layout``,
    when given, picks the service's pool of that layout (``LayoutError`` listing the layouts
    it serves when none is; ``kvtier.service.pools``) and lets the client start while the
    service is down (misses until it is up); without it an unreachable service raises
    ``ConfigError``. ``timeout`` bounds every call (seconds). ``direct=False``: never map the
    service's host arena (every transfer through the staging region). ``presence=False``:
    never map its presence map (every lookup asks the service).
    """
    if model_id or revision:
        if identity is not None:
            raise ConfigError("give either identity= or model_id=/revision=, not both")
        identity = Identity(model_id, revision=revision)
    client = ServiceClient(
        url,
        identity=identity,
        tenant=tenant,
        layout=layout,
        timeout=timeout,
        name=name,
        direct=direct,
        presence=presence,
    )
    if not client.connected and layout is None:
        client.close()
        raise ConfigError(
            f"the kvtier service at {url} does not answer: start `kvtier serve --url {url}`, "
            "or pass layout= to start serving misses until it is up"
        )
    return client
