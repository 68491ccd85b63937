"""``open_model_store``: the store a transformers model uses, from a kvtier config.

The config is kvtier's usual TOML (or dict). With a ``[service] url`` the model gets a client of
the node service there (``kvtier serve``), registered under the model's identity; without one,
an in-process ``TieredStore`` over the config's ``[[tiers]]`` (``kvtier.open.open_store``
decides). Either way ``hf.generate_with_cache(model, store, ...)`` serves it the same.

The model supplies what the config need not repeat: the layout (layers, KV heads, head_dim,
dtype; ``[store]`` layout keys, when given, must agree) and its configuration's fingerprint.
``model_id`` (and ``revision``) name the weights: the argument, else ``[store] model_id``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from kvtier.config import parse_int
from kvtier.errors import ConfigError, LayoutError
from kvtier.integrations import hf_cache
from kvtier.layout import DEFAULT_BLOCK_TOKENS
from kvtier.open import open_store

_LAYOUT_KEYS = ("model", "layers", "kv_heads", "head_dim", "kv_factor", "dtype")


def _read(config: Mapping[str, Any] | str | Path) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return {k: (dict(v) if isinstance(v, Mapping) else v) for k, v in config.items()}
    try:
        return tomllib.loads(Path(config).read_text())
    except FileNotFoundError:
        raise ConfigError(f"config file {config} does not exist") from None
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {config}: {exc}") from None


def open_model_store(
    model: Any,
    config: Mapping[str, Any] | str | Path,
    *,
    model_id: str = "",
    revision: str = "",
    name: str = "hf",
) -> Any:
    """A store for ``model`` from ``config``: a service client or a ``TieredStore``.

    ``block_tokens`` comes from ``[store]`` (kvtier's default otherwise). Does not modify
    ``config``. ``ConfigError`` for a config without a model id or one whose ``[store]``
    layout is not the model's (naming the keys to set); a service that is down is not an
    error (the client serves misses until it answers). The caller closes the store."""
    raw = _read(config)
    store = raw.get("store", {})
    if not isinstance(store, Mapping):
        raise ConfigError(f"[store] must be a table, got {store!r}")
    bt = parse_int(store.get("block_tokens", DEFAULT_BLOCK_TOKENS), "[store] block_tokens", 1)
    name_id = model_id or store.get("model_id", "")
    if not isinstance(name_id, str) or not name_id:
        raise ConfigError(
            "open_model_store needs the weights' name: pass model_id= or set [store] model_id"
        )
    layout = hf_cache.model_layout(model, bt)
    identity = hf_cache.model_identity(
        model, name_id, revision or str(store.get("revision", "") or "")
    )
    store = raw["store"] = {**store, "model_id": name_id}
    if not any(k in store for k in _LAYOUT_KEYS):  # the model says what the config need not
        raw["store"] = {
            **store,
            "layers": layout.layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "kv_factor": layout.kv_factor,
            "dtype": layout.dtype,
        }
    try:
        return open_store(raw, identity=identity, layout=layout, name=name)
    except LayoutError as exc:
        raise ConfigError(
            f"{exc}. This model's KV needs [store] {layout.toml_keys()} (in the service's config "
            "when [service] url is set: its [store], or [pools.store] of a [[pools]] table)"
        ) from None
