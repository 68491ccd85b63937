"""Two OS processes ("nodes"), each with its own host tier, share one Redis tier.

Node A stores a prompt's KV and flushes its write-through; node B -- a separate process that has
never seen the prompt -- finds the prefix in the shared tier and loads it byte-identical.
"""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest

pytestmark = [pytest.mark.server, pytest.mark.timeout(180)]

NODE = r"""
import sys
import numpy as np
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.redis import RedisOptions, RedisTier
from kvtier.tiers.secure import BlockSealer

role, url, prefix, path = sys.argv[1:5]
lay = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
shared = RedisTier(lay, RedisOptions(url=url), prefix=prefix,
                   sealer=BlockSealer(lay, bytes(range(32))))
tiers = [HostTier(lay, 64 * lay.block_bytes), shared]
data = np.load(path)
tokens, kv = data["tokens"], data["kv"]
with TieredStore(lay, tiers, tenant="acme", model_id="m") as store:
    if role == "a":
        assert store.store(tokens, kv) == len(tokens)
        store.flush()
        print("stored", store.lookup(tokens))
    else:
        n = store.lookup(tokens)
        out = np.zeros_like(kv)
        got = store.load(tokens, out)
        same = bool(np.array_equal(out.view(np.uint16), kv.view(np.uint16)))
        print("loaded", n, got, same, ",".join(sorted(set(store.locate(tokens)))))
"""


def _node(role: str, url: str, prefix: str, path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", NODE, role, url, prefix, str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def test_prefix_stored_by_node_a_loads_on_node_b(redis_url: str, tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    n = 16 * 6
    tokens = rng.integers(0, 100_000, size=n)
    kv = rng.integers(0, 2**16, size=(2, 2, n, 2, 16), dtype=np.uint16).view(np.float16)
    path = tmp_path / "prompt.npz"
    np.savez(path, tokens=tokens, kv=kv)
    prefix = "xnode" + uuid.uuid4().hex[:8]
    assert _node("a", redis_url, prefix, path) == f"stored {n}"
    assert _node("b", redis_url, prefix, path) == f"loaded {n} {n} True host"
