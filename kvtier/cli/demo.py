"""``kvtier demo``: the main job, on the embedded default (host DRAM + local NVMe, no servers).

By default a real model (a seeded random Llama-architecture model, or a local checkpoint with
``--model PATH``) serves multi-turn sessions; each turn prints its time to first token with
kvtier and without it, where the reused prefix came from, and whether the output was identical.
The sessions are served through vLLM with kvtier as its KV connector when vLLM is installed
(``kvtier.cli.demo_vllm``), else (or with ``--engine hf``) through a transformers forward pass
(``kvtier.cli.demo_model``). ``--synthetic`` instead pushes a larger mixed workload
(chat, document QA, agents, one-offs) with synthetic KV through the store and checks every
cached prefix against a recomputation (``kvtier.cli.demo_synthetic``). The vLLM demo then
shows the other mode: two vLLM engines sharing one node service, ``kvtier serve``
(``kvtier.cli.demo_service``; ``--no-service`` skips it). In-process stays the store's default.

Each mode has its own options; one given to the other mode is an error, not silently ignored.
"""

from __future__ import annotations

import argparse
import importlib.util
import sys

from rich.console import Console

from kvtier.cli import demo_model, demo_synthetic
from kvtier.errors import ConfigError

# rich wraps and truncates to 80 columns when stdout is not a terminal; a log should keep whole
# lines and table headers
_PIPE_WIDTH = 160


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--synthetic", action="store_true", help="mixed workload, synthetic KV")
    p.add_argument(
        "--engine",
        choices=["vllm", "hf"],
        default=None,
        help="serve the real-model demo through vLLM (the default when it is installed) or "
        "transformers",
    )
    p.add_argument(
        "--service",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the in-process turns, two vLLM engines sharing one node service (kvtier "
        "serve); on by default with vLLM",
    )
    p.add_argument("--dir", default=".kvtier/demo", help="NVMe tier directory (wiped)")
    p.add_argument("--seed", type=int, default=0)
    demo_model.add_arguments(p)
    demo_synthetic.add_arguments(p)


def _refuse_other_mode(args: argparse.Namespace, synthetic: bool) -> None:
    """Raise ``ConfigError`` for an option of the mode that is not running."""
    other = demo_model.DEFAULTS if synthetic else demo_synthetic.DEFAULTS
    for name in other:
        if getattr(args, name, None) is not None:
            flag = "--" + name.replace("_", "-")
            if not synthetic:
                raise ConfigError(f"{flag} applies to --synthetic only; add --synthetic")
            why = "" if args.synthetic else " (transformers is not installed)"
            raise ConfigError(f"{flag} applies to the real-model demo, not --synthetic{why}")


def run(args: argparse.Namespace) -> int:
    if args.seed < 0:
        raise ConfigError(f"--seed must be >= 0, got {args.seed}")
    fallback = not args.synthetic and importlib.util.find_spec("transformers") is None
    _refuse_other_mode(args, args.synthetic or fallback)
    console = Console() if sys.stdout.isatty() else Console(width=_PIPE_WIDTH)
    if fallback:
        console.print("transformers is not installed: running the synthetic demo instead")
    if args.synthetic or fallback:
        if args.engine is not None:
            raise ConfigError("--engine applies to the real-model demo, not --synthetic")
        if args.service is not None:
            raise ConfigError("--service/--no-service apply to the vLLM demo, not --synthetic")
        return demo_synthetic.run(console, args)
    engine = args.engine or ("vllm" if importlib.util.find_spec("vllm") else "hf")
    if args.service is not None and engine != "vllm":
        raise ConfigError(
            "--service/--no-service apply to the vLLM demo (engines sharing kvtier serve); "
            "drop it or use --engine vllm"
        )
    args.service = engine == "vllm" and args.service is not False
    if engine == "vllm":
        if importlib.util.find_spec("vllm") is None:
            raise ConfigError("--engine vllm: vLLM is not installed (scripts/setup.sh installs it)")
        from kvtier.cli import demo_vllm

        return demo_vllm.run(console, args)
    return demo_model.run(console, args)
