"""``kvtier bench TARGET [--json]``: run one benchmark from ``kvtier.bench.BENCHES``."""

from __future__ import annotations

import argparse
import importlib
import json

from rich.console import Console
from rich.table import Table

from kvtier.bench import BENCHES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="target", required=True, metavar="TARGET")
    for name, module in BENCHES.items():
        p = sub.add_parser(name, help=f"benchmark the {name} path")
        p.add_argument("--json", action="store_true", help="print one JSON object")
        importlib.import_module(module).add_arguments(p)


def run(args: argparse.Namespace) -> int:
    result = importlib.import_module(BENCHES[args.target]).run(args)
    if args.json:
        print(json.dumps(result))
        return 0
    table = Table(title=f"kvtier bench {args.target}")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for k, v in result.items():
        table.add_row(k, f"{v:.3f}" if isinstance(v, float) else str(v))
    Console().print(table)
    return 0
