"""A Kubernetes watch as pure decisions over what the API server sends; ``Kube.watch`` (the
seam) opens the watches and lists, so this is tested over tables of recorded answers:

- ``ADDED``/``MODIFIED``/``DELETED`` carry an object: passed on; its resourceVersion is where
  the next watch resumes. ``BOOKMARK`` (``allowWatchBookmarks``) carries only a newer version,
  so a quiet resource's watch resumes after etcd compaction instead of expiring.
- ``ERROR`` carries a ``Status``, never an object of the watched kind. ``410 Gone``
  (``Expired``: routine after compaction, on a quiet resource, after control-plane maintenance):
  list again and watch from the list's version. Any other code (429, 5xx): back off and resume
  from the version held.
- A line that is not JSON, or an object not of the watched kind, is dropped and counted: one
  bad object never stops the watch nor reaches the caller.
- A list (the first, or after a 410) replaces what the watch knew, as an informer's store does:
  every item is passed on as ``ADDED``, every object known before and not listed as ``DELETED``
  (its last state); else a pod deleted while the watch was cut is never seen to go, and the
  attempt waits on it until its deadline.

Every (re)open waits ``min_interval_s`` after the previous one, and after failures a jittered
exponential backoff (``backoff_s``, at least a server's ``Retry-After``): a server failing
every request sees a few a second, not a busy loop (a watch re-opening with a stale version
once made 80 k requests/s against an in-process fake). Relists have their own
(``relist_wait_s``): one after a 410 is routine and immediate, but a list is the most expensive
call there is, and a server answering 410 to every watch got one every ``min_interval_s``.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

GONE = 410


class Step(Enum):
    EMIT = "emit"  # pass (type, object) on; the version advanced
    SKIP = "skip"  # nothing to pass on (a bookmark, or a dropped line); the version may advance
    RELIST = "relist"  # 410: list again, then watch from the list's version
    BACKOFF = "backoff"  # a server error: end this stream, wait, resume from the version held


@dataclass(frozen=True)
class Decision:
    step: Step
    type: str = ""
    obj: dict[str, Any] | None = None
    why: str = ""
    retry_after_s: float | None = None


@dataclass
class WatchCursor:
    """One watch's state: the version to resume from, failures in a row, lines dropped."""

    kind: str  # "Pod" or "Node": the only kind an event may carry
    version: str | None = None
    failures: int = 0
    relists: int = 0  # 410s in a row: lists since the watch last delivered anything
    dropped: dict[str, int] = field(default_factory=dict)
    # The last state of every object seen and not deleted, by namespace/name: what a relist
    # is compared with.
    known: dict[str, dict[str, Any]] = field(default_factory=dict)

    def _drop(self, why: str) -> Decision:
        self.dropped[why] = self.dropped.get(why, 0) + 1
        return Decision(Step.SKIP, why=why)

    def on_line(self, line: bytes | str) -> Decision:
        """What one line of a watch stream means."""
        try:
            event = json.loads(line)
        except (ValueError, UnicodeDecodeError):
            return self._drop("not JSON")
        if not isinstance(event, dict):
            return self._drop("not an event")
        d = self.on_event(event)
        if d.step is Step.EMIT or d.why == "bookmark":  # the watch works again
            self.relists = 0
        return d

    def on_event(self, event: dict[str, Any]) -> Decision:
        kind, obj = event.get("type"), event.get("object")
        if not isinstance(obj, dict):
            return self._drop("no object")
        if kind == "ERROR":
            code = obj.get("code")
            reason = f"{obj.get('reason') or ''}: {obj.get('message') or ''}".strip(": ")
            if code == GONE:
                return Decision(Step.RELIST, why=f"410 {reason or 'Gone'}")
            retry = (obj.get("details") or {}).get("retryAfterSeconds")
            return Decision(
                Step.BACKOFF,
                why=f"{code} {reason}".strip(),
                retry_after_s=float(retry) if isinstance(retry, int | float) else None,
            )
        version = _version(obj)
        if kind == "BOOKMARK":
            self.version = version or self.version
            return Decision(Step.SKIP, why="bookmark")
        if kind not in ("ADDED", "MODIFIED", "DELETED"):
            return self._drop(f"type {kind!r}")
        if obj.get("kind") not in (self.kind, None) or not isinstance(obj.get("metadata"), dict):
            # A Status (or anything else) read as a Node was what deleted a healthy Job.
            return self._drop(f"not a {self.kind}")
        self.version = version or self.version
        self.failures = 0
        key = _key(obj)
        if kind == "DELETED":
            self.known.pop(key, None)
        else:
            self.known[key] = obj
        return Decision(Step.EMIT, type=kind, obj=obj)

    def on_list(self, listing: dict[str, Any]) -> list[Decision]:
        """A list answered: what to pass on (every item ``ADDED``, every object known before
        and not listed ``DELETED``), and the watch resumes from the list's version."""
        before = dict(self.known)
        self.known.clear()
        out = []
        for obj in listing.get("items") or []:
            d = self.on_event({"type": "ADDED", "object": obj})
            if d.step is Step.EMIT:
                out.append(d)
        for key, obj in before.items():
            if key not in self.known:
                out.append(Decision(Step.EMIT, type="DELETED", obj=obj, why="gone at a relist"))
        self.version = _version(listing)  # None: from now
        return out


def backoff_s(
    failures: int,
    *,
    base_s: float = 0.5,
    max_backoff_s: float = 30.0,
    retry_after_s: float | None = None,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before the next open after ``failures`` failures in a row: full jitter
    over an exponential bound (so many clients do not retry in step), at least the server's
    ``Retry-After``; 0 after none."""
    wait = 0.0 if failures <= 0 else rand() * min(max_backoff_s, base_s * 2 ** (failures - 1))
    return max(wait, retry_after_s or 0.0)


def relist_wait_s(
    relists: int,
    *,
    base_s: float = 0.5,
    max_s: float = 30.0,
    rand: Callable[[], float] = random.random,
) -> float:
    """Seconds to wait before the ``relists``-th list in a row (each after a 410, with no event
    between): none before the first (routine after compaction), then an exponential bound,
    capped, jittered over its upper half (a relist storm never shrinks to a busy loop, and many
    watchers do not list in step)."""
    if relists <= 1:
        return 0.0
    bound = min(max_s, base_s * 2 ** (relists - 2))
    return bound / 2 + rand() * bound / 2


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def _version(obj: dict[str, Any]) -> str | None:
    """An object's (or a list's) resourceVersion: where a watch after it starts."""
    meta = obj.get("metadata")
    version = meta.get("resourceVersion") if isinstance(meta, dict) else None
    return version if isinstance(version, str) and version else None
