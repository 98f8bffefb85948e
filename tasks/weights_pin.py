"""The initial weights' canonical digest: what ``initial_weights.sha256`` pins.

The weights are the files hydration copies: the objects at the top level of the directory or
S3 prefix whose plain name ends in ``.safetensors`` or ``.json`` (anything else, a pickled
``*.bin`` or a README, is never fetched, so it is not pinned either). Their *listing* is one line
per file, sorted by name (byte order)::

    <sha256 of the file: 64 lowercase hex digits>  <size in bytes, decimal>  <name>\\n

two spaces between the fields; a name is ``[A-Za-z0-9][A-Za-z0-9._-]*`` (no space, no newline),
so the text is unambiguous. The *digest* is the sha256 of the listing's ASCII bytes.
``nvrx-pipeline weights-digest DIR|s3://bucket/prefix`` prints both, and, with ``--write``,
writes the listing into DIR as ``weights.sha256``: uploaded with the weights, it lets hydration
name a file that differs before anything lands (``sha256sum weights.sha256`` prints the digest).
In Python: ``tasks.weights_pin.local_listing(Path(DIR)).digest()``.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import HydrationError
from trainer.hashing import sha256_capped

# Only these are ever fetched (and only safetensors are ever loaded): no pickles.
WEIGHT_SUFFIXES = (".safetensors", ".json")
# Used with fullmatch: "$" would accept a trailing newline.
SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,200}")
SHA256_HEX = re.compile(r"[0-9a-f]{64}")
# The listing as a file beside the weights: not a weight file itself (its suffix), so the
# digest never covers it.
LISTING_NAME = "weights.sha256"
MAX_LISTING_BYTES = 1 << 20  # ~10 000 files: read no further, whatever the object's size
GIB = 1 << 30
DEFAULT_MAX_GIB = 64  # the form's default cap (initial_weights.max_gib)
_LINE = re.compile(r"([0-9a-f]{64})  (0|[1-9][0-9]{0,15})  (" + SAFE_NAME.pattern + ")")


@dataclass(frozen=True)
class WeightsPin:
    """What a run asks of its initial weights (the form's ``initial_weights``)."""

    sha256: str | None = None  # the listing's digest; None: not pinned
    max_bytes: int = DEFAULT_MAX_GIB * GIB  # the listed sizes' sum, at most


UNPINNED = WeightsPin()  # no digest, the default cap


@dataclass(frozen=True)
class WeightFile:
    name: str
    size: int
    sha256: str

    def line(self) -> str:
        return f"{self.sha256}  {self.size}  {self.name}\n"


@dataclass(frozen=True)
class WeightsListing:
    """Every weight file's name, size and sha256, sorted by name."""

    files: tuple[WeightFile, ...]

    @classmethod
    def of(cls, files: list[WeightFile]) -> WeightsListing:
        ordered = tuple(sorted(files, key=lambda f: f.name.encode()))
        names = [f.name for f in ordered]
        if len(set(names)) != len(names):
            raise HydrationError(f"weights listing: a name appears twice in {names}")
        return cls(ordered)

    def text(self) -> str:
        return "".join(f.line() for f in self.files)

    def digest(self) -> str:
        import hashlib

        return hashlib.sha256(self.text().encode("ascii")).hexdigest()

    def by_name(self) -> dict[str, WeightFile]:
        return {f.name: f for f in self.files}

    @classmethod
    def parse(cls, raw: bytes, source: str) -> WeightsListing:
        """A listing read from somewhere untrusted (a bucket, the shared filesystem): every line
        well-formed, or HydrationError naming ``source`` and the line."""
        if len(raw) > MAX_LISTING_BYTES:
            raise HydrationError(f"{source}: more than {MAX_LISTING_BYTES} bytes")
        try:
            text = raw.decode("ascii")
        except UnicodeDecodeError:
            raise HydrationError(f"{source}: not ASCII text") from None
        files = []
        for i, line in enumerate(text.splitlines(keepends=True), start=1):
            m = _LINE.fullmatch(line.removesuffix("\n"))
            if m is None or not line.endswith("\n"):
                raise HydrationError(f"{source}: line {i} is not '<sha256>  <size>  <name>'")
            files.append(WeightFile(m[3], int(m[2]), m[1]))
        listing = cls.of(files)
        if listing.text() != text:
            raise HydrationError(f"{source}: lines not sorted by name")
        return listing


def is_weight_file(name: str) -> bool:
    return name.endswith(WEIGHT_SUFFIXES)


def check_name(name: str, where: str) -> None:
    """Names are untrusted (they become paths): plain file names, no leading dot."""
    if not SAFE_NAME.fullmatch(name):
        raise HydrationError(f"initial weights {where}: refusing the object name {name!r}")


def local_listing(directory: Path) -> WeightsListing:
    """The listing of a local weights directory (the one a user uploads)."""
    if not directory.is_dir():
        raise HydrationError(f"{directory}: not a directory")
    files = []
    for path in directory.iterdir():
        if not (path.is_file() and is_weight_file(path.name)):
            continue
        check_name(path.name, str(directory))
        size = path.stat().st_size
        files.append(WeightFile(path.name, size, sha256_capped(path, size)))
    return WeightsListing.of(files)


def s3_entries(fs: Any, uri: str) -> list[tuple[str, int]]:
    """(name, listed size) of every weight file under an S3 prefix: what hydration fetches."""
    src = uri.removeprefix("s3://").rstrip("/")
    try:
        listing = fs.ls(src, detail=True, refresh=True)
    except FileNotFoundError as e:
        raise HydrationError(f"initial weights {uri} not found") from e
    entries = []
    for item in listing:
        name = str(item["name"]).rsplit("/", 1)[-1]
        if item.get("type") != "file" or not is_weight_file(name):
            continue
        check_name(name, uri)
        entries.append((name, int(item["size"])))
    return entries


def s3_listing(fs: Any, uri: str) -> WeightsListing:
    """The listing of an S3 prefix, each object streamed no further than its listed size."""
    from trainer.hashing import read_capped

    src = uri.removeprefix("s3://").rstrip("/")
    files = []
    for name, size in s3_entries(fs, uri):
        with fs.open(f"{src}/{name}", "rb", block_size=8 << 20) as f:
            n, digest = read_capped(f, size)
        if n != size:
            raise HydrationError(f"{uri}/{name}: {n} bytes where the listing says {size}")
        files.append(WeightFile(name, size, digest))
    return WeightsListing.of(files)
