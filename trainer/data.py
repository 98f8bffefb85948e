"""Token shards on the shared filesystem: the manifest, its verification, a synthetic dataset.

A dataset directory::

    dataset.json          manifest: format, dtype, vocab size, every shard with tokens/bytes/sha256
    shard_00000.bin ...   one flat stream of little-endian tokens of the manifest's ``dtype``
                          (``uint16``, or ``uint32`` for vocabularies over 65,536 ids)

``python -m trainer.data --out DIR`` writes a seeded synthetic dataset from a sparse random Markov
chain, so the loss falls. Real data becomes a dataset with :mod:`trainer.prepare`; the sampler
over the stream is :mod:`trainer.sampler`.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import re
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from trainer.errors import TerminalError
from trainer.hashing import sha256_capped
from trainer.run_files import write_durably
from trainer.untrusted import UnsafeNameError, check_component

MANIFEST = "dataset.json"
FORMAT = "nvrx-tokens-v1"
# A manifest is untrusted: one past this (~100 k shard entries) is refused unread.
MAX_MANIFEST_BYTES = 16 << 20
# Token dtypes a dataset may use (always little-endian) and the vocabulary each can hold.
DTYPES: dict[str, np.dtype[Any]] = {"uint16": np.dtype("<u2"), "uint32": np.dtype("<u4")}
MAX_VOCAB: dict[str, int] = {"uint16": 1 << 16, "uint32": 1 << 32}


class DataError(TerminalError, RuntimeError):
    """The dataset is missing, short or corrupt. The message names the file."""


def token_dtype(name: object, *, field: str = "dtype") -> np.dtype[Any]:
    """The numpy dtype of a token dtype name; DataError naming ``field`` and the allowed values."""
    if not isinstance(name, str) or name not in DTYPES:
        raise DataError(
            f"{field}: {name!r} is not a token dtype; allowed: {', '.join(DTYPES)} (little-endian)"
        )
    return DTYPES[name]


def dtype_for_vocab(vocab_size: int) -> str:
    """The smallest token dtype that holds ids ``0 .. vocab_size - 1``."""
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"vocab_size: must be a positive integer, got {vocab_size!r}")
    for name, limit in MAX_VOCAB.items():
        if vocab_size <= limit:
            return name
    raise DataError(f"vocab_size: {vocab_size} is over {MAX_VOCAB['uint32']}, the uint32 limit")


def check_vocab_fits(vocab_size: object, dtype: str, *, field: str = "vocab_size") -> int:
    """``vocab_size`` must be a positive int whose ids all fit ``dtype`` (returned); the error
    names ``field`` (where the vocab size came from), ``vocab_size`` and ``dtype``, and the fix."""
    token_dtype(dtype)
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 1:
        raise DataError(f"{field}: vocab_size must be a positive integer, got {vocab_size!r}")
    limit = MAX_VOCAB[dtype]
    if vocab_size > limit:
        fix = (
            "write the shards as uint32"
            if dtype != "uint32"
            else "vocabularies over 2**32 ids are not supported"
        )
        raise DataError(
            f"{field}: vocab_size {vocab_size} does not fit dtype {dtype} (at most {limit} token "
            f"ids, vocab_size <= {limit}); {fix}"
        )
    return vocab_size


def _markov_tokens(rng: np.random.Generator, n: int, vocab: int, chains: int = 256) -> np.ndarray:
    """``n`` tokens from a sparse Markov chain: each token has 4 likely successors."""
    successors = rng.integers(0, vocab, size=(vocab, 4))
    probs = np.array([0.6, 0.2, 0.12, 0.08])
    length = -(-n // chains)
    out = np.empty((chains, length), dtype=np.int64)
    out[:, 0] = rng.integers(0, vocab, size=chains)
    picks = rng.choice(4, size=(chains, length), p=probs)
    for t in range(1, length):  # vectorised over the parallel chains
        out[:, t] = successors[out[:, t - 1], picks[:, t]]
    return out.reshape(-1)[:n]


def write_synthetic_dataset(
    out: Path,
    *,
    shards: int = 4,
    tokens_per_shard: int = 65536,
    vocab_size: int = 512,
    seed: int = 0,
    dtype: str | None = None,
) -> DatasetManifest:
    """Write a seeded dataset and its manifest (last, atomically); the same arguments give
    byte-identical files. ``dtype``: default the smallest that holds ``vocab_size``."""
    if shards < 1 or tokens_per_shard < 2:
        raise ValueError("shards must be >= 1 and tokens_per_shard >= 2")
    if isinstance(vocab_size, bool) or not isinstance(vocab_size, int) or vocab_size < 2:
        raise ValueError(f"vocab_size must be an integer >= 2, got {vocab_size!r}")
    dtype = dtype_for_vocab(vocab_size) if dtype is None else dtype
    check_vocab_fits(vocab_size, dtype)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    tokens = _markov_tokens(rng, shards * tokens_per_shard, vocab_size).astype(DTYPES[dtype])
    files = []
    for i in range(shards):
        name = f"shard_{i:05d}.bin"
        part = tokens[i * tokens_per_shard : (i + 1) * tokens_per_shard]
        write_durably(out / name, part.tobytes())
        digest = hashlib.sha256(part.tobytes()).hexdigest()
        files.append(ShardFile(name, int(part.size), int(part.nbytes), digest))
    return DatasetManifest.build(dtype, vocab_size, files, seed=seed).write(out)


@dataclass(frozen=True)
class ShardFile:
    """One ``files[i]`` entry of a manifest: a plain file name in the dataset directory."""

    name: str
    tokens: int
    bytes: int
    sha256: str


@dataclass(frozen=True)
class DatasetManifest:
    """A dataset's ``dataset.json``, checked. ``raw`` is the JSON object as read or written:
    the digest and a hydrated copy are made of it, so they never change with this class."""

    dtype: str
    vocab_size: int
    files: tuple[ShardFile, ...]
    raw: Mapping[str, object]

    @classmethod
    def build(
        cls,
        dtype: str,
        vocab_size: int,
        files: list[ShardFile],
        seed: int | None = None,
        source: Mapping[str, object] | None = None,
    ) -> DatasetManifest:
        """A new dataset's manifest: ``seed`` (synthetic data) or ``source`` (what produced it)."""
        raw: dict[str, object] = {"format": FORMAT, "dtype": dtype, "vocab_size": vocab_size}
        raw |= {} if seed is None else {"seed": seed}
        raw |= {"total_tokens": sum(f.tokens for f in files), "files": [asdict(f) for f in files]}
        raw |= {} if source is None else {"source": source}
        return cls(dtype, vocab_size, tuple(files), raw)

    @classmethod
    def parse(cls, blob: bytes, *, source: str) -> DatasetManifest:
        """An untrusted manifest's bytes (read no further than ``MAX_MANIFEST_BYTES + 1``),
        checked: a token dtype and a vocabulary that fits it, every file named, sized and
        digested (:func:`_shard_files`). DataError names ``source``, the field and the value."""
        where = f"dataset manifest {source}"
        if len(blob) > MAX_MANIFEST_BYTES:
            raise DataError(
                f"{where} is over the {MAX_MANIFEST_BYTES} bytes a manifest may hold: it is not "
                "one this pipeline wrote (write the dataset as fewer, larger shards)"
            )
        try:
            raw = json.loads(blob)
        except (ValueError, RecursionError) as e:
            raise DataError(f"{where} is malformed ({type(e).__name__}: {e})") from e
        if not isinstance(raw, dict) or raw.get("format") != FORMAT:
            raise DataError(f"{where} is malformed: not a JSON object of format {FORMAT!r}")
        token_dtype(raw.get("dtype"), field=f"{where}: dtype")
        dtype: str = raw["dtype"]  # a str: checked just above
        vocab_size = check_vocab_fits(raw.get("vocab_size"), dtype, field=where)
        return cls(dtype, vocab_size, _shard_files(raw.get("files"), dtype, where), raw)

    @property
    def total_tokens(self) -> int:
        return sum(f.tokens for f in self.files)

    def digest(self) -> str:
        """The sha256 of the canonical JSON (the S3 object and the hydrated copy agree)."""
        blob = json.dumps(self.raw, sort_keys=True, separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()

    def write(self, out: Path) -> DatasetManifest:
        """Write ``out/dataset.json`` durably (last: it marks the dataset complete); ``self``."""
        write_durably(out / MANIFEST, (json.dumps(self.raw, indent=2) + "\n").encode())
        return self


def _shard_files(entries: object, dtype: str, where: str) -> tuple[ShardFile, ...]:
    """Every ``files[i]`` names one plain file, with a size (its tokens of ``dtype``) and a
    digest that bound and judge reading it (the manifest is untrusted; its names are joined
    onto the dataset directory)."""
    if not isinstance(entries, list) or not entries:
        raise DataError(f"{where}: files must be a non-empty list")
    files: list[ShardFile] = []
    seen: set[str] = set()
    itemsize = DTYPES[dtype].itemsize
    for i, entry in enumerate(entries):
        at = f"{where}: files[{i}]"
        if not isinstance(entry, dict):
            raise DataError(f"{at} must be an object, not {type(entry).__name__}")
        try:
            name = check_component(entry.get("name"), where=f"{at}.name")
        except UnsafeNameError as e:
            raise DataError(str(e)) from e
        if name == MANIFEST or name in seen:
            raise DataError(f"{at}.name: {name!r} is the manifest itself or listed twice")
        seen.add(name)
        for key in ("bytes", "tokens"):
            if not isinstance(n := entry.get(key), int) or isinstance(n, bool) or n < 0:
                raise DataError(f"{at}.{key} must be a non-negative integer, not {n!r}")
        if not (isinstance(digest := entry.get("sha256"), str) and _SHA256_HEX.fullmatch(digest)):
            raise DataError(
                f"{at}.sha256 must be 64 lowercase hex digits, not {str(digest)[:80]!r}"
            )
        tokens, size = entry["tokens"], entry["bytes"]
        if size != tokens * itemsize:
            raise DataError(
                f"{at} ({name}): {size} bytes, but {tokens} tokens of {dtype} are "
                f"{tokens * itemsize} bytes: the manifest's dtype or sizes are wrong"
            )
        files.append(ShardFile(name, tokens, size, digest))
    return tuple(files)


_SHA256_HEX = re.compile(r"[0-9a-f]{64}")


def load_manifest(data_dir: Path) -> DatasetManifest:
    path = Path(data_dir) / MANIFEST
    if not path.is_file():
        raise DataError(
            f"dataset manifest {path} is missing; write a dataset with "
            f"`python -m trainer.data --out {data_dir}` or hydrate it first"
        )
    with open(path, "rb") as f:  # untrusted: never read past the cap
        return DatasetManifest.parse(f.read(MAX_MANIFEST_BYTES + 1), source=str(path))


@dataclass
class ReadProgress:
    """How far a full read of the dataset is (``verify_dataset`` with digests)."""

    files: int
    total_files: int
    bytes: int
    total_bytes: int
    seconds: float

    def line(self) -> str:
        rate = self.bytes / self.seconds / 1e6 if self.seconds > 0 else 0.0
        return (
            f"read {self.files}/{self.total_files} files, {self.bytes / 2**30:.2f}/"
            f"{self.total_bytes / 2**30:.2f} GiB, {rate:.0f} MB/s"
        )


def verify_dataset(
    data_dir: Path,
    *,
    digests: bool | None = None,
    manifest_sha256: str | None = None,
    readers: int = 1,
    progress: Callable[[ReadProgress], None] | None = None,
    every_s: float = 10.0,
) -> DatasetManifest:
    """Check every shard is present, full-sized and (with ``digests``) matches its digest.
    ``manifest_sha256``: the manifest hydration verified, which must still be this one; digests
    are then not read again unless asked (a worker's start-up, on every restart's critical path,
    checks sizes only). Digests read every byte (``readers`` threads, never past the manifest
    size): on FSx for Lustre that loads a lazily imported file, so hydration preloads and
    verifies in one pass. ``progress`` hears how far it is every ``every_s`` s and at the end."""
    data_dir = Path(data_dir)
    manifest = load_manifest(data_dir)
    if manifest_sha256 is not None:
        found = manifest.digest()
        if found != manifest_sha256:
            raise DataError(
                f"dataset manifest {data_dir / MANIFEST} changed since hydration verified the "
                f"dataset (digest {found[:12]}, hydration verified {manifest_sha256[:12]}): run "
                "the pipeline again so hydration re-checks it"
            )
    if digests is None:
        digests = manifest_sha256 is None
    for entry in manifest.files:
        path = data_dir / entry.name
        if not path.is_file():
            raise DataError(f"dataset shard {path} is missing (listed in {MANIFEST})")
        size = path.stat().st_size
        if size != entry.bytes:
            raise DataError(
                f"dataset shard {path} is {'short' if size < entry.bytes else 'too long'}: "
                f"{size} bytes, manifest says {entry.bytes}"
            )
    if digests:
        _read_all(data_dir, manifest.files, readers, progress, every_s)
    return manifest


def _read_all(
    data_dir: Path,
    files: tuple[ShardFile, ...],
    readers: int,
    progress: Callable[[ReadProgress], None] | None,
    every_s: float,
) -> None:
    """Digest every shard (each read at most to its manifest size), ``readers`` at once."""
    from concurrent.futures import ThreadPoolExecutor

    lock = threading.Lock()
    t0 = time.monotonic()
    done = {"files": 0, "bytes": 0}
    said = [t0]
    total = sum(e.bytes for e in files)

    def say(force: bool = False) -> None:
        now = time.monotonic()
        if progress is not None and (force or now - said[0] >= every_s):
            said[0] = now
            progress(ReadProgress(done["files"], len(files), done["bytes"], total, now - t0))

    def on_bytes(n: int) -> None:
        with lock:
            done["bytes"] += n
            say()

    def check(entry: ShardFile) -> None:
        path = data_dir / entry.name
        try:
            digest = sha256_capped(path, entry.bytes, on_bytes)
        except ValueError as e:
            raise DataError(f"dataset shard {path}: {e} ({MANIFEST})") from e
        if digest != entry.sha256:
            raise DataError(f"dataset shard {path} is corrupt: sha256 does not match {MANIFEST}")
        with lock:
            done["files"] += 1

    with ThreadPoolExecutor(max(1, readers), thread_name_prefix="dataset-read") as pool:
        list(pool.map(check, files))  # the first failure raises here
    with lock:
        say(force=True)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer.data", description="Write a seeded synthetic token dataset."
    )
    p.add_argument("--out", type=Path, required=True, help="dataset directory to write")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--tokens-per-shard", type=int, default=65536)
    p.add_argument("--vocab-size", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--dtype", choices=list(DTYPES), help="token dtype (default: the smallest that fits)"
    )
    p.add_argument("--verify", action="store_true", help="only verify an existing dataset")
    p.add_argument(
        "--readers", type=int, default=8, help="files read at once by --verify (default 8)"
    )
    p.add_argument(
        "--manifest-sha256",
        help="--verify: the manifest must be this one (its canonical digest), as the flow read it",
    )
    args = p.parse_args(argv)
    try:
        if args.verify:
            m = verify_dataset(
                args.out,
                digests=True,
                manifest_sha256=args.manifest_sha256,
                readers=args.readers,
                progress=lambda r: print(r.line(), flush=True),
            )
        else:
            m = write_synthetic_dataset(
                args.out,
                shards=args.shards,
                tokens_per_shard=args.tokens_per_shard,
                vocab_size=args.vocab_size,
                seed=args.seed,
                dtype=args.dtype,
            )
    except (DataError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(json.dumps({"dir": str(args.out), "files": len(m.files), "tokens": m.total_tokens}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
