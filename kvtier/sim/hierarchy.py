"""The simulated setup: tiers (sizes, policies, costs), model shape and GPU, from flags or TOML.

``--tier hbm=80GB --tier dram=1TB`` (fastest first) or a TOML file::

    model = "Llama-3.1-70B"
    dtype = "bf16"
    policy = "s3fifo"

    [gpu]
    name = "H100-SXM"
    flops = 989e12
    mfu = 0.5
    watts = 700
    count = 8

    [[tiers]]
    name = "hbm"            # hbm | dram | nvme | pool | object: picks the default costs
    capacity = "80GB"
    bandwidth = "3.35TB"    # bytes per second; optional overrides below
    latency_us = 0.1
    usd_per_gb_month = 15
    watts_per_gb = 0
    policy = "lru"          # optional, per tier

A tier's capacity in blocks is ``capacity // block_bytes``, with ``block_bytes`` = the trace's
block tokens (512 for Mooncake) times the model's KV bytes per token.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import check_keys, parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, preset
from kvtier.policy import DEFAULT_POLICY
from kvtier.sim.cost import GPU, ComputeModel, TierCost, tier_cost, with_overrides
from kvtier.sim.replay import TierSpec

DEFAULT_MODEL = "Llama-3.1-70B"
_TIER_KEYS = {
    "name",
    "capacity",
    "bandwidth",
    "latency_us",
    "usd_per_gb_month",
    "watts_per_gb",
    "policy",
}
_TOP_KEYS = {"model", "dtype", "policy", "gpu", "tiers"}
_GPU_KEYS = {"name", "flops", "mfu", "watts", "count"}


@dataclass(frozen=True, slots=True)
class SimTier:
    """One tier of the simulated hierarchy."""

    name: str
    capacity_bytes: int
    policy: str
    cost: TierCost


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Everything the simulator needs besides the trace."""

    model_name: str
    layout: KVLayout
    compute: ComputeModel
    gpu: GPU
    tiers: tuple[SimTier, ...] = field(default_factory=tuple)

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    def specs(self) -> list[TierSpec]:
        """Replay tier specs (capacity in blocks)."""
        return [
            TierSpec(t.name, t.capacity_bytes // self.block_bytes, t.policy) for t in self.tiers
        ]

    def with_tiers(self, tiers: list[SimTier]) -> Hierarchy:
        return Hierarchy(self.model_name, self.layout, self.compute, self.gpu, tuple(tiers))


def make_tier(
    name: str, capacity: str | int, policy: str, table: dict[str, Any] | None = None
) -> SimTier:
    where = f"tier {name!r}"
    cost = tier_cost(name)
    if table is not None:
        cost = with_overrides(tier_cost_or_zero(name), table, where)
    return SimTier(name, parse_size(capacity, f"{where} capacity"), policy, cost)


def tier_cost_or_zero(name: str) -> TierCost:
    """Default costs of a known tier name, or zeros for a custom one the TOML fully describes."""
    try:
        return tier_cost(name)
    except ConfigError:
        return TierCost(1.0, 0.0, 0.0, 0.0)


def parse_tier_flag(text: str, policy: str) -> SimTier:
    """``"dram=1TB"`` -> a tier named ``dram`` of 10**12 bytes with default costs."""
    name, sep, size = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--tier {text!r}: write NAME=SIZE, e.g. --tier dram=1TB")
    return make_tier(name.strip(), size.strip(), policy)


def build(
    model: str | None,
    dtype: str,
    block_tokens: int,
    policy: str | None,
    tier_flags: list[str],
    toml_path: str | None = None,
    gpus: int | None = None,
) -> Hierarchy:
    """Assemble the hierarchy; flags override the TOML file; errors say what to change."""
    doc: dict[str, Any] = {}
    if toml_path:
        try:
            doc = tomllib.loads(Path(toml_path).read_text())
        except (OSError, tomllib.TOMLDecodeError) as exc:
            raise ConfigError(f"cannot read simulation config {toml_path!r}: {exc}") from None
        check_keys("simulate", doc, _TOP_KEYS)
    name = model or str(doc.get("model", DEFAULT_MODEL))
    pol = policy or str(doc.get("policy", DEFAULT_POLICY))
    p = preset(name)
    layout = p.layout(str(doc.get("dtype", dtype)), block_tokens)
    g = doc.get("gpu", {})
    check_keys("gpu", g, _GPU_KEYS)
    d = GPU()
    gpu = GPU(
        name=str(g.get("name", d.name)),
        flops=float(g.get("flops", d.flops)),
        mfu=float(g.get("mfu", d.mfu)),
        watts=float(g.get("watts", d.watts)),
        count=int(gpus or g.get("count", d.count)),
    )
    tiers: list[SimTier] = []
    if tier_flags:
        tiers = [parse_tier_flag(f, pol) for f in tier_flags]
    else:
        for i, t in enumerate(doc.get("tiers", [])):
            check_keys(f"tiers[{i}]", t, _TIER_KEYS)
            if "name" not in t or "capacity" not in t:
                raise ConfigError(f"[[tiers]] #{i + 1} needs a name and a capacity")
            tiers.append(make_tier(str(t["name"]), t["capacity"], str(t.get("policy", pol)), t))
    if not tiers:
        tiers = [make_tier("hbm", "80GB", pol)]
    compute = ComputeModel.from_preset(p, layout.bytes_per_token)
    return Hierarchy(p.name, layout, compute, gpu, tuple(tiers))
