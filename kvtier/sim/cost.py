"""Cost model: what a replay's hits are worth in time, energy and money.

Per tier: bandwidth, latency, $/GB/month and watts per GB (defaults from the tier table of the
design notes, typical values; every one can be overridden in TOML). Per GPU: dense FLOP/s, the
model FLOPs utilisation prefill reaches (MFU), watts.

* **Prefill compute** for ``n`` new tokens after ``c`` cached ones: ``2 * params * n`` (the
  matmuls) ``+ 4 * layers * d_attn * n * (c + n / 2)`` (QK^T and AV over the causal context),
  divided by ``gpus * flops * mfu``.
* **Fetch** of ``h`` tokens from a tier: ``latency + h * kv_bytes_per_token / bandwidth``.
* **Fetch-vs-recompute admission**: a request loads its hit tokens from a tier only when that is
  faster than recomputing them there; otherwise they are recomputed (and count as misses in TTFT,
  though the replay still counts them as cache hits).
* **TTFT** = fetch time + prefill compute (no overlap assumed: conservative); no queueing.
* **Throughput** = input tokens / sum of TTFTs (one instance prefilling back to back).
* **Energy** = (GPU watts * gpus + tier watts) * busy time; tokens/J = input tokens / energy.
* **Monthly cost** = sum over tiers of capacity GB * $/GB/month (GPU rental not included).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from importlib import resources
from typing import Any

import numpy as np
import numpy.typing as npt

from kvtier.errors import ConfigError
from kvtier.layout import ModelPreset


@dataclass(frozen=True, slots=True)
class TierCost:
    """Performance and price of one tier. Bandwidth in bytes/s, latency in seconds."""

    bandwidth: float
    latency_s: float
    usd_per_gb_month: float
    watts_per_gb: float


#: typical values (DESIGN.md tier table; watts: DDR5 ~0.4 W/GB, NVMe ~15 W per 7.68 TB drive,
#: pool = remote DRAM + NIC, object store billed, not powered by us; HBM power is in the GPU's)
DEFAULT_TIER_COSTS: dict[str, TierCost] = {
    "hbm": TierCost(3.35e12, 100e-9, 15.0, 0.0),
    "dram": TierCost(50e9, 100e-9, 4.0, 0.4),
    "nvme": TierCost(7e9, 10e-6, 0.08, 0.002),
    "pool": TierCost(25e9, 20e-6, 2.0, 0.45),
    "object": TierCost(6.25e9, 20e-3, 0.02, 0.0),
}


def tier_cost(name: str) -> TierCost:
    """Default cost of a tier named ``hbm``/``dram``/``nvme``/``pool``/``object`` (or ``s3``)."""
    key = "object" if name.lower() in ("s3", "object") else name.lower()
    try:
        return DEFAULT_TIER_COSTS[key]
    except KeyError:
        raise ConfigError(
            f"tier {name!r} has no default cost; name it one of {', '.join(DEFAULT_TIER_COSTS)} "
            "or give bandwidth/latency/price/watts in the TOML file"
        ) from None


@dataclass(frozen=True, slots=True)
class GPU:
    """The prefill hardware. Defaults: H100 SXM, 989 TFLOP/s dense bf16, 700 W."""

    name: str = "H100-SXM"
    flops: float = 989e12
    mfu: float = 0.5
    watts: float = 700.0
    count: int = 8


@dataclass(frozen=True, slots=True)
class ComputeModel:
    """Prefill FLOPs of one model shape."""

    params: int
    layers: int
    d_attn: int  # query heads * head_dim
    bytes_per_token: int

    @classmethod
    def from_preset(cls, p: ModelPreset, bytes_per_token: int) -> ComputeModel:
        shapes = json.loads(
            resources.files("kvtier.presets").joinpath("model_shapes.json").read_text()
        )
        raw: dict[str, Any] = next((m for m in shapes if m["name"] == p.name), {})
        heads = int(raw.get("num_attention_heads", 0)) or p.kv_heads
        d_attn = heads * int(raw.get("head_dim", p.head_dim))
        if not p.params:
            raise ConfigError(f"model {p.name!r} has no parameter count for the compute model")
        return cls(p.params, p.layers, d_attn, bytes_per_token)

    def prefill_flops(
        self, new: npt.NDArray[np.float64], cached: npt.NDArray[np.float64]
    ) -> npt.NDArray[np.float64]:
        """FLOPs to prefill ``new`` tokens after ``cached`` ones (elementwise over requests)."""
        return 2.0 * self.params * new + 4.0 * self.layers * self.d_attn * new * (cached + new / 2)


@dataclass(frozen=True, slots=True)
class Timing:
    """Per-request results of pricing a replay."""

    ttft_s: npt.NDArray[np.float64]
    loaded_tokens: npt.NDArray[np.float64]  # [tier] tokens actually fetched (after admission)
    recomputed_hit_tokens: npt.NDArray[np.float64]  # [tier] hits recomputed (fetch was slower)


def price(
    hit_tokens: npt.NDArray[np.int64],
    input_tokens: npt.NDArray[np.int64],
    costs: list[TierCost],
    model: ComputeModel,
    gpu: GPU,
) -> Timing:
    """TTFT of every request given its cached tokens per tier (``[tier, request]``)."""
    rate = gpu.count * gpu.flops * gpu.mfu
    inp = input_tokens.astype(np.float64)
    hits = hit_tokens.astype(np.float64)
    mid = inp / 2.0  # recomputed hit tokens sit, on average, mid-prompt
    fetch = np.zeros_like(inp)
    use = np.zeros_like(hits)
    for t, c in enumerate(costs):
        h = hits[t]
        load = np.where(h > 0, c.latency_s + h * model.bytes_per_token / c.bandwidth, 0.0)
        redo = model.prefill_flops(h, np.maximum(mid - h / 2, 0.0)) / rate
        ok = load <= redo
        use[t] = np.where(ok, h, 0.0)
        fetch += np.where(ok, load, 0.0)
    cached = use.sum(axis=0)
    compute = model.prefill_flops(inp - cached, cached) / rate
    return Timing(fetch + compute, use.sum(axis=1), (hits - use).sum(axis=1))


def is_finite_number(v: object) -> bool:
    """A TOML/JSON number (not a bool) that is finite and fits a float."""
    if not isinstance(v, int | float) or isinstance(v, bool):
        return False
    try:
        return math.isfinite(v)
    except OverflowError:  # an int too large for a float
        return False


def with_overrides(base: TierCost, table: dict[str, Any], where: str) -> TierCost:
    """``base`` with the keys given in a TOML tier table replaced (sizes/rates parsed).

    Raises ``ConfigError`` naming ``where`` and the key: bandwidth must be > 0, latency, price
    and watts finite and >= 0.
    """
    from kvtier.config import parse_size

    out = base
    if "bandwidth" in table:
        bw = parse_size(table["bandwidth"], f"{where} bandwidth")
        if bw <= 0:
            raise ConfigError(f"{where} bandwidth must be > 0 bytes/s, got {table['bandwidth']!r}")
        out = replace(out, bandwidth=float(bw))
    for key, field in (
        ("latency_us", "latency_s"),
        ("usd_per_gb_month", "usd_per_gb_month"),
        ("watts_per_gb", "watts_per_gb"),
    ):
        if key in table:
            v = table[key]
            if not is_finite_number(v) or v < 0:
                raise ConfigError(f"{where} {key} must be a finite number >= 0, got {v!r}")
            out = replace(out, **{field: float(v) * (1e-6 if key == "latency_us" else 1.0)})
    return out
