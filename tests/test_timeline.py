"""Recovery phases from events (pure) and the timeline plot."""

from __future__ import annotations

from pathlib import Path

from trainer.event_types import Event, decode_obj
from trainer.timeline import plot_timeline, recovery_phases

# The required fields these histories do not decide from.
FILL: dict[str, dict[str, object]] = {
    "worker_start": {"world_size": 2},
    "train_start": {"world_size": 2},
    "stage_attempt": {"stage": "train"},
}


def ev(t: float, kind: str, **kw: object) -> Event:
    return decode_obj({"t": t, "kind": kind, **FILL.get(kind, {}), **kw})


def test_phases_of_an_in_job_recovery():
    events = [
        ev(0.0, "worker_start"),
        ev(1.0, "step", step=16, step_s=0.1),
        ev(1.05, "fault", fault="sigkill@step=17,rank=1", fault_kind="sigkill", step=17),
        ev(1.06, "step", step=16, step_s=0.1),  # rank 0 finishing the step the fault raced
        ev(4.0, "worker_start"),
        ev(6.5, "resume", action="loaded", step=15, load_s=0.5),
        ev(7.0, "step", step=16, step_s=0.1),
    ]
    [row] = recovery_phases(events)
    assert row["recovered"] and row["kind"] == "sigkill"
    assert row["detect_s"] == 2.95 and row["restart_s"] == 2.0 and row["load_s"] == 0.5
    assert row["first_step_s"] == 0.5 and row["total_s"] == 5.95
    assert (
        abs(
            sum(row[k] for k in ("detect_s", "restart_s", "load_s", "first_step_s"))
            - row["total_s"]
        )
        < 1e-6
    )


def test_in_job_phases_split_by_the_trainers_events_and_a_restart_from_scratch():
    events = [
        ev(1.0, "fault", fault="sigkill@step=3,rank=1", fault_kind="sigkill", step=3),
        ev(4.0, "worker_start", process_start_t=2.5),
        ev(4.4, "phase", phase="process_group", s=0.3),
        ev(5.4, "phase", phase="model_built", s=1.0),
        ev(5.5, "phase", phase="writer_ready", s=2.9),  # off the critical path: not a phase
        ev(5.6, "train_start", start_step=1),  # nothing was committed: from step 1
        ev(5.9, "step", step=1),
    ]
    [row] = recovery_phases(events)
    assert row["recovered"] and row["from_scratch"] and row["load_s"] == 0.0
    assert row["detect_s"] == 3.0 and row["respawn_s"] == 1.5 and row["startup_s"] == 1.5
    assert row["process_group_s"] == 0.3 and row["model_built_s"] == 1.0
    assert row["restart_s"] == 1.6 and row["first_step_s"] == 0.3 and row["total_s"] == 4.9


def test_superseded_load_and_unrecovered_fault():
    events = [
        ev(0.0, "fault", fault="node-loss@step=9,node=1", fault_kind="node-loss", step=9),
        ev(1.0, "restart", layer="inprocess"),  # survivors try in place first
        ev(2.0, "resume", action="loaded", step=5, load_s=0.2),  # never gets a step done
        ev(5.0, "stage_attempt", attempt=2),
        ev(9.0, "resume", action="loaded", step=5, load_s=0.4),
        ev(9.5, "step", step=6),
        ev(20.0, "fault", fault="hang@step=12,rank=0", fault_kind="hang", step=12),
    ]
    first, second = recovery_phases(events)
    assert first["total_s"] == 9.5 and first["load_s"] == 0.4 and first["detect_s"] == 1.0
    assert first["restart_s"] == 7.6  # from the first reaction to the load that counted
    assert second == {
        "fault": "hang@step=12,rank=0",
        "kind": "hang",
        "step": 12,
        "layer": None,
        "recovered": False,
    }


def test_plot_is_a_png(tmp_path: Path):
    events = [ev(float(i), "step", step=i) for i in range(1, 20)]
    events += [
        ev(5.5, "fault", fault="exception@step=5", fault_kind="exception"),
        ev(6.0, "restart", layer="inprocess"),
    ]
    events += [ev(10.0, "checkpoint", step=10, blocking_s=0.01)]
    out = plot_timeline(events, tmp_path / "t.png", compare=("baseline", events[:5]))
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and out.stat().st_size > 5000


def test_only_restarts_are_drawn_as_restarts():
    """Every rank's first start is no restart (issue 27: the demo's plot drew them as ones); a
    respawn after a fault, an in-process restart and a train attempt after the first are."""
    from trainer.timeline import _is_restart

    first = ev(1.0, "worker_start", rank=0)
    assert not _is_restart(first, after_fault=False)
    assert _is_restart(ev(9.0, "worker_start", rank=0), after_fault=True)
    assert _is_restart(ev(6.0, "restart", layer="inprocess"), after_fault=False)
    assert not _is_restart(ev(0.0, "stage_attempt", stage="train", attempt=1), after_fault=False)
    assert _is_restart(ev(30.0, "stage_attempt", stage="train", attempt=2), after_fault=True)
