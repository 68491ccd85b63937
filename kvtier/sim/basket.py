"""The policy basket: every workload and size the default policy is judged on.

``kvtier simulate --sweep --basket [--trace FILE]`` (``kvtier.cli.simulate``) and
``scripts/policy_basket.py`` replay, for each policy asked:

* **traces** -- a Mooncake-format trace if one is given (``--trace``), plus each synthetic
  generator of ``kvtier.sim.workload`` (chat, system-prompt, rag, agent, mixed) with seeds
  0, 1, 2 (``--requests`` requests each);
* **sizes** -- ``FRACTIONS`` of the trace's distinct full blocks (1% to 50%), each as one tier
  of that many blocks and as host + NVMe: a host tier of ``HOST_SHARE`` of it (a quarter; other
  shares check shapes the default was not chosen on) above an NVMe tier of it (inclusive: the
  NVMe tier holds what the host tier demoted);
* **hints** on or off, as the command says.

Each point is one exact replay (``kvtier.sim.replay``, the store's own decisions), so a row is
what a ``TieredStore`` of those sizes would deliver. Replays run ``jobs`` at a time in worker
processes; rows do not depend on ``jobs``.
"""

from __future__ import annotations

import multiprocessing
import statistics
from collections.abc import Callable, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import Trace, read_trace
from kvtier.sim.workload import generate

KINDS = ("chat", "system-prompt", "rag", "agent", "mixed")
SEEDS = (0, 1, 2)
#: sizes, as shares of a trace's distinct full blocks
FRACTIONS = (0.01, 0.03, 0.1, 0.3, 0.5)
#: host + NVMe: the host tier is this share of the NVMe tier
HOST_SHARE = 0.25


@dataclass(frozen=True, slots=True)
class Source:
    """A basket trace: a file (its hash ids of ``id_tokens``, grouped into blocks of
    ``block_tokens``: ``read_trace``; ``None``: inferred, the trace's own), or a synthetic
    generator and seed."""

    path: str = ""
    kind: str = ""
    seed: int = 0
    requests: int = 0
    block_tokens: int | None = None
    id_tokens: int | None = None

    @property
    def name(self) -> str:
        return Path(self.path).name if self.path else f"{self.kind}/{self.seed}"

    def load(self) -> Trace:
        if self.path:
            return read_trace(self.path, self.block_tokens, self.id_tokens)
        return generate(self.kind, self.requests, self.seed)


@dataclass(frozen=True, slots=True)
class Point:
    """One replay of the basket: a trace, sizes (blocks, fastest first), a policy, hints;
    ``lower``, if given, is the policy of the tiers below the first (``[[tiers]] policy``)."""

    source: Source
    fraction: float
    caps: tuple[int, ...]
    policy: str
    hints: bool
    lower: str = ""


def sources(
    trace_path: str | None,
    requests: int,
    seeds: Sequence[int] = SEEDS,
    block_tokens: int | None = None,
    id_tokens: int | None = None,
) -> list[Source]:
    """The basket's traces: ``trace_path`` (if any; ``block_tokens``, ``id_tokens``: see
    ``Source``) first, then every generator x seed (``seeds``: the basket's own, or others to
    check a policy on workloads it was not chosen on)."""
    out = [Source(trace_path, block_tokens=block_tokens, id_tokens=id_tokens)] if trace_path else []
    return out + [Source(kind=k, seed=s, requests=requests) for k in KINDS for s in seeds]


def distinct_full_blocks(trace: Trace) -> int:
    """Distinct blocks the store could cache (full blocks only)."""
    bt = trace.block_tokens
    return len({k for r in trace.requests for k in r.blocks[: r.input_length // bt]})


def sizes(
    trace: Trace, host_share: float = HOST_SHARE, blocks: Sequence[int] = ()
) -> list[tuple[float, tuple[int, ...]]]:
    """(fraction, caps) of every size of the basket for ``trace``: one tier and host + NVMe
    (the host tier ``host_share`` of the NVMe tier). The sizes are ``FRACTIONS`` of the
    trace's distinct full blocks, or ``blocks`` (sizes in blocks, to check sizes between)."""
    if not 0 < host_share <= 1:
        raise ValueError(f"host_share must be in (0, 1], got {host_share}")
    if any(b < 1 for b in blocks):
        raise ValueError(f"blocks must be >= 1, got {list(blocks)}")
    n = max(1, distinct_full_blocks(trace))
    caps = list(blocks) or [max(1, round(f * n)) for f in FRACTIONS]
    out: list[tuple[float, tuple[int, ...]]] = []
    for c in caps:
        f = c / n
        out += [(f, (c,)), (f, (max(1, round(host_share * c)), c))]
    return out


_traces: dict[Source, Trace] = {}  # a worker's (or this process's) traces, loaded once


def _trace(src: Source) -> Trace:
    t = _traces.get(src)
    if t is None:
        t = _traces[src] = src.load()
    return t


def run_point(p: Point) -> float:
    """The token hit ratio of one basket point (an exact replay)."""
    tiers = [
        TierSpec(f"t{i}", c, p.lower if i and p.lower else p.policy) for i, c in enumerate(p.caps)
    ]
    return replay(_trace(p.source), tiers, hints=p.hints).token_hit_ratio


def points(
    srcs: Sequence[Source],
    policies: Sequence[str],
    hints: Sequence[bool],
    host_share: float = HOST_SHARE,
    lower: str = "",
    blocks: Sequence[int] = (),
) -> list[Point]:
    """Every (trace, size, policy, hints) of the basket (host + NVMe with the host tier
    ``host_share`` of the NVMe tier; ``lower``: see ``Point``; ``blocks``: see ``sizes``)."""
    return [
        Point(src, f, caps, pol, h, lower if len(caps) > 1 else "")
        for src in srcs
        for f, caps in sizes(_trace(src), host_share, blocks)
        for pol in policies
        for h in hints
    ]


def run(
    pts: Sequence[Point], jobs: int = 1, done: Callable[[int], None] | None = None
) -> list[float]:
    """``run_point`` of each point, in order, ``jobs`` at a time (worker processes)."""
    if jobs <= 1 or len(pts) < 2:
        out = []
        for p in pts:
            out.append(run_point(p))
            if done is not None:
                done(len(out))
        return out
    ctx = multiprocessing.get_context(
        "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    )
    # the longest replays first, so no worker is left with one at the end
    order = sorted(range(len(pts)), key=lambda i: -_trace(pts[i].source).block_events)
    res: list[float] = [0.0] * len(pts)
    with ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        for n, (i, r) in enumerate(
            zip(order, pool.map(run_point, [pts[i] for i in order], chunksize=4), strict=True)
        ):
            res[i] = r
            if done is not None:
                done(n + 1)
    return res


def table(pts: Sequence[Point], ratios: Sequence[float]) -> list[dict[str, Any]]:
    """One row per (trace, sizes, hints): each policy's token hit ratio."""
    rows: dict[tuple[str, tuple[int, ...], bool], dict[str, Any]] = {}
    for p, r in zip(pts, ratios, strict=True):
        key = (p.source.name, p.caps, p.hints)
        row = rows.setdefault(
            key,
            {
                "trace": p.source.name,
                "fraction": p.fraction,
                "caps": list(p.caps),
                "hints": p.hints,
                "hit": {},
            },
        )
        row["hit"][p.policy] = r
    return list(rows.values())


def summary(rows: Sequence[dict[str, Any]], policy: str) -> dict[str, Any]:
    """How ``policy`` did over ``rows`` (``table``): points below the better of LRU and S3-FIFO
    less 1% (the target, read as 1% of it), its ratios to that better one and to Belady (when
    replayed), and its largest shortfall in hit-ratio points (``max_gap_to_best``: the target
    read as one percentage point would need it <= 0.01)."""
    to_best, to_belady, below, gaps = [], [], [], []
    for r in rows:
        h = r["hit"]
        best = max(h.get("lru", 0.0), h.get("s3fifo", 0.0))
        if best and policy in h:
            to_best.append(h[policy] / best)
            gaps.append(best - h[policy])
            if h[policy] < 0.99 * best:
                below.append(f"{r['trace']} {r['caps']}")
        if h.get("belady") and policy in h:
            to_belady.append(h[policy] / h["belady"])
    out: dict[str, Any] = {"policy": policy, "points": len(rows), "below_target": below}
    if to_best:
        out["min_ratio_to_best"] = min(to_best)
        out["mean_ratio_to_best"] = statistics.mean(to_best)
        out["max_gap_to_best"] = max(gaps)
    if to_belady:
        out["mean_ratio_to_belady"] = statistics.mean(to_belady)
    return out
