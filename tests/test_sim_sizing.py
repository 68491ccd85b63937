"""``kvtier plan --trace``: cheapest tier sizes meeting a TTFT p90 SLO."""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvtier.cli import plan_trace
from kvtier.cli.main import main
from kvtier.sim import sizing
from kvtier.sim.hierarchy import Hierarchy
from kvtier.sim.trace import Request, Trace, write_trace
from kvtier.sim.trace import Trace as _T
from kvtier.sim.workload import generate

SPACE = ["--model", "Llama-3.1-8B", "--gpus", "1", "--dram", "50GB", "--nvme", "100GB"]


def space(trace: Trace, policy: str = "lru") -> tuple[Hierarchy, list[int]]:
    ns = argparse.Namespace(
        model="Llama-3.1-8B",
        dtype="bf16",
        gpus=1,
        weights_bytes=None,
        weights_dtype="bf16",
        gpu_memory="80GB",
        policy=policy,
        dram="50GB",
        nvme="100GB",
        pool="0",
        nodes=1,
        route="rr",
    )
    hier, max_blocks, _ = plan_trace.search_space(ns, trace)
    return hier, max_blocks


@pytest.fixture(scope="module")
def trace() -> Trace:
    return generate("mixed", 400, seed=1)


def p90_range(trace: Trace, hier: Hierarchy, max_blocks: list[int]) -> tuple[float, float]:
    """(p90 with every tier at its largest, p90 with no cache)."""
    top, _ = sizing.exact_p90(
        trace, sizing.sized(hier, tuple(m * hier.block_bytes for m in max_blocks))
    )
    none, _ = sizing.exact_p90(trace, sizing.sized(hier, tuple(0 for _ in max_blocks)))
    return top, none


def tree_trace(seed: int, n_req: int = 80, nodes: int = 60) -> Trace:
    rng = random.Random(seed)
    parent = [-1] + [rng.randrange(i) if rng.random() < 0.85 else -1 for i in range(1, nodes)]
    reqs = []
    for i in range(n_req):
        node, path = rng.randrange(nodes), []
        while node != -1:
            path.append(node)
            node = parent[node]
        path.reverse()
        reqs.append(Request(float(i), 512 * len(path) - rng.randrange(512), 1, tuple(path)))
    return _T(tuple(reqs))


def test_looser_slo_never_costs_more_and_meets_it(trace: Trace) -> None:
    hier, max_blocks = space(trace)
    best, worst = p90_range(trace, hier, max_blocks)
    assert best < worst
    prof = sizing.lru_profile(trace)
    costs = []
    for slo in np.linspace(best, worst, 7):
        found = sizing.search(trace, hier, max_blocks, float(slo), points=5, prof=prof)
        assert found.caps_bytes is not None
        chosen = sizing.sized(hier, found.caps_bytes)
        p90, _ = sizing.exact_p90(trace, chosen)  # replayed afresh: really meets the SLO
        assert p90 <= slo
        costs.append(sum(t.capacity_bytes * t.cost.usd_per_gb_month for t in chosen.tiers))
    assert costs == sorted(costs, reverse=True)
    assert costs[0] > costs[-1] == 0  # the loosest SLO needs no cache at all


def test_default_policy_choice_is_verified_by_replay(trace: Trace) -> None:
    hier, max_blocks = space(trace, "s3fifo")
    best, worst = p90_range(trace, hier, max_blocks)
    slo = best + (worst - best) / 3
    found = sizing.search(trace, hier, max_blocks, slo, points=4, margin=0.02)
    assert found.caps_bytes is not None
    p90, _ = sizing.exact_p90(trace, sizing.sized(hier, found.caps_bytes))
    assert p90 <= slo


def run_cli(args: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, dict[str, Any]]:
    rc = main(args)
    return rc, json.loads(capsys.readouterr().out)


def test_cli_json(tmp_path: Path, trace: Trace, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    hier, max_blocks = space(trace)
    best, worst = p90_range(trace, hier, max_blocks)
    slo = (best + worst) / 2
    rc, out = run_cli(
        [
            "plan",
            "--trace",
            str(path),
            "--slo-ttft-p90",
            str(slo),
            "--policy",
            "lru",
            "--json",
            *SPACE,
        ],
        capsys,
    )
    assert rc == 0 and out["feasible"] is True
    ttft = out["ttft_s"]
    assert isinstance(ttft, dict) and ttft["p50"] <= ttft["p90"] <= slo
    chosen = out["chosen_bytes"]
    assert isinstance(chosen, dict) and set(chosen) == {"hbm", "dram", "nvme"}
    assert chosen["hbm"] > 0
    for key in (
        "token_hit_ratio",
        "monthly_cost_usd",
        "assumptions",
        "search",
        "tiers",
        "lower_policy_check",
    ):
        assert key in out
    assert out["monthly_cost_usd"] == pytest.approx(
        sum(c / 1e9 * {"hbm": 15, "dram": 4, "nvme": 0.08}[n] for n, c in chosen.items())
    )


def test_the_answer_is_checked_with_each_policy_below_the_first(trace: Trace) -> None:
    """``lower_policy_check`` replays an answer's sizes with every lower tier run by LRU, then by
    S3-FIFO, skipping the one they already run; each row is that configuration's own replay."""
    hier, max_blocks = space(trace, "auto")
    caps = (hier.block_bytes * max_blocks[0], hier.block_bytes * 40, hier.block_bytes * 200)
    rows = sizing.lower_policy_check(trace, sizing.sized(hier, caps))
    assert [r["lower_policy"] for r in rows] == ["lru", "s3fifo"]
    for r in rows:
        tiers = sizing.sized(hier, caps).tiers
        alt = hier.with_tiers(
            [tiers[0], *(dataclasses.replace(t, policy=r["lower_policy"]) for t in tiers[1:])]
        )
        p90, res = sizing.exact_p90(trace, alt)
        assert r["ttft_p90_s"] == p90 and r["token_hit_ratio"] == res.token_hit_ratio
    lru_hier, _ = space(trace, "lru")
    rows = sizing.lower_policy_check(trace, sizing.sized(lru_hier, caps))
    assert [r["lower_policy"] for r in rows] == ["s3fifo"]  # LRU below already
    upper = sizing.sized(lru_hier, caps)
    upper = upper.with_tiers(
        [upper.tiers[0], *(dataclasses.replace(t, policy="LRU") for t in upper.tiers[1:])]
    )
    assert [r["lower_policy"] for r in sizing.lower_policy_check(trace, upper)] == ["s3fifo"]
    assert sizing.lower_policy_check(trace, sizing.sized(hier, (caps[0], 0, 0))) == []


def test_cli_impossible_slo(
    tmp_path: Path, trace: Trace, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    rc, out = run_cli(
        ["plan", "--trace", str(path), "--slo-ttft-p90", "1e-6", "--json", *SPACE], capsys
    )
    assert rc == 1 and out["feasible"] is False
    assert "no configuration meets" in str(out["message"])


def test_cli_needs_an_slo(tmp_path: Path, trace: Trace, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    assert main(["plan", "--trace", str(path), *SPACE]) == 2
    assert "--slo-ttft-p90" in capsys.readouterr().err


def test_a_slo_only_the_policy_meets_is_found(trace: Trace) -> None:
    """S3-FIFO beats the LRU estimate by more than the screening margin at every size here: the
    screen widens instead of calling the SLO impossible (the largest size meets it)."""
    hier, _ = space(trace, "s3fifo")
    max_blocks = [103, 0, 0]  # one small first tier: the policies differ most
    top, _ = sizing.exact_p90(trace, sizing.sized(hier, (103 * hier.block_bytes, 0, 0)))
    prof = sizing.lru_profile(trace)
    inp = np.array([r.input_length for r in trace.requests], dtype=np.int64)
    lru_best = sizing._p90(sizing.estimate_hits(prof, (103, 0, 0)), inp, hier)
    slo = top + (lru_best - top) / 4
    assert slo * (1 + sizing.DEFAULT_MARGIN) < lru_best  # the first screen admits nothing
    found = sizing.search(trace, hier, max_blocks, slo, points=6, margin=sizing.DEFAULT_MARGIN)
    assert found.caps_bytes is not None and not found.exhausted
    p90, _ = sizing.exact_p90(trace, sizing.sized(hier, found.caps_bytes))
    assert p90 <= slo and found.caps_bytes[0] < 103 * hier.block_bytes


def test_plan_rejects_a_slo_that_is_not_a_finite_number(
    tmp_path: Path, trace: Trace, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "t.jsonl"
    write_trace(trace, path)
    for slo in ("nan", "inf", "-1"):
        assert main(["plan", "--trace", str(path), "--slo-ttft-p90", slo, *SPACE]) == 2
        assert "finite" in capsys.readouterr().err
    assert (
        main(["plan", "--trace", str(path), "--slo-ttft-p90", "1", "--screen-margin", "nan"]) == 2
    )


def test_plan_says_when_the_weights_do_not_fit(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--model", "Llama-3.1-70B", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_fit"] is False and out["fits_in_hbm"] is False
    assert out["min_tp_for_weights"] == 2
    assert main(["plan", "--model", "Llama-3.1-70B", "--tp", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["weights_fit"] is True
    assert main(["plan", "--model", "Llama-3.1-70B"]) == 0
    assert "WEIGHTS DO NOT FIT" in capsys.readouterr().out


def test_a_cheaper_size_only_the_policy_meets_is_found(trace: Trace) -> None:
    """The answer is the cheapest grid configuration whose S3-FIFO replay meets the SLO, checked
    against replaying every one: here that configuration's LRU estimate misses the SLO by more
    than the first screen's margin, and stopping at the first answer cost 13% more."""
    hier, max_blocks = space(trace, "s3fifo")
    best, worst = p90_range(trace, hier, max_blocks)
    slo = best + (worst - best) / 4
    found = sizing.search(trace, hier, max_blocks, slo, points=4, margin=sizing.DEFAULT_MARGIN)
    assert found.caps_bytes is not None and not found.exhausted
    bb = hier.block_bytes
    price = [t.cost.usd_per_gb_month * bb / 1e9 for t in hier.tiers]
    prof = sizing.lru_profile(trace)
    inp = np.array([r.input_length for r in trace.requests], dtype=np.int64)
    longest = max(len(r.blocks) for r in trace.requests)
    grids = [sizing.grid(min(m, prof.distinct), 4, longest if i == 0 else 1)
             for i, m in enumerate(max_blocks)]  # fmt: skip
    met = []
    for caps in itertools.product(*grids):
        if caps[0] == 0 and any(caps[1:]):
            continue
        p90, _ = sizing.exact_p90(trace, sizing.sized(hier, tuple(c * bb for c in caps)))
        if p90 <= slo:
            met.append((sum(c * p for c, p in zip(caps, price, strict=True)), caps))
    _, cheapest = min(met)
    assert found.caps_bytes == tuple(c * bb for c in cheapest)
    estimate = sizing._p90(sizing.estimate_hits(prof, cheapest), inp, hier)
    assert estimate > slo * (1 + sizing.DEFAULT_MARGIN)  # the first screen passed it over


def test_replays_in_workers_give_the_same_answer(trace: Trace) -> None:
    """Candidates replayed two at a time in worker processes: the same sizes, p90 and replays
    counted as one at a time, for an SLO met at once and one met only after the screen widens."""
    hier, max_blocks = space(trace, "s3fifo")
    best, worst = p90_range(trace, hier, max_blocks)
    for slo in (best + (worst - best) / 4, best + (worst - best) / 8):
        one, two = (
            sizing.search(trace, hier, max_blocks, slo, points=4, margin=0.01, jobs=j)
            for j in (1, 2)
        )
        assert one.caps_bytes is not None and one.replays > 2
        assert (two.caps_bytes, two.best_p90_s, two.replays) == (
            one.caps_bytes,
            one.best_p90_s,
            one.replays,
        )


def test_after_an_answer_cheaper_sizes_are_tried_most_promising_first(
    trace: Trace, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Once an answer stands, the walk replays only cheaper sizes, lowest LRU estimate first
    (the screen's margin only widens once none is left, admitting higher estimates): the replay
    budget goes first to the sizes likeliest to meet the SLO, not to the smallest."""
    hier, max_blocks = space(trace, "s3fifo")
    best, worst = p90_range(trace, hier, max_blocks)
    slo = best + (worst - best) / 4
    tried: list[tuple[int, ...]] = []
    real_sized = sizing.sized

    def sized(h: Hierarchy, caps_bytes: tuple[int, ...]) -> Hierarchy:
        tried.append(caps_bytes)
        return real_sized(h, caps_bytes)

    monkeypatch.setattr(sizing, "sized", sized)
    found = sizing.search(trace, hier, max_blocks, slo, points=4, margin=sizing.DEFAULT_MARGIN)
    monkeypatch.undo()
    assert found.caps_bytes is not None
    bb = hier.block_bytes
    price = [t.cost.usd_per_gb_month * bb / 1e9 for t in hier.tiers]
    prof = sizing.lru_profile(trace)
    inp = np.array([r.input_length for r in trace.requests], dtype=np.int64)
    answer: float | None = None  # the cost of the answer standing
    last_est = -1.0
    after = 0  # replays made while an answer stood
    for caps_bytes in tried[1:]:  # (the first is the largest configuration)
        caps = tuple(c // bb for c in caps_bytes)
        cost = sum(c * p for c, p in zip(caps, price, strict=True))
        est = sizing._p90(sizing.estimate_hits(prof, caps), inp, hier)
        if answer is not None:
            after += 1
            assert cost < answer
            assert est >= last_est - 1e-12  # most promising first, while this answer stands
        last_est = est
        p90, _ = sizing.exact_p90(trace, real_sized(hier, caps_bytes))
        if p90 <= slo:
            answer, last_est = cost, -1.0
    assert after >= 2
