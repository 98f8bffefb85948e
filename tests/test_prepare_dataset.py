"""Bring your own data: token files and JSONL text become datasets (trainer.prepare, CLI)."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest

from trainer.data import ShardFile, verify_dataset
from trainer.hashing import sha256_file
from trainer.prepare import PrepareError, find_eos_id, from_jsonl, from_token_files
from trainer.sampler import StepSampler

LINES = [
    "the cat sat on the mat",
    "a dog ran in the park",
    "the bird sang a song",
    "we like to read books in the park",
    "",
    "the cat and the dog",
]


def _expected_files(tokens: np.ndarray, dtype: str, shard_tokens: int) -> tuple[ShardFile, ...]:
    out = []
    for i, start in enumerate(range(0, tokens.size, shard_tokens)):
        raw = tokens[start : start + shard_tokens].astype(np.dtype(dtype).newbyteorder("<"))
        digest = hashlib.sha256(raw.tobytes()).hexdigest()
        out.append(ShardFile(f"shard_{i:05d}.bin", int(raw.size), int(raw.nbytes), digest))
    return tuple(out)


def _stream(path: Path) -> np.ndarray:
    m = verify_dataset(path)
    dt = {"uint16": "<u2", "uint32": "<u4"}[m.dtype]
    return np.concatenate([np.fromfile(path / f.name, dtype=dt) for f in m.files])


# ----------------------------------------------------------------------------------------------
# Token files
# ----------------------------------------------------------------------------------------------
def test_bin_and_npy_inputs_become_one_digest_checked_dataset(tmp_path: Path):
    rng = np.random.default_rng(0)
    a = rng.integers(0, 128256, size=1000).astype("<u4")
    b = rng.integers(0, 128256, size=(30, 11)).astype(np.int64)  # 2-D: flattened in C order
    a.tofile(tmp_path / "a.bin")
    np.save(tmp_path / "b.npy", b)
    seen: list[tuple[int, int, str]] = []
    m = from_token_files(
        [tmp_path / "a.bin", tmp_path / "b.npy"],
        tmp_path / "out",
        vocab_size=128256,
        input_dtype="uint32",
        shard_tokens=256,
        progress=lambda d, t, w: seen.append((d, t, w)),
    )
    expected = np.concatenate([a.astype(np.int64), b.reshape(-1)])
    assert m.dtype == "uint32" and m.vocab_size == 128256
    assert m.total_tokens == m.raw["total_tokens"] == expected.size == 1330
    assert m.files == _expected_files(expected, "uint32", 256)
    assert [f.tokens for f in m.files] == [256] * 5 + [50]
    assert json.loads((tmp_path / "out" / "dataset.json").read_text()) == m.raw
    assert np.array_equal(_stream(tmp_path / "out"), expected)
    src = m.raw["source"]
    assert src["kind"] == "token-files"
    assert [(i["name"], i["dtype"], i["tokens"]) for i in src["inputs"]] == [
        ("a.bin", "uint32", 1000),
        ("b.npy", "int64", 330),
    ]
    assert src["inputs"][1]["sha256"] == sha256_file(tmp_path / "b.npy")
    assert seen[-1] == (1330, 1330, "b.npy")
    # The sampler reads ids above 65535 back exactly.
    sampler = StepSampler(tmp_path / "out", seq_len=10, global_batch=2, seed=0)
    x, _ = sampler.batch(1, 0, 1)
    for row, i in zip(x, sampler.sample_ids(1, 0, 1), strict=True):
        assert np.array_equal(row, expected[i * 10 : i * 10 + 10])


def test_uint16_bin_to_uint16_is_byte_identical(tmp_path: Path):
    toks = np.arange(5000, dtype="<u2") % 50000
    toks.tofile(tmp_path / "t.bin")
    m = from_token_files(
        [tmp_path / "t.bin"], tmp_path / "out", vocab_size=50257, input_dtype="uint16"
    )
    assert m.dtype == "uint16" and len(m.files) == 1
    assert m.files[0].sha256 == sha256_file(tmp_path / "t.bin")


def test_reconversion_replaces_a_longer_earlier_dataset(tmp_path: Path):
    np.arange(1000, dtype="<u2").tofile(tmp_path / "t.bin")
    kw = {"vocab_size": 1000, "input_dtype": "uint16"}
    from_token_files([tmp_path / "t.bin"], tmp_path / "out", shard_tokens=100, **kw)
    m = from_token_files([tmp_path / "t.bin"], tmp_path / "out", shard_tokens=400, **kw)
    assert sorted(p.name for p in (tmp_path / "out").glob("shard_*")) == [f.name for f in m.files]
    verify_dataset(tmp_path / "out")


def test_out_of_range_and_negative_tokens_are_named(tmp_path: Path):
    toks = np.array([1, 2, 70000, 3], dtype="<u4")
    toks.tofile(tmp_path / "big.bin")
    with pytest.raises(PrepareError) as e:
        from_token_files(
            [tmp_path / "big.bin"], tmp_path / "out", vocab_size=65536, input_dtype="uint32"
        )
    msg = str(e.value)
    assert "big.bin" in msg and "70000" in msg and "vocab_size 65536" in msg, msg
    assert not (tmp_path / "out" / "dataset.json").exists()
    assert not list((tmp_path / "out").glob("*shard*"))  # nothing half-written left behind
    np.save(tmp_path / "neg.npy", np.array([4, -1, 2], dtype=np.int32))
    with pytest.raises(PrepareError, match=r"neg.npy: negative token -1"):
        from_token_files([tmp_path / "neg.npy"], tmp_path / "out", vocab_size=10)


def test_token_file_input_errors(tmp_path: Path):
    np.arange(10, dtype="<u2").tofile(tmp_path / "t.bin")
    out = tmp_path / "out"
    with pytest.raises(PrepareError, match=r"^input_dtype: t.bin is a raw .bin file"):
        from_token_files([tmp_path / "t.bin"], out, vocab_size=10)
    with pytest.raises(PrepareError, match=r"^input_dtype: 'int16' .* allowed: uint16, uint32"):
        from_token_files([tmp_path / "t.bin"], out, vocab_size=10, input_dtype="int16")
    with pytest.raises(PrepareError, match="not a whole number of uint32 tokens"):
        (tmp_path / "odd.bin").write_bytes(b"\0" * 6)
        from_token_files([tmp_path / "odd.bin"], out, vocab_size=10, input_dtype="uint32")
    np.save(tmp_path / "f.npy", np.zeros(4, dtype=np.float32))
    with pytest.raises(PrepareError, match="float32 values; token arrays must have an integer"):
        from_token_files([tmp_path / "f.npy"], out, vocab_size=10)
    with pytest.raises(PrepareError, match=r"^vocab_size: vocab_size 128256 does not fit .*uint32"):
        from_token_files([tmp_path / "t.bin"], out, vocab_size=128256, dtype="uint16")
    with pytest.raises(PrepareError, match=r"^inputs: .*nope.bin is not a file"):
        from_token_files([tmp_path / "nope.bin"], out, vocab_size=10)
    with pytest.raises(PrepareError, match=r"^shard_tokens"):
        from_token_files([tmp_path / "t.bin"], out, vocab_size=10, shard_tokens=0)


# ----------------------------------------------------------------------------------------------
# JSONL with a tokenizer built here (never downloaded)
# ----------------------------------------------------------------------------------------------
def _build_tokenizer(path: Path, specials: list[str]) -> Path:
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.WordLevel(unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(LINES, trainers.WordLevelTrainer(special_tokens=["[UNK]", *specials]))
    path.parent.mkdir(parents=True, exist_ok=True)
    tok.save(str(path))
    return path


@pytest.fixture
def tokenizer_json(tmp_path: Path) -> Path:
    return _build_tokenizer(tmp_path / "tok" / "tokenizer.json", ["</s>"])


def _write_jsonl(path: Path, lines: list[str], field: str = "text") -> Path:
    path.write_text("".join(json.dumps({field: t, "id": i}) + "\n" for i, t in enumerate(lines)))
    return path


def test_jsonl_stream_is_the_tokenizers_ids_plus_eos(tmp_path: Path, tokenizer_json: Path):
    from tokenizers import Tokenizer

    a = _write_jsonl(tmp_path / "a.jsonl", LINES[:3])
    b = _write_jsonl(tmp_path / "b.jsonl", [*LINES[3:], "unseen words here"])
    seen: list[tuple[int, int, str]] = []
    m = from_jsonl(
        [a, b],
        tmp_path / "out",
        tokenizer_json=tokenizer_json,
        shard_tokens=16,
        batch_lines=2,
        progress=lambda d, t, w: seen.append((d, t, w)),
    )
    tok = Tokenizer.from_file(str(tokenizer_json))
    eos = tok.token_to_id("</s>")
    expected = [i for t in [*LINES, "unseen words here"] for i in [*tok.encode(t).ids, eos]]
    assert np.array_equal(_stream(tmp_path / "out"), expected)
    assert m.vocab_size == tok.get_vocab_size() and m.dtype == "uint16"
    assert m.files == _expected_files(np.array(expected), "uint16", 16)
    src = m.raw["source"]
    assert src["kind"] == "jsonl" and src["eos_id"] == eos and src["documents"] == 7
    assert src["tokenizer"] == {"name": "tokenizer.json", "sha256": sha256_file(tokenizer_json)}
    assert [(i["name"], i["documents"], i["sha256"]) for i in src["inputs"]] == [
        ("a.jsonl", 3, sha256_file(a)),
        ("b.jsonl", 4, sha256_file(b)),
    ]
    total = a.stat().st_size + b.stat().st_size
    assert seen[-1] == (total, total, "b.jsonl")
    assert [d for d, _, _ in seen] == sorted(d for d, _, _ in seen)


def test_jsonl_text_field_no_eos_and_uint32(tmp_path: Path, tokenizer_json: Path):
    from tokenizers import Tokenizer

    src = _write_jsonl(tmp_path / "c.jsonl", LINES, field="body")
    m = from_jsonl(
        [src],
        tmp_path / "out",
        tokenizer_json=tokenizer_json,
        text_field="body",
        append_eos=False,
        vocab_size=100000,
    )
    tok = Tokenizer.from_file(str(tokenizer_json))
    assert m.dtype == "uint32" and m.vocab_size == 100000
    assert _stream(tmp_path / "out").tolist() == [i for t in LINES for i in tok.encode(t).ids]


def test_bad_jsonl_lines_are_reported_with_their_line_number(tmp_path: Path, tokenizer_json: Path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "the cat"}\n\n{"text": "the dog"\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl:3: not valid JSON") as e:
        from_jsonl([bad], tmp_path / "out", tokenizer_json=tokenizer_json)
    assert e.value.field == f"{bad}:3"
    assert not (tmp_path / "out" / "dataset.json").exists()
    bad.write_text('{"text": "the cat"}\n{"txt": "the dog"}\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl:2: text field 'text' is missing"):
        from_jsonl([bad], tmp_path / "out", tokenizer_json=tokenizer_json)
    bad.write_text('{"text": 5}\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl:1: text field 'text' is a int"):
        from_jsonl([bad], tmp_path / "out", tokenizer_json=tokenizer_json)
    bad.write_text('["the cat"]\n')
    with pytest.raises(PrepareError, match=r"bad.jsonl:1: expected a JSON object"):
        from_jsonl([bad], tmp_path / "out", tokenizer_json=tokenizer_json)


def test_eos_is_found_or_must_be_given(tmp_path: Path):
    from tokenizers import Tokenizer

    plain = _build_tokenizer(tmp_path / "plain" / "tokenizer.json", [])
    src = _write_jsonl(tmp_path / "a.jsonl", LINES[:2])
    with pytest.raises(PrepareError, match=r"^eos_id: tokenizer .* --eos-id N"):
        from_jsonl([src], tmp_path / "out", tokenizer_json=plain)
    m = from_jsonl([src], tmp_path / "out", tokenizer_json=plain, eos_id=0)
    assert m.raw["source"]["eos_id"] == 0
    with pytest.raises(PrepareError, match=r"^eos_id: 999 is not a token id below"):
        from_jsonl([src], tmp_path / "out", tokenizer_json=plain, eos_id=999)
    # tokenizer_config.json beside tokenizer.json names the EOS the model was trained with.
    llama = _build_tokenizer(tmp_path / "l3" / "tokenizer.json", ["<|end_of_text|>", "<|eot|>"])
    tok = Tokenizer.from_file(str(llama))
    assert find_eos_id(tok, llama) == tok.token_to_id("<|end_of_text|>")
    (llama.parent / "tokenizer_config.json").write_text(
        json.dumps({"eos_token": {"content": "<|eot|>"}})
    )
    assert find_eos_id(tok, llama) == tok.token_to_id("<|eot|>")
    with pytest.raises(PrepareError, match=r"^tokenizer: .* is not a tokenizer.json"):
        (tmp_path / "junk.json").write_text("{}")
        from_jsonl([src], tmp_path / "out", tokenizer_json=tmp_path / "junk.json")


# ----------------------------------------------------------------------------------------------
# The CLI, with an upload to the session's SeaweedFS and a hydrated copy
# ----------------------------------------------------------------------------------------------
def test_cli_prepare_upload_and_hydrate(tmp_path: Path, tokenizer_json: Path, s3_settings, capsys):
    from flows.cli import main
    from tasks.hydrate import hydrate_dataset
    from tasks.storage.s3 import boto3_client, s3fs_filesystem

    client = boto3_client(s3_settings)
    client.create_bucket(Bucket="prepare-test")
    src = _write_jsonl(tmp_path / "docs.jsonl", LINES * 20)
    out = tmp_path / "out"
    argv = [
        "prepare-dataset",
        str(src),
        "--tokenizer",
        str(tokenizer_json),
        "--out",
        str(out),
        "--shard-tokens",
        "200",
        "--s3-uri",
        "s3://prepare-test/byod/v1",
        "--s3-endpoint",
        str(s3_settings.endpoint_url),
        "--json",
    ]
    assert main(argv) == 0
    captured = capsys.readouterr()
    summary = json.loads(captured.out.strip().splitlines()[-1])
    manifest = verify_dataset(out)
    assert summary == {
        "dir": str(out),
        "dtype": "uint16",
        "vocab_size": manifest.vocab_size,
        "files": len(manifest.files),
        "tokens": manifest.total_tokens,
        "source": "jsonl",
        "uri": "s3://prepare-test/byod/v1",
        "objects": len(manifest.files) + 1,
    }
    assert summary["files"] > 1 and "100%" in captured.err
    listed = client.list_objects_v2(Bucket="prepare-test", Prefix="byod/v1/")["Contents"]
    assert sorted(o["Key"].rsplit("/", 1)[1] for o in listed) == sorted(
        ["dataset.json", *(f.name for f in manifest.files)]
    )
    dest = tmp_path / "fsx"
    report = hydrate_dataset(s3fs_filesystem(s3_settings), "prepare-test", "byod/v1", dest)
    assert report.downloaded == len(manifest.files)
    assert verify_dataset(dest) == manifest
    StepSampler(dest, seq_len=16, global_batch=4, seed=0).batch(1, 0, 1)


def test_cli_missing_bucket_fails_before_converting(tmp_path: Path, s3_settings, capsys):
    from flows.cli import main
    from flows.cli.common import EXIT_FAILED

    np.arange(10, dtype="<u2").tofile(tmp_path / "t.bin")
    argv = ["prepare-dataset", str(tmp_path / "t.bin"), "--out", str(tmp_path / "out")]
    argv += ["--vocab-size", "10", "--input-dtype", "uint16", "--s3-uri", "s3://no-such-bkt/x"]
    assert main([*argv, "--s3-endpoint", str(s3_settings.endpoint_url)]) == EXIT_FAILED
    assert "bucket 'no-such-bkt' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_cli_token_files_plain_output(tmp_path: Path, capsys):
    from flows.cli import main

    np.arange(3000, dtype="<u4").tofile(tmp_path / "t.bin")
    out = tmp_path / "out"
    argv = ["prepare-dataset", str(tmp_path / "t.bin"), "--out", str(out)]
    assert main([*argv, "--vocab-size", "3000", "--input-dtype", "uint32"]) == 0
    assert capsys.readouterr().out.startswith(f"wrote {out}: 1 shards, 3000 uint16 tokens")
    assert verify_dataset(out).dtype == "uint16"


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ([], "error: vocab_size: token files need --vocab-size"),
        (["--vocab-size", "10"], "error: input_dtype: t.bin is a raw .bin file"),
        (["--vocab-size", "10", "--input-dtype", "uint16", "--dtype", "int8"], "error: dtype: "),
        (["--vocab-size", "5", "--input-dtype", "uint16"], "is not below vocab_size 5"),
        (["--vocab-size", "10", "--input-dtype", "u16"], "error: input_dtype: 'u16'"),
        (["--vocab-size", "10", "--no-eos"], "error: no_eos: needs --tokenizer"),
        (["--vocab-size", "10", "--s3-uri", "http://x/y"], "error: s3_uri: "),
        (["--tokenizer", "missing.json"], "error: tokenizer: missing.json is not a file"),
    ],
)
def test_cli_bad_input_exits_2_naming_the_field(tmp_path: Path, capsys, extra, message):
    from flows.cli import main
    from flows.cli.common import EXIT_USAGE

    np.arange(10, dtype="<u2").tofile(tmp_path / "t.bin")
    argv = ["prepare-dataset", str(tmp_path / "t.bin"), "--out", str(tmp_path / "out"), *extra]
    assert main(argv) == EXIT_USAGE
    assert message in capsys.readouterr().err
