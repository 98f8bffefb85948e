"""An API server's ordinary bad day, in front of kmock's emulator (issue 28, item 2).

kmock stores and serves objects, politely: no resourceVersions, no expiry, no throttling. A
real API server versions every object, expires a watch resumed from a compacted version (an
``ERROR`` event with a ``410`` Status, or the request answered ``410``), throttles (``429`` with
``Retry-After``, API Priority and Fairness), answers ``5xx`` while a replica restarts or etcd
elects a leader, is slow, and cuts streams (a load balancer's idle timeout, a replica going
away) anywhere, mid-line included; and a watch resumed from a version it still holds replays
what happened since, deletions included (kmock's watches start from now, replaying only what
exists). :class:`ChaosProxy` forwards the client's requests to kmock
and adds exactly that, as a :class:`Misbehaviour` says, counting what it did so a test can
assert that it happened.
"""

from __future__ import annotations

import http.client
import itertools
import json
import threading
import time
import urllib.parse
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass(frozen=True)
class Misbehaviour:
    """What the server does wrong. Bursts: ``(first request, how many, status)``, counted over
    every request but watches (a burst on watches is ``watch_errors``)."""

    name: str
    # Per watched resource (pods, nodes): its first resumed watches answered with an ERROR
    # event carrying 410 (Expired), then its next ones answered HTTP 410 (version compacted).
    expire_resumed: int = 0
    compacted: int = 0
    bursts: tuple[tuple[int, int, int], ...] = ()
    periodic: tuple[tuple[int, int], ...] = ()  # (period, status): every period-th request
    watch_errors: tuple[int, ...] = ()  # statuses the next watch opens are answered with
    slow_s: float = 0.0  # every answer delayed this long
    cut: int = 0  # watch streams cut mid-line, after their first event


@dataclass
class Seen:
    """What the proxy did, by kind (the test asserts each misbehaviour really happened)."""

    counts: dict[str, int] = field(default_factory=dict)
    requests: int = 0
    watches: int = 0

    def add(self, what: str) -> None:
        self.counts[what] = self.counts.get(what, 0) + 1


def _is_watch(query: dict[str, str]) -> bool:
    return query.get("watch") in ("true", "1", "True")


class ChaosProxy:
    """kmock behind a server that versions, expires, throttles, fails, dawdles and cuts."""

    def __init__(self, upstream: str, misbehaviour: Misbehaviour) -> None:
        self.up = urllib.parse.urlsplit(upstream)
        self.m = misbehaviour
        self.seen = Seen()
        self.lock = threading.Lock()
        self._version = itertools.count(1000)
        self._expired: dict[str, int] = {}
        self._compacted: dict[str, int] = {}
        self._cuts = 0
        # What the client has been shown of each collection (by path): a resumed watch replays
        # the deletions it missed, as a real server's watch cache does.
        self._shown: dict[str, dict[str, Any]] = {}
        self._watch_errors = list(misbehaviour.watch_errors)
        outer = self

        class Handler(BaseHTTPRequestHandler):
            # Watches are chunked, as a real server's are: the client reads a watch in chunks
            # (urllib3's stream()), and a close-delimited body would only arrive in 4 KiB
            # pieces. Every answer closes its connection.
            protocol_version = "HTTP/1.1"

            def log_message(self, *a: Any) -> None:
                pass

            def do_GET(self) -> None:
                outer._handle(self)

            do_POST = do_PUT = do_PATCH = do_DELETE = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- versions, as a real server stamps them ------------------------------------------------
    def _stamp(self, obj: Any) -> None:
        if isinstance(obj, dict):
            meta = obj.setdefault("metadata", {})
            if isinstance(meta, dict):
                meta["resourceVersion"] = str(next(self._version))

    def _stamped_body(self, data: bytes) -> bytes:
        try:
            doc = json.loads(data)
        except ValueError:
            return data
        if isinstance(doc, dict) and isinstance(doc.get("items"), list):
            for item in doc["items"]:
                self._stamp(item)
        self._stamp(doc)  # a list's own version: where a watch after it starts
        return json.dumps(doc).encode()

    # -- the answers ---------------------------------------------------------------------------
    def _handle(self, h: BaseHTTPRequestHandler) -> None:
        query = dict(urllib.parse.parse_qsl(urllib.parse.urlsplit(h.path).query))
        watch = _is_watch(query)
        with self.lock:
            if watch:
                self.seen.watches += 1
            else:
                n = self.seen.requests
                self.seen.requests += 1
            status = None
            if watch and self._watch_errors:
                status = self._watch_errors.pop(0)
            elif not watch:
                for first, count, code in self.m.bursts:
                    if first <= n < first + count:
                        status = code
                for period, code in self.m.periodic:
                    if n % period == period - 1:
                        status = code
            resumed = watch and query.get("resourceVersion", "").isdigit()
            what = urllib.parse.urlsplit(h.path).path.rstrip("/").rsplit("/", 1)[-1]
            expire = resumed and self._expired.get(what, 0) < self.m.expire_resumed
            compact = resumed and not expire and self._compacted.get(what, 0) < self.m.compacted
            cut = watch and not (status or expire or compact) and self._cuts < self.m.cut
            self._expired[what] = self._expired.get(what, 0) + expire
            self._compacted[what] = self._compacted.get(what, 0) + compact
            self._cuts += cut
        body = h.rfile.read(int(h.headers.get("Content-Length") or 0))
        if self.m.slow_s:
            self.seen.add("slow")
            time.sleep(self.m.slow_s)
        if status is not None:
            self.seen.add(str(status))
            return _answer(h, status, _status(status), retry_after="1" if status == 429 else None)
        if compact:
            self.seen.add(f"410 compacted {what}")
            return _answer(h, 410, _status(410, "Expired", "too old resource version"))
        if expire:
            self.seen.add(f"410 expired {what}")
            return _lines(h, [{"type": "ERROR", "object": _status(410, "Expired")}])
        # kmock would replay from a version it does not know: it is watched from now.
        path = _without(h.path, "resourceVersion") if watch else h.path
        conn = http.client.HTTPConnection(self.up.hostname, self.up.port, timeout=60)
        headers = {k: v for k, v in h.headers.items() if k.lower() in ("content-type", "accept")}
        try:
            conn.request(h.command, path, body=body or None, headers=headers)
            resp = conn.getresponse()
            if not watch or resp.status != 200:
                raw = self._stamped_body(resp.read())
                if not watch and h.command == "GET" and "labelSelector" not in query:
                    self._remember_list(urllib.parse.urlsplit(h.path).path, raw)
                _answer(h, resp.status, None, raw=raw)
                return
            missed = self._missed(urllib.parse.urlsplit(h.path).path) if resumed else []
            self._stream(h, resp, cut, missed)
        except (BrokenPipeError, ConnectionResetError):  # the client went away
            pass
        finally:
            conn.close()

    def _remember_list(self, path: str, raw: bytes) -> None:
        try:
            items = json.loads(raw).get("items") or []
        except (ValueError, AttributeError):
            return
        with self.lock:
            self._shown[path] = {_key(o): o for o in items if isinstance(o, dict)}

    def _missed(self, path: str) -> list[dict[str, Any]]:
        """DELETED events for what the client was shown under ``path`` and is gone now."""
        conn = http.client.HTTPConnection(self.up.hostname, self.up.port, timeout=30)
        try:
            conn.request("GET", path)
            now = json.loads(conn.getresponse().read()).get("items") or []
        finally:
            conn.close()
        present = {_key(o) for o in now}
        with self.lock:
            shown = self._shown.get(path, {})
            return [
                {"type": "DELETED", "object": obj} for k, obj in shown.items() if k not in present
            ]

    def _stream(
        self,
        h: BaseHTTPRequestHandler,
        resp: http.client.HTTPResponse,
        cut: bool,
        missed: list[dict[str, Any]],
    ) -> None:
        path = urllib.parse.urlsplit(h.path).path
        _start_chunked(h)
        with self.lock:
            version = str(next(self._version))
        bookmark = {"type": "BOOKMARK", "object": {"metadata": {"resourceVersion": version}}}
        _chunk(h, json.dumps(bookmark).encode() + b"\n")
        self.seen.add("bookmark")
        if missed:
            self.seen.add("deletion replayed")
        replay = iter(json.dumps(e).encode() + b"\n" for e in missed)
        while line := next(replay, None) or resp.readline():
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self._stamp(event.get("object"))
                obj = event.get("object")
                shown = self._shown.setdefault(path, {})
                if isinstance(obj, dict) and event.get("type") == "DELETED":
                    shown.pop(_key(obj), None)
                elif isinstance(obj, dict) and event.get("type") in ("ADDED", "MODIFIED"):
                    shown[_key(obj)] = obj
            _chunk(h, json.dumps(event).encode() + b"\n")
            if cut:  # half a line, and the connection gone without the last chunk
                self.seen.add("cut mid-line")
                _chunk(h, b'{"type": "MODIFIED", "object": {"kind": "Po')
                return
        _chunk(h, b"")  # the server ended the watch (its timeoutSeconds)


def _key(obj: dict[str, Any]) -> str:
    meta = obj.get("metadata") or {}
    return f"{meta.get('namespace') or ''}/{meta.get('name') or ''}"


def _status(code: int, reason: str = "", message: str = "") -> dict[str, Any]:
    reasons = {410: "Expired", 429: "TooManyRequests", 500: "InternalError"}
    s: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "status": "Failure",
        "code": code,
        "reason": reason or reasons.get(code, "ServiceUnavailable"),
        "message": message or f"the chaos proxy answers {code}",
    }
    if code == 429:
        s["details"] = {"retryAfterSeconds": 1}
    return s


def _without(path: str, key: str) -> str:
    parts = urllib.parse.urlsplit(path)
    query = [(k, v) for k, v in urllib.parse.parse_qsl(parts.query) if k != key]
    return urllib.parse.urlunsplit(parts._replace(query=urllib.parse.urlencode(query)))


def _answer(
    h: BaseHTTPRequestHandler,
    code: int,
    obj: Any,
    *,
    raw: bytes | None = None,
    retry_after: str | None = None,
) -> None:
    data = raw if raw is not None else json.dumps(obj).encode()
    h.send_response(code)
    h.send_header("Content-Type", "application/json")
    h.send_header("Content-Length", str(len(data)))
    h.send_header("Connection", "close")
    if retry_after:
        h.send_header("Retry-After", retry_after)
    h.end_headers()
    h.wfile.write(data)


def _start_chunked(h: BaseHTTPRequestHandler) -> None:
    h.send_response(200)
    h.send_header("Content-Type", "application/json")
    h.send_header("Transfer-Encoding", "chunked")
    h.send_header("Connection", "close")
    h.end_headers()


def _chunk(h: BaseHTTPRequestHandler, data: bytes) -> None:
    """One chunk of a chunked body (empty: the last one)."""
    h.wfile.write(f"{len(data):x}\r\n".encode() + data + b"\r\n")
    h.wfile.flush()


def _lines(h: BaseHTTPRequestHandler, events: list[dict[str, Any]]) -> None:
    _start_chunked(h)
    for e in events:
        _chunk(h, json.dumps(e).encode() + b"\n")
    _chunk(h, b"")
