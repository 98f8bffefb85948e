"""Hydration: copy a dataset prefix from S3 into the run's "FSx" directory, verified against the
dataset manifest. Idempotent: files already present with the right size and digest are skipped;
the local ``dataset.json`` is written last, so a half-hydrated directory never looks complete."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import HydrationError
from trainer.data import (
    MANIFEST,
    MAX_MANIFEST_BYTES,
    DataError,
    DatasetManifest,
    ShardFile,
    load_manifest,
    verify_dataset,
)
from trainer.hashing import read_capped, sha256_file


@dataclass
class HydrateReport:
    source: str
    dest: str
    files: int
    downloaded: int
    skipped: int
    bytes_downloaded: int
    seconds: float
    # The digest of the manifest every file was checked against (DatasetManifest.digest): the
    # workers then check sizes only (a dataset of weights has none).
    manifest_sha256: str | None = None

    @classmethod
    def of(cls, source: str, dest: Path, got: list[int], t0: float, **kw: Any) -> HydrateReport:
        """``got``: each file's bytes downloaded (0: already present)."""
        seconds = round(time.perf_counter() - t0, 3)
        n = sum(1 for g in got if g)
        return cls(source, str(dest), len(got), n, len(got) - n, sum(got), seconds, **kw)


def _local_ok(path: Path, entry: ShardFile) -> bool:
    return (
        not path.is_symlink()  # a link is replaced by the real file, never written through
        and path.is_file()
        and path.stat().st_size == entry.bytes
        and sha256_file(path) == entry.sha256
    )


def _symlink_on(path: Path) -> Path | None:
    """The first component of ``path`` (absolute) that is a symbolic link, if any."""
    current = Path(path.anchor)
    for part in path.parts[1:]:
        current = current / part
        if current.is_symlink():
            return current
    return None


@contextlib.contextmanager
def staged_destination(dest: Path) -> Iterator[tuple[Path, Path]]:
    """``dest``, created, after refusing a destination that is, or goes through, a symbolic link:
    the shared filesystem is writable by others, and a link planted there would send hydration's
    writes somewhere else (checked before and after creating it: a link made in between); and
    a private directory in it (unguessable name, mode 0700) for files being written: a name
    known in advance (``.x.part``) could be planted as a link to a file elsewhere."""
    dest = Path(os.path.abspath(dest))
    for _ in range(2):
        link = _symlink_on(dest)
        if link is not None:
            raise HydrationError(
                f"hydration destination {dest} goes through the symbolic link {link} -> "
                f"{os.readlink(link)}: refusing to write through it; pass the real directory "
                f"({os.path.realpath(dest)}) if that is where the data belongs"
            )
        dest.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".hydrate-", dir=dest))
    try:
        yield dest, staging
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def _read_manifest(fs: Any, src: str) -> DatasetManifest:
    try:
        # Untrusted: never read past the cap, whatever the object's size. Names are joined onto
        # dest, sizes bound every read: checked before any read or write.
        raw = fs.cat_file(f"{src}/{MANIFEST}", start=0, end=MAX_MANIFEST_BYTES + 1)
        return DatasetManifest.parse(raw, source=f"s3://{src}/{MANIFEST}")
    except FileNotFoundError as e:
        raise HydrationError(f"dataset manifest s3://{src}/{MANIFEST} not found") from e
    except DataError as e:
        raise HydrationError(str(e)) from e


def hydrate_dataset(
    fs: Any,
    bucket: str,
    prefix: str,
    dest: Path,
    *,
    progress: Callable[[int, int, str], None] = lambda done, total, name: None,
    max_workers: int = 4,
) -> HydrateReport:
    """``fs`` is an s3fs filesystem. Raises :class:`HydrationError` naming the file at fault."""
    t0 = time.perf_counter()
    src = f"{bucket}/{prefix}".rstrip("/")
    manifest = _read_manifest(fs, src)
    files = manifest.files
    with staged_destination(dest) as (dest, staging):

        def fetch(entry: ShardFile) -> int:
            """Bytes downloaded for this file (0: already present and verified)."""
            name, size = entry.name, entry.bytes
            if _local_ok(dest / name, entry):
                return 0
            try:
                n, digest = stream_capped(fs, f"{src}/{name}", staging / name, size)
            except FileNotFoundError as e:
                raise HydrationError(
                    f"s3://{src}/{name} is listed in the manifest but missing"
                ) from e
            if n != size or digest != entry.sha256:
                raise HydrationError(
                    f"s3://{src}/{name} does not match the dataset manifest (size or sha256): the "
                    "source is corrupt"
                )
            os.replace(staging / name, dest / name)
            return size

        got = []
        # Several files at once: one stream rarely fills the link; results come back in order.
        with ThreadPoolExecutor(max_workers=max_workers) as pool:
            for i, (entry, n) in enumerate(zip(files, pool.map(fetch, files), strict=True)):
                got.append(n)
                progress(i + 1, len(files), entry.name)
        manifest.write(staging)  # the private directory: no name there can be planted
        os.replace(staging / MANIFEST, dest / MANIFEST)
    try:
        written = verify_dataset(dest, digests=False)  # digests were checked file by file above
    except DataError as e:
        raise HydrationError(str(e)) from e
    return HydrateReport.of(f"s3://{src}", dest, got, t0, manifest_sha256=written.digest())


def stream_capped(fs: Any, path: str, out: Path, size: int) -> tuple[int, str]:
    """Stream ``path`` into ``out``, digesting it, no further than one byte past ``size`` (the
    manifest's; :func:`trainer.hashing.read_capped`): the bytes read and the sha256."""
    with fs.open(path, "rb", block_size=8 << 20) as src, open(out, "wb") as dst:
        return read_capped(src, size, out=dst)


def upload_dataset(client: Any, local: Path, bucket: str, prefix: str) -> int:
    """Seed a bucket with a local dataset (demo and tests); the manifest goes last."""
    manifest = load_manifest(local)
    for entry in manifest.files:
        client.upload_file(str(local / entry.name), bucket, f"{prefix}/{entry.name}")
    client.upload_file(str(local / MANIFEST), bucket, f"{prefix}/{MANIFEST}")
    return len(manifest.files) + 1
