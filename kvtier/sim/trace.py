"""Request traces: the Mooncake JSONL format, read into plain int lists for the replay engine.

One request per line::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

``timestamp`` is in milliseconds, ``hash_ids`` are the ids of the request's 512-token prefix
blocks (chained: an id names a block *and everything before it*), so a request of
``input_length`` tokens has ``ceil(input_length / block_tokens)`` of them. Unknown extra fields are
ignored. A line that is not such an object raises ``TraceError`` naming the file and line number.

The file is UTF-8 (a leading byte-order mark is accepted). Timestamps must be finite and
non-negative; they may go backwards (real traces merged from several frontends have jitter), and
requests are replayed in file order regardless.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from kvtier.errors import ConfigError

#: Mooncake's block granularity (tokens per hash id)
MOONCAKE_BLOCK_TOKENS = 512


#: the first two bytes of a gzip file
GZIP_MAGIC = b"\x1f\x8b"


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
    if name not in obj:
        raise TraceError(f"{where}: {name!r} is missing (a non-negative integer)")
    value = obj[name]
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise TraceError(f"{where}: {name!r} must be a non-negative integer, got {value!r}")
    return value


def _n(count: int, noun: str) -> str:
    """``"1 block"``, ``"2 blocks"``."""
    return f"{count} {noun}" if count == 1 else f"{count} {noun}s"


def parse_request(line: str, where: str, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Request:
    """Parse one JSONL line; ``where`` (e.g. ``"trace.jsonl:12"``) prefixes any error."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    ts = obj.get("timestamp", 0)
    ts_ms = math.nan
    if isinstance(ts, int | float) and not isinstance(ts, bool):
        ts_ms = float(ts) if abs(ts) < 1e300 else math.inf  # a huge int would overflow float()
    if not 0 <= ts_ms < math.inf:
        raise TraceError(
            f"{where}: 'timestamp' must be a finite non-negative number (ms), got {ts!r}"
        )
    length = _field_int(obj, "input_length", where)
    out = _field_int(obj, "output_length", where) if "output_length" in obj else 0
    if "hash_ids" not in obj:
        raise TraceError(f"{where}: 'hash_ids' is missing (a list of non-negative integers)")
    ids = obj["hash_ids"]
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
            f"{where}: input_length {length} needs {_n(expected, 'block')} of {block_tokens} "
            f"tokens, but hash_ids has {len(ids)}"
        )
    return Request(ts_ms, length, out, tuple(ids))


def iter_trace(
    lines: Iterable[str], name: str = "<trace>", block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> Iterator[Request]:
    """Parse JSONL lines (blank lines skipped), numbering them from 1 in errors."""
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            yield parse_request(line, f"{name}:{lineno}", block_tokens)


def read_trace(path: str | Path, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> Trace:
    """Read a Mooncake-format JSONL trace, gzip-compressed or not (told by its first bytes);
    ``TraceError`` names the first bad line (or byte that is not UTF-8)."""
    p = Path(path)
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise TraceError(f"cannot open trace {str(p)!r}: {exc.strerror}") from None
    if data[:2] == GZIP_MAGIC:
        try:
            data = gzip.decompress(data)
        except (OSError, EOFError, zlib.error) as exc:
            raise TraceError(f"{p.name}: a damaged gzip file ({exc})") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as exc:
        lineno = data.count(b"\n", 0, exc.start) + 1
        line_start = data.rfind(b"\n", 0, exc.start) + 1
        raise TraceError(
            f"{p.name}:{lineno}: not UTF-8 text (byte "
            f"0x{data[exc.start]:02x} at column {exc.start - line_start + 1}); is this a JSONL "
            "trace?"
        ) from None
    # split on "\n" only: str.splitlines would also split inside strings at U+2028 and friends
    reqs = tuple(iter_trace(text.split("\n"), p.name, block_tokens))
    if not reqs:
        raise TraceError(f"trace {str(p)!r} has no requests")
    return Trace(reqs, block_tokens, p.name)


def write_trace(trace: Trace, path: str | Path) -> None:
    """Write ``trace`` as Mooncake JSONL (used to save synthetic workloads).

    Atomic: the lines go to a temporary file next to ``path``, which then replaces ``path``, so
    a failure (``OSError``, raised) leaves any existing file as it was and no partial file. A
    ``path`` ending in ``.gz`` is written gzip-compressed.
    """
    dest = Path(path)
    text = io.StringIO()
    _write_lines(trace, text)
    data = text.getvalue().encode("utf-8")
    if dest.suffix == ".gz":
        data = gzip.compress(data, mtime=0)
    tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)  # umask applies, as for open()
    try:
        with os.fdopen(fd, "wb") as fh:
            fh.write(data)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, dest)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _write_lines(trace: Trace, fh: TextIO) -> None:
    for r in trace.requests:
        ts: float | int = int(r.timestamp_ms) if r.timestamp_ms.is_integer() else r.timestamp_ms
        obj = {
            "timestamp": ts,
            "input_length": r.input_length,
            "output_length": r.output_length,
            "hash_ids": list(r.blocks),
        }
        fh.write(json.dumps(obj) + "\n")
