"""Command-line options shared by the trace-replaying commands (``kvtier simulate``,
``kvtier plan --trace``, ``kvtier bench sim``). Imports nothing heavy: parsers are built before
the chosen command runs."""

from __future__ import annotations

import argparse


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
