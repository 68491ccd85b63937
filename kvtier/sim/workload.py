"""Synthetic workloads: multi-turn chat, shared system prompts, RAG documents, agents.

A prompt is a list of *segments* (a system prompt, a document, a user turn, a tool output), each a
``(segment_id, tokens)`` pair; identical segment sequences are identical token sequences. Block
ids are chained exactly like real prefix hashes: block ``i`` of a prompt is named by its parent's
id and the segment pieces it covers, so two prompts share block ids exactly as far as they share
a token prefix (block aligned). Arrivals are Poisson. Deterministic for a given seed.
"""

from __future__ import annotations

import random
from collections.abc import Callable

from kvtier.errors import ConfigError
from kvtier.sim.trace import MOONCAKE_BLOCK_TOKENS, Request, Trace

Segment = tuple[int, int]  # (segment id, tokens)


class Namer:
    """Chained block ids for segment lists (a trie over block contents)."""

    def __init__(self, block_tokens: int) -> None:
        self.bt = block_tokens
        self.ids: dict[tuple[int, tuple[tuple[int, int, int], ...]], int] = {}

    def blocks(self, segs: list[Segment]) -> tuple[int, ...]:
        out: list[int] = []
        parent = -1
        piece: list[tuple[int, int, int]] = []
        fill = 0
        for sid, n in segs:
            start = 0
            while start < n:
                take = min(n - start, self.bt - fill)
                piece.append((sid, start, start + take))
                start += take
                fill += take
                if fill == self.bt:
                    parent = self._id(parent, piece)
                    out.append(parent)
                    piece, fill = [], 0
        if piece:
            out.append(self._id(parent, piece))
        return tuple(out)

    def _id(self, parent: int, piece: list[tuple[int, int, int]]) -> int:
        return self.ids.setdefault((parent, tuple(piece)), len(self.ids))


def zipf_index(rng: random.Random, n: int, s: float = 1.1) -> int:
    """An index in ``range(n)`` drawn with weight ``1 / (i + 1) ** s`` (popular ones first)."""
    weights = [1.0 / (i + 1) ** s for i in range(n)]
    return rng.choices(range(n), weights)[0]


def generate(
    kind: str,
    requests: int,
    seed: int = 0,
    rate_per_s: float = 4.0,
    block_tokens: int = MOONCAKE_BLOCK_TOKENS,
) -> Trace:
    """A synthetic trace of ``requests`` requests of the given ``kind`` (or ``mixed``)."""
    if requests <= 0:
        raise ConfigError(f"synthetic workload needs >= 1 request, got {requests}")
    rng = random.Random(seed)
    counter = iter(range(1 << 62))
    namer = Namer(block_tokens)
    systems = [(next(counter), rng.randint(500, 3000)) for _ in range(8)]
    docs = [(next(counter), rng.randint(1000, 8000)) for _ in range(200)]
    sessions: list[tuple[str, list[Segment]]] = []

    def new_segment(lo: int, hi: int) -> Segment:
        return (next(counter), rng.randint(lo, hi))

    def chat() -> list[Segment]:
        if sessions and rng.random() < 0.7:  # continue a live session
            i = rng.randrange(len(sessions))
            skind, segs = sessions[i]
            segs = [*segs, new_segment(20, 400), new_segment(50, 800)]  # answer + next turn
            if rng.random() < 0.25:
                sessions.pop(i)
            else:
                sessions[i] = (skind, segs)
            return segs
        segs = [systems[zipf_index(rng, len(systems))], new_segment(50, 2000)]
        sessions.append(("chat", segs))
        if len(sessions) > 64:
            sessions.pop(0)
        return segs

    def system_prompt() -> list[Segment]:
        return [systems[zipf_index(rng, len(systems))], new_segment(20, 1500)]

    def rag() -> list[Segment]:
        k = rng.randint(1, 3)
        picked = (docs[zipf_index(rng, len(docs))] for _ in range(k))
        return [systems[0], *picked, new_segment(20, 300)]

    def agent() -> list[Segment]:
        return chat() if rng.random() < 0.5 else [systems[-1], new_segment(2000, 6000)]

    makers: dict[str, Callable[[], list[Segment]]] = {
        "chat": chat,
        "system-prompt": system_prompt,
        "rag": rag,
        "agent": agent,
    }
    if kind != "mixed" and kind not in makers:
        raise ConfigError(f"unknown synthetic workload {kind!r}; choose {', '.join(makers)}, mixed")
    t = 0.0
    out: list[Request] = []
    for _ in range(requests):
        make = makers[kind] if kind != "mixed" else makers[rng.choice(list(makers))]
        segs = make()
        t += rng.expovariate(rate_per_s) * 1000.0
        length = sum(n for _, n in segs)
        out.append(Request(round(t, 3), length, rng.randint(16, 512), namer.blocks(segs)))
    return Trace(tuple(out), block_tokens, f"synthetic-{kind}")
