"""The run report (markdown artifact): a pure function of the result."""

from __future__ import annotations

import base64
from pathlib import Path

from flows.models import FaultRecord, PipelineResult
from trainer.records import TimeBreakdown

_STAGES = ("preflight", "hydrate", "train", "validate", "export")
REPORT_FILE = "report.md"  # saved in the run root beside pipeline_result.json and timeline.png

# ETTR, spelled out once wherever it is printed (the report, `status`).
ETTR_DEFINITION = (
    "effective training time ratio: the seconds of productive steps (each step's last "
    "execution) over the train attempts' wall time"
)

# The parts of the train stage's wall time (trainer.records.TimeBreakdown), in the order
# printed, each with the label the report and `status` print (the README's glossary defines
# every label).
TIME_PARTS: tuple[tuple[str, str], ...] = (
    ("startup", "start-up"),
    ("productive", "productive steps"),
    ("replayed", "replayed steps"),
    ("checkpoint_blocking", "checkpoint blocking"),
    ("recovery", "recovery"),
    ("end", "end"),
    ("other", "other"),
)


def too_short_for_ettr(t: TimeBreakdown) -> bool:
    """Start-up outweighs the steps: the ratio says more about process start than training."""
    return t.startup > t.productive


def time_rows(t: TimeBreakdown) -> list[tuple[str, float, float]]:
    """(label, seconds, share of the train stage's wall time) for each part."""
    wall = max(t.wall_s, 1e-9)
    return [(label, getattr(t, key), getattr(t, key) / wall) for key, label in TIME_PARTS]


SHORT_RUN_NOTE = (
    "This run is too short for its ETTR to mean much: start-up took longer than all its "
    "productive steps. A long run's figure is `make bench-ettr`'s (10 minutes of training with "
    "a fault every 2 minutes; benchmarks/results/ettr.json, benchmarks/README.md)."
)


def render_report(r: PipelineResult) -> str:
    sections = [
        _summary(r),
        _stage_timeline(r),
        _train_time(r),
        _faults(r),
        _world_changes(r),
        _stragglers(r),
        _memory_and_timeouts(r),
        _outputs(r),
    ]
    return "\n\n".join(s for s in sections if s) + "\n"


def _table(title: str, header: tuple[str, ...], rows: list[tuple[object, ...]]) -> str:
    """A titled markdown table, one row per tuple."""
    head = "|" + "|".join(f" {h} " if h else " " for h in header) + "|"
    lines = [f"## {title}", "", head, "| --- " * len(header) + "|"]
    lines += [f"| {' | '.join(map(str, row))} |" for row in rows]
    return "\n".join(lines)


def _summary(r: PipelineResult) -> str:
    icon = {"completed": "completed", "cancelled": "CANCELLED"}.get(r.status, "FAILED")
    lines = [
        f"# Run `{r.run_id}`: {icon}",
        "",
        f"- steps: **{r.final_step} / {r.target_steps}**, final loss "
        f"{'n/a' if r.final_loss is None else f'{r.final_loss:.4f}'}",
        f"- ETTR: **{'n/a' if r.ettr is None else f'{r.ettr:.3f}'}** ({ETTR_DEFINITION})",
        f"- wall time: {r.wall_s:.1f} s"
        + ("" if r.train_time is None else f" (train attempts {r.train_time.wall_s:.1f} s)"),
    ]
    if r.error:
        lines.append(f"- cause: `{r.error}`")
    if r.takeover is not None:
        t = r.takeover
        lines.append(
            f"- taken over from {t.previous_owner} (gone): {t.action}, {t.reason}; "
            f"{t.steps_lost} step(s) lost"
        )
    return "\n".join(lines)


def _stage_timeline(r: PipelineResult) -> str:
    rows: list[tuple[object, ...]] = []
    at = 0.0
    for s in _STAGES:
        if s in r.stage_durations_s:
            d = r.stage_durations_s[s]
            bar = "#" * max(1, round(20 * d / max(r.wall_s, 1e-9)))
            rows.append((s, f"{at:.1f}", f"{d:.1f}", r.stage_attempts.get(s, 1), f"`{bar}`"))
            at += d
    header = ("stage", "starts at (s)", "duration (s)", "attempts", "")
    return _table("Stage timeline", header, rows)


def _train_time(r: PipelineResult) -> str:
    t = r.train_time
    if t is None:
        return ""
    rows: list[tuple[object, ...]] = [
        (label, f"{sec:.1f}", f"{share:.0%}") for label, sec, share in time_rows(t)
    ]
    rows.append(("**train attempts**", f"**{t.wall_s:.1f}**", "100%"))
    table = _table("Where the train stage's time went", ("part", "seconds", "share"), rows)
    return f"{table}\n\n{SHORT_RUN_NOTE}" if too_short_for_ettr(t) else table


def _faults(r: PipelineResult) -> str:
    if not r.faults:
        return "## Faults\n\nnone"
    header = (
        "fault", "step", "rank", "node", "recovered by", "recovery (s)", "went back to",
        "steps replayed", "",
    )  # fmt: skip
    rows: list[tuple[object, ...]] = [
        (
            f.kind,
            f.step,
            _blank(f.rank),
            _blank(f.node),
            f.recovered_by,
            "n/a" if f.recovery_s is None else f"{f.recovery_s:.1f}",
            "" if f.resume_step is None else resumed_from(f.resume_step, f),
            _blank(f.replayed_steps),
            f.detail or "",
        )
        for f in r.faults
    ]
    return _table("Faults", header, rows)


def _world_changes(r: PipelineResult) -> str:
    if not r.world_changes:
        return ""
    rows: list[tuple[object, ...]] = [
        (
            c.step,
            f"{c.from_world} -> {c.to_world}",
            ", ".join(map(str, c.nodes)),
            "a node was lost" if c.cause == "shrink" else "a node returned",
        )
        for c in r.world_changes
    ]
    return _table("World size (elastic)", ("from step", "ranks", "nodes", "why"), rows)


def _stragglers(r: PipelineResult) -> str:
    """Each node the straggler judge confirmed slow: its score, what it cost, the evidence."""
    if not r.stragglers:
        return ""
    action = {
        "confirmed": "reported (policy report: it trained on)",
        "replaced": "replaced (taken away as lost)",
        "rate-limited": "reported only: the eviction budget was spent",
    }
    rows: list[tuple[object, ...]] = [
        (s.node, f"{s.score:.2f}x", action.get(s.verdict, s.verdict), s.evidence)
        for s in r.stragglers
    ]
    return _table("Slow nodes", ("node", "score", "action", "evidence"), rows)


def _memory_and_timeouts(r: PipelineResult) -> str:
    """What the newest incarnation measured and chose: its memory-save interval, its timeouts."""
    parts = []
    if r.memory_interval:
        parts.append(f"Memory saves (the newest incarnation's choice): {r.memory_interval}.")
    if r.timeouts:
        title = "In-job timeouts (the newest incarnation's, rank 0)"
        parts.append(_table(title, ("timeout", "seconds: why"), list(r.timeouts.items())))
    return "\n\n".join(parts)


def _outputs(r: PipelineResult) -> str:
    ck = r.checkpoint
    fallback = (
        f"; FALLBACK: newer step(s) {ck.fell_back_from} failed validation"
        if ck.fell_back_from
        else ""
    )
    return "\n".join(
        [
            "## Outputs",
            "",
            f"- checkpoint: step {ck.step} at `{ck.uri}` "
            f"({'validated' if ck.validated else 'not validated'}{fallback})",
            f"- export: `{r.export.uri}` ({r.export.objects} objects, {r.export.bytes} bytes, "
            f"{'verified' if r.export.verified else 'not verified'})",
            f"- params_sha256: `{r.params_sha256}`",
            "",
            f"Saved with the run: this report (`{REPORT_FILE}`), `pipeline_result.json` and the "
            "recovery timeline (`timeline.png`: step versus wall time, faults, restarts and "
            "checkpoints; also the `recovery-timeline` image artifact) in its run root.",
        ]
    )


def _blank(v: int | None) -> str:
    return "" if v is None else str(v)


# A resume's tier other than the durable checkpoint (trainer.checkpointing.tiers), in words.
MEMORY_TIERS = {"memory": "the process's own copy", "node": "node memory", "peer": "peer copies"}


def resumed_from(step: int, fault: FaultRecord) -> str:
    """Where training went back to after a fault (0: nothing committed yet), and what the load
    read: its tier, bytes and seconds."""
    if step == 0:
        return "started over from step 1"
    source = fault.resume_source
    if source in MEMORY_TIERS:
        text, read = f"resumed from step {step} in {MEMORY_TIERS[source]}", []
    else:
        text, read = f"resumed from step {step}'s checkpoint", [source] if source else []
    if source and fault.load_bytes is not None:
        read.append(f"{fault.load_bytes / 1e6:.1f} MB")
    if source and fault.load_s is not None:
        read.append(f"{fault.load_s:.2f} s")
    return f"{text} ({', '.join(read)})" if read else text


def png_data_uri(path: Path) -> str:
    """The image inline (``data:`` URL): the artifact needs no bucket, presigned URL or server
    to keep serving it, and the file stays next to the run (``timeline.png``)."""
    return "data:image/png;base64," + base64.b64encode(Path(path).read_bytes()).decode()
