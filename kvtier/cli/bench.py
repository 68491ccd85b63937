"""``kvtier bench TARGET [--json] [target options]``: run one benchmark from
``kvtier.bench.BENCHES``. Only the chosen target's module is imported, so ``kvtier bench host``
needs neither torch nor a server client."""

from __future__ import annotations

import argparse
import importlib
import json

from rich.console import Console
from rich.table import Table

from kvtier.bench import BENCHES


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
    result = module.run(opts)
    if opts.json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"kvtier bench {args.target}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(table)
    return 0
