"""A checkpoint's files read as untrusted input, for validation (:mod:`tasks.validation.checkpoint`)
and the load check's process (:mod:`tasks.validation.load_check`) alike: digests hashed in
parallel and never past the size a manifest gives (its names were checked as it was read:
:func:`trainer.checkpointing.parse_manifest`), and the refusal to import the workload a
manifest names."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from trainer.checkpointing import FileEntry
from trainer.hashing import SHA256, file_digest


def hash_files(
    path: Path,
    names: list[str],
    digest: str = SHA256,
    *,
    limits: Mapping[str, int] | None = None,
) -> tuple[dict[str, FileEntry], float]:
    """name -> the entry (size, ``digest``) of every file of ``names`` present, and the MB/s.
    ``limits``: the sizes a manifest gives; a file that grew past its own is not read on (its
    digest is then "", which matches nothing)."""
    t0 = time.perf_counter()
    present = [n for n in names if (path / n).is_file()]

    def one(name: str) -> str:
        try:
            return file_digest(path / name, digest, limit=(limits or {}).get(name))
        except ValueError:
            return ""

    # hashlib and xxhash release the GIL on large buffers: threads hash files in parallel.
    with ThreadPoolExecutor(max_workers=min(8, (os.cpu_count() or 1) * 2)) as pool:
        digests = dict(zip(present, pool.map(one, present), strict=True))
    total = sum((path / n).stat().st_size for n in present)
    seconds = time.perf_counter() - t0
    files = {n: FileEntry(n, (path / n).stat().st_size, digests[n]) for n in present}
    return files, (total / 1e6 / seconds if seconds > 0 else 0.0)


def untrusted_workload_message(path: Path, ref: str) -> str:
    return (
        f"{path}: its manifest names the workload {ref!r}, which is code to import; a file on "
        f"the shared filesystem does not choose what runs. Name it yourself to use it: "
        f"--workload {ref}"
    )
