"""Command-line options shared by the trace-replaying commands (``kvtier simulate``,
``kvtier plan --trace``, ``kvtier bench sim``). Imports nothing heavy: parsers are built before
the chosen command runs."""

from __future__ import annotations

import argparse
import os
from typing import TypedDict

from kvtier.errors import ConfigError


def add_hints_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--hints/--no-hints`` (default on): whether the replay gives the first tier's policy each
    request's reuse class (``kvtier.sim.replay.replay(hints=...)``)."""
    p.add_argument(
        "--hints",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="give the policy each request's reuse class (output length, extends a cached "
        "prefix), as an engine storing at request end can; --no-hints: unlabelled (default on)",
    )


def add_block_arguments(p: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--block-tokens`` (the blocks to replay: the store's block size) and
    ``--trace-block-tokens`` (the tokens one hash id of the trace covers), for
    ``kvtier.sim.trace.read_trace``."""
    p.add_argument(
        "--block-tokens",
        type=int,
        metavar="N",
        help="replay blocks of N tokens, as a store with that block size caches them: a "
        "multiple of the trace's (its hash ids are grouped); default: the trace's own",
    )
    p.add_argument(
        "--trace-block-tokens",
        type=int,
        metavar="N",
        help="tokens per hash id in the trace (Mooncake 512, Qwen-Bailian 16); default: "
        "inferred from its lines",
    )


class BlockOptions(TypedDict):
    """``read_trace``'s block arguments."""

    block_tokens: int | None
    id_tokens: int | None


def block_kwargs(args: argparse.Namespace) -> BlockOptions:
    """``read_trace``'s ``block_tokens``/``id_tokens`` from ``add_block_arguments``'s flags;
    ``ConfigError`` for a value below 1."""
    opts: BlockOptions = {"block_tokens": args.block_tokens, "id_tokens": args.trace_block_tokens}
    for flag, v in (
        ("--block-tokens", opts["block_tokens"]),
        ("--trace-block-tokens", opts["id_tokens"]),
    ):
        if v is not None and v < 1:
            raise ConfigError(f"{flag} must be >= 1, got {v}")
    return opts


def add_jobs_argument(p: argparse.ArgumentParser | argparse._ArgumentGroup, what: str) -> None:
    """``--jobs N``: replays at once, in worker processes (``kvtier.sim.replaypool``)."""
    p.add_argument(
        "--jobs",
        type=int,
        default=None,
        help=f"{what} at once, in worker processes (default: the CPUs available, at most 8)",
    )


def jobs_from(args: argparse.Namespace) -> int:
    """``--jobs``, or the CPUs this process may use, at most 8; ``ConfigError`` below 1."""
    if args.jobs is None:
        return default_jobs()
    if args.jobs < 1:
        raise ConfigError(f"--jobs must be >= 1, got {args.jobs}")
    return int(args.jobs)


def default_jobs() -> int:
    """The CPUs this process may use, at most 8 (each worker is one replay at a time)."""
    try:
        n = len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        n = os.cpu_count() or 1
    return max(1, min(n, 8))
