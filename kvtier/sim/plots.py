"""PNG plots (matplotlib, the ``sim`` extra): hit ratio vs capacity, TTFT CDF, cost per tier."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError


def _plt() -> Any:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise ConfigError("--plot needs matplotlib: pip install 'kvtier[sim]'") from None
    return plt


def plot_sweep(rows: list[dict[str, Any]], out: Path) -> Path:
    """Token hit ratio against capacity, one line per policy."""
    plt = _plt()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = [(r["capacity_blocks"], r["token_hit_ratio"]) for r in rows if r["policy"] == pol]
        ax.plot(*zip(*pts, strict=True), marker="o", label=pol)
    ax.set_xscale("log")
    ax.set(xlabel="capacity (blocks)", ylabel="token hit ratio", title="hit ratio vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = out / "hit_ratio_vs_capacity.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_run(summary: dict[str, Any], ttft: npt.NDArray[np.float64], out: Path) -> list[Path]:
    """TTFT CDF and monthly cost per tier of one simulation."""
    plt = _plt()
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.sort(ttft)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x))
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(True, alpha=0.3)
    paths.append(out / "ttft_cdf.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [t["name"] for t in summary["tiers"]]
    ax.bar(names, [t["monthly_cost_usd"] for t in summary["tiers"]])
    ax.set(ylabel="$ / month", title="capacity cost per tier")
    paths.append(out / "cost_per_tier.png")
    fig.savefig(paths[-1], dpi=110, bbox_inches="tight")
    plt.close(fig)
    return paths
