"""The node-local kvtier service: one ``TieredStore`` shared by every engine process on a node.

``kvtier serve --config kvtier.toml`` (``kvtier.service.server``) runs the store behind a ZeroMQ
ROUTER socket on a unix socket; engines reach it with ``kvtier.service.client.connect(url)``
(or ``TieredStore.connect``), which has the store's API. Control messages are msgpack frames;
KV bytes never cross the socket: each client session gets a staging region in shared memory
(``kvtier.service.staging``) that both sides map. The service derives every key itself from the
tokens, the identity the client registered and the per-call scope (``kvtier.service.scoped``).

Only these modules import ``zmq``; kvtier's core does not.
"""

from __future__ import annotations

from kvtier.service.client import ServiceClient, connect

__all__ = ["ServiceClient", "connect"]
