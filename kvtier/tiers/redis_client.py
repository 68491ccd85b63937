"""The redis-py side of the Redis tier: connection options and the connections under them.

``kvtier.tiers.redis`` decides what to store and what an error means; this module holds what it
takes to build its redis-py client:

- ``RedisOptions``: the connection settings of ``[[tiers]] kind = "redis"`` (``url`` or
  ``cluster``, credentials, TLS, timeouts), validated once -- a URL that is no Redis URL, a
  cluster node that is no ``host:port``, TLS on a unix socket are a ``ConfigError`` naming the
  value, with its password masked (``masked``). ``connect`` builds the client with redis-py's
  retries off.
- the zero-copy connection classes: commands are packed by the pure-Python RESP serializer, so a
  large value goes to the socket as a ``memoryview`` (hiredis' packer would copy it twice), and
  an error reply while a connection is set up is a ``ConnectionError`` (an outage, not a
  refused request).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import redis
import redis.cluster
from redis.backoff import NoBackoff
from redis.connection import (
    Connection,
    PythonRespSerializer,
    SSLConnection,
    UnixDomainSocketConnection,
    parse_url,
)
from redis.exceptions import ResponseError
from redis.retry import Retry

from kvtier.errors import ConfigError

_URL_SCHEMES = ("redis://", "rediss://", "unix://")


def masked(url: str) -> str:
    """``url`` for messages: everything up to its last ``@`` but a username is ``***``."""
    return re.sub(
        r"^([A-Za-z][A-Za-z0-9+.-]*://)?(.*)@",
        lambda m: (m[1] or "") + (m[2].split(":", 1)[0] + ":***" if ":" in m[2] else "***") + "@",
        url,
        flags=re.DOTALL,
    )


class _ZeroCopyMixin:
    """Pack commands with the pure-Python RESP serializer: large values go out as memoryviews.

    Also: an error reply while a connection is set up (``SELECT`` of a db the server does not
    have, ``HELLO``, a ``NOPERM`` for it) is a ``ConnectionError``: the server will not serve
    this client at all, which is an outage for the breaker, not one refused request.
    """

    _buffer_cutoff: int
    encoder: Any

    def _construct_command_packer(self, packer: Any) -> Any:
        return packer or PythonRespSerializer(self._buffer_cutoff, self.encoder.encode)

    def on_connect_check_health(self, check_health: bool = True) -> None:
        try:
            super().on_connect_check_health(check_health)  # type: ignore[misc]
        except ResponseError as exc:
            raise redis.ConnectionError(f"connection set-up refused: {exc}") from exc


class _ZeroCopyConnection(_ZeroCopyMixin, Connection):
    pass


class _ZeroCopySSLConnection(_ZeroCopyMixin, SSLConnection):
    pass


class _ZeroCopyUnixConnection(_ZeroCopyMixin, UnixDomainSocketConnection):
    pass


@dataclass(frozen=True, slots=True)
class RedisOptions:
    """Connection options, validated once (their meaning: ``kvtier.tiers.redis``'s docstring)."""

    url: str = "redis://127.0.0.1:6379/0"
    cluster: tuple[str, ...] = ()
    username: str | None = None
    password: str | None = field(default=None, repr=False)
    tls: bool = False
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    timeout: float = 1.0
    connect_timeout: float = 1.0

    def __post_init__(self) -> None:
        if self.timeout <= 0 or self.connect_timeout <= 0:
            raise ConfigError("redis tier: timeout and connect_timeout must be > 0 seconds")
        for node in self.cluster:
            host, _, port = node.rpartition(":")
            if not host or not port.isdigit() or not 0 < int(port) < 65536:
                raise ConfigError(f"redis tier: cluster node {node!r} is not 'host:port'")
        if not self.cluster:
            pool = self._pool()  # ConfigError if the URL is not a Redis URL
            try:  # builds a connection object, does not connect: rejects bad URL options now
                pool.make_connection()
            except (TypeError, ValueError, redis.RedisError) as exc:
                raise ConfigError(f"redis tier: url {masked(self.url)!r}: {exc}") from None

    def _common(self, tls: bool) -> dict[str, Any]:
        """Connection keyword arguments shared by a single server and Cluster nodes."""
        common: dict[str, Any] = {
            "socket_timeout": self.timeout,
            "socket_connect_timeout": self.connect_timeout,
        }
        if self.username is not None:
            common["username"] = self.username
        if self.password is not None:
            common["password"] = self.password
        if tls:
            common.update(
                ssl_ca_certs=self.tls_ca_file,
                ssl_certfile=self.tls_cert_file,
                ssl_keyfile=self.tls_key_file,
                ssl_cert_reqs="required" if self.tls_verify else "none",
                ssl_check_hostname=self.tls_verify,
            )
        return common

    def _pool(self) -> redis.ConnectionPool:
        """The single server's pool (connects lazily); ``ConfigError`` if ``url`` is not one."""
        url = self.url
        if not isinstance(url, str) or not url.startswith(_URL_SCHEMES):
            shown = masked(url) if isinstance(url, str) else url
            raise ConfigError(
                f"redis tier: url {shown!r} must start with redis://, rediss:// or unix://"
            )
        try:
            kw = parse_url(url)  # type: ignore[no-untyped-call]
        except ValueError as exc:
            raise ConfigError(f"redis tier: url {masked(url)!r}: {exc}") from None
        unix = kw.pop("connection_class", None) is UnixDomainSocketConnection
        tls = self.tls or url.startswith("rediss://")
        if unix and tls:
            raise ConfigError(f"redis tier: url {masked(url)!r} is a unix socket: tls is not used")
        conn_cls: type[Connection] | type[UnixDomainSocketConnection] = (
            _ZeroCopyUnixConnection
            if unix
            else _ZeroCopySSLConnection
            if tls
            else _ZeroCopyConnection
        )
        kw.update(self._common(tls))
        return redis.ConnectionPool(connection_class=conn_cls, retry=Retry(NoBackoff(), 0), **kw)

    def connect(self) -> redis.Redis | redis.cluster.RedisCluster:
        """A client (connects lazily or, for Cluster, now; raises redis-py's errors, or
        ``RedisClusterException``, if unreachable)."""
        if not self.cluster:
            return redis.Redis(connection_pool=self._pool())
        conn_cls = _ZeroCopySSLConnection if self.tls else _ZeroCopyConnection
        nodes = [
            redis.cluster.ClusterNode(h, int(p))  # type: ignore[no-untyped-call]
            for h, _, p in (n.rpartition(":") for n in self.cluster)
        ]
        # ``url`` makes redis-py build node pools from our kwargs (connection_class included)
        return redis.cluster.RedisCluster(
            url=f"redis://{self.cluster[0]}",
            startup_nodes=nodes,
            connection_class=conn_cls,
            retry=Retry(NoBackoff(), 0),
            **self._common(self.tls),
        )
