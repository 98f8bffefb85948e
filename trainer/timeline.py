"""A run's recovery timeline from its ``events.jsonl``: pure phase arithmetic, and a plot.

Phases of one recovery, from the events both the trainer and the baseline write:

- ``detect_s``: the fault until the next incarnation begins: an in-process ``restart``, a new
  worker's ``worker_start`` (ft_launcher or torchrun respawned it; this includes tearing the old
  workers down), or a new train-stage attempt (``stage_attempt``);
- ``restart_s``: from there until the checkpoint load begins (process start-up, process group,
  model build);
- ``load_s``: the checkpoint load (``resume``/``loaded``'s own ``load_s``);
- ``first_step_s``: from the end of the load until the first step completes;
- ``total_s``: the fault until that first step.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

RESTART_KINDS = ("restart", "worker_start", "stage_attempt")


def _after(events: list[dict[str, Any]], t: float, kinds: tuple[str, ...], **match: Any) -> Any:
    return next(
        (
            e
            for e in events
            if e["t"] > t and e["kind"] in kinds and all(e.get(k) == v for k, v in match.items())
        ),
        None,
    )


def recovery_phases(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per fault (``corrupt-checkpoint`` excluded: it is noticed at the next resume)."""
    events = sorted(events, key=lambda e: e["t"])
    rows = []
    for f in events:
        if f["kind"] != "fault" or f.get("fault_kind") == "corrupt-checkpoint":
            continue
        t0 = f["t"]
        begin = _after(events, t0, RESTART_KINDS)
        loaded = _after(events, begin["t"] if begin else t0, ("resume",), action="loaded")
        step = _after(events, loaded["t"] if loaded else t0, ("step",))
        if step is not None:
            # The load that led to that step: a later one supersedes an earlier load that never
            # got a step done (survivors of a lost node restarting in place, say).
            loaded = [
                e
                for e in events
                if t0 < e["t"] < step["t"] and e["kind"] == "resume" and e.get("action") == "loaded"
            ][-1]
        row: dict[str, Any] = {
            "fault": f.get("fault"),
            "kind": f.get("fault_kind"),
            "step": f.get("step"),
            "layer": begin.get("layer") if begin and begin["kind"] == "restart" else None,
        }
        if begin is None or loaded is None or step is None:
            row.update(recovered=False)
            rows.append(row)
            continue
        load_s = float(loaded.get("load_s") or 0.0)
        load_start = loaded["t"] - load_s
        row.update(
            recovered=True,
            detect_s=round(begin["t"] - t0, 3),
            restart_s=round(max(0.0, load_start - begin["t"]), 3),
            load_s=round(load_s, 3),
            first_step_s=round(step["t"] - loaded["t"], 3),
            total_s=round(step["t"] - t0, 3),
        )
        rows.append(row)
    return rows


def plot_timeline(
    events: list[dict[str, Any]],
    out: Path,
    *,
    title: str = "",
    compare: Any = None,
    align_on_fault: bool = False,
) -> Path:
    """Step versus wall time, faults / restarts / checkpoints marked; PNG at ``out``.

    ``compare``: optional ``(label, events)`` of a second run drawn on the same axes;
    ``align_on_fault``: time 0 is each run's first fault (else its first event), so two runs'
    recoveries line up."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 4.5), dpi=110)
    series = [("ours", events)] + ([compare] if compare else [])
    for i, (label, evs) in enumerate(series):
        evs = sorted(evs, key=lambda e: e["t"])
        if not evs:
            continue
        t0 = evs[0]["t"]
        if align_on_fault:
            t0 = next((e["t"] for e in evs if e["kind"] == "fault"), t0)
        steps = [(e["t"] - t0, e["step"]) for e in evs if e["kind"] == "step"]
        color = ("tab:blue", "tab:gray")[i % 2]
        if steps:
            ax.plot(*zip(*steps, strict=True), ".", ms=2, color=color, label=f"{label}: steps")
        for e in evs:
            x = e["t"] - t0
            if e["kind"] == "fault":
                ax.axvline(x, color="tab:red", lw=1.2, ls="-" if i == 0 else ":")
                if i == 0:
                    ax.annotate(
                        str(e.get("fault_kind")),
                        (x, ax.get_ylim()[1] if steps else 0),
                        rotation=90,
                        va="top",
                        ha="right",
                        fontsize=7,
                        color="tab:red",
                    )
            elif e["kind"] in RESTART_KINDS and i == 0:
                ax.axvline(x, color="tab:orange", lw=0.8, ls="--")
            elif e["kind"] == "checkpoint" and i == 0:
                ax.plot([x], [e["step"]], "|", color="tab:green", ms=8)
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
