"""File digests (sha256, streamed), shared by the dataset and checkpoint manifests."""

from __future__ import annotations

import hashlib
from pathlib import Path

_CHUNK = 8 << 20


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(_CHUNK):
            h.update(chunk)
    return h.hexdigest()
