"""Configuration: one TOML file (or dict) plus ``KVTIER_*`` environment overrides, validated once.

Example (``kvtier.toml``)::

    [store]
    model_id = "meta-llama/Llama-3.1-8B"  # required: names the weights (blocks are keyed by it)
    revision = "0e9e39f"        # the weights' version, when it can change
    model = "Llama-3.1-8B"      # a preset, or give layers/kv_heads/head_dim/kv_factor
    dtype = "bf16"
    block_tokens = 256
    tenant = "default"
    policy = "auto"             # the default; or "s3fifo", "lru" (a [[tiers]] table may
                                # name its own: policy = "lru")
    workers = 2
    metrics_port = 0            # >0 serves Prometheus metrics on 127.0.0.1:<port>

    [[tiers]]
    kind = "host"
    capacity = "8GiB"

    [[tiers]]
    kind = "nvme"
    capacity = "200GiB"
    paths = ["/mnt/nvme0/kvtier"]

A service's config may add ``[[pools]]``, stores of further KV layouts it serves
(``kvtier.service.pools``); ``StoreConfig`` reads ``[store]``/``[[tiers]]`` only.

Environment overrides: ``KVTIER_<KEY>`` sets ``store.<key>`` (``KVTIER_POLICY=lru``), and
``KVTIER_TIER<i>_<KEY>`` sets a key of the i-th tier (``KVTIER_TIER0_CAPACITY=4GiB``).
Env values are text: numbers are read as numbers, booleans as 1/0, true/false, yes/no, on/off.
``KVTIER_`` belongs to kvtier: an unknown ``KVTIER_<KEY>`` is an error, as is an unknown key, a
value of the wrong type or out of range; the ``ConfigError`` names the key, the bad value and the
env var or file it came from. ``KVTIER_PURE`` is no store key: it chose between the pure and a
compiled build of the policies, which no longer exists, and the config ignores it.
"""

from __future__ import annotations

import contextlib
import math
import os
import re
import tomllib
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.identity import Identity, check_share_groups
from kvtier.layout import DEFAULT_BLOCK_TOKENS, KVLayout, canonical_dtype, preset
from kvtier.policy import DEFAULT_POLICY, POLICIES, REMOVED, EvictionPolicy, make_policy

# decimal (k, kb = 10**3, m, mb, ...) and binary (kib = 2**10, mib, ...) units, any case
_UNITS = {"": 1, "b": 1} | {
    name: base**power
    for power, p in enumerate("kmgt", 1)
    for name, base in ((p, 1000), (p + "b", 1000), (p + "ib", 1024))
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")
_INT_RE = re.compile(r"^\s*[+-]?[0-9]+\s*$")
_TRUE = frozenset({"1", "true", "yes", "on"})
_FALSE = frozenset({"0", "false", "no", "off"})


def parse_size(value: str | int | float, what: str = "size") -> int:
    """``"8GiB"`` -> 8589934592, ``"80GB"`` -> 8e10, ``4096`` -> 4096. Raises ``ConfigError``."""
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise ConfigError(f"{what}: expected a size like '8GiB', got {value!r}")
    if isinstance(value, int | float):
        if not math.isfinite(value):
            raise ConfigError(f"{what}: size must be a finite number, got {value!r}")
        n = int(value)
    else:
        m = _SIZE_RE.match(value)
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what}: cannot read size {value!r}; write e.g. 4096, '512MiB', '8GiB', '2TB'"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ConfigError(f"{what}: size must not be negative, got {value!r}")
    return n


def parse_int(value: object, what: str, lo: int = 0, hi: int | None = None) -> int:
    """An integer in ``lo..hi``: a TOML integer, or decimal digits (an env var's text).

    Raises ``ConfigError`` naming ``what`` for anything else: a bool, a fraction (never
    truncated), a word, a value out of range (never clamped).
    """
    span = f"{lo}..{hi}" if hi is not None else f">= {lo}"
    if isinstance(value, int) and not isinstance(value, bool):
        n = value
    elif isinstance(value, str) and _INT_RE.match(value):
        n = int(value)
    else:
        raise ConfigError(f"{what}: expected a whole number {span}, got {value!r}")
    if n < lo or (hi is not None and n > hi):
        raise ConfigError(f"{what}: must be {span}, got {value!r}")
    return n


def parse_float(value: object, what: str, lo: float = 0.0) -> float:
    """A finite number ``>= lo``: a TOML number, or its text (an env var). ``ConfigError`` else."""
    x = math.nan
    if isinstance(value, int | float | str) and not isinstance(value, bool):
        with contextlib.suppress(ValueError):
            x = float(value)
    if not math.isfinite(x) or x < lo:
        raise ConfigError(f"{what}: expected a finite number >= {lo:g}, got {value!r}")
    return x


def parse_bool(value: object, what: str) -> bool:
    """A TOML boolean, or (an env var's text) 1/0, true/false, yes/no, on/off in any case.

    Anything else raises ``ConfigError``: a typo must not silently mean False.
    """
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        word = value.strip().lower()
        if word in _TRUE or word in _FALSE:
            return word in _TRUE
    raise ConfigError(f"{what}: expected true or false (or 1/0, yes/no, on/off), got {value!r}")


def check_keys(section: str, given: Mapping[str, Any], allowed: set[str]) -> None:
    """Raise ``ConfigError`` naming unknown keys and listing the allowed ones."""
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ConfigError(
            f"[{section}] unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )


_LAYOUT_KEYS = {"model", "dtype", "block_tokens", "layers", "kv_heads", "head_dim", "kv_factor"}
_NAMESPACE_KEYS = {"tenant", "model_id", "revision", "share_groups", "secret"}
#: keys of earlier versions, with what replaced them
_RENAMED = {
    "weights_version": "it is now revision = '...'",
    "share_group": (
        "a store-wide share group merged every tenant of the store; map tenants to groups "
        "instead: [store.share_groups] alice = 'team', bob = 'team'"
    ),
}
#: the store's defaults, shared by ``TieredStore(...)`` and ``from_config``
DEFAULT_WORKERS = 2
#: demotion jobs queued before ``store`` waits for the workers (back-pressure)
DEFAULT_DEMOTE_QUEUE = 16
_ENGINE_KEYS = {"policy", "workers", "metrics_port", "demote_queue"}
_STORE_KEYS = _LAYOUT_KEYS | _NAMESPACE_KEYS | _ENGINE_KEYS


def _policy_name(value: object, what: str) -> str:
    """A policy name (``kvtier.policy.POLICIES``), or a ``ConfigError`` saying what to use."""
    if not isinstance(value, str):
        raise ConfigError(f"{what}: a policy name (a string), got {value!r}")
    if value.lower() in REMOVED:
        raise ConfigError(f"{what}: policy {value!r} was removed; use {REMOVED[value.lower()]}")
    if value.lower() not in POLICIES:
        raise ConfigError(f"{what}: unknown policy {value!r}; choose {', '.join(POLICIES)}")
    return value


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Validated store configuration. ``tiers`` are raw per-tier tables, validated by each kind."""

    layout: KVLayout
    identity: Identity
    tenant: str = "default"
    share_groups: Mapping[str, str] = field(default_factory=dict)
    secret: bytes = field(default=b"", repr=False)
    policy: str = DEFAULT_POLICY
    workers: int = DEFAULT_WORKERS
    metrics_port: int = 0
    demote_queue: int = DEFAULT_DEMOTE_QUEUE
    tiers: tuple[Mapping[str, Any], ...] = ()
    #: a ``policy`` key of a ``[[tiers]]`` table, per tier (``None``: ``policy``); empty when
    #: no table has one
    tier_policies: tuple[str | None, ...] = ()

    def policy_source(self) -> str | Callable[[int, int], EvictionPolicy[Any]]:
        """What ``TieredStore(policy=...)`` takes: the store's policy name, or, where a tier
        names its own, a factory of each tier's policy from (tier, capacity in blocks)."""
        if not self.tier_policies:
            return self.policy
        names = [p or self.policy for p in self.tier_policies]
        return lambda t, capacity: make_policy(names[t], capacity)

    @staticmethod
    def from_dict(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> StoreConfig:
        """Validate a config mapping (``{"store": {...}, "tiers": [...]}``) with env overrides."""
        if not isinstance(raw, Mapping):
            raise ConfigError(
                f"a config is a table of [store] and [[tiers]], got {type(raw).__name__}"
            )
        # [service] and [[pools]] (further stores of a service): kvtier.service
        check_keys("top level", raw, {"store", "tiers", "service", "pools"})
        store, tiers = raw.get("store", {}), raw.get("tiers", [])
        if not isinstance(store, Mapping):
            raise ConfigError(f"[store] must be a table (key = value lines), got {store!r}")
        if not isinstance(tiers, list | tuple) or not all(isinstance(t, Mapping) for t in tiers):
            raise ConfigError(
                f'tiers must be an array of tables ([[tiers]] kind = "host"), got {tiers!r}'
            )
        s = _Section(dict(store))
        tiers = [dict(t) for t in tiers]
        _apply_env(s, tiers, os.environ if env is None else env)
        for old, why in _RENAMED.items():
            if old in s.values:
                raise ConfigError(f"{s.what(old)} = {s.values[old]!r}: no longer a key; {why}")
        check_keys("store", s.values, _STORE_KEYS)
        if not tiers:
            tiers = [{"kind": "host", "capacity": "1GiB"}]
        for i, t in enumerate(tiers):
            if not isinstance(t.get("kind"), str):
                raise ConfigError(
                    f'[[tiers]] #{i} needs kind = "host" (a string), got {t.get("kind")!r}'
                )
        policy = _policy_name(s.text("policy", DEFAULT_POLICY), s.what("policy"))
        tier_policies = tuple(
            None
            if t.get("policy") is None
            else _policy_name(t.pop("policy"), f"[[tiers]] #{i} ({t['kind']}) policy")
            for i, t in enumerate(tiers)
        )
        layout = _layout_from(s)
        groups = check_share_groups(s.values.get("share_groups", {}), s.what("share_groups"))
        engine = {
            "tenant": s.text("tenant", "default"),
            "secret": _secret(s),
            "policy": policy,
            "workers": s.integer("workers", DEFAULT_WORKERS, 1, 1024),
            "metrics_port": s.integer("metrics_port", 0, 0, 65535),
            "demote_queue": s.integer("demote_queue", DEFAULT_DEMOTE_QUEUE, 1),
        }
        if "model_id" not in s.values:
            raise ConfigError(
                "[store] model_id is required: name the weights the KV comes from (e.g. "
                "model_id = 'meta-llama/Llama-3.1-8B', with revision = '<commit>'); blocks of "
                "two checkpoints must never mix, and a model preset names only a shape"
            )
        try:
            identity = Identity(s.text("model_id", ""), s.text("revision", "", empty=True))
        except ConfigError as exc:
            raise ConfigError(f"[store] {exc}") from None
        return StoreConfig(
            layout=layout,
            identity=identity,
            share_groups=groups,
            tiers=tuple(tiers),
            tier_policies=tier_policies if any(tier_policies) else (),
            **engine,  # type: ignore[arg-type]
        )

    @staticmethod
    def load(
        config: StoreConfig | Mapping[str, Any] | str | Path, env: Mapping[str, str] | None = None
    ) -> StoreConfig:
        """A validated config from a ``StoreConfig``, a dict or a TOML file path."""
        if isinstance(config, StoreConfig):
            return config
        if isinstance(config, str | Path):
            return StoreConfig.from_file(config, env)
        return StoreConfig.from_dict(config, env)

    @staticmethod
    def from_file(path: str | Path, env: Mapping[str, str] | None = None) -> StoreConfig:
        """``from_dict`` of a TOML file; every ``ConfigError`` names the file."""
        try:
            raw = tomllib.loads(Path(path).read_bytes().decode())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror or exc}") from None
        except UnicodeDecodeError as exc:
            raise ConfigError(f"config file {path} is not UTF-8 text (byte {exc.start})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        try:
            return StoreConfig.from_dict(raw, env)
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None


class _Section:
    """The ``[store]`` table being read; errors name the key, and the env var that set it."""

    __slots__ = ("origin", "values")

    def __init__(self, values: dict[str, Any]) -> None:
        self.values = values
        self.origin: dict[str, str] = {}

    def what(self, key: str) -> str:
        src = self.origin.get(key)
        return f"[store] {key}" + (f" (from {src})" if src else "")

    def integer(self, key: str, default: int, lo: int, hi: int | None = None) -> int:
        return (
            parse_int(self.values[key], self.what(key), lo, hi) if key in self.values else default
        )

    def text(self, key: str, default: str, *, empty: bool = False) -> str:
        value = self.values.get(key, default)
        if not isinstance(value, str) or not (value or empty):
            raise ConfigError(f"{self.what(key)}: expected a non-empty string, got {value!r}")
        return value


def _secret(s: _Section) -> bytes:
    """The namespace secret: a non-empty string (or bytes, from a dict). Never echoed."""
    value = s.values.get("secret")
    if value is None:
        return b""
    if isinstance(value, str | bytes) and value:
        return value.encode() if isinstance(value, str) else value
    kind = "an empty string" if value == "" else type(value).__name__
    raise ConfigError(
        f"{s.what('secret')}: expected a non-empty string, got {kind}; omit it for none"
    )


def _layout_from(s: _Section) -> KVLayout:
    dtype = canonical_dtype(s.text("dtype", "float16"))
    block_tokens = s.integer("block_tokens", DEFAULT_BLOCK_TOKENS, 1)
    shape = ("layers", "kv_heads", "head_dim")
    if "model" in s.values and not any(k in s.values for k in shape):
        if "kv_factor" in s.values:
            raise ConfigError(
                f"{s.what('kv_factor')}: a model preset sets it; give layers, "
                "kv_heads, head_dim too, or drop it"
            )
        return preset(s.text("model", "")).layout(dtype, block_tokens)
    missing = [k for k in shape if k not in s.values]
    if missing:
        raise ConfigError(
            f'[store] give a model preset (model = "Llama-3.1-8B") or all of layers, kv_heads, '
            f"head_dim; missing {', '.join(missing)}"
        )
    layers, heads, dim = (s.integer(k, 0, 1) for k in shape)
    return KVLayout(layers, heads, dim, dtype, s.integer("kv_factor", 2, 1, 2), block_tokens)


#: ``KVTIER_*`` variables that are no store keys (``KVTIER_PURE`` chose a build that is gone)
_NOT_CONFIG = frozenset({"KVTIER_PURE"})


def _apply_env(s: _Section, tiers: list[dict[str, Any]], env: Mapping[str, str]) -> None:
    """Apply ``KVTIER_*`` overrides; kvtier owns the prefix, so an unknown name is an error."""
    tier_re = re.compile(r"^KVTIER_TIER(\d+)_(\w+)$")
    for name, value in env.items():
        if not name.startswith("KVTIER_") or name in _NOT_CONFIG:
            continue
        m = tier_re.match(name)
        if m:
            i = int(m.group(1))
            if i >= len(tiers):
                raise ConfigError(f"{name}: there is no tier #{i} (configured: {len(tiers)})")
            tiers[i][m.group(2).lower()] = value
            continue
        key = name.removeprefix("KVTIER_").lower()
        if key not in _STORE_KEYS:
            raise ConfigError(
                f"{name}: no store key {key!r}; KVTIER_<KEY> sets one of "
                f"{', '.join(sorted(_STORE_KEYS))}, KVTIER_TIER<i>_<KEY> a key of tier i"
            )
        s.values[key] = value
        s.origin[key] = name
