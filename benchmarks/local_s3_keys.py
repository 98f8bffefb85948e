"""What the embedded S3 server's credentials cost (issue 43): the same SeaweedFS, anonymous
(as before) and keyed (tasks.storage.local_keys: S3 keys, JWT-signed filer and volume requests,
mutual TLS on gRPC), side by side in one run, alternating.

- start: ``LocalS3Server.start`` until ready (keyed: the secrets generated first, once, timed
  apart: the first start of a state directory pays it);
- put / get: boto3 ``upload_file`` / ``download_file`` of the same files, one server then the
  other, each a fresh prefix. Target: keyed >= 0.9x anonymous throughput.

    python benchmarks/local_s3_keys.py [--files 8] [--mb 32] [--repeats 5] [--json] [--out F]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TARGET = 0.9


def _stats(xs: list[float]) -> dict[str, float]:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--files", type=int, default=8)
    p.add_argument("--mb", type=int, default=32, help="MiB per file")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--json", action="store_true")
    p.add_argument("--out", type=Path)
    args = p.parse_args(argv)

    from tasks.storage.local_keys import ensure_keys
    from tasks.storage.local_s3 import LocalS3Server
    from tasks.storage.s3 import S3Settings, boto3_client
    from tests.helpers import free_s3_port

    work = Path(tempfile.mkdtemp(prefix="nvrx-bench-keys-"))
    src = work / "src"
    src.mkdir()
    for i in range(args.files):
        (src / f"f{i}.bin").write_bytes(os.urandom(args.mb << 20))
    names = sorted(q.name for q in src.iterdir())
    total_mb = args.files * args.mb * 1.048576
    t0 = time.perf_counter()
    keys = ensure_keys(work / "keyed")
    keygen_s = time.perf_counter() - t0
    servers = {
        "anonymous": LocalS3Server(f"http://127.0.0.1:{free_s3_port()}", work / "anonymous"),
        "keyed": LocalS3Server(f"http://127.0.0.1:{free_s3_port()}", work / "keyed", keys=keys),
    }
    start: dict[str, list[float]] = {k: [] for k in servers}
    put: dict[str, list[float]] = {k: [] for k in servers}
    get: dict[str, list[float]] = {k: [] for k in servers}
    try:
        for r in range(args.repeats):
            for kind, server in servers.items():
                t = time.perf_counter()
                server.start()
                start[kind].append(time.perf_counter() - t)
                settings = S3Settings(
                    endpoint_url=server.endpoint,
                    keys_file=None if server.keys is None else server.keys.credentials,
                )
                client = boto3_client(settings)
                if r == 0:
                    client.create_bucket(Bucket="bench")
                t = time.perf_counter()
                for n in names:
                    client.upload_file(str(src / n), "bench", f"r{r}/{n}")
                put[kind].append(total_mb / (time.perf_counter() - t))
                dest = work / f"dest-{kind}-{r}"
                dest.mkdir()
                t = time.perf_counter()
                for n in names:
                    client.download_file("bench", f"r{r}/{n}", str(dest / n))
                get[kind].append(total_mb / (time.perf_counter() - t))
                shutil.rmtree(dest)
                server.stop()
    finally:
        for server in servers.values():
            server.stop()
        shutil.rmtree(work, ignore_errors=True)

    result: dict[str, Any] = {
        "files": args.files,
        "mib_per_file": args.mb,
        "repeats": args.repeats,
        "keygen_s": round(keygen_s, 4),
        "start_s": {k: _stats(v) for k, v in start.items()},
        "put_mb_s": {k: _stats(v) for k, v in put.items()},
        "get_mb_s": {k: _stats(v) for k, v in get.items()},
    }
    ratios = {
        op: result[f"{op}_mb_s"]["keyed"]["median"] / result[f"{op}_mb_s"]["anonymous"]["median"]
        for op in ("put", "get")
    }
    result["keyed_vs_anonymous"] = ratios
    result["start_keyed_minus_anonymous_s"] = (
        result["start_s"]["keyed"]["median"] - result["start_s"]["anonymous"]["median"]
    )
    result["target"] = {"keyed_vs_anonymous": TARGET}
    print(
        f"{args.files} files x {args.mb} MiB, {args.repeats} rounds alternating; median (min-max)"
    )
    print(f"  secrets generated once: {keygen_s * 1000:.0f} ms")
    for what, unit in (("start_s", "s"), ("put_mb_s", "MB/s"), ("get_mb_s", "MB/s")):
        for kind in servers:
            s = result[what][kind]
            print(
                f"  {what:<9} {kind:<9} {s['median']:8.2f} {unit} ({s['min']:.2f}-{s['max']:.2f})"
            )
    for op, v in ratios.items():
        print(
            f"  {op} keyed/anonymous {v:.3f}x "
            f"(target >= {TARGET}: {'met' if v >= TARGET else 'MISSED'})"
        )
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.json:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
