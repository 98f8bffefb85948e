"""A run's recovery timeline from its ``events.jsonl``: pure phase arithmetic, and a plot.

Phases of one recovery: ``detect_s`` (the fault until the next incarnation begins: an
in-process ``restart``, a new ``worker_start``, or a new ``stage_attempt``), ``restart_s``
(until the checkpoint load begins), ``load_s`` (the load's own), ``first_step_s`` (until the
first step completes) and ``total_s`` (the fault until that step). Where the trainer's phase
events allow, an in-job ``detect_s`` splits into ``respawn_s`` and ``startup_s``, and
``restart_s`` gets ``process_group_s`` and ``model_built_s``. A restart with nothing to load has
``load_s`` 0 and ``from_scratch``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from trainer.event_types import (
    Checkpoint,
    Event,
    Fault,
    Phase,
    Restart,
    Resume,
    StageAttempt,
    Step,
    TrainStart,
    WorkerStart,
)
from trainer.faults import DAMAGE_KINDS

# What begins a new incarnation after a fault.
RESTARTS = (Restart, WorkerStart, StageAttempt)


def _after(events: list[Event], t: float, kinds: tuple[type, ...]) -> Any:
    return next((e for e in events if e.t > t and isinstance(e, kinds)), None)


def _loaded(e: Event) -> bool:
    return isinstance(e, Resume) and e.action == "loaded"


def recovery_phases(events: list[Event]) -> list[dict[str, Any]]:
    """One row per fault (damage excluded, ``faults.DAMAGE_KINDS``: noticed at the next resume)."""
    events = sorted(events, key=lambda e: e.t)
    rows = []
    for f in events:
        if not isinstance(f, Fault) or f.fault_kind in DAMAGE_KINDS:
            continue
        t0 = f.t
        begin = _after(events, t0, RESTARTS)
        row: dict[str, Any] = {
            "fault": f.fault,
            "kind": f.fault_kind,
            "step": f.step,
            "layer": begin.layer if isinstance(begin, Restart) else None,
        }
        # The first step after a load (with nothing to load: after the training start).
        step = None
        if begin is not None:
            first_load = next((e for e in events if e.t > begin.t and _loaded(e)), None)
            anchor = first_load or _after(events, begin.t, (TrainStart,))
            step = _after(events, anchor.t, (Step,)) if anchor else None
        if begin is None or step is None:
            row.update(recovered=False)
            rows.append(row)
            continue
        # The load that led to that step (a later one supersedes one that got no step done).
        loads = [e for e in events if t0 < e.t < step.t and _loaded(e)]
        loaded = loads[-1] if loads else None
        if isinstance(loaded, Resume):
            load_s = loaded.load_s or 0.0
            load_end = loaded.t
        else:  # started over from step 1: nothing was committed before the fault
            starts = [e for e in events if begin.t <= e.t < step.t]
            load_end = next((e.t for e in reversed(starts) if isinstance(e, TrainStart)), step.t)
            load_s = 0.0
            row["from_scratch"] = True
        load_start = load_end - load_s
        row.update(
            recovered=True,
            detect_s=round(begin.t - t0, 3),
            restart_s=round(max(0.0, load_start - begin.t), 3),
            load_s=round(load_s, 3),
            first_step_s=round(step.t - load_end, 3),
            total_s=round(step.t - t0, 3),
        )
        row.update(_split(events, t0, begin, load_start))
        rows.append(row)
    return rows


def _split(events: list[Event], t0: float, begin: Event, load_start: float) -> dict[str, float]:
    """The finer phases the trainer's events allow (see the module docstring)."""
    out: dict[str, float] = {}
    born = begin.process_start_t if isinstance(begin, WorkerStart) else None
    if born is not None and t0 <= born <= begin.t:
        out["respawn_s"] = round(born - t0, 3)
        out["startup_s"] = round(begin.t - born, 3)
    for e in events:
        if not isinstance(e, Phase) or e.phase not in ("process_group", "model_built"):
            continue
        if begin.t <= e.t <= load_start + 1e-6:
            out[f"{e.phase}_s"] = round(e.s, 3)
    return out


def _is_restart(e: Event, after_fault: bool) -> bool:
    """Drawn as a restart: an in-process restart, a train attempt after the first, a worker's
    first start after a fault."""
    if isinstance(e, Restart):
        return True
    if isinstance(e, StageAttempt):
        return e.attempt > 1
    return after_fault


def plot_timeline(
    events: list[Event],
    out: Path,
    *,
    title: str = "",
    compare: Any = None,
    align_on_fault: bool = False,
    label: str = "this run",
) -> Path:
    """Step versus wall time, faults / restarts / checkpoints marked; PNG at ``out``.
    ``compare``: ``(label, events)`` of a second run on the same axes; ``align_on_fault``: time
    0 is each run's first fault (else its first event), so two recoveries line up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    series = [(label, events)] + ([compare] if compare else [])
    for i, (label, evs) in enumerate(series):
        evs = sorted(evs, key=lambda e: e.t)
        if not evs:
            continue
        t0 = evs[0].t
        if align_on_fault:
            t0 = next((e.t for e in evs if isinstance(e, Fault)), t0)
        steps = [(e.t - t0, e.step) for e in evs if isinstance(e, Step)]
        color = ("tab:blue", "tab:gray")[i % 2]
        if steps:
            ax.plot(*zip(*steps, strict=True), ".", ms=2, color=color, label=f"{label}: steps")
        open_fault = False  # a respawn after a fault is a restart; a first start is not
        for e in evs:
            x = e.t - t0
            if isinstance(e, Fault):
                open_fault = True
                ax.axvline(x, color="tab:red", lw=1.2, ls="-" if i == 0 else ":")
                if i == 0:
                    ax.annotate(
                        e.fault_kind,
                        (x, ax.get_ylim()[1] if steps else 0),
                        rotation=90,
                        va="top",
                        ha="right",
                        fontsize=7,
                        color="tab:red",
                    )
            elif isinstance(e, RESTARTS) and i == 0 and _is_restart(e, open_fault):
                ax.axvline(x, color="tab:orange", lw=0.8, ls="--")
                open_fault = False
            elif isinstance(e, Checkpoint) and i == 0:
                ax.plot([x], [e.step], "|", color="tab:green", ms=8)
    # Legend proxies for the markers.
    ax.plot([], [], color="tab:red", label="fault")
    ax.plot([], [], color="tab:orange", ls="--", label="restart / new attempt")
    ax.plot([], [], "|", color="tab:green", ms=8, label="checkpoint committed")
    ax.set_xlabel("seconds since the fault" if align_on_fault else "wall time (s)")
    ax.set_ylabel("step")
    ax.set_title(title or "recovery timeline")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper left")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    plt.close(fig)
    return out
