"""Initial weights from an HF-format directory in S3, hydrated onto the shared filesystem like the
dataset (real SeaweedFS over HTTP), and loaded by the Llama workload."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from tasks.errors import HydrationError
from tasks.hydrate_weights import RECORD, hydrate_weights
from tasks.storage.s3 import boto3_client, s3fs_filesystem
from tasks.weights_pin import local_listing
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
