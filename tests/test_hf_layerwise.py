"""Layer-wise loading in the HF integration: the model's layer i waits for layer i of the
streamed prefix; the output is bit-identical to a plain run, also when a streamed block turns
out corrupt (caught by verification before the result is returned: a miss and a recompute)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from kvtier.identity import Identity  # noqa: E402
from kvtier.integrations import hf, hf_cache  # noqa: E402
from kvtier.integrations.models import ModelSpec, random_model  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from kvtier.tiers.host import HostTier  # noqa: E402
from kvtier.tiers.nvme import NVMeTier  # noqa: E402

BT = 16
NEW = 4


def ident(model: Any) -> Identity:
    return hf_cache.model_identity(model, "random-llama")


@pytest.fixture(scope="module")
def model() -> Any:
    return random_model(ModelSpec(arch="llama", seed=1))


def prompt(n: int, seed: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 1024, n).astype(np.int64)


def assert_same(got: hf.Generation, ref: hf.Generation) -> None:
    assert got.tokens == ref.tokens
    assert torch.equal(got.logits, ref.logits), (got.logits - ref.logits).abs().max()


class NoLayerHost(HostTier):
    layer_reads = False


@pytest.mark.parametrize("kind", ["host", "nvme", "no-layer-reads"])
def test_layerwise_is_bit_identical(model: Any, kind: str, tmp_path: Path) -> None:
    layout = hf_cache.model_layout(model, BT)
    cap = 16 * layout.block_bytes
    tier = {
        "host": lambda: HostTier(layout, cap),
        "nvme": lambda: NVMeTier(layout, [tmp_path], 2 * cap, workers=2),
        "no-layer-reads": lambda: NoLayerHost(layout, cap),
    }[kind]()
    ids = prompt(100, 11)
    ref = hf.generate_reference(model, ids, NEW)
    with TieredStore(layout, [tier], identity=ident(model)) as store:
        hf.generate_with_cache(model, store, ids[:90], 1)
        pre = hf.load_prefix(model, store, ids, layerwise=True)
        assert (pre.stream is None) == (kind == "no-layer-reads")
        if pre.stream is not None:
            pre.stream.verify()  # unpin
        got = hf.generate_with_cache(model, store, ids, NEW, layerwise=True)
        assert got.n_reused == 80
        assert_same(got, ref)


def test_corrupt_block_mid_stream_is_recomputed(model: Any) -> None:
    layout = hf_cache.model_layout(model, BT)
    ids = prompt(100, 12)
    ref = hf.generate_reference(model, ids, NEW)
    with TieredStore(
        layout, [HostTier(layout, 16 * layout.block_bytes)], identity=ident(model)
    ) as store:
        hf.generate_with_cache(model, store, ids[:90], 1, store_generated="none")
        host: Any = store.tiers[0].inner
        slot = host._table.acquire(list(store._index.entries)[2])  # the third block
        host._table.release(slot)
        # garbage the model will use: layer 1's K of the third block
        view = host.slot_view(slot)[layout.layer_block_bytes : layout.layer_block_bytes + 64]
        view[:] = 0x7F
        got = hf.generate_with_cache(model, store, ids, NEW, layerwise=True)
        assert got.n_reused == 32  # the two blocks before the corrupt one
        assert store.stats()["store"]["invalid_blocks"] == 1
        assert_same(got, ref)
