"""How validation's check 4 looks at a checkpoint's tensors (:class:`LoadMode`): a full load in
a fresh process, or only the DCP metadata when the load would not fit in the memory this process
may use (its cgroup's limit, or the machine's available memory): a load past it would be
OOM-killed, taking the flow runner with it (the load check's process shares its cgroup)."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path


class LoadMode(StrEnum):
    """How check 4 looks at the tensors."""

    FULL = "full"  # load every tensor in a fresh process, check each is finite
    METADATA = "metadata"  # load nothing: the DCP metadata against the model built on "meta"
    AUTO = "auto"  # full when the load fits in the memory this process may use, else metadata


# Peak memory of a full load per byte of checkpoint tensors: the model and optimizer state the
# load fills hold every tensor once; initialising AdamW's state first allocates the gradients
# (a third of an AdamW checkpoint's tensors) for one step; DCP reads each item into a buffer
# before copying it, and the parameter digest copies one tensor at a time. Plus the interpreter
# with torch imported.
LOAD_MEMORY_FACTOR = 1.5
LOAD_OVERHEAD_BYTES = 1 << 30


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def choose_load_mode(
    requested: LoadMode, *, tensor_bytes: int, budget_bytes: int | None, budget_source: str
) -> tuple[LoadMode, str]:
    """(mode, why) for check 4 (pure). ``auto``: a full load only when its estimated peak
    (``LOAD_MEMORY_FACTOR`` x the tensors + ``LOAD_OVERHEAD_BYTES``) fits in what this process
    may use; it would otherwise be OOM-killed (taking the flow runner with it: the load check's
    process shares its cgroup) or leave the check unanswered."""
    if requested == LoadMode.FULL:
        return LoadMode.FULL, "full load (load_mode full, as asked)"
    if requested == LoadMode.METADATA:
        return LoadMode.METADATA, "metadata-only (load_mode metadata, as asked)"
    need = tensor_bytes * LOAD_MEMORY_FACTOR + LOAD_OVERHEAD_BYTES
    if budget_bytes is None:
        return LoadMode.FULL, "full load (auto: the memory this process may use is not known)"
    versus = (
        f"checkpoint tensors {_gb(tensor_bytes)} x {LOAD_MEMORY_FACTOR} + "
        f"{_gb(LOAD_OVERHEAD_BYTES)}: {_gb(need)}"
    )
    budget = f"{_gb(budget_bytes)} this process may use ({budget_source})"
    if need > budget_bytes:
        return LoadMode.METADATA, f"metadata-only (auto): {versus} > {budget}"
    return LoadMode.FULL, f"full load (auto): {versus} <= {budget}"


CGROUP_ROOT = Path("/sys/fs/cgroup")
_NO_LIMIT = 1 << 60  # cgroup v1 writes "unlimited" as a page-rounded 2**63 - 1


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


def cgroup_memory_left(root: Path = CGROUP_ROOT, proc_cgroup: Path | None = None) -> int | None:
    """Bytes this process's memory cgroup still allows (its limit less what the cgroup already
    uses), or None without a limit. cgroup v2 (``memory.max``, ``memory.current``; the
    process's own group from /proc/self/cgroup, then the root a container sees), else v1."""
    candidates = []
    try:
        for line in (proc_cgroup or Path("/proc/self/cgroup")).read_text().splitlines():
            if line.startswith("0::"):
                candidates.append(root / line[3:].strip().lstrip("/"))
    except OSError:
        pass
    candidates.append(root)
    for group in candidates:
        limit = _read_int(group / "memory.max")
        if limit is not None:
            return max(0, limit - (_read_int(group / "memory.current") or 0))
    limit = _read_int(root / "memory" / "memory.limit_in_bytes")
    if limit is not None and limit < _NO_LIMIT:
        return max(0, limit - (_read_int(root / "memory" / "memory.usage_in_bytes") or 0))
    return None


def memory_budget() -> tuple[int | None, str]:
    """(bytes this process may still use, where that figure comes from)."""
    try:
        import psutil

        available: int | None = int(psutil.virtual_memory().available)
    except Exception:  # psutil missing or /proc unreadable: the cgroup alone, or unknown
        available = None
    left = cgroup_memory_left()
    if left is not None and (available is None or left <= available):
        return left, "cgroup memory limit less usage"
    if available is None:
        return None, "unknown"
    return available, "available memory"
