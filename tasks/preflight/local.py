"""Gather the local preflight snapshot once; every source in its own try so one failure only
blinds the checks that need it."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

from tasks.checks import Snapshot
from tasks.storage.s3 import S3Settings, describe_client_error


def _existing_parent(path: Path) -> Path:
    path = path.absolute()
    while not path.exists():
        path = path.parent
    return path


def gather_local(
    *,
    state_dir: Path,
    s3: S3Settings,
    client: Any,
    buckets: tuple[str, ...],
    dataset_bucket: str,
    dataset_prefix: str,
) -> Snapshot:
    snap = Snapshot()
    f, err = snap.facts, snap.errors
    try:
        import psutil

        f["cpu_count"] = os.cpu_count() or 1
        f["mem_available_gb"] = psutil.virtual_memory().available / 1e9
    except Exception as e:
        err["host"] = str(e)
    try:
        where = _existing_parent(state_dir)
        f["disk_path"] = str(where)
        f["disk_free_gb"] = shutil.disk_usage(where).free / 1e9
    except Exception as e:
        err["disk"] = str(e)
    try:
        from tasks.backends.node_memory import base_dir

        shm = _existing_parent(base_dir())
        f["node_memory_free_gb"] = shutil.disk_usage(shm).free / 1e9
        f["node_memory_where"] = f"{shm} on this machine (every simulated node's)"
    except Exception as e:
        err["node memory"] = str(e)
    try:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
        f["loopback_bind"] = True
    except OSError as e:
        err["ports"] = str(e)
    try:
        from tasks.backends.netns import support

        f["private_network"] = support()
    except Exception as e:
        err["network"] = str(e)
    try:
        import torch

        from trainer import nvrx_compat

        f["torch_version"] = torch.__version__
        f["nvrx_version"] = nvrx_compat.version()
        # What every node runs: NVRx's launcher, in-process through trainer.agent.
        spec = importlib.util.find_spec("nvidia_resiliency_ext.fault_tolerance.launcher")
        f["ft_launcher"] = (spec.origin or "") if spec is not None else ""
    except Exception as e:
        err["versions"] = str(e)
    gather_s3(
        snap,
        s3=s3,
        client=client,
        buckets=buckets,
        dataset_bucket=dataset_bucket,
        dataset_prefix=dataset_prefix,
    )
    return snap


def gather_s3(
    snap: Snapshot,
    *,
    s3: S3Settings,
    client: Any,
    buckets: tuple[str, ...],
    dataset_bucket: str,
    dataset_prefix: str,
) -> None:
    """The S3 part of a snapshot (both backends): endpoint, buckets, the dataset manifest."""
    f, err = snap.facts, snap.errors
    f["s3_endpoint"] = s3.endpoint_url
    try:
        client.list_buckets()
    except Exception as e:
        err["s3"] = describe_client_error(e, bucket=None, endpoint=s3.endpoint_url)
        return
    f["buckets"] = {}
    for b in buckets:
        try:
            client.head_bucket(Bucket=b)
            f["buckets"][b] = True
        except Exception:
            f["buckets"][b] = False
    try:
        body = client.get_object(Bucket=dataset_bucket, Key=f"{dataset_prefix}/dataset.json")[
            "Body"
        ]
        dataset = json.loads(body.read())
        f["dataset_files"] = len(dataset["files"])
        f["dataset_vocab_size"] = dataset.get("vocab_size")
        f["dataset_dtype"] = dataset.get("dtype", "uint16")
    except Exception as e:
        err["dataset"] = (
            f"s3://{dataset_bucket}/{dataset_prefix}/dataset.json: "
            + describe_client_error(e, bucket=dataset_bucket, endpoint=s3.endpoint_url)
        )
