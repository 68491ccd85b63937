"""``Pools``: the stores one ``kvtier serve`` runs, one per KV layout it serves.

A *pool* is a whole store of its own: its layout, default identity and tenant, its tiers and
their capacities, its host arena in shared memory (arena mode) and its NVMe directories. The
config's ``[store]`` + ``[[tiers]]`` are the default pool (index 0, named ``"default"``); each
``[[pools]]`` table adds one::

    [[pools]]
    name = "vllm"          # optional (default "pool<i>"): names the pool in stats and errors
    [pools.store]          # as [store]: model_id, layers, kv_heads, head_dim, dtype, ...
    model_id = "Qwen/Qwen3-0.6B"
    layers = 28
    kv_heads = 8
    head_dim = 256
    kv_factor = 1
    dtype = "bf16"
    block_tokens = 256
    [[pools.tiers]]        # as [[tiers]]; at least one
    kind = "host"
    capacity = "2GiB"

At ``hello`` a client is bound to the pool whose layout equals its own (``Pools.for_layout``;
a client that names no layout gets the default pool), and every call of its session runs on
that pool's store. Pools share the socket, the service threads and the process, nothing
else: capacity is per pool and never moves between them. ``KVTIER_*`` environment overrides
apply to the default pool only (they name ``[store]`` keys).

Refused with a ``ConfigError`` naming the pool: two pools of one layout (engines of one
layout share its pool; their identities keep their blocks apart), two pools sharing an NVMe
directory, a ``[[pools]]`` table without tiers, and ``metrics_port`` in a pool (the Prometheus
endpoint is one per process: set it in ``[store]``; a pool's tiers are labelled
``<pool>/<tier>`` there).
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.config import StoreConfig, check_keys
from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import KVLayout
from kvtier.service.config import ServiceConfig
from kvtier.service.scoped import ServiceStore

DEFAULT_POOL = "default"
_POOL_KEYS = {"name", "store", "tiers"}


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """One pool's validated store config; ``index`` 0 is the default pool."""

    index: int
    name: str
    store: StoreConfig

    @property
    def what(self) -> str:
        """How messages name the pool's table."""
        return "[store]" if self.index == 0 else f"[[pools]] #{self.index} ({self.name!r})"


def pool_configs(raw: Mapping[str, Any], env: Mapping[str, str] | None = None) -> list[PoolConfig]:
    """Every pool of a whole config mapping, the default first; ``ConfigError`` naming the
    pool for a bad one (see the module docstring)."""
    out = [PoolConfig(0, DEFAULT_POOL, StoreConfig.from_dict(raw, env))]
    tables = raw.get("pools", [])
    if not isinstance(tables, list | tuple) or not all(isinstance(t, Mapping) for t in tables):
        raise ConfigError(
            "pools must be an array of tables ([[pools]] followed by [pools.store] and "
            f"[[pools.tiers]]), got {tables!r}"
        )
    for i, table in enumerate(tables, 1):
        name = table.get("name", f"pool{i}")
        if not isinstance(name, str) or not name:
            raise ConfigError(f"[[pools]] #{i} name: expected a non-empty string, got {name!r}")
        what = f"[[pools]] #{i} ({name!r})"
        check_keys(f"pools #{i} ({name})", table, _POOL_KEYS)
        store = table.get("store")
        if not isinstance(store, Mapping):
            raise ConfigError(
                f"{what} needs a [pools.store] table after it, with the keys of [store] "
                "(model_id, layers, kv_heads, head_dim, dtype, kv_factor, block_tokens)"
            )
        if not table.get("tiers"):
            raise ConfigError(
                f'{what} has no tiers: add a [[pools.tiers]] table after it (kind = "host", '
                'capacity = "1GiB"); a pool\'s capacity is its own'
            )
        if "metrics_port" in store:
            raise ConfigError(
                f"{what}: metrics_port is one per service (one Prometheus endpoint per "
                "process): set it in [store] and drop it here"
            )
        try:
            cfg = StoreConfig.from_dict({"store": store, "tiers": table["tiers"]}, env={})
        except ConfigError as exc:
            text = str(exc).replace("[store]", "[pools.store]").replace("[[tiers]]", "tiers")
            raise ConfigError(f"{what}: {text}") from None
        out.append(PoolConfig(i, name, cfg))
    _check_distinct(out)
    return out


def _nvme_dirs(cfg: StoreConfig) -> list[str]:
    dirs: list[str] = []
    for spec in cfg.tiers:
        if spec.get("kind") == "nvme":
            paths = spec.get("paths", [])
            for p in [paths] if isinstance(paths, str | os.PathLike) else paths:
                dirs.append(os.path.realpath(str(p)))
    return dirs


def _check_distinct(pools: Sequence[PoolConfig]) -> None:
    """Names, layouts and NVMe directories differ between pools (else ``ConfigError``)."""
    seen_dirs: list[tuple[str, PoolConfig]] = []
    for j, b in enumerate(pools):
        for a in pools[:j]:
            if a.name == b.name:
                raise ConfigError(f"{b.what}: pool {a.what} has that name too; rename one")
            if a.store.layout == b.store.layout:
                raise ConfigError(
                    f"{b.what} has the layout of {a.what} ({b.store.layout.toml_keys()}): a "
                    "client could not be told which is its pool. Engines of one layout share "
                    "one pool (their identities keep their blocks apart): remove one of them"
                )
        for d in _nvme_dirs(b.store):
            for other, a in seen_dirs:
                if a is not b and (d == other or d.startswith(other + os.sep)
                                   or other.startswith(d + os.sep)):  # fmt: skip
                    raise ConfigError(
                        f"{b.what}: its NVMe directory {d} is also {a.what}'s ({other}); give "
                        "each pool an NVMe directory of its own"
                    )
            seen_dirs.append((d, b))


@dataclass(frozen=True, slots=True)
class Pool:
    """One served layout: its name, index and store."""

    index: int
    name: str
    store: ServiceStore

    @property
    def layout(self) -> KVLayout:
        return self.store.layout


class Pools:
    """The pools of a service (immutable once built; each store is thread-safe)."""

    def __init__(self, pools: Sequence[Pool]) -> None:
        assert pools, "a service serves at least its default pool"
        self._pools = tuple(pools)
        self._by_layout = {p.layout: p for p in self._pools}
        assert len(self._by_layout) == len(self._pools), "one pool per layout"

    @classmethod
    def open(
        cls,
        raw: Mapping[str, Any],
        service: ServiceConfig,
        env: Mapping[str, str] | None = None,
    ) -> Pools:
        """Validate every pool of ``raw`` (before any is built), then build their stores, each
        with its own arena (``service.arena_path_of``). A failure closes what was built."""
        configs = pool_configs(raw, env)
        pools: list[Pool] = []
        try:
            for pc in configs:
                store = ServiceStore.for_service(
                    pc.store,
                    service.arena_path_of(pc.index),
                    service.gid,
                    label="" if pc.index == 0 else pc.name,
                    presence_path=service.presence_path_of(pc.index),
                )
                pools.append(Pool(pc.index, pc.name, store))
        except BaseException:
            for p in pools:
                p.store.close()
            raise
        return cls(pools)

    @property
    def default(self) -> Pool:
        return self._pools[0]

    def __iter__(self) -> Iterator[Pool]:
        return iter(self._pools)

    def __len__(self) -> int:
        return len(self._pools)

    def for_layout(self, layout: KVLayout | None) -> Pool:
        """The pool of ``layout`` (``None``: the default pool); ``LayoutError`` listing the
        layouts served and the config lines to add when no pool serves it."""
        if layout is None:
            return self.default
        pool = self._by_layout.get(layout)
        if pool is None:
            served = "; ".join(f"pool {p.name!r}: {p.layout.toml_keys()}" for p in self)
            raise LayoutError(
                f"this kvtier service serves no pool of the layout {layout.toml_keys()} (it "
                f"serves {served}); add to its config a [[pools]] table with [pools.store] "
                f'model_id = "...", {layout.toml_keys()} and a [[pools.tiers]] table (kind = '
                '"host", capacity = "..."), then restart it'
            )
        return pool

    def stats(self) -> dict[str, Any]:
        """Every pool's ``stats()`` by name, with its index and layout."""
        return {
            p.name: {"index": p.index, "layout": asdict(p.layout), **p.store.stats()} for p in self
        }

    def close(self) -> None:
        """Close every pool's store (each writes its volatile blocks down first)."""
        errors: list[BaseException] = []
        for p in self._pools:
            try:
                p.store.close()
            except Exception as exc:  # close the others anyway, then say what failed
                errors.append(exc)
        if errors:
            raise errors[0]
