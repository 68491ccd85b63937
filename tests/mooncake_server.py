"""A real Mooncake Store for the tests: ``mooncake_master`` plus a pool-memory holder, on 127.0.0.1.

Mooncake Store has two server-side parts, both shipped in the PyPI wheel
(``mooncake-transfer-engine-non-cuda``, binaries inside the ``mooncake`` package directory):

- ``mooncake_master`` keeps the object metadata (which key lives in which segment) and runs
  eviction. It is started with ``--rpc_address=127.0.0.1`` and free ports for RPC and metrics.
  No metadata server is needed: clients use ``P2PHANDSHAKE`` (transfer endpoints are exchanged
  peer to peer), so the master's HTTP metadata server (which would bind 0.0.0.0) stays off.
- the pool memory itself is *mounted by clients* (``global_segment_size``). ``mooncake_client``
  (the standalone "real client" service) mounts ``pool_bytes`` and holds it while the tests run,
  so a tier under test contributes no memory of its own and still reads and writes the pool --
  the topology of a remote memory pool.

Registered as a pytest plugin (``tests/conftest.py``): the session fixture ``mooncake_cluster``
is available to every test module. Both processes are ``ServerProcess``es (``tests/servers.py``):
stopped by PID, logs kept in a temp dir. If the binaries cannot run here (no ``libibverbs1``,
package missing) the fixture skips with the reason the binary gave.

Note: the Mooncake transfer engine of every participant (the holder and each tier's client)
listens on a TCP port it picks itself, on all interfaces; the master's RPC and metrics ports are
bound to 127.0.0.1.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from kvtier.tiers.mooncake import package_binary
from tests.servers import ServerProcess, free_port

MIB = 1 << 20


class MooncakeCluster:
    """One ``mooncake_master`` on 127.0.0.1, and a ``mooncake_client`` holding ``pool_bytes``.

    ``pool_bytes`` 0 starts no holder (the tiers under test then mount the pool memory
    themselves). ``restart_master()`` crashes the master and starts a fresh one on the same port:
    without HA every key is lost; clients re-mount their segments on their own.
    """

    def __init__(self, pool_bytes: int = 0) -> None:
        master_bin = package_binary("mooncake_master")
        client_bin = package_binary("mooncake_client")
        if master_bin is None or client_bin is None:
            raise FileNotFoundError("mooncake_master/mooncake_client not in the mooncake package")
        self.pool_bytes = pool_bytes
        self.master = ServerProcess(
            "mooncake-master",
            [
                str(master_bin),
                "--rpc_port={port}",
                "--rpc_address=127.0.0.1",
                "--metrics_host=127.0.0.1",
                f"--metrics_port={free_port()}",
                "--http_metadata_server_host=127.0.0.1",
                "--rpc_thread_num=2",
                "--logtostderr=true",
                "--minloglevel=1",
            ],
        )
        self.holder: ServerProcess | None = None
        if pool_bytes:
            self.holder = ServerProcess(
                "mooncake-pool",
                [
                    str(client_bin),
                    f"--global_segment_size={pool_bytes}",
                    f"--master_server_address={self.address}",
                    "--metadata_server=P2PHANDSHAKE",
                    "--host=127.0.0.1",
                    "--port={port}",
                    "--protocol=tcp",
                    "--logtostderr=true",
                    "--minloglevel=1",
                ],
                workdir=self.master.workdir,
            )

    @property
    def address(self) -> str:
        """``host:port`` of the master's RPC service (a tier's ``master`` setting)."""
        return f"127.0.0.1:{self.master.port}"

    def start(self) -> MooncakeCluster:
        self.master.start()
        if self.holder is not None:
            try:
                self.holder.start()
            except BaseException:
                self.master.stop()
                raise
        return self

    def kill_master(self) -> None:
        """SIGKILL the master (a crash, not a clean shutdown)."""
        self.master.kill()

    def restart_master(self) -> None:
        """Crash the master and start a fresh one on the same port (every key is gone)."""
        self.master.kill()
        self.master.start()

    def stop(self) -> None:
        if self.holder is not None:
            self.holder.stop()
        self.master.stop()

    def __enter__(self) -> MooncakeCluster:
        return self if self.master.running else self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def start_or_skip(pool_bytes: int) -> MooncakeCluster:
    """A started ``MooncakeCluster``, or ``pytest.skip`` saying why it cannot run here."""
    pytest.importorskip("mooncake.store", reason="install mooncake-transfer-engine-non-cuda")
    try:
        return MooncakeCluster(pool_bytes).start()
    except (OSError, RuntimeError) as exc:
        pytest.skip(f"cannot run Mooncake Store here (libibverbs1 installed?): {exc}")


@pytest.fixture(scope="session")
def mooncake_cluster() -> Iterator[MooncakeCluster]:
    """A session-wide master with a 256 MiB pool held by ``mooncake_client``."""
    cluster = start_or_skip(256 * MIB)
    try:
        yield cluster
    finally:
        cluster.stop()
