"""The node-local kvtier service: the ``TieredStore`` shared by every engine process on a node.

``kvtier serve --config kvtier.toml`` (``kvtier.service.server``) runs the store (one per KV
layout it serves: ``kvtier.service.pools``) behind a ZeroMQ ROUTER socket on a unix socket;
engines reach it with ``kvtier.service.client.connect(url)`` (or ``TieredStore.connect``),
which has the store's API. Control messages are msgpack frames;
KV bytes never cross the socket: clients copy them straight into and out of the service's host
arena in shared memory (``kvtier.service.direct``, ``kvtier.service.arena_io``), or through a
per-session staging region both sides map (``kvtier.service.staging``, ``staged``). The service
derives every key itself from the tokens, the identity the client registered and the per-call
scope (``kvtier.service.scoped``).

Modules: ``protocol`` (frames, errors), ``config`` (``[service]``), ``server`` (the socket
loop), ``sessions`` (what a client holds), ``pools`` (the stores it runs, one per KV layout
it serves), ``scoped`` and ``direct`` (what each store adds), ``connection`` (a client's
session and heartbeat), ``staged`` and ``arena_io`` (the client's transfers), ``client`` (the
public API).

Only these modules import ``zmq``; kvtier's core does not.
"""

from __future__ import annotations

from kvtier.service.client import ServiceClient, connect

__all__ = ["ServiceClient", "connect"]
