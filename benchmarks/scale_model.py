"""Project recovery time and ETTR to 2-64 p5.48xlarge nodes from measured components and stated
assumptions (benchmarks/SCALE_MODEL.md explains each). Prints the tables the document quotes.

    python benchmarks/scale_model.py [--recovery benchmarks/results/recovery_time.json]
        [--ckpt-gb 90] [--fsx-tib 1.2] [--json]

Measured inputs (from ``--recovery``: the committed results of ``benchmarks/recovery_time.py``,
medians over its samples, this machine): the in-process restart and the in-job respawn
overheads of ours, and the baseline's detection, which are code paths that do not grow with the
model. The file is required: without it (or when it predates the sampled methodology, or a
class it needs did not recover) the script fails and names the command that produces it,
instead of projecting from made-up defaults. Everything that does grow (checkpoint bytes, FSx
throughput, NCCL start-up, Kubernetes detection, image pull) is an assumption, named in
``ASSUMPTIONS`` and printed with the tables.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
RECOVERY_JSON = REPO / "benchmarks" / "results" / "recovery_time.json"
PRODUCE = (
    "run `make bench`, or `python benchmarks/recovery_time.py "
    "--out benchmarks/results/recovery_time.json`, and commit the file"
)

ASSUMPTIONS: dict[str, Any] = {
    # Checkpoint: 7.5B parameters x (4 B fp32 weights + 8 B AdamW moments) = 90 GB per save.
    "ckpt_gb": 90.0,
    # FSx for Lustre SCRATCH_2: 200 MB/s per TiB baseline throughput (burst is higher but not
    # sustained); the file system size is a choice.
    "fsx_mb_s_per_tib": 200.0,
    "fsx_tib": 1.2,
    # Staging copy GPU -> pinned host memory per rank (ours blocks only for this), GB/s.
    "d2h_gb_s": 20.0,
    "gpus_per_node": 8,
    # Job MTBF: per-node MTBF of 6,300 node-hours (Llama 3 405B report: 419 unexpected
    # interruptions in 54 days on 16,384 H100s, i.e. ~50,700 GPU-hours per GPU, / 8 GPUs).
    "node_mtbf_h": 6300.0,
    # Fault mix by the layer that can answer it (assumed; Llama 3 reports ~78% hardware causes,
    # most needing a node swap or a process restart rather than an in-place retry).
    "mix": {"inprocess": 0.2, "injob": 0.4, "node_loss": 0.4},
    # Start-up on a GPU node: torch import + CUDA context + NCCL communicator init, seconds,
    # growing with the log of the ranks.
    "process_start_s": 25.0,
    "nccl_init_s_per_log2_rank": 2.0,
    # Node loss on EKS: node-monitor-grace-period (Ready=Unknown) 50 s; a spare node in the
    # node group is Ready at once; image layers cached on the node (else add minutes).
    "k8s_detect_s": 50.0,
    "pod_start_s": 30.0,
    # Baseline: torchrun restarts every worker for every fault; a lost node ends the job and a
    # person re-submits it (assumed 30 min on average, with the same spare capacity).
    "manual_requeue_s": 1800.0,
    "share_hang": 0.25,  # of the in-job faults, how many are hangs (no exit to notice)
    "baseline_hang_detect_s": 1800.0,  # torch's default process-group timeout
    # The memory tiers (issue 29). A restore from the process's own copy is a host-to-device
    # copy of the rank's shard; from node memory the shard is checked first (xxh3-128 since
    # issue 40, one core per rank: its GB/s is read from benchmarks/results/checksum_speed.json)
    # and then copied up. The hang bound a run learns from its step time is floored, on EKS, by
    # the in-process layer's window (pg_timeout_s 120 + heartbeat interval + 0.5:
    # trainer.timeouts, issue 40).
    "h2d_gb_s": 20.0,
    # A peer copy travels over gloo (TCP on the pod network), one stream per rank pair.
    "peer_gb_s": 1.0,
    "learned_hang_bound_s": 121.5,
    # The steady-state cost of the memory saves (issue 40): an 8B step on p5 (assumed: a few
    # seconds at a global batch of 4M tokens on 16-512 H100s; Llama-3-8B-class reports), the
    # durable interval in steps, and the memory save's copy off the training stream into
    # pageable host memory (item 3 not built yet: the copy blocks at pageable D2H speed).
    "step_s": 4.0,
    "durable_interval_steps": 100,
    "pageable_d2h_gb_s": 10.0,
    "budget": 0.02,  # checkpoint.memory.budget: what interval auto keeps a save within
}
CHECKSUM_JSON = REPO / "benchmarks" / "results" / "checksum_speed.json"


def load_s(a: dict[str, Any]) -> float:
    """The whole checkpoint read back, limited by the file system's throughput."""
    return a["ckpt_gb"] * 1000.0 / (a["fsx_mb_s_per_tib"] * a["fsx_tib"])


def startup_s(a: dict[str, Any], nodes: int) -> float:
    ranks = nodes * a["gpus_per_node"]
    return a["process_start_s"] + a["nccl_init_s_per_log2_rank"] * math.log2(ranks)


def recoveries(a: dict[str, Any], nodes: int, measured: dict[str, float]) -> dict[str, Any]:
    """Seconds from fault to first step, per class: ours and the baseline."""
    load = load_s(a)
    start = startup_s(a, nodes)
    ours_inproc = measured["inprocess_restart_s"] + a["nccl_init_s_per_log2_rank"] * (
        math.log2(nodes * a["gpus_per_node"])
    )
    ours = {
        # In place: the processes, CUDA context and dataset stay; the model reloads from the
        # newest checkpoint (the in-memory copy is not kept across a restart here).
        "exception": ours_inproc + load,
        "sigkill": measured["injob_detect_s"] + start + load,
        # Every in-job timeout is learned (issue 40): a hang is caught at the learned step
        # bound, whichever tier the resume reads.
        "hang": a["learned_hang_bound_s"] + start + load,
        "node-loss": a["k8s_detect_s"] + a["pod_start_s"] + start + load,
    }
    # With the memory tiers: each rank reads its own shard from memory, not the whole
    # checkpoint from FSx; a lost node's ranks get theirs from the peer copies on the next node
    # (a spare in its place, the world unchanged).
    shard = a["ckpt_gb"] / (nodes * a["gpus_per_node"])
    from_process = shard / a["h2d_gb_s"]
    from_node = shard / measured["checksum_gb_s"] + shard / a["h2d_gb_s"]
    from_peer = shard / a["peer_gb_s"] + from_node
    tiers = {
        "exception": ours_inproc + from_process,
        "sigkill": measured["injob_detect_s"] + start + from_node,
        "hang": a["learned_hang_bound_s"] + start + from_node,
        "node-loss": a["k8s_detect_s"] + a["pod_start_s"] + start + from_peer,
    }
    base = {
        "exception": measured["baseline_exception_detect_s"] + start + load,
        "sigkill": measured["baseline_injob_detect_s"] + start + load,
        "hang": a["baseline_hang_detect_s"] + start + load,
        "node-loss": a["manual_requeue_s"] + a["pod_start_s"] + start + load,
    }
    return {"ours": ours, "tiers": tiers, "baseline": base}


def ettr(a: dict[str, Any], nodes: int, rec: dict[str, float], ckpt_block_s: float) -> dict:
    """ETTR ~= 1 - c/tau - (R + tau/2)/M with Young's tau = sqrt(2 c M)."""
    mtbf = a["node_mtbf_h"] * 3600.0 / nodes
    mix = a["mix"]
    injob = (1 - a["share_hang"]) * rec["sigkill"] + a["share_hang"] * rec["hang"]
    mean_r = mix["inprocess"] * rec["exception"] + mix["injob"] * injob
    mean_r += mix["node_loss"] * rec["node-loss"]
    tau = math.sqrt(2 * ckpt_block_s * mtbf)
    value = 1 - ckpt_block_s / tau - (mean_r + tau / 2) / mtbf
    return {"mtbf_h": mtbf / 3600, "mean_recovery_s": mean_r, "interval_s": tau, "ettr": value}


def tier_cost(a: dict[str, Any], nodes: int, checksum_gb_s: float) -> dict[str, Any]:
    """A memory save's cost per step at steady state (issue 40, item 8): its blocking copy and
    its background work (the checksum, and the peer copy out and in with its checksum) for one
    rank's shard, the interval ``memory_interval: auto`` takes for it
    (trainer.checkpointing.memory_cadence.choose), and the share of a step that costs."""
    from trainer.checkpointing.memory_cadence import choose

    shard = a["ckpt_gb"] / (nodes * a["gpus_per_node"])
    blocking = shard / a["pageable_d2h_gb_s"]
    background = 2 * shard / checksum_gb_s + shard / a["peer_gb_s"]
    c = choose(
        a["step_s"], blocking, background,
        budget=a["budget"], durable_interval=a["durable_interval_steps"],
    )  # fmt: skip
    return {
        "shard_gb": shard,
        "blocking_s": blocking,
        "background_s": background,
        "interval": c.interval,
        "share_of_step": (blocking + background) / (c.interval * a["step_s"]),
        "share_every_step": (blocking + background) / a["step_s"],
        "capped": bool(c.clamped),
    }


class MeasurementMissing(RuntimeError):
    pass


def read_checksum(path: Path = CHECKSUM_JSON) -> float:
    """xxh3-128's single-core GB/s over 1 GiB (median), from checksum_speed.py's JSON."""
    try:
        data = json.loads(path.read_text())
        rows = [
            r
            for r in data["throughput"]
            if r["algo"] == "xxh3_128" and r["size_mib"] >= 1024 and r["mode"] == "one_call"
        ]
        return float(statistics.median(r["median_gbps"] for r in rows))
    except (OSError, ValueError, KeyError, TypeError, statistics.StatisticsError) as e:
        raise MeasurementMissing(
            f"{path} is not checksum_speed.py output ({e!r}): run `python "
            "benchmarks/checksum_speed.py --out benchmarks/results/checksum_speed.json`"
        ) from e


def read_measured(path: Path) -> dict[str, float]:
    """The measured components, from recovery_time.py's JSON (medians over its samples)."""
    shown = path.relative_to(REPO) if path.is_relative_to(REPO) else path
    if not path.is_file():
        raise MeasurementMissing(f"{shown} is missing: {PRODUCE}")
    try:
        rows = {r["fault"]: r for r in json.loads(path.read_text())["rows"]}
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise MeasurementMissing(f"{shown} is not recovery_time.py output ({e}): {PRODUCE}") from e

    def median(fault: str, who: str, phase: str) -> float:
        row = rows.get(fault)
        if row is None:
            raise MeasurementMissing(f"{shown} has no {fault!r} row: {PRODUCE}")
        agg = row.get(who)
        if not isinstance(agg, dict) or "median" not in agg:
            raise MeasurementMissing(
                f"{shown}: the {fault!r} row has no {who} medians (it predates the sampled "
                f"methodology, or {who} never recovered): {PRODUCE}"
            )
        if phase not in agg["median"]:
            raise MeasurementMissing(
                f"{shown}: no recovered {fault!r} sample of {who} (no median {phase}): {PRODUCE}"
            )
        return float(agg["median"][phase])

    return {
        # The in-process layer's own cost here, without this machine's checkpoint load.
        "inprocess_restart_s": median("exception", "ours", "total_s")
        - median("exception", "ours", "load_s"),
        "injob_detect_s": median("sigkill", "ours", "detect_s"),
        # The baseline's own detection (torchrun notices the failure, stops and respawns).
        "baseline_exception_detect_s": median("exception", "baseline", "detect_s"),
        "baseline_injob_detect_s": median("sigkill", "baseline", "detect_s"),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--recovery", type=Path, default=RECOVERY_JSON)
    p.add_argument("--ckpt-gb", type=float)
    p.add_argument("--fsx-tib", type=float)
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    a = dict(ASSUMPTIONS)
    if args.ckpt_gb:
        a["ckpt_gb"] = args.ckpt_gb
    if args.fsx_tib:
        a["fsx_tib"] = args.fsx_tib
    try:
        measured = read_measured(args.recovery)
        measured["checksum_gb_s"] = read_checksum()
    except MeasurementMissing as e:
        print(f"scale_model: {e}", file=sys.stderr)
        return 2
    out: dict[str, Any] = {"assumptions": a, "measured": measured, "rows": []}
    print(
        f"checkpoint {a['ckpt_gb']:.0f} GB; FSx {a['fsx_tib']} TiB at "
        f"{a['fsx_mb_s_per_tib']:.0f} MB/s/TiB -> load {load_s(a):.0f} s; measured {measured}"
    )
    print()
    print(
        "| nodes | GPUs | job MTBF (h) | ours, durable only: exception / sigkill / hang / node "
        "loss (s) | ours with memory tiers: same (s) | torchrun: same (s) | ours ETTR (durable "
        "/ tiers) | baseline ETTR |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for nodes in (2, 4, 8, 16, 32, 64):
        rec = recoveries(a, nodes, measured)
        ranks = nodes * a["gpus_per_node"]
        ours_block = a["ckpt_gb"] / ranks / a["d2h_gb_s"]  # each rank copies its shard
        base_block = a["ckpt_gb"] * 1000.0 / (a["fsx_mb_s_per_tib"] * a["fsx_tib"])
        e_ours = ettr(a, nodes, rec["ours"], ours_block)
        e_tiers = ettr(a, nodes, rec["tiers"], ours_block)
        e_base = ettr(a, nodes, rec["baseline"], base_block)
        row = {
            "nodes": nodes,
            "recovery": rec,
            "ettr_ours": e_ours,
            "ettr_tiers": e_tiers,
            "ettr_baseline": e_base,
            "ours_block_s": ours_block,
            "baseline_block_s": base_block,
        }
        out["rows"].append(row)
        fmt = " / ".join
        print(
            f"| {nodes} | {ranks} | {e_ours['mtbf_h']:.0f} | "
            f"{fmt(f'{v:.0f}' for v in rec['ours'].values())} | "
            f"{fmt(f'{v:.0f}' for v in rec['tiers'].values())} | "
            f"{fmt(f'{v:.0f}' for v in rec['baseline'].values())} | "
            f"{e_ours['ettr']:.4f} / {e_tiers['ettr']:.4f} | {e_base['ettr']:.4f} |"
        )
    print()
    print(
        f"Memory saves at steady state (an 8B step of {a['step_s']:g} s, a budget of "
        f"{a['budget']:.0%}, xxh3 at {measured['checksum_gb_s']:.1f} GB/s, the peer copy at "
        f"{a['peer_gb_s']:g} GB/s, the copy at pageable D2H {a['pageable_d2h_gb_s']:g} GB/s):"
    )
    print()
    print(
        "| nodes | shard/GPU (GB) | blocking (s) | background (s) | auto interval | cost, share "
        "of a step | every step |"
    )
    print("| --- | --- | --- | --- | --- | --- | --- |")
    out["tier_cost"] = []
    for nodes in (2, 4, 8, 16, 32, 64):
        t = tier_cost(a, nodes, measured["checksum_gb_s"])
        out["tier_cost"].append({"nodes": nodes, **t})
        print(
            f"| {nodes} | {t['shard_gb']:.2f} | {t['blocking_s']:.2f} | {t['background_s']:.2f} "
            f"| {t['interval']}{' (capped)' if t['capped'] else ''} | "
            f"{t['share_of_step']:.1%} | {t['share_every_step']:.1%} |"
        )
    if args.json:
        print(json.dumps(out))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
