"""Smoke tests of ``kvtier bench redis|s3|mooncake`` against the session servers (tiny sizes).

Timing is not asserted; the JSON must carry both sides' numbers, and the tier's loads must be
byte-identical to what it stored.
"""

from __future__ import annotations

import argparse
import importlib
from typing import Any

import pytest

from tests.mooncake_server import MooncakeCluster

pytestmark = pytest.mark.server
KEYS = {"store_gbps", "load_gbps", "raw_store_gbps", "raw_load_gbps", "store_ratio_median"}


def _bench(target: str, *argv: str) -> dict[str, Any]:
    module = importlib.import_module(f"kvtier.bench.{target}")
    parser = argparse.ArgumentParser()
    module.add_arguments(parser)
    args = parser.parse_args(["--block-mib", "1", "--blocks", "2", "--rounds", "2", *argv])
    result: dict[str, Any] = module.run(args)
    return result


def _check(out: dict[str, Any]) -> None:
    assert set(out) >= KEYS
    assert all(out[k] > 0 for k in KEYS)
    assert out["byte_identical"] is True
    assert out["block_bytes"] == 1 << 20 and out["rounds"] == 2


def test_bench_redis(redis_url: str) -> None:
    _check(_bench("redis", "--url", redis_url, "--encrypt"))


def test_bench_s3(s3_endpoint: str) -> None:
    _check(_bench("s3", "--endpoint", s3_endpoint, "--workers", "2"))


def test_bench_mooncake(mooncake_cluster: MooncakeCluster) -> None:
    _check(_bench("mooncake", "--master", mooncake_cluster.address, "--encrypt"))
