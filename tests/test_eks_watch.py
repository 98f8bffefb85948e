"""Watches as the API server defines them (issue 28, item 1): the pure decisions over recorded
answers (tasks.backends.eks.watch), and ``Kube.watch`` through the official client against a
real HTTP server that answers as an API server does on a bad day: a resumed watch expired
(``410`` as an ``ERROR`` event), bookmarks, a line that is not JSON, a ``Status`` where an object
belongs, a stream cut mid-line, and then nothing but ``500`` and ``429`` with ``Retry-After``."""

from __future__ import annotations

import itertools
import json
import queue
import threading
import time
import urllib.parse
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tasks.backends.eks.watch import Step, WatchCursor, backoff_s, relist_wait_s


def _node(name: str, rv: str) -> dict[str, Any]:
    return {"kind": "Node", "apiVersion": "v1", "metadata": {"name": name, "resourceVersion": rv}}


def _status(code: int, reason: str, retry: int | None = None) -> dict[str, Any]:
    s: dict[str, Any] = {"kind": "Status", "apiVersion": "v1", "code": code, "reason": reason}
    if retry is not None:
        s["details"] = {"retryAfterSeconds": retry}
    return s


# (recorded line, decision step, version held after it)
HISTORY = [
    (json.dumps({"type": "ADDED", "object": _node("a", "7")}), Step.EMIT, "7"),
    (
        json.dumps(
            {"type": "BOOKMARK", "object": {"kind": "Node", "metadata": {"resourceVersion": "9"}}}
        ),
        Step.SKIP,
        "9",
    ),
    (b"{not json", Step.SKIP, "9"),
    (json.dumps({"type": "MODIFIED", "object": _status(500, "InternalError")}), Step.SKIP, "9"),
    (json.dumps({"type": "MODIFIED", "object": "a string"}), Step.SKIP, "9"),
    (json.dumps({"type": "WEIRD", "object": _node("a", "10")}), Step.SKIP, "9"),
    (json.dumps({"type": "DELETED", "object": _node("a", "11")}), Step.EMIT, "11"),
    (json.dumps({"type": "ERROR", "object": _status(500, "InternalError")}), Step.BACKOFF, "11"),
    (
        json.dumps({"type": "ERROR", "object": _status(429, "TooManyRequests", 3)}),
        Step.BACKOFF,
        "11",
    ),
    (json.dumps({"type": "ERROR", "object": _status(410, "Expired")}), Step.RELIST, "11"),
]


def test_each_answer_means_what_the_api_server_says() -> None:
    cursor = WatchCursor("Node")
    got = []
    for line, step, version in HISTORY:
        d = cursor.on_line(line)
        got.append((d.step, cursor.version))
        assert d.step is step, (line, d)
        if d.step is Step.EMIT:
            assert d.obj is not None and d.obj["kind"] == "Node"
        assert cursor.version == version, line
    # A Status never reaches the caller as a Node; the dropped lines are counted by why.
    assert cursor.dropped == {"not JSON": 1, "not a Node": 1, "no object": 1, "type 'WEIRD'": 1}
    retry = cursor.on_line(HISTORY[8][0])
    assert retry.retry_after_s == 3.0 and "429" in retry.why
    cursor.on_list({"metadata": {"resourceVersion": "40"}, "items": []})
    assert cursor.version == "40"
    cursor.on_list({"items": []})  # a server without versions: watch from now
    assert cursor.version is None


def test_a_relist_replaces_what_the_watch_knew() -> None:
    """An object deleted while the watch was expired or cut is absent from the relist: it is
    passed on as DELETED (its last state), as an informer's store would; listed ones as ADDED."""
    cursor = WatchCursor("Pod")
    first = cursor.on_list({"metadata": {"resourceVersion": "5"}, "items": [
        {"kind": "Pod", "metadata": {"name": "p0", "namespace": "ns", "resourceVersion": "3"}},
        {"kind": "Pod", "metadata": {"name": "p1", "namespace": "ns", "resourceVersion": "4"}},
    ]})  # fmt: skip
    assert [(d.type, d.obj["metadata"]["name"]) for d in first if d.obj] == [
        ("ADDED", "p0"), ("ADDED", "p1"),
    ]  # fmt: skip
    assert cursor.version == "5"
    moved = {"kind": "Pod", "metadata": {"name": "p1", "namespace": "ns", "resourceVersion": "6"},
             "status": {"phase": "Running"}}  # fmt: skip
    assert cursor.on_event({"type": "MODIFIED", "object": moved}).step is Step.EMIT
    again = cursor.on_list({"metadata": {"resourceVersion": "9"}, "items": [
        {"kind": "Pod", "metadata": {"name": "p0", "namespace": "ns", "resourceVersion": "3"}},
    ]})  # fmt: skip
    assert [(d.type, d.obj["metadata"]["name"]) for d in again if d.obj] == [
        ("ADDED", "p0"), ("DELETED", "p1"),
    ]  # fmt: skip
    assert again[1].obj == moved  # its last state: where it ran, what it was doing
    assert set(cursor.known) == {"ns/p0"} and cursor.version == "9"
    # a watched DELETED forgets it too: the next relist does not delete it twice
    cursor.on_event({"type": "DELETED", "object": again[0].obj})
    assert cursor.on_list({"metadata": {"resourceVersion": "10"}, "items": []}) == []


@pytest.mark.parametrize(
    ("failures", "retry_after", "low", "high"),
    [(0, None, 0.0, 0.0), (1, None, 0.0, 0.5), (4, None, 0.0, 4.0), (30, None, 0.0, 30.0),
     (0, 7.0, 7.0, 7.0), (1, 2.0, 2.0, 2.0)],
)  # fmt: skip
def test_backoff_is_jittered_bounded_and_honours_retry_after(
    failures: int, retry_after: float | None, low: float, high: float
) -> None:
    for r in (0.0, 0.5, 0.999):
        wait = backoff_s(failures, retry_after_s=retry_after, rand=lambda r=r: r)
        assert low <= wait <= high, (failures, r, wait)


# (relists in a row, rand, wait): the first at once, then an exponential bound, capped at 30 s,
# jittered over its upper half.
RELIST_WAITS = [
    (0, 0.5, 0.0), (1, 0.999, 0.0),  # a 410 after compaction: routine, list at once
    (2, 0.0, 0.25), (2, 1.0, 0.5),
    (3, 0.0, 0.5), (3, 1.0, 1.0),
    (5, 0.5, 3.0),
    (8, 0.0, 15.0), (8, 1.0, 30.0),
    (40, 0.0, 15.0), (40, 1.0, 30.0),  # capped, never overflowing
]  # fmt: skip


@pytest.mark.parametrize(("relists", "r", "wait"), RELIST_WAITS)
def test_relists_in_a_row_back_off_with_jitter_and_a_cap(relists: int, r: float, wait: float):
    assert relist_wait_s(relists, rand=lambda: r) == pytest.approx(wait)


def test_relists_in_a_row_are_counted_until_the_watch_delivers_again() -> None:
    cursor = WatchCursor("Node")
    cursor.relists = 3  # as Kube.watch counts each 410
    gone = {"type": "ERROR", "object": {"kind": "Status", "code": 410}}
    assert cursor.on_line(json.dumps(gone)).step is Step.RELIST and cursor.relists == 3
    cursor.on_list({"metadata": {"resourceVersion": "5"}, "items": [_node("n1", "5")]})
    assert cursor.relists == 3  # a list is no sign the watch works
    bookmark = {
        "type": "BOOKMARK",
        "object": {"kind": "Node", "metadata": {"resourceVersion": "6"}},
    }
    assert cursor.on_line(json.dumps(bookmark)).step is Step.SKIP and cursor.relists == 0


class _BadDayServer:
    """The nodes endpoint of an API server: lists, and watches that go wrong in order."""

    def __init__(self) -> None:
        self.requests: list[dict[str, str]] = []
        self.times: list[float] = []
        self.lock = threading.Lock()
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                q = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(self.path).query))
                with outer.lock:
                    outer.requests.append(q)
                    outer.times.append(time.monotonic())
                    n_lists = sum(1 for r in outer.requests if "watch" not in r)
                    n_watches = sum(1 for r in outer.requests if "watch" in r)
                if "watch" not in q:
                    version = "100" if n_lists == 1 else "200"
                    names = ["a"] if n_lists == 1 else ["a", "b"]
                    items = [{"metadata": {"name": n, "resourceVersion": version}} for n in names]
                    body = {"kind": "NodeList", "metadata": {"resourceVersion": version}}
                    return self._json(200, {**body, "items": items})
                if n_watches == 1:  # from the list's version: one node, then expired
                    return self._lines(
                        {"type": "ADDED", "object": _node("b", "101")},
                        {"type": "ERROR", "object": _status(410, "Expired")},
                    )
                if n_watches == 2:  # after the relist: a bookmark, junk, a change, a cut line
                    return self._lines(
                        {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": "250"}}},
                        "garbage that is not json",
                        {"type": "MODIFIED", "object": _status(500, "InternalError")},
                        {"type": "MODIFIED", "object": _node("a", "251")},
                        tail=b'{"type": "MODIFIED", "obj',
                    )
                if n_watches == 3:
                    return self._json(429, _status(429, "TooManyRequests"), retry_after="1")
                return self._json(500, _status(500, "InternalError"))

            def _json(self, code: int, obj: Any, retry_after: str | None = None) -> None:
                data = json.dumps(obj).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if retry_after:
                    self.send_header("Retry-After", retry_after)
                self.end_headers()
                self.wfile.write(data)

            def _lines(self, *events: Any, tail: bytes = b"") -> None:
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                for e in events:
                    line = e if isinstance(e, str) else json.dumps(e)
                    self.wfile.write(line.encode() + b"\n")
                self.wfile.write(tail)
                self.wfile.flush()
                self.close_connection = True

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_watch_survives_a_bad_day_and_never_passes_a_status_on() -> None:
    from kubernetes import client

    from tasks.backends.eks.kube import Kube

    server = _BadDayServer()
    try:
        kube = Kube(client.ApiClient(client.Configuration(host=server.url)))
        out: queue.Queue[tuple[str, str, dict[str, Any]]] = queue.Queue()
        stop = threading.Event()
        t = threading.Thread(
            target=kube.watch, args=("node", "", out, stop), kwargs={"timeout_s": 5}, daemon=True
        )
        t.start()
        time.sleep(6.0)
        stop.set()
        t.join(10)
        assert not t.is_alive()
    finally:
        server.close()
    seen = []
    while not out.empty():
        what, kind, obj = out.get_nowait()
        assert what == "node" and obj.get("kind", "Node") == "Node", obj  # never a Status
        seen.append((kind, obj["metadata"]["name"], obj["metadata"]["resourceVersion"]))
    assert seen == [
        ("ADDED", "a", "100"),  # the first list
        ("ADDED", "b", "101"),  # its watch, before it expired
        ("ADDED", "a", "200"),  # the relist after 410
        ("ADDED", "b", "200"),
        ("MODIFIED", "a", "251"),  # the junk around it dropped
    ]
    watches = [r for r in server.requests if "watch" in r]
    # each watch resumed from the version the previous answers left: the list's, the relist's,
    # then after the bookmark and the change, 251 (the cut line moved nothing)
    assert [w.get("resourceVersion") for w in watches[:4]] == ["100", "200", "251", "251"]
    assert all(w["allowWatchBookmarks"] == "true" for w in watches)
    assert sum(1 for r in server.requests if "watch" not in r) == 2  # one relist, on the 410
    # bounded: 0.5 s between opens at least, longer after the 429 (Retry-After 1) and the 500s;
    # the old loop re-opened as fast as the server answered
    opened = [t for t, r in zip(server.times, server.requests, strict=True) if "watch" in r]
    gaps = [b - a for a, b in itertools.pairwise(opened)]
    assert len(server.requests) <= 14, len(server.requests)
    assert gaps and min(gaps) >= 0.45, gaps


@pytest.mark.parametrize(
    ("tries", "status", "retry_after", "waited", "retried"),
    [(1, 429, 1.0, 0.0, True), (1, 503, None, 0.0, True), (1, None, None, 0.0, True),
     (5, 500, None, 10.0, True), (6, 500, None, 10.0, False),  # out of tries
     (1, 429, 40.0, 0.0, False),  # a Retry-After past the budget: the caller's deadline decides
     (2, 500, None, 29.9, False),  # the budget spent
     (1, 404, None, 0.0, False), (1, 409, None, 0.0, False), (1, 403, None, 0.0, False),
     (1, 422, None, 0.0, False)],
)  # fmt: skip
def test_an_ordinary_call_retries_only_transient_answers_within_bounds(
    tries: int, status: int | None, retry_after: float | None, waited: float, retried: bool
) -> None:
    from tasks.backends.eks.kube import retry_wait

    wait = retry_wait(tries, status, retry_after, waited_s=waited, rand=lambda: 0.999)
    assert (wait is not None) == retried, wait
    if wait is not None and retry_after:
        assert wait >= retry_after
