"""``ServiceConfig``: the ``[service]`` table of a kvtier TOML.

Example::

    [service]
    url = "unix:///run/kvtier/kvtier.sock"   # where `kvtier serve` listens, clients connect
    group = "kvtier"        # optional: the socket (and staging regions) are 0660 for this group
    staging = "64MiB"       # shared staging region per client session (bounds one transfer)
    lease_ttl = 10.0        # seconds: a silent client's pins and leases are released after it
    timeout = 5.0           # seconds: a client call waits at most this long, then is a miss
    threads = 4             # service threads running loads and stores
    data = "arena"          # or "staging": how clients move KV bytes (see below)

``data``: ``"arena"`` (the default) names the host tier's arena in shared memory and lets every
client map it, so a store or load costs one copy per direction, as in-process; any client can
then read every block in the arena. ``"staging"`` keeps each client to its own staging region
(the service copies between it and the arena: two copies per direction), for clients that must
not read each other's KV. The socket's permissions decide who is a client either way.

The rest of the file (``[store]``, ``[[tiers]]``) configures the store the service runs, and
``[[pools]]`` further stores of other KV layouts it serves too (``kvtier.service.pools``).
"""

from __future__ import annotations

import grp
import hashlib
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.config import check_keys, parse_float, parse_int, parse_size
from kvtier.errors import ConfigError
from kvtier.service.protocol import socket_path
from kvtier.tiers.shm import shm_dir

DEFAULT_URL = "unix:///run/kvtier/kvtier.sock"
_KEYS = {"url", "group", "staging", "lease_ttl", "timeout", "threads", "data"}
DATA_MODES = ("arena", "staging")


@dataclass(frozen=True, slots=True)
class ServiceConfig:
    """Validated ``[service]`` settings (sizes in bytes, times in seconds)."""

    url: str = DEFAULT_URL
    group: str = ""
    staging: int = 64 << 20
    lease_ttl: float = 10.0
    timeout: float = 5.0
    threads: int = 4
    data: str = "arena"
    token_area: int = 4 << 20  # bytes per session for token ids (1M tokens); longer: a frame

    def __post_init__(self) -> None:
        socket_path(self.url)  # validates the URL
        if self.data not in DATA_MODES:
            raise ConfigError(
                f"[service] data must be one of {', '.join(map(repr, DATA_MODES))}, got "
                f"{self.data!r}"
            )
        if self.lease_ttl <= self.timeout:
            raise ConfigError(
                f"[service] lease_ttl ({self.lease_ttl} s) must exceed timeout "
                f"({self.timeout} s): a client waiting on a call must not lose its leases"
            )

    @property
    def shm_prefix(self) -> str:
        """The path prefix of this socket's shared memory in ``/dev/shm`` (its arena and
        staging regions): a service that starts on the socket removes what a killed one
        left under it."""
        digest = hashlib.sha256(socket_path(self.url).encode()).hexdigest()[:16]
        return os.path.join(shm_dir(), f"kvtier-{digest}")

    @property
    def arena_path(self) -> str | None:
        """Where the shared host arena is named (``None`` in staging mode): one name per
        socket, so a service that was killed leaves at most one stale arena, which the next
        service on that socket replaces."""
        return None if self.data != "arena" else self.shm_prefix + "-arena"

    def arena_path_of(self, pool: int) -> str | None:
        """The shared arena name of pool ``pool`` (``kvtier.service.pools``): the default
        pool's is ``arena_path``, pool i's that with ``-<i>``, so each pool of a service has
        its own, still one per socket and pool (``SocketLock.claim`` removes those a killed
        service left)."""
        path = self.arena_path
        return path if path is None or pool == 0 else f"{path}-{pool}"

    def presence_path_of(self, pool: int) -> str:
        """Where pool ``pool``'s index presence map is named (``kvtier.service.presence``):
        one per socket and pool, as the arenas (each created anew, replacing a stale one)."""
        path = self.shm_prefix + "-presence"
        return path if pool == 0 else f"{path}-{pool}"

    @property
    def gid(self) -> int | None:
        """The socket group's id (``None`` for owner-only); ``ConfigError`` if unknown."""
        if not self.group:
            return None
        try:
            return grp.getgrnam(self.group).gr_gid
        except KeyError:
            raise ConfigError(f"[service] group {self.group!r} does not exist") from None

    @staticmethod
    def from_dict(raw: Mapping[str, Any], url: str | None = None) -> ServiceConfig:
        """The ``[service]`` table of a whole config mapping; ``url`` overrides its url."""
        table = raw.get("service", {})
        if not isinstance(table, Mapping):
            raise ConfigError(f"[service] must be a table, got {table!r}")
        check_keys("service", table, _KEYS)
        out = ServiceConfig(
            url=url or str(table.get("url", DEFAULT_URL)),
            group=str(table.get("group", "")),
            staging=parse_size(table.get("staging", "64MiB"), "[service] staging"),
            lease_ttl=parse_float(table.get("lease_ttl", 10.0), "[service] lease_ttl", 0.1),
            timeout=parse_float(table.get("timeout", 5.0), "[service] timeout", 0.01),
            threads=parse_int(table.get("threads", 4), "[service] threads", 1, 256),
            data=str(table.get("data", "arena")),
        )
        if out.staging < 1 << 16:
            raise ConfigError(f"[service] staging: at least 64KiB, got {out.staging} bytes")
        return out

    @staticmethod
    def from_file(path: str | Path, url: str | None = None) -> ServiceConfig:
        try:
            raw = tomllib.loads(Path(path).read_text())
        except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
        try:
            return ServiceConfig.from_dict(raw, url)
        except ConfigError as exc:
            raise ConfigError(f"config file {path}: {exc}") from None
