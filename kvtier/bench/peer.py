"""The store's whole path through a shared tier, seen from a second process (another node).

``WholePath`` gives a server bench two more steps per round:

- ``write_through``: ``TieredStore.store()`` of ``blocks`` new blocks into a store whose first
  tier is host DRAM and whose second is the shared tier, until a *second process* -- its own
  ``TieredStore`` over the same shared tier, polling ``lookup`` (asleep for twice each lookup's
  time between lookups, so watching takes at most a third of the server) -- sees every block.
  The time runs from just before ``store()`` to the peer's first full hit (``time.monotonic``:
  one clock for every process of the machine), so it covers the host write, the write-through
  job (staging, sealing, the tier's batches) and the server's acknowledgement;
- ``read_path``: the peer ``load()``s the same tokens into its own buffer (a miss in its host
  tier, so every block comes from the shared tier, is verified and is promoted), timed inside
  the peer; the loaded bytes are checked against what was stored.

The peer is ``python -m kvtier.bench.peer`` speaking one JSON object per line on stdin/stdout.
It builds its shared tier with the bench module's ``peer_tier(layout, spec)`` from the same
``spec`` (plain JSON: addresses, prefix, keys as hex) the parent used, so both store processes
derive the same keys and open each other's values.
"""

from __future__ import annotations

import importlib
import json
import subprocess
import sys
import time
from collections.abc import Callable
from itertools import islice
from typing import IO, Any

import numpy as np
import xxhash

from kvtier.bench.remote import Step
from kvtier.keys import TokenIds, iter_keys
from kvtier.layout import KVLayout
from kvtier.store import TieredStore
from kvtier.tiers.base import Tier
from kvtier.tiers.host import HostTier

MODEL_ID = "kvtier-bench"
POLL_S = 0.0005  # the peer's shortest lookup interval: a small fraction of any step here
WAIT_S = 120.0


def bench_store(layout: KVLayout, shared: Tier, blocks: int) -> TieredStore:
    """The store both processes run: a host tier holding ``blocks`` (no eviction within a
    round), then the shared tier (written through)."""
    host = HostTier(layout, (blocks + 1) * layout.block_bytes, pin_memory="never")
    return TieredStore(layout, [host, shared], model_id=MODEL_ID)


def round_tokens(layout: KVLayout, r: int, blocks: int) -> Any:
    """Round ``r``'s prompt: distinct per round, the same in both processes."""
    rng = np.random.default_rng(10_000 + r)
    return rng.integers(0, 32_000, blocks * layout.block_tokens, dtype=np.int64)


def digest(a: Any) -> str:
    return xxhash.xxh3_128_hexdigest(np.ascontiguousarray(a).data)


class WholePath:
    """The parent side: the writing store and the peer process. Close it (``close``)."""

    def __init__(
        self,
        layout: KVLayout,
        module: str,
        make_tier: Callable[[], Tier],
        spec: dict[str, Any],
        blocks: int,
    ) -> None:
        self.layout, self.blocks = layout, blocks
        self.make_tier = make_tier
        rng = np.random.default_rng(3)
        self.kv = rng.integers(0, 2**16, size=layout.kv_shape(blocks * layout.block_tokens),
                               dtype=np.uint16).view(layout.storage_dtype)  # fmt: skip
        self.want = digest(self.kv)
        hello = {"module": module, "spec": spec, "layout": _layout_json(layout), "blocks": blocks}
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvtier.bench.peer"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self._ask(hello)
        self.loaded_ok = True

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"benchmark: the peer process exited ({self.proc.wait()})")
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"benchmark: peer: {reply['error']}")
        return reply

    def steps(self, r: int) -> tuple[dict[str, Step], dict[str, Step], Callable[[], None]]:
        """Round ``r``'s write step, read step and cleanup (a fresh store on both sides)."""
        toks = round_tokens(self.layout, r, self.blocks)
        tier = self.make_tier()
        store = bench_store(self.layout, tier, self.blocks)
        store.lookup(toks)  # connects to the server outside the timed part (a miss)

        def write_through() -> float:
            self._ask({"op": "watch", "round": r})  # the peer polls from now on
            t0 = time.monotonic()
            if store.store(toks, self.kv) != len(toks):
                raise RuntimeError("benchmark: store() did not take every block")
            seen = float(self._ask({"op": "seen"})["seen"])
            return seen - t0

        def read_path() -> float:
            got = self._ask({"op": "load", "round": r})
            self.loaded_ok = self.loaded_ok and got["digest"] == self.want
            return float(got["load_s"])

        def cleanup() -> None:
            try:
                store.flush()
                ns = store.namespace(None)
                keys = list(islice(iter_keys(ns, TokenIds(toks)), self.blocks))
                tier.delete(keys, ns.owner)
                self._ask({"op": "drop"})
            finally:
                store.close()

        return {"write_through": write_through}, {"read_path": read_path}, cleanup

    def close(self) -> None:
        try:
            self._ask({"op": "close"})
        finally:
            self.proc.wait(30)


def _layout_json(layout: KVLayout) -> dict[str, Any]:
    return {
        "layers": layout.layers,
        "kv_heads": layout.kv_heads,
        "head_dim": layout.head_dim,
        "dtype": layout.dtype,
        "kv_factor": layout.kv_factor,
        "block_tokens": layout.block_tokens,
    }


def _serve(inp: IO[str], out: IO[str]) -> None:
    """The peer's loop: one request per line, one reply per line."""

    def reply(obj: dict[str, Any]) -> None:
        out.write(json.dumps(obj) + "\n")
        out.flush()

    hello = json.loads(inp.readline())
    layout = KVLayout(**hello["layout"])
    blocks = int(hello["blocks"])
    make = importlib.import_module(hello["module"]).peer_tier
    spec = hello["spec"]
    buf = np.empty(layout.kv_shape(blocks * layout.block_tokens), layout.storage_dtype)
    buf.fill(0)  # page-touched once, outside every timed step
    store: TieredStore | None = None
    toks: Any = None
    reply({"ok": True})
    for line in inp:
        msg = json.loads(line)
        op = msg["op"]
        try:
            if op == "watch":
                if store is None:
                    store = bench_store(layout, make(layout, spec), blocks)
                toks = round_tokens(layout, int(msg["round"]), blocks)
                reply({"ok": True})
                deadline = time.monotonic() + WAIT_S
                while True:
                    t0 = time.monotonic()
                    if store.lookup(toks) == len(toks):
                        break
                    if t0 > deadline:
                        raise RuntimeError("the written blocks never became visible")
                    # the watcher keeps at most about a third of the server's time
                    time.sleep(max(POLL_S, 2 * (time.monotonic() - t0)))
                seen = time.monotonic()
                if json.loads(inp.readline())["op"] != "seen":
                    raise RuntimeError("protocol: expected 'seen'")
                reply({"seen": seen})
            elif op == "load":
                assert store is not None
                toks = round_tokens(layout, int(msg["round"]), blocks)
                buf.fill(0)
                t0 = time.perf_counter()
                got = store.load(toks, buf)
                dt = time.perf_counter() - t0
                if got != len(toks):
                    raise RuntimeError(f"loaded {got} of {len(toks)} tokens")
                reply({"load_s": dt, "digest": digest(buf)})
            elif op == "drop":  # a fresh store (and host tier) for the next round
                if store is not None:
                    store.close()
                store = None
                reply({"ok": True})
            elif op == "close":
                if store is not None:
                    store.close()
                reply({"ok": True})
                return
        except Exception as exc:  # reported to the parent, which raises it
            reply({"error": f"{op}: {exc!r}"})


if __name__ == "__main__":
    _serve(sys.stdin, sys.stdout)
