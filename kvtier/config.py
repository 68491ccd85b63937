"""Configuration: one TOML file (or dict) plus ``KVTIER_*`` environment overrides, validated once.

Example (``kvtier.toml``)::

    [store]
    model = "Llama-3.1-8B"      # a preset, or give layers/kv_heads/head_dim/kv_factor
    dtype = "bf16"
    block_tokens = 256
    tenant = "default"
    policy = "lru"
    workers = 2
    metrics_port = 0            # >0 serves Prometheus metrics on 127.0.0.1:<port>

    [[tiers]]
    kind = "host"
    capacity = "8GiB"

    [[tiers]]
    kind = "nvme"
    capacity = "200GiB"
    paths = ["/mnt/nvme0/kvtier"]

Environment overrides: ``KVTIER_<KEY>`` sets ``store.<key>`` (``KVTIER_POLICY=lru``), and
``KVTIER_TIER<i>_<KEY>`` sets a key of the i-th tier (``KVTIER_TIER0_CAPACITY=4GiB``).
Unknown keys and impossible values raise ``ConfigError`` saying what to change.
"""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError
from kvtier.layout import DEFAULT_BLOCK_TOKENS, KVLayout, canonical_dtype, preset

_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "m": 10**6,
    "mb": 10**6,
    "g": 10**9,
    "gb": 10**9,
    "t": 10**12,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
}
_SIZE_RE = re.compile(r"^\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*$")


def parse_size(value: str | int | float, what: str = "size") -> int:
    """``"8GiB"`` -> 8589934592, ``"80GB"`` -> 8e10, ``4096`` -> 4096. Raises ``ConfigError``."""
    if isinstance(value, bool):
        raise ConfigError(f"{what}: expected a size like '8GiB', got {value!r}")
    if isinstance(value, int | float):
        n = int(value)
    else:
        m = _SIZE_RE.match(str(value))
        if not m or m.group(2).lower() not in _UNITS:
            raise ConfigError(
                f"{what}: cannot read size {value!r}; write e.g. 4096, '512MiB', '8GiB', '2TB'"
            )
        n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n < 0:
        raise ConfigError(f"{what}: size must not be negative, got {value!r}")
    return n


def check_keys(section: str, given: Mapping[str, Any], allowed: set[str]) -> None:
    """Raise ``ConfigError`` naming unknown keys and listing the allowed ones."""
    unknown = sorted(set(given) - allowed)
    if unknown:
        raise ConfigError(
            f"[{section}] unknown key(s) {', '.join(unknown)}; "
            f"allowed: {', '.join(sorted(allowed))}"
        )


_STORE_KEYS = {
    "model",
    "layers",
    "kv_heads",
    "head_dim",
    "kv_factor",
    "dtype",
    "block_tokens",
    "tenant",
    "model_id",
    "weights_version",
    "share_group",
    "secret",
    "policy",
    "workers",
    "metrics_port",
    "demote_queue",
}


@dataclass(frozen=True, slots=True)
class StoreConfig:
    """Validated store configuration. ``tiers`` are raw per-tier tables, validated by each kind."""

    layout: KVLayout
    tenant: str = "default"
    model_id: str = ""
    weights_version: str = ""
    share_group: str | None = None
    secret: bytes = field(default=b"", repr=False)
    policy: str = "lru"
    workers: int = 2
    metrics_port: int = 0
    demote_queue: int = 64
    tiers: tuple[Mapping[str, Any], ...] = ()

    @staticmethod
    def from_dict(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> StoreConfig:
        """Validate a config mapping (``{"store": {...}, "tiers": [...]}``) with env overrides."""
        check_keys("top level", raw, {"store", "tiers"})
        store = dict(raw.get("store", {}))
        tiers = [dict(t) for t in raw.get("tiers", [])]
        _apply_env(store, tiers, os.environ if env is None else env)
        check_keys("store", store, _STORE_KEYS)
        layout = _layout_from(store)
        workers = int(store.get("workers", 2))
        if workers < 1:
            raise ConfigError(f"[store] workers must be >= 1, got {workers}")
        demote_queue = int(store.get("demote_queue", 64))
        if demote_queue < 1:
            raise ConfigError(f"[store] demote_queue must be >= 1, got {demote_queue}")
        if not tiers:
            tiers = [{"kind": "host", "capacity": "1GiB"}]
        for i, t in enumerate(tiers):
            if "kind" not in t:
                raise ConfigError(f"[[tiers]] #{i} has no 'kind' (e.g. kind = \"host\")")
        secret = store.get("secret", "")
        return StoreConfig(
            layout=layout,
            tenant=str(store.get("tenant", "default")),
            model_id=str(store.get("model_id", store.get("model", ""))),
            weights_version=str(store.get("weights_version", "")),
            share_group=store.get("share_group"),
            secret=secret.encode() if isinstance(secret, str) else bytes(secret),
            policy=str(store.get("policy", "lru")),
            workers=workers,
            metrics_port=int(store.get("metrics_port", 0)),
            demote_queue=demote_queue,
            tiers=tuple(tiers),
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
        try:
            raw = tomllib.loads(Path(path).read_text())
        except FileNotFoundError:
            raise ConfigError(f"config file {path} does not exist") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from None
        return StoreConfig.from_dict(raw, env)


def _layout_from(store: Mapping[str, Any]) -> KVLayout:
    dtype = canonical_dtype(str(store.get("dtype", "float16")))
    block_tokens = int(store.get("block_tokens", DEFAULT_BLOCK_TOKENS))
    if "model" in store and not any(k in store for k in ("layers", "kv_heads", "head_dim")):
        return preset(str(store["model"])).layout(dtype, block_tokens)
    missing = [k for k in ("layers", "kv_heads", "head_dim") if k not in store]
    if missing:
        raise ConfigError(
            f'[store] give a model preset (model = "Llama-3.1-8B") or all of layers, kv_heads, '
            f"head_dim; missing {', '.join(missing)}"
        )
    return KVLayout(
        int(store["layers"]),
        int(store["kv_heads"]),
        int(store["head_dim"]),
        dtype,
        int(store.get("kv_factor", 2)),
        block_tokens,
    )


def _apply_env(store: dict[str, Any], tiers: list[dict[str, Any]], env: Mapping[str, str]) -> None:
    tier_re = re.compile(r"^KVTIER_TIER(\d+)_(\w+)$")
    for name, value in env.items():
        if not name.startswith("KVTIER_"):
            continue
        m = tier_re.match(name)
        if m:
            i = int(m.group(1))
            if i >= len(tiers):
                raise ConfigError(f"{name}: there is no tier #{i} (configured: {len(tiers)})")
            tiers[i][m.group(2).lower()] = value
        else:
            key = name.removeprefix("KVTIER_").lower()
            if key in _STORE_KEYS:
                store[key] = value
