"""``Service``: the ``ServiceStore`` pools behind a ZeroMQ ROUTER socket on a unix socket.

A client's session is bound at ``hello`` to the pool of its layout (``kvtier.service.pools``);
every later call of the session runs on that pool's store.

One thread owns the socket: it receives every request, answers the cheap ones itself (hello,
lookup, lease, release, prefetch, stats, heartbeat, and a direct store's reserve and commit
when they cannot wait) and hands loads and stores to a pool of threads, whose replies come
back to it over an in-process socket (a ZeroMQ socket is used by one thread only). KV bytes
never cross the socket: in arena mode the client copies them into and
out of the shared host arena itself (``kvtier.service.direct``: ``reserve``/``commit`` a store,
``acquire``/``read_done`` a load); otherwise, and for ``buffer()`` arrays and blocks below the
host tier, they move between the store and the client's staging region
(``kvtier.service.staging``). Between polls it expires sessions whose client went silent
(``kvtier.service.sessions``).

Startup refuses to share a socket: ``<socket>.lock`` is held (``flock``) for the service's life,
so a second service on the same URL fails with ``ConfigError`` naming the first one's pid; a
socket file left by a service that died is detected (nothing accepts on it) and replaced; the
socket is created owner-only (0600, or 0660 with ``[service] group``).
"""

from __future__ import annotations

import contextlib
import fcntl
import glob
import itertools
import logging
import os
import secrets
import socket
import stat
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import zmq

from kvtier.decider import checked_reuse_class
from kvtier.errors import ConfigError, KVTierError, TokenError
from kvtier.identity import Identity
from kvtier.keys import Namespace, TokenIds
from kvtier.layout import KVLayout
from kvtier.service.config import ServiceConfig
from kvtier.service.direct import Reservation, SlotRead
from kvtier.service.pools import Pools
from kvtier.service.protocol import VERSION, error_reply, pack, socket_path, unpack
from kvtier.service.scoped import ServiceStore
from kvtier.service.sessions import Session
from kvtier.service.staging import Staging

log = logging.getLogger(__name__)
_REPLIES = "inproc://kvtier-service-replies"
# a direct transfer's bytes are counted where it ends, under the op a client called
_COUNT_AS = {"commit": "store", "read_done": "load"}
_WORKER_OPS = frozenset({"load", "store", "flush", "reserve", "commit"})  # may wait for room


def _probe(path: str) -> bool:
    """True if something accepts connections on the unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.settimeout(1.0)
        try:
            s.connect(path)
        except (ConnectionRefusedError, FileNotFoundError):
            return False
        except OSError:
            return True  # e.g. EACCES: it is there and alive, we may just not reach it
        return True


class SocketLock:
    """``<socket>.lock``, held with ``flock`` while the service runs (holds our pid). Taken
    before the store is built (``claim``), so a second service fails before it touches the
    first one's shared arena."""

    def __init__(self, path: str) -> None:
        self.path = path + ".lock"
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.read(fd, 32).decode(errors="replace").strip() or "?"
            os.close(fd)
            raise ConfigError(
                f"another kvtier service (pid {other}) is serving {path}; stop it, or give this "
                "one another [service] url / --url"
            ) from None
        os.ftruncate(fd, 0)
        os.write(fd, str(os.getpid()).encode())
        self._fd: int | None = fd

    @classmethod
    def claim(cls, config: ServiceConfig) -> SocketLock:
        """The lock of ``config.url``'s socket (its directory made if missing);
        ``ConfigError`` if another service holds it. Staging regions a killed service on
        this socket left in ``/dev/shm`` (sessions whose client never attached) are removed,
        and the arenas of its pools (each new pool's replaces its own name: this removes
        those of pools the config no longer has)."""
        path = socket_path(config.url)
        parent = os.path.dirname(path)
        if not os.path.isdir(parent):
            os.makedirs(parent, mode=0o750 if config.gid is not None else 0o700, exist_ok=True)
        lock = cls(path)
        prefix = glob.escape(config.shm_prefix)
        stale_names = ("-staging-*", "-arena-*", "-presence-*")
        for stale in [p for name in stale_names for p in glob.glob(prefix + name)]:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(stale)
        return lock

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


class Service:
    """Serve ``pools`` on ``config.url`` until ``stop()``. Call ``serve()`` on one thread.

    ``bind()`` (also done by ``serve``) claims the socket; its errors are ``ConfigError``.
    ``lock``: the socket's lock when the caller claimed it already (``SocketLock.claim``); the
    caller releases it, after closing the store (a service started meanwhile on the socket
    would otherwise have its shared memory, named per socket, removed by this one's close)."""

    def __init__(self, pools: Pools, config: ServiceConfig, lock: SocketLock | None = None) -> None:
        self.pools = pools
        self.config = config
        self.path = socket_path(config.url)
        self._ctx = zmq.Context()
        self._router: zmq.Socket[bytes] | None = None
        self._lock: SocketLock | None = lock
        self._lock_given = lock is not None
        self._sessions: dict[bytes, Session] = {}
        self._stop = threading.Event()
        self._pool = ThreadPoolExecutor(config.threads, thread_name_prefix="kvtier-service")
        self._local = threading.local()
        self._pushes: list[zmq.Socket[bytes]] = []
        self._pushes_lock = threading.Lock()
        self._handlers: dict[str, Callable[[Session, dict[str, Any], Any], dict[str, Any]]] = {
            "lookup": self._lookup,
            "locate": self._locate,
            "load": self._load,
            "store": self._store,
            "prefetch": self._prefetch,
            "lease": self._lease,
            "release": self._release,
            "stats": self._stats,
            "ping": lambda s, h, t: {},
            "root": self._root,
            "attach": self._attach,
            "flush": self._flush,
            "reserve": self._reserve,
            "commit": self._commit,
            "abort": self._abort,
            "acquire": self._acquire,
            "read_done": self._read_done,
            "bye": self._bye,
        }
        self.ready = threading.Event()
        self._numbers = itertools.count(1)

    # -- socket ----------------------------------------------------------------------------
    def bind(self) -> None:
        """Claim the socket path (lock, stale-socket check, owner-only bind)."""
        if self._router is not None:
            return
        path = self.path
        gid = self.config.gid
        if self._lock is None:
            self._lock = SocketLock.claim(self.config)
        try:
            if os.path.lexists(path):
                if not stat.S_ISSOCK(os.lstat(path).st_mode):
                    raise ConfigError(
                        f"{path} exists and is not a socket; remove it or choose another url"
                    )
                if _probe(path):
                    raise ConfigError(
                        f"a process that is not a kvtier service is listening on {path}; stop "
                        "it or choose another url"
                    )
                log.warning("removing the stale socket %s (its service is gone)", path)
                os.unlink(path)
            router = self._ctx.socket(zmq.ROUTER)
            router.setsockopt(zmq.LINGER, 0)
            router.setsockopt(zmq.ROUTER_MANDATORY, 0)  # replies to a dead client are dropped
            old = os.umask(0o177)  # the socket is born owner-only: no window for others
            try:
                router.bind("ipc://" + path)
            finally:
                os.umask(old)
            if gid is not None:
                os.chown(path, -1, gid)
                os.chmod(path, 0o660)
            self._router = router
        except BaseException:
            self._lock.release()
            self._lock = None
            raise

    def stop(self) -> None:
        """Ask ``serve`` to return (thread- and signal-safe)."""
        self._stop.set()

    def serve(self) -> None:
        """Run the socket loop until ``stop()``; then close sessions and the socket (the pools'
        stores stay open: their owner closes them)."""
        self.bind()
        router = self._router
        assert router is not None
        replies = self._ctx.socket(zmq.PULL)
        replies.bind(_REPLIES)
        poller = zmq.Poller()
        poller.register(router, zmq.POLLIN)
        poller.register(replies, zmq.POLLIN)
        tick = max(10, int(self.config.lease_ttl * 250))  # ms: expiry is checked 4x per TTL
        next_expiry = time.monotonic() + tick / 1000
        self.ready.set()
        try:
            while not self._stop.is_set():
                events = dict(poller.poll(tick))
                if router in events:
                    while True:
                        try:
                            frames = router.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        try:
                            self._handle(frames)
                        except Exception:  # a malformed request must not stop the service
                            log.exception("dropping a request that could not be handled")
                if replies in events:
                    while True:
                        try:
                            out = replies.recv_multipart(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        router.send_multipart(out)
                now = time.monotonic()
                if now >= next_expiry:  # not after every request: it visits every session
                    self._expire()
                    next_expiry = now + tick / 1000
        finally:
            self._pool.shutdown(wait=True)
            for push in self._pushes:  # the workers are gone: close their sockets here
                push.close(0)
            while True:  # replies of the last loads and stores: nobody waits for them now
                try:
                    replies.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    break
            for s in list(self._sessions.values()):
                s.close()
            self._sessions.clear()
            replies.close(0)
            router.close(0)
            self._router = None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            if self._lock is not None and not self._lock_given:
                self._lock.release()  # a caller's lock is the caller's: held until its store
            self._ctx.term()  # is closed (its arena and presence map are named per socket)

    # -- dispatch --------------------------------------------------------------------------
    def _handle(self, frames: list[bytes]) -> None:
        if len(frames) < 2:
            return
        peer, head = frames[0], frames[1]
        try:
            req = unpack(head)
        except ValueError:
            log.warning("dropping a malformed request")
            return
        tokens = frames[2] if len(frames) > 2 else req.pop("tokens", b"")
        req_id = req.get("id", 0)
        op = req.get("op")
        if op == "hello":
            self._reply(peer, self._hello(req, req_id, peer))
            return
        session = self._sessions.get(req.get("sid", b""))
        if session is not None and session.peer != peer:
            session = None  # a session is good only on the connection that opened it
        if session is None:  # never registered, or expired: the client says hello again
            self._reply(peer, {"id": req_id, "error": "session", "message": "unknown session"})
            return
        session.last_seen = time.monotonic()
        if "lm" in req:  # misses the client answered from the presence map since its last call
            self._count_local(session, req.pop("lm"))
        handler = self._handlers.get(str(op))
        if handler is None:
            self._reply(peer, {"id": req_id, "error": "ConfigError", "message": f"no op {op!r}"})
            return
        if op in _WORKER_OPS and not self._cannot_wait(session, str(op), req):
            with session.lock:
                session.inflight += 1
            self._pool.submit(self._work, peer, session, handler, req, tokens)
        else:
            self._reply(peer, self._call(session, handler, req, tokens))

    def _cannot_wait(self, session: Session, op: str, req: dict[str, Any]) -> bool:
        """A worker op answered on this thread, sparing two thread hand-offs: a direct store's
        reserve or commit that cannot wait (``DirectStore.reserve_may_wait``,
        ``commit_may_wait``)."""
        if op == "reserve":
            return not session.store.reserve_may_wait()
        if op != "commit":
            return False
        res = session.peek_transfer(req.get("tid", -1) if isinstance(req.get("tid"), int) else -1)
        return isinstance(res, Reservation) and not session.store.commit_may_wait(res)

    def _call(
        self,
        session: Session,
        handler: Callable[[Session, dict[str, Any], Any], dict[str, Any]],
        req: dict[str, Any],
        tokens: Any,
    ) -> dict[str, Any]:
        req_id = req.get("id", 0)
        t0 = time.perf_counter()
        try:
            if "tok" in req:  # a long prompt's ids, in the session's staging token area
                tokens = session.staging.tokens(int(req["tok"]))
            with ServiceStore.using(session.identity):
                out = handler(session, req, tokens)
        except KVTierError as exc:
            return error_reply(req_id, exc)
        except Exception as exc:  # a fault here is a miss for the client, never a crash
            log.exception("service: %s failed", req.get("op"))
            return error_reply(req_id, exc)
        session.count(
            _COUNT_AS.get(str(req.get("op")), str(req.get("op"))),
            time.perf_counter() - t0,
            int(out.pop("_tokens", 0)),
            int(out.pop("_bytes", 0)),
        )
        out["id"] = req_id
        return out

    def _work(
        self,
        peer: bytes,
        session: Session,
        handler: Callable[[Session, dict[str, Any], Any], dict[str, Any]],
        req: dict[str, Any],
        tokens: Any,
    ) -> None:
        try:
            reply = self._call(session, handler, req, tokens)
            push = getattr(self._local, "push", None)
            if push is None:  # one per worker thread: a ZeroMQ socket is single-threaded
                push = self._local.push = self._ctx.socket(zmq.PUSH)
                push.setsockopt(zmq.LINGER, 0)
                push.connect(_REPLIES)
                with self._pushes_lock:
                    self._pushes.append(push)
            push.send_multipart([peer, pack(reply)])
        finally:
            with session.lock:
                session.inflight -= 1

    def _reply(self, peer: bytes, reply: dict[str, Any]) -> None:
        assert self._router is not None
        self._router.send_multipart([peer, pack(reply)])

    def _expire(self) -> None:
        now = time.monotonic()
        for sid, s in list(self._sessions.items()):
            if s.expired(now, self.config.lease_ttl):
                log.info("session %d (pid %d) went silent: releasing it", s.number, s.pid)
                del self._sessions[sid]
                s.close()

    def _count_local(self, session: Session, report: Any) -> None:
        """Count a client's local misses (``[tenant, lookups, lookup tokens, loads, load
        tokens]`` rows) as the store counts its own lookups and loads."""
        try:
            for tenant, lookups, lookup_tokens, loads, load_tokens in report:
                session.store.count_misses(
                    str(tenant), int(lookups), int(lookup_tokens), int(loads), int(load_tokens)
                )
                session.count(
                    "lookup_local",
                    0.0,
                    int(lookup_tokens) + int(load_tokens),
                    calls=int(lookups) + int(loads),
                )
        except (TypeError, ValueError):
            log.warning("session %d: dropping a malformed miss report", session.number)

    # -- operations ------------------------------------------------------------------------
    def _hello(self, req: dict[str, Any], req_id: int, peer: bytes) -> dict[str, Any]:
        try:
            if req.get("version") != VERSION:
                raise ConfigError(
                    f"client speaks protocol {req.get('version')!r}, this service {VERSION}: "
                    "run the same kvtier version on both sides"
                )
            pool = self.pools.for_layout(self._layout(req.get("layout")))
            store = pool.store
            fields = req.get("identity")
            if fields is None:
                identity = store.identity
            elif isinstance(fields, dict):
                try:
                    identity = Identity(**fields)
                except TypeError as exc:
                    raise ConfigError(f"identity: {exc}") from None
            else:
                raise ConfigError(f"identity: expected a map, got {fields!r}")
            tenant = req.get("tenant") or store.tenant
            store.namespace(tenant)  # validates the tenant name
            staging = Staging.create(
                self.config.staging,
                self.config.token_area,
                gid=self.config.gid,
                prefix=self.config.shm_prefix,
            )
        except KVTierError as exc:
            return error_reply(req_id, exc)
        sid = secrets.token_bytes(16)
        pid = req.get("pid", 0)
        name = req.get("name", "")
        self._sessions[sid] = Session(
            sid,
            identity,
            tenant,
            staging,
            store,
            pool.name,
            pid=pid if isinstance(pid, int) else 0,
            name=name if isinstance(name, str) else "",
            peer=peer,
            number=next(self._numbers),
        )
        lay = store.layout
        arena = store.arena if self.config.data == "arena" else None
        presence = store.presence
        with ServiceStore.using(identity):
            root = store.namespace(tenant).root
        return {
            "id": req_id,
            "arena": None if arena is None else arena.shm.path,  # the arena of its pool
            "arena_bytes": 0 if arena is None else arena.shm.nbytes,
            "presence": None if presence is None else presence.shm.path,
            "presence_bytes": 0 if presence is None else presence.shm.nbytes,
            "root": root,
            "sid": sid,
            "pool": pool.name,
            "layout": {
                "layers": lay.layers,
                "kv_heads": lay.kv_heads,
                "head_dim": lay.head_dim,
                "dtype": lay.dtype,
                "kv_factor": lay.kv_factor,
                "block_tokens": lay.block_tokens,
            },
            "staging": staging.path,
            "staging_bytes": staging.nbytes,
            "kv_bytes": staging.kv_bytes,
            "lease_ttl": self.config.lease_ttl,
            "tenant": tenant,
            "identity": identity.describe(),
        }

    @staticmethod
    def _layout(fields: object) -> KVLayout | None:
        """The layout a client sent at hello (``None``: it sent none, the default pool)."""
        if fields is None:
            return None
        if not isinstance(fields, dict):
            raise ConfigError(f"layout: expected a map, got {fields!r}")
        try:
            return KVLayout(**fields)
        except TypeError as exc:
            raise ConfigError(f"layout: {exc}") from None

    def _attach(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        s.staging.unlink()  # both sides have it mapped: the name is no longer needed
        return {}

    def _bye(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        self._sessions.pop(s.sid, None)
        s.close()
        return {}

    @staticmethod
    def _tokens(raw: object) -> Any:
        if isinstance(raw, np.ndarray):  # a view of the staging token area (uint32 already)
            return raw
        if not isinstance(raw, bytes) or len(raw) % 4:
            raise TokenError("token ids must arrive as little-endian uint32 bytes")
        return np.frombuffer(raw, dtype="<u4")

    @staticmethod
    def _scope(req: dict[str, Any]) -> dict[str, Any]:
        return {
            "tenant": req.get("tenant"),
            "adapter": req.get("adapter"),
            "salt": req.get("salt"),
            "start": req.get("start", 0),
        }

    def _lookup(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        end = s.store.lookup(self._tokens(tokens), **self._scope(req))
        return {"end": end, "_tokens": end - req.get("start", 0)}

    def _locate(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        return {"tiers": s.store.locate(self._tokens(tokens), **self._scope(req))}

    def _prefetch(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        return {"tokens": s.store.prefetch(self._tokens(tokens), **self._scope(req))}

    def _load(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        out = s.staging.view(s.store.layout, req["off"], req["n"])
        end = s.store.load(self._tokens(tokens), out, **self._scope(req))
        got = end - req.get("start", 0)
        return {"end": end, "_tokens": got, "_bytes": got * s.store.layout.bytes_per_token}

    def _store(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        kv = s.staging.view(s.store.layout, req["off"], req["n"])
        reuse = req.get("reuse_class")
        written = s.store.store(
            self._tokens(tokens),
            kv,
            reuse_class=tuple(reuse) if isinstance(reuse, list) else reuse,
            **self._scope(req),
        )
        out = {
            "written": written,
            "_tokens": written,
            "_bytes": written * s.store.layout.bytes_per_token,
        }
        if req.get("hold"):
            # a chunk of a larger store: hold it so the chunks after it cannot evict it
            # (as one in-process call holds its own blocks); released at the call's end
            held = s.store.lease(self._tokens(tokens), **self._scope(req))
            out["lid"] = s.add_lease(held)
        return out

    # -- direct transfers (arena mode): the client copies, the store decides ----------------
    def _root(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        """The key root of a scope of the session's identity (``kvtier.service.presence``)."""
        return {"root": self._namespace(s, req).root}

    def _namespace(self, s: Session, req: dict[str, Any]) -> Namespace:
        return s.store.namespace(req.get("tenant"), req.get("adapter"), req.get("salt"))

    def _slice(self, s: Session, res: Reservation, tid: int | None) -> dict[str, Any]:
        """The reply naming a reservation's current slice, or the store's outcome when done."""
        if res.done:
            n = res.written * s.store.layout.block_tokens
            return {"written": n, "_tokens": n, "_bytes": n * s.store.layout.bytes_per_token}
        if tid is None:
            tid = s.add_transfer(res)
        else:
            s.put_back(tid, res)
        return {"tid": tid, "blocks": res.pending, "slots": res.slots}

    def _direct(self, s: Session) -> None:
        """Direct transfers only where clients were offered the arena (else a fault: a miss)."""
        if self.config.data != "arena" or s.store.arena is None:
            raise LookupError("this service shares no host arena: transfer through staging")

    def _reserve(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        self._direct(s)
        reuse = req.get("reuse_class")
        res = s.store.reserve_store(
            TokenIds(self._tokens(tokens)),
            req.get("start", 0),
            int(req["n"]) // s.store.layout.block_tokens,
            self._namespace(s, req),
            checked_reuse_class(tuple(reuse) if isinstance(reuse, list) else reuse),
        )
        return self._slice(s, res, None)

    def _commit(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        tid = int(req["tid"])
        res = s.take_transfer(tid)
        if not isinstance(res, Reservation):
            raise LookupError(f"no store {tid} in progress in this session")  # a fault: a miss
        try:
            s.store.commit_store(res, np.frombuffer(req["sums"], "<u8").tolist())
        except BaseException:
            s.store.abort_store(res)
            raise
        return self._slice(s, res, tid)

    def _abort(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        res = s.take_transfer(int(req["tid"]))
        if res is not None:
            res.release()
        return {}

    def _acquire(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        self._direct(s)
        toks = TokenIds(self._tokens(tokens))
        start = req.get("start", 0)
        read, more = s.store.begin_read(toks, start, self._namespace(s, req))
        if not read.slots:  # nothing in the host tier: a miss, unless a lower tier follows
            bt = s.store.layout.block_tokens
            s.store.end_read(read, 0, 0 if more else len(toks) // bt - start // bt)
            return {"slots": [], "more": more}
        sums = np.asarray(read.sums, "<u8").tobytes()
        return {"tid": s.add_transfer(read), "slots": read.slots, "sums": sums, "more": more}

    def _read_done(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        read = s.take_transfer(int(req["tid"]))
        if not isinstance(read, SlotRead):
            return {}
        s.store.end_read(read, int(req["ok"]), int(req["asked"]))
        bt = s.store.layout.block_tokens
        got = int(req["ok"]) * bt
        return {"_tokens": got, "_bytes": got * s.store.layout.bytes_per_token}

    def _lease(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        lease = s.store.lease(self._tokens(tokens), **self._scope(req))
        lid = s.add_lease(lease)
        return {"lid": lid, "start": lease.start, "end": lease.end, "_tokens": lease.tokens}

    def _release(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        lids = req.get("lids", [req.get("lid", 0)])
        return {"released": sum(s.release(int(lid)) for lid in lids)}

    def _flush(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        timeout = req.get("timeout")
        s.store.flush(float(timeout) if isinstance(timeout, int | float) else None)
        return {}

    def _stats(self, s: Session, req: dict[str, Any], tokens: Any) -> dict[str, Any]:
        stats = s.store.stats()  # the session's pool, as a store's stats
        stats["pool"] = s.pool
        stats["pools"] = self.pools.stats()
        stats["service"] = {
            "url": self.config.url,
            "pid": os.getpid(),
            # numbered, never by id: a session id is the client's credential
            "sessions": {str(x.number): x.describe() for x in list(self._sessions.values())},
        }
        return {"stats": stats}
