"""A realistic mixed prompt workload with real token ids, for the demo and the benchmarks.

Four kinds of traffic, interleaved the way a serving node sees them:

- **chat**: multi-turn sessions; each turn re-sends a shared system prompt plus the whole
  history, then appends the user's message and the model's reply;
- **document QA**: long documents, each asked several questions (document first, question last);
- **agents**: a scratchpad that grows every step and is re-read in full each time;
- **one-off** prompts with nothing to reuse (they keep the hit ratio honest).

Token ids are drawn from a seeded generator; the KV a model would compute for them is stood in
by ``synthetic_kv``, a deterministic function of the prefix so a wrong block is detectable.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvtier.layout import KVLayout

VOCAB = 32000


@dataclass(frozen=True, slots=True)
class Request:
    kind: str  # chat | doc | agent | oneoff
    session: str
    tokens: np.ndarray[Any, np.dtype[np.int64]]
    output_tokens: int


def mixed_workload(seed: int = 0, scale: float = 1.0) -> Iterator[Request]:
    """Yield requests of the four kinds; ``scale`` multiplies the number of sessions."""
    rng = np.random.default_rng(seed)

    def words(n: int) -> np.ndarray[Any, np.dtype[np.int64]]:
        return rng.integers(1, VOCAB, size=n, dtype=np.int64)

    systems = [words(int(rng.integers(700, 1400))) for _ in range(3)]
    streams: list[Iterator[Request]] = []

    def chat(i: int) -> Iterator[Request]:
        history = systems[i % len(systems)].copy()
        for _ in range(int(rng.integers(3, 7))):
            history = np.concatenate([history, words(int(rng.integers(40, 300)))])
            out = int(rng.integers(60, 400))
            yield Request("chat", f"chat-{i}", history, out)
            history = np.concatenate([history, words(out)])

    def document(i: int) -> Iterator[Request]:
        doc = words(int(rng.integers(4000, 9000)))
        for _ in range(int(rng.integers(2, 5))):
            yield Request("doc", f"doc-{i}", np.concatenate([doc, words(40)]), 120)

    def agent(i: int) -> Iterator[Request]:
        pad = np.concatenate([systems[0], words(500)])
        for _ in range(int(rng.integers(4, 8))):
            pad = np.concatenate([pad, words(int(rng.integers(100, 400)))])
            yield Request("agent", f"agent-{i}", pad, 200)

    def oneoff(i: int) -> Iterator[Request]:
        yield Request("oneoff", f"oneoff-{i}", words(int(rng.integers(300, 2000))), 100)

    n = max(1, round(4 * scale))
    streams += [chat(i) for i in range(3 * n)]
    streams += [document(i) for i in range(n)]
    streams += [agent(i) for i in range(n)]
    streams += [oneoff(i) for i in range(2 * n)]
    while streams:
        k = int(rng.integers(len(streams)))
        try:
            yield next(streams[k])
        except StopIteration:
            streams.pop(k)


def synthetic_kv(
    tokens: np.ndarray[Any, Any], layout: KVLayout, start: int = 0
) -> np.ndarray[Any, Any]:
    """KV for ``tokens[start:]`` given the whole prefix: position t depends on tokens[:t+1].

    Cheap (one broadcast per call) yet prefix-sensitive, so loading a wrong block is caught
    by comparing with a recomputation.
    """
    toks = np.asarray(tokens, dtype=np.uint64)
    acc = np.cumsum(toks * np.uint64(2654435761) % np.uint64(65521))[start:]
    vals = (acc % np.uint64(4093)).astype(np.float32) / 4093.0
    shape = layout.kv_shape(len(vals))
    out = np.empty(shape, dtype=layout.storage_dtype)
    if layout.storage_dtype.kind == "f":
        out[...] = vals.reshape(1, 1, -1, 1, 1).astype(layout.storage_dtype)
    else:  # bf16 / fp8 carried as integers: any deterministic bit pattern will do
        out[...] = (vals * 255).astype(layout.storage_dtype).reshape(1, 1, -1, 1, 1)
    out[:, 1:] += out.dtype.type(1)  # K and V differ
    return out
