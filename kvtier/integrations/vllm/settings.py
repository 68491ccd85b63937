"""The connector's settings: vLLM's ``kv_connector_extra_config`` read and checked once.

``kv_connector_extra_config`` keys:

- ``kvtier_config``: a kvtier TOML path, or the same tables inline (``{"store": {...},
  "tiers": [...]}``). ``store``/``tiers`` given beside it override the file's.
- ``service``: a ``[service]`` table (``{"url": "unix:///run/kvtier/kvtier.sock"}``); its keys
  override the file's. A ``[service] url`` (here or in the file) means service mode: every rank
  uses the node service there (``kvtier serve``) instead of a store of its own
  (``service_backend``); ``[[tiers]]`` are then the service's business and are not opened.
- ``lookup_timeout_ms``: how long the scheduler waits for a rank's lookup answer (default 500);
  no answer in time is a miss (0 tokens), never a stall. In service mode it bounds each of the
  scheduler's calls to the service.
- ``async_save``: store saves on a background thread after their copy (default: on CUDA
  only; see ``worker``); ``save_queue_bytes``: the staging memory pending async saves may hold
  (default 1GiB; a save beyond it is dropped, a later miss).

The KV layout is vLLM's, not the config's: ``layers``, ``kv_heads``, ``head_dim``,
``kv_factor``, ``dtype`` and ``model`` (a preset) are refused with a ``ConfigError`` naming the
key -- except in service mode, where the file may be the one ``kvtier serve`` reads: layout keys
there describe the service's blocks and are checked against vLLM's (``check_service_layout``).
``model_id`` names the weights when given (otherwise vLLM's model path/name does).
``block_tokens`` must be a multiple of vLLM's ``block_size`` (default: the smallest multiple
of it that is at least kvtier's default block).
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvtier.config import StoreConfig, parse_int, parse_size
from kvtier.errors import ConfigError, LayoutError
from kvtier.layout import DEFAULT_BLOCK_TOKENS, KVLayout, canonical_dtype

if TYPE_CHECKING:
    from kvtier.service.config import ServiceConfig

DEFAULT_LOOKUP_TIMEOUT_MS = 500
_EXTRA_KEYS = frozenset(
    {
        "kvtier_config",
        "store",
        "tiers",
        "service",
        "lookup_timeout_ms",
        "async_save",
        "save_queue_bytes",
    }
)
DEFAULT_SAVE_QUEUE_BYTES = 1 << 30
_TABLES = frozenset({"store", "tiers", "service"})
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
    #: service mode: the node service every rank uses (``None``: a store per rank, in-process)
    service: ServiceConfig | None = None
    #: service mode: the layout keys the config's ``[store]`` gave (the service's layout)
    service_layout: Mapping[str, Any] = field(default_factory=dict)

    def use_async_save(self, cuda: bool) -> bool:
        """Whether saves are stored off the model runner's thread on this platform (the
        scheduler and the workers must agree: vLLM frees pages after async saves only when
        the workers report them)."""
        return cuda if self.async_save is None else self.async_save

    @property
    def tenant(self) -> str:
        """``[store] tenant`` ("": the store's default, or the service's)."""
        value = self.raw.get("store", {}).get("tenant", "")
        return value if isinstance(value, str) else ""

    def check_service_layout(self, layout: KVLayout) -> None:
        """Service mode: ``ConfigError`` if the config's ``[store]`` layout keys (the service's
        blocks, when the engine shares ``kvtier serve``'s file) do not describe vLLM's
        ``layout``; no keys, nothing to check (the service checks at connect)."""
        given = dict(self.service_layout)
        if not given:
            return
        want = {
            "layers": layout.layers,
            "kv_heads": layout.kv_heads,
            "head_dim": layout.head_dim,
            "kv_factor": layout.kv_factor,
            "dtype": layout.dtype,
        }
        try:
            if "dtype" in given:
                given["dtype"] = canonical_dtype(str(given["dtype"]))
        except LayoutError as exc:
            raise ConfigError(f"{self.source}: [store] dtype: {exc}") from None
        wrong = [
            f"{k} = {given[k]!r} (vLLM: {want[k]!r})"
            for k in want
            if k in given and given[k] != want[k]
        ]
        if "model" in given or wrong:
            lines = ", ".join(f"{k} = {v!r}" for k, v in want.items())
            raise ConfigError(
                f"{self.source}: the service's [store] layout does not match this vLLM "
                f"engine's pages ({'; '.join(wrong) or 'a model preset'}); the service needs "
                f"[store] {lines}, block_tokens = {self.block_tokens}"
            )

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
    if isinstance(raw, dict) and "pools" in raw:
        raise ConfigError(
            f"{source}: [[pools]] configure the service (`kvtier serve`); give the vLLM "
            "connector a config of its own: [service] url, and [store] model_id and "
            "block_tokens of the pool that serves its pages"
        )
    if not isinstance(raw, dict) or not set(raw) <= _TABLES:
        raise ConfigError(f"{source}: a kvtier config has [store], [[tiers]] and [service] only")
    for table in ("store", "service"):
        if table in extra:
            if not isinstance(extra[table], Mapping):
                raise ConfigError(f"kv_connector_extra_config: {table} must be a table")
            raw[table] = {**dict(raw.get(table, {})), **dict(extra[table])}
    if "tiers" in extra:
        raw["tiers"] = list(extra["tiers"])
    store = raw.setdefault("store", {})
    if not isinstance(store, dict):
        raise ConfigError(f"{source}: [store] must be a table, got {store!r}")
    service = _service(raw, source)
    layout_keys = {k: store.pop(k) for k in _LAYOUT_KEYS if service and k in store}
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
        raw,
        bt,
        engine_block_size,
        model_id,
        timeout / 1000.0,
        source,
        async_save=async_save,
        save_queue_bytes=queue_bytes,
        service=service,
        service_layout=layout_keys,
    )


def _service(raw: Mapping[str, Any], source: str) -> ServiceConfig | None:
    """The validated ``[service]`` table when it names a url (service mode), else ``None``."""
    table = raw.get("service", {})
    if not isinstance(table, Mapping):
        raise ConfigError(f"{source}: [service] must be a table, got {table!r}")
    if not table.get("url"):
        return None
    try:
        from kvtier.service.config import ServiceConfig
    except ImportError as exc:  # pragma: no cover - the service extra is missing
        raise ConfigError(
            f"{source}: [service] url needs the service extra: pip install 'kvtier[service]' "
            f"({exc})"
        ) from None
    try:
        return ServiceConfig.from_dict(raw)
    except ConfigError as exc:
        raise ConfigError(f"{source}: {exc}") from None
