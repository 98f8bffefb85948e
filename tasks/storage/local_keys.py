"""The embedded S3 server's secrets (issue 43): generated once per state directory, kept in
``<state>/s3/secrets/`` (0700, each file 0600), never in a run's parameters or events.

SeaweedFS serves every object on four ports, and S3 access keys guard only one: its filer
(S3 port +3) and volume server (+2) answered anonymous HTTP reads of any object, and their gRPC
ports any client. So the secrets are three locks, each where SeaweedFS looks for it:
- ``credentials``: the S3 access key, in the AWS shared-credentials format (profile
  ``nvrx-local``), so boto3, s3fs and the aws CLI read it as it is
  (``AWS_SHARED_CREDENTIALS_FILE=... AWS_PROFILE=nvrx-local``); ``identities.json``, the same
  key as the S3 gateway's only identity (no anonymous identity: an unsigned request gets 403);
- ``security.toml``: JWT signing keys for the filer's and the volume server's HTTP reads and
  writes (the S3 gateway signs its own requests; anyone else gets 401);
- a private CA and one certificate (``ca.crt``, ``node.crt``, ``node.key``) that every gRPC
  endpoint requires of its clients (mutual TLS), named by ``security.toml``.
A fourth lock is not a secret: the master's and the filer's HTTP are off (``-disableHttp`` in
``tasks.storage.local_s3``); the master's took admin requests from anyone (``/col/delete``
dropped a bucket's data), guarded by client IP only.

The directory is made whole in a temporary sibling and renamed into place, so a crash never
leaves half a set; an existing one is used only when it is this user's alone."""

from __future__ import annotations

import configparser
import datetime
import ipaddress
import json
import os
import secrets
import shutil
import stat
from dataclasses import dataclass
from pathlib import Path

from tasks.errors import StorageError
from trainer.run_files import UnsafeFile, read_small

SECRETS_DIR = "secrets"
PROFILE = "nvrx-local"
CREDENTIALS = "credentials"
IDENTITIES = "identities.json"
SECURITY = "security.toml"
_CERTS = ("ca.crt", "node.crt", "node.key")
FILES = (CREDENTIALS, IDENTITIES, SECURITY, *_CERTS)
MAX_FILE_BYTES = 16 * 1024  # each is under 2 KiB
_CN = "nvrx-local"
# Every gRPC role SeaweedFS has: one certificate serves them all (one process, one host).
_GRPC_ROLES = (
    "master",
    "volume",
    "filer",
    "s3",
    "msg_broker",
    "msg_agent",
    "admin",
    "worker",
    "mq",
)


@dataclass(frozen=True)
class LocalKeys:
    """Where the state directory's server keeps its secrets (nothing secret in this object)."""

    root: Path

    @property
    def credentials(self) -> Path:
        return self.root / CREDENTIALS

    @property
    def identities(self) -> Path:
        return self.root / IDENTITIES


def keys_of(data_dir: Path) -> LocalKeys:
    return LocalKeys(Path(data_dir).absolute() / SECRETS_DIR)


def ensure_keys(data_dir: Path) -> LocalKeys:
    """This data directory's secrets, generated on first use. The caller holds the state lock."""
    keys = keys_of(data_dir)
    if keys.root.exists() or keys.root.is_symlink():
        check_private(keys.root, directory=True)
        for name in FILES:
            check_private(keys.root / name)
        return keys
    keys.root.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    tmp = keys.root.with_name(f".{SECRETS_DIR}-{secrets.token_hex(8)}")
    os.mkdir(tmp, 0o700)
    try:
        _write_all(tmp, final=keys.root)
        os.rename(tmp, keys.root)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return keys


def check_private(path: Path, *, directory: bool = False, what: str = "", fix: str = "") -> None:
    """``path`` must be this user's own, no link, and neither readable nor writable by anyone
    else: a key another user can read is no key, and one they can write is theirs. ``what``
    and ``fix`` word the error (default: this module's secrets, and regenerating them)."""
    what = what or "the local S3 server's secrets"
    fix = fix or (
        f"remove {path if directory else path.parent} to generate new ones (the server's data "
        "stays; clients then need the new keys)"
    )
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise StorageError(f"{path}: missing ({what}); {fix}") from None
    kind_ok = stat.S_ISDIR(st.st_mode) if directory else stat.S_ISREG(st.st_mode)
    if not kind_ok or st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise StorageError(
            f"{path}: {what} must be this user's own {'directory' if directory else 'file'}, "
            f"mode {'0700' if directory else '0600'} (found uid {st.st_uid}, mode "
            f"{stat.filemode(st.st_mode)}); fix the owner and mode, or {fix}"
        )


def read_credentials(path: Path) -> dict[str, str]:
    """boto3 keyword arguments from a ``credentials`` file this module wrote."""
    text = read_private(path)
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text.decode("utf-8"))
        section = parser[PROFILE]
        return {
            "aws_access_key_id": section["aws_access_key_id"],
            "aws_secret_access_key": section["aws_secret_access_key"],
        }
    except (configparser.Error, KeyError, UnicodeDecodeError) as e:
        raise StorageError(
            f"{path}: no [{PROFILE}] profile with both keys ({type(e).__name__}); remove "
            f"{path.parent} to generate new ones"
        ) from None


def read_private(
    path: Path, *, limit: int = MAX_FILE_BYTES, what: str = "", fix: str = ""
) -> bytes:
    """A secret's bytes: :func:`check_private`, then at most ``limit`` of them, read as every
    small file the project trusts no further than it must (``run_files.read_small``)."""
    check_private(path, what=what, fix=fix)
    try:
        data = read_small(path, limit=limit)
    except UnsafeFile:
        raise StorageError(f"{path}: over {limit} bytes, not a secret written here") from None
    if data is None:
        raise StorageError(f"{path}: removed while it was read") from None
    return data


def create_private(path: Path, data: bytes) -> None:
    """Create ``path`` with ``data``, 0600, exclusively (FileExistsError when it is there: two
    creators agree on the first one's), never through a link, synced."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


def _write_all(tmp: Path, *, final: Path) -> None:
    """Every file, into ``tmp``; paths inside them name ``final`` (where ``tmp`` is renamed)."""
    access, secret = "NVRX" + secrets.token_hex(8).upper(), secrets.token_urlsafe(30)
    creds = f"[{PROFILE}]\naws_access_key_id = {access}\naws_secret_access_key = {secret}\n"
    create_private(tmp / CREDENTIALS, creds.encode())
    identity = {
        "name": PROFILE,
        "credentials": [{"accessKey": access, "secretKey": secret}],
        "actions": ["Admin", "Read", "Write", "List", "Tagging"],
    }
    create_private(tmp / IDENTITIES, json.dumps({"identities": [identity]}).encode())
    for name, pem in zip(_CERTS, _certificates(), strict=True):
        create_private(tmp / name, pem)
    create_private(tmp / SECURITY, _security_toml(final).encode())


def _security_toml(root: Path) -> str:
    ca, crt, key = (str(root / n) for n in _CERTS)
    jwt = "".join(
        f'[{section}]\nkey = "{secrets.token_urlsafe(32)}"\nexpires_after_seconds = 10\n'
        for section in (
            "jwt.signing",
            "jwt.signing.read",
            "jwt.filer_signing",
            "jwt.filer_signing.read",
        )
    )
    grpc = "".join(
        f'[grpc.{role}]\ncert = "{crt}"\nkey = "{key}"\nclient_cert = "{crt}"\n'
        f'client_key = "{key}"\nallowed_commonNames = "{_CN}"\n'
        for role in _GRPC_ROLES
    )
    client = f'[grpc.client]\ncert = "{crt}"\nkey = "{key}"\n'
    return f'{jwt}[access]\nui = false\n[grpc]\nca = "{ca}"\n{grpc}{client}'


def _certificates() -> tuple[bytes, bytes, bytes]:
    """A private CA and one certificate for 127.0.0.1, both ways (server and client auth):
    PEM of the CA's certificate, the node's certificate and the node's key."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)
    start, end = now - datetime.timedelta(minutes=5), now + datetime.timedelta(days=3650)

    def name(cn: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])

    ca_key, node_key = (
        ec.generate_private_key(ec.SECP256R1()),
        ec.generate_private_key(ec.SECP256R1()),
    )
    ca = (
        x509.CertificateBuilder()
        .subject_name(name(f"{_CN}-ca"))
        .issuer_name(name(f"{_CN}-ca"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    sans = [x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
    usage = [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
    node = (
        x509.CertificateBuilder()
        .subject_name(name(_CN))
        .issuer_name(ca.subject)
        .public_key(node_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(start)
        .not_valid_after(end)
        .add_extension(x509.SubjectAlternativeName(sans), critical=False)
        .add_extension(x509.ExtendedKeyUsage(usage), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    key_pem = node_key.private_bytes(
        pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    return ca.public_bytes(pem), node.public_bytes(pem), key_pem
