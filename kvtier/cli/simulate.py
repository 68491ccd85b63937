"""``kvtier simulate``: replay a trace through a tier hierarchy and price it.

kvtier simulate --trace mooncake.jsonl --model Llama-3.1-70B --tier hbm=80GB --tier dram=1TB
kvtier simulate --trace mooncake.jsonl --capacity-blocks 10000 --policy belady --json
kvtier simulate --trace mooncake.jsonl --sweep --plot out/
kvtier simulate --sweep --basket [--trace mooncake.jsonl] [--policy auto]
kvtier simulate --synthetic chat --requests 2000 --save-trace chat.jsonl
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.sim.options import (
    add_block_arguments,
    add_hints_argument,
    add_jobs_argument,
    block_kwargs,
    jobs_from,
)


def add_arguments(p: argparse.ArgumentParser) -> None:
    from kvtier.sim.hierarchy import ROUTES  # the command needs them anyway
    from kvtier.sim.replay import SIM_POLICIES

    src = p.add_mutually_exclusive_group()
    src.add_argument("--trace", help="Mooncake-format JSONL trace")
    src.add_argument(
        "--synthetic",
        choices=["chat", "system-prompt", "rag", "agent", "mixed"],
        help="generate a synthetic workload instead of reading a trace",
    )
    p.add_argument("--requests", type=int, default=2000, help="synthetic: number of requests")
    p.add_argument("--seed", type=int, default=0, help="synthetic: random seed")
    add_block_arguments(p)
    p.add_argument(
        "--save-trace",
        metavar="FILE",
        help="write the trace as replayed (synthetic, or grouped by --block-tokens) as JSONL "
        "(atomically; never onto the --trace file)",
    )
    p.add_argument("--config", metavar="TOML", help="hierarchy/model/GPU description")
    p.add_argument(
        "--tier",
        action="append",
        default=[],
        metavar="NAME=SIZE[:POLICY]",
        help="a tier, fastest first (hbm, dram, nvme, pool, object), e.g. dram=1TB; "
        "nvme=16TB:lru gives it its own eviction policy",
    )
    p.add_argument(
        "--capacity-blocks", type=int, metavar="N", help="one tier of N blocks (overrides --tier)"
    )
    p.add_argument("--model", help="model preset (default Llama-3.1-70B)")
    p.add_argument("--dtype", help="KV dtype (default: the TOML file's, else bf16)")
    p.add_argument("--gpus", type=int, help="GPUs prefilling, >= 1 (default 8)")
    p.add_argument("--policy", help=f"eviction policy: {', '.join(SIM_POLICIES)}")
    p.add_argument(
        "--sweep",
        action="store_true",
        help="hit ratio and TTFT vs capacity for every policy, Belady included",
    )
    p.add_argument(
        "--capacities", help="sweep: comma-separated capacities in blocks (>= 1; sorted)"
    )
    p.add_argument(
        "--basket",
        action="store_true",
        help="sweep: the policy basket (kvtier.sim.basket): --trace if given, every synthetic "
        "workload x seeds 0-2 (--requests each), 1%%-50%% of their blocks, one tier and host + "
        "NVMe; policies --policy, else auto, lru, s3fifo",
    )
    add_jobs_argument(p, "sweep: replays")
    p.add_argument(
        "--nodes",
        type=int,
        help="engine nodes, each with its own hbm/dram/nvme tiers; pool and object tiers are "
        "shared by all, written through (default: the TOML file's [cluster], else 1)",
    )
    p.add_argument(
        "--route",
        choices=ROUTES,
        help="with --nodes > 1: requests to nodes round robin (default), by first block, or "
        "to the node caching the longest prefix unless it is overloaded",
    )
    p.add_argument(
        "--check-lower",
        action="store_true",
        help="replay the hierarchy twice more, every tier below the first run by lru, then by "
        "s3fifo, and report both (what kvtier plan does for its answer)",
    )
    p.add_argument("--plot", metavar="DIR", help="write PNG plots into DIR (created if needed)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    add_hints_argument(p)


def _check_save_target(args: argparse.Namespace) -> Path:
    """Where ``--save-trace`` writes: a file in an existing, writable directory, never the input
    trace. Checked before anything runs, so a failing run writes nothing."""
    dest = Path(args.save_trace)
    flag = f"--save-trace {args.save_trace!r}"
    if dest.is_dir():
        raise ConfigError(f"{flag} is a directory; give a file name")
    if not dest.parent.is_dir():
        raise ConfigError(f"{flag}: directory {str(dest.parent)!r} does not exist")
    if not os.access(dest.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag}: directory {str(dest.parent)!r} is not writable")
    if args.trace:
        src = Path(args.trace)
        same = dest.resolve() == src.resolve()
        if not same and dest.exists() and src.exists():
            same = os.path.samefile(dest, src)  # a hard link or another spelling of the path
        if same:
            raise ConfigError(f"{flag} is the input trace (--trace); save to another file")
    return dest


def _save_trace(trace: Any, dest: Path) -> None:
    from kvtier.sim.trace import write_trace

    try:
        write_trace(trace, dest)
    except OSError as exc:
        raise ConfigError(
            f"--save-trace {str(dest)!r}: cannot write: {exc.strerror or exc}"
        ) from None


def _load_trace(args: argparse.Namespace) -> Any:
    from kvtier.sim.trace import read_trace, regroup
    from kvtier.sim.workload import generate

    kw = block_kwargs(args)
    if args.trace:
        return read_trace(args.trace, **kw)
    if kw["id_tokens"] is not None:
        raise ConfigError("--trace-block-tokens describes a --trace file; drop it for --synthetic")
    trace = generate(args.synthetic, args.requests, args.seed)
    return trace if kw["block_tokens"] is None else regroup(trace, kw["block_tokens"])


class _LazyProgress:
    """A progress callback that shows a rich bar on stderr once a run has taken ``delay_s``.

    Short runs print nothing; on a non-terminal stderr it stays silent (no escape codes in logs).
    Use as a context manager so the bar is removed when the run ends.
    """

    def __init__(self, total: int, what: str, delay_s: float = 1.0) -> None:
        self.total = total
        self.what = what
        self.start = time.monotonic() + delay_s
        self.enabled = sys.stderr.isatty()
        self.bar: Any = None
        self.task: Any = None

    def __call__(self, done: int) -> None:
        if self.bar is None:
            if not self.enabled or time.monotonic() < self.start:
                return
            from rich.console import Console
            from rich.progress import Progress

            self.bar = Progress(console=Console(stderr=True), transient=True)
            self.bar.start()
            self.task = self.bar.add_task(self.what, total=self.total)
        self.bar.update(self.task, completed=done)

    def __enter__(self) -> _LazyProgress:
        return self

    def __exit__(self, *exc: object) -> None:
        if self.bar is not None:
            self.bar.stop()


def run(args: argparse.Namespace) -> int:
    """Every flag, the trace and the hierarchy are checked before anything is written: a run
    that fails leaves no saved trace and no plot directory behind."""
    from kvtier.sim import hierarchy
    from kvtier.sim.replay import SIM_POLICIES, replay
    from kvtier.sim.report import lower_check_lines, render, summarize

    if args.basket:
        return _run_basket(args)
    if not (args.trace or args.synthetic):
        raise ConfigError("give a trace: --trace FILE or --synthetic KIND (or --sweep --basket)")
    caps: list[int] | None = None
    if args.capacities is not None:
        if not args.sweep:
            raise ConfigError("--capacities sets the sweep's capacities; add --sweep")
        from kvtier.sim.sweep import parse_capacities

        caps = parse_capacities(args.capacities)
    if args.jobs is not None and not args.sweep:
        raise ConfigError("--jobs sets how many replays of the sweep run at once; add --sweep")
    jobs = jobs_from(args)
    if args.capacity_blocks is not None and args.capacity_blocks < 0:
        raise ConfigError(f"--capacity-blocks must be >= 0, got {args.capacity_blocks}")
    plot_dir = None
    if args.plot:
        from kvtier.sim.plots import check_plot_dir

        plot_dir = check_plot_dir(args.plot)
    save_to = _check_save_target(args) if args.save_trace else None
    trace = _load_trace(args)
    tier_flags = list(args.tier)
    hier = hierarchy.build(
        args.model,
        args.dtype,
        trace.block_tokens,
        args.policy,
        tier_flags,
        args.config,
        args.gpus,
        args.nodes,
        args.route,
    )
    if hier.nodes > 1 and (args.sweep or args.capacity_blocks is not None):
        raise ConfigError(
            "--nodes replays a hierarchy (--tier or --config); --sweep and --capacity-blocks "
            "replay one tier"
        )
    if args.check_lower and (args.sweep or args.capacity_blocks is not None or len(hier.tiers) < 2):
        raise ConfigError(
            "--check-lower replays a hierarchy of two tiers or more (--tier or --config) with "
            "other policies below the first; --sweep and --capacity-blocks replay one tier"
        )
    if args.capacity_blocks is not None:
        first = hier.tiers[0]
        size = args.capacity_blocks * hier.block_bytes
        hier = hier.with_tiers([dataclasses.replace(first, capacity_bytes=size)])
    if save_to is not None:
        _save_trace(trace, save_to)

    if args.sweep:
        from kvtier.sim.sweep import default_capacities, sweep

        if caps is None:
            caps = default_capacities(trace)
        pols = [args.policy] if args.policy else list(SIM_POLICIES)
        with _LazyProgress(len(pols) * len(caps), "sweeping") as progress:
            rows = sweep(trace, hier, pols, caps, progress, hints=args.hints, jobs=jobs)
        out: dict[str, Any] = {
            "trace": trace.name,
            "requests": len(trace),
            "input_tokens": trace.input_tokens,
            "reuse_hints": args.hints,
            "sweep": rows,
        }
        if plot_dir is not None:
            from kvtier.sim.plots import plot_sweep

            out["plots"] = [str(plot_sweep(rows, plot_dir))]
        if args.json:
            print(json.dumps(out, indent=1))
        else:
            for r in rows:
                print(
                    f"{r['policy']:>14} {r['capacity_blocks']:>8} blocks  hit "
                    f"{r['token_hit_ratio']:.4f}  TTFT p90 {r['ttft_p90_s']:.3f} s"
                )
        return 0

    with _LazyProgress(len(trace), "replaying") as progress:
        if hier.clustered:
            from kvtier.sim.cluster import replay_cluster

            res = replay_cluster(
                trace,
                hier.specs(),
                hier.nodes,
                hier.shared_from,
                hier.route,
                args.hints,
                progress,
            )
        else:
            res = replay(trace, hier.specs(), progress, hints=args.hints)
    summary = summarize(trace, hier, res)
    checks: list[dict[str, Any]] = []
    if args.check_lower:
        from kvtier.sim.sizing import lower_policy_check

        checks = lower_policy_check(trace, hier, args.hints)
        summary["lower_policy_check"] = checks
    if plot_dir is not None:
        from kvtier.sim.cost import price
        from kvtier.sim.plots import plot_run

        t = price(
            res.hit_tokens, res.input_tokens, [x.cost for x in hier.tiers], hier.compute, hier.gpu
        )
        summary["plots"] = [str(x) for x in plot_run(summary, t.ttft_s, plot_dir)]
    if args.json:
        print(json.dumps(summary, indent=1))
    else:
        print(render(summary))
        for line in lower_check_lines(checks, summary):
            print(line)
    return 0


def _run_basket(args: argparse.Namespace) -> int:
    """``--sweep --basket``: every point of the policy basket, each policy's summary."""
    from kvtier.sim import basket
    from kvtier.sim.replay import check_policy

    if not args.sweep:
        raise ConfigError("--basket is a sweep over many traces; add --sweep")
    other = [
        f
        for f in ("synthetic", "capacities", "capacity_blocks", "save_trace", "plot")
        if getattr(args, f) is not None
    ]
    if other or args.tier or args.config or args.nodes:
        raise ConfigError(
            "--basket chooses its own traces and sizes; drop --synthetic, --capacities, "
            "--capacity-blocks, --tier, --config, --nodes, --save-trace and --plot"
        )
    if args.requests < 1:
        raise ConfigError(f"--requests must be >= 1, got {args.requests}")
    blocks = block_kwargs(args)
    if not args.trace and (blocks["block_tokens"] or blocks["id_tokens"]):
        raise ConfigError(
            "--block-tokens and --trace-block-tokens apply to the basket's --trace file (its "
            "generators keep their 512-token blocks); add --trace or drop them"
        )
    pols = [args.policy] if args.policy else ["auto", "lru", "s3fifo"]
    for p in pols:
        check_policy(p, "--")
    if args.trace:
        from kvtier.sim.trace import read_trace

        read_trace(args.trace, **blocks)  # a bad trace is named before any replay starts
    srcs = basket.sources(args.trace, args.requests, **blocks)
    pts = basket.points(srcs, pols, [args.hints])
    with _LazyProgress(len(pts), "basket") as progress:
        rows = basket.table(pts, basket.run(pts, jobs_from(args), progress))
    out = {
        "reuse_hints": args.hints,
        "rows": rows,
        "summary": [basket.summary(rows, p) for p in pols if p != "belady"],
    }
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        for r in rows:
            hits = "  ".join(f"{p} {v:.4f}" for p, v in r["hit"].items())
            print(f"{r['trace']:>26} {r['fraction']:>5.0%} {r['caps']!s:>16}  {hits}")
        for s in out["summary"]:
            print(
                f"{s['policy']}: {s['points'] - len(s['below_target'])}/{s['points']} points "
                f"within 1% of the better of lru and s3fifo"
                + (
                    f", mean {s['mean_ratio_to_best']:.4f} of it, at most"
                    f" {s['max_gap_to_best']:.4f} below it"
                    if "mean_ratio_to_best" in s
                    else ""
                )
            )
    return 0
