"""FSx calls through botocore's Stubber: every call and response is checked against the real FSx
service model (no emulator implements data repository associations or tasks)."""

from __future__ import annotations

import re
from datetime import UTC, datetime
from pathlib import Path

import boto3
import kubernetes_validate
import pytest
from botocore.stub import Stubber

from tasks.backends.eks.fsx import (
    Backoff,
    ensure_association,
    import_metadata,
)
from tasks.backends.eks.hydrate import hydration_job
from tasks.backends.eks.params import EksParams
from tasks.errors import HydrationError
from tests.test_eks_render import K8S_VERSION

FS = "fs-0123456789abcdef0"
NOW = datetime(2026, 11, 29, tzinfo=UTC)
FAST = Backoff(first_s=1, factor=2, max_s=4, deadline_s=60)


@pytest.fixture
def fsx():
    client = boto3.client(
        "fsx", region_name="us-east-1", aws_access_key_id="x", aws_secret_access_key="x"
    )
    with Stubber(client) as stub:
        yield client, stub
        stub.assert_no_pending_responses()


def assoc(state: str, path: str = "/datasets", s3: str = "s3://nvrx-datasets/synthetic") -> dict:
    return {
        "AssociationId": "dra-0123456789abcdef0",
        "FileSystemId": FS,
        "Lifecycle": state,
        "FileSystemPath": path,
        "DataRepositoryPath": s3,
    }


def test_association_created_once(fsx):
    client, stub = fsx
    sleeps: list[float] = []
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": []},
        {"Filters": [{"Name": "file-system-id", "Values": [FS]}]},
    )
    stub.add_response(
        "create_data_repository_association",
        {"Association": assoc("CREATING")},
        {
            "FileSystemId": FS,
            "FileSystemPath": "/datasets",
            "DataRepositoryPath": "s3://nvrx-datasets/synthetic",
            "BatchImportMetaDataOnCreate": False,
            "ClientRequestToken": "run1",
        },
    )
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": [assoc("CREATING")]},
        {"AssociationIds": ["dra-0123456789abcdef0"]},
    )
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": [assoc("AVAILABLE")]},
        {"AssociationIds": ["dra-0123456789abcdef0"]},
    )
    got = ensure_association(
        client,
        file_system_id=FS,
        file_system_path="/datasets",
        s3_path="s3://nvrx-datasets/synthetic",
        token="run1",
        backoff=FAST,
        sleep=sleeps.append,
    )
    assert got == "dra-0123456789abcdef0" and sleeps == [1, 2]
    # Second run: found, not created again.
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": [assoc("AVAILABLE")]},
        {"Filters": [{"Name": "file-system-id", "Values": [FS]}]},
    )
    assert (
        ensure_association(
            client,
            file_system_id=FS,
            file_system_path="/datasets",
            s3_path="s3://nvrx-datasets/synthetic",
            token="run1",
            sleep=sleeps.append,
        )
        == "dra-0123456789abcdef0"
    )


def test_association_path_clash_is_explained(fsx):
    client, stub = fsx
    stub.add_response(
        "describe_data_repository_associations",
        {"Associations": [assoc("AVAILABLE", s3="s3://other-bucket/x")]},
    )
    with pytest.raises(HydrationError, match="already associated with s3://other-bucket/x"):
        ensure_association(
            client,
            file_system_id=FS,
            file_system_path="/datasets",
            s3_path="s3://nvrx-datasets/synthetic",
            token="t",
            sleep=lambda s: None,
        )


def task(state: str, **extra) -> dict:
    return {
        "TaskId": "task-0123456789abcdef0",
        "Lifecycle": state,
        "Type": "IMPORT_METADATA_FROM_REPOSITORY",
        "CreationTime": NOW,
        "Report": {
            "Enabled": True,
            "Path": "/fsx/reports",
            "Format": "REPORT_CSV_20191124",
            "Scope": "FAILED_FILES_ONLY",
        },
        **extra,
    }


def _create(stub, state: str = "PENDING") -> None:
    stub.add_response(
        "create_data_repository_task",
        {"DataRepositoryTask": task(state)},
        {
            "Type": "IMPORT_METADATA_FROM_REPOSITORY",
            "Paths": ["datasets/synthetic/v1"],
            "FileSystemId": FS,
            "ClientRequestToken": "run1-import",
            "Report": {
                "Enabled": True,
                "Path": "/fsx/reports",
                "Format": "REPORT_CSV_20191124",
                "Scope": "FAILED_FILES_ONLY",
            },
        },
    )


def test_import_task_polled_to_success(fsx):
    client, stub = fsx
    sleeps: list[float] = []
    _create(stub)
    for state in ("EXECUTING", "EXECUTING", "SUCCEEDED"):
        stub.add_response(
            "describe_data_repository_tasks",
            {"DataRepositoryTasks": [task(state)]},
            {"TaskIds": ["task-0123456789abcdef0"]},
        )
    done = import_metadata(
        client,
        file_system_id=FS,
        paths=["datasets/synthetic/v1"],
        report_path="/fsx/reports",
        token="run1-import",
        backoff=FAST,
        sleep=sleeps.append,
    )
    assert done["Lifecycle"] == "SUCCEEDED"
    assert sleeps == [1, 2, 4]  # backoff, capped


def test_failed_import_names_the_report(fsx):
    client, stub = fsx
    _create(stub)
    failed = task("FAILED", FailureDetails={"Message": "Access denied to s3://nvrx-datasets"})
    stub.add_response("describe_data_repository_tasks", {"DataRepositoryTasks": [failed]})
    with pytest.raises(HydrationError, match=r"FAILED: Access denied .* report under /fsx/reports"):
        import_metadata(
            client,
            file_system_id=FS,
            paths=["datasets/synthetic/v1"],
            report_path="/fsx/reports",
            token="run1-import",
            backoff=FAST,
            sleep=lambda s: None,
        )


def test_hydration_job_validates():
    job = hydration_job(
        name="nvrx-hydrate-run1",
        eks=EksParams(image="img:1"),
        data_dir="/fsx/datasets/nvrx-datasets/synthetic/v1",
        manifest_sha256="ab" * 32,
    )
    kubernetes_validate.validate(job, K8S_VERSION, strict=True)
    # Nothing but the image's Python: no shell, no Lustre user-space tools (the image has none).
    command = job["spec"]["template"]["spec"]["containers"][0]["command"]
    assert command[:4] == ["python", "-m", "trainer.data", "--verify"], command
    assert command[command.index("--manifest-sha256") + 1] == "ab" * 32
    assert not {"bash", "sh", "lfs"} & {Path(c).name for c in command}


def test_hydration_job_names_are_a_digest_of_run_place_and_manifest():
    from tasks.backends.eks.hydrate import hydration_job_name

    a = hydration_job_name("run1", "/datasets/b/p", "aa" * 32)
    assert re.fullmatch(r"nvrx-hydrate-[0-9a-f]{20}", a) and len(a) <= 63
    assert a == hydration_job_name("run1", "/datasets/b/p", "aa" * 32)  # a re-run joins it
    others = {
        hydration_job_name("run1", "/datasets/b/p", "bb" * 32),  # the dataset changed
        hydration_job_name("run2", "/datasets/b/p", "aa" * 32),  # another run
        hydration_job_name("r" * 40 + "x", "/datasets/b/p", "aa" * 32),  # ids alike in 40 chars
        hydration_job_name("r" * 40 + "y", "/datasets/b/p", "aa" * 32),
        hydration_job_name("run1", "/datasets/b/q", "aa" * 32),
    }
    assert len(others) == 5 and a not in others
