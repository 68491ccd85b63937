"""Cluster replays (kvtier/sim/cluster.py): nodes with tiers of their own, shared pool tiers."""

from __future__ import annotations

import argparse
import itertools
import json
from pathlib import Path

import numpy as np
import pytest

from kvtier.cli import plan_trace
from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.sim import sizing
from kvtier.sim.cluster import replay_cluster, route_of
from kvtier.sim.clusterstack import cluster_profile, estimate_cluster_hits
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import Request, Trace, write_trace
from kvtier.sim.workload import generate
from tests.test_sim import BT, tree_trace


def ideal_cached_tokens(trace: Trace) -> int:
    """Infinite cache, counted directly, by the store's rules: a full block stored before (as a
    full block of an earlier request) is a hit while the request's leading run lasts."""
    seen: set[int] = set()
    total = 0
    for r in trace.requests:
        full = r.blocks[: r.input_length // BT]
        n = 0
        while n < len(full) and full[n] in seen:
            n += 1
        total += n * BT
        seen.update(full)
    return total


def brute_lru_serve(order: list[int], blocks: tuple[int, ...], cap: int) -> None:
    """A list-based LRU (``order``, oldest first, of ``cap`` blocks) after serving ``blocks``:
    its leading ``cap`` blocks resident, the least recent others evicted to make room."""
    chain = list(blocks[:cap])
    need = len(order) + len([k for k in chain if k not in order]) - cap
    for k in [k for k in order if k not in chain][: max(need, 0)]:
        order.remove(k)
    for k in reversed(chain):  # root ends most recent
        if k in order:
            order.remove(k)
        order.append(k)


def _counters(res: object) -> tuple[object, ...]:
    return tuple(
        getattr(res, f)
        for f in ("promoted_blocks", "written_blocks", "evicted_blocks", "block_hits")
    ) + (res.hit_tokens.tolist(),)  # type: ignore[attr-defined]


def brute_cluster_lru_tokens(trace: Trace, nodes: int, cap: int, pool: int) -> int:
    """What the sizing screen assumes (``kvtier.sim.clusterstack``), by brute force: round-robin
    nodes with a list-based LRU each and one LRU pool that every request's chain is written
    through to; a block counts if either holds it, a fully cached request all its tokens."""
    own: list[list[int]] = [[] for _ in range(nodes)]
    shared: list[int] = []
    total = 0
    for i, r in enumerate(trace.requests):
        node = own[i % nodes]
        n = 0
        while n < len(r.blocks) and (r.blocks[n] in node or r.blocks[n] in shared):
            n += 1
        total += r.input_length if n == len(r.blocks) else n * BT
        brute_lru_serve(node, r.blocks, cap)
        brute_lru_serve(shared, r.blocks, pool)
    return total


@pytest.mark.parametrize("policy", ["lru", "auto"])
def test_one_node_is_the_one_node_replay(policy: str) -> None:
    """A cluster of one node with every tier its own is the store model of a one-node replay:
    the same counters, tier by tier and request by request."""
    trace = generate("mixed", 400, seed=2)
    tiers = [TierSpec("hbm", 30, policy), TierSpec("dram", 120, policy)]
    assert _counters(replay_cluster(trace, tiers, 1, 2)) == _counters(replay(trace, tiers))


def test_nodes_without_a_shared_tier_are_independent_stores() -> None:
    """Round robin over 3 nodes and nothing shared: each node is the one-node replay of its own
    requests."""
    trace = generate("chat", 300, seed=1)
    tiers = [TierSpec("hbm", 20, "auto"), TierSpec("dram", 60, "auto")]
    res = replay_cluster(trace, tiers, 3, 2)
    for n in range(3):
        sub = Trace(trace.requests[n::3], trace.block_tokens, trace.name)
        alone = replay(sub, tiers)
        assert res.hit_tokens[:, n::3].tolist() == alone.hit_tokens.tolist()


@pytest.mark.parametrize("seed", range(3))
def test_a_pool_that_holds_everything_serves_every_reuse_on_any_node(seed: int) -> None:
    """Round robin over 4 nodes with caches of their own (a first tier that holds the longest
    prompt, so a store is never pinned full, and a small dram): without a shared tier they hit
    less than one node would; with a pool that holds every block, every block seen before on
    any node is a hit (the trace's ideal, counted independently), and what the nodes' own tiers
    miss of it comes from the pool."""
    trace = tree_trace(seed, n_req=400, nodes=150)
    longest = max(len(r.blocks) for r in trace.requests)  # never pinned full: all is stored
    own = [TierSpec("hbm", longest, "lru"), TierSpec("dram", 10, "lru")]
    pool = [TierSpec("pool", 10_000, "lru")]
    alone = replay_cluster(trace, own, 4, 2)
    shared = replay_cluster(trace, own + pool, 4, 2)
    ideal = ideal_cached_tokens(trace)
    assert shared.hit_tokens.sum() == ideal
    assert alone.hit_tokens.sum() < replay(trace, own).hit_tokens.sum() <= ideal
    assert shared.hit_tokens[2].sum() > 0
    full = {k for r in trace.requests for k in r.blocks[: r.input_length // BT]}
    assert shared.written_blocks[2] == len(full)  # every stored block written through once
    # a victim goes down the node's own chain although the pool has a copy: dram still serves
    assert shared.hit_tokens[1].sum() > 0


def test_prefix_routing_keeps_requests_that_start_alike_on_one_node() -> None:
    trace = generate("rag", 300, seed=1)  # every rag prompt starts with the same system prompt
    assert len(set(route_of(trace, 4, "prefix").tolist())) == 1
    tiers = [TierSpec("hbm", 50, "s3fifo"), TierSpec("dram", 100, "s3fifo")]
    one = replay_cluster(trace, tiers, 1, 2)
    assert _counters(replay_cluster(trace, tiers, 4, 2, route="prefix")) == _counters(one)
    chat = generate("chat", 300, seed=1)
    firsts = {r.blocks[0] for r in chat.requests}
    nodes = route_of(chat, 4, "prefix")
    by_first = {r.blocks[0]: n for r, n in zip(chat.requests, nodes.tolist(), strict=True)}
    assert all(by_first[r.blocks[0]] == n for r, n in zip(chat.requests, nodes, strict=True))
    assert len(firsts) > 1


def test_cluster_report_counts_each_nodes_tiers_and_the_busiest_node(
    capsys: pytest.CaptureFixture[str],
) -> None:
    argv = ["simulate", "--synthetic", "chat", "--requests", "300", "--json"]
    tiers = ["--tier", "hbm=40GB", "--tier", "dram=200GB", "--tier", "pool=2TB"]
    assert main([*argv, *tiers]) == 0
    one = json.loads(capsys.readouterr().out)
    assert main([*argv, *tiers, "--nodes", "3"]) == 0
    three = json.loads(capsys.readouterr().out)
    assert [t["copies"] for t in three["tiers"]] == [3, 3, 1]
    own_usd = sum(t["monthly_cost_usd"] for t in one["tiers"][:2])
    pool_usd = one["tiers"][2]["monthly_cost_usd"]
    assert three["monthly_cost_usd"] == pytest.approx(3 * own_usd + pool_usd)
    assert len(one["busy_s"]) == 1 and len(three["busy_s"]) == 3
    assert one["throughput_tokens_per_s"] == pytest.approx(one["input_tokens"] / one["busy_s"][0])
    tokens = three["input_tokens"]
    assert three["throughput_tokens_per_s"] == pytest.approx(tokens / max(three["busy_s"]))
    assert "3 nodes" in three["assumptions"]["cluster"]
    assert three["tiers"][2]["hit_tokens"] > 0  # other nodes' blocks, read from the pool


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--nodes", "0"], "--nodes must be >= 1, got 0"),
        (["--route", "prefix"], "--route sends requests to nodes; add --nodes N"),
        (["--nodes", "2", "--sweep"], "--nodes replays a hierarchy"),
        (["--nodes", "2", "--capacity-blocks", "10"], "--nodes replays a hierarchy"),
        (["--nodes", "2", "--policy", "belady"], "belady is not offered for a cluster"),
        (["--nodes", "2", "--route", "hash"], "invalid choice: 'hash'"),
    ],
)
def test_cluster_flags_are_checked(
    extra: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["simulate", "--synthetic", "chat", "--requests", "20", "--tier", "hbm=40GB"]
    try:
        rc = main([*argv, *extra])
    except SystemExit as exc:  # argparse's own check (--route's choices)
        rc = exc.code
    assert rc == 2
    assert message in capsys.readouterr().err


def test_the_shared_tiers_need_a_first_tier_of_the_nodes_own() -> None:
    trace = Trace((Request(0.0, 10, 1, (1,)),))
    with pytest.raises(ConfigError, match="first tier of each node"):
        replay_cluster(trace, [TierSpec("pool", 10, "lru")], 2, 0)
    assert np.array_equal(route_of(trace, 3, "rr"), [0])


def test_cache_routing_follows_cached_prefixes_and_keeps_nodes_balanced() -> None:
    """``cache`` routing: chat sessions stay with the node holding their history (more hits
    than round robin), yet a prompt every request starts with (rag's system prompt) does not
    send everything to one node, as routing by first block does."""
    tiers = [TierSpec("hbm", 40, "lru"), TierSpec("dram", 120, "lru")]
    chat = generate("chat", 800, seed=4)
    rr = replay_cluster(chat, tiers, 4, 2, route="rr")
    cache = replay_cluster(chat, tiers, 4, 2, route="cache")
    assert cache.token_hit_ratio > 1.2 * rr.token_hit_ratio
    rag = generate("rag", 800, seed=4)
    res = replay_cluster(rag, tiers, 4, 2, route="cache")
    assert res.node_of is not None
    counts = np.bincount(res.node_of, minlength=4)
    assert counts.min() > 0.15 * len(rag.requests)
    assert len(set(route_of(rag, 4, "prefix").tolist())) == 1


def test_a_toml_cluster_is_the_flags_cluster(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """``[cluster] nodes, route`` in the TOML file replays what ``--nodes``/``--route`` do; the
    flags override the file."""
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[cluster]\nnodes = 3\nroute = "cache"\n'
        '[[tiers]]\nname = "hbm"\ncapacity = "40GB"\n'
        '[[tiers]]\nname = "pool"\ncapacity = "1TB"\n'
    )
    argv = ["simulate", "--synthetic", "chat", "--requests", "300", "--json"]
    flags = ["--tier", "hbm=40GB", "--tier", "pool=1TB", "--nodes", "3", "--route", "cache"]
    runs = []
    for extra in (["--config", str(cfg)], flags, ["--config", str(cfg), "--nodes", "2"]):
        assert main([*argv, *extra]) == 0
        runs.append(json.loads(capsys.readouterr().out))
    assert runs[0]["nodes"] == 3 and runs[0]["token_hit_ratio"] == runs[1]["token_hit_ratio"]
    assert runs[0]["busy_s"] == runs[1]["busy_s"]
    assert (
        runs[2]["nodes"] == 2
        and "requests routed to the node caching" in (runs[2]["assumptions"]["cluster"])
    )


def test_an_empty_pool_passes_the_writes_on_to_object_storage() -> None:
    trace = tree_trace(1, n_req=300, nodes=100)
    own = TierSpec("hbm", max(len(r.blocks) for r in trace.requests), "lru")
    empty = replay_cluster(
        trace, [own, TierSpec("pool", 0, "lru"), TierSpec("object", 10_000, "lru")], 3, 1
    )
    direct = replay_cluster(trace, [own, TierSpec("object", 10_000, "lru")], 3, 1)
    assert empty.hit_tokens[2].sum() == direct.hit_tokens[1].sum() > 0
    assert empty.hit_tokens[1].sum() == 0 and empty.written_blocks[1] == 0
    assert empty.hit_tokens.sum() == ideal_cached_tokens(trace)


@pytest.mark.parametrize("seed", range(3))
def test_the_cluster_lru_screen_is_its_exclusive_lru_model(seed: int) -> None:
    """The sizing screen's profile (a stack position per node and one for the shared tiers)
    gives, from one pass, the hits of an exclusive LRU node cache and an LRU pool written
    through by every node: equal to that model by brute force. (The replay, the store's model,
    decides: the screen only orders the candidates.)"""
    trace = tree_trace(seed, n_req=200, nodes=80)
    longest = max(len(r.blocks) for r in trace.requests)
    prof = cluster_profile(trace, 3, "rr")
    for pool in (0, 12, 40):
        est = estimate_cluster_hits(prof, (longest, 0, pool), 2)
        assert est.sum() == brute_cluster_lru_tokens(trace, 3, longest, pool)
    with pytest.raises(ConfigError, match="rr or prefix"):
        cluster_profile(trace, 2, "cache")


def test_a_cluster_plan_is_the_cheapest_grid_configuration() -> None:
    """``kvtier plan --nodes 3``: each node's tiers are paid once per node, the pool once; with
    LRU the answer equals the cheapest configuration of the grid whose cluster replay meets
    the SLO, found by replaying every one."""
    trace = generate("chat", 300, seed=3)
    ns = argparse.Namespace(
        model="Llama-3.1-8B", dtype="bf16", gpus=1, weights_bytes=None, weights_dtype="bf16",
        gpu_memory="80GB", policy="lru", dram="20GB", nvme="0", pool="60GB", nodes=3, route="rr",
    )  # fmt: skip
    hier, max_blocks, _ = plan_trace.search_space(ns, trace)
    assert [t.name for t in hier.tiers] == ["hbm", "dram", "pool"] and hier.nodes == 3
    bb = hier.block_bytes

    def p90(caps: tuple[int, ...]) -> float:
        return sizing.exact_p90(trace, sizing.sized(hier, tuple(c * bb for c in caps)))[0]

    longest = max(len(r.blocks) for r in trace.requests)
    distinct = len({k for r in trace.requests for k in r.blocks})
    grids = [sizing.grid(min(m, distinct), 4, longest if i in (0, 2) else 1)
             for i, m in enumerate(max_blocks)]  # fmt: skip
    best, worst = p90(tuple(max(g) for g in grids)), p90((longest, 0, 0))
    slo = best + (worst - best) / 3
    found = sizing.search(trace, hier, max_blocks, slo, points=4)
    price = [t.cost.usd_per_gb_month * bb / 1e9 for t in hier.tiers]
    price[0] *= 3
    price[1] *= 3
    met = []
    for caps in itertools.product(*grids):
        if caps[0] and p90(caps) <= slo:
            met.append((sum(c * p for c, p in zip(caps, price, strict=True)), caps))
    usd, cheapest = min(met)
    assert found.caps_bytes == tuple(c * bb for c in cheapest)
    assert found.summary["nodes"] == 3 and found.best_p90_s <= slo
    assert found.summary["monthly_cost_usd"] == pytest.approx(usd)  # each node's hbm paid 3x


def test_plan_cluster_flags_are_checked(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(generate("chat", 50, seed=1), path)
    argv = ["plan", "--trace", str(path), "--slo-ttft-p90", "1", "--model", "Llama-3.1-8B"]
    assert main([*argv, "--gpus", "1", "--nodes", "0"]) == 2
    assert "--nodes must be >= 1, got 0" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main([*argv, "--nodes", "2", "--route", "hash"])
    assert "invalid choice: 'hash'" in capsys.readouterr().err


def test_a_cache_routed_cluster_is_sized_by_replay() -> None:
    """Cache routing has no profile of its own: the plan screens it as routing by first block,
    and what it answers meets the SLO in a cache-routed replay."""
    trace = generate("chat", 300, seed=5)
    ns = argparse.Namespace(
        model="Llama-3.1-8B", dtype="bf16", gpus=1, weights_bytes=None, weights_dtype="bf16",
        gpu_memory="80GB", policy="lru", dram="20GB", nvme="0", pool="60GB", nodes=3,
        route="cache",
    )  # fmt: skip
    hier, max_blocks, _ = plan_trace.search_space(ns, trace)
    bb = hier.block_bytes
    top = sizing.exact_p90(trace, sizing.sized(hier, tuple(m * bb for m in max_blocks)))[0]
    longest = max(len(r.blocks) for r in trace.requests)
    none = sizing.exact_p90(trace, sizing.sized(hier, (longest * bb, 0, 0)))[0]
    slo = top + (none - top) / 3
    found = sizing.search(trace, hier, max_blocks, slo, points=4, margin=sizing.DEFAULT_MARGIN)
    assert found.caps_bytes is not None and found.best_p90_s <= slo
    p90, res = sizing.exact_p90(trace, sizing.sized(hier, found.caps_bytes))
    assert p90 == found.best_p90_s and res.route == "cache" and res.nodes == 3
