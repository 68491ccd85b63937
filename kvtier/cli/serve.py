"""``kvtier serve --config kvtier.toml [--url unix:///path.sock]``: run the node-local service.

Builds the store of the config's ``[store]``/``[[tiers]]`` and one per ``[[pools]]`` table
(``kvtier.service.pools``: further KV layouts it serves), serves them on ``[service] url`` (or
``--url``) until SIGTERM/SIGINT, then closes the stores (volatile blocks are written down to
the persistent tier, so a restarted service finds them). See ``kvtier.service``.
"""

from __future__ import annotations

import argparse
import signal
import sys
import tomllib
from pathlib import Path

from kvtier.errors import ConfigError


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", required=True, help="kvtier TOML ([store], [[tiers]], [service])"
    )
    parser.add_argument("--url", default=None, help="unix:///path/kvtier.sock (overrides the TOML)")


def run(args: argparse.Namespace) -> int:
    from kvtier.service.config import ServiceConfig
    from kvtier.service.pools import Pools
    from kvtier.service.server import Service, SocketLock

    try:
        raw = tomllib.loads(Path(args.config).read_text())
    except (OSError, tomllib.TOMLDecodeError, UnicodeDecodeError) as exc:
        raise ConfigError(f"config file {args.config}: {exc}") from None
    cfg = ServiceConfig.from_dict(raw, args.url)
    lock = SocketLock.claim(cfg)  # before the stores: their shared arenas are named per socket
    try:
        try:
            pools = Pools.open(raw, cfg)
        except ConfigError as exc:
            raise ConfigError(f"config file {args.config}: {exc}") from None
    except BaseException:
        lock.release()
        raise
    service = Service(pools, cfg, lock)
    try:
        service.bind()  # a busy or foreign socket fails before anything is served
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: service.stop())
        served = ", ".join(f"{p.name} ({p.layout.toml_keys()})" for p in pools)
        print(f"kvtier serve: pools {served}", file=sys.stderr, flush=True)
        print(f"kvtier serve: serving {cfg.url}", file=sys.stderr, flush=True)
        service.serve()
    finally:
        try:
            pools.close()
        finally:
            lock.release()  # only now: a new service on the socket may create its arenas
    return 0
