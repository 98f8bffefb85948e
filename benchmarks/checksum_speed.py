"""Checksum throughput of a shard in memory (issue 40): sha256 (what the memory tiers and the
durable writer compute today, up to three times per shard) next to the fast candidates,
xxh3-128 and xxh3-64 (``xxhash``) and CRC32C (``google-crc32c``, its C extension), with
``zlib.crc32`` for reference. One core, one thread per call.

- throughput: GB/s (1e9 bytes/s) of one call over the whole buffer, for a ``bytearray`` and an
  anonymous ``mmap`` of each size (64 MiB, 1 GiB); and of streaming the bytearray through
  ``update`` in 4 MiB and 16 MiB chunks (how a writer hashes the bytes as it writes them).
  ``--samples`` (5) per case, the cases interleaved within each sample round (the machine is
  shared: drift spreads over every case alike); median, min and max. Every streamed digest is
  checked against the one-call digest.
- gil: does a 512 MiB hash let another Python thread run? A counter thread's rate while the
  main thread hashes, over its rate while the main thread sleeps (~1: released, ~0: held).
- buffers: which inputs each function takes in place (bytes, bytearray, memoryview, mmap, a
  numpy view), and the Python-level allocation while hashing a 64 MiB mmap (a copy would show).

google-crc32c takes only read-only buffers without a release hook ("y#": bytes, numpy arrays),
so its bytearray and mmap cases go through a zero-copy ``numpy.frombuffer`` view (the ``input``
field says so); it releases the GIL only for ``bytes`` of 1 MiB or more.

Absolute GB/s depend on the CPU (SHA-NI, AVX2/AVX-512, SSE4.2 crc32) and on who else runs:
read the ratios. The default run takes about a minute on 2 shared cores.

    python benchmarks/checksum_speed.py [--sizes-mb 64 1024] [--samples 5] [--json] [--out F]

google-crc32c is a candidate measured here, not a dependency of the project (xxh3-128 was
chosen): ``pip install google-crc32c`` into the venv first.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import mmap
import os
import platform
import statistics
import sys
import threading
import time
import tracemalloc
import zlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import partial
from importlib import metadata
from typing import Any

try:
    import google_crc32c
except ImportError as e:  # measured, not a dependency
    raise SystemExit("pip install google-crc32c first: a candidate this compares") from e
import numpy as np
import xxhash

Buffer = bytes | bytearray | mmap.mmap | memoryview
MiB = 1 << 20
FILL_BLOCK = 64 * MiB  # random bytes tiled over the buffers (the speed is not data-dependent)


@dataclass(frozen=True)
class Algo:
    name: str
    one: Callable[[Buffer], bytes]  # whole buffer, one call
    new: Callable[[], Any]  # a streaming state: .update(chunk), .digest()
    adapt: Callable[[Buffer], Any]  # a zero-copy, sliceable input the function accepts
    input: str


def _mv(buf: Buffer) -> memoryview:
    """A zero-copy, sliceable view."""
    return memoryview(buf)


def _u8(buf: Buffer) -> Any:
    """A zero-copy uint8 view: google-crc32c refuses bytearray, memoryview and mmap (and
    releases the GIL only for bytes, so bytes stay bytes)."""
    return buf if isinstance(buf, bytes) else np.frombuffer(buf, dtype=np.uint8)


class _Zlib:
    def __init__(self) -> None:
        self.crc = 0

    def update(self, chunk: Buffer) -> None:
        self.crc = zlib.crc32(chunk, self.crc)

    def digest(self) -> bytes:
        return self.crc.to_bytes(4, "big")


ALGOS = {
    a.name: a
    for a in (
        Algo(
            "sha256",
            lambda b: hashlib.sha256(b).digest(),
            hashlib.sha256,
            _mv,
            "memoryview (zero-copy)",
        ),
        Algo(
            "xxh3_128",
            lambda b: xxhash.xxh3_128(b).digest(),
            xxhash.xxh3_128,
            _mv,
            "memoryview (zero-copy)",
        ),
        Algo(
            "xxh3_64",
            lambda b: xxhash.xxh3_64(b).digest(),
            xxhash.xxh3_64,
            _mv,
            "memoryview (zero-copy)",
        ),
        Algo(
            "crc32c",
            lambda b: google_crc32c.value(b).to_bytes(4, "big"),
            google_crc32c.Checksum,
            _u8,
            "numpy.frombuffer view (zero-copy); google_crc32c.value / Checksum.update",
        ),
        Algo(
            "zlib_crc32",
            lambda b: zlib.crc32(b).to_bytes(4, "big"),
            _Zlib,
            _mv,
            "memoryview (zero-copy)",
        ),
    )
}


def _fill(buf: bytearray | mmap.mmap, size: int) -> None:
    block = os.urandom(min(FILL_BLOCK, size))
    for off in range(0, size, len(block)):
        n = min(len(block), size - off)
        buf[off : off + n] = block[:n]


@contextlib.contextmanager
def _buffers(size: int) -> Iterator[dict[str, bytearray | mmap.mmap]]:
    ba = bytearray(size)
    mm = mmap.mmap(-1, size)
    _fill(ba, size)
    mm[:] = ba  # the same bytes: every digest of a size must agree
    try:
        yield {"bytearray": ba, "mmap": mm}
    finally:
        mm.close()
        del ba


def _stream(algo: Algo, view: Any, size: int, chunk: int) -> bytes:
    h = algo.new()
    for off in range(0, size, chunk):
        h.update(view[off : off + chunk])
    return bytes(h.digest())


def _summary(gbps: list[float]) -> dict[str, Any]:
    return {
        "median_gbps": round(statistics.median(gbps), 3),
        "min_gbps": round(min(gbps), 3),
        "max_gbps": round(max(gbps), 3),
        "samples_gbps": [round(g, 3) for g in gbps],
    }


def _cases(
    bufs: dict[str, bytearray | mmap.mmap], size: int, chunks_mb: list[int], algos: list[str]
) -> dict[tuple[str, str, str], Callable[[], bytes]]:
    """(algo, buffer, mode) -> a call returning the digest; streaming reads the bytearray."""
    cases: dict[tuple[str, str, str], Callable[[], bytes]] = {}
    for name in algos:
        a = ALGOS[name]
        for kind, buf in bufs.items():
            cases[(name, kind, "one_call")] = partial(a.one, a.adapt(buf))
        for c in chunks_mb:
            view = a.adapt(bufs["bytearray"])
            cases[(name, "bytearray", f"stream_{c}MiB")] = partial(_stream, a, view, size, c * MiB)
    return cases


def throughput(
    sizes_mb: list[int], samples: int, chunks_mb: list[int], algos: list[str]
) -> list[dict[str, Any]]:
    out: list[dict[str, Any]] = []
    for size_mb in sizes_mb:
        size = size_mb * MiB
        with _buffers(size) as bufs:
            cases = _cases(bufs, size, chunks_mb, algos)
            for name in algos:  # warm-up: code paths, CPU clocks
                with memoryview(bufs["bytearray"]) as head:
                    ALGOS[name].one(ALGOS[name].adapt(head[: min(size, 8 * MiB)]))
            times: dict[tuple[str, str, str], list[float]] = {k: [] for k in cases}
            digests: dict[tuple[str, str, str], bytes] = {}
            for _ in range(samples):  # interleaved: every case sees the same drift
                for key, fn in cases.items():
                    t0 = time.perf_counter()
                    digests[key] = fn()
                    times[key].append(time.perf_counter() - t0)
            cases.clear()  # drop the views before the mmap closes
        for (name, kind, mode), ts in times.items():
            if digests[(name, kind, mode)] != digests[(name, "bytearray", "one_call")]:
                raise AssertionError(f"{name} {kind} {mode}: digest differs from one call")
            out.append(
                {
                    "algo": name,
                    "size_mib": size_mb,
                    "buffer": kind,
                    "mode": mode,
                    "input": ALGOS[name].input,
                    **_summary([size / t / 1e9 for t in ts]),
                }
            )
    _stream_cost(out)
    return out


def _stream_cost(rows: list[dict[str, Any]]) -> None:
    """Each streamed case's median relative to the one-call median on the same buffer."""
    one = {
        (r["algo"], r["size_mib"]): r["median_gbps"]
        for r in rows
        if r["mode"] == "one_call" and r["buffer"] == "bytearray"
    }
    for r in rows:
        if r["mode"] != "one_call":
            r["vs_one_call"] = round(r["median_gbps"] / one[(r["algo"], r["size_mib"])], 3)


# -- GIL --------------------------------------------------------------------------------------
class _Counter(threading.Thread):
    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.n = 0
        self.stop = False

    def run(self) -> None:
        while not self.stop:
            self.n += 1

    def rate(self, fn: Callable[[], object]) -> tuple[float, float]:
        n0, t0 = self.n, time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        return (self.n - n0) / dt, dt


def gil(size_mb: int, algos: list[str]) -> list[dict[str, Any]]:
    size = size_mb * MiB
    ba = bytearray(size)
    _fill(ba, size)
    data: dict[str, Buffer] = {"bytes": bytes(ba), "bytearray": ba}
    counter = _Counter()
    counter.start()
    time.sleep(0.05)
    out = []
    try:
        for name in algos:
            a = ALGOS[name]
            for buf in data.values():
                arg = _u8(buf) if name == "crc32c" else buf
                idle, _ = counter.rate(partial(time.sleep, 0.25))
                busy, dt = counter.rate(partial(a.one, arg))
                ratio = busy / idle
                out.append(
                    {
                        "algo": name,
                        "input": type(arg).__name__,
                        "size_mib": size_mb,
                        "seconds": round(dt, 3),
                        "counter_ratio": round(ratio, 2),
                        "gil": "released" if ratio > 0.5 else "held",
                    }
                )
    finally:
        counter.stop = True
        counter.join()
    return out


# -- buffer protocol --------------------------------------------------------------------------
def buffers() -> dict[str, Any]:
    raw = bytes(range(256)) * 4096  # 1 MiB
    mm = mmap.mmap(-1, len(raw))
    mm[:] = raw
    ba = bytearray(raw)
    inputs: dict[str, Any] = {
        "bytes": raw,
        "bytearray": ba,
        "memoryview_slice": memoryview(ba)[1:],
        "readonly_memoryview": memoryview(raw),
        "mmap": mm,
        "numpy_frombuffer": np.frombuffer(ba, dtype=np.uint8),
    }
    calls: dict[str, Callable[[Any], object]] = {
        "sha256": lambda b: hashlib.sha256(b).digest(),
        "xxh3_128": lambda b: xxhash.xxh3_128(b).digest(),
        "xxh3_128.update": lambda b: xxhash.xxh3_128().update(b),
        "xxh3_64": lambda b: xxhash.xxh3_64(b).digest(),
        "crc32c.value": google_crc32c.value,
        "crc32c.Checksum.update": lambda b: google_crc32c.Checksum().update(b),
        "zlib_crc32": zlib.crc32,
    }
    accepted: dict[str, dict[str, str]] = {}
    for fname, fn in calls.items():
        accepted[fname] = {}
        for iname, obj in inputs.items():
            try:
                fn(obj)
                accepted[fname][iname] = "ok"
            except TypeError as e:
                accepted[fname][iname] = f"TypeError: {e}"
    # A copy of the input would show as a traced allocation of its size.
    big = mmap.mmap(-1, 64 * MiB)
    copies: dict[str, int] = {}
    hashes: tuple[tuple[str, Callable[[], object]], ...] = (
        ("xxh3_128(mmap)", lambda: xxhash.xxh3_128(big).digest()),
        ("xxh3_128().update(memoryview(mmap))", lambda: xxhash.xxh3_128().update(memoryview(big))),
        ("sha256(mmap)", lambda: hashlib.sha256(big).digest()),
        ("crc32c.value(numpy view of mmap)", lambda: google_crc32c.value(_u8(big))),
        ("zlib_crc32(mmap)", lambda: zlib.crc32(big)),
    )
    for fname, run in hashes:
        tracemalloc.start()
        run()
        copies[fname] = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    mm.close()
    big.close()
    return {"accepted": accepted, "traced_peak_bytes_hashing_64MiB": copies}


# -- environment ------------------------------------------------------------------------------
def environment() -> dict[str, Any]:
    cpu, flags = platform.processor(), set()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
            if line.startswith("flags"):
                flags = set(line.split(":", 1)[1].split())
    want = ("sha_ni", "sse4_2", "pclmulqdq", "avx2", "avx512f", "vpclmulqdq")
    return {
        "python": platform.python_version(),
        "cpu": cpu,
        "cpu_flags": [f for f in want if f in flags],
        "cpus": os.cpu_count(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
        "xxhash": metadata.version("xxhash"),
        "xxhash_lib": xxhash.XXHASH_VERSION,
        "google_crc32c": metadata.version("google-crc32c"),
        "google_crc32c_implementation": google_crc32c.implementation,
        "numpy": np.__version__,
        "openssl": __import__("ssl").OPENSSL_VERSION,
        "zlib_runtime": zlib.ZLIB_RUNTIME_VERSION,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    p.add_argument("--sizes-mb", type=int, nargs="+", default=[64, 1024], help="MiB")
    p.add_argument("--samples", type=int, default=5)
    p.add_argument("--chunks-mb", type=int, nargs="*", default=[4, 16], help="stream, MiB")
    p.add_argument("--algos", nargs="+", default=list(ALGOS), choices=list(ALGOS))
    p.add_argument("--gil-mb", type=int, default=512, help="0: skip the GIL check")
    p.add_argument("--json", action="store_true", help="print one JSON object as the last line")
    p.add_argument("--out", default=None, help="also write the JSON object to this file")
    args = p.parse_args(argv)
    if google_crc32c.implementation != "c":
        print("google_crc32c is the pure-Python fallback: not what issue 40 would use")
    t0 = time.monotonic()
    result: dict[str, Any] = {"environment": environment()}
    result["buffers"] = buffers()
    result["gil"] = gil(args.gil_mb, args.algos) if args.gil_mb else []
    result["throughput"] = throughput(args.sizes_mb, args.samples, args.chunks_mb, args.algos)
    result["environment"]["loadavg_end"] = [round(x, 2) for x in os.getloadavg()]
    result["environment"]["wall_s"] = round(time.monotonic() - t0, 1)
    result["settings"] = vars(args) | {"gb": "1e9 bytes", "mib": "2**20 bytes"}
    print(f"{'algo':11} {'MiB':>5} {'buffer':9} {'mode':14} {'median':>7} {'min':>7} {'max':>7}")
    for r in result["throughput"]:
        print(
            f"{r['algo']:11} {r['size_mib']:5} {r['buffer']:9} {r['mode']:14} "
            f"{r['median_gbps']:7.2f} {r['min_gbps']:7.2f} {r['max_gbps']:7.2f}"
        )
    for g in result["gil"]:
        print(f"gil {g['algo']:11} {g['input']:10} ratio {g['counter_ratio']:.2f} {g['gil']}")
    text = json.dumps(result)
    if args.out:
        with open(args.out, "w") as f:
            f.write(json.dumps(result, indent=1) + "\n")
    if args.json:
        print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
