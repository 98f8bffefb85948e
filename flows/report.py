"""The run report (markdown artifact): a pure function of the result."""

from __future__ import annotations

import base64
from pathlib import Path

from flows.models import PipelineResult

_STAGES = ("preflight", "hydrate", "train", "validate", "export")


def render_report(r: PipelineResult) -> str:
    icon = {"completed": "completed", "cancelled": "CANCELLED"}.get(r.status, "FAILED")
    lines = [
        f"# Run `{r.run_id}`: {icon}",
        "",
        f"- steps: **{r.final_step} / {r.target_steps}**, final loss "
        f"{'n/a' if r.final_loss is None else f'{r.final_loss:.4f}'}",
        f"- ETTR (productive training time / train-stage wall time): "
        f"**{'n/a' if r.ettr is None else f'{r.ettr:.3f}'}**",
        f"- wall time: {r.wall_s:.1f} s",
    ]
    if r.error:
        lines.append(f"- cause: `{r.error}`")
    if r.takeover is not None:
        t = r.takeover
        lines.append(
            f"- taken over from {t.previous_owner} (gone): {t.action}, {t.reason}; "
            f"{t.steps_lost} step(s) lost"
        )
    lines += [
        "",
        "## Stage timeline",
        "",
        "| stage | starts at (s) | duration (s) | attempts | |",
        "| --- | --- | --- | --- | --- |",
    ]
    at = 0.0
    for s in _STAGES:
        if s in r.stage_durations_s:
            d = r.stage_durations_s[s]
            bar = "#" * max(1, round(20 * d / max(r.wall_s, 1e-9)))
            lines.append(f"| {s} | {at:.1f} | {d:.1f} | {r.stage_attempts.get(s, 1)} | `{bar}` |")
            at += d
    lines += ["", "## Faults", ""]
    if r.faults:
        lines += [
            "| fault | step | rank | node | recovered by | recovery (s) | |",
            "| --- | --- | --- | --- | --- | --- | --- |",
        ]
        for f in r.faults:
            rec = "n/a" if f.recovery_s is None else f"{f.recovery_s:.1f}"
            lines.append(
                f"| {f.kind} | {f.step} | {'' if f.rank is None else f.rank} | "
                f"{'' if f.node is None else f.node} | {f.recovered_by} | {rec} | "
                f"{f.detail or ''} |"
            )
    else:
        lines.append("none")
    if r.world_changes:
        lines += [
            "",
            "## World size (elastic)",
            "",
            "| from step | ranks | nodes | why |",
            "| --- | --- | --- | --- |",
        ]
        for c in r.world_changes:
            why = "a node was lost" if c.cause == "shrink" else "a node returned"
            lines.append(
                f"| {c.step} | {c.from_world} -> {c.to_world} | "
                f"{', '.join(map(str, c.nodes))} | {why} |"
            )
    lines += [
        "",
        "## Outputs",
        "",
        f"- checkpoint: step {r.checkpoint.step} at `{r.checkpoint.uri}` "
        f"({'validated' if r.checkpoint.validated else 'not validated'}"
        + (
            f"; FALLBACK: newer step(s) {r.checkpoint.fell_back_from} failed validation)"
            if r.checkpoint.fell_back_from
            else ")"
        ),
        f"- export: `{r.export.uri}` ({r.export.objects} objects, {r.export.bytes} bytes, "
        f"{'verified' if r.export.verified else 'not verified'})",
        f"- params_sha256: `{r.params_sha256}`",
        "",
        "The recovery timeline (step versus wall time, faults, restarts and checkpoints) is the "
        "`recovery-timeline` image artifact of this run.",
    ]
    return "\n".join(lines) + "\n"


def png_data_uri(path: Path) -> str:
    """The image inline (``data:`` URL): the artifact needs no bucket, presigned URL or server
    to keep serving it, and the file stays next to the run (``timeline.png``)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()
