"""Bring your own data: token files or JSONL text into a dataset (``trainer.data`` format).

:func:`from_token_files` takes ``.bin`` files (raw little-endian ``uint16``/``uint32``, the caller
says which) or ``.npy`` integer arrays; :func:`from_jsonl` takes one document per line, tokenized
with a local ``tokenizer.json`` (Hugging Face ``tokenizers``), each followed by the EOS id.

Both stream (memory stays bounded whatever the input size) and write the manifest last and
atomically (a half-written directory never looks complete), with a ``source`` block saying what
produced it. Errors are :class:`PrepareError`, whose ``field`` names the parameter or the file
(``path:line`` for a JSONL line). ``nvrx-pipeline prepare-dataset`` wraps this (and uploads).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable, Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from trainer.data import DTYPES, DatasetManifest, token_dtype
from trainer.hashing import sha256_file
from trainer.shard_writer import (
    PrepareError,
    ShardWriter,
    as_prepare_error,
    check_range,
    check_shard_tokens,
    input_paths,
    no_progress,
    out_dtype,
)

Progress = Callable[[int, int, str], None]
DEFAULT_SHARD_TOKENS = 1 << 26  # 64 Mi tokens: 128 MiB of uint16, 256 MiB of uint32 per shard
CHUNK_TOKENS = 1 << 20  # tokens read per step from a token file
BATCH_LINES = 1024  # JSONL lines encoded per encode_batch call
# Tried in order when the tokenizer's tokenizer_config.json does not name its eos_token.
EOS_CANDIDATES = ("<|end_of_text|>", "<|endoftext|>", "</s>", "<eos>", "<|im_end|>")


def _open_token_file(path: Path, input_dtype: str | None) -> tuple[np.ndarray, str]:
    """A read-only view of the file's tokens (memory-mapped, never loaded whole) and its dtype."""
    if path.suffix == ".npy":
        try:
            arr = np.load(path, mmap_mode="r", allow_pickle=False)
        except (ValueError, OSError) as e:
            raise PrepareError(str(path), f"not a readable .npy array ({e})") from e
        if not np.issubdtype(arr.dtype, np.integer):
            raise PrepareError(
                str(path), f"holds {arr.dtype} values; token arrays must have an integer dtype"
            )
        return arr, str(arr.dtype)
    if path.suffix != ".bin":
        raise PrepareError(
            str(path), "unknown input type: token files are .bin (raw) or .npy (numpy)"
        )
    if input_dtype is None:
        raise PrepareError(
            "input_dtype",
            f"{path.name} is a raw .bin file, which does not record its dtype; pass "
            f"--input-dtype ({' or '.join(DTYPES)})",
        )
    with as_prepare_error():
        dt = token_dtype(input_dtype, field="input_dtype")
    size = path.stat().st_size
    if size % dt.itemsize:
        raise PrepareError(
            str(path), f"is {size} bytes, not a whole number of {input_dtype} tokens"
        )
    if size == 0:
        return np.empty(0, dtype=dt), input_dtype
    return np.memmap(path, dtype=dt, mode="r"), input_dtype


def _chunks(arr: np.ndarray, chunk_tokens: int) -> Iterator[np.ndarray]:
    """The array's elements in C order, flat, a bounded number at a time."""
    arr = arr.reshape(1) if arr.ndim == 0 else arr
    row = int(np.prod(arr.shape[1:]))  # 1 for a flat array
    if row == 0:
        return
    rows = max(1, chunk_tokens // row)
    for i in range(0, arr.shape[0], rows):
        yield np.asarray(arr[i : i + rows]).reshape(-1)


def from_token_files(
    paths: Sequence[Path | str],
    out: Path | str,
    *,
    vocab_size: int,
    input_dtype: str | None = None,
    dtype: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    progress: Progress | None = None,
) -> DatasetManifest:
    """Re-shard token files (concatenated in order; ``.npy`` flattened in C order) into a dataset
    at ``out``; its manifest. ``dtype``: default the smallest holding ``vocab_size``. Every token
    must be in ``[0, vocab_size)``. ``progress(done_tokens, total_tokens, file_name)`` per chunk.
    """
    out = Path(out)
    progress = progress or no_progress
    check_shard_tokens(shard_tokens)
    name = out_dtype(vocab_size, dtype)
    files = input_paths(paths, out)
    # Every input is checked before anything is written, and mapped again in its turn (a map
    # holds a file descriptor, and there may be thousands of inputs).
    total = sum(int(_open_token_file(p, input_dtype)[0].size) for p in files)
    writer = ShardWriter(out, name, shard_tokens)
    inputs = []
    done = 0
    try:
        for path in files:
            arr, in_dtype = _open_token_file(path, input_dtype)
            first = done
            for chunk in _chunks(arr, CHUNK_TOKENS):
                check_range(chunk, vocab_size, str(path), done - first)
                writer.write(chunk)
                done += chunk.size
                progress(done, total, path.name)
            inputs.append(
                {
                    "name": path.name,
                    "dtype": in_dtype,
                    "tokens": done - first,
                    "bytes": path.stat().st_size,
                    "sha256": sha256_file(path),
                }
            )
            del arr  # unmap before the next input
        source = {"kind": "token-files", "inputs": inputs}
        return writer.finish(vocab_size, source)
    except BaseException:
        writer.abort()
        raise


def load_tokenizer(tokenizer_json: Path | str) -> Any:
    """A ``tokenizers.Tokenizer`` from a local file (never a hub download)."""
    path = Path(tokenizer_json)
    if not path.is_file():
        raise PrepareError("tokenizer", f"{path} is not a file (a local tokenizer.json)")
    from tokenizers import Tokenizer

    try:
        return Tokenizer.from_file(str(path))
    except Exception as e:  # the Rust side raises plain Exception
        raise PrepareError("tokenizer", f"{path} is not a tokenizer.json ({e})") from e


def find_eos_id(tokenizer: Any, tokenizer_json: Path | str | None = None) -> int | None:
    """The tokenizer's end-of-text id: the ``eos_token`` of a ``tokenizer_config.json`` beside
    ``tokenizer_json`` if there is one, else the first of :data:`EOS_CANDIDATES` it knows."""
    names: list[str] = []
    if tokenizer_json is not None:
        config = Path(tokenizer_json).with_name("tokenizer_config.json")
        try:
            eos = json.loads(config.read_text()).get("eos_token")
        except (OSError, ValueError, AttributeError):
            eos = None
        if isinstance(eos, dict):
            eos = eos.get("content")
        if isinstance(eos, str):
            names.append(eos)
    for name in [*names, *EOS_CANDIDATES]:
        tid = tokenizer.token_to_id(name)
        if tid is not None:
            return int(tid)
    return None


def _jsonl_batches(
    path: Path, text_field: str, batch_lines: int, hasher: Any, on_bytes: Callable[[int], None]
) -> Iterator[list[str]]:
    """Batches of documents from a JSONL file, read line by line; blank lines are skipped."""
    batch: list[str] = []
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            hasher.update(raw)
            on_bytes(len(raw))
            if not raw.strip():
                continue
            where = f"{path}:{lineno}"
            try:
                doc = json.loads(raw)
            except UnicodeDecodeError as e:
                raise PrepareError(where, f"not UTF-8 ({e})") from e
            except json.JSONDecodeError as e:
                raise PrepareError(where, f"not valid JSON ({e.msg} at column {e.colno})") from e
            if not isinstance(doc, dict):
                raise PrepareError(where, f"expected a JSON object, got {type(doc).__name__}")
            text = doc.get(text_field)
            if not isinstance(text, str):
                why = "missing" if text_field not in doc else f"a {type(text).__name__}"
                keys = ", ".join(sorted(map(str, doc))[:8]) or "none"
                raise PrepareError(
                    where,
                    f"text field {text_field!r} is {why}, not a string (keys: {keys}); "
                    "choose the field with --text-field",
                )
            batch.append(text)
            if len(batch) >= batch_lines:
                yield batch
                batch = []
    if batch:
        yield batch


def from_jsonl(
    paths: Sequence[Path | str],
    out: Path | str,
    *,
    tokenizer_json: Path | str,
    text_field: str = "text",
    append_eos: bool = True,
    eos_id: int | None = None,
    vocab_size: int | None = None,
    dtype: str | None = None,
    shard_tokens: int = DEFAULT_SHARD_TOKENS,
    batch_lines: int = BATCH_LINES,
    progress: Progress | None = None,
) -> DatasetManifest:
    """Tokenize JSONL documents (each line's ``text_field``) into a dataset at ``out``; its
    manifest. A document is ``tokenizer.encode(text).ids``, then ``eos_id`` when ``append_eos``
    (default the tokenizer's own, :func:`find_eos_id`). ``vocab_size`` defaults to the
    tokenizer's. ``progress(done_bytes, total_bytes, file_name)`` per ``batch_lines`` lines.
    """
    out = Path(out)
    progress = progress or no_progress
    check_shard_tokens(shard_tokens)
    if batch_lines < 1:
        raise PrepareError("batch_lines", f"must be a positive integer, got {batch_lines!r}")
    if not text_field:
        raise PrepareError("text_field", "must not be empty")
    files = input_paths(paths, out)
    tok = load_tokenizer(tokenizer_json)
    vocab = int(tok.get_vocab_size()) if vocab_size is None else vocab_size
    name = out_dtype(vocab, dtype)
    eos = _document_end(tok, tokenizer_json, eos_id, vocab) if append_eos else None
    total = sum(p.stat().st_size for p in files)
    writer = ShardWriter(out, name, shard_tokens)
    state = {"done": 0}
    inputs = []
    documents = 0

    def count(n: int) -> None:
        state["done"] += n

    try:
        for path in files:
            hasher = hashlib.sha256()
            first_tokens, first_docs = writer.total, documents
            for batch in _jsonl_batches(path, text_field, batch_lines, hasher, count):
                ids = _encode(tok, batch, eos)
                check_range(ids, vocab, str(path), writer.total - first_tokens)
                writer.write(ids)
                documents += len(batch)
                progress(state["done"], total, path.name)
            progress(state["done"], total, path.name)
            inputs.append(
                {
                    "name": path.name,
                    "bytes": path.stat().st_size,
                    "sha256": hasher.hexdigest(),
                    "documents": documents - first_docs,
                    "tokens": writer.total - first_tokens,
                }
            )
        source = {
            "kind": "jsonl",
            "inputs": inputs,
            "text_field": text_field,
            "tokenizer": {
                "name": Path(tokenizer_json).name,
                "sha256": sha256_file(Path(tokenizer_json)),
            },
            "append_eos": append_eos,
            "eos_id": eos,
            "documents": documents,
        }
        return writer.finish(vocab, source)
    except BaseException:
        writer.abort()
        raise


def _document_end(tok: Any, tokenizer_json: Path | str, eos_id: int | None, vocab: int) -> int:
    """The token appended after each document: ``eos_id``, else the tokenizer's own EOS."""
    eos = find_eos_id(tok, tokenizer_json) if eos_id is None else eos_id
    if eos is None:
        raise PrepareError(
            "eos_id",
            f"tokenizer {tokenizer_json} has no end-of-text token known here "
            f"({', '.join(EOS_CANDIDATES)}, or eos_token in tokenizer_config.json); pass "
            "--eos-id N, or --no-eos to concatenate documents without one",
        )
    if isinstance(eos, bool) or not isinstance(eos, int) or not 0 <= eos < vocab:
        raise PrepareError("eos_id", f"{eos!r} is not a token id below vocab_size {vocab}")
    return eos


def _encode(tok: Any, texts: list[str], eos: int | None) -> np.ndarray:
    encodings = tok.encode_batch(texts)
    pieces: Iterable[list[int]] = (
        (e.ids for e in encodings) if eos is None else ([*e.ids, eos] for e in encodings)
    )
    flat = [i for ids in pieces for i in ids]
    return np.asarray(flat, dtype=np.int64)
