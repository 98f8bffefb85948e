"""Export, hydration and digest throughput, each next to a plain baseline, in one run.

- export: ours (``tasks.export.export_checkpoint``: parallel, verified, manifest last) vs a plain
  loop of boto3 ``upload_file`` over the same files; also s3fs ``put_file`` (the other candidate
  client) on the same files. Target: ours >= 0.9x the plain baseline.
- hydration: ours (``tasks.hydrate.hydrate_dataset``: s3fs, verified) vs a plain loop of boto3
  ``download_file``. Target: >= 0.9x.
- digest: our parallel sha256 of the checkpoint files vs ``sha256sum`` on the same files.
  Target: >= 0.8x.

Against a SeaweedFS server started on 127.0.0.1 for the run (client and server share the cores:
read ratios, not absolute MB/s).

    python benchmarks/transfer_throughput.py [--files 8] [--mb 32] [--repeats 3] [--json]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGETS = {"export_vs_boto3": 0.9, "hydrate_vs_boto3": 0.9, "digest_vs_sha256sum": 0.8}


def _fake_checkpoint(root: Path, files: int, mb: int) -> Path:
    from trainer import checkpointing

    partial = checkpointing.partial_path(root, 1)
    partial.mkdir(parents=True)
    for i in range(files):
        (partial / f"__{i}_0.distcp").write_bytes(os.urandom(mb << 20))
    (partial / ".metadata").write_bytes(os.urandom(4096))
    return checkpointing.commit(
        root, 1, world_size=files, info={"config_hash": "bench"}, keep_last=1
    )


def _fake_dataset(d: Path, files: int, mb: int) -> None:
    d.mkdir(parents=True)
    entries = []
    for i in range(files):
        data = os.urandom(mb << 20)
        name = f"shard_{i:05d}.bin"
        (d / name).write_bytes(data)
        entries.append(
            {
                "name": name,
                "tokens": len(data) // 2,
                "bytes": len(data),
                "sha256": hashlib.sha256(data).hexdigest(),
            }
        )
    (d / "dataset.json").write_text(
        json.dumps(
            {
                "format": "nvrx-tokens-v1",
                "dtype": "uint16",
                "vocab_size": 65536,
                "seed": 0,
                "total_tokens": sum(e["tokens"] for e in entries),
                "files": entries,
            }
        )
    )


def _timed(fn: Callable[[], Any], repeats: int, before: Callable[[], Any] = lambda: None) -> float:
    times = []
    for _ in range(repeats):
        before()
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--mb", type=int, default=32, help="MiB per file")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--port", type=int, default=18833)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    from tasks.export import export_checkpoint
    from tasks.hydrate import hydrate_dataset, upload_dataset
    from tasks.storage.local_s3 import LocalS3Server
    from tasks.storage.s3 import S3Settings, boto3_client, s3fs_filesystem
    from tasks.validation.files import hash_files

    work = Path(tempfile.mkdtemp(prefix="nvrx-bench-transfer-"))
    server = LocalS3Server(f"http://127.0.0.1:{args.port}", work / "s3")
    server.start()
    try:
        settings = S3Settings(endpoint_url=server.endpoint)
        client = boto3_client(settings)
        fs = s3fs_filesystem(settings)
        client.create_bucket(Bucket="bench")
        ckpt = _fake_checkpoint(work / "run", args.files, args.mb)
        names = sorted(p.name for p in ckpt.iterdir())
        total_mb = sum((ckpt / n).stat().st_size for n in names) / 1e6
        counter = iter(range(10**6))

        def fresh_prefix() -> str:
            return f"r{next(counter)}"

        prefix = {"v": ""}

        def new_prefix() -> None:
            prefix["v"] = fresh_prefix()

        t_ours = _timed(
            lambda: export_checkpoint(
                client, ckpt, "bench", prefix["v"], "run", endpoint=settings.endpoint_url
            ),
            args.repeats,
            new_prefix,
        )
        t_boto = _timed(
            lambda: [
                client.upload_file(str(ckpt / n), "bench", f"{prefix['v']}/{n}") for n in names
            ],
            args.repeats,
            new_prefix,
        )
        t_s3fs = _timed(
            lambda: [fs.put_file(str(ckpt / n), f"bench/{prefix['v']}/{n}") for n in names],
            args.repeats,
            new_prefix,
        )

        data = work / "data"
        _fake_dataset(data, args.files, args.mb)
        upload_dataset(client, data, "bench", "ds")
        dest = {"v": work / "hydrated0"}

        def new_dest() -> None:
            shutil.rmtree(dest["v"], ignore_errors=True)
            dest["v"] = work / f"hydrated{next(counter)}"

        t_hyd = _timed(
            lambda: hydrate_dataset(fs, "bench", "ds", dest["v"]), args.repeats, new_dest
        )
        shards = sorted(p.name for p in data.glob("shard_*"))
        t_dl = _timed(
            lambda: [client.download_file("bench", f"ds/{n}", str(dest["v"] / n)) for n in shards],
            args.repeats,
            lambda: (new_dest(), dest["v"].mkdir(parents=True)),
        )
        data_mb = sum((data / n).stat().st_size for n in shards) / 1e6

        t_digest = _timed(lambda: hash_files(ckpt, names), args.repeats)
        t_sum = _timed(
            lambda: subprocess.run(
                ["sha256sum", *names], cwd=ckpt, check=True, capture_output=True
            ),
            args.repeats,
        )
    finally:
        server.stop()
        shutil.rmtree(work, ignore_errors=True)

    mbps = {
        "export_ours": total_mb / t_ours,
        "export_boto3_upload_file": total_mb / t_boto,
        "export_s3fs_put_file": total_mb / t_s3fs,
        "hydrate_ours": data_mb / t_hyd,
        "hydrate_boto3_download_file": data_mb / t_dl,
        "digest_ours": total_mb / t_digest,
        "digest_sha256sum": total_mb / t_sum,
    }
    ratios = {
        "export_vs_boto3": mbps["export_ours"] / mbps["export_boto3_upload_file"],
        "s3fs_vs_boto3_upload": mbps["export_s3fs_put_file"] / mbps["export_boto3_upload_file"],
        "hydrate_vs_boto3": mbps["hydrate_ours"] / mbps["hydrate_boto3_download_file"],
        "digest_vs_sha256sum": mbps["digest_ours"] / mbps["digest_sha256sum"],
    }
    print(
        f"{args.files} files x {args.mb} MiB, median of {args.repeats}; MB/s (client and "
        "server share this machine's cores)"
    )
    for k, v in mbps.items():
        print(f"  {k:<30} {v:8.1f} MB/s")
    for k, v in ratios.items():
        target = TARGETS.get(k)
        print(f"  {k:<30} {v:8.2f}x" + (f"  (target >= {target})" if target else ""))
    out = {
        "mb_per_s": {k: round(v, 1) for k, v in mbps.items()},
        "ratios": {k: round(v, 3) for k, v in ratios.items()},
        "targets": TARGETS,
        "files": args.files,
        "mb_per_file": args.mb,
    }
    if args.out:
        args.out.write_text(json.dumps(out, indent=1))
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    sys.exit(main())
