"""``kvtier demo``: the main job, on the embedded default (host DRAM + local NVMe, no servers).

By default a real transformers model (a seeded random Llama-architecture model, or a local
checkpoint with ``--model PATH``) serves multi-turn sessions; each turn prints its time to first
token with kvtier and without it, where the reused prefix came from, and whether the output was
bit-identical (``kvtier.cli.demo_model``). ``--synthetic`` instead pushes a larger mixed workload
(chat, document QA, agents, one-offs) with synthetic KV through the store and checks every
cached prefix against a recomputation (``kvtier.cli.demo_synthetic``).
"""

from __future__ import annotations

import argparse
import importlib.util

from rich.console import Console

from kvtier.cli import demo_model, demo_synthetic


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--synthetic", action="store_true", help="mixed workload, synthetic KV")
    p.add_argument("--dir", default=".kvtier/demo", help="NVMe tier directory (wiped)")
    p.add_argument("--seed", type=int, default=0)
    demo_model.add_arguments(p)
    demo_synthetic.add_arguments(p)


def run(args: argparse.Namespace) -> int:
    console = Console()
    if args.synthetic:
        return demo_synthetic.run(console, args)
    if importlib.util.find_spec("transformers") is None:
        console.print("transformers is not installed: running the synthetic demo instead")
        return demo_synthetic.run(console, args)
    return demo_model.run(console, args)
