"""The boto3 side of the S3 tier: connection options, and reading a response zero-copy.

``kvtier.tiers.s3`` decides what to store and what an error means; this module holds what it
takes to build its boto3 client and read from it:

- ``S3Options``: the connection settings of ``[[tiers]] kind = "s3"`` (bucket, endpoint, region,
  credentials, timeout, workers), validated once -- no bucket, a bucket name or ``endpoint_url``
  S3 cannot take, a bad region or half a key pair are a ``ConfigError`` naming the value, with
  URL credentials masked (``masked_url``). ``connect`` builds the client: bounded timeouts, no
  retries, no second checksum over blocks that carry their own.
- ``http_stream`` / ``read_exact``: the ``http.client`` response under a botocore body, read
  straight into a caller's buffer (urllib3's ``readinto`` would read into new bytes and copy).
"""

from __future__ import annotations

import http.client
import re
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import IncompleteReadError
from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

from kvtier.errors import ConfigError

# what botocore accepts as a bucket (a name, or an access point / outpost ARN)
_BUCKET_RE = re.compile(r"^([a-zA-Z0-9.\-_]{1,255}|arn:[^\s]+)$")


def masked_url(url: str) -> str:
    """``url`` with any ``user:password@`` replaced by ``***@``."""
    return re.sub(r"^([^:/]*://)[^/@]*@", r"\1***@", url)


def http_stream(body: Any) -> http.client.HTTPResponse | None:
    """The unread ``http.client`` response under a botocore ``StreamingBody`` (None when the
    stack is not the usual botocore -> urllib3 -> http.client, or the body is content-encoded).

    ``http.client.HTTPResponse.readinto`` fills a caller buffer straight from the socket;
    urllib3's ``readinto`` would read into a new ``bytes`` first and copy.
    """
    raw = getattr(body, "_raw_stream", None)
    fp = getattr(raw, "_fp", None)
    if not isinstance(fp, http.client.HTTPResponse) or not hasattr(raw, "release_conn"):
        return None
    if getattr(raw, "headers", {}).get("content-encoding") not in (None, "identity"):
        return None
    return fp


def read_exact(stream: http.client.HTTPResponse, buf: memoryview) -> None:
    """Fill ``buf`` from ``stream``; ``IncompleteReadError`` if the body ends first."""
    got = 0
    while got < len(buf):
        n = stream.readinto(buf[got:])
        if not n:
            raise IncompleteReadError(actual_bytes=got, expected_bytes=len(buf))
        got += n


@dataclass(frozen=True, slots=True)
class S3Options:
    """Connection options, validated once (their meaning: ``kvtier.tiers.s3``'s docstring)."""

    bucket: str
    endpoint_url: str | None = None
    region: str = "us-east-1"
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    timeout: float = 5.0
    workers: int = 8

    def __post_init__(self) -> None:
        if not self.bucket:
            raise ConfigError("s3 tier: bucket is required")
        if not isinstance(self.bucket, str) or not _BUCKET_RE.match(self.bucket):
            raise ConfigError(
                f"s3 tier bucket {self.bucket!r}: not a bucket name S3 accepts "
                "(letters, digits, '.', '-', '_'; at most 255)"
            )
        url = self.endpoint_url
        if url:
            ok = isinstance(url, str) and url.split("://", 1)[0].lower() in ("http", "https")
            if not ok or not (is_valid_endpoint_url(url) or is_valid_ipv6_endpoint_url(url)):
                raise ConfigError(
                    f"s3 tier endpoint_url {masked_url(str(url))!r}: expected an http(s) URL "
                    "such as 'http://10.0.0.5:9000', or empty for AWS"
                )
        if not isinstance(self.region, str) or not re.fullmatch(
            r"(?![0-9]+$)(?!-)[a-zA-Z0-9-]{0,63}(?<!-)", self.region
        ):
            raise ConfigError(f"s3 tier region {self.region!r}: expected a name like 'us-east-1'")
        if bool(self.access_key) != bool(self.secret_key):
            raise ConfigError(
                "s3 tier: access_key and secret_key go together; give both, or neither "
                "(boto3's usual credential chain)"
            )
        if self.timeout <= 0:
            raise ConfigError(f"s3 tier: timeout must be > 0 seconds, got {self.timeout}")
        if self.workers < 1:
            raise ConfigError(f"s3 tier: workers must be >= 1, got {self.workers}")

    def connect(self) -> Any:
        cfg = Config(
            connect_timeout=self.timeout,
            read_timeout=self.timeout,
            retries={"max_attempts": 1, "mode": "standard"},
            # blocks carry their own checksum (xxh3) or GCM tag: no second CRC over every byte
            request_checksum_calculation="when_required",
            response_checksum_validation="when_required",
            max_pool_connections=2 * self.workers,
        )
        return boto3.session.Session().client(
            "s3",
            endpoint_url=self.endpoint_url or None,
            region_name=self.region or None,
            aws_access_key_id=self.access_key or None,
            aws_secret_access_key=self.secret_key or None,
            config=cfg,
        )
