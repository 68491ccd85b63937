"""Smoke tests of ``kvtier bench redis|s3|mooncake`` against the session servers (tiny sizes).

Timing is not asserted; the JSON must carry every bare-client configuration, the best of them,
the tier's and the store's whole path's ratios to it, and the tier's loads (and the second store
process's) must be byte-identical to what was stored.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import pytest

from tests.mooncake_server import MooncakeCluster

pytestmark = pytest.mark.server
KEYS = {
    "store_gbps",
    "load_gbps",
    "raw_store_gbps",
    "raw_load_gbps",
    "store_ratio_median",
    "write_through_gbps",
    "read_path_gbps",
    "write_through_ratio",
    "read_path_ratio",
}


def _bench(target: str, *argv: str) -> dict[str, Any]:
    module = importlib.import_module(f"kvtier.bench.{target}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--block-mib", "1", "--blocks", "2", "--rounds", "2", *argv])
    result: dict[str, Any] = module.run(args)
    return result


def _check(out: dict[str, Any], configs: set[str]) -> None:
    assert set(out) >= KEYS
    assert all(out[k] > 0 for k in KEYS)
    assert out["byte_identical"] is True
    assert out["block_bytes"] == 1 << 20 and out["rounds"] == 2
    for side in ("store", "load"):
        tried = {f"raw_{side}:{c}" for c in configs}
        assert {f"{t}_gbps" for t in tried} <= set(out)
        best = out[f"raw_{side}_best"]
        assert best in tried and out[f"raw_{side}_gbps"] == out[f"{best}_gbps"]
    ratio = out["write_through_gbps"] / out["raw_store_gbps"]
    assert out["write_through_ratio"] == pytest.approx(ratio)


def _check_auth_pair(out: dict[str, Any]) -> None:
    """The MAC'd tier (the default) and the plain one ran in the same rounds."""
    assert out["auth"] == "mac" and out["auth_pair"] is True
    for step in ("store_noauth", "load_noauth"):
        assert out[f"{step}_gbps"] > 0 and out[f"{step}_ratio_median"] > 0


def test_bench_redis(redis_url: str) -> None:
    out = _bench("redis", "--url", redis_url, "--auth-pair")
    _check(out, {"pipeline=2,conns=1", "pipeline=2,conns=2"})
    _check_auth_pair(out)


def test_bench_s3(s3_endpoint: str) -> None:
    _check(
        _bench("s3", "--endpoint", s3_endpoint, "--workers", "2", "--encrypt"),
        {"concurrency=1", "concurrency=2"},
    )


def test_bench_mooncake(mooncake_cluster: MooncakeCluster) -> None:
    _check(
        _bench("mooncake", "--master", mooncake_cluster.address, "--encrypt"),
        {"batch=2,registered"},
    )
