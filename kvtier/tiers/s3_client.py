"""The boto3 side of the S3 tier: connection options, and reading a response zero-copy.

``kvtier.tiers.s3`` decides what to store and when the tier is out of service; this module holds
what it takes to build its boto3 client, read from it and tell S3's answers apart:

- ``S3Options``: the connection settings of ``[[tiers]] kind = "s3"`` (bucket, endpoint, region,
  credentials, timeout, workers), validated once -- no bucket, a bucket name or ``endpoint_url``
  S3 cannot take, a bad region or half a key pair are a ``ConfigError`` naming the value, with
  URL credentials masked (``masked_url``). ``connect`` builds the client: bounded timeouts, no
  retries, no second checksum over blocks that carry their own.
- ``prepare_bucket``: create the bucket and install the TTL lifecycle rule, skipping (logged) a
  step S3 refuses.
- ``refused``: whether an error is S3 refusing that one request (a miss) or S3 not serving.
- ``http_stream`` / ``read_exact``: the ``http.client`` response under a botocore body, read
  straight into a caller's buffer (urllib3's ``readinto`` would read into new bytes and copy).
"""

from __future__ import annotations

import http.client
import logging
import re
from dataclasses import dataclass, field
from typing import Any

import boto3
from botocore.config import Config
from botocore.exceptions import ClientError, IncompleteReadError
from botocore.utils import is_valid_endpoint_url, is_valid_ipv6_endpoint_url

from kvtier.errors import ConfigError

log = logging.getLogger(__name__)

# what botocore accepts as a bucket (a name, or an access point / outpost ARN)
_BUCKET_RE = re.compile(r"^([a-zA-Z0-9.\-_]{1,255}|arn:[^\s]+)$")
#: error codes of a missing object
MISSING = frozenset({"404", "NoSuchKey", "NotFound"})
#: 4xx codes that still mean no request can succeed now: the bucket is gone, the credentials or
#: the clock are refused, the account is blocked, the connection is too slow
_TIER_DOWN = frozenset(
    {"NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken"}
    | {"InvalidToken", "TokenRefreshRequired", "RequestTimeTooSkewed", "RequestTimeout"}
    | {"AccountProblem", "AllAccessDisabled"}
)


def error_code(exc: ClientError) -> str:
    """The S3 error code of ``exc`` (``"NoSuchKey"``, ``"AccessDenied"``, ``"404"``, ...)."""
    return str(exc.response.get("Error", {}).get("Code", ""))


def refused(exc: BaseException) -> bool:
    """Did S3 refuse this one request -- a 4xx about the object (``AccessDenied``, an archived
    object's ``InvalidObjectState``, a key it will not take)? That is the request's miss: S3 is
    up and answering, so it must not open the breaker. A 5xx (``InternalError``,
    ``SlowDown``), a 429, a ``_TIER_DOWN`` code and every network error mean the server cannot
    serve now. (A HEAD's error has no body, so bad credentials on a lookup read as a plain
    403, a refusal; the first GET or PUT names them and opens the breaker.)"""
    if not isinstance(exc, ClientError):
        return False
    status = int(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode") or 0)
    return 400 <= status < 500 and status != 429 and error_code(exc) not in _TIER_DOWN


def prepare_bucket(client: Any, bucket: str, prefix: str, create: bool, ttl_days: int) -> None:
    """Create ``bucket`` (``create``) and install a rule expiring objects under ``prefix/``
    after ``ttl_days`` (0: none), merged with the bucket's other rules. A step S3 refuses (no
    permission for it, a name another account owns) is logged and skipped: the tier may still
    work, and the object requests will say whether it does. Raises on anything else."""
    if create:
        try:
            try:
                client.head_bucket(Bucket=bucket)
            except ClientError as exc:
                if error_code(exc) not in MISSING | {"NoSuchBucket"}:
                    raise
                client.create_bucket(Bucket=bucket)
        except ClientError as exc:
            if error_code(exc) != "BucketAlreadyOwnedByYou":  # another node was first
                _skip_step(exc, f"creating bucket {bucket}")
    if ttl_days:
        try:
            _install_ttl(client, bucket, prefix, ttl_days)
        except ClientError as exc:
            _skip_step(exc, f"installing the {ttl_days}-day TTL rule")


def _install_ttl(client: Any, bucket: str, prefix: str, ttl_days: int) -> None:
    rule_id = f"kvtier-{prefix}"
    try:
        rules = client.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
    except ClientError as exc:
        if error_code(exc) != "NoSuchLifecycleConfiguration":
            raise  # refused too: rules we could not read must not be overwritten
        rules = []
    rules = [r for r in rules if r.get("ID") != rule_id] + [
        {
            "ID": rule_id,
            "Status": "Enabled",
            "Filter": {"Prefix": prefix + "/"},
            "Expiration": {"Days": ttl_days},
        }
    ]
    client.put_bucket_lifecycle_configuration(
        Bucket=bucket, LifecycleConfiguration={"Rules": rules}
    )


def _skip_step(exc: ClientError, step: str) -> None:
    """Log a refused preparation step and go on; anything else is an outage (raised)."""
    if not refused(exc):
        raise exc
    log.warning("s3 tier: S3 refused %s (%s); going on without it", step, error_code(exc))


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
            # one attempt: botocore's "max_attempts" counts retries (1 = two attempts)
            retries={"total_max_attempts": 1, "mode": "standard"},
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
