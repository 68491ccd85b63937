"""Layer-wise loads: stream a cached prefix into a buffer one layer at a time, verify at the end.

``TieredStore.load_layers`` starts a ``LayerLoad``: the leading readable blocks are pinned, and
a worker thread reads layer 0 of every block, then layer 1, ... (``Tier.get_layer_into``), so
a model can run layer ``i`` as soon as ``wait(i)`` returns while later layers are still being
read. Blocks are layer-major, so one layer of a block is a contiguous range of its payload; the
checksum a tier records covers the whole payload, so no layer can be verified on its own.

Integrity rule: the bytes handed out by ``wait`` are *unverified*. The worker hashes each
block's layers in order as they arrive (xxh3 streaming over the C-order bytes equals the hash of
the whole payload); ``verify()`` compares with the checksum the tier recorded and returns the
number of leading tokens that match. The caller must call ``verify()`` (always: it also unpins
the blocks) and must discard anything computed from tokens beyond that number before returning
a result. A block that fails is a miss, dropped like in ``load``; verified blocks from a lower
tier are promoted like in ``load``.

When a block's tier cannot read single layers (``Tier.layer_reads`` False), or shared tiers are
configured, ``load_layers`` falls back to a whole-block ``load``: the result is a ``LayerLoad``
whose layers are all ready and already verified.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import xxhash

from kvtier.decider import Read
from kvtier.errors import LayoutError
from kvtier.keys import Namespace, TokenIds, iter_keys
from kvtier.kvarray import host_array
from kvtier.tiers.base import Array

if TYPE_CHECKING:
    from kvtier.readpath import ReadPath

log = logging.getLogger(__name__)


def _chunks(a: Array) -> Iterator[Array]:
    """Contiguous uint8 pieces of ``a`` in C order (for streaming hashes)."""
    if a.flags.c_contiguous:
        yield a.reshape(-1).view(np.uint8)
    elif a.ndim >= 2:
        for i in range(a.shape[0]):
            yield from _chunks(a[i])
    else:
        yield np.ascontiguousarray(a).view(np.uint8)


class LayerLoad:
    """A load in progress. ``tokens``: tokens being streamed (what ``wait`` fills); the
    verified count, possibly smaller, comes from ``verify()``."""

    def __init__(self, layers: int, tokens: int) -> None:
        self.layers = layers
        self.tokens = tokens
        self.streamed = False  # False: a whole-block fallback, already complete and verified
        self._ready = 0  # layers complete
        self._cond = threading.Condition()
        self._verified: int | None = None
        self._thread: threading.Thread | None = None
        self._finish: Any = None  # () -> int, run once by verify()

    @classmethod
    def complete(cls, layers: int, tokens: int) -> LayerLoad:
        ll = cls(layers, tokens)
        ll._ready = layers
        ll._verified = tokens
        return ll

    def _mark(self, n_layers: int) -> None:
        with self._cond:
            self._ready = max(self._ready, n_layers)
            self._cond.notify_all()

    def wait(self, layer: int) -> None:
        """Block until layer ``layer`` of every streamed block is in the buffer (unverified)."""
        with self._cond:
            self._cond.wait_for(lambda: self._ready > layer)

    def verify(self) -> int:
        """Wait for the whole load, check every block's checksum, unpin; return the leading
        tokens whose bytes are verified (idempotent)."""
        if self._verified is None:
            if self._thread is not None:
                self._thread.join()
            self._verified = int(self._finish())
        return self._verified


def start_layer_load(store: ReadPath, tokens: Any, out: Any, ns: Namespace) -> LayerLoad:
    """``TieredStore.load_layers`` (see the module docs)."""
    store._check_open()
    layout = store.layout
    toks = TokenIds(tokens)
    arr = host_array(out, layout, "out", writable=True)
    bt = layout.block_tokens
    limit = len(toks) // bt
    if arr.shape[2] < limit * bt:
        raise LayoutError(
            f"out holds {arr.shape[2]} tokens but the {len(toks)} tokens given cover "
            f"{limit * bt} tokens of full blocks"
        )
    store._poll()
    with store._lock:
        reads = store._decider.readable_prefix(iter_keys(ns, toks), limit)
        tiers = [store.tiers[r.tier] for r in reads]
        streamable = bool(reads) and not store._shared and all(t.layer_reads for t in tiers)
        if streamable:
            store._index.pin([r.key for r in reads])
    if not streamable:
        got = store.load(tokens, out, ns.tenant, adapter=ns.scope.adapter, salt=ns.scope.salt)
        return LayerLoad.complete(layout.layers, got)
    views = store._views(arr, len(reads))
    ll = LayerLoad(layout.layers, len(reads) * bt)
    ll.streamed = True
    csums: list[int | None] = [None] * len(reads)
    hashers = [xxhash.xxh3_64() for _ in reads]
    state = {"good": len(reads)}  # blocks [0, good) still candidates

    def read_all() -> None:
        try:
            for layer in range(layout.layers):
                _read_layer(layer)
                ll._mark(layer + 1)
        except BaseException as exc:  # never hang a waiter; the load becomes a miss
            log.error("layer-wise load failed: %r", exc)
            state["good"] = 0
        finally:
            ll._mark(layout.layers)

    def _read_layer(layer: int) -> None:
        start_b = 0
        good = state["good"]
        while start_b < good:  # one call per run of blocks from the same tier
            end = start_b
            while end < good and reads[end].tier == reads[start_b].tier:
                end += 1
            got = tiers[start_b].get_layer_into(
                [r.key for r in reads[start_b:end]],
                layer,
                [v[layer] for v in views[start_b:end]],
                ns.owner,
            )
            for b, c in enumerate(got, start_b):
                if c is None or (csums[b] is not None and csums[b] != c):
                    state["good"] = good = min(good, b)
                    break
                csums[b] = c
                for piece in _chunks(views[b][layer]):
                    hashers[b].update(piece.data)
            start_b = end

    def finish() -> int:
        good = state["good"]
        ok = [b < good and hashers[b].intdigest() == csums[b] for b in range(len(reads))]
        n = ok.index(False) if False in ok else len(ok)
        if n < good:  # bytes that do not hash to the recorded checksum: corrupt in that tier
            log.warning("layer-wise load: block %d failed verification; dropped", n)
            tiers[n].delete([reads[n].key], ns.owner)
        return _finish_load(store, reads, views, ok, n, limit, ns)

    ll._finish = finish
    ll._thread = threading.Thread(target=read_all, name="kvtier-layers", daemon=True)
    ll._thread.start()
    return ll


def _finish_load(
    store: ReadPath,
    reads: list[Read],
    views: list[Array],
    ok: list[bool],
    n: int,
    asked: int,
    ns: Namespace,
) -> int:
    """Unpin, account, drop the failed block and promote like ``TieredStore.load`` does."""
    with store._lock:
        promote, _ = store._decider.finish_load(reads, ok, n, ns.tenant)
        store._decider.count_load(ns.tenant, n, asked)
    if promote:
        store._promote([reads[i] for i in promote], [views[i] for i in promote], ns.owner)
    return n * store.layout.block_tokens


__all__ = ["LayerLoad", "start_layer_load"]
