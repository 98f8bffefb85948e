"""File digests (sha256, streamed), shared by the dataset and checkpoint manifests."""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from pathlib import Path

_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()


def sha256_capped(path: Path, limit: int, on_bytes: Callable[[int], None] | None = None) -> str:
    """The sha256 of a file expected to hold ``limit`` bytes, reading at most one byte past it
    (a file on a shared filesystem or from a bucket is untrusted: one far larger than its
    manifest says is not read to its end). ValueError when it holds more. ``on_bytes``: called
    with each chunk's size (progress)."""
    h = hashlib.sha256()
    seen = 0
    with open(path, "rb") as f:
        while chunk := f.read(min(_CHUNK, limit + 1 - seen)):
            seen += len(chunk)
            if seen > limit:
                raise ValueError(f"{path} holds more than the {limit} bytes expected")
            h.update(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return h.hexdigest()
