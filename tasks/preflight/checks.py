"""Pure preflight checks over a snapshot gathered once. A check whose data source failed is
SKIPPED (with why), never PASSED: a blind check must not look healthy."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tasks.checks import CheckResult, Status, failures

__all__ = ["CHECKS", "CheckResult", "Requirements", "Snapshot", "Status", "failures", "run_checks"]


@dataclass
class Snapshot:
    """Facts gathered once. ``errors[source]`` says why a source could not be read."""

    facts: dict[str, Any] = field(default_factory=dict)
    errors: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True, kw_only=True)
class Requirements:
    workers: int
    min_memory_gb: float = 2.0
    min_free_disk_gb: float = 1.0
    min_torch: tuple[int, int] = (2, 6)
    min_nvrx: tuple[int, int, int] = (0, 4, 1)
    buckets: tuple[str, ...] = ()
    dataset_uri: str = ""
    workload: str = ""
    vocab_size: int | None = None  # the workload's vocabulary (embedding rows)


Check = Callable[[Snapshot, Requirements], CheckResult]


def _needs(source: str, name: str, snap: Snapshot) -> CheckResult | None:
    if source in snap.errors:
        return CheckResult(
            name, Status.SKIPPED, f"source {source!r} unavailable: {snap.errors[source]}"
        )
    return None


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


def check_cores(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "cpu cores"
    if (skip := _needs("host", name, snap)) is not None:
        return skip
    cores = snap.facts["cpu_count"]
    # Oversubscription only slows CPU training down; more than 4 workers per core starves the
    # heartbeat and gloo timeouts.
    if req.workers > 4 * cores:
        return CheckResult(
            name,
            Status.FAILED,
            f"{req.workers} workers on {cores} cores",
            "use fewer nodes or workers per node",
        )
    return CheckResult(name, Status.PASSED, f"{cores} cores for {req.workers} workers")


def check_memory(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "memory"
    if (skip := _needs("host", name, snap)) is not None:
        return skip
    gb = snap.facts["mem_available_gb"]
    if gb < req.min_memory_gb:
        return CheckResult(
            name,
            Status.FAILED,
            f"{gb:.1f} GB available, need {req.min_memory_gb}",
            "free memory or use a smaller model",
        )
    return CheckResult(name, Status.PASSED, f"{gb:.1f} GB available")


def check_disk(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "free disk on run root"
    if (skip := _needs("disk", name, snap)) is not None:
        return skip
    gb = snap.facts["disk_free_gb"]
    if gb < req.min_free_disk_gb:
        return CheckResult(
            name,
            Status.FAILED,
            f"{gb:.2f} GB free at {snap.facts['disk_path']}, need {req.min_free_disk_gb}",
            "free space or point the state directory elsewhere",
        )
    return CheckResult(name, Status.PASSED, f"{gb:.1f} GB free at {snap.facts['disk_path']}")


def check_ports(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "loopback ports"
    if (skip := _needs("ports", name, snap)) is not None:
        return skip
    return CheckResult(name, Status.PASSED, "can bind 127.0.0.1 ports for rendezvous and stores")


def check_versions(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "torch / NVRx versions"
    if (skip := _needs("versions", name, snap)) is not None:
        return skip
    torch_v, nvrx_v = snap.facts["torch_version"], snap.facts["nvrx_version"]
    problems = []
    if _version_tuple(torch_v)[:2] < req.min_torch:
        problems.append(f"torch {torch_v} < {'.'.join(map(str, req.min_torch))}")
    if _version_tuple(nvrx_v)[:3] < req.min_nvrx:
        problems.append(f"nvidia-resiliency-ext {nvrx_v} < {'.'.join(map(str, req.min_nvrx))}")
    if not snap.facts.get("ft_launcher"):
        problems.append("ft_launcher not found")
    if problems:
        return CheckResult(name, Status.FAILED, "; ".join(problems), "make venv (reinstall)")
    return CheckResult(name, Status.PASSED, f"torch {torch_v}, NVRx {nvrx_v}")


def check_s3_endpoint(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "S3 endpoint reachable"
    if "s3" in snap.errors:
        return CheckResult(
            name, Status.FAILED, snap.errors["s3"], "check the endpoint URL and credentials"
        )
    return CheckResult(name, Status.PASSED, f"{snap.facts.get('s3_endpoint') or 'AWS S3'}")


def check_buckets(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "S3 buckets present"
    if (skip := _needs("s3", name, snap)) is not None:
        return skip
    missing = [b for b in req.buckets if not snap.facts["buckets"].get(b)]
    if missing:
        return CheckResult(
            name,
            Status.FAILED,
            f"missing or not accessible: {missing}",
            "create the buckets or fix their names",
        )
    return CheckResult(name, Status.PASSED, ", ".join(req.buckets))


def check_dataset(snap: Snapshot, req: Requirements) -> CheckResult:
    name = "dataset present"
    if (skip := _needs("s3", name, snap)) is not None:
        return skip
    if "dataset" in snap.errors:
        return CheckResult(
            name,
            Status.FAILED,
            snap.errors["dataset"],
            "upload the dataset (with dataset.json) or fix the prefix",
        )
    files = snap.facts["dataset_files"]
    return CheckResult(name, Status.PASSED, f"{req.dataset_uri}: {files} shards in the manifest")


_DTYPE_LIMIT = {"uint16": 1 << 16, "uint32": 1 << 32}


def check_vocabulary(snap: Snapshot, req: Requirements) -> CheckResult:
    """The data's token ids must index inside the model's embedding, and fit the shards' dtype."""
    name = "dataset vocabulary fits the workload"
    if (skip := _needs("s3", name, snap)) is not None:
        return skip
    if (skip := _needs("dataset", name, snap)) is not None:
        return skip
    data_vocab = snap.facts.get("dataset_vocab_size")
    dtype = snap.facts.get("dataset_dtype")
    if req.vocab_size is None:
        return CheckResult(name, Status.SKIPPED, "the workload's vocabulary is not known")
    if not isinstance(data_vocab, int) or data_vocab < 1:
        return CheckResult(
            name,
            Status.FAILED,
            f"{req.dataset_uri}/dataset.json has no valid vocab_size ({data_vocab!r})",
            "write the dataset with `nvrx-pipeline prepare-dataset`",
        )
    limit = _DTYPE_LIMIT.get(str(dtype))
    if limit is None or data_vocab > limit:
        return CheckResult(
            name,
            Status.FAILED,
            f"dataset vocab_size {data_vocab} does not fit its token dtype {dtype!r} "
            f"(at most {limit or 0} ids)",
            "write the shards as uint32 (`nvrx-pipeline prepare-dataset --dtype uint32`)",
        )
    if data_vocab > req.vocab_size:
        return CheckResult(
            name,
            Status.FAILED,
            f"dataset vocab_size {data_vocab} is larger than workload {req.workload!r}'s "
            f"vocabulary {req.vocab_size}: token ids would index past the embedding",
            "tokenize with the model's tokenizer, or pick a workload with a large enough "
            "vocabulary",
        )
    return CheckResult(
        name,
        Status.PASSED,
        f"dataset vocab_size {data_vocab} ({dtype}) <= workload vocabulary {req.vocab_size}",
    )


CHECKS: tuple[Check, ...] = (
    check_cores,
    check_memory,
    check_disk,
    check_ports,
    check_versions,
    check_s3_endpoint,
    check_buckets,
    check_dataset,
    check_vocabulary,
)


# What both backends check of S3 (the EKS preflight adds its own cluster and FSx checks).
S3_CHECKS: tuple[Check, ...] = (
    check_s3_endpoint,
    check_buckets,
    check_dataset,
    check_vocabulary,
)


def run_checks(snap: Snapshot, req: Requirements) -> list[CheckResult]:
    return [check(snap, req) for check in CHECKS]
