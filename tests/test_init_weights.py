"""Initial weights from an HF-format directory in S3, hydrated onto the shared filesystem like the
dataset (real SeaweedFS over HTTP), and loaded by the Llama workload."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from tasks.errors import HydrationError
from tasks.hydrate_weights import RECORD, hydrate_weights
from tasks.storage.s3 import boto3_client, s3fs_filesystem
from tasks.weights_pin import LISTING_NAME, WeightsPin, local_listing
from trainer.workload import load_workload


def _bucket(client, name: str) -> None:
    try:
        client.head_bucket(Bucket=name)
    except Exception:
        client.create_bucket(Bucket=name)


def test_weights_hydrate_and_load(s3_settings, tmp_path: Path):
    wl = load_workload("llama-tiny")
    torch.manual_seed(7)
    source = wl.build_model("cpu")
    source.save_pretrained(str(tmp_path / "hf"))  # type: ignore[operator]
    client = boto3_client(s3_settings)
    _bucket(client, "nvrx-weights")
    for f in (tmp_path / "hf").iterdir():
        client.upload_file(str(f), "nvrx-weights", f"llama-tiny/v1/{f.name}")
    # A pickled checkpoint beside them is never fetched (only safetensors are ever loaded).
    client.put_object(Bucket="nvrx-weights", Key="llama-tiny/v1/pytorch_model.bin", Body=b"x")

    fs = s3fs_filesystem(s3_settings)
    dest = tmp_path / "fsx" / "weights"
    report = hydrate_weights(fs, "s3://nvrx-weights/llama-tiny/v1", dest)
    assert sorted(p.name for p in dest.iterdir()) == [
        RECORD,  # written last: what a later run may reuse, read again before it does
        "config.json",
        "generation_config.json",
        "model.safetensors",
    ]
    assert report.downloaded == 3
    # Unpinned, the digest is still reported (the hydrate line says it, to pin it next time).
    assert report.manifest_sha256 == local_listing(tmp_path / "hf").digest()
    assert hydrate_weights(fs, "s3://nvrx-weights/llama-tiny/v1", dest).downloaded == 0

    torch.manual_seed(0)  # a different seed: the weights must come from the directory
    model = load_workload("llama-tiny", {"init_weights": str(dest)}).build_model("cpu")
    expected = source.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())


class _Listing:
    """The real filesystem, its listing saying every object is ``size`` bytes (an object that
    grew after it was listed)."""

    def __init__(self, fs, size: int):
        self.fs, self.size = fs, size

    def ls(self, *args, **kwargs):
        return [{**item, "size": self.size} for item in self.fs.ls(*args, **kwargs)]

    def __getattr__(self, name):
        return getattr(self.fs, name)


def test_a_weight_larger_than_listed_is_not_copied_past_the_listing(s3_settings, tmp_path):
    client = boto3_client(s3_settings)
    _bucket(client, "nvrx-weights")
    client.put_object(Bucket="nvrx-weights", Key="grown/model.safetensors", Body=b"x" * (1 << 20))
    client.put_object(Bucket="nvrx-weights", Key="grown/config.json", Body=b"{}")
    fs = _Listing(s3fs_filesystem(s3_settings), 2)
    dest = tmp_path / "weights"
    with pytest.raises(HydrationError, match=r"more than 2 bytes where the listing says 2"):
        hydrate_weights(fs, "s3://nvrx-weights/grown", dest)
    assert not dest.exists() or not any(dest.iterdir())  # nothing landed


def test_untrusted_weight_listings_are_refused(s3_settings):
    client = boto3_client(s3_settings)
    _bucket(client, "nvrx-weights")
    client.put_object(Bucket="nvrx-weights", Key="hostile/.bashrc.json", Body=b"{}")
    client.put_object(Bucket="nvrx-weights", Key="hostile/config.json", Body=b"{}")
    fs = s3fs_filesystem(s3_settings)
    with pytest.raises(HydrationError, match=r"refusing the object name '.bashrc.json'"):
        hydrate_weights(fs, "s3://nvrx-weights/hostile", Path("/nonexistent"))
    client.put_object(Bucket="nvrx-weights", Key="nothing/readme.json", Body=b"{}")
    with pytest.raises(HydrationError, match=r"must hold config.json and \*.safetensors"):
        hydrate_weights(fs, "s3://nvrx-weights/nothing", Path("/nonexistent"))


def test_s3_weights_map_to_the_hydrated_directory(tmp_path: Path, dataset: Path):
    from pydantic import ValidationError

    from flows.context import RunContext, train_config
    from flows.models import PipelineParams
    from tasks.backends.base import Placement

    params = PipelineParams(
        state_dir=str(tmp_path),
        workload="llama-tiny",
        workload_options={"init_weights": "s3://nvrx-weights/llama-tiny/v1"},
    )
    ctx = RunContext.create(params)
    assert ctx.weights_dir == tmp_path.absolute() / "fsx/weights/nvrx-weights/llama-tiny/v1"
    where = Placement(shared_root=tmp_path)
    cfg = train_config(params, where, ctx.run_root, dataset, weights_dir=ctx.weights_dir)
    assert cfg.workload_options["init_weights"] == str(ctx.weights_dir)
    with pytest.raises(
        ValidationError, match=r"init_weights: the eks backend does not copy s3:// weights"
    ):
        PipelineParams(
            backend="eks",
            workload="llama-tiny",
            workload_options={"init_weights": "s3://nvrx-weights/p"},
            global_batch=16,
        )


@pytest.mark.parametrize(
    ("uri", "said"),
    [
        # no bucket: the rest read as an absolute path (the hydrated files land there)
        ("s3:///tmp/anywhere", "bucket '' is not a valid S3 bucket name"),
        # out of weights/ into another run's config/, which is code
        ("s3://nvrx-weights/../../runs/other/config", "must not contain empty, '.' or '..'"),
        ("s3://nvrx-weights/a/./b", "must not contain empty, '.' or '..'"),
        ("s3://user:secret@nvrx-weights/p", "must not carry credentials"),
    ],
)
def test_init_weights_that_would_write_outside_weights_are_refused(
    tmp_path: Path, uri: str, said: str
):
    """Issue 28: the weights' S3 prefix becomes a directory on the shared filesystem, so it is
    validated as one before anything runs."""
    from pydantic import ValidationError

    from flows.models import PipelineParams

    with pytest.raises(
        ValidationError, match=r"workload_options.init_weights: .*" + re.escape(said)
    ):
        PipelineParams(
            state_dir=str(tmp_path), workload="llama-tiny", workload_options={"init_weights": uri}
        )


# --- pinned weights: initial_weights.sha256 and initial_weights.max_gib ----------------------


@dataclass(frozen=True)
class PinCase:
    id: str
    pin: str  # "right", "wrong" or "none": initial_weights.sha256 against the uploaded weights
    listing_beside: bool = False  # weights.sha256 (`weights-digest DIR --write`) uploaded too
    swap: str | None = None  # a file replaced in S3 after pinning: same size, other bytes
    cap: str = "default"  # "under": the cap one byte under the listed sizes' sum
    refused: str | None = None  # the refusal (a regex); None: hydrated and loaded


PIN_CASES = [
    PinCase("right-digest", "right"),
    PinCase("right-digest-listing-beside", "right", listing_beside=True),
    PinCase("unpinned", "none"),
    PinCase(
        "wrong-digest",
        "wrong",
        refused=r"initial_weights.sha256: the weights at s3://\S+ have digest [0-9a-f]{64}, not "
        r"the pinned 0{64}: .*nothing was hydrated",
    ),
    PinCase(
        "swapped-file-named",
        "right",
        listing_beside=True,
        swap="model.safetensors",
        refused=r"initial_weights.sha256: s3://\S+/model.safetensors has sha256 [0-9a-f]{64}, "
        r"the pinned listing says [0-9a-f]{64}: it was replaced",
    ),
    PinCase(
        "swapped-file-whole",
        "right",
        swap="config.json",
        refused=r"initial_weights.sha256: the weights at s3://\S+ have digest",
    ),
    PinCase(
        "listing-beside-not-the-pin",
        "wrong",
        listing_beside=True,
        refused=r"initial_weights.sha256: s3://\S+/weights.sha256 \(the weights' listing\) has "
        r"digest [0-9a-f]{64}, not the pinned 0{64}",
    ),
    PinCase(
        "over-the-cap",
        "right",
        cap="under",
        refused=r"initial_weights.max_gib: initial weights s3://\S+ list \d+ bytes .* over the "
        r"cap",
    ),
]


class _Opens:
    """The real filesystem, counting the objects opened (a byte copied needs one)."""

    def __init__(self, fs):
        self.fs, self.opened = fs, []

    def open(self, path, *args, **kwargs):
        self.opened.append(path)
        return self.fs.open(path, *args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.fs, name)


def _llama_dir(tmp_path: Path) -> tuple[torch.nn.Module, Path]:
    torch.manual_seed(7)
    source = load_workload("llama-tiny").build_model("cpu")
    local = tmp_path / "hf"
    source.save_pretrained(str(local))  # type: ignore[operator]
    return source, local


def _swapped(data: bytes) -> bytes:
    """Other bytes, the same size (a JSON file stays JSON-sized; the digest is what differs)."""
    return data[:-1] + (b" " if data[-1:] != b" " else b"\n")


@pytest.mark.parametrize("case", PIN_CASES, ids=[c.id for c in PIN_CASES])
def test_pinned_weights(case: PinCase, s3_settings, tmp_path: Path):
    source, local = _llama_dir(tmp_path)
    listing = local_listing(local)
    client = boto3_client(s3_settings)
    _bucket(client, "nvrx-weights")
    prefix = f"pins/{case.id}"
    if case.listing_beside:
        (local / LISTING_NAME).write_text(listing.text())
    for f in local.iterdir():
        body = f.read_bytes()
        if f.name == case.swap:
            body = _swapped(body)
            assert len(body) == f.stat().st_size
        client.put_object(Bucket="nvrx-weights", Key=f"{prefix}/{f.name}", Body=body)
    total = sum(f.size for f in listing.files)
    pin = WeightsPin(
        sha256={"right": listing.digest(), "wrong": "0" * 64, "none": None}[case.pin],
        max_bytes=total - 1 if case.cap == "under" else WeightsPin().max_bytes,
    )
    fs = _Opens(s3fs_filesystem(s3_settings))
    dest = tmp_path / "fsx" / "weights"
    uri = f"s3://nvrx-weights/{prefix}"
    if case.refused is not None:
        with pytest.raises(HydrationError, match=case.refused):
            hydrate_weights(fs, uri, dest, pin=pin)
        # Nothing a later run could trust: no record, no weight file, no partial file.
        assert not dest.exists() or list(dest.iterdir()) == []
        if case.cap == "under":
            assert fs.opened == []  # refused from the listing: not a byte copied
        return
    report = hydrate_weights(fs, uri, dest, pin=pin)
    assert report.downloaded == len(listing.files) and report.manifest_sha256 == listing.digest()
    assert (dest / RECORD).read_text() == listing.text()
    torch.manual_seed(0)  # a different seed: the weights must come from the directory
    model = load_workload("llama-tiny", {"init_weights": str(dest)}).build_model("cpu")
    expected = source.state_dict()
    assert all(torch.equal(t, expected[k]) for k, t in model.state_dict().items())


def test_a_cached_copy_is_reused_only_as_the_pin_says(s3_settings, tmp_path: Path):
    """The hydrated directory is kept per prefix across runs: a run reuses a file there only
    when a listing whose digest is its pin names it, and only after reading it again."""
    _, local = _llama_dir(tmp_path)
    listing = local_listing(local)
    client = boto3_client(s3_settings)
    _bucket(client, "nvrx-weights")
    for f in local.iterdir():
        client.upload_file(str(f), "nvrx-weights", f"cached/{f.name}")
    fs = s3fs_filesystem(s3_settings)
    uri, dest = "s3://nvrx-weights/cached", tmp_path / "weights"
    pin = WeightsPin(sha256=listing.digest())
    n = len(listing.files)
    assert hydrate_weights(fs, uri, dest, pin=pin).downloaded == n
    assert hydrate_weights(fs, uri, dest, pin=pin).downloaded == 0  # the record is the pin's

    # Tampered on the shared filesystem (same size): read again, found different, copied again.
    model = dest / "model.safetensors"
    model.write_bytes(_swapped(model.read_bytes()))
    assert hydrate_weights(fs, uri, dest, pin=pin).downloaded == 1
    assert local_listing(dest).digest() == listing.digest()

    # A forged record (it lists the tampered file): its digest is not the pin, so not trusted.
    model.write_bytes(_swapped(model.read_bytes()))
    (dest / RECORD).write_text(local_listing(dest).text())
    (dest / "stale-00002-of-00002.safetensors").write_bytes(b"older version")
    assert hydrate_weights(fs, uri, dest, pin=pin).downloaded == n
    assert local_listing(dest).digest() == listing.digest()  # and the stray shard is gone

    # Another pin: refused; the record goes, so the next run trusts nothing of this copy.
    with pytest.raises(HydrationError, match=r"initial_weights.sha256: the weights at"):
        hydrate_weights(fs, uri, dest, pin=WeightsPin(sha256="f" * 64))
    assert not (dest / RECORD).exists()
    assert hydrate_weights(fs, uri, dest, pin=pin).downloaded == n


def test_the_digest_is_the_sha256_of_the_listing_and_the_cli_prints_it(tmp_path: Path, capsys):
    """The digest a user computes before the run: documented exactly, so any tool can too."""
    import hashlib
    import json

    from flows.cli import main

    d = tmp_path / "w"
    d.mkdir()
    (d / "config.json").write_bytes(b"{}")
    (d / "b.safetensors").write_bytes(bytes(5))
    (d / "pytorch_model.bin").write_bytes(b"never fetched, never pinned")
    zeros, braces = hashlib.sha256(bytes(5)).hexdigest(), hashlib.sha256(b"{}").hexdigest()
    text = f"{zeros}  5  b.safetensors\n{braces}  2  config.json\n"
    digest = hashlib.sha256(text.encode()).hexdigest()
    assert local_listing(d).text() == text and local_listing(d).digest() == digest
    assert main(["weights-digest", str(d), "--write", "--json"]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1])["sha256"] == digest
    assert (d / LISTING_NAME).read_text() == text  # `sha256sum weights.sha256` prints it
    assert local_listing(d).digest() == digest  # the listing file is not a weight file
    assert main(["weights-digest", str(tmp_path / "none")]) == 2


@pytest.mark.parametrize(
    ("pin", "options", "said"),
    [
        ({"sha256": "abc"}, None, r"initial_weights.sha256\n.*expected 64 hex digits"),
        ({"sha256": "g" * 64}, None, r"initial_weights.sha256\n.*expected 64 hex digits"),
        ({"sha256": "a" * 65}, None, r"initial_weights.sha256\n.*expected 64 hex digits"),
        ({"max_gib": 0}, None, r"initial_weights.max_gib\n.*greater than 0"),
        ({"max_gib": 4096}, None, r"initial_weights.max_gib\n.*less than or equal to 512"),
        ({"sha256": "a" * 64}, {}, r"initial_weights.sha256: no initial weights to pin"),
        ({"sha256": "a" * 64}, {"init_weights": "/fsx/w"}, r"initial_weights.sha256: pins s3://"),
    ],
)
def test_a_malformed_pin_is_refused_at_the_form_naming_the_field(pin, options, said, tmp_path):
    from pydantic import ValidationError

    from flows.models import PipelineParams

    options = {"init_weights": "s3://nvrx-weights/p"} if options is None else options
    with pytest.raises(ValidationError, match=said):
        PipelineParams(
            state_dir=str(tmp_path),
            workload="llama-tiny",
            workload_options=options,
            initial_weights=pin,
        )


def test_a_deployment_may_require_pinned_weights(monkeypatch, tmp_path: Path):
    from pydantic import ValidationError

    from flows.models import PipelineParams

    form = {
        "state_dir": str(tmp_path),
        "workload": "llama-tiny",
        "workload_options": {"init_weights": "s3://nvrx-weights/p"},
    }
    assert PipelineParams(**form).initial_weights.sha256 is None  # unset: a plain run works
    monkeypatch.setenv("NVRX_ALLOWED_UNPINNED_WEIGHTS", "none")
    with pytest.raises(
        ValidationError,
        match=r"initial_weights.sha256: unpinned initial weights "
        r"from 'nvrx-weights' are not allowed.*NVRX_ALLOWED_UNPINNED_WEIGHTS",
    ):
        PipelineParams(**form)
    assert PipelineParams(**form, initial_weights={"sha256": "A" * 64}).initial_weights.pin() == (
        WeightsPin(sha256="a" * 64, max_bytes=64 << 30)
    )
    monkeypatch.setenv("NVRX_ALLOWED_UNPINNED_WEIGHTS", "scratch,nvrx-weights")
    PipelineParams(**form)


def test_the_local_backend_hydrates_with_the_runs_pin(s3_settings, dataset: Path, tmp_path):
    """The form's pin reaches hydration (flows.stages builds the request from it), and the
    hydrate line says whether the weights were pinned."""
    from tasks.backends.base import HydrateRequest
    from tasks.backends.local import LocalBackend
    from tasks.hydrate import upload_dataset

    client = boto3_client(s3_settings)
    _bucket(client, "nvrx-datasets")
    _bucket(client, "nvrx-weights")
    upload_dataset(client, dataset, "nvrx-datasets", "pin-backend")
    weights = tmp_path / "w"
    weights.mkdir()
    (weights / "config.json").write_bytes(b"{}")
    (weights / "model.safetensors").write_bytes(b"tensors")
    for f in weights.iterdir():
        client.upload_file(str(f), "nvrx-weights", f"pin-backend/{f.name}")
    digest = local_listing(weights).digest()

    def hydrate(pin: WeightsPin) -> str:
        request = HydrateRequest(
            run_id="r",
            bucket="nvrx-datasets",
            prefix="pin-backend",
            data_dir=tmp_path / "fsx" / "data",
            s3=s3_settings,
            weights=("s3://nvrx-weights/pin-backend", tmp_path / "fsx" / "weights"),
            weights_pin=pin,
        )
        return LocalBackend(tmp_path).hydrate(request, lambda *a: None).detail

    with pytest.raises(HydrationError, match=r"initial_weights.sha256: the weights at"):
        hydrate(WeightsPin(sha256="0" * 64))
    assert f"sha256 {digest} pinned" in hydrate(WeightsPin(sha256=digest))
    assert "NOT pinned (no initial_weights.sha256)" in hydrate(WeightsPin())
