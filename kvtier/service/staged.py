"""Transfers through a session's staging region: the path of ``data = "staging"`` services,
of ``buffer()`` arrays, and of blocks the host tier does not hold.

A ``store`` copies the KV into the region and the service's store copies it from there into the
host tier (copy + checksum); a ``load`` is the reverse. Calls larger than the region go in
block-aligned chunks, up to ``_DEPTH`` in flight, so the client's copy of one chunk overlaps the
service's of another; each chunk of a store but the last is leased on the service until the
call ends, so the later chunks cannot evict the prefix they extend. Long token ids are put in
the region's token area once, and each chunk names how many of them it covers.

Every function here runs under the connection's ``lock``.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import Any

import numpy as np

from kvtier.service.connection import LONG_TOKEN_BYTES, Connection, Link
from kvtier.tiers.base import Array

_DEPTH = 4  # staging slices (chunks in flight) of a transfer larger than its region


def slices(conn: Connection, link: Link) -> tuple[int, int]:
    """(tokens per chunk, chunks in flight) of a transfer through the staging region: up
    to ``_DEPTH`` slices of it, so the client's copies overlap the service's (on other
    cores) and a call's first chunk starts moving before its last is copied."""
    lay = conn.layout
    blocks = link.staging.kv_bytes // lay.block_bytes
    depth = max(1, min(_DEPTH, blocks))
    return (blocks // depth) * lay.block_tokens, depth


def token_fields(link: Link, raw: bytes) -> Callable[[int], tuple[dict[str, Any], bytes | None]]:
    """For a chunked call over ``raw`` token ids: long ids are put in the token area
    once, and each chunk names how many of them it covers."""
    if len(raw) >= LONG_TOKEN_BYTES and link.staging.put_tokens(raw):
        return lambda count: ({"tok": count}, None)
    return lambda count: ({}, raw[: 4 * count])


def store_chunks(
    conn: Connection,
    link: Link,
    arr: Array,
    raw: bytes,
    scope: dict[str, Any],
    start: int,
    have: int,
) -> int:
    """Store ``arr`` (not in the staging region) in chunks, several in flight (under the
    lock): the client fills one slice while the service stores from the others."""
    lay = conn.layout
    step, depth = slices(conn, link)
    tokens_of = token_fields(link, raw)
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
            if len(pending) == depth and not done(conn.await_reply("store", pending.popleft())):
                return written
            n = min(step, have - pos)
            off = (k % depth) * step * lay.bytes_per_token
            np.copyto(link.staging.view(lay, off, n), arr[:, :, pos : pos + n])
            extra, toks = tokens_of(start + pos + n)
            fields = {**scope, "start": start + pos, "off": off, "n": n, **extra}
            req_id = conn.send_request("store", {**fields, "hold": pos + n < have}, toks)
            if req_id is None:
                return written
            pending.append(req_id)
        while pending:
            if not done(conn.await_reply("store", pending.popleft())):
                return written
        return written
    finally:
        conn.drain("store", pending)
        if held and conn.link is link:
            conn.call("release", {"lids": held})


def load_chunks(
    conn: Connection,
    link: Link,
    arr: Array,
    raw: bytes,
    scope: dict[str, Any],
    start: int,
    want: int,
) -> int:
    """Load into ``arr`` (not in the staging region) in chunks, several in flight (under the
    lock): the service fills slices while the client copies another out."""
    lay = conn.layout
    step, depth = slices(conn, link)
    tokens_of = token_fields(link, raw)
    chunks = list(range(0, want, step))
    pending: deque[int] = deque()

    def ask(k: int) -> bool:
        pos = chunks[k]
        n = min(step, want - pos)
        extra, toks = tokens_of(start + pos + n)
        off = (k % depth) * step * lay.bytes_per_token
        req_id = conn.send_request(
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
            reply = conn.await_reply("load", pending.popleft())
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
        conn.drain("load", pending)
