"""Held-out scenarios: workload families unlike the basket's, to check a policy on traffic it
was not chosen on (``docs/policy-experiments.md``).

The basket (``kvtier.sim.basket``) judges policies on ``kvtier.sim.workload``'s generators.
These families change what those generators hold fixed -- how many conversations are live and
how long they last, which one speaks next, how wide and how skewed a document corpus is, how
many system prompts there are, agents whose context grows step by step -- and add traffic that
changes over time (phases). They are for checking only: tune nothing on them, or they stop
being held out. Each point is an exact replay (``kvtier.sim.replay``), one tier and host + NVMe,
at the basket's fractions of the trace's distinct full blocks, hints off.

Run: ``.venv/bin/python scripts/heldout_scenarios.py [--families chat-long,shift]
[--seeds 0,1] [--policies auto,lru,s3fifo] [--host-share 0.25] [--requests 2000] [--jobs 2]``.
Prints one line per point and, per policy, the points within 1% of the better of LRU and
S3-FIFO (``kvtier.sim.basket.summary``).
"""

from __future__ import annotations

import argparse
import json
import random
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from kvtier.sim import basket
from kvtier.sim.replay import TierSpec, replay
from kvtier.sim.trace import Request, Trace
from kvtier.sim.workload import Namer, Segment, zipf_index


@dataclass(frozen=True)
class Family:
    """What a family changes from the basket's generators (their values are the defaults)."""

    sessions: int = 64  # conversations live at once
    continue_p: float = 0.7  # a chat request continues a live conversation
    end_p: float = 0.25  # a continued conversation ends after this turn
    recent_rate: float = 0.0  # > 0: the next speaker is a recent conversation (exponential)
    systems: int = 8
    system_skew: float = 1.1
    docs: int = 200
    doc_skew: float = 1.1
    docs_per_request: int = 3
    mix: tuple[tuple[str, float], ...] = (("chat", 1.0),)  # kinds and their weights
    phases: tuple[str, ...] = ()  # kinds in turn (equal parts), instead of ``mix``
    phase_requests: int = 0  # > 0: phases of this many requests, cycling


FAMILIES = {
    "chat-long": Family(sessions=256, continue_p=0.85, end_p=0.08),
    "chat-short": Family(sessions=16, continue_p=0.5, end_p=0.5),
    "chat-bursty": Family(recent_rate=0.3),
    "rag-wide": Family(docs=2000, doc_skew=0.8, docs_per_request=5, mix=(("rag", 1.0),)),
    "rag-hot": Family(docs=40, doc_skew=1.4, docs_per_request=5, mix=(("rag", 1.0),)),
    "sys-many": Family(systems=64, system_skew=0.9, mix=(("system-prompt", 1.0),)),
    "agent-deep": Family(sessions=32, mix=(("agent", 1.0),)),
    "shift": Family(phases=("chat", "rag", "system-prompt")),
    "alternate": Family(phases=("chat", "rag"), phase_requests=250),
    "mix-weighted": Family(mix=(("chat", 0.6), ("rag", 0.3), ("system-prompt", 0.1))),
}


def generate(name: str, requests: int, seed: int, block_tokens: int = 512) -> Trace:
    """A trace of family ``name``: prompts as segment lists, named like real prefix hashes."""
    fam = FAMILIES[name]
    rng = random.Random(seed)
    counter = iter(range(1 << 62))
    namer = Namer(block_tokens)

    def seg(lo: int, hi: int) -> Segment:
        return (next(counter), rng.randint(lo, hi))

    systems = [seg(300, 4000) for _ in range(fam.systems)]
    docs = [seg(800, 10000) for _ in range(fam.docs)]
    chats: list[list[Segment]] = []
    tasks: list[list[Segment]] = []

    def chat() -> list[Segment]:
        if chats and rng.random() < fam.continue_p:
            if fam.recent_rate:
                i = len(chats) - 1 - min(len(chats) - 1, int(rng.expovariate(fam.recent_rate)))
            else:
                i = rng.randrange(len(chats))
            segs = [*chats[i], seg(20, 400), seg(50, 800)]  # answer + next turn
            if rng.random() < fam.end_p:
                chats.pop(i)
            else:
                chats[i] = segs
            return segs
        segs = [systems[zipf_index(rng, len(systems), fam.system_skew)], seg(50, 2000)]
        chats.append(segs)
        if len(chats) > fam.sessions:
            chats.pop(0)
        return segs

    def rag() -> list[Segment]:
        k = rng.randint(1, fam.docs_per_request)
        picked = (docs[zipf_index(rng, len(docs), fam.doc_skew)] for _ in range(k))
        return [systems[0], *picked, seg(20, 300)]

    def system_prompt() -> list[Segment]:
        return [systems[zipf_index(rng, len(systems), fam.system_skew)], seg(100, 4000)]

    def agent() -> list[Segment]:  # a task's context grows by a call and a tool output a step
        if tasks and rng.random() < 0.8:
            i = rng.randrange(len(tasks))
            segs = [*tasks[i], seg(100, 600), seg(200, 3000)]
            if rng.random() < 0.1 or sum(n for _, n in segs) > 60000:
                tasks.pop(i)
            else:
                tasks[i] = segs
            return segs
        segs = [systems[-1], seg(500, 3000)]
        tasks.append(segs)
        if len(tasks) > fam.sessions:
            tasks.pop(0)
        return segs

    makers: dict[str, Callable[[], list[Segment]]] = {
        "chat": chat,
        "rag": rag,
        "system-prompt": system_prompt,
        "agent": agent,
    }
    kinds, weights = zip(*fam.mix, strict=True)
    out: list[Request] = []
    t = 0.0
    for j in range(requests):
        if fam.phases and fam.phase_requests:
            kind = fam.phases[(j // fam.phase_requests) % len(fam.phases)]
        elif fam.phases:
            kind = fam.phases[len(fam.phases) * j // requests]
        else:
            kind = rng.choices(kinds, weights)[0]
        segs = makers[kind]()
        t += rng.expovariate(4.0) * 1000.0
        length = sum(n for _, n in segs)
        out.append(Request(round(t, 3), length, 100, namer.blocks(segs)))
    return Trace(tuple(out), block_tokens, f"{name}/{seed}")


_traces: dict[tuple[str, int, int], Trace] = {}


def _point(args: tuple[str, int, int, tuple[int, ...], str]) -> float:
    name, seed, requests, caps, policy = args
    key = (name, seed, requests)
    if key not in _traces:
        _traces[key] = generate(name, requests, seed)
    tiers = [TierSpec(f"t{i}", c, policy) for i, c in enumerate(caps)]
    return replay(_traces[key], tiers, hints=False).token_hit_ratio


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--families", default=",".join(FAMILIES), help="comma-separated families")
    ap.add_argument("--seeds", default="0,1,2,3", help="comma-separated seeds")
    ap.add_argument("--policies", default="auto,lru,s3fifo", help="policies to replay")
    ap.add_argument(
        "--host-share",
        type=float,
        default=basket.HOST_SHARE,
        help="host tier as a share of the NVMe tier (host + NVMe points)",
    )
    ap.add_argument("--requests", type=int, default=2000, help="requests per trace")
    ap.add_argument("--jobs", type=int, default=2, help="worker processes")
    args = ap.parse_args()
    families = args.families.split(",")
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        ap.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    pols = args.policies.split(",")
    seeds = [int(s) for s in args.seeds.split(",")]
    jobs, meta = [], []
    for name in families:
        for seed in seeds:
            trace = generate(name, args.requests, seed)
            for frac, caps in basket.sizes(trace, args.host_share):
                meta.append((f"{name}/{seed}", frac, caps))
                jobs += [(name, seed, args.requests, caps, p) for p in pols]
    with ProcessPoolExecutor(args.jobs) as pool:
        hits = list(pool.map(_point, jobs, chunksize=4))
    rows = []
    for i, (trace_name, frac, caps) in enumerate(meta):
        h = dict(zip(pols, hits[i * len(pols) : (i + 1) * len(pols)], strict=True))
        rows.append({"trace": trace_name, "fraction": frac, "caps": list(caps), "hit": h})
        print(trace_name, f"{frac:.2f}", list(caps), " ".join(f"{p}={v:.4f}" for p, v in h.items()))
    for p in pols:
        if p not in ("lru", "s3fifo"):
            print(json.dumps(basket.summary(rows, p)))


if __name__ == "__main__":
    main()
