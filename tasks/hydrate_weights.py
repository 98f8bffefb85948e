"""Initial weights from an S3 prefix onto the shared filesystem: capped, hashed as they stream,
and checked whole against the digest the run pins (:mod:`tasks.weights_pin` defines it) before
any of them lands.

Every file is downloaded into a private staging directory; only once the whole listing is
known (and, pinned, matches ``initial_weights.sha256``) do the files replace those in the
destination, stray weight files go, and the record (``.nvrx-weights.sha256``: the listing of
what is there) is written last. Nothing else marks a copy hydrated: a failure removes the record,
so a later run trusts nothing of it and copies the weights again.

A later run of the same prefix reuses a file already there only when a listing it can trust
names it: pinned, the record or the ``weights.sha256`` beside the weights, either one only when
its own digest is the pin; unpinned, the record (the copy is not pinned either). The file is read
again (the shared filesystem is writable by others) and must match that listing's size and sha256.
"""

from __future__ import annotations

import contextlib
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tasks.errors import HydrationError
from tasks.hydrate import HydrateReport, staged_destination, stream_capped
from tasks.weights_pin import (
    GIB,
    LISTING_NAME,
    MAX_LISTING_BYTES,
    UNPINNED,
    WeightFile,
    WeightsListing,
    WeightsPin,
    is_weight_file,
    s3_entries,
)
from trainer.hashing import sha256_capped
from trainer.run_files import UnsafeFile, read_small

RECORD = ".nvrx-weights.sha256"  # a leading dot: never a weight file's name
SHA256_FIELD = "initial_weights.sha256"
CAP_FIELD = "initial_weights.max_gib"


@dataclass(frozen=True)
class _Known:
    """A listing of the weights that hydration may check files against."""

    files: dict[str, WeightFile]
    pinned: bool  # its digest is the pin (else: the record of an unpinned copy)


def hydrate_weights(
    fs: Any,
    uri: str,
    dest: Path,
    *,
    pin: WeightsPin = UNPINNED,
    progress: Callable[[int, int, str], None] = lambda done, total, name: None,
) -> HydrateReport:
    """Copy an HF-format weights directory (``config.json`` + ``*.safetensors``) from S3 to the
    shared filesystem. Raises :class:`HydrationError` naming the field, the file and the fix."""
    t0 = time.perf_counter()
    entries = s3_entries(fs, uri)
    names = {n for n, _ in entries}
    if "config.json" not in names or not any(n.endswith(".safetensors") for n in names):
        raise HydrationError(
            f"initial weights {uri} must hold config.json and *.safetensors (an HF model "
            f"directory), found {sorted(names) or 'nothing'}"
        )
    total = sum(size for _, size in entries)
    if total > pin.max_bytes:  # from the listing: before any byte is copied
        raise HydrationError(
            f"{CAP_FIELD}: initial weights {uri} list {total} bytes ({total / GIB:.2f} GiB), "
            f"over the cap of {pin.max_bytes / GIB:.2f} GiB; raise {CAP_FIELD} if these are "
            "the weights you mean"
        )
    with staged_destination(dest) as (dest, staging):
        try:
            known = _known(fs, uri, dest, pin)
            if known is not None and known.pinned:
                _same_files(known, entries, uri)
            staged = _stage(fs, uri, dest, staging, entries, known, pin, progress)
            listing = WeightsListing.of([f for f, _ in staged])
            _check_whole(listing, pin, uri)
            _land(dest, staging, listing, {f.name for f, n in staged if n})
        except BaseException:
            (dest / RECORD).unlink(missing_ok=True)  # nothing a later run could trust
            raise
    got = [n for _, n in staged]
    return HydrateReport.of(uri, dest, got, t0, manifest_sha256=listing.digest())


def _read_listing(read: Callable[[], bytes], source: str) -> WeightsListing | None:
    try:
        return WeightsListing.parse(read(), source)
    except FileNotFoundError:
        return None


def _known(fs: Any, uri: str, dest: Path, pin: WeightsPin) -> _Known | None:
    """The listing files are checked against: see the module's docstring."""
    record = None
    path = dest / RECORD
    # A garbled, oversized or unsafe record (a link, a FIFO: the shared filesystem is others'
    # to write too): copy again.
    with contextlib.suppress(HydrationError, UnsafeFile):
        if (data := read_small(path, limit=MAX_LISTING_BYTES)) is not None:
            record = WeightsListing.parse(data, str(path))
    if pin.sha256 is None:
        return None if record is None else _Known(record.by_name(), pinned=False)
    if record is not None and record.digest() == pin.sha256:
        return _Known(record.by_name(), pinned=True)
    src = f"{uri.rstrip('/')}/{LISTING_NAME}"
    beside = _read_listing(
        lambda: fs.cat_file(src.removeprefix("s3://"), start=0, end=MAX_LISTING_BYTES + 1), src
    )
    if beside is None:
        return None
    if beside.digest() != pin.sha256:
        raise HydrationError(
            f"{SHA256_FIELD}: {src} (the weights' listing) has digest {beside.digest()}, not the "
            f"pinned {pin.sha256}: the weights changed since they were pinned, or the pin is "
            "wrong; nothing was hydrated. Check the source and recompute the digest with "
            f"`nvrx-pipeline weights-digest {uri}`"
        )
    return _Known(beside.by_name(), pinned=True)


def _same_files(known: _Known, entries: list[tuple[str, int]], uri: str) -> None:
    """The prefix lists exactly the files (names and sizes) the pinned listing names."""
    listed = dict(entries)
    pinned = {n: f.size for n, f in known.files.items()}
    differ = sorted(n for n in listed.keys() | pinned.keys() if listed.get(n) != pinned.get(n))
    if differ:
        said = ", ".join(
            f"{n} ({listed.get(n, 'absent')} vs {pinned.get(n, 'absent')})" for n in differ
        )
        raise HydrationError(
            f"{SHA256_FIELD}: {uri} does not hold the pinned weights: {said} (bytes in S3 vs "
            "pinned); nothing was hydrated. Restore those files, or pin the weights there now "
            f"(`nvrx-pipeline weights-digest {uri}`)"
        )


def _stage(
    fs: Any,
    uri: str,
    dest: Path,
    staging: Path,
    entries: list[tuple[str, int]],
    known: _Known | None,
    pin: WeightsPin,
    progress: Callable[[int, int, str], None],
) -> list[tuple[WeightFile, int]]:
    """Every file's line, with the bytes downloaded (0: reused): a verified local copy's, or
    the download's (hashed as it streams, into ``staging``)."""
    src = uri.removeprefix("s3://").rstrip("/")
    staged: list[tuple[WeightFile, int]] = []
    copied = 0
    for i, (name, size) in enumerate(entries):
        expect = None if known is None else known.files.get(name)
        if expect is not None and expect.size == size and _local_matches(dest / name, expect):
            staged.append((expect, 0))
            progress(i + 1, len(entries), name)
            continue
        # Streamed no further than one byte past the listed size: an object that grew after the
        # listing (or a listing that lied) is never copied whole; the sizes sum to the cap at
        # most, so neither is the whole.
        n, digest = stream_capped(fs, f"{src}/{name}", staging / name, size)
        copied += n
        if n != size or copied > pin.max_bytes:
            got_n = f"more than {size}" if n > size else str(n)
            raise HydrationError(
                f"{uri}/{name}: {got_n} bytes where the listing says {size}: the object "
                "changed while it was copied; copy it again once it is stable"
            )
        if expect is not None and known is not None and known.pinned and digest != expect.sha256:
            raise HydrationError(
                f"{SHA256_FIELD}: {uri}/{name} has sha256 {digest}, the pinned listing says "
                f"{expect.sha256}: it was replaced since the weights were pinned; nothing was "
                "hydrated. Restore it, or pin the weights there now (`nvrx-pipeline "
                f"weights-digest {uri}`)"
            )
        staged.append((WeightFile(name, size, digest), size))
        progress(i + 1, len(entries), name)
    return staged


def _local_matches(path: Path, expect: WeightFile) -> bool:
    if path.is_symlink() or not path.is_file() or path.stat().st_size != expect.size:
        return False
    try:
        return sha256_capped(path, expect.size) == expect.sha256
    except ValueError:  # grew while read
        return False


def _check_whole(listing: WeightsListing, pin: WeightsPin, uri: str) -> None:
    if pin.sha256 is None or listing.digest() == pin.sha256:
        return
    raise HydrationError(
        f"{SHA256_FIELD}: the weights at {uri} have digest {listing.digest()}, not the pinned "
        f"{pin.sha256}: they changed since they were pinned, or the pin is wrong; nothing was "
        f"hydrated. Compare `nvrx-pipeline weights-digest {uri}` with your copy's; upload its "
        f"{LISTING_NAME} beside the weights (`weights-digest DIR --write`) to have the file "
        "that differs named"
    )


def _land(dest: Path, staging: Path, listing: WeightsListing, downloaded: set[str]) -> None:
    """The verified files replace the old ones, config.json last; the record after them."""
    (dest / RECORD).unlink(missing_ok=True)  # a crash from here on leaves no marker
    wanted = listing.by_name()
    for stray in dest.iterdir():  # a weight file of an older version would be loaded too
        if is_weight_file(stray.name) and stray.name not in wanted and not stray.is_dir():
            stray.unlink()
    for name in sorted(downloaded, key=lambda n: n == "config.json"):
        os.replace(staging / name, dest / name)
    (staging / RECORD).write_text(listing.text())
    os.replace(staging / RECORD, dest / RECORD)
