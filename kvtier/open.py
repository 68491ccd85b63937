"""``open_store(config)``: the store an engine uses, in-process or the node service, from config.

A config whose ``[service]`` table names a ``url`` means "use the node service there": the
engine gets a ``kvtier.service.client.ServiceClient`` (the ``service`` extra, pyzmq) with the
``[service] timeout``. Without one, it gets an in-process ``TieredStore`` built from
``[store]``/``[[tiers]]`` (the default). Both have the same API, so an integration calls this
and never asks which it got. ``kvtier serve`` reads the same file and serves its ``[store]``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.errors import ConfigError, LayoutError
from kvtier.identity import Identity
from kvtier.layout import KVLayout


def _raw(config: Mapping[str, Any] | str | Path) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    try:
        return tomllib.loads(Path(config).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {config} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {config}: {exc}") from None


def open_store(
    config: Mapping[str, Any] | str | Path,
    *,
    identity: Identity | None = None,
    layout: KVLayout | None = None,
    name: str = "",
) -> Any:
    """A ``TieredStore`` (no ``[service] url``) or a client of the service at that url.

    ``identity``/``layout`` are what the engine knows of itself: for a client they are
    registered with the service (``layout`` must match it, and lets the engine start while the
    service is down); in-process, ``identity`` replaces the config's. Returns ``Any``: both
    kinds have the store API."""
    raw = _raw(config)
    service = raw.get("service", {})
    if isinstance(service, Mapping) and service.get("url"):
        from kvtier.service.client import connect
        from kvtier.service.config import ServiceConfig

        cfg = ServiceConfig.from_dict(raw)
        return connect(cfg.url, identity, layout=layout, timeout=cfg.timeout, name=name)
    from kvtier.config import StoreConfig
    from kvtier.store import TieredStore

    if raw.get("pools"):
        raise ConfigError(
            "[[pools]] are further stores of a service (`kvtier serve`); an in-process store "
            "has one layout: drop [[pools]], or set [service] url to use the service"
        )
    store_cfg = StoreConfig.load(raw)
    if layout is not None and layout != store_cfg.layout:
        raise LayoutError(f"the config's layout {store_cfg.layout} is not the engine's {layout}")
    if identity is not None:
        from dataclasses import replace

        store_cfg = replace(store_cfg, identity=identity)
    return TieredStore.from_config(store_cfg)
