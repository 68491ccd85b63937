"""The ``kvtier`` command line: ``plan | simulate | bench | demo | check | serve | stats``.

Each subcommand lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``;
``COMMANDS`` maps the name to the module and help line, imported only when used so
``kvtier plan`` never pays for torch.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import sys
from collections.abc import Sequence

from kvtier.errors import KVTierError

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": (
        "kvtier.cli.plan",
        "capacity planner: KV bytes per token, what fits in HBM, what spills",
    ),
    "demo": (
        "kvtier.cli.demo",
        "run a realistic workload through the store on the embedded default",
    ),
    "bench": (
        "kvtier.cli.bench",
        "benchmarks against the physical limit, measured in the same run",
    ),
    "simulate": ("kvtier.cli.simulate", "replay a trace through tiers: hit ratio, TTFT, cost"),
    "check": ("kvtier.cli.check", "verify an NVMe tier directory: ok/torn/orphan/foreign slots"),
    "serve": ("kvtier.cli.serve", "run the node-local service shared by every engine on the node"),
    "stats": ("kvtier.cli.stats", "per-client and per-tenant counters of a running service"),
}


def _chosen(argv: Sequence[str]) -> str | None:
    """The subcommand named in ``argv`` (first non-option word), if any."""
    for word in argv:
        if not word.startswith("-"):
            return word if word in COMMANDS else None
    return None


def build_parser(argv: Sequence[str] = ()) -> argparse.ArgumentParser:
    """The parser; only the chosen subcommand's module is imported (``kvtier plan`` stays light)."""
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tiered KV-cache store for LLM inference"
    )
    parser.add_argument("-v", "--verbose", action="count", default=0, help="more logging")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    chosen = _chosen(argv)
    for name, (module, help_line) in COMMANDS.items():
        p = sub.add_parser(name, help=help_line, description=help_line)
        if name == chosen:
            importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(args_list)
    args = parser.parse_args(args_list)
    level = logging.WARNING - 10 * min(args.verbose, 2)
    logging.basicConfig(level=level, format="%(levelname)s %(name)s: %(message)s")
    module = importlib.import_module(COMMANDS[args.command][0])
    try:
        rc: int = module.run(args)
    except KVTierError as exc:
        print(f"kvtier {args.command}: error: {exc}", file=sys.stderr)
        return 2
    return rc


if __name__ == "__main__":
    sys.exit(main())
