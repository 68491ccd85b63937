"""The connector's settings: vLLM's ``kv_connector_extra_config`` read and checked once.

``kv_connector_extra_config`` keys:

- ``kvtier_config``: a kvtier TOML path, or the same tables inline (``{"store": {...},
  "tiers": [...]}``). ``store``/``tiers`` given beside it override the file's.
- ``lookup_timeout_ms``: how long the scheduler waits for a rank's lookup answer (default 500);
  no answer in time is a miss (0 tokens), never a stall.
- ``async_save``: store saves on a background thread after their copy (default: on CUDA
  only; see ``worker``); ``save_queue_bytes``: the staging memory pending async saves may hold
  (default 1GiB; a save beyond it is dropped, a later miss).

The KV layout is vLLM's, not the config's: ``layers``, ``kv_heads``, ``head_dim``,
``kv_factor``, ``dtype`` and ``model`` (a preset) are refused with a ``ConfigError`` naming the
key. ``model_id`` names the weights when given (otherwise vLLM's model path/name does).
``block_tokens`` must be a multiple of vLLM's ``block_size`` (default: the smallest multiple
of it that is at least kvtier's default block).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from kvtier.config import StoreConfig, parse_int, parse_size
from kvtier.errors import ConfigError
from kvtier.layout import DEFAULT_BLOCK_TOKENS, KVLayout

DEFAULT_LOOKUP_TIMEOUT_MS = 500
_EXTRA_KEYS = frozenset(
    {"kvtier_config", "store", "tiers", "lookup_timeout_ms", "async_save", "save_queue_bytes"}
)
DEFAULT_SAVE_QUEUE_BYTES = 1 << 30
_LAYOUT_KEYS = ("layers", "kv_heads", "head_dim", "kv_factor", "dtype", "model")


@dataclass(frozen=True, slots=True)
class ConnectorSettings:
    """The validated settings (a value; safe to share). ``raw`` is the kvtier config with the
    layout keys still missing (``store_config`` adds them)."""

    raw: Mapping[str, Any] = field(repr=False)
    block_tokens: int
    engine_block_size: int
    model_id: str
    lookup_timeout_s: float
    source: str
    async_save: bool | None = None  # None: on CUDA only
    save_queue_bytes: int = DEFAULT_SAVE_QUEUE_BYTES

    def use_async_save(self, cuda: bool) -> bool:
        """Whether saves are stored off the model runner's thread on this platform (the
        scheduler and the workers must agree: vLLM frees pages after async saves only when
        the workers report them)."""
        return cuda if self.async_save is None else self.async_save

    def store_config(self, layout: KVLayout, model_id: str, revision: str = "") -> StoreConfig:
        """The ``StoreConfig`` for ``layout`` (vLLM's) and the weights' name; ``ConfigError``
        if a tier cannot hold one block of it."""
        store = dict(self.raw.get("store", {}))
        store.update(
            model_id=model_id,
            revision=store.get("revision", revision),
            layers=layout.layers,
            kv_heads=layout.kv_heads,
            head_dim=layout.head_dim,
            kv_factor=layout.kv_factor,
            dtype=layout.dtype,
            block_tokens=self.block_tokens,
        )
        try:
            cfg = StoreConfig.from_dict({"store": store, "tiers": list(self.raw.get("tiers", []))})
        except ConfigError as exc:
            raise ConfigError(f"{self.source}: {exc}") from None
        for i, tier in enumerate(cfg.tiers):
            if "capacity" not in tier:
                continue
            cap = parse_size(tier["capacity"], f"[[tiers]] #{i} capacity")
            if 0 < cap < cfg.layout.block_bytes:
                raise ConfigError(
                    f"{self.source}: [[tiers]] #{i} ({tier.get('kind')}) capacity "
                    f"{tier['capacity']!r} is smaller than one kvtier block of this model "
                    f"({cfg.layout.block_bytes} bytes = {self.block_tokens} tokens); raise "
                    "capacity or lower block_tokens"
                )
        return cfg


def _read_file(path: str | Path) -> dict[str, Any]:
    try:
        return tomllib.loads(Path(path).read_bytes().decode())
    except FileNotFoundError:
        raise ConfigError(f"kvtier_config: file {path} does not exist") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"kvtier_config: cannot read {path}: {exc}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"kvtier_config: {path} is not valid TOML: {exc}") from None


def parse_settings(extra: Mapping[str, Any] | None, engine_block_size: int) -> ConnectorSettings:
    """Read ``kv_connector_extra_config``; ``ConfigError`` naming the setting on bad input."""
    extra = dict(extra or {})
    unknown = sorted(
        k
        for k in extra
        if k.startswith(("kvtier", "lookup", "async", "save")) and k not in _EXTRA_KEYS
    )
    if unknown:
        raise ConfigError(
            f"kv_connector_extra_config: unknown key(s) {', '.join(unknown)}; "
            f"kvtier reads {', '.join(sorted(_EXTRA_KEYS))}"
        )
    given = extra.get("kvtier_config")
    source = "kv_connector_extra_config"
    if given is None:
        raw: dict[str, Any] = {}
    elif isinstance(given, str | Path):
        raw, source = _read_file(given), f"kvtier_config {given}"
    elif isinstance(given, Mapping):
        raw = {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in given.items()}
    else:
        raise ConfigError(
            f"kvtier_config: expected a TOML path or a table of store/tiers, got "
            f"{type(given).__name__}"
        )
    if not isinstance(raw, dict) or not set(raw) <= {"store", "tiers"}:
        raise ConfigError(f"{source}: a kvtier config has [store] and [[tiers]] only")
    if "store" in extra:
        raw["store"] = {**dict(raw.get("store", {})), **dict(extra["store"])}
    if "tiers" in extra:
        raw["tiers"] = list(extra["tiers"])
    store = raw.setdefault("store", {})
    if not isinstance(store, dict):
        raise ConfigError(f"{source}: [store] must be a table, got {store!r}")
    for key in _LAYOUT_KEYS:
        if key in store:
            hint = "; name the weights with model_id" if key == "model" else ""
            raise ConfigError(
                f"{source}: [store] {key} is set by vLLM's model and cache config under the vLLM "
                f"connector; remove it{hint}"
            )
    if engine_block_size <= 0:
        raise ConfigError(f"vLLM block_size must be positive, got {engine_block_size}")
    if "block_tokens" in store:
        bt = parse_int(store["block_tokens"], f"{source}: [store] block_tokens", 1)
        if bt % engine_block_size:
            raise ConfigError(
                f"{source}: [store] block_tokens = {bt} is not a multiple of vLLM's block_size "
                f"{engine_block_size}; set block_tokens to a multiple of {engine_block_size} "
                f"(e.g. {engine_block_size * max(1, round(bt / engine_block_size))})"
            )
    else:
        bt = -(-DEFAULT_BLOCK_TOKENS // engine_block_size) * engine_block_size
    model_id = store.get("model_id", "")
    if not isinstance(model_id, str):
        raise ConfigError(f"{source}: [store] model_id must be a string, got {model_id!r}")
    timeout = parse_int(
        extra.get("lookup_timeout_ms", DEFAULT_LOOKUP_TIMEOUT_MS), "lookup_timeout_ms", 1, 600_000
    )
    async_save = extra.get("async_save")
    if async_save == "auto":
        async_save = None
    if async_save is not None and not isinstance(async_save, bool):
        raise ConfigError(f'async_save must be true, false or "auto", got {async_save!r}')
    queue_bytes = parse_size(
        extra.get("save_queue_bytes", DEFAULT_SAVE_QUEUE_BYTES), "save_queue_bytes"
    )
    if queue_bytes <= 0:
        raise ConfigError(f"save_queue_bytes must be positive, got {queue_bytes}")
    return ConnectorSettings(
        raw, bt, engine_block_size, model_id, timeout / 1000.0, source, async_save, queue_bytes
    )
