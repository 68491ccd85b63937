"""``kvtier check DIR [DIR ...] [--fix] [--json]``: verify NVMe tier directories.

Exit status 0 when every directory is clean (or was fixed), 1 when torn or foreign slots or a
damaged index were found and ``--fix`` was not given; orphan slots (left by evictions,
harmless) are reported but are not a failure. ``--fix`` rebuilds a damaged index from the slot
headers (as opening the tier does) and zeroes slots that do not verify; it never destroys a
block the tier could serve. See ``kvtier.tiers.nvme_check`` for the states.
"""

from __future__ import annotations

import argparse
import json

from kvtier.tiers.nvme_check import check_dir


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dirs", nargs="+", metavar="DIR", help="an NVMe tier directory")
    parser.add_argument(
        "--fix", action="store_true", help="rebuild a damaged index; drop slots that do not verify"
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object per directory")


def run(args: argparse.Namespace) -> int:
    rc = 0
    for d in args.dirs:
        report = check_dir(d, fix=args.fix)
        print(json.dumps(report.as_dict()) if args.json else str(report))
        if report.problems and not args.fix:
            rc = 1
    return rc
