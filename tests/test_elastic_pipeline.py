"""Elastic node counts and hot spares through the whole pipeline on the embedded default (real
ft_launcher agents as simulated nodes, the Prefect test server, SeaweedFS): a node loss that the
in-job layer absorbs, with no stage retry, bitwise equal to the fault-free baseline.

Losing more nodes than the range's minimum allows still ends in a stage retry: that is the
fixed-size job's node-loss drills in ``tests/test_workload_pipeline.py`` (``nodes=2`` is ``2:2``),
which assert the path too; the decision itself is table-tested in ``tests/test_elastic.py``."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from flows.context import RunContext
from flows.models import PipelineResult
from tests.helpers import free_port_pair, read_events
from tests.pipeline_helpers import Scraper, assert_exported, make_params, nvrx_events, run_pipeline
from trainer.faults import DAMAGE_KINDS

pytestmark = pytest.mark.slow
REPO = Path(__file__).resolve().parents[1]


@dataclass(frozen=True)
class Drill:
    name: str
    params: dict[str, Any]
    faults: tuple[str, ...]
    layer: str  # the layer that recovered the loss(es)
    worlds: tuple[int, ...]  # the world size of every start of the attempt, in order
    paths: tuple[str, ...] = ()  # each loss's path, in order (default: the layer's, once)
    # Bitwise equal to the fault-free 2-node baseline (same global batch, two micro-batches).
    exact: bool = True


DRILLS = [
    # Shrink to the one node left, then grow back when it returns (at step 13 of the re-formed
    # world: as early as the drill allows, so that the returning agent's start-up and the
    # survivors' restart fit before the last step): 2 -> 1 -> 2 ranks. Two micro-batches per
    # step on every world (trainer.elastic), so every step sums two terms and the run stays
    # bitwise equal to the fault-free 2-node run. Trained by a script (script mode, gpt-tiny
    # over the session's micro-batches): bitwise equal to the built-in loop's fault-free run, so
    # the two share one training core (trainer.session). The built-in loop's own shrink and grow
    # is the Kubernetes stand-in's drill (tests/test_eks_pipeline.py); one local run covers both
    # (the CI budget).
    # Paced from step 12 (1 s a step, the same maths): without the spawned writer's start-up
    # in every incarnation, the shrunk world's last steps took under a second, and the run
    # ended before the returning node's agent had started (one CI-like run here).
    Drill(
        "script-shrink-and-grow",
        {
            "nodes": "1:2",
            "workload": "script:tests/scripts/gpt_script.py",
            # The pace ends once the world has grown back: 4 s of the grown world's last
            # steps bought nothing.
            "script_args": ["--pace-from", "12", "--pace-s", "1.0", "--pace-until-grown"],
        },
        ("node-loss@step=12,node=1", "node-return@step=13,node=1"),
        "elastic",
        (2, 1, 2),
    ),
    # Two nodes and one hot spare (node 2, started once the world formed): it takes node 1's
    # place, the world keeps its size. At the resume after the loss, node 0 damages the newest
    # peer copy it holds of rank 1's shard (issue 29: a damaged peer copy falls back). A memory
    # save every step (the default, auto, chooses from measured costs: at an interval of the
    # durable one's 5, the peer copy is only as new as the newest commit, and a CI run had its
    # damaged copy at step 10, committed too).
    Drill(
        "spare",
        {"nodes": 2, "spares": 1, "memory_interval": 1},
        ("node-loss@step=12,node=1", "corrupt-peer@step=10,rank=0"),
        "spare",
        (2, 2),
    ),
    # Two of three nodes lost at once: the first loss leaves the minimum (elastic), the second
    # leaves one node, which waits in the rendezvous (node-wait) rather than ending the attempt;
    # node 2 returns while it waits and the job re-forms on 2 nodes in-job. Another global
    # batch (divisible by 3 ranks) than the baseline's: not compared bitwise. `extended` (not
    # in `make test`): the same agents and watcher states run the Kubernetes stand-in's
    # node-wait drill (tests/test_eks_pipeline.py), and the watcher's waiting and giving up are
    # table-tested (tests/test_watch_state.py).
    pytest.param(
        Drill(
            "node-wait",
            {"nodes": "2:3", "global_batch": 6},
            ("node-loss@step=12,node=1", "node-loss@step=12,node=2", "node-return@step=13,node=2"),
            "elastic",
            (3, 2),
            paths=("elastic", "node-wait"),
            exact=False,
        ),
        marks=pytest.mark.extended,
        id="node-wait",
    ),
]


@pytest.mark.parametrize("d", DRILLS, ids=lambda d: d.name)
def test_node_loss_without_a_stage_retry(
    d: Drill, baseline: PipelineResult, s3_settings, tmp_path: Path, monkeypatch
):
    monkeypatch.chdir(REPO)  # a script is named relative to the repository
    port = free_port_pair()
    params = make_params(
        tmp_path,
        s3_settings,
        run_id=f"elastic-{d.name}",
        drills={"faults": list(d.faults)},
        metrics_port=port,
        **d.params,
    )
    flow = f"http://127.0.0.1:{port}/metrics"
    with Scraper(flow) as scraped:
        state, result = run_pipeline(params)
    assert state.is_completed(), state.message
    assert result is not None and result.status == "completed"
    assert result.final_step == result.target_steps == 20
    assert result.stage_attempts["train"] == 1, "no stage retry"
    if d.exact:
        # What the design says is exact (arch §7): with one rank per node, every world of this
        # range sums two micro-batch gradients per step, so the parameters are the baseline's.
        assert result.params_sha256 == baseline.params_sha256
        assert result.final_loss == baseline.final_loss
    paths = d.paths or (d.layer,)
    losses = [f for f in d.faults if f.startswith("node-loss")]
    failures = [f for f in result.faults if f.kind not in DAMAGE_KINDS]
    assert [(f.kind, f.node, f.path, f.recovered_by) for f in failures] == [
        ("node-loss", int(spec.rsplit("=", 1)[1]), path, d.layer)
        for spec, path in zip(losses, paths, strict=True)
    ]
    assert all(f.recovery_s and f.recovery_s > 0 for f in failures)
    run_root = RunContext.create(params).run_root
    events = read_events(run_root)
    starts = [e for e in events if e["kind"] == "train_start"]
    # The world sizes in order, a restart on the very same nodes counted once: one CI run of
    # the shrink-and-grow drill had a further restart of the grown world after its last
    # checkpoint (2, 1, 2, 2), still bitwise equal to the baseline (asserted above); its cause
    # was not found in 5 runs here, under CPU load too. A spare's takeover changes the nodes.
    worlds = [(e["world_size"], e["nodes"]) for e in starts]
    assert tuple(w[0] for i, w in enumerate(worlds) if i == 0 or w != worlds[i - 1]) == d.worlds
    # The resume after the loss loaded what the 2-rank world saved (resharded by DCP when the
    # world shrank), never step 0.
    loaded = [e for e in events if e["kind"] == "resume" and e.get("action") == "loaded"]
    assert loaded and loaded[0]["saved_world_size"] == d.worlds[0], loaded
    # Issue 29: a world of another size has shards of other sizes: the durable tier. A spare in
    # the lost node's place keeps the world: the lost rank's shard comes from its peer copy on
    # the surviving node (the lost node's own memory is gone with it), newer than any commit.
    # (The drill kills the node once the watcher saw step 12: training may have gone further.)
    # Its newest peer copy was damaged at the resume: chosen (the node loss went to the peer
    # copies), found out by its digest when it reached the spare, said, and the next newest
    # candidate read. That is the older generation when both ranks hold it, still newer than
    # any commit; when the lost rank died before sending its last copy, the survivor's own
    # generations are a step ahead of the peer copies and share only the damaged step: then
    # the durable tier (1 of 4 runs here). Bitwise either way (above).
    if d.name == "spare":
        fault_t = next(e["t"] for e in events if e["kind"] == "fault")
        committed = [e["step"] for e in events if e["kind"] == "checkpoint" and e["t"] < fault_t]
        (damage,) = [e for e in events if e.get("fault_kind") == "corrupt-peer"]
        skipped = [e for e in events if e["kind"] == "resume" and e["action"] == "skipped"]
        peer = [e for e in skipped if e["source"] == "peer"]
        assert [e["step"] for e in peer] == [damage["copy_step"]], skipped
        assert "rank 1" in peer[0]["reason"] and "xxh3_128" in peer[0]["reason"], skipped
        assert damage["copy_step"] > max(committed), (damage, committed)
        if loaded[0]["source"] == "peer":
            assert max(committed) < loaded[0]["step"] < damage["copy_step"], (loaded[0], damage)
        else:
            assert loaded[0]["source"] == "durable", loaded[0]
    else:
        assert loaded[0]["source"] == "durable" and 5 <= loaded[0]["step"] < 12, loaded[0]
    # The world changes, in the result and the report.
    expected = [(a, b) for a, b in zip(d.worlds, d.worlds[1:], strict=False) if a != b]
    assert [(c.from_world, c.to_world) for c in result.world_changes] == expected
    assert [c.cause for c in result.world_changes] == [
        "shrink" if b < a else "grow" for a, b in expected
    ]
    if d.name == "spare":
        assert starts[-1]["nodes"] == [0, 2], "the spare trained in node 1's place"
    # The newest checkpoint, whatever world wrote it, is the one validated and exported (a
    # check for the full world's size alone would fall back past a shrunk world's commits).
    assert result.checkpoint.validated and result.checkpoint.step == 20
    assert not result.checkpoint.fell_back_from
    assert_exported(result, s3_settings)
    # Operators see the path taken: on the fault event, the recovery and the world changes.
    prefect = nvrx_events(params.run_id or "", expect="nvrx.run.completed")
    by_name: dict[str, list[Any]] = {}
    for e in prefect:
        by_name.setdefault(e.event, []).append(e)
    detected = by_name["nvrx.fault.detected"]
    assert [e.payload["path"] for e in detected if e.payload["kind"] not in DAMAGE_KINDS] == list(
        paths
    )
    assert any(e.payload["kind"] == "corrupt-peer" for e in detected) == (d.name == "spare")
    assert [e.payload["layer"] for e in by_name["nvrx.recovery.completed"]] == [d.layer] * len(
        paths
    )
    assert len(by_name.get("nvrx.world.changed", [])) == len(expected)
    assert "nvrx.stage.retried" not in by_name
    restarts = scraped.series(flow, "nvrx_restarts_total", run_id=params.run_id, layer=d.layer)
    assert restarts and 1 <= restarts[-1] <= len(paths)
