"""File digests, streamed: sha256 (datasets, exports, everything checked outside this project)
and xxh3-128 (the durable checkpoint's files, arch §3: a checksum against corruption, ~7x faster
than sha256 here; what is trusted comes from where a manifest lives, never from its digests)."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO, Protocol

import xxhash

_CHUNK = 8 << 20

SHA256 = "sha256"
XXH3_128 = "xxh3_128"
# The digests a manifest may name, with the hex digits of each: what a well-formed entry holds.
HEX_DIGITS: dict[str, int] = {SHA256: 64, XXH3_128: 32}


class Hasher(Protocol):
    def update(self, data: bytes | bytearray | memoryview, /) -> None: ...

    def digest(self) -> bytes: ...

    def hexdigest(self) -> str: ...


def new_hasher(algorithm: str) -> Hasher:
    """A fresh hasher of ``algorithm`` (one of :data:`HEX_DIGITS`); ValueError for any other."""
    if algorithm == SHA256:
        return hashlib.sha256()
    if algorithm == XXH3_128:
        # Streamed updates give the digest of one call over the whole (tested); it releases the
        # GIL and reads a memoryview in place.
        return xxhash.xxh3_128()
    raise ValueError(f"unknown digest {algorithm!r} (known: {', '.join(HEX_DIGITS)})")


def file_digest(path: Path, algorithm: str, *, limit: int | None = None) -> str:
    """The ``algorithm`` digest of a file, read once through one reused buffer. ``limit``: the
    size a manifest gives it; an untrusted file that holds more is never read past ``limit + 1``
    bytes (ValueError)."""
    h = new_hasher(algorithm)
    view = memoryview(bytearray(_CHUNK))
    seen = 0
    with open(path, "rb", buffering=0) as f:
        while True:
            want = _CHUNK if limit is None else min(_CHUNK, limit + 1 - seen)
            n = f.readinto(view[:want]) if want > 0 else 0
            if not n:
                break
            seen += n
            if limit is not None and seen > limit:
                raise ValueError(f"{path} holds more than the {limit} bytes expected")
            h.update(view[:n])
    return h.hexdigest()


def sha256_file(path: Path) -> str:
    return file_digest(path, SHA256)


def read_capped(
    src: BinaryIO,
    limit: int,
    *,
    out: BinaryIO | None = None,
    on_bytes: Callable[[int], None] | None = None,
    also: Hasher | None = None,
) -> tuple[int, str]:
    """Stream ``src`` (into ``out`` when given), digesting it, and stop one byte past
    ``limit``: a file or object that is untrusted (the shared filesystem, a bucket) and far
    larger than its manifest says is never read, nor copied, to its end. The bytes read
    (``limit + 1`` at most: more than expected) and the sha256 of the first ``limit``.
    ``on_bytes``: called with each chunk's size (progress)."""
    h = hashlib.sha256()
    seen = 0
    while seen <= limit and (chunk := src.read(min(_CHUNK, limit + 1 - seen))):
        seen += len(chunk)
        if seen > limit:
            break
        h.update(chunk)
        if also is not None:  # a second digest of the same bytes (another algorithm's)
            also.update(chunk)
        if out is not None:
            out.write(chunk)
        if on_bytes is not None:
            on_bytes(len(chunk))
    return seen, h.hexdigest()


def sha256_capped(path: Path, limit: int, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 of a file expected to hold ``limit`` bytes (:func:`read_capped`); ValueError
    when it holds more."""
    with open(path, "rb") as f:
        seen, digest = read_capped(f, limit, on_bytes=on_bytes)
    if seen > limit:
        raise ValueError(f"{path} holds more than the {limit} bytes expected")
    return digest
