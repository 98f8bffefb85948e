"""Preflight checks are pure functions over a snapshot; a blind check is SKIPPED, not PASSED."""

from __future__ import annotations

from tasks.checks import Snapshot, Status, failures
from tasks.preflight.checks import Requirements, run_checks
from tasks.preflight.memory import count_parameters

REQ = Requirements(
    workers=2,
    buckets=("data", "ckpt"),
    dataset_uri="s3://data/v1",
    workload="gpt-tiny",
    vocab_size=512,
)


def healthy() -> Snapshot:
    return Snapshot(
        facts={
            "cpu_count": 2,
            "mem_available_gb": 20.0,
            "disk_free_gb": 50.0,
            "disk_path": "/x",
            "loopback_bind": True,
            "private_network": None,
            "torch_version": "2.13.0+cpu",
            "nvrx_version": "0.4.1",
            "ft_launcher": "/bin/ft",
            "s3_endpoint": "http://127.0.0.1:8333",
            "buckets": {"data": True, "ckpt": True},
            "dataset_files": 4,
            "dataset_vocab_size": 512,
            "dataset_dtype": "uint16",
            "node_memory_free_gb": 12.0,
            "node_memory_where": "/dev/shm",
        }
    )


def by_name(results):
    return {r.name: r for r in results}


def test_all_pass():
    from dataclasses import replace

    results = run_checks(healthy(), replace(REQ, node_memory_gb=0.01, node_memory_basis="tiny"))
    assert {r.status for r in results} == {Status.PASSED}


def test_s3_down_fails_once_and_skips_dependents():
    snap = healthy()
    snap.errors["s3"] = "S3 endpoint http://127.0.0.1:8333 is unreachable"
    r = by_name(run_checks(snap, REQ))
    assert r["S3 endpoint reachable"].status == Status.FAILED
    assert r["S3 buckets present"].status == Status.SKIPPED
    assert r["dataset present"].status == Status.SKIPPED
    assert "unreachable" in r["S3 buckets present"].detail


def test_every_failure_listed_with_fix():
    snap = healthy()
    snap.facts.update(
        mem_available_gb=0.5,
        disk_free_gb=0.1,
        nvrx_version="0.3.0",
        buckets={"data": True, "ckpt": False},
    )
    snap.errors["dataset"] = "s3://data/v1/dataset.json: missing"
    failed = failures(run_checks(snap, REQ))
    names = {f.name for f in failed}
    assert names == {
        "memory",
        "free disk on run root",
        "torch / NVRx versions",
        "S3 buckets present",
        "dataset present",
    }
    assert all(f.fix for f in failed)
    assert "ckpt" in by_name(failed)["S3 buckets present"].detail


def test_host_source_failure_is_skipped_not_passed():
    snap = healthy()
    snap.errors["host"] = "psutil unavailable"
    r = by_name(run_checks(snap, REQ))
    assert r["cpu cores"].status == r["memory"].status == Status.SKIPPED
    assert "psutil unavailable" in r["cpu cores"].detail


def test_missing_nvrx_import_fails_the_gate_naming_the_check_and_the_error():
    snap = healthy()
    for k in ("torch_version", "nvrx_version", "ft_launcher"):
        snap.facts.pop(k)
    snap.errors["versions"] = "No module named 'nvidia_resiliency_ext'"
    failed = failures(run_checks(snap, REQ))
    assert [f.name for f in failed] == ["torch / NVRx versions"]
    (f,) = failed
    assert f.status == Status.SKIPPED and f.required
    assert "source 'versions' failed: No module named 'nvidia_resiliency_ext'" in f.detail
    assert "make venv" in f.fix


def test_a_source_never_gathered_is_blind_too():
    snap = healthy()
    del snap.facts["loopback_bind"]  # the gatherer forgot it: not a pass
    (f,) = failures(run_checks(snap, REQ))
    assert f.name == "loopback ports" and "was not gathered (no loopback_bind)" in f.detail


def test_an_advisory_check_may_be_blind():
    snap = healthy()
    snap.errors["dataset"] = "s3://data/v1/dataset.json: missing"
    r = by_name(run_checks(snap, REQ))
    vocab = r["dataset vocabulary fits the workload"]
    assert vocab.status == Status.SKIPPED and not vocab.required
    assert [f.name for f in failures(list(r.values()))] == ["dataset present"]


def test_s3_down_lists_its_dependents_as_blind_with_fixes():
    snap = healthy()
    snap.errors["s3"] = "S3 endpoint http://127.0.0.1:8333 is unreachable"
    failed = by_name(failures(run_checks(snap, REQ)))
    assert set(failed) == {"S3 endpoint reachable", "S3 buckets present", "dataset present"}
    assert all("unreachable" in f.detail and f.fix for f in failed.values())


def test_oversubscription_fails():
    r = by_name(run_checks(healthy(), Requirements(workers=64)))
    assert r["cpu cores"].status == Status.FAILED


def test_vocabulary_must_fit_the_workload_and_the_dtype():
    from dataclasses import replace

    name = "dataset vocabulary fits the workload"
    snap = healthy()
    snap.facts["dataset_vocab_size"] = 128256
    snap.facts["dataset_dtype"] = "uint32"
    r = by_name(run_checks(snap, REQ))[name]  # Llama 3 data for the 512-token GPT
    assert r.status == Status.FAILED and "128256" in r.detail and "512" in r.detail
    r = by_name(run_checks(snap, replace(REQ, workload="llama3-8b", vocab_size=128256)))[name]
    assert r.status == Status.PASSED
    snap.facts["dataset_dtype"] = "uint16"  # 128256 ids cannot be uint16 tokens
    r = by_name(run_checks(snap, replace(REQ, workload="llama3-8b", vocab_size=128256)))[name]
    assert r.status == Status.FAILED and "uint32" in r.fix and "128256" in r.detail
    snap.errors["dataset"] = "no dataset.json"
    assert by_name(run_checks(snap, REQ))[name].status == Status.SKIPPED


def test_memory_is_checked_against_the_workloads_own_need():
    """Issue 27: an 8B workload on a small machine fails preflight naming the fix; the need is
    the model's parameter count (built on the meta device), not a flat floor."""
    from dataclasses import replace

    from tasks.preflight.memory import MemoryNeed, count_parameters
    from trainer.workload import load_workload

    def local_memory_need(workload: str) -> MemoryNeed:  # as flows.stages' preflight builds it
        return MemoryNeed(params=count_parameters(load_workload(workload, {})), workers=2)

    big = local_memory_need("llama3-8b")
    assert 8.0e9 < big.params < 8.1e9 and big.gb > 200  # Llama 3 8B: 8.03 B parameters
    tiny = local_memory_need("gpt-tiny")
    assert tiny.params < 1e6 and tiny.gb < 2
    req = replace(REQ, workload="llama3-8b", min_memory_gb=big.gb, memory_basis=big.explain())
    r = by_name(run_checks(healthy(), req))["memory"]  # 20 GB available
    assert r.status == Status.FAILED
    assert "llama3-8b" in r.detail and "8.03 B parameters" in r.detail and "20.0 GB" in r.detail
    assert "eks backend" in r.fix and "gpt-tiny" in r.fix
    ok = replace(REQ, min_memory_gb=tiny.gb, memory_basis=tiny.explain())
    assert by_name(run_checks(healthy(), ok))["memory"].status == Status.PASSED


def test_memory_saves_that_do_not_fit_the_node_are_refused_with_both_numbers():
    """Issue 29, item 5: the node-memory tier's need (shard x generations) from the model,
    against the node's memory (/dev/shm here, eks.shm_gi on EKS)."""
    from dataclasses import replace

    from tasks.preflight.memory import node_memory_need
    from trainer.workload import load_workload

    name = "node memory for the memory saves"
    n = count_parameters(load_workload("llama3-8b", {}))
    # Every simulated node here, of two: own generations and a peer node's, with the one arriving.
    one_node = node_memory_need(n, memory_tiers=True, nodes=1, peers=True)
    assert one_node is not None and one_node.copies == 5
    assert 480 < one_node.gb < 483  # 8.03 B x 12 bytes x 5
    assert "2 generations of its own, 2 of a peer node's, 1 arriving" in one_node.explain()
    req = replace(REQ, node_memory_gb=one_node.gb, node_memory_basis=one_node.explain())
    r = by_name(run_checks(healthy(), req))[name]
    assert r.status == Status.FAILED and r in failures(run_checks(healthy(), req))
    assert "481.8" in r.detail and "12.00 GB" in r.detail and "/dev/shm" in r.detail
    assert "memory_interval to 0" in r.fix and "eks.shm_gi" in r.fix
    # One node: no peer copy, its own two generations only.
    alone = node_memory_need(n, memory_tiers=True, nodes=1, peers=False)
    assert alone is not None and alone.copies == 2 and 192 < alone.gb < 193
    assert node_memory_need(n, memory_tiers=False, nodes=1, peers=True) is None
    # 16 p5 pods, 64 GiB of /dev/shm each: 30 GB per pod fits.
    per_pod = node_memory_need(n, memory_tiers=True, nodes=16, peers=True)
    assert per_pod is not None
    snap = healthy()
    snap.facts["node_memory_free_gb"] = 64 * 2**30 / 1e9
    fits = replace(REQ, node_memory_gb=per_pod.gb, node_memory_basis=per_pod.explain())
    assert by_name(run_checks(snap, fits))[name].status == Status.PASSED
    # No tier (memory_interval 0): said, stops nothing; nor does an unreadable /dev/shm.
    assert by_name(run_checks(healthy(), REQ))[name].status == Status.SKIPPED
    del snap.facts["node_memory_free_gb"]
    assert not failures(run_checks(snap, fits))


def test_a_shared_network_is_said_and_does_not_stop_the_run():
    snap = healthy()
    snap.facts["private_network"] = "user namespaces are not allowed here"
    results = run_checks(snap, REQ)
    net = by_name(results)["private network for the simulated nodes"]
    assert net.status == Status.SKIPPED and not net.required and not failures(results)
    assert "stores open to its other processes: user namespaces are not allowed" in net.detail
