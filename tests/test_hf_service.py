"""The HF integration's store from config: in-process, or a client of a real ``kvtier serve``.

A tiny random Llama (4 layers, hidden 128, GQA 4:2) on CPU in fp32, blocks of 16 tokens; every
output is compared, tokens and logits, with a plain forward (``generate_reference``).
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
pytest.importorskip("zmq")

from kvtier.errors import ConfigError  # noqa: E402
from kvtier.integrations import hf, hf_cache  # noqa: E402
from kvtier.integrations.hf_store import open_model_store  # noqa: E402
from kvtier.integrations.models import ModelSpec, random_model  # noqa: E402
from kvtier.layout import KVLayout  # noqa: E402
from kvtier.store import TieredStore  # noqa: E402
from tests.service_helpers import ServiceProc, env  # noqa: E402

BT = 16
N = 75  # 4 full blocks and a tail
PROC = Path(__file__).resolve().parent / "hf_engine_proc.py"


@pytest.fixture(scope="module")
def model() -> Any:
    return random_model(ModelSpec(arch="llama", seed=1))  # the model hf_engine_proc.py builds


@pytest.fixture
def service(model: Any) -> Iterator[ServiceProc]:
    svc = ServiceProc(layout=hf_cache.model_layout(model, BT), host="4MiB", timeout=5.0,
                      lease_ttl=10.0)  # fmt: skip
    svc.start()
    yield svc
    svc.cleanup()


def _ids() -> np.ndarray[Any, Any]:
    return np.random.default_rng(4).integers(0, 1024, N).astype(np.int64)  # as hf_engine_proc


def _same(got: hf.Generation, ref: hf.Generation) -> bool:
    return got.tokens == ref.tokens and bool(torch.equal(got.logits, ref.logits))


def _config(tmp_path: Path, url: str) -> Path:
    conf = tmp_path / "kvtier.toml"  # no layout keys: the model supplies them
    conf.write_text(
        f'[store]\nmodel_id = "random-llama"\nblock_tokens = {BT}\n[service]\nurl = "{url}"\n'
    )
    return conf


def test_in_process_store_from_a_config_without_layout_keys(model: Any) -> None:
    cfg = {
        "store": {"model_id": "random-llama", "block_tokens": BT},
        "tiers": [{"kind": "host", "capacity": "4MiB"}],
    }
    ref = hf.generate_reference(model, _ids(), 6)
    with open_model_store(model, cfg) as store:
        assert isinstance(store, TieredStore)
        assert store.layout == hf_cache.model_layout(model, BT)
        assert _same(hf.generate_with_cache(model, store, _ids(), 6), ref)
        again = hf.generate_with_cache(model, store, _ids(), 6)
        assert again.n_reused == N - hf.MIN_RECOMPUTE and _same(again, ref)


def test_two_engines_share_a_prefix_through_the_service(
    model: Any, service: ServiceProc, tmp_path: Path
) -> None:
    conf = _config(tmp_path, service.url)
    ref = hf.generate_reference(model, _ids(), 6)
    with open_model_store(model, conf, name="hf-a") as a:  # engine A: computes, stores
        assert type(a).__name__ == "ServiceClient"
        first = hf.generate_with_cache(model, a, _ids(), 6)
        assert first.n_reused == 0 and _same(first, ref)
    with open_model_store(model, conf, name="hf-b") as b:  # engine B: its own session
        got = hf.generate_with_cache(model, b, _ids(), 6)
        assert got.n_reused == N - hf.MIN_RECOMPUTE and set(got.sources) == {"host"}
        assert _same(got, ref)
        with pytest.raises(ConfigError, match="layerwise"):  # not offered over the service
            hf.generate_with_cache(model, b, _ids(), 6, layerwise=True)


def test_a_service_of_another_layout_is_refused_with_the_keys_to_set(
    model: Any, tmp_path: Path
) -> None:
    own = hf_cache.model_layout(model, BT)
    other = KVLayout(own.layers, own.kv_heads, 2 * own.head_dim, own.dtype, 1, BT)  # vLLM-like
    svc = ServiceProc(layout=other)
    try:
        svc.start()
        with pytest.raises(ConfigError, match=r"needs \[store\] .*kv_factor = 2"):
            open_model_store(model, _config(tmp_path, svc.url))
    finally:
        svc.cleanup()
    with pytest.raises(ConfigError, match="model_id"):
        open_model_store(model, {"store": {"block_tokens": BT}})


@pytest.mark.slow  # another process importing torch and transformers (~20-45 s on 2 cores)
def test_another_process_is_served_this_ones_prefix(
    model: Any, service: ServiceProc, tmp_path: Path
) -> None:
    conf = _config(tmp_path, service.url)
    with open_model_store(model, conf, name="hf-here") as here:
        assert hf.generate_with_cache(model, here, _ids(), 6).n_reused == 0
    out = subprocess.run(
        [sys.executable, str(PROC), str(conf), str(N)],
        env=env(), capture_output=True, text=True, timeout=300, check=True,
    )  # fmt: skip
    assert out.stdout.split() == ["hf", str(N - hf.MIN_RECOMPUTE), "True"]
