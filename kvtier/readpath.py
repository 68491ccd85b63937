"""``ReadPath``: how ``TieredStore`` reads -- ``load``, promotion on hit, ``prefetch``, and the
layer-wise ``load_layers``.

A load pins the readable prefix (under the lock), reads it outside the lock on the caller and the
transfer engine's workers, then hands the outcome to the ``Decider``: verified blocks count, the
first failed one is dropped (a miss), lower-tier hits are promoted into the first tier. A tier
that raises is a miss too, never an exception into the inference path.
"""

from __future__ import annotations

from itertools import islice
from typing import Any

from kvtier.decider import Read
from kvtier.errors import LayoutError
from kvtier.keys import Namespace, TokenIds, iter_keys
from kvtier.kvarray import host_array
from kvtier.layerload import LayerLoad, start_layer_load
from kvtier.moves import Move
from kvtier.store_core import StoreCore, log
from kvtier.tiers.base import Array


class ReadPath(StoreCore):
    """The read half of ``TieredStore`` (see the module docstring)."""

    # -- load ------------------------------------------------------------------------------
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
        """Fill ``out`` with the cached blocks of ``tokens`` from ``start``; return the end
        ``n`` of what was loaded (tokens, ``start`` when nothing): ``out[:, :, : n - start]``
        holds tokens ``[start, n)``.

        ``out`` is a writable host array ``[layers, kv_factor, m, kv_heads, head_dim]`` in the
        layout's storage dtype (or a CPU torch tensor) with room for every full block of
        ``tokens`` after ``start`` (``LayoutError`` otherwise); pass ``tokens[:end]`` to load
        less. ``start`` (a multiple of ``block_tokens``) skips blocks the engine already holds;
        they need not be cached here. Tokens beyond ``n`` in ``out`` are unspecified. Only
        verified blocks count.
        """
        self._check_open()
        toks = TokenIds(tokens)
        arr = host_array(out, self.layout, "out", writable=True)
        ns = self.namespace(tenant, adapter, salt)
        first = self._first_block(start, toks)
        bt = self.layout.block_tokens
        limit = len(toks) // bt
        if arr.shape[2] < (limit - first) * bt:
            raise LayoutError(
                f"out holds {arr.shape[2]} tokens but the {len(toks)} tokens given cover "
                f"{(limit - first) * bt} tokens of full blocks from {start}; pass a larger out "
                f"or tokens[:{start + arr.shape[2]}]"
            )
        done = first
        for _ in range(3):  # a block moved by a finishing demotion is re-read from its new tier
            got, retry = self._load_pass(ns, toks, arr, done, limit, first)
            done += got
            if not retry or done >= limit:
                break
            self._engine.wait_idle(timeout=5.0)  # rare: let the move that raced us finish
        with self._lock:
            self._decider.count_load(ns.tenant, done - first, limit - first)
        return done * self.layout.block_tokens

    def _load_pass(
        self, ns: Namespace, toks: TokenIds, arr: Array, first: int, limit: int, base: int
    ) -> tuple[int, bool]:
        """Load blocks ``first..`` into ``arr`` (whose token 0 is block ``base``'s); return
        (blocks loaded, worth retrying)."""
        self._poll()
        with self._lock:
            reads = self._decider.readable_prefix(
                islice(iter_keys(ns, toks), first, None), limit - first
            )
            self._index.pin([r.key for r in reads])
        reads += self._shared_extension(ns, toks, first + len(reads), limit)
        views = self._views(arr, len(reads), first - base)
        try:
            ok = self._read_blocks(reads, views, ns.owner)
        except Exception:  # a tier broke its contract: a miss for the engine, not a crash
            log.exception("load: a tier raised; serving the blocks as misses")
            ok = [False] * len(reads)
        except BaseException:  # KeyboardInterrupt & co: release the pins, then propagate
            with self._lock:
                self._index.unpin([r.key for r in reads if r.pinned])
            raise
        n = ok.index(False) if False in ok else len(ok)
        with self._lock:
            promote, retry = self._decider.finish_load(reads, ok, n, ns.tenant)
        if n < len(reads) and not retry and reads[n].tier not in self._shared:
            # keep a local tier in step with the index's drop; a shared tier drops what it
            # finds corrupt itself, and keeps what this node merely cannot open (another key)
            failed = reads[n]
            self.tiers[failed.tier].delete([failed.key], ns.owner)
        if promote:
            self._promote([reads[i] for i in promote], [views[i] for i in promote], ns.owner)
        return n, retry

    def _read_blocks(self, reads: list[Read], views: list[Array], owner: str) -> list[bool]:
        ok: list[bool] = []
        start = 0
        while start < len(reads):  # one parallel batch per run of blocks from the same tier
            tier = reads[start].tier
            end = start
            while end < len(reads) and reads[end].tier == tier:
                end += 1
            src = self.tiers[tier]
            items = list(zip(reads[start:end], views[start:end], strict=True))
            ok += self._engine.run_parallel(
                lambda part, src=src: src.get_into(  # type: ignore[misc]
                    [r.key for r, _ in part], [v for _, v in part], owner
                ),
                items,
            )
            if not all(ok):
                ok += [False] * (len(reads) - len(ok))
                break
            start = end
        return ok

    def _promote(self, reads: list[Read], views: list[Array], owner: str) -> None:
        """Copy blocks just loaded from a lower tier into the first tier.

        If the first tier has room now, the copy is made from ``views`` (already in host
        memory) before returning; otherwise the promotion is a background job that first makes
        room (demoting victims) and then re-reads the blocks -- the load path never waits on a
        demotion.
        """
        idx = self._index
        moves: list[Move] = []
        with self._lock:
            todo = [
                (r.key, v)
                for r, v in zip(reads, views, strict=True)
                if (e := idx.entries.get(r.key)) is not None and not (e.tiers | e.pending) & 1
            ]
            if idx.free(0) < len(todo):
                wanted = {k for k, _ in todo}
                moves = self._decider.plan_fetch([r for r in reads if r.key in wanted], owner)
                todo = []
            for k, _ in todo:
                idx.begin_write(k, 0)
        self._submit("promote", moves)
        if not todo:
            return
        first = self.tiers[0]
        ok = [False] * len(todo)
        try:
            ok = self._engine.run_parallel(
                lambda part: first.put([k for k, _ in part], [v for _, v in part], owner), todo
            )
        except Exception:
            log.exception("promotion into %s failed", first.name)
        finally:
            if not all(ok):  # what a raising put wrote is not indexed: free its slots
                first.delete([k for (k, _), g in zip(todo, ok, strict=True) if not g], owner)
            with self._lock:
                idx.end_write([k for k, _ in todo], 0, ok)
                self._decider.counters.promotions += sum(ok)

    # -- layer-wise load (the logic lives in kvtier/layerload.py) ------------------------------
    def load_layers(
        self,
        tokens: Any,
        out: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
    ) -> LayerLoad:
        """Start loading the cached prefix of ``tokens`` into ``out`` one layer at a time.

        Same arguments as ``load`` (from the first block). Returns a ``LayerLoad`` at once:
        ``wait(i)`` blocks until layer ``i`` of the ``tokens`` streamed tokens is in ``out``
        (UNVERIFIED bytes); ``verify()`` waits for the end, checks every block's checksum,
        unpins and returns the leading tokens verified -- the caller must call it and discard
        anything computed from later tokens. Falls back to a whole-block ``load`` (already
        verified) when a block's tier cannot read single layers.
        """
        return start_layer_load(self, tokens, out, self.namespace(tenant, adapter, salt))

    def prefetch(
        self,
        tokens: Any,
        tenant: str | None = None,
        *,
        adapter: str | None = None,
        salt: str | bytes | None = None,
        start: int = 0,
    ) -> int:
        """Start bringing the cached blocks of ``tokens`` from ``start`` up into the first
        tier; return how many tokens' blocks were scheduled. Asynchronous: ``flush()`` waits
        for it."""
        self._check_open()
        toks = TokenIds(tokens)
        ns = self.namespace(tenant, adapter, salt)
        first = self._first_block(start, toks)
        limit = len(toks) // self.layout.block_tokens
        self._poll()
        with self._lock:
            reads = self._decider.readable_prefix(
                islice(iter_keys(ns, toks), first, None), limit - first
            )
        shared = self._shared_extension(ns, toks, first + len(reads), limit)
        with self._lock:
            for r in shared:
                self._index.add_present([r.key], r.tier)
            todo = [
                r
                for r in reads + shared
                if (e := self._index.entries.get(r.key)) is not None
                and not (e.tiers | e.pending) & 1
            ]
            moves = self._decider.plan_fetch(todo, ns.owner)
        self._submit("promote", moves)
        return sum(len(m.keys) for m in moves if m.dst == 0) * self.layout.block_tokens
