"""``nvrx-pipeline weights-digest``: the digest that ``initial_weights.sha256`` pins, of a local
weights directory or an S3 prefix (tasks.weights_pin defines it and does the work)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from flows.cli.common import (
    EXIT_FAILED,
    EXIT_USAGE,
    add_s3_endpoint,
    command,
    emit,
    fail,
    s3_settings,
)


def cmd_weights_digest(args: argparse.Namespace) -> int:
    from tasks.errors import HydrationError, StorageError
    from tasks.weights_pin import LISTING_NAME, local_listing, s3_listing

    source: str = args.source
    remote = source.startswith("s3://")
    if remote and args.write:
        return fail(f"--write: writes {LISTING_NAME} into a local directory only", EXIT_USAGE)
    try:
        if remote:
            from tasks.storage.s3 import parse_s3_uri, s3fs_filesystem

            parse_s3_uri(source)
            listing = s3_listing(s3fs_filesystem(s3_settings(args)), source)
        else:
            listing = local_listing(Path(source))
    except StorageError as e:
        return fail(e, EXIT_USAGE)
    except (HydrationError, OSError) as e:
        return fail(e, EXIT_USAGE if not remote else EXIT_FAILED)
    if not listing.files:
        return fail(f"{source}: no *.safetensors or *.json files (nothing to pin)", EXIT_USAGE)
    if args.write:
        (Path(source) / LISTING_NAME).write_text(listing.text())
    files = [{"name": f.name, "bytes": f.size, "sha256": f.sha256} for f in listing.files]
    text = listing.text() + f"initial_weights.sha256={listing.digest()}"
    return emit(args.json, {"sha256": listing.digest(), "files": files}, text)


def add(sub: Any) -> None:
    p = command(
        sub,
        "weights-digest",
        cmd_weights_digest,
        help="the digest initial_weights.sha256 pins, of a weights directory or S3 prefix",
        description="Lists each weight file (*.safetensors, *.json at the top level) as "
        "'<sha256>  <bytes>  <name>', sorted by name, and prints the sha256 of that listing: "
        "the value of initial_weights.sha256. With --write, the listing is also written into "
        "DIR as weights.sha256: uploaded with the weights, it lets hydration name a file that "
        "differs.",
    )
    p.add_argument(
        "source", metavar="DIR_OR_S3_URI", help="a local directory or s3://bucket/prefix"
    )
    p.add_argument("--write", action="store_true", help="write DIR/weights.sha256 (local only)")
    add_s3_endpoint(p)
    p.add_argument("--json", action="store_true", help="print the digest and files as JSON last")
