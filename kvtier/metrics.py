"""Metrics as a wrapper: ``MeteredTier`` counts what passes through any tier, per tenant.

No tier implementation contains metrics code. The store wraps each tier once; ``snapshot()``
feeds ``TieredStore.stats()``. With ``enable_prometheus()`` the same events also update
``prometheus_client`` counters/histograms (labels: tier, tenant, op), optionally served over
HTTP on 127.0.0.1.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvtier.keys import BlockKey
from kvtier.tiers.base import Array, Tier, TierUsage


@dataclass(slots=True)
class OpStats:
    hits: int = 0
    misses: int = 0
    puts: int = 0
    put_failures: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    read_seconds: float = 0.0
    write_seconds: float = 0.0

    def read_gbps(self) -> float:
        return self.bytes_read / self.read_seconds / 1e9 if self.read_seconds else 0.0

    def write_gbps(self) -> float:
        return self.bytes_written / self.write_seconds / 1e9 if self.write_seconds else 0.0


class _Prometheus:
    def __init__(self) -> None:
        from prometheus_client import Counter, Histogram

        self.blocks = Counter(
            "kvtier_blocks_total", "Blocks by tier, tenant and outcome", ["tier", "tenant", "op"]
        )
        self.bytes = Counter("kvtier_bytes_total", "Bytes moved", ["tier", "tenant", "op"])
        self.latency = Histogram(
            "kvtier_batch_seconds",
            "Tier batch call latency",
            ["tier", "op"],
            buckets=(1e-5, 1e-4, 1e-3, 3e-3, 1e-2, 3e-2, 0.1, 0.3, 1.0, 3.0),
        )


_prom: _Prometheus | None = None
_prom_lock = threading.Lock()


def enable_prometheus(port: int = 0) -> None:
    """Export metrics via prometheus_client (idempotent); serve on 127.0.0.1:port if port > 0."""
    global _prom
    with _prom_lock:
        if _prom is None:
            _prom = _Prometheus()
            if port > 0:
                from prometheus_client import start_http_server

                start_http_server(port, addr="127.0.0.1")


class MeteredTier(Tier):
    """Wraps a tier; forwards every call and records counts, bytes and latency per tenant."""

    def __init__(self, inner: Tier) -> None:
        super().__init__(inner.layout)
        self.inner = inner
        self.name = inner.name
        self.label = inner.name  # the Prometheus ``tier`` label (a service pool prefixes it)
        self.persistent = inner.persistent
        self.shared = inner.shared
        self.verifies_checksums = inner.verifies_checksums
        self.layer_reads = inner.layer_reads
        self._lock = threading.Lock()
        self._by_tenant: dict[str, OpStats] = defaultdict(OpStats)

    @property
    def capacity_blocks(self) -> int:
        return self.inner.capacity_blocks

    def usage(self) -> TierUsage:
        return self.inner.usage()

    @property
    def healthy(self) -> bool:
        return self.inner.healthy

    def keys(self) -> Iterator[BlockKey]:
        return self.inner.keys()

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        return self.inner.contains_prefix(keys, tenant)

    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        t0 = time.perf_counter()
        res = self.inner.get_into(keys, outs, tenant)
        self._record(tenant, "read", res, time.perf_counter() - t0)
        return res

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        t0 = time.perf_counter()
        res = self.inner.put(keys, blocks, tenant)
        self._record(tenant, "write", res, time.perf_counter() - t0)
        return res

    def get_layer_into(
        self, keys: Sequence[BlockKey], layer: int, outs: Sequence[Array], tenant: str = ""
    ) -> list[int | None]:
        t0 = time.perf_counter()
        res = self.inner.get_layer_into(keys, layer, outs, tenant)
        found = [c is not None for c in res]
        # a block's hit or miss is counted once (at layer 0); bytes and time for every layer
        self._record(
            tenant,
            "read",
            found,
            time.perf_counter() - t0,
            per_block=self.layout.layer_block_bytes,
            count_blocks=layer == 0,
        )
        return res

    def _record(
        self,
        tenant: str,
        op: str,
        res: list[bool],
        seconds: float,
        per_block: int = 0,
        count_blocks: bool = True,
    ) -> None:
        ok = sum(res)
        failed = len(res) - ok if count_blocks else 0
        nbytes = ok * (per_block or self.block_bytes)
        if not count_blocks:
            ok = 0
        with self._lock:
            s = self._by_tenant[tenant]
            if op == "read":
                s.hits += ok
                s.misses += failed
                s.bytes_read += nbytes
                s.read_seconds += seconds
            else:
                s.puts += ok
                s.put_failures += failed
                s.bytes_written += nbytes
                s.write_seconds += seconds
        if _prom is not None:
            good, bad = ("hit", "miss") if op == "read" else ("put", "put_failed")
            _prom.blocks.labels(self.label, tenant, good).inc(ok)
            _prom.blocks.labels(self.label, tenant, bad).inc(failed)
            _prom.bytes.labels(self.label, tenant, op).inc(nbytes)
            _prom.latency.labels(self.label, "get" if op == "read" else "put").observe(seconds)

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        self.inner.delete(keys, tenant)

    def sync(self) -> None:
        self.inner.sync()

    def close(self) -> None:
        self.inner.close()

    def snapshot(self) -> dict[str, Any]:
        """Totals and per-tenant counters, plus usage and health."""
        with self._lock:
            per = {t: OpStats(**asdict(s)) for t, s in self._by_tenant.items()}
        total = OpStats()
        for s in per.values():
            for k, v in asdict(s).items():
                setattr(total, k, getattr(total, k) + v)
        u = self.usage()
        out: dict[str, Any] = asdict(total)
        out.update(
            read_gbps=total.read_gbps(),
            write_gbps=total.write_gbps(),
            used_blocks=u.used_blocks,
            capacity_blocks=u.capacity_blocks,
            healthy=self.healthy,
            tenants={t: asdict(s) for t, s in per.items()},
        )
        return out
