"""The state directory's S3 server against a local user without its keys (issue 43, item 4): a
table of requests to every port that holds its objects, each refused, and the object unchanged
afterwards. (The kept Prefect server's 401s and the UI's login: tests/test_local_services.py;
tampered secrets: tests/test_local_keys.py.)

SeaweedFS serves objects on more ports than S3's: its filer (+3) and volume server (+2) answered
any anonymous HTTP read, its master (+1) any admin request, and its gRPC ports (+10000 each) any
client, before the keys (tasks.storage.local_keys) and ``-disableHttp`` (the master and the
filer serve no HTTP at all now: 404; the volume server needs a JWT: 401)."""

from __future__ import annotations

import socket
import ssl
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from botocore.exceptions import ClientError

from tasks.storage.local_keys import keys_of, read_credentials
from tasks.storage.local_s3 import SharedServer, ensure_local_s3
from tasks.storage.s3 import S3Settings, boto3_client
from tests.helpers import free_s3_port

BUCKET, KEY, BODY = "held-bucket", "secret.bin", b"the run's data " * 300


@dataclass(frozen=True)
class Held:
    port: int
    settings: S3Settings  # with the keys
    keys: Path  # the secrets directory


@pytest.fixture(scope="module")
def held(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Held]:
    state = tmp_path_factory.mktemp("state")
    port = free_s3_port()
    base = S3Settings(endpoint_url=f"http://127.0.0.1:{port}")
    server: SharedServer | None = ensure_local_s3(base, state, user="owner")
    assert server is not None and server.started_here
    settings = server.settings(base)
    client = boto3_client(settings)
    client.create_bucket(Bucket=BUCKET)
    client.put_object(Bucket=BUCKET, Key=KEY, Body=BODY)
    try:
        yield Held(port, settings, keys_of(state / "s3").root)
    finally:
        server.release()


def _http(method: str, offset: int, path: str, body: bytes | None = None) -> Callable[[Held], int]:
    def call(h: Held) -> int:
        url = f"http://127.0.0.1:{h.port + offset}{path}"
        try:
            with urllib.request.urlopen(
                urllib.request.Request(url, data=body, method=method), timeout=10
            ) as r:
                return int(r.status)
        except urllib.error.HTTPError as e:
            return e.code

    return call


def _s3(credentials: Callable[[Held], dict[str, str]], op: str) -> Callable[[Held], str]:
    def call(h: Held) -> str:
        client = boto3_client(h.settings, credentials=credentials(h))
        try:
            if op == "get":
                client.get_object(Bucket=BUCKET, Key=KEY)
            elif op == "put":
                client.put_object(Bucket=BUCKET, Key=KEY, Body=b"overwritten")
            else:
                client.delete_object(Bucket=BUCKET, Key=KEY)
        except ClientError as e:
            return str(e.response["Error"]["Code"])
        return "served"

    return call


def _placeholder(h: Held) -> dict[str, str]:  # what an anonymous local server accepts
    return {"aws_access_key_id": "nvrx-local", "aws_secret_access_key": "nvrx-local"}


def _wrong_secret(h: Held) -> dict[str, str]:
    good = read_credentials(h.keys / "credentials")
    return {**good, "aws_secret_access_key": good["aws_secret_access_key"][::-1]}


def _grpc(offset: int) -> Callable[[Held], str]:
    """A TLS client of the private CA's, with no certificate of its own: the handshake (what
    the server demands), then the HTTP/2 preface."""

    def call(h: Held) -> str:
        ctx = ssl.create_default_context(cafile=str(h.keys / "ca.crt"))
        try:
            with (
                socket.create_connection(("127.0.0.1", h.port + offset), timeout=5) as raw,
                ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
            ):
                tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
                tls.settimeout(5)
                return "served" if tls.recv(9) else "closed"
        except ssl.SSLError as e:
            return "CERTIFICATE_REQUIRED" if "CERTIFICATE_REQUIRED" in str(e) else str(e)

    return call


ROWS: list[tuple[str, Callable[[Held], object], object]] = [
    ("S3, unsigned read", _http("GET", 0, f"/{BUCKET}/{KEY}"), 403),
    ("S3, unsigned write", _http("PUT", 0, f"/{BUCKET}/{KEY}", b"overwritten"), 403),
    ("S3, unsigned listing", _http("GET", 0, "/"), 403),
    ("S3, a placeholder key", _s3(_placeholder, "get"), "InvalidAccessKeyId"),
    ("S3, its key with a wrong secret, write", _s3(_wrong_secret, "put"), "SignatureDoesNotMatch"),
    (
        "S3, its key with a wrong secret, delete",
        _s3(_wrong_secret, "delete"),
        "SignatureDoesNotMatch",
    ),
    ("filer, read", _http("GET", 3, f"/buckets/{BUCKET}/{KEY}"), 404),
    ("filer, listing", _http("GET", 3, f"/buckets/{BUCKET}/"), 404),
    ("filer, write", _http("PUT", 3, f"/buckets/{BUCKET}/{KEY}", b"overwritten"), 404),
    ("filer, delete", _http("DELETE", 3, f"/buckets/{BUCKET}/{KEY}"), 404),
    ("volume server, read", _http("GET", 2, "/1,01"), 401),
    *(
        (f"gRPC +{off}, no client certificate", _grpc(off), "CERTIFICATE_REQUIRED")
        for off in range(10000, 10005)
    ),
]


@pytest.mark.parametrize("request_,refusal", [r[1:] for r in ROWS], ids=[r[0] for r in ROWS])
def test_a_client_without_the_keys_is_refused(held: Held, request_, refusal: object):
    assert request_(held) == refusal
    # and the object is as it was (a refused write or delete changed nothing)
    got = boto3_client(held.settings).get_object(Bucket=BUCKET, Key=KEY)["Body"].read()
    assert got == BODY


def test_the_keys_open_every_door_the_table_shuts(held: Held):
    """The control: with the keys the same server serves S3, and its gRPC ports complete the
    handshake for the node certificate, so each refusal above is the missing credential."""
    assert boto3_client(held.settings).get_object(Bucket=BUCKET, Key=KEY)["Body"].read() == BODY
    ctx = ssl.create_default_context(cafile=str(held.keys / "ca.crt"))
    ctx.load_cert_chain(str(held.keys / "node.crt"), str(held.keys / "node.key"))
    with (
        socket.create_connection(("127.0.0.1", held.port + 10001), timeout=5) as raw,
        ctx.wrap_socket(raw, server_hostname="127.0.0.1") as tls,
    ):
        tls.sendall(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n")
        tls.settimeout(5)
        assert tls.recv(9)[3] == 0x04  # the server's SETTINGS frame


def test_the_masters_admin_port_refuses_a_client_without_the_keys(held: Held):
    """The master's admin requests (delete a bucket's collection, grow volumes, assign a file
    id, write a blob through it) answered anyone before ``-disableHttp``; a bucket of its own
    (``doomed-bucket``), whose object must stay readable."""
    client = boto3_client(held.settings)
    client.create_bucket(Bucket="doomed-bucket")
    client.put_object(Bucket="doomed-bucket", Key=KEY, Body=BODY)
    # SeaweedFS guards these by client IP only: the master runs with no HTTP at all.
    for path in ("/col/delete?collection=doomed-bucket", "/vol/grow?count=1", "/dir/assign"):
        assert _http("GET", 1, path)(held) == 404, path
    assert _http("POST", 1, "/submit", b"a blob")(held) == 404
    assert client.get_object(Bucket="doomed-bucket", Key=KEY)["Body"].read() == BODY
