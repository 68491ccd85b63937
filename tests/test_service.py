"""The node-local service with real processes: ``kvtier serve`` and client processes sharing it,
killed with SIGKILL mid-transfer, a service killed and restarted, foreign identities, a busy or
stale socket."""

from __future__ import annotations

import os
import signal
import socket
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import numpy as np
import pytest

pytest.importorskip("zmq")

from kvtier.errors import ConfigError, LayoutError, TokenError
from kvtier.open import open_store
from kvtier.service.client import ServiceClient, connect
from kvtier.service.config import ServiceConfig
from kvtier.store import TieredStore
from tests.service_helpers import (
    LAYOUT,
    ServiceProc,
    client_proc,
    env,
    kill9,
    kill_spawned,
    prompt,
    until,
    wait_line,
)

BT = LAYOUT.block_tokens


@pytest.fixture(autouse=True)
def _no_client_left() -> Iterator[None]:
    yield
    kill_spawned()


@pytest.fixture
def service() -> Iterator[ServiceProc]:
    svc = ServiceProc(host="256KiB", lease_ttl=3.0, timeout=2.0)  # 64 blocks of 4 KiB
    svc.start()
    yield svc
    svc.cleanup()


@pytest.fixture
def client(service: ServiceProc) -> Iterator[ServiceClient]:
    with connect(service.url, timeout=service.timeout) as c:
        yield c


def sessions(c: ServiceClient) -> dict[str, dict[str, object]]:
    """The service's sessions; asked again while a stats call is a miss (a call that timed out
    on a machine too busy to answer in time: the client reconnects)."""
    stats = c.stats()
    deadline = time.monotonic() + 15
    while "service" not in stats and time.monotonic() < deadline:
        time.sleep(0.2)
        stats = c.stats()
    out: dict[str, dict[str, object]] = stats["service"]["sessions"]
    return out


def test_socket_is_owner_only(service: ServiceProc) -> None:
    mode = os.stat(service.sock).st_mode
    assert stat.S_ISSOCK(mode) and mode & 0o777 == 0o600


def test_socket_group_is_configurable() -> None:
    import grp

    group = grp.getgrgid(os.getgid()).gr_name
    svc = ServiceProc(group=group)
    try:
        svc.start()
        st = os.stat(svc.sock)
        assert st.st_mode & 0o777 == 0o660 and st.st_gid == os.getgid()
        with connect(svc.url, timeout=2.0) as c:
            assert c.connected
    finally:
        svc.cleanup()


def test_two_processes_share_a_prefix_byte_identical(
    service: ServiceProc, client: ServiceClient
) -> None:
    writer = client_proc(service.url, "store", 0, 2, 10 * BT + 5)
    wait_line(writer, "done")
    kill9(writer)
    reader = client_proc(service.url, "load", 0, 2, 10 * BT + 5)
    assert wait_line(reader, "loaded 0") == f"loaded 0 {10 * BT}"  # checked byte for byte
    assert wait_line(reader, "loaded 1") == f"loaded 1 {10 * BT}"
    kill9(reader)
    tokens, kv = prompt(0, 10 * BT + 5)  # and in this process, from an offset
    out = np.zeros(LAYOUT.kv_shape(6 * BT), np.float16)
    assert client.load(tokens, out, start=4 * BT) == 10 * BT
    assert np.array_equal(out, kv[:, :, 4 * BT : 10 * BT])


def test_store_and_load_from_the_staging_buffer(client: ServiceClient) -> None:
    tokens, kv = prompt(7, 8 * BT)
    buf = client.buffer(8 * BT)  # the engine gathers straight into the shared region
    buf[...] = kv
    assert client.store(tokens, buf) == 8 * BT
    buf[...] = 0
    assert client.load(tokens, buf) == 8 * BT
    assert np.array_equal(buf, kv)
    # larger than the staging region (64 KiB = 16 blocks): chunked, same bytes
    tokens, kv = prompt(8, 40 * BT)
    assert client.store(tokens, kv) == 40 * BT
    assert [s["leases"] for s in sessions(client).values()] == [0]  # chunk holds released
    out = np.zeros_like(kv)
    assert client.load(tokens, out) == 40 * BT
    assert np.array_equal(out, kv)


def test_long_prompt_from_an_offset(client: ServiceClient) -> None:
    # 77 KiB of token ids: they travel in the staging token area, not in a socket frame
    tokens, _ = prompt(10, 1216 * BT)
    _, kv = prompt(11, 16 * BT)
    start = 1200 * BT  # the engine holds the prefix; only the tail goes to the service
    assert client.store(tokens, kv, start=start) == 16 * BT
    assert client.lookup(tokens, start=start) == 1216 * BT
    assert client.lookup(tokens) == 0  # the prefix itself was never stored
    out = np.zeros_like(kv)
    assert client.load(tokens, out, start=start) == 1216 * BT
    assert np.array_equal(out, kv)
    other = tokens.copy()
    other[5] += 1  # another prefix: other keys for the same tail
    assert client.lookup(other, start=start) == start


def test_open_store_picks_the_mode_from_config(service: ServiceProc) -> None:
    tokens, kv = prompt(12, 2 * BT)
    with open_store(service.config, layout=LAYOUT) as remote:  # [service] url: a client
        assert isinstance(remote, ServiceClient)
        assert remote.store(tokens, kv) == 2 * BT
    local_cfg = {
        "store": {
            "model_id": "test/model",
            "layers": 2,
            "kv_heads": 2,
            "head_dim": 16,
            "block_tokens": BT,
        },
        "tiers": [{"kind": "host", "capacity": "1MiB"}],
    }
    with open_store(local_cfg) as local:  # no url: in-process, its own (empty) cache
        assert isinstance(local, TieredStore) and local.lookup(tokens) == 0


def test_another_identity_gets_no_hits(service: ServiceProc, client: ServiceClient) -> None:
    tokens, kv = prompt(1, 4 * BT)
    assert client.store(tokens, kv) == 4 * BT
    assert client.lookup(tokens) == 4 * BT
    other = client_proc(service.url, "model", "other/model", 1, 4 * BT)
    assert wait_line(other, "lookup") == "lookup 0"
    assert wait_line(other, "load") == "load 0"
    kill9(other)
    with connect(service.url, model_id="test/model", revision="v2") as c2:
        assert c2.lookup(tokens) == 0
    assert client.lookup(tokens, tenant="bob") == 0  # tenants stay apart too


def test_first_block_misses_are_answered_from_the_presence_map(
    service: ServiceProc, client: ServiceClient
) -> None:
    tokens, kv = prompt(20, 4 * BT)
    other = connect(service.url, timeout=service.timeout, name="other")
    try:
        before = other.stats()["store"]["lookups"]
        assert other.lookup(tokens) == 0 and other.counters["local_misses"] == 1  # no round trip
        assert client.store(tokens, kv) == 4 * BT
        # what one client stored, another finds at once: the map never hides a cached block
        assert other.lookup(tokens) == 4 * BT and other.counters["local_misses"] == 1
        assert other.lookup(tokens, start=BT) == 4 * BT
        out = np.zeros_like(kv)
        assert other.load(tokens, out) == 4 * BT and np.array_equal(out, kv)
        assert other.lookup(tokens, tenant="bob") == 0  # another scope: its own root, a miss
        assert other.load(tokens, out, tenant="bob") == 0
        assert other.counters["local_misses"] == 3
        stats = other.stats()  # the local misses reach the service's counters
        assert stats["store"]["lookups"] == before + 4
        mine = [s for s in stats["service"]["sessions"].values() if s["name"] == "other"]
        assert mine[0]["ops"]["lookup_local"]["calls"] == 3
        # evicted: the map forgets it too, so the miss is local again
        filler, fkv = prompt(21, 64 * BT)
        assert client.store(filler, fkv) == 64 * BT  # the whole host tier
        assert other.lookup(tokens) == 0 and other.counters["local_misses"] == 4
        with pytest.raises(ConfigError):  # a bad scope still raises, asked of the service
            other.lookup(prompt(22, BT)[0], tenant="")
    finally:
        other.close()
    with connect(service.url, timeout=service.timeout, presence=False) as asks:
        assert asks.lookup(filler) == 64 * BT and asks.lookup(tokens) == 0
        assert asks.counters["local_misses"] == 0


def test_caller_mistakes_raise_the_same_errors(client: ServiceClient) -> None:
    tokens, kv = prompt(2, 2 * BT)
    with pytest.raises(TokenError):
        client.lookup([-1] * BT)
    with pytest.raises(LayoutError):
        client.store(tokens, kv.astype(np.float32))
    with pytest.raises(LayoutError):
        client.load(tokens, np.zeros(LAYOUT.kv_shape(BT), np.float16))
    with pytest.raises(ConfigError):  # raised by the service, re-raised here
        client.lookup(tokens, tenant="")
    assert client.lookup(tokens) == 0  # nothing was stored
    with pytest.raises(LayoutError):
        connect(client.url, layout=LAYOUT.__class__(layers=3, kv_heads=2, head_dim=16))


def test_killed_client_releases_its_lease(service: ServiceProc, client: ServiceClient) -> None:
    holder = client_proc(service.url, "lease", 3, 56 * BT)  # pins 56 of the 64 slots
    assert wait_line(holder, "held") == f"held {56 * BT}"
    assert [s["leases"] for s in sessions(client).values() if s["name"] == "test-lease"] == [1]
    tokens, kv = prompt(4, 16 * BT)  # one staging region's worth: a single call
    assert client.store(tokens, kv) == 8 * BT  # only the unpinned room
    kill9(holder)
    assert until(lambda: all(s["name"] != "test-lease" for s in sessions(client).values()))
    assert client.store(tokens, kv) == 8 * BT  # the pins are gone: the rest fits now
    assert client.lookup(tokens) == 16 * BT


def test_client_killed_mid_store_and_mid_load(service: ServiceProc, client: ServiceClient) -> None:
    n = 6 * BT + 3
    writer = client_proc(service.url, "store", 100, 0, n)  # stores until killed
    wait_line(writer, "stored 102")
    reader = client_proc(service.url, "load", 100, 0, n)  # loads until killed
    wait_line(reader, "loaded 101")
    kill9(writer)
    kill9(reader)
    # every visible block is whole: whatever a lookup promises loads verified, byte-identical
    for i in range(100, 140):
        tokens, kv = prompt(i, n)
        out = np.zeros_like(kv)
        end = client.load(tokens, out)
        assert np.array_equal(out[:, :, :end], kv[:, :, :end]), i
    assert until(lambda: {str(s["name"]) for s in sessions(client).values()} == {""})
    # the service serves on, for everyone (a prompt the writer, storing 100, 101, ... until it
    # was killed, cannot have reached: its tokens would already be cached)
    tokens, kv = prompt(10**6, 4 * BT)
    assert client.store(tokens, kv) == 4 * BT and client.lookup(tokens) == 4 * BT


def test_service_killed_and_restarted_serves_misses_then_warm_hits() -> None:
    svc = ServiceProc(host="64KiB", nvme="1MiB", lease_ttl=2.0, timeout=1.0)  # 16 host slots
    try:
        svc.start()
        c = connect(svc.url, timeout=svc.timeout, layout=LAYOUT)
        tokens, kv = prompt(5, 8 * BT)
        assert c.store(tokens, kv) == 8 * BT
        filler, fkv = prompt(6, 16 * BT)
        assert c.store(filler, fkv) == 16 * BT  # pushes prompt 5 down to NVMe
        c.flush(5.0)
        svc.kill()
        assert c.lookup(tokens) == 0  # a miss after at most the timeout, never an exception
        assert c.store(tokens, kv) == 0
        out = np.zeros_like(kv)
        assert c.load(tokens, out) == 0
        with c.lease(tokens) as held:
            assert held.end == 0
        assert not c.connected and c.stats()["client"]["timeouts"] >= 1
        cfg = ServiceConfig(url=svc.url)
        left = cfg.shm_prefix + "-staging-0"  # a session the killed service never saw attach
        open(left, "wb").close()
        svc.start()  # the stale socket file is replaced, and what it left in /dev/shm
        assert not os.path.exists(left)
        assert until(lambda: c.connected)
        assert c.lookup(tokens) == 8 * BT  # NVMe kept it across the crash
        assert c.load(tokens, out) == 8 * BT and np.array_equal(out, kv)
        c.close()
    finally:
        svc.cleanup()


def test_service_stopped_and_restarted_finds_its_cache_on_nvme() -> None:
    svc = ServiceProc(host="256KiB", nvme="1MiB")
    try:
        svc.start()
        c = connect(svc.url, timeout=1.0, layout=LAYOUT)
        tokens, kv = prompt(15, 4 * BT)
        assert c.store(tokens, kv) == 4 * BT  # in the host tier only
        svc.stop()  # SIGTERM: the store closes, writing its volatile blocks to NVMe
        assert svc.proc is not None and svc.proc.returncode == 0
        assert not os.path.exists(svc.sock)
        svc.start()
        assert until(lambda: c.connected)
        out = np.zeros_like(kv)
        assert c.load(tokens, out) == 4 * BT and np.array_equal(out, kv)
        c.close()
    finally:
        svc.cleanup()


def test_client_started_before_the_service_connects_later() -> None:
    svc = ServiceProc()
    try:
        with pytest.raises(ConfigError, match="does not answer"):
            connect(svc.url, timeout=0.2)
        c = TieredStore.connect(svc.url, timeout=1.0, layout=LAYOUT)
        tokens, kv = prompt(9, 2 * BT)
        assert c.store(tokens, kv) == 0 and c.lookup(tokens) == 0
        svc.start()
        assert until(lambda: c.connected)
        assert c.store(tokens, kv) == 2 * BT and c.lookup(tokens) == 2 * BT
        c.close()
    finally:
        svc.cleanup()


def _serve(svc: ServiceProc) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "serve", "--config", svc.config],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_second_service_on_the_same_socket_is_refused(service: ServiceProc) -> None:
    second = _serve(service)
    assert second.returncode == 2
    assert f"another kvtier service (pid {service.proc.pid}) is serving" in second.stderr  # type: ignore[union-attr]
    assert service.proc is not None and service.proc.poll() is None  # the first serves on


def test_a_service_started_as_the_last_one_stops_keeps_its_shared_memory() -> None:
    first = ServiceProc(host="1MiB", nvme="4MiB")
    try:
        first.start()
        with connect(first.url, timeout=first.timeout) as c:
            tokens, kv = prompt(30, 64 * BT)
            assert c.store(tokens, kv) == 64 * BT  # written down to NVMe when it stops
        assert first.proc is not None
        first.proc.send_signal(signal.SIGTERM)
        second = ServiceProc(host="1MiB", nvme="4MiB", root=first.dir)
        second.log = os.path.join(first.dir, "serve-2.log")
        deadline = time.monotonic() + 30
        while True:  # refused while the first still closes its store, then it starts
            try:
                second.start()
                break
            except RuntimeError as exc:
                assert "another kvtier service" in str(exc), exc
                assert time.monotonic() < deadline
        assert first.proc.wait(10) == 0
        assert second.proc is not None and second.proc.poll() is None, second.output()
        with connect(second.url, timeout=second.timeout) as c:  # its arena and map are there
            assert c.data_path == "arena" and c.link is not None and c.link.presence is not None
            assert c.lookup(tokens) == 64 * BT  # warm from NVMe
            assert c.lookup(prompt(31, BT)[0]) == 0 and c.counters["local_misses"] == 1
        second.stop()
    finally:
        first.cleanup()


def test_stale_socket_is_replaced_and_a_foreign_file_refused() -> None:
    svc = ServiceProc()
    try:
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(svc.sock)  # a socket file nobody accepts on: a crashed service's
        s.close()
        svc.start()
        with connect(svc.url, timeout=2.0) as c:
            assert c.connected
        svc.stop()
        with open(svc.sock, "w") as f:
            f.write("not a socket")
        out = _serve(svc)
        assert out.returncode == 2 and "exists and is not a socket" in out.stderr
    finally:
        svc.cleanup()


@pytest.mark.slow  # two processes importing torch and transformers: ~45 s on 2 cores
def test_two_hf_engines_share_one_service() -> None:
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from kvtier.integrations import hf_cache
    from kvtier.integrations.models import ModelSpec, random_model

    layout = hf_cache.model_layout(random_model(ModelSpec(arch="llama", seed=1)), 16)
    svc = ServiceProc(host="4MiB", layout=layout, staging="1MiB")
    try:
        svc.start()
        first = client_proc(svc.url, "hf", 75)
        assert wait_line(first, "hf", 120) == "hf 0 True"
        kill9(first)
        second = client_proc(svc.url, "hf", 75)  # another process: served the first's prefix
        _, reused, same = wait_line(second, "hf", 120).split()
        assert int(reused) >= 3 * 16 and same == "True"  # the prefix, bit-identical output
        kill9(second)
    finally:
        svc.cleanup()


def test_a_session_id_is_good_only_on_its_own_connection(
    service: ServiceProc, client: ServiceClient
) -> None:
    import zmq

    from kvtier.service.protocol import pack, unpack

    tokens, kv = prompt(13, 2 * BT)
    assert client.store(tokens, kv) == 2 * BT
    assert client.link is not None
    stolen = client.link.sid
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect("ipc://" + service.sock)
    try:
        sock.send(b"\x93not msgpack")  # dropped, the service serves on
        sock.send(pack({"op": ["x"], "id": 1, "sid": [1, 2]}))  # wrong types: dropped too
        raw = np.asarray(tokens, "<u4").tobytes()
        sock.send(pack({"op": "lookup", "id": 7, "sid": stolen, "tokens": raw}))
        assert sock.poll(5000)
        reply = unpack(sock.recv())
        assert reply["id"] == 7 and reply["error"] == "session"
    finally:
        sock.close(0)
        ctx.term()
    assert client.lookup(tokens) == 2 * BT  # the owner's session is untouched
    assert all("sid" not in s for s in sessions(client).values())


def test_stats_cli_lists_clients_and_tenants(service: ServiceProc, client: ServiceClient) -> None:
    tokens, kv = prompt(14, 2 * BT)
    client.store(tokens, kv, tenant="alice")
    client.lookup(tokens, tenant="alice")
    out = subprocess.run(
        [sys.executable, "-m", "kvtier.cli.main", "stats", "--url", service.url],
        env=env(),
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "model test/model" in out.stdout and "store" in out.stdout
    assert "tenant alice: hit 0 miss 0 stored 32" in out.stdout


# -- the direct data path: clients copy into and out of the shared host arena -------------------
def transfers(c: ServiceClient, name: str) -> list[object]:
    return [s["transfers"] for s in sessions(c).values() if s["name"] == name]


def test_clients_map_the_host_arena_owner_only(service: ServiceProc, client: ServiceClient) -> None:
    assert client.data_path == "arena"
    assert client.link is not None and client.link.arena is not None
    arena = client.link.arena.path
    assert arena is not None and os.stat(arena).st_mode & 0o777 == 0o600
    tokens, kv = prompt(20, 4 * BT)
    assert client.store(tokens, kv) == 4 * BT
    host = client.stats()["tiers"]["host"]
    assert host["puts"] == 4 and host["used_blocks"] == 4  # the client's copies, committed
    out = np.zeros_like(kv)
    assert client.load(tokens, out) == 4 * BT and np.array_equal(out, kv)
    service.stop()
    assert not os.path.exists(arena)  # the name goes with the service


def test_a_client_killed_mid_store_leaves_nothing_visible(
    service: ServiceProc, client: ServiceClient
) -> None:
    writer = client_proc(service.url, "stall-store", 21, 48 * BT)
    assert wait_line(writer, "reserved") == "reserved 48"  # half of them written, none committed
    assert transfers(client, "test-stall-store") == [1]
    tokens, kv = prompt(21, 48 * BT)
    assert client.lookup(tokens) == 0  # reserved slots are invisible
    other, okv = prompt(22, 32 * BT)
    assert client.store(other, okv) == 16 * BT  # the reservation holds 48 of the 64 slots
    kill9(writer)
    assert until(lambda: all(s["name"] != "test-stall-store" for s in sessions(client).values()))
    assert client.lookup(tokens) == 0  # never became visible
    assert client.store(other, okv) == 16 * BT  # the slots are free again: the rest fits
    assert client.lookup(other) == 32 * BT
    assert client.store(tokens, kv) == 48 * BT  # the half-written slots are reused, cleanly
    out = np.zeros_like(kv)
    assert client.load(tokens, out) == 48 * BT and np.array_equal(out, kv)


def test_a_client_killed_mid_load_releases_its_slots(
    service: ServiceProc, client: ServiceClient
) -> None:
    reader = client_proc(service.url, "stall-load", 23, 40 * BT)
    assert wait_line(reader, "acquired") == "acquired 40"
    assert transfers(client, "test-stall-load") == [1]
    tokens, kv = prompt(24, 48 * BT)
    assert client.store(tokens, kv) == 24 * BT  # the 40 acquired blocks cannot be evicted
    held, hkv = prompt(23, 40 * BT)
    out = np.zeros_like(hkv)
    assert client.load(held, out) == 40 * BT and np.array_equal(out, hkv)  # others read on
    kill9(reader)
    assert until(lambda: all(s["name"] != "test-stall-load" for s in sessions(client).values()))
    assert client.store(tokens, kv) == 24 * BT  # unpinned: evicted to make room for the rest
    assert client.lookup(tokens) == 48 * BT


def test_bytes_overwritten_in_the_shared_arena_are_a_miss(client: ServiceClient) -> None:
    tokens, kv = prompt(25, 4 * BT)
    assert client.store(tokens, kv) == 4 * BT
    assert client.link is not None and client.link.arena is not None
    client.link.arena.array[:] = 7  # a client that maps the arena can write anything into it
    out = np.zeros_like(kv)
    assert client.load(tokens, out) == 0  # the checksums live in the service: a miss
    assert client.stats()["store"]["invalid_blocks"] == 1
    assert client.lookup(tokens) == 0  # the corrupt first block was dropped


def test_staging_mode_keeps_clients_out_of_the_arena() -> None:
    svc = ServiceProc(host="256KiB", data="staging")
    try:
        svc.start()
        with connect(svc.url, timeout=2.0) as c:
            assert c.data_path == "staging"
            assert c.link is not None and c.link.arena is None
            named = ServiceConfig(url=svc.url).arena_path  # where arena mode would name it
            assert named is not None and not os.path.exists(named)  # the arena is anonymous
            tokens, kv = prompt(26, 40 * BT)  # larger than the staging region: chunked
            assert c.store(tokens, kv) == 40 * BT
            out = np.zeros_like(kv)
            assert c.load(tokens, out) == 40 * BT and np.array_equal(out, kv)
        with connect(svc.url, timeout=2.0) as c:  # and the next client is served the same
            out = np.zeros_like(kv)
            assert c.load(tokens, out) == 40 * BT and np.array_equal(out, kv)
    finally:
        svc.cleanup()


@pytest.mark.slow  # starts two services and client processes: ~30 s on 2 cores
def test_bench_host_url_compares_the_service_with_in_process() -> None:
    import argparse

    from kvtier.bench import host

    p = argparse.ArgumentParser()
    host.add_arguments(p)
    args = p.parse_args(
        ["--url", "auto", "--mib", "4", "--rounds", "1", "--clients", "2", "--host-mib", "32"]
    )
    out = host.run(args)
    assert out["data_path"] == "arena"
    for name in ("service", "service_staging", "service_buffer"):
        for kind in ("store", "load"):
            ratio = out[f"{name}_{kind}_gbps"] / out[f"in_process_{kind}_gbps"]
            assert out[f"{name}_{kind}_vs_in_process"] == pytest.approx(ratio)
    assert out["clients_vs_one"] == pytest.approx(out["2_clients_gbps"] / out["one_client_gbps"])
    assert 0 < out["service_miss_4k_in_service_us"] < out["service_miss_4k_asked_us"]
    assert out["service_ping_vs_zmq_echo"] == pytest.approx(
        out["service_ping_us"] / out["zmq_echo_us"]
    )
    assert out["service_ping_us"] > 0 and out["in_process_lookup_128k_ms"] > 0


def test_an_arena_larger_than_shared_memory_is_a_config_error() -> None:
    from kvtier.tiers.shm import SharedMemory, shm_dir

    path = os.path.join(shm_dir(), f"kvtier-test-{os.getpid()}")
    with pytest.raises(ConfigError, match=r"cannot allocate .*--shm-size"):
        SharedMemory.create(1 << 50, path)  # a PiB: more than any /dev/shm
    assert not os.path.exists(path)  # nothing left behind
    small = SharedMemory.create(1 << 16, path)
    try:
        other = SharedMemory.attach(path, 1 << 16)
        other.array[:4] = [1, 2, 3, 4]  # one mapping's writes are the other's bytes
        assert small.array[:4].tolist() == [1, 2, 3, 4]
        other.close()
    finally:
        small.unlink()
        small.close()
    assert not os.path.exists(path)
