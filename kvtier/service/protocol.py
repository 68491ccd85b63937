"""The wire protocol between ``kvtier serve`` and its clients: socket URLs, message frames, errors.

A request is a ZeroMQ multipart message ``[header, tokens?]``: ``header`` is a msgpack map with
``op`` (the operation), ``id`` (a client-chosen request number echoed in the reply, so a late
reply to an abandoned call is recognised and dropped) and ``sid`` (the session, from ``hello``);
``tokens``, when the call has any, is the canonical little-endian uint32 bytes of the token ids
(``TokenIds.chunk``): a frame of its own when large, the header's ``tokens`` field when small
(one frame is cheaper than two). A reply is one msgpack map with the same ``id`` and either the
result fields or ``error``/``message``. KV bytes never travel here: they are in the service's shared
host arena, named by slot (``kvtier.service.direct``), or in the session's staging region
(``kvtier.service.staging``), named by offset and token count.

``VERSION`` changes whenever a message changes meaning; ``hello`` refuses another version.
"""

from __future__ import annotations

from typing import Any

import msgpack

from kvtier import errors
from kvtier.errors import ConfigError, KVTierError

VERSION = 1
_IPC_PATH_MAX = 107  # sun_path holds 108 bytes with the terminating NUL


def socket_path(url: str) -> str:
    """The filesystem path of a ``unix:///abs/path.sock`` URL (``ipc://`` is accepted too).

    Raises ``ConfigError`` for another scheme, a relative path or one too long for a unix
    socket address."""
    if not isinstance(url, str):
        raise ConfigError(f"service url: expected a string, got {url!r}")
    for scheme in ("unix://", "ipc://"):
        if url.startswith(scheme):
            path = url[len(scheme) :]
            break
    else:
        raise ConfigError(
            f"service url {url!r}: expected unix:///absolute/path/kvtier.sock (a local socket)"
        )
    if not path.startswith("/"):
        raise ConfigError(f"service url {url!r}: the socket path must be absolute")
    if len(path.encode()) > _IPC_PATH_MAX:
        raise ConfigError(
            f"service url {url!r}: the socket path is {len(path.encode())} bytes, a unix socket "
            f"address holds at most {_IPC_PATH_MAX}; choose a shorter path"
        )
    return path


def endpoint(url: str) -> str:
    """The ZeroMQ endpoint (``ipc://...``) of a service URL."""
    return "ipc://" + socket_path(url)


def _plain(value: Any) -> Any:
    """A msgpack-able stand-in for a value msgpack does not know (numpy scalars, sets...)."""
    if hasattr(value, "item"):
        return value.item()
    if isinstance(value, set | frozenset):
        return sorted(value, key=str)
    return str(value)


def pack(message: dict[str, Any]) -> bytes:
    """One msgpack frame of ``message`` (str keys; bytes values stay bytes)."""
    out: bytes = msgpack.packb(message, use_bin_type=True, default=_plain)
    return out


def unpack(frame: bytes) -> dict[str, Any]:
    """The map in a msgpack frame; ``ValueError`` if the frame is not one."""
    try:
        value = msgpack.unpackb(frame, raw=False)
    except Exception as exc:  # msgpack raises several types for malformed input
        raise ValueError(f"not a msgpack frame: {exc}") from None
    if not isinstance(value, dict):
        raise ValueError(f"expected a msgpack map, got {type(value).__name__}")
    return value


# The exceptions that cross the socket: the caller's mistakes, raised on the client as the
# same named class. Anything else on the service side is a fault and reaches the client as a
# miss.
_ERRORS: dict[str, type[KVTierError]] = {
    cls.__name__: cls
    for cls in (errors.ConfigError, errors.LayoutError, errors.TokenError, errors.KVTierError)
}


def error_reply(req_id: int, exc: BaseException) -> dict[str, Any]:
    """The reply that re-raises ``exc`` on the client (a ``KVTierError``) or is a fault."""
    name = type(exc).__name__ if isinstance(exc, KVTierError) else "fault"
    if isinstance(exc, KVTierError) and name not in _ERRORS:
        name = next(c.__name__ for c in type(exc).__mro__ if c.__name__ in _ERRORS)
    return {"id": req_id, "error": name, "message": str(exc)}


def raise_error(reply: dict[str, Any]) -> None:
    """Raise the client-side exception of an error reply of a caller mistake."""
    cls = _ERRORS.get(str(reply.get("error")))
    if cls is not None:
        raise cls(str(reply.get("message", "")))
