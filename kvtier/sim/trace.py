"""Request traces: the Mooncake JSONL format, read into plain int lists for the replay engine.

One request per line::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

``timestamp`` is in milliseconds, ``hash_ids`` are the ids of the request's 512-token prefix
blocks (chained: an id names a block *and everything before it*), so a request of
``input_length`` tokens has ``ceil(input_length / block_tokens)`` of them. Unknown extra fields are
ignored. A line that is not such an object raises ``TraceError`` naming the file and line number.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from kvtier.errors import ConfigError

#: Mooncake's block granularity (tokens per hash id)
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ConfigError):
    """A trace line is malformed; the message names the file and line."""


@dataclass(frozen=True, slots=True)
class Request:
    """One request of a trace. ``blocks`` are int block ids in prefix order (parent first)."""

    timestamp_ms: float
    input_length: int
    output_length: int
    blocks: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Trace:
    """A replayable workload: requests in arrival order and the tokens per block id."""

    requests: tuple[Request, ...]
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    name: str = ""

    def __len__(self) -> int:
        return len(self.requests)

    @property
    def input_tokens(self) -> int:
        return sum(r.input_length for r in self.requests)

    @property
    def block_events(self) -> int:
        """Block references in the whole trace (the unit of the events/s benchmark)."""
        return sum(len(r.blocks) for r in self.requests)

    @property
    def duration_s(self) -> float:
        if not self.requests:
            return 0.0
        return (self.requests[-1].timestamp_ms - self.requests[0].timestamp_ms) / 1000.0

    def hit_tokens(self, n_hit: int, r: Request) -> int:
        """Tokens covered by the first ``n_hit`` blocks of ``r`` (the last block may be partial)."""
        if n_hit <= 0:
            return 0
        if n_hit >= len(r.blocks):
            return r.input_length
        return n_hit * self.block_tokens


def _field_int(obj: dict[str, object], name: str, where: str) -> int:
    value = obj.get(name)
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def parse_request(line: str, where: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Request:
    """Parse one JSONL line; ``where`` (e.g. ``"trace.jsonl:12"``) prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp", 0)
    if not isinstance(ts, int | float) or isinstance(ts, bool) or ts < 0:
        raise TraceError(f"{where}: 'timestamp' must be a non-negative number (ms), got {ts!r}")
    length = _field_int(obj, "input_length", where)
    out = _field_int(obj, "output_length", where) if "output_length" in obj else 0
    ids = obj.get("hash_ids")
    if not isinstance(ids, list) or not all(
        isinstance(h, int) and not isinstance(h, bool) and h >= 0 for h in ids
    ):
        raise TraceError(f"{where}: 'hash_ids' must be a list of non-negative integers")
    if len(set(ids)) != len(ids):
        raise TraceError(
            f"{where}: 'hash_ids' repeats an id; chained ids name distinct prefixes, so an id "
            "appears at most once per request"
        )
    expected = -(-length // block_tokens)
    if len(ids) != expected:
        raise TraceError(
            f"{where}: input_length {length} needs {expected} blocks of {block_tokens} tokens, "
            f"but hash_ids has {len(ids)}"
        )
    return Request(float(ts), length, out, tuple(ids))


def iter_trace(
    lines: Iterable[str], name: str = "<trace>", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Iterator[Request]:
    """Parse JSONL lines (blank lines skipped), numbering them from 1 in errors."""
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            yield parse_request(line, f"{name}:{lineno}", block_tokens)


def read_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake-format JSONL trace; ``TraceError`` names the first bad line."""
    p = Path(path)
    try:
        fh = p.open(encoding="utf-8")
    except OSError as exc:
        raise TraceError(f"cannot open trace {str(p)!r}: {exc.strerror}") from None
    with fh:
        reqs = tuple(iter_trace(fh, p.name, block_tokens))
    if not reqs:
        raise TraceError(f"trace {str(p)!r} has no requests")
    return Trace(reqs, block_tokens, p.name)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as Mooncake JSONL (used to save synthetic workloads)."""
    with Path(path).open("w", encoding="utf-8") as fh:
        for r in trace.requests:
            ts: float | int = int(r.timestamp_ms) if r.timestamp_ms.is_integer() else r.timestamp_ms
            obj = {
                "timestamp": ts,
                "input_length": r.input_length,
                "output_length": r.output_length,
                "hash_ids": list(r.blocks),
            }
            fh.write(json.dumps(obj) + "\n")
