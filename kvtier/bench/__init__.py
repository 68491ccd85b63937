"""Benchmarks, one module per target, each comparing kvtier with the physical limit measured in
the same run (memcpy, raw O_DIRECT I/O, the bare server client).

``BENCHES`` maps ``kvtier bench <target>`` to a module with ``add_arguments(parser)`` and
``run(args) -> dict`` (the JSON object printed with ``--json``).
"""

from __future__ import annotations

BENCHES: dict[str, str] = {
    "host": "kvtier.bench.host",
    "ttft": "kvtier.bench.ttft",
    "sim": "kvtier.bench.sim",
    "disk": "kvtier.bench.disk",
    "redis": "kvtier.bench.redis",
    "s3": "kvtier.bench.s3",
    "mooncake": "kvtier.bench.mooncake",
    "seal": "kvtier.bench.seal",
    "service": "kvtier.bench.service",
    "vllm": "kvtier.bench.vllm",
    "vllm-service": "kvtier.bench.vllm_service",
}
