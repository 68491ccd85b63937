"""The S3 tier against a real S3-protocol server (moto, started by ``tests.servers``)."""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest

from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Tier
from kvtier.tiers.registry import make_tier
from kvtier.tiers.s3 import S3Options, S3Tier
from tests.tier_conformance import (
    LAYOUT,
    TierConformance,
    assert_round_trip,
    empty_block,
    rand_block,
    rand_key,
)

pytestmark = pytest.mark.server
BUCKET = "kvtier-test"


def s3_tier(endpoint: str, layout: KVLayout = LAYOUT, **kw: Any) -> S3Tier:
    opts = S3Options(bucket=BUCKET, endpoint_url=endpoint, workers=4)
    return S3Tier(
        layout,
        opts,
        prefix="t" + uuid.uuid4().hex[:12],
        create_bucket=True,
        **({} if "sealer" in kw else {"secret": b"test-secret"}) | kw,
    )


class TestS3Tier(TierConformance):
    @pytest.fixture(autouse=True)
    def _server(self, s3_endpoint: str) -> None:
        self.endpoint = s3_endpoint

    def make_tier(self, layout: KVLayout, capacity_blocks: int, tmp_path: Path) -> Tier:
        return s3_tier(self.endpoint, layout)

    def corrupt(self, tier: Tier, key: BlockKey) -> bool:
        assert isinstance(tier, S3Tier)
        name = tier.object_key(key, "")
        client = tier.client()
        value = bytearray(client.get_object(Bucket=BUCKET, Key=name)["Body"].read())
        value[100] ^= 0x10
        client.put_object(Bucket=BUCKET, Key=name, Body=bytes(value))
        return True


def test_keys_are_prefix_organized_by_tenant(s3_endpoint: str) -> None:
    tier = s3_tier(s3_endpoint)
    try:
        k = rand_key()
        assert tier.put([k], [rand_block()], tenant="acme") == [True]
        h = k.hex()
        assert list(tier.keys_of("acme")) == [f"{tier.prefix}/acme/{h[:2]}/{h}"]
        assert list(tier.keys_of("other")) == []
        assert tier.contains_prefix([k], tenant="other") == 0
    finally:
        tier.close()


def test_large_block_goes_multipart_and_round_trips(s3_endpoint: str) -> None:
    lay = KVLayout(layers=4, kv_heads=8, head_dim=128, dtype="float16", block_tokens=256)
    assert lay.block_bytes == 4 << 20
    tier = s3_tier(s3_endpoint, lay, multipart_threshold=1 << 20, multipart_chunk=5 << 20)
    try:
        k, b = rand_key(), rand_block(lay, seed=9)
        assert tier.put([k], [b]) == [True]
        head = tier.client().head_object(Bucket=BUCKET, Key=tier.object_key(k, ""))
        assert "-" in head["ETag"]  # a multipart ETag is "<md5>-<parts>"
        assert tier.put([k], [rand_block(lay, seed=10)]) == [True]  # kept, not replaced
        out = empty_block(lay)
        assert tier.get_into([k], [out]) == [True] and out.tobytes() == b.tobytes()
    finally:
        tier.close()


def test_ttl_installs_a_lifecycle_rule_for_the_prefix(s3_endpoint: str) -> None:
    tier = s3_tier(s3_endpoint, ttl_days=7)
    try:
        tier.put([rand_key()], [rand_block()])
        rules = tier.client().get_bucket_lifecycle_configuration(Bucket=BUCKET)["Rules"]
        mine = [r for r in rules if r["ID"] == f"kvtier-{tier.prefix}"]
        assert len(mine) == 1 and mine[0]["Expiration"]["Days"] == 7
        assert mine[0]["Filter"]["Prefix"] == tier.prefix + "/"
    finally:
        tier.close()


def test_from_config_via_registry(s3_endpoint: str) -> None:
    spec = {
        "kind": "s3",
        "bucket": BUCKET,
        "endpoint_url": s3_endpoint,
        "create_bucket": True,
        "prefix": "cfg" + uuid.uuid4().hex[:8],
        "encryption_key": "ab" * 32,
    }
    tier = make_tier(LAYOUT, spec)
    try:
        assert isinstance(tier, S3Tier) and tier.sealer.encrypted and tier.shared
        assert_round_trip(tier, seed=4)
    finally:
        tier.close()


@pytest.mark.parametrize(
    ("spec", "needle"),
    [
        ({"bucket": ""}, "bucket"),
        ({"bucket": "b", "workers": 0}, "workers"),
        ({"bucket": "b", "multipart_chunk": "1MiB"}, "5MiB"),
        ({"bucket": "b", "quota": "lots"}, "quota"),
        ({"bucket": "b", "region": "x", "color": 1}, "color"),
        ({"endpoint_url": "http://127.0.0.1:9000"}, "needs bucket"),
        ({"bucket": 7}, "bucket: expected a string, got 7"),
        ({"bucket": "Bad_Bucket!"}, "bucket 'Bad_Bucket!'"),
        ({"bucket": "b", "endpoint_url": "not a url"}, "endpoint_url 'not a url'"),
        ({"bucket": "b", "endpoint_url": "127.0.0.1:9000"}, "endpoint_url '127.0.0.1:9000'"),
        ({"bucket": "b", "endpoint_url": "ftp://h:21"}, "endpoint_url 'ftp://h:21'"),
        ({"bucket": "b", "region": "us east 1"}, "region 'us east 1'"),
        ({"bucket": "b", "access_key": "AKIAEXAMPLE"}, "secret_key"),
    ],
)
def test_bad_config_names_the_problem(spec: dict[str, Any], needle: str) -> None:
    """A setting that can never work is a ConfigError at construction, naming key and value
    (not a ValueError or a TypeError from boto3 on the first request)."""
    with pytest.raises(ConfigError, match=needle):
        S3Tier.from_config(LAYOUT, spec)


def test_config_errors_do_not_show_secrets() -> None:
    with pytest.raises(ConfigError, match=r"endpoint_url 'http://\*\*\*@") as err:
        S3Tier.from_config(LAYOUT, {"bucket": "b", "endpoint_url": "http://AKIA:s3cr3t@a b"})
    assert "s3cr3t" not in str(err.value)
    with pytest.raises(ConfigError, match="secret_key") as err:
        S3Tier.from_config(LAYOUT, {"bucket": "b", "access_key": "AKIA", "secret_key": 12345})
    assert "12345" not in str(err.value)


def test_foreign_objects_are_misses_and_dropped(s3_endpoint: str) -> None:
    """A valid block copied under another key (same length: the zero-copy read path) and a
    truncated one (the whole-value path) both read as misses and are deleted."""
    tier = s3_tier(s3_endpoint)
    try:
        a, b, c = rand_key(), rand_key(), rand_key()
        assert tier.put([a], [rand_block(seed=1)]) == [True]
        client = tier.client()
        value = client.get_object(Bucket=BUCKET, Key=tier.object_key(a, ""))["Body"].read()
        client.put_object(Bucket=BUCKET, Key=tier.object_key(b, ""), Body=value)
        client.put_object(Bucket=BUCKET, Key=tier.object_key(c, ""), Body=value[:-1])
        assert tier.contains_prefix([b]) == 1 and tier.contains_prefix([c]) == 1
        assert tier.get_into([b, c], [empty_block(), empty_block()]) == [False, False]
        assert tier.contains_prefix([b]) == 0 and tier.contains_prefix([c]) == 0
        out = empty_block()
        assert tier.get_into([a], [out]) == [True]  # the original is untouched
    finally:
        tier.close()
