"""``kvtier bench TARGET [--json] [target options]``: run one benchmark from
``kvtier.bench.BENCHES``. Only the chosen target's module is imported, so ``kvtier bench host``
needs neither torch nor a server client."""

from __future__ import annotations

import argparse
import importlib
import json
import math
from typing import Any

from rich.console import Console
from rich.table import Table

from kvtier.bench import BENCHES
from kvtier.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("target", choices=list(BENCHES), help="what to benchmark")
    parser.add_argument(
        "options", nargs=argparse.REMAINDER, help="the target's options (TARGET --help lists them)"
    )


def run(args: argparse.Namespace) -> int:
    module = importlib.import_module(BENCHES[args.target])
    p = argparse.ArgumentParser(prog=f"kvtier bench {args.target}", description=module.__doc__)
    p.add_argument("--json", action="store_true", help="print one JSON object")
    module.add_arguments(p)
    opts = p.parse_args(args.options)
    rounds = getattr(opts, "rounds", None)  # a target's repetitions; 0 would measure nothing
    if rounds is not None and rounds < 1:
        raise ConfigError(f"--rounds must be >= 1, got {rounds}")
    result = module.run(opts)
    if opts.json:
        print(json.dumps(_finite(result)))
        return 0
    table = Table(title=f"kvtier bench {args.target}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(table)
    return 0


def _finite(v: Any) -> Any:
    """JSON has no NaN or Infinity: a rate over a zero time is reported as null."""
    if isinstance(v, dict):
        return {k: _finite(x) for k, x in v.items()}
    if isinstance(v, list | tuple):
        return [_finite(x) for x in v]
    return None if isinstance(v, float) and not math.isfinite(v) else v
