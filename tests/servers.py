"""Real servers for the tests: started on free 127.0.0.1 ports, stopped by PID.

Registered as a pytest plugin (``pytest_plugins = ["tests.servers"]`` in ``tests/conftest.py``).
Session-scoped fixtures, shared by every test module:

- ``redis_url``       -- one ``redis-server --save '' --appendonly no``: ``"redis://127.0.0.1:P"``
- ``redis_cluster``   -- a 3-master Redis Cluster: ``["127.0.0.1:P1", "127.0.0.1:P2", ...]``
- ``s3_endpoint``     -- a moto S3-protocol server: ``"http://127.0.0.1:P"``

``ServerProcess`` is the building block (also for tests that kill and restart a server, and for
other server kinds): argv with a ``{port}`` placeholder, a readiness probe, ``start``/``stop``/
``restart`` on the same port, output captured to a log file that is shown when it fails to start.
A missing binary or client library skips the dependent tests with a reason that says what to
install; it never fails them.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path

import pytest

HOST = "127.0.0.1"
STARTUP_TIMEOUT_S = 20.0


def free_port(also_free: Sequence[int] = ()) -> int:
    """A free TCP port on 127.0.0.1 (and ``port + d`` free for each ``d`` in ``also_free``)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind((HOST, 0))
            port = int(s.getsockname()[1])
        if all(port + d < 65536 and port_is_free(port + d) for d in also_free):
            return port
    raise RuntimeError("no free port pair found on 127.0.0.1")


def port_is_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind((HOST, port))
        except OSError:
            return False
    return True


def port_accepts(port: int, timeout: float = 0.2) -> bool:
    """True if something accepts TCP connections on 127.0.0.1:port."""
    try:
        with socket.create_connection((HOST, port), timeout=timeout):
            return True
    except OSError:
        return False


def require_binary(name: str, package: str) -> str:
    """Path of ``name``, or skip the test saying which package provides it."""
    path = shutil.which(name)
    if path is None:
        pytest.skip(f"{name} not found on PATH (install {package})")
    return path


class ServerProcess:
    """One server process on a fixed port; ``argv`` items may contain ``{port}`` and ``{dir}``."""

    def __init__(
        self,
        name: str,
        argv: Sequence[str],
        port: int | None = None,
        ready: Callable[[ServerProcess], bool] | None = None,
        workdir: Path | None = None,
    ) -> None:
        self.name = name
        self.port = port if port is not None else free_port()
        if workdir is None:  # ours: removed when this object goes (at the latest at exit)
            workdir = Path(tempfile.mkdtemp(prefix=f"kvtier-{name}-"))
            weakref.finalize(self, shutil.rmtree, workdir, ignore_errors=True)
        self.workdir = workdir
        self.argv = [a.format(port=self.port, dir=self.workdir) for a in argv]
        self._ready = ready or (lambda p: port_accepts(p.port))
        self.proc: subprocess.Popen[bytes] | None = None
        self.log_path = self.workdir / f"{name}-{self.port}.log"

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = STARTUP_TIMEOUT_S) -> ServerProcess:
        """Start and wait until ready; raise ``RuntimeError`` (with the log tail) if it is not."""
        assert not self.running, f"{self.name} already running"
        with open(self.log_path, "ab") as logf:
            self.proc = subprocess.Popen(
                self.argv,
                stdout=logf,
                stderr=subprocess.STDOUT,
                cwd=self.workdir,
                start_new_session=True,
            )
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                break
            if self._ready(self):
                return self
            time.sleep(0.05)
        tail = self.log_path.read_text(errors="replace")[-2000:]
        self.stop()
        raise RuntimeError(f"{self.name} did not become ready on port {self.port}:\n{tail}")

    def stop(self, timeout: float = 10.0) -> None:
        """Terminate by PID (SIGTERM, then SIGKILL) and reap it. Idempotent."""
        proc, self.proc = self.proc, None
        if proc is None or proc.poll() is not None:
            return
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(timeout)

    def kill(self) -> None:
        """SIGKILL by PID (a crash, not a shutdown)."""
        proc, self.proc = self.proc, None
        if proc is not None and proc.poll() is None:
            proc.kill()
            proc.wait(10)

    def restart(self) -> ServerProcess:
        self.stop()
        return self.start()


# -- Redis ---------------------------------------------------------------------------------------
def _redis_ping(p: ServerProcess) -> bool:
    try:
        out = subprocess.run(
            ["redis-cli", "-h", HOST, "-p", str(p.port), "ping"],
            capture_output=True,
            timeout=2,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return False
    return out.stdout.strip() == b"PONG" or b"NOAUTH" in out.stdout  # up, wants a password


def redis_server_process(port: int | None = None, *extra: str) -> ServerProcess:
    """A not-yet-started single ``redis-server`` (no persistence, 127.0.0.1 only)."""
    binary = require_binary("redis-server", "Debian package redis-server")
    require_binary("redis-cli", "Debian package redis-server (redis-tools)")
    argv = [
        binary,
        "--port",
        "{port}",
        "--bind",
        HOST,
        "--save",
        "",
        "--appendonly",
        "no",
        "--dir",
        "{dir}",
        "--protected-mode",
        "yes",
        *extra,
    ]
    return ServerProcess("redis", argv, port, _redis_ping)


def _cluster_ok(port: int) -> bool:
    out = subprocess.run(
        ["redis-cli", "-h", HOST, "-p", str(port), "cluster", "info"],
        capture_output=True,
        timeout=5,
        check=False,
    )
    return b"cluster_state:ok" in out.stdout


def start_redis_cluster(masters: int = 3) -> list[ServerProcess]:
    """Start ``masters`` cluster-enabled servers and join them (no replicas); wait for state ok."""
    nodes: list[ServerProcess] = []
    try:
        for _ in range(masters):
            port = free_port(also_free=(10000,))  # the cluster bus listens on port + 10000
            node = redis_server_process(
                port,
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes-{port}.conf",
                "--cluster-node-timeout",
                "2000",
            )
            nodes.append(node.start())
        create = subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"{HOST}:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            capture_output=True,
            timeout=60,
            check=False,
        )
        if create.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed:\n{create.stdout.decode()}")
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while not all(_cluster_ok(n.port) for n in nodes):
            if time.monotonic() > deadline:
                raise RuntimeError("Redis Cluster did not reach cluster_state:ok")
            time.sleep(0.1)
    except BaseException:
        for n in nodes:
            n.stop()
        raise
    return nodes


@pytest.fixture(scope="session")
def redis_url() -> Iterator[str]:
    """URL of a session-wide single redis-server."""
    server = redis_server_process().start()
    try:
        yield f"redis://{HOST}:{server.port}"
    finally:
        server.stop()


@pytest.fixture(scope="session")
def redis_cluster() -> Iterator[list[str]]:
    """``host:port`` of each master of a session-wide 3-master Redis Cluster."""
    require_binary("redis-server", "Debian package redis-server")
    nodes = start_redis_cluster(3)
    try:
        yield [f"{HOST}:{n.port}" for n in nodes]
    finally:
        for n in nodes:
            n.stop()


# -- S3 (moto) -------------------------------------------------------------------------------------
def s3_server_process(port: int | None = None) -> ServerProcess:
    """A not-yet-started moto S3-protocol server (in-memory, 127.0.0.1 only)."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        pytest.skip("moto[server] is not installed (pip install 'moto[server]')")
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "testing")  # moto accepts any credentials
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "testing")
    argv = [sys.executable, "-m", "moto.server", "-H", HOST, "-p", "{port}"]
    return ServerProcess("moto-s3", argv, port)


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    """Endpoint URL of a session-wide moto S3 server (any credentials are accepted)."""
    server = s3_server_process().start()
    try:
        yield f"http://{HOST}:{server.port}"
    finally:
        server.stop()
