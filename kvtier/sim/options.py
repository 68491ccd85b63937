"""Command-line options shared by the trace-replaying commands (``kvtier simulate``,
``kvtier plan --trace``, ``kvtier bench sim``). Imports nothing heavy: parsers are built before
the chosen command runs."""

from __future__ import annotations

import argparse
import os

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
