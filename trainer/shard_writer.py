"""Writing a dataset's shards (:mod:`trainer.data` format) for :mod:`trainer.prepare`: the
:class:`ShardWriter` (each shard hashed as written and renamed into place once complete, the
manifest last), the checks every conversion makes on its inputs and tokens, and
:class:`PrepareError`, whose ``field`` names the parameter or file at fault."""

from __future__ import annotations

import hashlib
import os
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import (
    DTYPES,
    MANIFEST,
    DataError,
    DatasetManifest,
    ShardFile,
    check_vocab_fits,
    dtype_for_vocab,
    token_dtype,
)
from trainer.run_files import create_temp

SHARD_NAME = "shard_{:05d}.bin"


class PrepareError(DataError):
    """Bad input for a dataset conversion; ``field`` is the parameter or file at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


def no_progress(done: int, total: int, what: str) -> None:
    pass


def check_shard_tokens(shard_tokens: int) -> None:
    if isinstance(shard_tokens, bool) or not isinstance(shard_tokens, int) or shard_tokens < 1:
        raise PrepareError("shard_tokens", f"must be a positive integer, got {shard_tokens!r}")


@contextmanager
def as_prepare_error() -> Iterator[None]:
    """trainer.data's checks raise DataError("field: message"); here they become PrepareError."""
    try:
        yield
    except PrepareError:
        raise
    except DataError as e:
        field, _, message = str(e).partition(": ")
        raise PrepareError(field, message) from e


def out_dtype(vocab_size: int, dtype: str | None) -> str:
    with as_prepare_error():
        name = dtype_for_vocab(vocab_size) if dtype is None else dtype
        token_dtype(name)
        check_vocab_fits(vocab_size, name)
    return name


def input_paths(paths: Sequence[Path | str], out: Path) -> list[Path]:
    if not paths:
        raise PrepareError("inputs", "no input files given")
    result = []
    for p in map(Path, paths):
        if not p.is_file():
            raise PrepareError("inputs", f"{p} is not a file")
        r = p.resolve()
        if r.parent == out.resolve() and (r.name == MANIFEST or r.name.startswith("shard_")):
            raise PrepareError("out", f"{out} holds the input {p.name}; write to another directory")
        result.append(p)
    return result


class ShardWriter:
    """Appends tokens to ``shard_NNNNN.bin`` files of ``shard_tokens`` tokens each (the last may be
    shorter), hashing as it writes; each shard is renamed into place once complete. ``finish``
    writes the manifest last; ``abort`` removes what this writer wrote."""

    def __init__(self, out: Path, dtype: str, shard_tokens: int) -> None:
        self.out, self.dtype, self.shard_tokens = out, DTYPES[dtype], shard_tokens
        self.dtype_name = dtype
        out.mkdir(parents=True, exist_ok=True)
        # An older manifest here would describe shards about to be overwritten.
        (out / MANIFEST).unlink(missing_ok=True)
        self.files: list[ShardFile] = []
        self.total = 0
        self._f: Any = None
        self._tmp = Path()  # the open shard's temporary file
        self._hash: Any = None
        self._count = 0

    def write(self, tokens: np.ndarray) -> None:
        """``tokens``: integers already checked to be in ``[0, vocab_size)``."""
        data = np.ascontiguousarray(tokens, dtype=self.dtype)
        while data.size:
            if self._f is None:
                fd, self._tmp = create_temp(self.out / SHARD_NAME.format(len(self.files)))
                self._f = open(fd, "wb")  # noqa: SIM115  # closed in _close_shard
                self._hash = hashlib.sha256()
                self._count = 0
            take = min(data.size, self.shard_tokens - self._count)
            raw = data[:take].tobytes()
            self._f.write(raw)
            self._hash.update(raw)
            self._count += take
            self.total += take
            data = data[take:]
            if self._count == self.shard_tokens:
                self._close_shard()

    def _close_shard(self) -> None:
        assert self._f is not None
        tmp = self._tmp
        self._f.flush()
        os.fsync(self._f.fileno())
        self._f.close()
        self._f = None
        name = SHARD_NAME.format(len(self.files))
        os.replace(tmp, self.out / name)
        size = self._count * self.dtype.itemsize
        self.files.append(ShardFile(name, self._count, size, self._hash.hexdigest()))

    def finish(self, vocab_size: int, source: Mapping[str, object]) -> DatasetManifest:
        if self._f is not None:
            self._close_shard()
        if self.total < 2:
            self.abort()
            raise PrepareError("inputs", f"hold {self.total} tokens; a dataset needs at least 2")
        keep = {f.name for f in self.files}
        for stale in self.out.glob("shard_*.bin"):  # from an earlier, longer conversion
            if stale.name not in keep:
                stale.unlink()
        manifest = DatasetManifest.build(self.dtype_name, vocab_size, self.files, source=source)
        return manifest.write(self.out)

    def abort(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None
            self._tmp.unlink(missing_ok=True)
        for entry in self.files:
            (self.out / entry.name).unlink(missing_ok=True)
        self.files = []


def check_range(tokens: np.ndarray, vocab_size: int, where: str, first_index: int) -> None:
    if not tokens.size:
        return
    lo, hi = int(tokens.min()), int(tokens.max())
    if lo < 0:
        at = first_index + int(np.argmax(tokens < 0))
        raise PrepareError(where, f"negative token {lo} (first negative at token {at})")
    if hi >= vocab_size:
        at = first_index + int(np.argmax(tokens >= vocab_size))
        raise PrepareError(
            where,
            f"token {hi} is not below vocab_size {vocab_size} (first out of range at token "
            f"{at}); pass the vocabulary size the data was tokenized with",
        )
