"""Small builders shared by the store tests."""

from __future__ import annotations

from typing import Any

import numpy as np

from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier

SMALL = KVLayout(layers=2, kv_heads=2, head_dim=4, dtype="float16", block_tokens=4)


def kv_for(
    tokens: list[int] | np.ndarray[Any, Any], layout: KVLayout = SMALL
) -> np.ndarray[Any, Any]:
    """Deterministic KV for a token sequence: position t of the result depends only on tokens[:t+1],
    like a real model's KV (so equal prefixes give equal KV)."""
    toks = np.asarray(tokens, dtype=np.int64)
    acc = np.cumsum(toks * 2654435761 % 65521)
    base = (acc % 997).astype(np.float32) / 997.0
    shape = layout.kv_shape(len(toks))
    grid = np.arange(shape[0] * shape[1] * shape[3] * shape[4], dtype=np.float32).reshape(
        shape[0], shape[1], 1, shape[3], shape[4]
    )
    return (grid * 0.001 + base.reshape(1, 1, -1, 1, 1)).astype(layout.storage_dtype)


def host_store(
    blocks: int = 16, *, layout: KVLayout = SMALL, lower: int = 0, **kw: Any
) -> TieredStore:
    tiers = [HostTier(layout, blocks * layout.block_bytes)]
    if lower:
        t2 = HostTier(layout, lower * layout.block_bytes)
        t2.name = "host2"
        tiers.append(t2)
    if "identity" not in kw:
        kw.setdefault("model_id", "test-model")
    return TieredStore(layout, tiers, **kw)


def store_documents_then_load_the_last(st: TieredStore, docs: int = 6, blocks: int = 3) -> None:
    """Store ``docs`` documents of ``blocks`` blocks each (SMALL layout), the first token of
    document ``d`` being ``d * 1000``, then load the last one back and check it is all there
    and exact (a policy that keeps the newest document)."""
    n = blocks * SMALL.block_tokens
    for doc in range(docs):
        tokens = [doc * 1000 + i for i in range(n)]
        st.store(tokens, kv_for(tokens))
    out = np.zeros(SMALL.kv_shape(n), SMALL.storage_dtype)
    assert st.load(tokens, out) == n  # the newest document is still there
    assert np.array_equal(out, kv_for(tokens))
