"""Lookups from vLLM's scheduler process to the stores in its worker processes (pyzmq).

vLLM runs the scheduler (where ``get_num_new_matched_tokens`` is asked) in the engine-core
process and every rank's model runner (where the KV pages and the rank's store live) in worker
processes. Each worker rank answers lookups on a ZeroMQ REP socket, ``ipc://`` in a private
temporary directory (mode 0700) named from vLLM's engine id; the scheduler asks every rank
and takes the minimum (a prefix is usable only if every rank holds its part). A rank's socket
goes at close or interpreter exit; the directories of engines killed before either (a SIGTERM'd
``vllm serve``) are swept by the next engine's lookup server (``sweep_stale``).

Failure is a miss: a rank that does not answer within the timeout, a malformed reply or a
closed socket counts as 0 tokens for that request, never a hang or an exception in the
scheduler. The REQ sockets are relaxed/correlated, so a late reply to an abandoned question is
discarded instead of wedging the socket.

Wire format (one multipart message each way): question ``[json header, int32 token bytes]``
with ``{"op": "lookup" | "lease", "start", "adapter", "salt", "req"}``; answer ``[json {"end":
n}]``. ``lease`` pins the prefix on the rank for request ``req`` until the rank loads it (or
the request finishes): the commit that follows a lookup, so a block does not leave between the
scheduler's promise and the worker's load. ``{"op": "stats"}`` answers the rank's counters
(``WorkerSide.stats``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import stat
import tempfile
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import zmq

from kvtier.integrations.vllm.backend import Scope

log = logging.getLogger("kvtier.vllm")

LookupFn = Callable[[np.ndarray[Any, Any], Scope, int], int]
LeaseFn = Callable[[str, np.ndarray[Any, Any], Scope, int], int]
StatsFn = Callable[[], dict[str, Any]]


def sweep_stale(root: Path) -> int:
    """Remove the socket directories under ``root`` of engines that died without closing their
    connector (a ``vllm serve`` stopped by SIGTERM ends its workers without it): this user's
    ``kvtier-vllm-*`` directories holding only sockets that refuse connections. A directory
    with a live or a non-socket entry, or none (an engine still starting), is kept. Returns how
    many were removed."""
    removed = 0
    for d in root.glob("kvtier-vllm-*"):
        try:
            st = d.lstat()
            if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
                continue
            entries = list(d.iterdir())
            if not entries or not all(_refuses(e) for e in entries):
                continue
            for e in entries:
                e.unlink()
            d.rmdir()
            removed += 1
        except OSError:  # another engine swept it, or started in it, meanwhile
            continue
    return removed


def _refuses(path: Path) -> bool:
    """Whether ``path`` is a Unix socket nobody listens on any more."""
    if not stat.S_ISSOCK(path.lstat().st_mode):
        return False
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        try:
            s.connect(str(path))
        except ConnectionRefusedError:
            return True
        except OSError:
            return False
    return False


def socket_dir(engine_id: str) -> Path:
    """The private directory of one engine's sockets (created 0700; refused if not ours)."""
    safe = "".join(c if c.isalnum() or c in "-_." else "_" for c in engine_id)[:64]
    path = Path(tempfile.gettempdir()) / f"kvtier-vllm-{safe}"
    with contextlib.suppress(FileExistsError):
        path.mkdir(mode=0o700)
    st = path.lstat()
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise PermissionError(f"{path} is not a private directory of this user")
    return path


def rank_address(engine_id: str, rank: int) -> str:
    return f"ipc://{socket_dir(engine_id) / f'rank{rank}.sock'}"


class LookupServer:
    """Answers lookups for one rank on a background thread until ``close()``."""

    def __init__(
        self,
        engine_id: str,
        rank: int,
        lookup: LookupFn,
        lease: LeaseFn,
        stats: StatsFn = dict,
    ) -> None:
        self._lookup = lookup
        self._lease = lease
        self._stats = stats
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        sweep_stale(Path(tempfile.gettempdir()))
        self.address = rank_address(engine_id, rank)
        path = self.address.removeprefix("ipc://")
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)  # a stale socket of a dead engine with the same id
        self._sock.bind(self.address)
        # at close, or at interpreter exit if the engine never closes the connector
        self._remove = weakref.finalize(self, _remove_socket, Path(path))
        self._stop = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, name=f"kvtier-lookup-{rank}", daemon=True
        )
        self._thread.start()

    def _answer(self, parts: Sequence[bytes]) -> dict[str, Any]:
        head = json.loads(parts[0])
        if head.get("op") == "stats":
            return self._stats()
        tokens = (
            np.frombuffer(parts[1], dtype=np.int32) if len(parts) > 1 else np.empty(0, np.int32)
        )
        scope = Scope(str(head.get("adapter", "")), str(head.get("salt", "")))
        start = int(head.get("start", 0))
        if head.get("op") == "lease":
            return {"end": int(self._lease(str(head["req"]), tokens, scope, start))}
        return {"end": int(self._lookup(tokens, scope, start))}

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                parts = self._sock.recv_multipart()
            except zmq.ZMQError:
                break
            try:
                reply = self._answer(parts)
            except Exception as exc:  # a bad question is a miss for the asker
                log.warning("kvtier lookup failed: %s", exc)
                reply = {"end": 0}
            try:
                self._sock.send(json.dumps(reply).encode())
            except zmq.ZMQError:
                break
        self._sock.close(0)

    def close(self) -> None:
        """Stop serving and remove this rank's socket; the last rank to close removes the
        engine's socket directory too (another rank's socket still in it keeps it)."""
        self._stop.set()
        self._thread.join(timeout=5)
        self._ctx.term()
        self._remove()


def _remove_socket(path: Path) -> None:
    """Remove a rank's socket file, and the engine's directory once no rank's socket is left."""
    with contextlib.suppress(OSError):
        path.unlink()
    with contextlib.suppress(OSError):  # not empty: a rank still serves
        path.parent.rmdir()


class LookupClient:
    """Asks every rank; not thread-safe (the scheduler calls it from its one thread)."""

    def __init__(self, engine_id: str, ranks: int, timeout_s: float) -> None:
        self._ctx = zmq.Context()
        self._timeout = timeout_s
        self._socks = []
        for r in range(ranks):
            s = self._ctx.socket(zmq.REQ)
            s.setsockopt(zmq.LINGER, 0)
            s.setsockopt(zmq.REQ_RELAXED, 1)
            s.setsockopt(zmq.REQ_CORRELATE, 1)
            s.connect(rank_address(engine_id, r))
            self._socks.append(s)
        self.timeouts = 0

    def lookup(self, tokens: np.ndarray[Any, Any], scope: Scope, start: int = 0) -> int:
        """min over ranks of each rank's cached prefix end; 0 if any rank fails to answer."""
        return self._ask({"op": "lookup"}, tokens, scope, start)

    def lease(self, req_id: str, tokens: np.ndarray[Any, Any], scope: Scope, start: int) -> int:
        """Pin the prefix on every rank for ``req_id``; min over ranks of the pinned end."""
        return self._ask({"op": "lease", "req": req_id}, tokens, scope, start)

    def stats(self) -> list[dict[str, Any]]:
        """Every rank's counters, in rank order ({} for a rank that did not answer in time)."""
        out: list[dict[str, Any]] = []
        for s in self._socks:
            try:
                s.send_multipart([b'{"op": "stats"}', b""])
                if not s.poll(int(self._timeout * 1000)):
                    out.append({})
                    continue
                out.append(json.loads(s.recv()))
            except (zmq.ZMQError, ValueError):
                out.append({})
        return out

    def _ask(
        self, op: dict[str, Any], tokens: np.ndarray[Any, Any], scope: Scope, start: int
    ) -> int:
        head = json.dumps({**op, "start": start, "adapter": scope.adapter, "salt": scope.salt})
        body = np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
        poller = zmq.Poller()
        for s in self._socks:
            try:
                s.send_multipart([head.encode(), body], flags=zmq.NOBLOCK)
            except zmq.ZMQError:
                self.timeouts += 1
                return 0
            poller.register(s, zmq.POLLIN)
        deadline = time.monotonic() + self._timeout
        ends: dict[int, int] = {}
        while len(ends) < len(self._socks):
            left = deadline - time.monotonic()
            if left <= 0:
                self.timeouts += 1
                return 0
            for s, _ in poller.poll(int(left * 1000) + 1):
                try:
                    ends[id(s)] = int(json.loads(s.recv(zmq.NOBLOCK))["end"])
                except (zmq.ZMQError, ValueError, KeyError, TypeError):
                    return 0
                poller.unregister(s)
        return min(ends.values()) if ends else 0

    def close(self) -> None:
        for s in self._socks:
            s.close(0)
        self._ctx.term()
