"""FSx for Lustre hydration's AWS side: the data repository association (idempotent) and an
``IMPORT_METADATA_FROM_REPOSITORY`` task polled with backoff (FSx has no waiters).

The boto3 calls go through ``fsx`` (a boto3 FSx client): tests drive it with
``botocore.stub.Stubber``, which checks every call and response against the real FSx service model.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.errors import HydrationError

TERMINAL = ("SUCCEEDED", "FAILED", "CANCELED")


@dataclass(frozen=True)
class Backoff:
    first_s: float = 5.0
    factor: float = 1.6
    max_s: float = 60.0
    deadline_s: float = 3600.0

    def delays(self) -> Any:
        delay, waited = self.first_s, 0.0
        while waited < self.deadline_s:
            yield delay
            waited += delay
            delay = min(delay * self.factor, self.max_s)


def ensure_association(
    fsx: Any,
    *,
    file_system_id: str,
    file_system_path: str,
    s3_path: str,
    token: str,
    backoff: Backoff = Backoff(),
    sleep: Callable[[float], None] = time.sleep,
) -> str:
    """The association id linking ``file_system_path`` to ``s3_path``, created only if missing."""
    found = fsx.describe_data_repository_associations(
        Filters=[{"Name": "file-system-id", "Values": [file_system_id]}]
    )["Associations"]
    # FSx allows one association per file system path.
    match = next((a for a in found if a.get("FileSystemPath") == file_system_path), None)
    if match is not None and match.get("DataRepositoryPath") != s3_path:
        raise HydrationError(
            f"{file_system_id}:{file_system_path} is already associated with "
            f"{match.get('DataRepositoryPath')}, not {s3_path}: remove that association or "
            "choose another path"
        )
    if match is None:
        match = fsx.create_data_repository_association(
            FileSystemId=file_system_id,
            FileSystemPath=file_system_path,
            DataRepositoryPath=s3_path,
            BatchImportMetaDataOnCreate=False,  # our import task does it, and reports
            ClientRequestToken=token,
        )["Association"]
    assoc_id = str(match["AssociationId"])
    for delay in [0.0, *backoff.delays()]:
        if delay:
            sleep(delay)
            match = fsx.describe_data_repository_associations(AssociationIds=[assoc_id])[
                "Associations"
            ][0]
        state = match.get("Lifecycle")
        if state == "AVAILABLE":
            return assoc_id
        if state in ("FAILED", "MISCONFIGURED", "DELETING"):
            detail = (match.get("FailureDetails") or {}).get("Message", "")
            raise HydrationError(f"data repository association {assoc_id} is {state}: {detail}")
    raise HydrationError(f"data repository association {assoc_id} not AVAILABLE in time")


def import_metadata(
    fsx: Any,
    *,
    file_system_id: str,
    paths: list[str],
    report_path: str,
    token: str,
    backoff: Backoff = Backoff(),
    sleep: Callable[[float], None] = time.sleep,
) -> dict[str, Any]:
    """Run an ``IMPORT_METADATA_FROM_REPOSITORY`` task and poll it to the end. A failed task
    raises naming its failure report's location."""
    task = fsx.create_data_repository_task(
        Type="IMPORT_METADATA_FROM_REPOSITORY",
        Paths=paths,
        FileSystemId=file_system_id,
        Report={
            "Enabled": True,
            "Path": report_path,
            "Format": "REPORT_CSV_20191124",
            "Scope": "FAILED_FILES_ONLY",
        },
        ClientRequestToken=token,
    )["DataRepositoryTask"]
    task_id = task["TaskId"]
    for delay in backoff.delays():
        if task.get("Lifecycle") in TERMINAL:
            break
        sleep(delay)
        task = fsx.describe_data_repository_tasks(TaskIds=[task_id])["DataRepositoryTasks"][0]
    state = task.get("Lifecycle")
    if state == "SUCCEEDED":
        return dict(task)
    report = (task.get("Report") or {}).get("Path", report_path)
    detail = (task.get("FailureDetails") or {}).get("Message", "")
    if state in ("FAILED", "CANCELED"):
        raise HydrationError(
            f"FSx import task {task_id} {state}: {detail} (failure report under {report})"
        )
    raise HydrationError(f"FSx import task {task_id} still {state} at the deadline")
