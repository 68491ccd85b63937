"""The S3 tier when S3 refuses one request, and when it cannot serve at all.

A refusal about one object (``AccessDenied`` on a prefix, an archived object's
``InvalidObjectState``, a denied listing or lifecycle call) is that request's miss: the rest of
the batch is served and the tier stays in service. A server that cannot serve (``SlowDown``,
``InternalError``) takes the tier out of service until a trial succeeds.

Errors are real HTTP answers: moto's own (an archived object), or injected by ``FaultProxy``, a
small proxy in front of the session's moto server that answers chosen paths with an S3 error.
"""

from __future__ import annotations

import contextlib
import http.client
import socket
import threading
import time
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import boto3
import pytest

from kvtier.tiers.s3 import S3Options, S3Tier
from tests.tier_conformance import LAYOUT, empty_block, rand_block, rand_key

pytestmark = [pytest.mark.server, pytest.mark.timeout(120)]
BUCKET = "kvtier-faults"
COOLDOWN_S = 0.3
_HOP = {"connection", "keep-alive", "transfer-encoding", "expect", "content-length"}


class FaultProxy:
    """HTTP on 127.0.0.1 in front of ``upstream``: a request whose ``"METHOD path"`` (path with
    query) contains a key of ``faults`` is answered ``faults[key] = (status, code)`` as S3 would
    (an XML error body, none for HEAD); every other request goes to ``upstream`` unchanged."""

    def __init__(self, upstream: str) -> None:
        self.faults: dict[str, tuple[int, str]] = {}
        self.injected = 0
        port = urlsplit(upstream).port
        assert port is not None
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def handle_any(self) -> None:
                assert "chunked" not in self.headers.get("Transfer-Encoding", "")
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                request = f"{self.command} {self.path}"
                fault = next((f for m, f in proxy.faults.items() if m in request), None)
                if fault is not None:
                    proxy.injected += 1
                    status, code = fault
                    xml = f"<Error><Code>{code}</Code><Message>injected</Message></Error>"
                    payload = b"" if self.command == "HEAD" else xml.encode()
                    self.send_response(status)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    self.wfile.write(payload)
                    return
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                try:
                    headers = {k: v for k, v in self.headers.items() if k.lower() not in _HOP}
                    headers["Content-Length"] = str(len(body))
                    conn.request(self.command, self.path, body=body, headers=headers)
                    resp = conn.getresponse()
                    data = resp.read()
                    self.send_response_only(resp.status)
                    for k, v in resp.getheaders():
                        if k.lower() not in _HOP:
                            self.send_header(k, v)
                    length = resp.getheader("Content-Length") if self.command == "HEAD" else None
                    self.send_header("Content-Length", length or str(len(data)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(data)
                finally:
                    conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_any

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self._thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server.server_address[1]}"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def proxy(s3_endpoint: str) -> Iterator[FaultProxy]:
    p = FaultProxy(s3_endpoint)
    yield p
    p.close()


def _tier(endpoint: str, **kw: Any) -> S3Tier:
    opts = S3Options(bucket=BUCKET, endpoint_url=endpoint, workers=4, timeout=2.0)
    return S3Tier(
        LAYOUT,
        opts,
        prefix="f" + uuid.uuid4().hex[:12],
        create_bucket=True,
        cooldown_s=COOLDOWN_S,
        **({} if "sealer" in kw else {"secret": b"test-secret"}) | kw,
    )


@pytest.mark.parametrize(
    ("status", "code"), [(403, "AccessDenied"), (403, "InvalidObjectState"), (400, "KeyTooLong")]
)
def test_a_refused_key_is_a_miss_and_the_batch_goes_on(
    proxy: FaultProxy, status: int, code: str
) -> None:
    tier = _tier(proxy.url)
    try:
        keys = [rand_key() for _ in range(3)]
        blocks = [rand_block(seed=i) for i in range(3)]
        assert tier.put(keys, blocks) == [True] * 3
        proxy.faults[tier.object_key(keys[1], "")] = (status, code)
        outs = [empty_block() for _ in keys]
        assert tier.get_into(keys, outs) == [True, False, True]
        assert outs[0].tobytes() == blocks[0].tobytes()
        assert outs[2].tobytes() == blocks[2].tobytes()
        assert tier.contains_prefix(keys) == 1  # the refused HEAD ends the prefix
        assert tier.contains_prefix(keys[2:]) == 1  # ... and nothing else
        new = rand_key()
        proxy.faults[tier.object_key(new, "")] = (status, code)
        assert tier.put([new, rand_key()], blocks[:2]) == [False, True]
        assert tier.healthy and tier.breaker.trips == 0 and tier.breaker.skipped == 0
        assert tier.refusals >= 3 and proxy.injected >= 3
    finally:
        tier.close()


def test_an_archived_object_is_a_miss(s3_endpoint: str) -> None:
    """A block a lifecycle rule moved to GLACIER answers GET with InvalidObjectState (moto's
    own answer): a miss, while the blocks next to it load."""
    tier = _tier(s3_endpoint)
    try:
        a, b = rand_key(), rand_key()
        block = rand_block(seed=1)
        assert tier.put([a], [block]) == [True]
        client = tier.client()
        value = client.get_object(Bucket=BUCKET, Key=tier.object_key(a, ""))["Body"].read()
        client.put_object(
            Bucket=BUCKET, Key=tier.object_key(b, ""), Body=value, StorageClass="GLACIER"
        )
        outs = [empty_block(), empty_block()]
        assert tier.get_into([b, a], outs) == [False, True]
        assert outs[1].tobytes() == block.tobytes()
        assert tier.healthy and tier.breaker.trips == 0 and tier.refusals == 1
    finally:
        tier.close()


def test_denied_listing_and_lifecycle_leave_the_tier_in_service(proxy: FaultProxy) -> None:
    """Credentials without ListBucket or PutLifecycleConfiguration are common: ``usage`` is 0
    and the TTL rule is skipped (logged), but blocks are stored and loaded."""
    proxy.faults["list-type=2"] = (403, "AccessDenied")
    proxy.faults["?lifecycle"] = (403, "AccessDenied")
    tier = _tier(proxy.url, ttl_days=7)
    try:
        k, block = rand_key(), rand_block(seed=2)
        assert tier.put([k], [block]) == [True]
        out = empty_block()
        assert tier.get_into([k], [out]) == [True] and out.tobytes() == block.tobytes()
        assert tier.usage().used_blocks == 0
        assert tier.healthy and tier.breaker.trips == 0
    finally:
        tier.close()


def test_unreadable_lifecycle_rules_are_not_overwritten(
    proxy: FaultProxy, s3_endpoint: str
) -> None:
    """Credentials that may write the bucket's lifecycle configuration but not read it: the
    TTL rule is skipped (logged), since writing it would replace the rules we could not read."""
    bucket = "kvtier-rules-" + uuid.uuid4().hex[:8]
    admin = boto3.client("s3", endpoint_url=s3_endpoint, region_name="us-east-1")
    admin.create_bucket(Bucket=bucket)
    theirs = {"ID": "theirs", "Status": "Enabled", "Filter": {"Prefix": "logs/"}}
    admin.put_bucket_lifecycle_configuration(
        Bucket=bucket,
        LifecycleConfiguration={"Rules": [{**theirs, "Expiration": {"Days": 30}}]},
    )
    proxy.faults[f"GET /{bucket}?lifecycle"] = (403, "AccessDenied")
    opts = S3Options(bucket=bucket, endpoint_url=proxy.url, workers=4, timeout=2.0)
    tier = S3Tier(LAYOUT, opts, ttl_days=7, cooldown_s=COOLDOWN_S, secret=b"test-secret")
    try:
        k, block = rand_key(), rand_block(seed=4)
        assert tier.put([k], [block]) == [True]
        assert proxy.injected == 1  # the read was refused
        rules = admin.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]
        assert [r["ID"] for r in rules] == ["theirs"]
        assert tier.healthy and tier.breaker.trips == 0
    finally:
        tier.close()


class HungServer:
    """A TCP listener on 127.0.0.1 that accepts connections (counted) and never answers: an S3
    endpoint that stopped serving."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.accepted: list[socket.socket] = []
        self._thread = threading.Thread(target=self._accept, daemon=True)
        self._thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.sock.getsockname()[1]}"

    def _accept(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                self.accepted.append(self.sock.accept()[0])

    def close(self) -> None:
        self.sock.close()
        for conn in self.accepted:
            conn.close()


def test_a_request_to_a_hung_server_is_sent_once() -> None:
    """boto3 retries are off: a request that times out is not sent again, so it costs one
    timeout (botocore's ``max_attempts`` counts retries: 1 meant two attempts)."""
    hung = HungServer()
    timeout = 0.5
    opts = S3Options(bucket=BUCKET, endpoint_url=hung.url, workers=4, timeout=timeout)
    tier = S3Tier(LAYOUT, opts, cooldown_s=60.0, secret=b"test-secret")
    try:
        tier.client()  # built now (no request), not inside the timed call
        t0 = time.monotonic()
        assert tier.get_into([rand_key()], [empty_block()]) == [False]
        took = time.monotonic() - t0
        time.sleep(0.1)  # let the listener accept a second attempt, were there one
        assert len(hung.accepted) == 1
        assert took < 1.6 * timeout, f"one request took {took:.2f}s at timeout {timeout}s"
        assert not tier.healthy
    finally:
        tier.close()
        hung.close()


@pytest.mark.parametrize(("status", "code"), [(503, "SlowDown"), (500, "InternalError")])
def test_a_server_that_cannot_serve_opens_the_breaker_then_recovers(
    proxy: FaultProxy, status: int, code: str
) -> None:
    tier = _tier(proxy.url)
    try:
        k, block = rand_key(), rand_block(seed=3)
        assert tier.put([k], [block]) == [True]
        proxy.faults[tier.object_key(k, "")] = (status, code)
        assert tier.get_into([k], [empty_block()]) == [False]
        assert not tier.healthy and tier.breaker.trips == 1 and tier.refusals == 0
        proxy.faults.clear()
        time.sleep(COOLDOWN_S + 0.1)
        out = empty_block()
        assert tier.get_into([k], [out]) == [True] and out.tobytes() == block.tobytes()
        assert tier.healthy
    finally:
        tier.close()
