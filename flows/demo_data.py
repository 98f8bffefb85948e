"""The demo's data: local S3's buckets, and its synthetic dataset where the demo's own prefix is
empty (nowhere else: that would hide a mistyped prefix)."""

from __future__ import annotations

import difflib

from prefect import task
from prefect.logging import get_run_logger

from flows.context import RunContext
from flows.locations import DEMO_DATASET, DatasetLocation
from flows.models import PipelineParams
from tasks.errors import PreflightFailed
from tasks.hydrate import upload_dataset
from tasks.storage.s3 import boto3_client
from trainer.data import write_synthetic_dataset


@task(name="seed-demo-dataset")
def seed_demo_dataset(params: PipelineParams, ctx: RunContext) -> bool:
    """Local S3 only: create the buckets, and the demo's synthetic dataset when the demo's own
    prefix is empty. Any other empty prefix is refused: seeding it would train "successfully"
    on random tokens after a typo in the prefix."""
    log = get_run_logger()
    client = boto3_client(ctx.s3)
    for bucket in (params.dataset.bucket, params.export.bucket):
        try:
            client.head_bucket(Bucket=bucket)
        except Exception:
            client.create_bucket(Bucket=bucket)
            log.info("created bucket %s", bucket)
    key = f"{params.dataset.prefix}/dataset.json"
    try:
        client.head_object(Bucket=params.dataset.bucket, Key=key)
        return False
    except Exception:
        pass
    check_seedable(params.dataset)
    staging = ctx.state_dir / "seed" / params.dataset.prefix
    write_synthetic_dataset(staging, vocab_size=512, seed=0)
    n = upload_dataset(client, staging, params.dataset.bucket, params.dataset.prefix)
    log.info(
        "seeded s3://%s/%s with the demo's synthetic dataset (%d objects)",
        params.dataset.bucket,
        params.dataset.prefix,
        n,
    )
    return True


def check_seedable(dataset: DatasetLocation) -> None:
    """Raise when ``dataset`` (found empty) is not the demo's own location: seeding writes
    synthetic tokens, and anywhere else that would hide a mistyped prefix."""
    if dataset == DEMO_DATASET:
        return
    demo = f"s3://{DEMO_DATASET.bucket}/{DEMO_DATASET.prefix}"
    given = f"s3://{dataset.bucket}/{dataset.prefix}"
    close = difflib.SequenceMatcher(None, given, demo).ratio() >= 0.8
    hint = f" (did you mean {demo}?)" if close else ""
    raise PreflightFailed(
        f"dataset: {given}/dataset.json does not exist{hint}, and "
        f"seed_demo_dataset writes its synthetic tokens only into the demo's own {demo}. "
        "Fix dataset.bucket/dataset.prefix, or upload your data there first "
        "(nvrx-pipeline prepare-dataset INPUTS --out DIR --s3-uri "
        f"s3://{dataset.bucket}/{dataset.prefix}); for the demo's data leave dataset unset"
    )
