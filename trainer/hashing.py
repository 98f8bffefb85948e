"""File digests (sha256, streamed), shared by the dataset and checkpoint manifests."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def read_capped(
    src: BinaryIO,
    limit: int,
    *,
    out: BinaryIO | None = None,
    on_bytes: Callable[[int], None] | None = None,
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
