"""Block identity: everything that decides a block's bytes, in one typed value.

A cached block may be served only where its bytes are exactly what the engine would compute. A
chained key already stands for the block's tokens and everything before them; the *namespace
root* each chain starts from stands for everything else. It is derived here, and nowhere else,
from two values:

- ``Identity`` -- fixed for a store (one engine process, one rank): which weights, which
  parallel position, which engine page layout, which model configuration.
- ``Scope`` -- given per request: the tenant (or its share group), the LoRA adapter, the cache
  salt.

- ``model_id``, ``revision``: other weights compute other KV (the operator, or the engine).
- ``tp_rank``/``tp_size``, ``pp_rank``/``pp_size``: each rank holds other heads, each stage
  other layers (the engine integration).
- ``engine_tag``: page layout, engine block size, cache dtype, KV quantization scales (the
  engine integration).
- ``model_fingerprint``: architecture, RoPE parameters, dtype, attention implementation (the
  integration, from the model config).
- the layout fingerprint: shape and storage dtype of a block (``KVLayout``).
- ``Scope.tenant``: tenants never share blocks unless mapped into one share group; ``adapter``:
  a LoRA adapter changes K and V; ``salt``: a per-request cache salt (the request).

The README has this as a table.

The root is a BLAKE2b-256 digest of a length-prefixed encoding of all of these, keyed with the
deployment secret when one is configured. Every field is validated once, at construction; a
wrong type or an empty required field raises ``ConfigError`` naming it.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvtier.errors import ConfigError
from kvtier.layout import KVLayout

KEY_BYTES = 32
_SAFE_NAME = re.compile(r"^[^\x00-\x1f]{1,256}$")


def _text(value: object, what: str, *, required: bool = False) -> str:
    """A str field: ``ConfigError`` naming ``what`` for another type, or empty when required."""
    if not isinstance(value, str):
        raise ConfigError(f"{what}: expected a string, got {type(value).__name__} {value!r}")
    if required and not value:
        raise ConfigError(f"{what}: must not be empty")
    if value and not _SAFE_NAME.match(value):
        raise ConfigError(f"{what}: at most 256 printable characters, got {value!r}")
    return value


def _count(value: object, what: str, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise ConfigError(f"{what}: expected a whole number >= {lo}, got {value!r}")
    return value


@dataclass(frozen=True, slots=True)
class Identity:
    """What a store's blocks are the KV of: weights, parallel position, engine layout, model.

    ``model_id`` is required (name the weights, e.g. ``"meta-llama/Llama-3.1-8B"``);
    ``revision`` names their version (a commit, a checkpoint step). ``rank_agnostic`` may be set
    only when every tensor-parallel rank holds the same bytes (an MLA latent cache, replicated
    on every rank): it then drops ``tp_rank`` from the identity, never ``pp_rank`` (stages hold
    other layers).
    """

    model_id: str
    revision: str = ""
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    engine_tag: str = ""
    model_fingerprint: str = ""
    rank_agnostic: bool = False

    def __post_init__(self) -> None:
        _text(
            self.model_id, "model_id (name the weights, e.g. model_id = 'org/model')", required=True
        )
        _text(self.revision, "revision")
        _text(self.engine_tag, "engine_tag")
        _text(self.model_fingerprint, "model_fingerprint")
        tp = _count(self.tp_size, "tp_size", 1)
        pp = _count(self.pp_size, "pp_size", 1)
        if _count(self.tp_rank, "tp_rank", 0) >= tp:
            raise ConfigError(f"tp_rank: must be < tp_size ({tp}), got {self.tp_rank}")
        if _count(self.pp_rank, "pp_rank", 0) >= pp:
            raise ConfigError(f"pp_rank: must be < pp_size ({pp}), got {self.pp_rank}")
        if not isinstance(self.rank_agnostic, bool):
            raise ConfigError(f"rank_agnostic: expected true or false, got {self.rank_agnostic!r}")

    def fields(self) -> dict[str, str]:
        """The identity as it enters the namespace root (``tp_rank`` omitted when agnostic)."""
        out = {
            "model_id": self.model_id,
            "revision": self.revision,
            "tp": f"{'*' if self.rank_agnostic else self.tp_rank}/{self.tp_size}",
            "pp": f"{self.pp_rank}/{self.pp_size}",
            "engine_tag": self.engine_tag,
            "model_fingerprint": self.model_fingerprint,
        }
        return out

    def describe(self) -> dict[str, Any]:
        """A plain dict for ``stats()`` and logs."""
        return {
            "model_id": self.model_id,
            "revision": self.revision,
            "tp_rank": self.tp_rank,
            "tp_size": self.tp_size,
            "pp_rank": self.pp_rank,
            "pp_size": self.pp_size,
            "engine_tag": self.engine_tag,
            "model_fingerprint": self.model_fingerprint,
            "rank_agnostic": self.rank_agnostic,
        }


def check_tenant(value: object, what: str = "tenant") -> str:
    """A tenant name: a non-empty string. ``""``, ``0``, ``False``, ints... raise ``ConfigError``
    (an empty or falsy tenant must never silently mean the store's default tenant)."""
    return _text(value, what, required=True)


def check_share_groups(value: object, what: str = "share_groups") -> dict[str, str]:
    """``{tenant: group}``: tenants mapped to one group share blocks; others stay private."""
    if not isinstance(value, Mapping):
        raise ConfigError(f"{what}: expected a table {{tenant = 'group'}}, got {value!r}")
    try:
        return {
            check_tenant(t, f"{what} tenant"): _text(g, f"{what}.{t}", required=True)
            for t, g in value.items()
        }
    except ConfigError as exc:
        raise ConfigError(f"{exc} (in {value!r})") from None


@dataclass(frozen=True, slots=True)
class Scope:
    """The per-request part of a block's identity: tenant, LoRA adapter, cache salt.

    ``adapter`` is ``None`` for the base model (an adapter name or id otherwise); ``salt`` is
    ``None`` or a non-empty string/bytes (vLLM's ``cache_salt``).
    """

    tenant: str
    adapter: str | None = None
    salt: str | bytes | None = None

    def __post_init__(self) -> None:
        check_tenant(self.tenant)
        if self.adapter is not None:
            _text(self.adapter, "adapter", required=True)
        if self.salt is not None and (not isinstance(self.salt, str | bytes) or not self.salt):
            raise ConfigError(
                f"salt: expected a non-empty string or bytes (or None), got {self.salt!r}"
            )


def _encode(parts: Mapping[str, str | bytes]) -> bytes:
    """Unambiguous bytes of ``parts``: each name and value length-prefixed, in a fixed order."""
    out = bytearray(b"kvtier-ns-v2")
    for name, value in parts.items():
        raw = value if isinstance(value, bytes) else value.encode()
        for piece in (name.encode(), raw):
            out += len(piece).to_bytes(4, "little") + piece
    return bytes(out)


@dataclass(frozen=True, slots=True)
class Namespace:
    """The key space of one (identity, layout, owner, adapter, salt). ``root`` seeds every key
    chain in it; ``owner`` (the tenant or its share group) is what quotas and encryption keys
    are charged to; ``tenant`` is what statistics are counted under."""

    identity: Identity
    layout: KVLayout
    scope: Scope
    share_group: str | None = None
    secret: bytes = field(default=b"", repr=False)
    root: bytes = field(init=False, repr=False)

    def __post_init__(self) -> None:
        parts: dict[str, str | bytes] = dict(self.identity.fields())
        parts["owner"] = (
            f"group:{self.share_group}" if self.share_group else f"tenant:{self.scope.tenant}"
        )
        parts["adapter"] = self.scope.adapter or ""
        salt = self.scope.salt
        parts["salt"] = (
            b""
            if salt is None
            else (b"s" + salt.encode() if isinstance(salt, str) else b"b" + salt)
        )
        parts["layout"] = self.layout.fingerprint
        secret = self.secret  # BLAKE2b keys hold 64 bytes: a longer secret is hashed first
        if len(secret) > 64:
            secret = hashlib.blake2b(secret).digest()
        root = hashlib.blake2b(_encode(parts), digest_size=KEY_BYTES, key=secret).digest()
        object.__setattr__(self, "root", root)

    @property
    def tenant(self) -> str:
        return self.scope.tenant

    @property
    def owner(self) -> str:
        """The tenant (or share group) that quotas and encryption keys are charged to."""
        return self.share_group or self.scope.tenant


__all__ = ["Identity", "Namespace", "Scope", "check_share_groups", "check_tenant"]
