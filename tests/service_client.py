"""A client process of ``kvtier serve`` for the service tests (started and killed by them).

``service_client.py URL MODE ARGS``; every mode prints progress lines on stdout:

- ``store FIRST COUNT TOKENS``: store prompts FIRST.. (``COUNT`` of them, forever if 0);
  prints ``stored i`` after each, then ``done``.
- ``load FIRST COUNT TOKENS``: load prompts, check every loaded byte; ``loaded i n`` / ``bad i``.
- ``lease I TOKENS``: store prompt I, lease it, print ``held END``, then sleep until killed.
- ``model MODEL_ID I TOKENS``: as another identity, print ``lookup END`` for prompt I.
- ``stall-store I TOKENS``: reserve arena slots for prompt I, copy half its blocks into them,
  print ``reserved N`` (slots), then sleep until killed (never commits).
- ``stall-load I TOKENS``: store prompt I, acquire its arena slots for a load, copy them out,
  print ``acquired N``, then sleep until killed (never reports the load done).
- ``hf TOKENS``: an HF transformers engine (a tiny random Llama on CPU) generating from a
  fixed prompt through the service; prints ``hf N_REUSED SAME`` (``SAME``: tokens and logits
  identical to a plain run).
"""

from __future__ import annotations

import itertools
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from kvtier.service.arena_io import ArenaCopier
from kvtier.service.client import ServiceClient, connect
from tests.service_helpers import HF_BLOCK_TOKENS, LAYOUT, prompt


def main(argv: list[str]) -> int:
    url, mode, *rest = argv
    if mode == "model":
        with connect(url, model_id=rest[0], timeout=5.0) as c:
            tokens, kv = prompt(int(rest[1]), int(rest[2]))
            print(f"lookup {c.lookup(tokens)}", flush=True)
            out = np.zeros_like(kv)
            print(f"load {c.load(tokens, out)}", flush=True)
        return 0
    if mode == "hf":
        return _hf(url, int(rest[0]))
    client = connect(url, timeout=5.0, layout=LAYOUT, name=f"test-{mode}")
    if mode in ("stall-store", "stall-load"):
        return _stall(client, mode, int(rest[0]), int(rest[1]))
    if mode == "lease":
        tokens, kv = prompt(int(rest[0]), int(rest[1]))
        client.store(tokens, kv)
        lease = client.lease(tokens)
        print(f"held {lease.end}", flush=True)
        time.sleep(300)  # until killed (a bound, should a test fail to)
        return 0
    first, count, n = (int(x) for x in rest)
    ids = itertools.count(first) if count == 0 else range(first, first + count)
    for i in ids:
        tokens, kv = prompt(i, n)
        if mode == "store":
            client.store(tokens, kv)
            print(f"stored {i}", flush=True)
        else:
            out = np.zeros_like(kv)
            end = client.load(tokens, out)
            ok = np.array_equal(out[:, :, :end], kv[:, :, :end])
            print(f"{'loaded' if ok else 'bad'} {i} {end}", flush=True)
    print("done", flush=True)
    client.close()
    return 0


def _stall(client: ServiceClient, mode: str, i: int, n: int) -> int:
    """The first half of a direct transfer, by hand (``kvtier.service.arena_io`` does both)."""
    tokens, kv = prompt(i, n)
    raw = np.asarray(tokens, "<u4").tobytes()
    bt = LAYOUT.block_tokens
    link = client.link
    assert link is not None and link.arena is not None, "the service must be in arena mode"
    copier = ArenaCopier(LAYOUT)
    if mode == "stall-store":
        reply = client.call("reserve", {"start": 0, "n": n // bt * bt}, raw)
        assert reply is not None and "slots" in reply, reply
        half = len(reply["slots"]) // 2
        blocks = [kv[:, :, p * bt : (p + 1) * bt] for p in reply["blocks"][:half]]
        copier.copy_in(link.arena, blocks, reply["slots"][:half])
        print(f"reserved {len(reply['slots'])}", flush=True)
    else:
        client.store(tokens, kv)
        reply = client.call("acquire", {"start": 0}, raw)
        assert reply is not None and reply["slots"], reply
        outs = [np.empty(LAYOUT.kv_shape(bt), np.float16) for _ in reply["slots"]]
        sums = np.frombuffer(reply["sums"], "<u8").tolist()
        copier.copy_out(link.arena, outs, reply["slots"], sums)
        print(f"acquired {len(reply['slots'])}", flush=True)
    time.sleep(300)  # until killed (a bound, should a test fail to)
    return 0


def _hf(url: str, n: int) -> int:
    import torch

    from kvtier.integrations import hf, hf_cache
    from kvtier.integrations.models import ModelSpec, random_model

    model = random_model(ModelSpec(arch="llama", seed=1))
    ids = np.random.default_rng(4).integers(0, 1024, n).astype(np.int64)
    with connect(
        url,
        identity=hf_cache.model_identity(model, "random-llama"),
        layout=hf_cache.model_layout(model, HF_BLOCK_TOKENS),
        timeout=10.0,
        name="test-hf",
    ) as client:
        got = hf.generate_with_cache(model, client, ids, 6)
    ref = hf.generate_reference(model, ids, 6)
    same = got.tokens == ref.tokens and bool(torch.equal(got.logits, ref.logits))
    print(f"hf {got.n_reused} {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
