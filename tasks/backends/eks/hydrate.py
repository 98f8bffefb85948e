"""The hydrate stage on EKS: link the dataset prefix to FSx, import its metadata, preload the
file contents with the hydration Job, then check the manifest on the FSx mount.

The flow runner mounts the same FSx claim at the same path as the training pods
(deploy/eks/work-pool-template.json), so what it reads under ``data_dir`` is what the pods will
read. It reads the dataset's manifest there first (capped: ``trainer.data.MAX_MANIFEST_BYTES``),
and the hydration Job's name is a digest of the run, the dataset's place and that manifest: a
re-run of the same run over the same dataset joins (or reuses) the Job already there, a changed
dataset gets a new Job that reads and digests it again, and two runs never share one. The Job
reads every file once (``python -m trainer.data --verify``, each no further than its manifest
size), which on FSx is the preload; the flow then re-checks the same manifest, presence and
sizes, a stat per file instead of a second full read.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from tasks.backends.base import Hydrated, HydrateRequest
from tasks.backends.eks.classify import IMAGE_PULL_REASONS
from tasks.backends.eks.clients import EksClients
from tasks.backends.eks.fsx import ensure_association, import_metadata
from tasks.backends.eks.kube import Kube
from tasks.backends.eks.params import EksParams
from tasks.backends.eks.pod import guaranteed
from tasks.backends.eks.security import (
    container_security_context,
    pod_security_context,
    scratch_volumes,
)
from tasks.errors import HydrationError
from trainer.data import DataError, load_manifest, verify_dataset


@dataclass
class FsxHydrateReport:
    source: str
    dest: str
    files: int
    bytes: int
    association_id: str
    import_task_id: str
    job: str
    seconds: float
    # What the hydration Job digested every file against (trainer.data's DatasetManifest.digest).
    manifest_sha256: str | None = None


def hydration_job_name(run_id: str, fs_path: str, manifest_sha256: str) -> str:
    """``nvrx-hydrate-<20 hex>``: a digest of the run, the dataset's place on FSx and its
    manifest (a valid DNS label of fixed length, whatever the run id)."""
    key = "\0".join((run_id, fs_path, manifest_sha256)).encode()
    return f"nvrx-hydrate-{hashlib.sha256(key).hexdigest()[:20]}"


def _token(run_id: str, what: str) -> str:
    # ClientRequestToken: <= 63 chars; the same run asking again gets the same answer.
    return f"{run_id[: 62 - len(what)]}-{what}"


def image_pull_failure(pods: list[dict[str, Any]]) -> str | None:
    """Why the first pod that cannot pull its image cannot (pure), or None. Waiting longer
    does not help a pod waiting for one of ``IMAGE_PULL_REASONS`` (the training watcher's own):
    the kubelet retries the pull forever, backing off up to 5 minutes, while the image name,
    the registry or the pull credentials stay wrong."""
    for pod in pods:
        name = (pod.get("metadata") or {}).get("name", "?")
        spec, status = pod.get("spec") or {}, pod.get("status") or {}
        kinds = ("initContainer", "container")  # spec.<kind>s, status.<kind>Statuses
        images = {c.get("name"): c.get("image") for k in kinds for c in spec.get(f"{k}s") or []}
        for cs in [c for k in kinds for c in status.get(f"{k}Statuses") or []]:
            waiting = (cs.get("state") or {}).get("waiting") or {}
            reason = waiting.get("reason")
            if reason in IMAGE_PULL_REASONS:
                image = cs.get("image") or images.get(cs.get("name")) or "?"
                message = waiting.get("message", "")
                return (
                    f"pod {name} cannot pull its image {image!r}: {reason}"
                    + (f" ({message})" if message else "")
                    + "; check eks.image (it must name a pushed image the deployment allows: "
                    "NVRX_ALLOWED_IMAGES) and that the nodes may pull from its registry "
                    "(ECR: the node role's AmazonEC2ContainerRegistryReadOnly; elsewhere an "
                    "imagePullSecret on the ServiceAccount)"
                )
    return None


def wait_for_job(
    kube: Kube,
    ns: str,
    name: str,
    *,
    deadline_s: float,
    poll_s: float,
    progress: Callable[[str], None] = lambda msg: None,
) -> None:
    """Until the Job has condition Complete; raises on Failed (with the controller's reason),
    at once when a pod of the Job cannot pull its image, or at the deadline. Says it still
    runs every 30 s, not every poll."""
    started = noted = time.monotonic()
    while True:
        job = kube.read_job(ns, name)
        if job is None:
            raise HydrationError(f"Job {ns}/{name} disappeared before completing")
        conds = {
            c.get("type"): c
            for c in (job.get("status") or {}).get("conditions") or []
            if c.get("status") == "True"
        }
        if "Complete" in conds:
            return
        if "Failed" in conds:
            c = conds["Failed"]
            raise HydrationError(
                f"Job {ns}/{name} failed: {c.get('reason', '')} {c.get('message', '')}".rstrip()
                + f"; see `kubectl logs -n {ns} job/{name}`"
            )
        pull = image_pull_failure(kube.job_pods(ns, name))
        if pull:
            raise HydrationError(f"hydration Job {ns}/{name}: {pull}")
        waited = time.monotonic() - started
        if waited > deadline_s:
            raise HydrationError(
                f"Job {ns}/{name} did not complete within {deadline_s:.0f} s "
                f"(eks.hydrate_timeout_s); see `kubectl describe -n {ns} job/{name}`"
            )
        if time.monotonic() - noted >= 30.0:
            noted = time.monotonic()
            progress(f"hydration Job {name} running for {waited:.0f} s")
        time.sleep(poll_s)


def hydration_job(
    *, name: str, eks: EksParams, data_dir: str, manifest_sha256: str
) -> dict[str, Any]:
    """The Job that mounts the FSx claim and reads every file of ``data_dir`` once, digesting
    it against the manifest the flow read (8 readers keep several lazy loads in flight).
    Nothing but the image's Python (no ``lfs``, no shell), as its non-root user: read access
    to the imported files is all it needs (deploy/eks/README.md), no capability, API token or
    network (the Lustre client is the node's kernel). Limits equal requests (Guaranteed QoS:
    not the first pod evicted when a system node runs short)."""
    scratch, scratch_mounts = scratch_volumes(tmp_gi=1)
    command = [
        "python", "-m", "trainer.data", "--verify", "--out", data_dir,
        "--readers", "8", "--manifest-sha256", manifest_sha256,
    ]  # fmt: skip
    resources = {"cpu": "1", "memory": "2Gi"}
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {
            "name": name,
            "namespace": eks.namespace,
            "labels": {
                "app.kubernetes.io/name": "nvrx-pipeline",
                "app.kubernetes.io/component": "hydrate",
            },
        },
        "spec": {
            "backoffLimit": 2,
            "ttlSecondsAfterFinished": 24 * 3600,
            "template": {
                "metadata": {"labels": {"app.kubernetes.io/component": "hydrate"}},
                "spec": {
                    "restartPolicy": "Never",
                    "serviceAccountName": eks.service_account,
                    "automountServiceAccountToken": False,
                    **({"priorityClassName": eks.priority_class} if eks.priority_class else {}),
                    "securityContext": pod_security_context(),
                    "containers": [
                        {
                            "name": "hydrate",
                            "image": eks.image,
                            "command": command,
                            "securityContext": container_security_context(),
                            "resources": guaranteed(resources),
                            "volumeMounts": [
                                {"name": "fsx", "mountPath": eks.fsx_mount},
                                *scratch_mounts,  # Python's own temporary files
                            ],
                        }
                    ],
                    "volumes": [
                        {"name": "fsx", "persistentVolumeClaim": {"claimName": eks.fsx_claim}},
                        *scratch,
                    ],
                },
            },
        },
    }


def hydrate_fsx(
    clients: EksClients,
    eks: EksParams,
    request: HydrateRequest,
    progress: Callable[[str], None] = lambda msg: None,
) -> Hydrated:
    """``request.data_dir``: the dataset as this process sees it on the FSx mount."""
    if not eks.file_system_id:
        raise HydrationError("eks.file_system_id is not set: give the fs-... id of the FSx claim")
    t0 = time.monotonic()
    run_id, data_dir = request.run_id, request.data_dir
    s3_path = f"s3://{request.bucket}/{request.prefix}/"
    # Where the dataset lives on the file system (the pods and the flow runner see it under
    # their FSx mount).
    fs_path = f"/datasets/{request.bucket}/{request.prefix}".rstrip("/")
    assoc = ensure_association(
        clients.fsx,
        file_system_id=eks.file_system_id,
        file_system_path=fs_path,
        s3_path=s3_path,
        token=_token(run_id, "dra"),
        backoff=clients.fsx_backoff,
    )
    progress(f"data repository association {assoc}: {fs_path} <-> {s3_path}")
    task = import_metadata(
        clients.fsx,
        file_system_id=eks.file_system_id,
        paths=[fs_path.lstrip("/")],
        report_path=f"{s3_path}_fsx-reports/{run_id}",
        token=_token(run_id, "import"),
        backoff=clients.fsx_backoff,
    )
    progress(f"metadata import task {task['TaskId']} SUCCEEDED")
    try:  # the imported manifest, read through the mount (capped): what the Job must verify
        digest = load_manifest(data_dir).digest()
    except DataError as e:
        raise HydrationError(f"dataset {s3_path} on FSx: {e}") from e
    name = hydration_job_name(run_id, fs_path, digest)
    job = hydration_job(
        name=name, eks=eks, data_dir=f"{eks.fsx_mount}{fs_path}", manifest_sha256=digest
    )
    progress(f"hydration Job {name}: reads and digests every file of manifest {digest[:12]}")
    clients.kube.apply(job)  # the same run and dataset: joins (or reuses) the Job there
    remaining = eks.hydrate_timeout_s - (time.monotonic() - t0)
    poll_s = clients.poll_s
    wait_for_job(
        clients.kube, eks.namespace, name, deadline_s=remaining, poll_s=poll_s, progress=progress
    )
    try:
        manifest = verify_dataset(data_dir, digests=False, manifest_sha256=digest)
    except DataError as e:
        raise HydrationError(
            f"hydration Job {name} completed but the dataset on FSx is incomplete: {e}"
        ) from e
    r = FsxHydrateReport(
        source=s3_path,
        dest=str(data_dir),
        files=len(manifest.files),
        bytes=sum(f.bytes for f in manifest.files),
        association_id=assoc,
        import_task_id=str(task["TaskId"]),
        job=name,
        seconds=round(time.monotonic() - t0, 3),
        manifest_sha256=manifest.digest(),
    )
    return Hydrated.of(
        r,
        f"{r.files} files, {r.bytes} bytes through FSx association {assoc}, import task "
        f"{r.import_task_id} and Job {name}; checked against the manifest",
    )
