"""Tier kinds by name, imported lazily so the core never pulls in a client it does not use.

Each entry names a ``module:Class``; the class provides
``from_config(layout: KVLayout, spec: dict[str, Any]) -> Tier`` which validates ``spec`` (the
``[[tiers]]`` table minus ``kind``) with ``kvtier.config.check_keys`` and raises ``ConfigError``
saying what to change.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping, Sequence
from typing import Any

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier

TIER_KINDS: dict[str, str] = {
    "host": "kvtier.tiers.host:HostTier",
    "device": "kvtier.tiers.device:DeviceTier",
    "mooncake": "kvtier.tiers.mooncake:MooncakeTier",
    "nvme": "kvtier.tiers.nvme:NVMeTier",
    "redis": "kvtier.tiers.redis:RedisTier",
    "s3": "kvtier.tiers.s3:S3Tier",
}


def make_tier(layout: KVLayout, spec: Mapping[str, Any], secret: bytes = b"") -> Tier:
    """Build a tier from one ``[[tiers]]`` table (``{"kind": "host", "capacity": "8GiB"}``).

    A shared tier whose table sets no ``secret`` of its own gets ``secret`` (the store's
    deployment secret) to authenticate its blocks with."""
    kind = str(spec.get("kind", ""))
    try:
        target = TIER_KINDS[kind]
    except KeyError:
        raise ConfigError(
            f"unknown tier kind {kind!r}; choose one of {', '.join(sorted(TIER_KINDS))}"
        ) from None
    module_name, cls_name = target.split(":")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ConfigError(
            f"tier kind {kind!r} needs an optional dependency that is not installed: {exc}"
        ) from None
    cls = getattr(module, cls_name)
    rest = {k: v for k, v in spec.items() if k != "kind"}
    if secret and getattr(cls, "shared", False) and "secret" not in rest:
        rest["secret"] = secret
    tier: Tier = cls.from_config(layout, rest)
    return tier


def make_tiers(
    layout: KVLayout, specs: Sequence[Mapping[str, Any]], secret: bytes = b""
) -> list[Tier]:
    """Build every tier of a config, in order; on a failure, close those already built."""
    tiers: list[Tier] = []
    try:
        for spec in specs:
            tiers.append(make_tier(layout, spec, secret))
    except BaseException:
        for t in tiers:
            t.close()
        raise
    return tiers
