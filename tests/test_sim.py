"""The simulator: hit accounting, Belady's ceiling, LRU against a brute-force reference, traces."""

from __future__ import annotations

import gzip
import json
import random
from dataclasses import replace
from itertools import pairwise
from pathlib import Path

import pytest

from kvtier.cli.main import main
from kvtier.errors import ConfigError
from kvtier.policy import DEFAULT_POLICY, POLICIES
from kvtier.sim import basket
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import Request, Trace, TraceError, iter_trace, read_trace, write_trace
from kvtier.sim.workload import generate

MOONCAKE = Path("/work/shared/data/traces/mooncake_synthetic.jsonl")
BT = 512


def tree_trace(seed: int, n_req: int = 60, nodes: int = 40) -> Trace:
    """Requests are root-to-node paths of a random block tree (chained ids, like real prefixes)."""
    rng = random.Random(seed)
    parent = [-1]
    for i in range(1, nodes):
        parent.append(rng.randrange(i) if rng.random() < 0.8 else -1)
    reqs = []
    for i in range(n_req):
        node = rng.randrange(nodes)
        path = []
        while node != -1:
            path.append(node)
            node = parent[node]
        path.reverse()
        length = BT * len(path) - rng.randrange(BT)
        reqs.append(Request(float(i), length, 1, tuple(path)))
    return Trace(tuple(reqs))


def full(r: Request) -> tuple[int, ...]:
    """The blocks of ``r`` the store caches: its full ones."""
    return r.blocks[: r.input_length // BT]


def ideal_cached_tokens(trace: Trace) -> int:
    """Infinite cache, counted directly: every full block seen before is a hit."""
    seen: set[int] = set()
    total = 0
    for r in trace.requests:
        blocks = full(r)
        n = 0
        while n < len(blocks) and blocks[n] in seen:
            n += 1
        total += n * BT
        seen.update(blocks)
    return total


def brute_lru_hits(trace: Trace, cap: int) -> int:
    """Leading-run block hits of a list-based LRU with the served chain pinned."""
    order: list[int] = []  # oldest first
    hits = 0
    for r in trace.requests:
        blocks = full(r)
        n = 0
        while n < len(blocks) and blocks[n] in order:
            n += 1
        hits += n
        brute_lru_serve(order, blocks, cap)
    return hits


def brute_lru_serve(order: list[int], blocks: tuple[int, ...], cap: int) -> None:
    """A list-based LRU (``order``, oldest first, of ``cap`` blocks) after the store served
    ``blocks``: the blocks it held stay (pinned); the leading new ones that fit are stored (with
    no tier below, a prompt longer than the tier keeps its head), making room by evicting the
    least recent unpinned blocks, leaf first (its root ends most recent); then the held ones
    are made most recent the same way."""
    held = [k for k in blocks if k in order]
    new = [k for k in blocks if k not in order]
    for start in range(0, min(len(new), 1), cap):
        part = new[start : start + cap]
        fit = min(len(part), cap - len(held))
        need = len(order) + fit - cap
        for k in [k for k in order if k not in held][: max(need, 0)]:
            order.remove(k)
        order.extend(reversed(part[:fit]))
        if fit < len(part):
            break
    for k in reversed(held):
        order.remove(k)
        order.append(k)


def test_infinite_cache_equals_ideal_reuse_on_mooncake() -> None:
    trace = read_trace(MOONCAKE)
    res = replay(trace, [TierSpec("hbm", 10**9, "lru")])
    assert int(res.hit_tokens.sum()) == ideal_cached_tokens(trace)
    assert res.token_hit_ratio == pytest.approx(0.650, abs=0.001)


@pytest.mark.parametrize("seed", range(5))
def test_infinite_cache_equals_ideal_reuse_on_random_trees(seed: int) -> None:
    trace = tree_trace(seed)
    for pol in (*POLICIES, "belady"):
        res = replay(trace, [TierSpec("x", 10**6, pol)])
        assert int(res.hit_tokens.sum()) == ideal_cached_tokens(trace)


@pytest.mark.parametrize("seed", range(8))
def test_lru_matches_brute_force(seed: int) -> None:
    trace = tree_trace(seed)
    for cap in (1, 3, 7, 15):
        assert replay(trace, [TierSpec("x", cap, "lru")]).block_hits == brute_lru_hits(trace, cap)


def test_belady_bounds_the_online_policies_on_mooncake() -> None:
    """Belady's MIN (farthest next use first) is the reference the docs divide by. Under the
    store's rules (only leading runs hit, a stored prompt's held blocks pinned) it is not a
    strict bound on tiny caches of random trees, but on a real trace it is above every online
    policy."""
    trace = read_trace(MOONCAKE)
    trace = Trace(trace.requests[:1500], trace.block_tokens)
    for cap in (300, 3000):
        best = replay(trace, [TierSpec("x", cap, "belady")]).block_hits
        for pol in (*POLICIES, "s3fifo-block"):
            assert replay(trace, [TierSpec("x", cap, pol)]).block_hits <= best, (pol, cap)


@pytest.mark.parametrize("pol", ["lru", "belady"])
def test_hit_ratio_never_decreases_with_capacity(pol: str) -> None:
    for seed in range(4):
        trace = tree_trace(seed)
        ratios = [replay(trace, [TierSpec("x", c, pol)]).token_hit_ratio for c in range(1, 41)]
        assert all(a <= b + 1e-12 for a, b in pairwise(ratios)), ratios


def test_default_policy_holds_against_lru_and_s3fifo_on_mooncake() -> None:
    """The shared trace at 3%, 30% and 50% of its distinct full blocks, one tier
    (docs/simulation.md has the whole basket): the default within 1% of the better of LRU and
    S3-FIFO."""
    trace = read_trace(MOONCAKE)
    for cap in (1204, 12044, 20074):
        hit = {
            pol: replay(trace, [TierSpec("x", cap, pol)]).token_hit_ratio
            for pol in ("lru", "s3fifo", DEFAULT_POLICY)
        }
        assert hit[DEFAULT_POLICY] >= 0.99 * max(hit["lru"], hit["s3fifo"]), (cap, hit)


def test_tiers_split_the_hits_and_demote() -> None:
    trace = tree_trace(3, n_req=200)
    one = replay(trace, [TierSpec("x", 4, "lru")])
    two = replay(trace, [TierSpec("x", 4, "lru"), TierSpec("y", 30, "lru")])
    assert two.hit_tokens.sum() > one.hit_tokens.sum()
    assert two.hit_tokens[1].sum() > 0 and two.promoted_blocks[1] > 0
    # inclusive: a victim is demoted unless the tier below holds it already (a promoted block)
    assert 0 < two.written_blocks[1] <= two.evicted_blocks[0]


def test_replay_reports_which_ranking_auto_ended_on(capsys: pytest.CaptureFixture[str]) -> None:
    """Each tier's policy state at the end (``describe``): for ``auto`` the ranking that evicts
    and each shadow's hits, what a user reads before overriding one tier's policy. The two
    workloads are the ones ``auto`` exists for, each far from a tie: RAG documents flood a small
    cache (S3-FIFO keeps the shared prefixes), chat turns come back after S3-FIFO's probation."""
    for kind, share, want in (("rag", 0.01, "s3fifo"), ("chat", 0.1, "lru")):
        trace = generate(kind, 2000, 0)
        cap = round(share * basket.distinct_full_blocks(trace))
        res = replay(trace, [TierSpec("host", cap, "auto"), TierSpec("nvme", 4 * cap, "lru")])
        top, below = res.policy_state
        assert top["ranking"] == want, (kind, top)
        other = "lru" if want == "s3fifo" else "s3fifo"
        assert top[f"{want}_shadow_hits"] > top[f"{other}_shadow_hits"]
        assert below == {}  # LRU learns nothing
    args = ["simulate", "--synthetic", "rag", "--requests", "300", "--capacity-blocks", "40"]
    assert main([*args, "--json"]) == 0
    state = json.loads(capsys.readouterr().out)["tiers"][0]["policy_state"]
    assert main(args) == 0
    assert f"auto ({state['ranking']})" in capsys.readouterr().out  # the table's policy column


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ("not json", "not valid JSON"),
        ("[1, 2]", "expected a JSON object"),
        ('{"timestamp": 0, "input_length": 600, "hash_ids": [1]}', "needs 2 blocks"),
        ('{"timestamp": 0, "input_length": -1, "hash_ids": []}', "input_length"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": ["a"]}', "hash_ids"),
        ('{"timestamp": 0, "input_length": 600, "hash_ids": [4, 4]}', "repeats an id"),
    ],
)
def test_malformed_trace_line_is_named(line: str, needle: str) -> None:
    good = '{"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}'
    with pytest.raises(TraceError, match=rf"t\.jsonl:3: .*{needle}"):
        list(iter_trace([good, "", line], "t.jsonl"))


def test_synthetic_workloads_share_prefixes_like_real_ones() -> None:
    for kind in ("chat", "system-prompt", "rag", "agent", "mixed"):
        trace = generate(kind, 300, seed=1)
        parent: dict[int, int] = {}
        for r in trace.requests:
            assert len(r.blocks) == -(-r.input_length // BT)
            for i, k in enumerate(r.blocks):  # chained: an id always has the same parent
                assert parent.setdefault(k, r.blocks[i - 1] if i else -1) == (
                    r.blocks[i - 1] if i else -1
                )
        assert 0.0 < replay(trace, [TierSpec("x", 10**6, "lru")]).token_hit_ratio < 1.0


def test_cli_json_single_tier(capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "simulate",
            "--trace",
            str(MOONCAKE),
            "--capacity-blocks",
            "10000",
            "--policy",
            "belady",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["requests"] == 3993
    assert out["input_tokens"] == read_trace(MOONCAKE).input_tokens
    assert 0.6 < out["token_hit_ratio"] < 0.651
    assert out["tiers"][0]["capacity_blocks"] == 10000
    assert out["ttft_s"]["p50"] <= out["ttft_s"]["p90"] <= out["ttft_s"]["p99"]


def test_cli_tiers_and_plots(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rc = main(
        [
            "simulate",
            "--synthetic",
            "chat",
            "--requests",
            "200",
            "--tier",
            "hbm=20GB",
            "--tier",
            "dram=200GB",
            "--model",
            "Llama-3.1-8B",
            "--plot",
            str(tmp_path),
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and [t["name"] for t in out["tiers"]] == ["hbm", "dram"]
    assert sum(t["hit_tokens"] for t in out["tiers"]) == round(
        out["token_hit_ratio"] * out["input_tokens"]
    )
    assert all(Path(p).stat().st_size > 1000 for p in out["plots"])


def test_cli_bad_tier_is_a_clear_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["simulate", "--synthetic", "rag", "--tier", "tape=1TB"]) == 2
    assert "tape" in capsys.readouterr().err


def test_a_tier_flag_may_name_its_own_policy(capsys: pytest.CaptureFixture[str]) -> None:
    """``--tier NAME=SIZE:POLICY`` runs that tier by POLICY, the others by ``--policy``: the
    replay is the one a ``[[tiers]]`` table with ``policy`` gives; an unknown one is an error
    naming the flag."""
    base = ["simulate", "--synthetic", "rag", "--requests", "300", "--json"]
    assert main([*base, "--tier", "hbm=20GB", "--tier", "dram=80GB:lru"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["policy"] for t in out["tiers"]] == ["auto", "lru"]
    caps = [t["capacity_blocks"] for t in out["tiers"]]
    want = replay(
        generate("rag", 300, 0),
        [TierSpec("hbm", caps[0], "auto"), TierSpec("dram", caps[1], "lru")],
    )
    assert out["token_hit_ratio"] == want.token_hit_ratio
    assert main([*base, "--tier", "hbm=20GB", "--tier", "dram=80GB:fifo"]) == 2
    err = capsys.readouterr().err
    assert "dram=80GB:fifo" in err and "fifo" in err and "lru" in err


def test_check_lower_replays_each_policy_below_the_first(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """``--check-lower`` adds, per alternative, the replay of the same sizes with that policy
    below the first tier: each row equals that configuration's own run (``--tier ...:POLICY``);
    with one tier it is an error that says what it needs."""
    base = ["simulate", "--synthetic", "chat", "--requests", "300", "--json"]
    # small enough that the three configurations (and uniform ones) all differ
    tiers = ["--tier", "hbm=2GB", "--tier", "dram=6GB", "--tier", "nvme=15GB"]
    assert main([*base, *tiers, "--check-lower"]) == 0
    out = json.loads(capsys.readouterr().out)
    rows = out["lower_policy_check"]
    assert [r["lower_policy"] for r in rows] == ["lru", "s3fifo"]
    for r in rows:
        pol = r["lower_policy"]
        own = ["--tier", "hbm=2GB", "--tier", f"dram=6GB:{pol}", "--tier", f"nvme=15GB:{pol}"]
        assert main([*base, *own]) == 0
        alt = json.loads(capsys.readouterr().out)
        assert r["token_hit_ratio"] == alt["token_hit_ratio"]
        assert r["ttft_p90_s"] == pytest.approx(alt["ttft_s"]["p90"])
    assert len({out["token_hit_ratio"], *(r["token_hit_ratio"] for r in rows)}) == 3
    assert main([*base, "--tier", "hbm=20GB", "--check-lower"]) == 2
    assert "two tiers or more" in capsys.readouterr().err


def test_write_trace_is_atomic(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed save leaves the old file as it was and no temporary file; a good one replaces it."""
    import kvtier.sim.trace as trace_mod

    dest = tmp_path / "t.jsonl"
    dest.write_text("old\n")
    trace = generate("chat", 20, seed=1)

    def full(fd: int) -> None:  # the lines were written; the disk fills before they are synced
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(trace_mod.os, "fsync", full)
    with pytest.raises(OSError):
        trace_mod.write_trace(trace, dest)
    assert dest.read_text() == "old\n" and sorted(tmp_path.iterdir()) == [dest]
    monkeypatch.undo()
    trace_mod.write_trace(trace, dest)
    assert read_trace(dest).requests == trace.requests and sorted(tmp_path.iterdir()) == [dest]


def test_gzip_traces_are_read_and_written(tmp_path: Path) -> None:
    """A trace saved as ``.gz`` is gzip-compressed and reads back the same; a damaged gzip file
    is a clear error, not a crash."""
    trace = generate("rag", 50, seed=2)
    plain, packed = tmp_path / "t.jsonl", tmp_path / "t.jsonl.gz"
    write_trace(trace, plain)
    write_trace(trace, packed)
    assert gzip.decompress(packed.read_bytes()) == plain.read_bytes()
    assert read_trace(packed).requests == trace.requests == read_trace(plain).requests
    torn = tmp_path / "torn.gz"
    torn.write_bytes(packed.read_bytes()[:40])
    with pytest.raises(TraceError, match=r"torn\.gz: a damaged gzip file"):
        read_trace(torn)


@pytest.mark.parametrize(
    ("line", "needle"),
    [
        ('{"timestamp": NaN, "input_length": 10, "hash_ids": [0]}', "finite non-negative"),
        ('{"timestamp": 1e999, "input_length": 10, "hash_ids": [0]}', "finite non-negative"),
        ('{"timestamp": 0, "hash_ids": [0]}', "'input_length' is missing"),
        ('{"timestamp": 0, "input_length": 10}', "'hash_ids' is missing"),
        ('{"timestamp": 0, "input_length": 10, "hash_ids": [0, 1]}', "needs 1 block of 512"),
    ],
)
def test_trace_field_errors_say_what_is_wrong(line: str, needle: str) -> None:
    with pytest.raises(TraceError, match=rf"t\.jsonl:1: .*{needle}"):
        list(iter_trace([line], "t.jsonl"))


def test_custom_toml_tier_with_its_costs_runs(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text(
        '[[tiers]]\nname = "hbm"\ncapacity = "20GB"\n'
        '[[tiers]]\nname = "cxl"\ncapacity = "100GB"\nbandwidth = "64GB"\nlatency_us = 0.5\n'
    )
    argv = ["simulate", "--synthetic", "chat", "--requests", "50", "--model", "Llama-3.1-8B"]
    assert main([*argv, "--config", str(cfg), "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in out["tiers"]] == ["hbm", "cxl"]


def test_cli_basket_sweeps_every_workload_and_size(capsys: pytest.CaptureFixture[str]) -> None:
    """``--sweep --basket``: each generator x 3 seeds, five sizes, one tier and host + NVMe."""
    argv = ["simulate", "--sweep", "--basket", "--requests", "60", "--policy", "lru", "--json"]
    assert main([*argv, "--jobs", "1"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert len(out["rows"]) == 5 * 3 * 10
    assert {len(r["caps"]) for r in out["rows"]} == {1, 2}
    assert out["summary"][0]["policy"] == "lru"
    assert all(0.0 <= r["hit"]["lru"] <= 1.0 for r in out["rows"])


def test_basket_summary_reads_the_target_both_ways() -> None:
    """A point below the better of LRU and S3-FIFO by more than 1% of it is below target; the
    largest shortfall is also given in hit-ratio points."""
    rows = [
        {"trace": "a", "caps": [10], "hit": {"lru": 0.040, "s3fifo": 0.050, "auto": 0.0496}},
        {"trace": "b", "caps": [20], "hit": {"lru": 0.500, "s3fifo": 0.400, "auto": 0.480}},
        {"trace": "c", "caps": [30], "hit": {"lru": 0.300, "s3fifo": 0.300, "auto": 0.310}},
    ]
    s = basket.summary(rows, "auto")
    assert s["below_target"] == ["b [20]"]  # a: 0.992 of the better
    assert s["max_gap_to_best"] == pytest.approx(0.020)
    assert s["min_ratio_to_best"] == pytest.approx(0.96)


def test_basket_host_share_and_lower_policy_shape_the_hierarchy_points() -> None:
    """Other host shares size the host tier; ``lower`` sets only the tiers below the first, and
    replaying with it gives what the per-tier policies give in a replay of their own."""
    src = basket.Source(kind="chat", seed=0, requests=80)
    for share in (0.125, 0.5):
        pts = basket.points([src], ["s3fifo"], [False], share, "lru")
        two = [p for p in pts if len(p.caps) == 2]
        assert len(two) == len(basket.FRACTIONS)
        assert all(p.caps[0] == max(1, round(share * p.caps[1])) for p in two)
        assert {p.lower for p in pts if len(p.caps) == 1} == {""}
        assert {p.lower for p in two} == {"lru"}
    p = two[-1]
    tiers = [TierSpec("t0", p.caps[0], "s3fifo"), TierSpec("t1", p.caps[1], "lru")]
    mixed = replay(src.load(), tiers, hints=False).token_hit_ratio
    assert basket.run_point(p) == mixed
    uniform = replay(src.load(), [replace(t, policy="s3fifo") for t in tiers], hints=False)
    assert mixed != uniform.token_hit_ratio  # the point tells the two apart
    assert basket.run_point(replace(p, lower="")) == uniform.token_hit_ratio
    with pytest.raises(ValueError, match="host_share"):
        basket.sizes(src.load(), 0.0)


def test_basket_sizes_in_blocks_replace_the_fractions() -> None:
    """``blocks`` (held-out sizes between the basket's): one tier and host + NVMe of each size,
    the fraction each is of the trace's distinct blocks; a size below one block is an error."""
    trace = generate("rag", 100, 0)
    n = basket.distinct_full_blocks(trace)
    got = basket.sizes(trace, 0.5, [7, 40])
    assert got == [(7 / n, (7,)), (7 / n, (4, 7)), (40 / n, (40,)), (40 / n, (20, 40))]
    src = basket.Source(kind="rag", seed=0, requests=100)
    pts = basket.points([src], ["lru"], [False], 0.5, blocks=[7, 40])
    assert [p.caps for p in pts] == [c for _, c in got]
    with pytest.raises(ValueError, match="blocks"):
        basket.sizes(trace, 0.5, [0])


@pytest.mark.parametrize(
    ("extra", "needle"),
    [([], "add --sweep"), (["--sweep", "--tier", "hbm=1GB"], "chooses its own")],
)
def test_cli_basket_flags_are_checked(
    extra: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["simulate", "--basket", *extra]) == 2
    assert needle in capsys.readouterr().err


def refine(trace: Trace, k: int) -> list[str]:
    """``trace`` (512-token ids) as a trace of ``512 // k``-token ids, in the Qwen-Bailian
    style: extra fields, timestamps in seconds. Sub-id ``j`` of block ``b`` is ``b * k + j``:
    chained, as ``b`` names everything before it."""
    small = BT // k
    lines = []
    for i, r in enumerate(trace.requests):
        n = len(r.blocks)
        ids = []
        for pos, b in enumerate(r.blocks):
            cnt = k if pos < n - 1 else -(-(r.input_length - BT * (n - 1)) // small)
            ids += [b * k + j for j in range(cnt)]
        obj = {"chat_id": i, "parent_chat_id": -1, "timestamp": r.timestamp_ms / 1000.0}
        obj |= {"input_length": r.input_length, "output_length": r.output_length, "type": "text"}
        lines.append(json.dumps(obj | {"turn": 1, "hash_ids": ids}))
    return lines


def test_fine_grained_trace_is_inferred_and_regrouped_to_the_store_block(tmp_path: Path) -> None:
    coarse = generate("mixed", 400, seed=3)
    fine = tmp_path / "qwen_trace_blksz_16.jsonl"
    fine.write_text("\n".join(refine(coarse, 32)) + "\n")
    assert read_trace(fine).block_tokens == 16
    back = read_trace(fine, block_tokens=512)
    assert back.block_tokens == 512 and back.input_tokens == coarse.input_tokens
    for pol in ("lru", "auto"):
        for caps in ([150], [40, 160]):
            tiers = [TierSpec(f"t{i}", c, pol) for i, c in enumerate(caps)]
            want = replay(coarse, tiers, hints=False)
            got = replay(back, tiers, hints=False)
            assert got.token_hit_ratio == want.token_hit_ratio > 0.05
            assert got.block_hits == want.block_hits
    (src,) = basket.sources(str(fine), 0, seeds=(), block_tokens=512)  # as the basket reads it
    pts = basket.points([src], ["lru"], [False])
    want_pts = [replace(p, source=basket.Source(kind="mixed", seed=3, requests=400)) for p in pts]
    assert basket.run(pts) == basket.run(want_pts)
    # the store's block between the trace's and 512: a different, valid replay
    mid = read_trace(fine, block_tokens=128)
    assert mid.block_tokens == 128 and all(
        len(r.blocks) == -(-r.input_length // 128) for r in mid.requests
    )


def test_block_size_errors_say_what_to_pass(tmp_path: Path) -> None:
    fine = tmp_path / "fine.jsonl"
    lines = refine(generate("chat", 50, seed=1), 32)
    fine.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"fine\.jsonl:1: .*needs \d+ blocks? of 512"):
        read_trace(fine, id_tokens=512)
    with pytest.raises(ConfigError, match="use a multiple of 16"):
        read_trace(fine, block_tokens=24)
    bad = json.loads(lines[7])
    bad["hash_ids"] = bad["hash_ids"][:-1]  # one line off by one id
    lines[7] = json.dumps(bad)
    fine.write_text("\n".join(lines) + "\n")
    with pytest.raises(TraceError, match=r"fine\.jsonl:8: .* of 16 tokens.*--trace-block-tokens"):
        read_trace(fine)
    short = tmp_path / "short.jsonl"  # one-id prompts fit every size from 16 up
    short.write_text("".join(f'{{"input_length": 10, "hash_ids": [{i}]}}\n' for i in range(3)))
    assert read_trace(short).block_tokens == 512  # Mooncake's, when it fits as many as any
    short.write_text(
        '{"input_length": 40, "hash_ids": [1, 2, 3]}\n'  # 16 tokens per id only
        '{"input_length": 64, "hash_ids": [4, 5]}\n'  # 32 only
        '{"input_length": 10, "hash_ids": [6]}\n'  # 16, 32, ... 512, ...
    )
    with pytest.raises(TraceError, match=r"short\.jsonl: hash ids of .*fit its lines equally"):
        read_trace(short)


def test_cli_block_tokens_replays_the_regrouped_trace(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    coarse = tmp_path / "coarse.jsonl"
    write_trace(generate("rag", 300, seed=2), coarse)
    fine = tmp_path / "fine.jsonl"
    fine.write_text("\n".join(refine(read_trace(coarse), 4)) + "\n")
    out = []
    for path, extra in ((coarse, []), (fine, ["--block-tokens", "512"])):
        args = ["simulate", "--trace", str(path), "--capacity-blocks", "200", "--json", *extra]
        assert main(args) == 0
        out.append(json.loads(capsys.readouterr().out))
    assert out[0]["token_hit_ratio"] == out[1]["token_hit_ratio"] > 0.05
    said = [(o["assumptions"]["block_tokens"], o["assumptions"]["trace_block_tokens"]) for o in out]
    assert said == [(512, 512), (512, 128)]  # what was inferred is reported
    assert main(["simulate", "--trace", str(fine), "--capacity-blocks", "9", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["block_events"] > out[0]["block_events"]
    assert (
        main(
            ["simulate", "--trace", str(coarse), "--capacity-blocks", "9", "--block-tokens", "100"]
        )
        == 2
    )
    assert "use a multiple of 512" in capsys.readouterr().err
    assert main(["simulate", "--sweep", "--basket", "--block-tokens", "1024"]) == 2
    assert "apply to the basket's --trace file" in capsys.readouterr().err
