"""Pure preflight checks over a snapshot gathered once.

Each check is declared once (:class:`Check`: its name, the snapshot :class:`Source` s it reads,
whether the gate needs it, and a pure function). :func:`run_check` is the one place that turns a
failed or missing source into SKIPPED with the source's error; a check function only ever sees
sources that were read. The gate (:func:`tasks.checks.failures`) fails a SKIPPED *required*
check with that error and the source's fix: a blind preflight must not pass.
"""

from __future__ import annotations

from dataclasses import dataclass

from tasks.checks import (
    Check,
    CheckResult,
    Snapshot,
    Source,
    Status,
    Verdict,
    failed,
    passed,
    run_all,
)


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
    # How min_memory_gb was estimated for this workload (tasks.preflight.memory); empty: the
    # flat floor (a script, whose model is not known here).
    memory_basis: str = ""
    # Node memory (issue 29): what the memory saves of one node need (its ranks' shards x the
    # generations kept), and how that was computed; 0: no node-memory tier, or not known.
    node_memory_gb: float = 0.0
    node_memory_basis: str = ""


# -- sources (what tasks.preflight.local gathers) ---------------------------------------------
HOST = Source(
    "host", "make venv (psutil reports cores and memory)", ("cpu_count", "mem_available_gb")
)
DISK = Source(
    "disk",
    "make the state directory's filesystem readable, or point the state directory elsewhere",
    ("disk_path", "disk_free_gb"),
)
PORTS = Source(
    "ports",
    "allow binding 127.0.0.1 ports (rendezvous and stores listen there)",
    ("loopback_bind",),
)
NETWORK = Source("network", "install util-linux (unshare, nsenter)", ("private_network",))
VERSIONS = Source(
    "versions",
    "make venv (reinstall torch and nvidia-resiliency-ext): the trainer cannot start without",
    ("torch_version", "nvrx_version", "ft_launcher"),
)
S3 = Source("s3", "check the S3 endpoint URL and credentials", ("buckets",))
NODE_MEMORY = Source(
    "node memory",
    "make /dev/shm readable (the node-memory tier's files live there)",
    ("node_memory_free_gb", "node_memory_where"),
)
DATASET = Source(
    "dataset",
    "upload the dataset (with dataset.json) or fix the prefix",
    ("dataset_files", "dataset_vocab_size", "dataset_dtype"),
)


def _version_tuple(v: str) -> tuple[int, ...]:
    out = []
    for part in v.split("+")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        out.append(int(digits) if digits else 0)
    return tuple(out)


# -- check functions (pure; they only see sources that were read) -----------------------------
def cores(snap: Snapshot, req: Requirements) -> Verdict:
    n = snap.facts["cpu_count"]
    # Oversubscription only slows CPU training down; more than 4 workers per core starves the
    # heartbeat and gloo timeouts.
    if req.workers > 4 * n:
        return failed(f"{req.workers} workers on {n} cores", "use fewer nodes or workers per node")
    return passed(f"{n} cores for {req.workers} workers")


def memory(snap: Snapshot, req: Requirements) -> Verdict:
    gb = snap.facts["mem_available_gb"]
    need = f"about {req.min_memory_gb:.1f} GB"
    if req.memory_basis:
        need += f" for workload {req.workload!r} ({req.memory_basis})"
    if gb < req.min_memory_gb:
        return failed(
            f"{gb:.1f} GB available, need {need}",
            "use a smaller workload (gpt-tiny, llama-tiny, gpt-100m) or fewer workers on this "
            "machine, or train this one on the eks backend",
        )
    return passed(f"{gb:.1f} GB available, need {need}")


def node_memory(snap: Snapshot, req: Requirements) -> Verdict:
    if req.node_memory_gb <= 0:
        return Verdict(
            Status.SKIPPED, "no node-memory tier (memory_interval 0), or the model is unknown"
        )
    free, where = snap.facts["node_memory_free_gb"], snap.facts["node_memory_where"]
    need = f"{req.node_memory_gb:.2f} GB ({req.node_memory_basis})"
    if req.node_memory_gb > free:
        return failed(
            f"the memory saves need {need} per node, {where} holds {free:.2f} GB",
            "set memory_interval to 0 (no node-memory tier: a respawn reads the durable "
            "checkpoint), train a smaller workload, or give the node more: on EKS raise "
            "eks.shm_gi (and eks.memory_gi), locally remount /dev/shm larger",
        )
    return passed(f"the memory saves need {need} per node, {where} holds {free:.2f} GB")


def disk(snap: Snapshot, req: Requirements) -> Verdict:
    gb, where = snap.facts["disk_free_gb"], snap.facts["disk_path"]
    if gb < req.min_free_disk_gb:
        return failed(
            f"{gb:.2f} GB free at {where}, need {req.min_free_disk_gb}",
            "free space or point the state directory elsewhere",
        )
    return passed(f"{gb:.1f} GB free at {where}")


def ports(snap: Snapshot, req: Requirements) -> Verdict:
    return passed("can bind 127.0.0.1 ports for rendezvous and stores")


def network(snap: Snapshot, req: Requirements) -> Verdict:
    why_not = snap.facts["private_network"]  # None: a namespace can be made (tasks.backends.netns)
    if why_not:
        return Verdict(
            Status.SKIPPED,
            f"the simulated nodes will share this machine's network, their stores open to its "
            f"other processes: {why_not}",
        )
    return passed("each attempt's nodes and stores in a network namespace of their own")


def versions(snap: Snapshot, req: Requirements) -> Verdict:
    torch_v, nvrx_v = snap.facts["torch_version"], snap.facts["nvrx_version"]
    problems = []
    if _version_tuple(torch_v)[:2] < req.min_torch:
        problems.append(f"torch {torch_v} < {'.'.join(map(str, req.min_torch))}")
    if _version_tuple(nvrx_v)[:3] < req.min_nvrx:
        problems.append(f"nvidia-resiliency-ext {nvrx_v} < {'.'.join(map(str, req.min_nvrx))}")
    if not snap.facts["ft_launcher"]:
        problems.append(
            "NVRx's launcher module (nvidia_resiliency_ext.fault_tolerance.launcher) not found"
        )
    if problems:
        return failed("; ".join(problems), "make venv (reinstall)")
    return passed(f"torch {torch_v}, NVRx {nvrx_v}")


def s3_endpoint(snap: Snapshot, req: Requirements) -> Verdict:
    # This check judges the S3 source itself, so its failure is a FAILED, not a SKIPPED.
    if "s3" in snap.errors:
        return failed(snap.errors["s3"], S3.fix)
    return passed(f"{snap.facts.get('s3_endpoint') or 'AWS S3'}")


def buckets(snap: Snapshot, req: Requirements) -> Verdict:
    missing = [b for b in req.buckets if not snap.facts["buckets"].get(b)]
    if missing:
        return failed(
            f"missing or not accessible: {missing}", "create the buckets or fix their names"
        )
    return passed(", ".join(req.buckets))


def dataset(snap: Snapshot, req: Requirements) -> Verdict:
    # Judges the dataset source itself (S3 was readable, the dataset was not).
    if "dataset" in snap.errors:
        return failed(snap.errors["dataset"], DATASET.fix)
    return passed(f"{req.dataset_uri}: {snap.facts['dataset_files']} shards in the manifest")


_DTYPE_LIMIT = {"uint16": 1 << 16, "uint32": 1 << 32}


def vocabulary(snap: Snapshot, req: Requirements) -> Verdict:
    """The data's token ids must index inside the model's embedding, and fit the shards' dtype."""
    data_vocab = snap.facts["dataset_vocab_size"]
    dtype = snap.facts["dataset_dtype"]
    if req.vocab_size is None:
        return Verdict(Status.SKIPPED, "the workload's vocabulary is not known")
    if not isinstance(data_vocab, int) or data_vocab < 1:
        return failed(
            f"{req.dataset_uri}/dataset.json has no valid vocab_size ({data_vocab!r})",
            "write the dataset with `nvrx-pipeline prepare-dataset`",
        )
    limit = _DTYPE_LIMIT.get(str(dtype))
    if limit is None or data_vocab > limit:
        return failed(
            f"dataset vocab_size {data_vocab} does not fit its token dtype {dtype!r} "
            f"(at most {limit or 0} ids)",
            "write the shards as uint32 (`nvrx-pipeline prepare-dataset --dtype uint32`)",
        )
    if data_vocab > req.vocab_size:
        return failed(
            f"dataset vocab_size {data_vocab} is larger than workload {req.workload!r}'s "
            f"vocabulary {req.vocab_size}: token ids would index past the embedding",
            "tokenize with the model's tokenizer, or pick a workload with a large enough "
            "vocabulary",
        )
    return passed(
        f"dataset vocab_size {data_vocab} ({dtype}) <= workload vocabulary {req.vocab_size}"
    )


# -- the checks, declared once ----------------------------------------------------------------
check_node_memory = Check(
    name="node memory for the memory saves",
    requires=(NODE_MEMORY,),
    fn=node_memory,
    # A need that does not fit fails; a machine whose /dev/shm cannot be read, or a run with no
    # memory saves, is said and stops nothing (a failed memory save only costs its tier).
    required=False,
)
# What both backends check of S3 (the EKS preflight adds its own cluster and FSx checks).
S3_CHECKS: tuple[Check, ...] = (
    Check(name="S3 endpoint reachable", requires=(), fn=s3_endpoint),
    Check(name="S3 buckets present", requires=(S3,), fn=buckets),
    Check(name="dataset present", requires=(S3,), fn=dataset),
    Check(
        name="dataset vocabulary fits the workload",
        requires=(S3, DATASET),
        fn=vocabulary,
        # Advisory: "dataset present" already fails when the dataset cannot be read, the
        # trainer checks the vocabulary again before the first step, and a user workload's
        # vocabulary is not known here.
        required=False,
    ),
)
CHECKS: tuple[Check, ...] = (
    Check(name="cpu cores", requires=(HOST,), fn=cores),
    Check(name="memory", requires=(HOST,), fn=memory),
    check_node_memory,
    Check(name="free disk on run root", requires=(DISK,), fn=disk),
    Check(name="loopback ports", requires=(PORTS,), fn=ports),
    Check(
        name="private network for the simulated nodes",
        requires=(NETWORK,),
        fn=network,
        # Advisory: without user namespaces the run still works on the host's loopback, as it
        # always did; the backend says so again when it launches.
        required=False,
    ),
    Check(name="torch / NVRx versions", requires=(VERSIONS,), fn=versions),
    *S3_CHECKS,
)


def run_checks(snap: Snapshot, req: Requirements) -> list[CheckResult]:
    return run_all(CHECKS, snap, req)
