"""Two OS processes ("nodes"), each with its own host tier, share one cluster tier.

Node A stores a prompt's KV and flushes its write-through; node B -- a separate process that has
never seen the prompt -- finds the prefix in the shared tier and loads it byte-identical. Run
against the Redis tier and the Mooncake Store tier, blocks encrypted; the shared tier is built
from its config table (``make_tier``), as a deployment would.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.mooncake_server import MooncakeCluster

pytestmark = [pytest.mark.server, pytest.mark.timeout(180)]

NODE = r"""
import json
import sys
import numpy as np
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.host import HostTier
from kvtier.tiers.registry import make_tier

role, spec, path = sys.argv[1:4]
lay = KVLayout(layers=2, kv_heads=2, head_dim=16, dtype="float16", block_tokens=16)
tiers = [HostTier(lay, 64 * lay.block_bytes), make_tier(lay, json.loads(spec))]
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


def _node(role: str, spec: dict[str, Any], path: Path) -> str:
    proc = subprocess.run(
        [sys.executable, "-c", NODE, role, json.dumps(spec), str(path)],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


@pytest.fixture(params=["redis", "mooncake"])
def shared_spec(request: pytest.FixtureRequest) -> dict[str, Any]:
    """The ``[[tiers]]`` table of the shared tier, with a fresh prefix and a master key."""
    spec: dict[str, Any] = {"prefix": "xnode" + uuid.uuid4().hex[:8], "encryption_key": "5a" * 32}
    if request.param == "redis":
        return {"kind": "redis", "url": request.getfixturevalue("redis_url"), **spec}
    cluster: MooncakeCluster = request.getfixturevalue("mooncake_cluster")
    return {
        "kind": "mooncake",
        "master": cluster.address,
        "segment_size": 0,
        "buffer_size": "1MiB",
        **spec,
    }


def test_prefix_stored_by_node_a_loads_on_node_b(
    shared_spec: dict[str, Any], tmp_path: Path
) -> None:
    rng = np.random.default_rng(1)
    n = 16 * 6
    tokens = rng.integers(0, 100_000, size=n)
    kv = rng.integers(0, 2**16, size=(2, 2, n, 2, 16), dtype=np.uint16).view(np.float16)
    path = tmp_path / "prompt.npz"
    np.savez(path, tokens=tokens, kv=kv)
    assert _node("a", shared_spec, path) == f"stored {n}"
    assert _node("b", shared_spec, path) == f"loaded {n} {n} True host"
