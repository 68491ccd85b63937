"""S3 tier (G4 archive): blocks as objects in any S3-protocol store, via boto3.

**Objects.** One object per block, holding the ``BlockSealer`` value (header first; encrypted
per tenant when a key is configured), under ``<prefix>/<tenant>/<first 2 hex>/<hex key>``: the
tenant directory makes per-tenant listing, lifecycle and IAM policies possible; the 2-hex fan-out
spreads request load over S3's key-range partitions. An object becomes visible only when its
PUT (or multipart completion) finishes, so a reader sees a whole block or nothing. Writes are
conditional (``If-None-Match: *``): a present key keeps its first value.

**Large blocks.** A value of ``multipart_threshold`` bytes or more is uploaded as a multipart
upload whose parts go out in parallel (it pays once a block is larger than one PUT can stream
at full speed, ~16 MiB on AWS); smaller ones are a single PUT. Batches run on a small thread
pool (``workers``), one request per block.

**Reads.** A plain block of the expected length is read zero-copy: the 64-byte header into a
small buffer, the payload from the socket straight into the caller's (contiguous) buffer, then
one xxh3 pass -- fewer copies than a bare ``get_object(...)["Body"].read()``. Encrypted blocks,
strided buffers and objects of another length are read whole and opened by the sealer. Writes
send the sealed buffer itself (one fused copy + checksum from the caller's array).

**Lookups.** S3 has no multi-key existence query, so ``contains_prefix`` HEADs the keys in
waves of ``workers`` concurrent requests and stops at the first wave with a miss. That is
``ceil(n / workers)`` round trips -- an archive tier is asked only for what the faster tiers
miss; the one-round-trip lookup is the Redis tier's job.

**TTL.** ``ttl_days`` > 0 installs (once, at first connect) a bucket lifecycle rule expiring
objects under ``<prefix>/`` after that many days, merged with the bucket's other rules.

**Failures.** A missing object is a miss. So is a request S3 *refuses* (``refused``: a 4xx
about that object -- ``AccessDenied``, ``InvalidObjectState`` for an archived one): S3
answered, the other blocks of the batch are read as usual and the tier stays in service
(counted in ``refusals``, the first of each code logged). What means no request can succeed now
-- a network error, a timeout, a 5xx (``InternalError``, ``SlowDown``/503), a 429, a missing
bucket, refused credentials -- opens a ``CircuitBreaker``: misses / False for ``cooldown``
seconds, ``healthy`` False, then one trial. boto3 retries are off and connect/read timeouts are
bounded (``timeout``); the pool threads are shared by all callers, so once a request failed the
requests not sent yet, of every call, are given up: a call costs at most about one timeout. A
setting that can never work (no bucket, a bucket name or ``endpoint_url`` S3 cannot take, half a
key pair) is a ``ConfigError`` at construction.

Config (``[[tiers]] kind = "s3"``)::

    bucket = "kv-archive" ; endpoint_url = "" ; region = "us-east-1"
    access_key = "" ; secret_key = ""        # empty: boto3's usual credential chain
    prefix = "kvtier" ; create_bucket = false ; ttl_days = 0
    workers = 8 ; multipart_threshold = "16MiB" ; multipart_chunk = "8MiB"
    timeout = 5.0 ; cooldown = 10.0
    encryption_key = "<hex>" ; tenant_keys = {} ; quota = 0 ; tenant_quotas = {}

The connection settings (``S3Options``: bucket and endpoint checks, the boto3 client), bucket
preparation, what S3 ``refused`` and the zero-copy body reads live in ``kvtier.tiers.s3_client``.
"""

from __future__ import annotations

import io
import logging
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor, wait
from functools import partial
from typing import Any, TypeVar

import numpy as np
from botocore.exceptions import BotoCoreError, ClientError

from kvtier import codec
from kvtier.config import parse_bool, parse_float, parse_int, parse_size
from kvtier.errors import ConfigError
from kvtier.keys import BlockKey
from kvtier.layout import KVLayout
from kvtier.tiers.base import Array, TierUsage
from kvtier.tiers.remote import Refusals, RemoteTier, flat_bytes
from kvtier.tiers.s3_client import (
    MISSING,
    S3Options,
    error_code,
    http_stream,
    masked_url,
    prepare_bucket,
    read_exact,
    refused,
)
from kvtier.tiers.secure import BlockSealer, TenantQuotas, tenant_token

__all__ = ["S3Options", "S3Tier", "masked_url", "refused"]

log = logging.getLogger(__name__)

T = TypeVar("T")


class _Abandoned(Exception):
    """A request given up unsent: its call already failed, or another caller found S3 down."""


_ERRORS: tuple[type[BaseException], ...] = (BotoCoreError, ClientError, OSError, _Abandoned)
_EXISTS = {"412", "PreconditionFailed", "ConditionalRequestConflict"}


class S3Tier(RemoteTier):
    """Archive tier on an S3-protocol object store. Thread-safe."""

    name = "s3"
    errors = _ERRORS

    def __init__(
        self,
        layout: KVLayout,
        options: S3Options,
        *,
        prefix: str = "kvtier",
        create_bucket: bool = False,
        ttl_days: int = 0,
        multipart_threshold: int = 16 << 20,
        multipart_chunk: int = 8 << 20,
        cooldown_s: float = 10.0,
        sealer: BlockSealer | None = None,
        quotas: TenantQuotas | None = None,
        secret: bytes = b"",
        trust_pool: bool = False,
    ) -> None:
        super().__init__(
            layout,
            breaker_name="s3 tier",
            cooldown_s=cooldown_s,
            sealer=sealer,
            quotas=quotas,
            secret=secret,
            trust_pool=trust_pool,
        )
        prefix = prefix.strip("/")
        if not prefix:
            raise ConfigError("s3 tier: prefix must be a non-empty path")
        if ttl_days < 0:
            raise ConfigError(f"s3 tier: ttl_days must be >= 0, got {ttl_days}")
        if multipart_chunk < 5 << 20:
            raise ConfigError("s3 tier: multipart_chunk must be at least 5MiB (an S3 limit)")
        self.require_authentication()
        self.options = options
        self.prefix = prefix
        self.create_bucket = create_bucket
        self.ttl_days = ttl_days
        self.multipart_threshold = multipart_threshold
        self.multipart_chunk = multipart_chunk
        self._pool = ThreadPoolExecutor(options.workers, thread_name_prefix="kvtier-s3")
        self._parts = ThreadPoolExecutor(options.workers, thread_name_prefix="kvtier-s3-part")
        self._client: Any = None
        #: server requests that failed so far: a change tells the pool items of every call that
        #: S3 is down, and the next call (the breaker's trial) to start from a fresh client
        self._failures = 0
        self._client_at = 0  # ``_failures`` when ``_client`` was made
        self._last_failure: BaseException | None = None
        self._prepared_for: Any = None  # the client the bucket was last prepared with
        self._lock = threading.Lock()  # held for no network I/O: the pool threads need it never
        self._prep_lock = threading.Lock()  # one bucket preparation at a time
        self._refusals = Refusals()

    @classmethod
    def from_config(cls, layout: KVLayout, spec: Mapping[str, Any]) -> S3Tier:
        """Build from a ``[[tiers]]`` table (keys listed in the module docstring)."""
        opt_keys = {
            "bucket",
            "endpoint_url",
            "region",
            "access_key",
            "secret_key",
            "timeout",
            "workers",
        }
        tier_keys = {
            "prefix",
            "create_bucket",
            "ttl_days",
            "multipart_threshold",
            "multipart_chunk",
            "cooldown",
        }
        sealer, quotas = cls.security_section(layout, spec, "tiers.s3", opt_keys | tier_keys)
        if "bucket" not in spec:
            raise ConfigError('[tiers.s3] needs bucket = "<name>" (the bucket blocks go to)')
        opts = {k: spec[k] for k in opt_keys if k in spec}
        for k in opt_keys - {"timeout", "workers"}:
            if k in opts and not isinstance(opts[k], str):
                shown = "***" if k == "secret_key" else repr(opts[k])
                raise ConfigError(f"tiers.s3 {k}: expected a string, got {shown}")
        if "timeout" in opts:
            opts["timeout"] = parse_float(opts["timeout"], "tiers.s3 timeout")
        if "workers" in opts:
            opts["workers"] = parse_int(opts["workers"], "tiers.s3 workers", 1, 1024)
        return cls(
            layout,
            S3Options(**opts),
            prefix=str(spec.get("prefix", "kvtier")),
            create_bucket=parse_bool(spec.get("create_bucket", False), "tiers.s3 create_bucket"),
            ttl_days=parse_int(spec.get("ttl_days", 0), "tiers.s3 ttl_days"),
            multipart_threshold=parse_size(
                spec.get("multipart_threshold", "16MiB"), "tiers.s3 multipart_threshold"
            ),
            multipart_chunk=parse_size(
                spec.get("multipart_chunk", "8MiB"), "tiers.s3 multipart_chunk"
            ),
            cooldown_s=parse_float(spec.get("cooldown", 10.0), "tiers.s3 cooldown"),
            sealer=sealer,
            quotas=quotas,
        )

    # -- plumbing --------------------------------------------------------------------------
    def object_key(self, key: BlockKey, tenant: str) -> str:
        h = key.hex()
        return f"{self.prefix}/{tenant_token(tenant)}/{h[:2]}/{h}"

    def client(self) -> Any:
        """The boto3 client, the bucket prepared (``create_bucket``, ``ttl_days``). Each server
        call asks for it once and hands it to its pool items. After a failure the next call
        (the breaker's trial) starts from a fresh client, closing the old one, and prepares the
        bucket again (a restarted store may have lost it): once, by one caller, and if that
        fails, callers waiting for it give up (``_Abandoned``) rather than try again."""
        seen = self._failures
        with self._lock:
            old = None
            if self._client is None or self._client_at != seen:
                old, self._client, self._client_at = self._client, self.options.connect(), seen
            client = self._client
        if old is not None:
            old.close()  # its urllib3 pool; a request still on it keeps its connection
        if (self.create_bucket or self.ttl_days) and self._prepared_for is not client:
            with self._prep_lock:
                if self._failures != seen:
                    raise self._abandoned()
                if self._prepared_for is not client:
                    prepare_bucket(
                        client, self.options.bucket, self.prefix, self.create_bucket, self.ttl_days
                    )
                    self._prepared_for = client
        return client

    @property
    def refusals(self) -> int:
        """Requests S3 refused (``refused``): misses that left the tier in service."""
        return self._refusals.count

    def _unless_refused(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()``; ``fallback`` if S3 ``refused`` the request (counted in ``refusals``, the
        first of each code logged: a denied prefix refuses every request)."""
        try:
            return fn()
        except ClientError as exc:
            if not refused(exc):
                raise
            if self._refusals.add(error_code(exc)):
                log.warning("s3 tier: S3 refused a request (%s); a miss, tier stays in use", exc)
            return fallback

    def guard(self, fn: Callable[[], T], fallback: T) -> T:
        """``fn()`` through the breaker; ``fallback`` if S3 ``refused`` the request (the
        breaker stays closed). A failure makes the next call start from a fresh client."""

        def run() -> T:
            try:
                return self._unless_refused(fn, fallback)
            except _ERRORS as exc:
                self._failed(exc)
                raise

        return super().guard(run, fallback)

    def _failed(self, exc: BaseException) -> None:
        if not isinstance(exc, _Abandoned):
            with self._lock:
                self._failures += 1
                self._last_failure = exc

    def _abandoned(self) -> _Abandoned:
        e = self._last_failure
        return _Abandoned(f"given up: a request failed ({type(e).__name__}: {e})")

    def _each(self, fn: Callable[[Any, int], T], n: int, fallback: T) -> list[T]:
        """``[fn(client, i) for i in range(n)]`` on the pool: ``fallback`` for an item whose
        request S3 ``refused``, all ``fallback`` if the server fails. The pool is shared by all
        callers: once an item of this call failed, or another caller found S3 down, the items
        not started yet are given up unsent, not a timeout each. The call still waits for its
        items in flight (at most one timeout): a read may be writing into a caller's buffer."""

        def run() -> list[T]:
            seen = self._failures
            client = self.client()
            failed = threading.Event()

            def item(i: int) -> T:
                if failed.is_set() or self._failures != seen:
                    raise self._abandoned()
                try:
                    return self._unless_refused(partial(fn, client, i), fallback)
                except BaseException as exc:
                    if isinstance(exc, _ERRORS):
                        self._failed(exc)
                    failed.set()
                    raise

            futures = [self._pool.submit(item, i) for i in range(n)]
            try:
                return [f.result() for f in futures]
            finally:
                failed.set()
                wait(futures)

        return self.guard(run, [fallback] * n)

    # -- queries ---------------------------------------------------------------------------
    def usage(self) -> TierUsage:
        """Objects under this tier's prefix (all tenants): a listing, meant for stats."""

        def count() -> int:
            pages = (
                self.client()
                .get_paginator("list_objects_v2")
                .paginate(Bucket=self.options.bucket, Prefix=self.prefix + "/")
            )
            return sum(int(p.get("KeyCount", 0)) for p in pages)

        return TierUsage(self.guard(count, 0), 0, self.block_bytes)

    def _exists(self, client: Any, name: str) -> bool:
        try:
            client.head_object(Bucket=self.options.bucket, Key=name)
        except ClientError as exc:
            if error_code(exc) in MISSING:
                return False
            raise
        return True

    def contains_prefix(self, keys: Sequence[BlockKey], tenant: str = "") -> int:
        names = [self.object_key(k, tenant) for k in keys]
        wave = self.options.workers
        for start in range(0, len(names), wave):
            part = names[start : start + wave]
            found = self._each(lambda c, i, p=part: self._exists(c, p[i]), len(part), False)  # type: ignore[misc]
            for i, f in enumerate(found):
                if not f:
                    return start + i
        return len(names)

    # -- data ------------------------------------------------------------------------------
    def _read_into(self, client: Any, key: BlockKey, name: str, out: Array, tenant: str) -> bool:
        """GET object ``name`` and verify it as block ``key`` into ``out``; ``False`` for a miss
        (absent, or not this block -- then deleted if ``droppable``). Raises on server errors.

        A plain or MAC'd block of the expected length into a contiguous ``out`` is read
        zero-copy: the header (and MAC trailer) into small buffers, the payload from the socket
        straight into ``out``, then one checksum or MAC pass over it. Anything else is read whole
        and opened by the sealer.
        """
        try:
            resp = client.get_object(Bucket=self.options.bucket, Key=name)
        except ClientError as exc:
            if error_code(exc) in MISSING:
                return False
            raise
        body = resp["Body"]
        sealer = self.sealer
        flat = flat_bytes(out) if sealer.splits and out.flags.writeable else None
        stream = http_stream(body) if resp.get("ContentLength") == self.value_bytes else None
        value: bytes | bytearray
        if flat is not None and stream is not None:
            value = bytearray(codec.HEADER_BYTES)
            trailer = bytearray(sealer.trailer_bytes)
            try:
                read_exact(stream, memoryview(value))
                read_exact(stream, memoryview(flat.data))
                read_exact(stream, memoryview(trailer))
            except BaseException:
                body.close()
                raise
            body._raw_stream.release_conn()  # fully read: the connection goes back to the pool
            head, tail = np.frombuffer(value, np.uint8), np.frombuffer(trailer, np.uint8)
            if sealer.verify_parts(key, head, flat, tail, tenant):
                return True
            value = value + bytes(flat.data) + trailer  # for ``droppable``
        else:
            value = body.read()
            if self.sealer.open_into(key, value, out, tenant):
                return True
        if self.sealer.droppable(key, value):
            log.warning("s3 tier: object %s failed verification: deleted", name)
            client.delete_object(Bucket=self.options.bucket, Key=name)
        return False

    def get_into(
        self, keys: Sequence[BlockKey], outs: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(outs, keys)
        names = [self.object_key(k, tenant) for k in keys]
        return self._each(
            lambda c, i: self._read_into(c, keys[i], names[i], outs[i], tenant), len(keys), False
        )

    def _upload(self, client: Any, name: str, value: memoryview) -> bool:
        """Store ``value`` unless ``name`` exists; True either way, raises on server errors."""
        bucket = self.options.bucket
        try:
            if len(value) < self.multipart_threshold:
                whole = value.obj if isinstance(value.obj, bytearray) else None
                body = whole if whole is not None and len(whole) == len(value) else bytes(value)
                client.put_object(Bucket=bucket, Key=name, Body=body, IfNoneMatch="*")
                return True
            upload_id = client.create_multipart_upload(Bucket=bucket, Key=name)["UploadId"]
            try:
                step = self.multipart_chunk
                offsets = range(0, len(value), step)

                def part(i: int) -> dict[str, Any]:
                    body = value[offsets[i] : offsets[i] + step]
                    r = client.upload_part(
                        Bucket=bucket,
                        Key=name,
                        UploadId=upload_id,
                        PartNumber=i + 1,
                        Body=io.BytesIO(body),
                    )
                    return {"ETag": r["ETag"], "PartNumber": i + 1}

                parts = list(self._parts.map(part, range(len(offsets))))
                client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=name,
                    UploadId=upload_id,
                    MultipartUpload={"Parts": parts},
                    IfNoneMatch="*",
                )
            except BaseException:
                client.abort_multipart_upload(Bucket=bucket, Key=name, UploadId=upload_id)
                raise
        except ClientError as exc:
            if error_code(exc) in _EXISTS:
                return True
            raise
        return True

    def put(
        self, keys: Sequence[BlockKey], blocks: Sequence[Array], tenant: str = ""
    ) -> list[bool]:
        self.check_buffers(blocks, keys)
        charge = self.quotas.active

        def one(client: Any, i: int) -> bool:
            name = self.object_key(keys[i], tenant)
            if charge and self._exists(client, name):
                return True  # kept as it is, and not charged again
            value = self.seal_charged(keys[i], blocks[i], tenant)
            if value is None:
                return False
            try:
                return self._upload(client, name, value)
            except BaseException:
                self.refund(tenant)  # not stored: the charge goes back
                raise

        return self._each(one, len(keys), False)

    def delete(self, keys: Sequence[BlockKey], tenant: str = "") -> None:
        if not keys:
            return
        names = [self.object_key(k, tenant) for k in keys]
        if self.quotas.active:  # refunds need to know which were present
            present = self._each(lambda c, i: self._exists(c, names[i]), len(names), False)
            names = [n for n, p in zip(names, present, strict=True) if p]
            self.refund(tenant, len(names))

        def drop() -> None:
            client = self.client()
            for start in range(0, len(names), 1000):  # DeleteObjects takes up to 1000 keys
                objs = [{"Key": n} for n in names[start : start + 1000]]
                client.delete_objects(
                    Bucket=self.options.bucket, Delete={"Objects": objs, "Quiet": True}
                )

        if names:
            self.guard(drop, None)

    def keys_of(self, tenant: str) -> Iterable[str]:
        """Object names held for ``tenant`` (a listing; for tools and tests)."""
        pages = (
            self.client()
            .get_paginator("list_objects_v2")
            .paginate(Bucket=self.options.bucket, Prefix=f"{self.prefix}/{tenant_token(tenant)}/")
        )
        for p in pages:
            for obj in p.get("Contents", []):
                yield str(obj["Key"])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._parts.shutdown(wait=True)
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()
