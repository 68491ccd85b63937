"""The simulated setup: tiers (sizes, policies, costs), model shape and GPU, from flags or TOML.

``--tier hbm=80GB --tier dram=1TB`` (fastest first) or a TOML file::

    model = "Llama-3.1-70B"
    dtype = "bf16"
    policy = "auto"

    [gpu]
    name = "H100-SXM"
    flops = 989e12
    mfu = 0.5
    watts = 700
    count = 8

    [cluster]               # optional: engine nodes (--nodes, --route override)
    nodes = 4               # each with its own tiers before the first pool/object tier
    route = "cache"         # rr | prefix | cache (kvtier.sim.cluster)

    [[tiers]]
    name = "hbm"            # hbm | dram | nvme | pool | object: picks the default costs
    capacity = "80GB"
    bandwidth = "3.35TB"    # bytes per second; optional overrides below
    latency_us = 0.1
    usd_per_gb_month = 15
    watts_per_gb = 0
    policy = "lru"          # optional, per tier

A tier's capacity in blocks is ``capacity // block_bytes``, with ``block_bytes`` = the trace's
block tokens (512 for Mooncake) times the model's KV bytes per token; a capacity must be 0 or at
least one block. Tiers are listed fastest first: the known kinds in the order hbm, dram, nvme,
pool, object (custom names may go anywhere), each name once. Every value is checked once here:
``ConfigError`` names the flag or the TOML file and key, and the bad value.
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvtier.config import parse_size
from kvtier.errors import ConfigError
from kvtier.layout import KVLayout, preset
from kvtier.policy import DEFAULT_POLICY
from kvtier.sim.cost import (
    GPU,
    ComputeModel,
    TierCost,
    is_finite_number,
    tier_cost,
    with_overrides,
)
from kvtier.sim.replay import TierSpec, check_policy

DEFAULT_MODEL = "Llama-3.1-70B"
DEFAULT_DTYPE = "bf16"
#: known tier kinds, fastest first (``s3`` is another name for ``object``)
TIER_ORDER = ("hbm", "dram", "nvme", "pool", "object")
_TIER_KEYS = {
    "name",
    "capacity",
    "bandwidth",
    "latency_us",
    "usd_per_gb_month",
    "watts_per_gb",
    "policy",
}
_TOP_KEYS = {"model", "dtype", "policy", "gpu", "tiers", "cluster"}
_GPU_KEYS = {"name", "flops", "mfu", "watts", "count"}
_CLUSTER_KEYS = {"nodes", "route"}
#: tier kinds a cluster shares (``nodes > 1``): the first tier of these kinds and all after it
SHARED_KINDS = ("pool", "object")
#: how a cluster sends requests to nodes (``kvtier.sim.cluster``)
ROUTES = ("rr", "prefix", "cache")


@dataclass(frozen=True, slots=True)
class SimTier:
    """One tier of the simulated hierarchy."""

    name: str
    capacity_bytes: int
    policy: str
    cost: TierCost

    def __post_init__(self) -> None:
        if self.capacity_bytes < 0:
            raise ConfigError(
                f"tier {self.name!r}: capacity must be >= 0, got {self.capacity_bytes}"
            )
        check_policy(self.policy, f"tier {self.name!r}: ")


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """Everything the simulator needs besides the trace."""

    model_name: str
    layout: KVLayout
    compute: ComputeModel
    gpu: GPU
    tiers: tuple[SimTier, ...] = field(default_factory=tuple)
    #: engine nodes, each with its own tiers before ``shared_from`` (``kvtier.sim.cluster``)
    nodes: int = 1
    route: str = "rr"

    @property
    def block_bytes(self) -> int:
        return self.layout.block_bytes

    @property
    def shared_from(self) -> int:
        """Index of the first tier a cluster shares (a pool or object tier), else the count."""
        kinds = [_kind(t.name) for t in self.tiers]
        return next((i for i, k in enumerate(kinds) if k in SHARED_KINDS), len(kinds))

    @property
    def clustered(self) -> bool:
        """Whether a replay needs the cluster model: several nodes, or a shared tier (a pool or
        object tier is shared in the store even on one node: written through, evicting on
        its own; ``kvtier.sim.cluster``)."""
        return self.nodes > 1 or self.shared_from < len(self.tiers)

    def specs(self) -> list[TierSpec]:
        """Replay tier specs (capacity in blocks)."""
        return [
            TierSpec(t.name, t.capacity_bytes // self.block_bytes, t.policy) for t in self.tiers
        ]

    def with_tiers(self, tiers: list[SimTier]) -> Hierarchy:
        return replace(self, tiers=tuple(tiers))


def make_tier(
    name: str,
    capacity: str | int | float,
    policy: str,
    table: dict[str, Any] | None = None,
    where: str | None = None,
) -> SimTier:
    """A tier with the default costs of its kind, overridden by a TOML ``table`` if given (then
    a custom name is allowed if the table gives its bandwidth; its other costs default to zero).
    ``where`` prefixes errors (default ``tier 'NAME'``)."""
    where = where or f"tier {name!r}"
    if table is None:
        cost = tier_cost(name)
    else:
        if _kind(name) not in TIER_ORDER and "bandwidth" not in table:
            raise ConfigError(
                f"{where}: tier {name!r} has no default cost (known: {', '.join(TIER_ORDER)}); "
                "give at least its bandwidth (and latency_us, usd_per_gb_month, watts_per_gb)"
            )
        cost = with_overrides(tier_cost_or_zero(name), table, where)
    return SimTier(name, parse_size(capacity, f"{where} capacity"), policy, cost)


def _kind(name: str) -> str:
    """The tier kind a name picks (``s3`` is ``object``); custom names are their own kind."""
    key = name.lower()
    return "object" if key == "s3" else key


def tier_cost_or_zero(name: str) -> TierCost:
    """Default costs of a known tier name, or zeros for a custom one the TOML fully describes."""
    try:
        return tier_cost(name)
    except ConfigError:
        return TierCost(1.0, 0.0, 0.0, 0.0)


def parse_tier_flag(text: str, policy: str) -> SimTier:
    """``"dram=1TB"`` -> a tier named ``dram`` of 10**12 bytes with default costs, run by
    ``policy``; ``"nvme=16TB:lru"`` gives that tier its own policy (a ``[[tiers]]`` table's
    ``policy``)."""
    name, sep, rest = text.partition("=")
    if not sep or not name.strip():
        raise ConfigError(f"--tier {text!r}: write NAME=SIZE[:POLICY], e.g. --tier dram=1TB")
    size, _, own = rest.partition(":")
    if own.strip():
        policy = check_policy(own.strip(), f"--tier {text!r}: ")
    return make_tier(name.strip(), size.strip(), policy)


def check_tier_list(tiers: list[SimTier], source: str) -> None:
    """Each name once; the known kinds fastest first (``source`` names the flag or file)."""
    seen: set[str] = set()
    last: tuple[int, str] | None = None
    for t in tiers:
        if t.name.lower() in seen:
            raise ConfigError(f"{source}: tier {t.name!r} is given twice; name each tier once")
        seen.add(t.name.lower())
        kind = _kind(t.name)
        if kind not in TIER_ORDER:
            continue
        rank = TIER_ORDER.index(kind)
        if last is not None and rank < last[0]:
            raise ConfigError(
                f"{source}: tier {t.name!r} comes after {last[1]!r}; list tiers fastest first, "
                f"in the order {', '.join(TIER_ORDER)} (custom names anywhere)"
            )
        last = (rank, t.name)


def check_tier_sizes(tiers: tuple[SimTier, ...], layout: KVLayout, model: str) -> None:
    """A capacity is 0 or at least one block (a smaller one would silently hold nothing)."""
    bb = layout.block_bytes
    for t in tiers:
        if 0 < t.capacity_bytes < bb:
            raise ConfigError(
                f"tier {t.name!r}: capacity {t.capacity_bytes:,} bytes is less than one block "
                f"({bb:,} bytes: {layout.block_tokens} tokens of {model}, {layout.dtype}); "
                f"give 0 or at least {bb:,} bytes"
            )


def _read_toml(path: str) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_bytes().decode("utf-8-sig"))
    except OSError as exc:
        raise ConfigError(f"cannot read simulation config {path!r}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(
            f"cannot read simulation config {path!r}: not UTF-8 text (byte at offset "
            f"{exc.start}); is this a TOML file?"
        ) from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"cannot read simulation config {path!r}: {exc}") from None


def _check_keys(where: str, table: dict[str, Any], allowed: set[str]) -> None:
    unknown = sorted(set(table) - allowed)
    if unknown:
        raise ConfigError(
            f"{where}unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(allowed))}"
        )


def _policy(table: dict[str, Any], where: str, default: str) -> str:
    return check_policy(_text(table, "policy", where, default), where)


def _text(table: dict[str, Any], key: str, where: str, default: str) -> str:
    value = table.get(key, default)
    if not isinstance(value, str) or not value.strip():
        raise ConfigError(f"{where}{key} must be a non-empty string, got {value!r}")
    return value


def _number(
    table: dict[str, Any], key: str, where: str, default: float, low: float, strict: bool
) -> float:
    """``table[key]`` (or ``default``): a finite number ``> low`` (``strict``) or ``>= low``."""
    value = table.get(key, default)
    if not is_finite_number(value) or (value <= low if strict else value < low):
        bound = f"> {low:g}" if strict else f">= {low:g}"
        raise ConfigError(f"{where}{key} must be a finite number {bound}, got {value!r}")
    return float(value)


def _gpu(doc: dict[str, Any], src: str, gpus: int | None) -> GPU:
    g = doc.get("gpu", {})
    if not isinstance(g, dict):
        raise ConfigError(
            f"{src}'gpu' must be a table ([gpu] with {', '.join(sorted(_GPU_KEYS))}), got {g!r}"
        )
    where = f"{src}[gpu] "
    _check_keys(where, g, _GPU_KEYS)
    d = GPU()
    mfu = g.get("mfu", d.mfu)
    if not is_finite_number(mfu) or not 0 < mfu <= 1:
        raise ConfigError(f"{where}mfu must be in (0, 1] (a fraction of peak), got {mfu!r}")
    if gpus is not None:
        if gpus < 1:
            raise ConfigError(f"--gpus must be >= 1, got {gpus}")
        count = gpus
    else:
        count = g.get("count", d.count)
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise ConfigError(f"{where}count must be a positive integer, got {count!r}")
    return GPU(
        name=_text(g, "name", where, d.name),
        flops=_number(g, "flops", where, d.flops, 0.0, strict=True),
        mfu=float(mfu),
        watts=_number(g, "watts", where, d.watts, 0.0, strict=False),
        count=count,
    )


def _toml_tiers(doc: dict[str, Any], src: str, pol: str) -> list[SimTier]:
    raw = doc.get("tiers", [])
    if not isinstance(raw, list) or not all(isinstance(t, dict) for t in raw):
        raise ConfigError(
            f"{src}'tiers' must be an array of tables ([[tiers]] with name, capacity, ...), "
            f"got {raw!r}"
        )
    tiers: list[SimTier] = []
    for i, t in enumerate(raw):
        where = f"{src}[[tiers]] #{i + 1} "
        _check_keys(where, t, _TIER_KEYS)
        if "name" not in t or "capacity" not in t:
            raise ConfigError(f"{where}needs a name and a capacity")
        name = _text(t, "name", where, "")
        tier_pol = _policy(t, where, pol)
        tiers.append(make_tier(name, t["capacity"], tier_pol, t, f"{where}({name!r})"))
    return tiers


def build(
    model: str | None,
    dtype: str | None,
    block_tokens: int,
    policy: str | None,
    tier_flags: list[str],
    toml_path: str | None = None,
    gpus: int | None = None,
    nodes: int | None = None,
    route: str | None = None,
) -> Hierarchy:
    """Assemble the hierarchy; flags override the TOML file; errors say what to change."""
    doc: dict[str, Any] = {}
    src = ""
    if toml_path:
        doc = _read_toml(toml_path)
        src = f"{toml_path}: "
        _check_keys(src, doc, _TOP_KEYS)
    name = model or _text(doc, "model", src, DEFAULT_MODEL)
    if policy is not None:
        check_policy(policy, "--")
    pol = policy or _policy(doc, src, DEFAULT_POLICY)
    p = preset(name)
    layout = p.layout(dtype or _text(doc, "dtype", src, DEFAULT_DTYPE), block_tokens)
    gpu = _gpu(doc, src, gpus)
    if tier_flags:
        tiers = [parse_tier_flag(f, pol) for f in tier_flags]
        check_tier_list(tiers, "--tier")
    else:
        tiers = _toml_tiers(doc, src, pol)
        check_tier_list(tiers, f"{src}[[tiers]]")
    if not tiers:
        tiers = [make_tier("hbm", "80GB", pol)]
    check_tier_sizes(tuple(tiers), layout, p.name)
    compute = ComputeModel.from_preset(p, layout.bytes_per_token)
    n, how = _cluster(doc, src, nodes, route)
    return Hierarchy(p.name, layout, compute, gpu, tuple(tiers), n, how)


def _cluster(
    doc: dict[str, Any], src: str, nodes: int | None, route: str | None
) -> tuple[int, str]:
    """Nodes and routing: the flags, else the TOML file's ``[cluster]``, else one node."""
    c = doc.get("cluster", {})
    if not isinstance(c, dict):
        raise ConfigError(f"{src}'cluster' must be a table ([cluster] with nodes, route)")
    where = f"{src}[cluster] "
    _check_keys(where, c, _CLUSTER_KEYS)
    if nodes is None:
        nodes = c.get("nodes", 1)
        if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1:
            raise ConfigError(f"{where}nodes must be a positive integer, got {nodes!r}")
    elif nodes < 1:
        raise ConfigError(f"--nodes must be >= 1, got {nodes}")
    if route is None:
        route = _text(c, "route", where, "rr")
        if route not in ROUTES:
            raise ConfigError(f"{where}route {route!r} is unknown; choose {', '.join(ROUTES)}")
    elif nodes == 1:
        raise ConfigError("--route sends requests to nodes; add --nodes N (N > 1)")
    return nodes, route
