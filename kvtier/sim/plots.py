"""PNG plots (matplotlib, the ``sim`` extra): hit ratio vs capacity, TTFT CDF, cost per tier.

``check_plot_dir`` validates ``--plot DIR`` before a run (nothing is created); the plot functions
create the directory only when they write into it.
"""

from __future__ import annotations

import os
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


def check_plot_dir(path: str, flag: str = "--plot") -> Path:
    """``path`` as a plot directory: an existing directory, or one that can be created (its first
    existing ancestor is a writable directory). Creates nothing; checks matplotlib is installed.
    Raises ``ConfigError`` naming ``flag`` and the path."""
    out = Path(path)
    _plt()
    if out.exists():
        if not out.is_dir():
            raise ConfigError(f"{flag} {path!r} exists and is not a directory; give a directory")
        probe = out
    else:
        probe = out.parent
        while not probe.exists():
            probe = probe.parent
        if not probe.is_dir():
            raise ConfigError(
                f"{flag} {path!r}: {str(probe)!r} is a file, so the directory cannot be created"
            )
    if not os.access(probe, os.W_OK | os.X_OK):
        raise ConfigError(f"{flag} {path!r}: {str(probe)!r} is not writable")
    return out


def _ready(out: Path) -> Path:
    """Create ``out`` (and parents) now that plots are about to be written."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(
            f"--plot {str(out)!r}: cannot create the directory: {exc.strerror}"
        ) from None
    return out


def _save(plt: Any, fig: Any, path: Path) -> None:
    try:
        fig.savefig(path, dpi=110, bbox_inches="tight")
    except OSError as exc:
        raise ConfigError(f"--plot: cannot write {str(path)!r}: {exc.strerror or exc}") from None
    finally:
        plt.close(fig)


def plot_sweep(rows: list[dict[str, Any]], out: Path) -> Path:
    """Token hit ratio against capacity, one line per policy (points in capacity order)."""
    plt = _plt()
    out = _ready(out)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for pol in dict.fromkeys(r["policy"] for r in rows):
        pts = sorted(
            (r["capacity_blocks"], r["token_hit_ratio"]) for r in rows if r["policy"] == pol
        )
        ax.plot(*zip(*pts, strict=True), marker="o", label=pol)
    ax.set_xscale("log")
    ax.set(xlabel="capacity (blocks)", ylabel="token hit ratio", title="hit ratio vs capacity")
    ax.grid(True, alpha=0.3)
    ax.legend()
    path = out / "hit_ratio_vs_capacity.png"
    _save(plt, fig, path)
    return path


def plot_run(summary: dict[str, Any], ttft: npt.NDArray[np.float64], out: Path) -> list[Path]:
    """TTFT CDF and monthly cost per tier of one simulation."""
    plt = _plt()
    out = _ready(out)
    paths = []
    fig, ax = plt.subplots(figsize=(7, 4.5))
    x = np.sort(ttft)
    ax.plot(x, np.arange(1, len(x) + 1) / len(x))
    ax.set(xlabel="TTFT (s)", ylabel="fraction of requests", title="TTFT CDF")
    ax.grid(True, alpha=0.3)
    paths.append(out / "ttft_cdf.png")
    _save(plt, fig, paths[-1])
    fig, ax = plt.subplots(figsize=(7, 4.5))
    names = [t["name"] for t in summary["tiers"]]
    ax.bar(names, [t["monthly_cost_usd"] for t in summary["tiers"]])
    ax.set(ylabel="$ / month", title="capacity cost per tier")
    paths.append(out / "cost_per_tier.png")
    _save(plt, fig, paths[-1])
    return paths
