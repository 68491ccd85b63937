"""Request traces: Mooncake-style JSONL, read into plain int lists for the replay engine.

One request per line::

    {"timestamp": 40, "input_length": 23769, "output_length": 3, "hash_ids": [151, 152, ...]}

``hash_ids`` are the ids of the request's prefix blocks, chained: an id names a block *and
everything before it*, so a request of ``input_length`` tokens has ``ceil(input_length /
id_tokens)`` of them. Mooncake's traces use 512 tokens per id; the Qwen-Bailian traces
(``qwen_trace*_blksz_16.jsonl``: extra fields ``chat_id``, ``turn``, ...; timestamps in seconds)
use 16. ``read_trace`` infers ``id_tokens`` from the lines unless told, and can regroup the ids
into the larger blocks a store caches (``regroup``). Unknown extra fields are ignored. A line
that is not such an object raises ``TraceError`` naming the file and line number.

The file is UTF-8 (a leading byte-order mark is accepted). Timestamps must be finite and
non-negative; they may go backwards (real traces merged from several frontends have jitter), and
requests are replayed in file order regardless. No figure of the simulator reads them.
"""

from __future__ import annotations

import gzip
import io
import json
import math
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

import numpy as np

from kvtier.errors import ConfigError

#: Mooncake's block granularity (tokens per hash id)
MOONCAKE_BLOCK_TOKENS = 512
#: the granularities ``infer_id_tokens`` considers: powers of two, 1 to 64Ki tokens per id
_ID_TOKEN_CANDIDATES = tuple(1 << i for i in range(17))


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
    #: tokens per hash id in the file it was read from, when ``regroup`` grouped them into
    #: larger blocks (``None``: ``block_tokens``)
    id_tokens: int | None = None

    @property
    def trace_block_tokens(self) -> int:
        """Tokens per hash id of the source trace (``block_tokens`` unless regrouped)."""
        return self.id_tokens or self.block_tokens

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


def parse_request(
    line: str, where: str, block_tokens: int | None = MOONCAKE_BLOCK_TOKENS
) -> Request:
    """Parse one JSONL line; ``where`` (e.g. ``"trace.jsonl:12"``) prefixes any error.
    ``block_tokens``: tokens per hash id, checked against ``input_length`` (``None``: not
    checked, for ``read_trace`` to infer it)."""
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
    req = Request(ts_ms, length, out, tuple(ids))
    if block_tokens is not None:
        _check_ids(req, block_tokens, where)
    return req


def _fits(req: Request, id_tokens: int) -> bool:
    """Whether ``req`` has one hash id per ``id_tokens`` tokens (the last may be partial)."""
    return len(req.blocks) == -(-req.input_length // id_tokens)


def _check_ids(req: Request, id_tokens: int, where: str, hint: str = "") -> None:
    if not _fits(req, id_tokens):
        expected = -(-req.input_length // id_tokens)
        raise TraceError(
            f"{where}: input_length {req.input_length} needs {_n(expected, 'block')} of "
            f"{id_tokens} tokens, but hash_ids has {len(req.blocks)}{hint}"
        )


def infer_id_tokens(reqs: Sequence[Request], name: str = "<trace>") -> tuple[int, int]:
    """The tokens per hash id of a trace, and how many of ``reqs`` it fits: the power of two
    that fits the most (512, Mooncake's, when it fits as many as any). ``TraceError`` when two
    sizes fit equally many (a trace of short prompts): say which."""
    lengths = np.fromiter((r.input_length for r in reqs), np.int64, len(reqs))
    ids = np.fromiter((len(r.blocks) for r in reqs), np.int64, len(reqs))
    votes = [int(np.count_nonzero(ids == -(-lengths // c))) for c in _ID_TOKEN_CANDIDATES]
    best = max(votes)
    tied = [c for c, v in zip(_ID_TOKEN_CANDIDATES, votes, strict=True) if v == best]
    if MOONCAKE_BLOCK_TOKENS in tied:
        return MOONCAKE_BLOCK_TOKENS, best
    if len(tied) > 1:
        raise TraceError(
            f"{name}: hash ids of {', '.join(map(str, tied))} tokens fit its lines equally; "
            "say how many tokens one id covers (--trace-block-tokens)"
        )
    return tied[0], best


def regroup(trace: Trace, block_tokens: int) -> Trace:
    """``trace`` as a store of ``block_tokens``-token blocks sees it: every ``block_tokens /
    trace.block_tokens`` ids become one block, named by the last id of its group (a chained id
    names its whole prefix, so that id names the larger block too); the last, partial group by
    the request's last id. ``block_tokens`` must be a multiple of the trace's."""
    n = trace.block_tokens
    if block_tokens == n:
        return trace
    if block_tokens <= 0 or block_tokens % n:
        raise ConfigError(
            f"blocks of {block_tokens} tokens cannot be made from this trace's hash ids of {n} "
            f"tokens: use a multiple of {n}"
        )
    k = block_tokens // n
    reqs = tuple(
        Request(
            r.timestamp_ms,
            r.input_length,
            r.output_length,
            r.blocks[k - 1 :: k] + ((r.blocks[-1],) if len(r.blocks) % k else ()),
        )
        for r in trace.requests
    )
    return Trace(reqs, block_tokens, trace.name, trace.trace_block_tokens)


def iter_trace(
    lines: Iterable[str], name: str = "<trace>", block_tokens: int | None = MOONCAKE_BLOCK_TOKENS
) -> Iterator[Request]:
    """Parse JSONL lines (blank lines skipped), numbering them from 1 in errors."""
    for _, req in _numbered(lines, name, block_tokens):
        yield req


def _numbered(
    lines: Iterable[str], name: str, block_tokens: int | None
) -> Iterator[tuple[int, Request]]:
    for lineno, line in enumerate(lines, 1):
        if line.strip():
            yield lineno, parse_request(line, f"{name}:{lineno}", block_tokens)


def read_trace(
    path: str | Path, block_tokens: int | None = None, id_tokens: int | None = None
) -> Trace:
    """Read a JSONL trace, gzip-compressed or not (told by its first bytes); ``TraceError``
    names the first bad line (or byte that is not UTF-8).

    ``id_tokens``: tokens per hash id in the file; ``None``: inferred (``infer_id_tokens``),
    every line then checked against it. ``block_tokens``: the blocks to replay, a multiple of
    ``id_tokens`` (``regroup``); ``None``: the trace's own.
    """
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
    rows = list(_numbered(text.split("\n"), p.name, id_tokens))
    if not rows:
        raise TraceError(f"trace {str(p)!r} has no requests")
    reqs = tuple(r for _, r in rows)
    if id_tokens is None:
        id_tokens, fit = infer_id_tokens(reqs, p.name)
        if fit < len(reqs):
            hint = (
                f" (hash ids of {id_tokens} tokens fit {fit} of its {len(reqs)} lines, more "
                "than any other size; if the trace uses another, say which with "
                "--trace-block-tokens)"
            )
            for lineno, r in rows:
                _check_ids(r, id_tokens, f"{p.name}:{lineno}", hint)
    trace = Trace(reqs, id_tokens, p.name)
    return trace if block_tokens is None else regroup(trace, block_tokens)


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
