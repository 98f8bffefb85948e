"""The thin seam over the official ``kubernetes`` client: plain dicts in and out.

Responses are used as raw JSON (``_preload_content=False`` / ``deserialize=False``): the pure
classifier reads dicts, and the client's model classes are never needed. Selectors are applied
client-side as well (a real API server filters, the emulator used in tests does not; filtering
twice is harmless).
"""

from __future__ import annotations

import contextlib
import json
import math
import queue
import random
import threading
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from typing import Any

from tasks.backends.eks.lines import CUT, LineBuffer
from tasks.backends.eks.watch import backoff_s

JOB_NAME_LABEL = "batch.kubernetes.io/job-name"
# The longest line held of a rank's log (a longer one is passed on cut), and of a watch's
# events (etcd stores no object over 1.5 MiB: a longer line is no event, dropped).
LOG_LINE_CAP = 64 << 10
WATCH_LINE_CAP = 4 << 20


def _json(resp: Any) -> Any:
    return json.loads(resp.data)


# (connect, read) seconds for every API call that does not set its own (watches and log follows
# do): without one a stalled connection to the API server blocks the flow past every deadline.
REQUEST_TIMEOUT_S = (10.0, 60.0)

# What an API server answers on an ordinary bad day: 429 (API Priority and Fairness throttling,
# with Retry-After), 500/502/503/504 (a control-plane replica restarting, the load balancer in
# front of them, etcd leader election), or no answer at all (a reset connection). A call is
# retried on those, jittered, at most CALL_TRIES times and CALL_BUDGET_S of waiting; anything
# else (403, 404, 409, 422) is an answer and goes to the caller at once.
TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
CALL_TRIES = 6
CALL_BUDGET_S = 30.0


def retry_wait(
    tries: int,
    status: int | None,
    retry_after_s: float | None,
    *,
    waited_s: float,
    rand: Callable[[], float] = random.random,
) -> float | None:
    """Seconds to wait before trying a failed call again, or None to give up: ``tries`` failures
    so far, the last answered ``status`` (None: no answer, 0: the client's own TLS error)."""
    if (status is not None and status not in TRANSIENT_STATUS) or tries >= CALL_TRIES:
        return None
    wait = backoff_s(tries, retry_after_s=retry_after_s, rand=rand)
    # A Retry-After past the budget: the caller's own deadline decides.
    return None if waited_s + wait > CALL_BUDGET_S else wait


def with_request_timeout(api_client: Any, *, sleep: Callable[[float], None] = time.sleep) -> Any:
    """Give every call through ``api_client`` a request timeout (``REQUEST_TIMEOUT_S``) and
    bounded retries of transient answers (:func:`retry_wait`) unless it sets its own timeout
    (a watch or a log follow: their loops resume and back off themselves). One seam for the
    generated API classes (batch, core, apps, storage, authorization, networking), whose
    methods all end in ``ApiClient.call_api``. A create retried after an answer that never
    arrived may find its object made (409): ``Kube.apply`` patches then, so it is idempotent."""
    import urllib3
    from kubernetes.client import ApiException

    call = api_client.call_api

    def call_api(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("_request_timeout") is not None:
            return call(*args, **kwargs)
        kwargs["_request_timeout"] = REQUEST_TIMEOUT_S
        tries, waited = 0, 0.0
        while True:
            try:
                return call(*args, **kwargs)
            except ApiException as e:
                status: int | None = e.status
                retry_after, error = _retry_after(e), e
            except (urllib3.exceptions.HTTPError, ConnectionError) as e:
                if _timed_out(e):  # its own bound spent: a silent server is not waited on again
                    raise
                status, retry_after, error = None, None, e
            tries += 1
            wait = retry_wait(tries, status, retry_after, waited_s=waited)
            if wait is None:
                raise error
            sleep(wait)
            waited += wait

    api_client.call_api = call_api
    return api_client


class Kube:
    def __init__(self, api_client: Any) -> None:
        from kubernetes import client

        api_client = with_request_timeout(api_client)

        self.core = client.CoreV1Api(api_client)
        self.batch = client.BatchV1Api(api_client)
        self.apps = client.AppsV1Api(api_client)
        self.storage = client.StorageV1Api(api_client)
        self.authz = client.AuthorizationV1Api(api_client)
        self.networking = client.NetworkingV1Api(api_client)
        self._exc = client.ApiException

    @classmethod
    def from_environment(cls) -> Kube:
        """In-cluster config when running in a pod, else the local kubeconfig."""
        from kubernetes import client, config

        try:
            config.load_incluster_config()
        except config.ConfigException:
            config.load_kube_config()
        return cls(client.ApiClient())

    @contextlib.contextmanager
    def _missing_ok(self) -> Iterator[None]:
        """A 404 is an answer: the object is gone (or the emulator lacks the resource)."""
        try:
            yield
        except self._exc as e:
            if e.status != 404:
                raise

    # -- apply / delete ----------------------------------------------------------------------
    def apply(self, obj: dict[str, Any]) -> None:
        """Create, or patch when it exists (same run + attempt -> same name: idempotent)."""
        ns, name, kind = obj["metadata"]["namespace"], obj["metadata"]["name"], obj["kind"]
        create, patch = {
            "Job": (self.batch.create_namespaced_job, self.batch.patch_namespaced_job),
            "Service": (self.core.create_namespaced_service, self.core.patch_namespaced_service),
            "NetworkPolicy": (
                self.networking.create_namespaced_network_policy,
                self.networking.patch_namespaced_network_policy,
            ),
            "ConfigMap": (
                self.core.create_namespaced_config_map,
                self.core.patch_namespaced_config_map,
            ),
        }[kind]
        try:
            create(ns, obj, _preload_content=False)
        except self._exc as e:
            if e.status != 409:
                raise
            patch(name, ns, obj, _preload_content=False)

    def delete_job(self, ns: str, name: str) -> None:
        """The Job and what was rendered with it under the same name (Service, ConfigMap,
        NetworkPolicy). The policy goes last; the Job's pods still end in the background (grace
        period) after it, which is harmless: nothing new can join a deleted Job."""
        for fn in (
            self.batch.delete_namespaced_job,
            self.core.delete_namespaced_service,
            self.core.delete_namespaced_config_map,
            self.networking.delete_namespaced_network_policy,
        ):
            with self._missing_ok():
                fn(name, ns, propagation_policy="Background", _preload_content=False)

    def delete_pod(self, ns: str, name: str, *, grace_s: int = 0) -> None:
        """Delete a pod: at once (grace period 0), as a lost node's pods go (the node-loss
        drill), or with a grace, as an eviction's (its kubelet sends SIGTERM, then SIGKILL
        ``grace_s`` later). A pod already gone is fine."""
        with self._missing_ok():
            self.core.delete_namespaced_pod(
                name, ns, grace_period_seconds=grace_s, _preload_content=False
            )

    def cordon(self, node: str) -> None:
        """Mark Kubernetes Node ``node`` unschedulable (``kubectl cordon``): a node confirmed
        slow takes no pod of the next attempt or of the Job's replacement. Its running pods
        stay; nothing else about it changes. A node already gone is fine."""
        with self._missing_ok():
            self.core.patch_node(node, {"spec": {"unschedulable": True}}, _preload_content=False)

    # -- reads ---------------------------------------------------------------------------------
    def read_job(self, ns: str, name: str) -> dict[str, Any] | None:
        with self._missing_ok():
            return dict(_json(self.batch.read_namespaced_job(name, ns, _preload_content=False)))
        return None

    def _labelled(self, list_fn: Any, ns: str, key: str, value: str) -> list[dict[str, Any]]:
        """The objects of ``list_fn`` in ``ns`` carrying label ``key=value`` (the selector is
        re-checked here: an emulator may ignore it)."""
        items, selector = [], f"{key}={value}"
        with self._missing_ok():  # an emulator without the resource yet: none
            items = _json(list_fn(ns, label_selector=selector, _preload_content=False))["items"]
        return [o for o in items if (o["metadata"].get("labels") or {}).get(key) == value]

    def jobs_labelled(self, ns: str, key: str, value: str) -> list[str]:
        """Names of the Jobs carrying label ``key=value`` (e.g. every attempt of one run)."""
        return sorted(
            j["metadata"]["name"]
            for j in self._labelled(self.batch.list_namespaced_job, ns, key, value)
        )

    def job_pods(self, ns: str, job: str) -> list[dict[str, Any]]:
        return self._labelled(self.core.list_namespaced_pod, ns, JOB_NAME_LABEL, job)

    def nodes(self) -> list[dict[str, Any]]:
        return list(_json(self.core.list_node(_preload_content=False))["items"])

    def follow_log(
        self,
        ns: str,
        pod: str,
        on_line: Callable[[str], None],
        stop: threading.Event,
        *,
        container: str = "trainer",
        read_timeout_s: float = 60.0,
    ) -> None:
        """Stream the container's log lines into ``on_line`` until ``stop`` (a thread body).

        ``follow=true`` keeps one connection open; when it drops (API server restart, idle
        read timeout, the container restarting) it is reopened with ``sinceSeconds`` reaching
        back past the last line seen, and the kubelet's timestamps drop the overlap, so no
        line is delivered twice and none is skipped. Best effort: logs are for people, the
        run's outcome never depends on them."""
        last: datetime | None = None
        while not stop.is_set():
            kwargs: dict[str, Any] = {
                "container": container,
                "follow": "true",  # literal, as in watch(): the client would send "True"
                "timestamps": "true",
                "_preload_content": False,
                "_request_timeout": (5, read_timeout_s),
            }
            if last is not None:
                behind = (datetime.now(UTC) - last).total_seconds()
                kwargs["since_seconds"] = max(1, math.ceil(behind) + 1)
            try:
                resp = self.core.read_namespaced_pod_log(pod, ns, **kwargs)
                buf = LineBuffer(LOG_LINE_CAP)
                for chunk in resp.stream(4096):
                    for raw in buf.feed(chunk):
                        ts, _, text = raw.decode(errors="replace").partition(" ")
                        try:
                            when = datetime.fromisoformat(ts)
                        except ValueError:  # not a timestamped line: deliver as is
                            on_line(raw.decode(errors="replace"))
                            continue
                        if last is not None and when <= last:
                            continue  # overlap of a reopened stream
                        last = when
                        on_line(text)
                    if stop.is_set():
                        break
                resp.release_conn()
            except Exception:  # not started yet, gone, connection dropped: retry
                pass
            stop.wait(1.0)

    # -- watches -------------------------------------------------------------------------------
    def watch(
        self,
        what: str,
        ns: str,
        out: queue.Queue[tuple[str, str, dict[str, Any]]],
        stop: threading.Event,
        *,
        timeout_s: int = 30,
        min_interval_s: float = 0.5,
    ) -> None:
        """Stream ``(what, type, object)`` into ``out`` until ``stop``, as the API server defines
        a watch (``tasks.backends.eks.watch``): list, then watch from the list's
        resourceVersion with bookmarks; resume from the last version when a watch ends; on
        ``410 Gone`` (an ``ERROR`` event or the answer to the request) list again; on any other
        error back off (jittered, bounded, ``Retry-After`` honoured) and resume. Only objects of
        the watched kind reach ``out``: an ``ERROR`` event's ``Status`` or a bad line never does.
        A list's items are passed on as ``ADDED`` (the caller's history dedupes by time, so a
        replay is harmless), and what it no longer shows as ``DELETED``."""
        from tasks.backends.eks.watch import Step, WatchCursor, backoff_s, relist_wait_s

        func, args = (
            (self.core.list_namespaced_pod, (ns,)) if what == "pod" else (self.core.list_node, ())
        )
        cursor = WatchCursor("Pod" if what == "pod" else "Node")
        relist, last_open, retry_after = True, -math.inf, None
        while not stop.is_set():
            # At least min_interval_s between opens, and after a failure at least that long
            # after it too (the client's own retry of a 429 may have taken the interval).
            since = time.monotonic() - last_open
            wait = max(
                backoff_s(cursor.failures, retry_after_s=retry_after),
                relist_wait_s(cursor.relists) if relist else 0.0,
                min_interval_s - since,
                min_interval_s if cursor.failures else 0.0,
            )
            if wait > 0 and stop.wait(wait):
                return
            last_open, retry_after = time.monotonic(), None
            resp = None
            try:
                if relist:
                    for d in cursor.on_list(_json(func(*args, _preload_content=False))):
                        if d.obj is not None:
                            out.put((what, d.type, d.obj))
                    relist = False
                kwargs: dict[str, Any] = {
                    # Literal "true"s: the client would send "True" for a bool, which some
                    # servers (and the emulator in the tests) do not take as a watch request.
                    "watch": "true",
                    "allow_watch_bookmarks": "true",
                    "timeout_seconds": timeout_s,
                    "_preload_content": False,
                    "_request_timeout": timeout_s + 5,
                }
                if cursor.version and cursor.version.isdigit():
                    kwargs["resource_version"] = cursor.version
                resp = func(*args, **kwargs)
                ended = self._stream(resp, what, cursor, out, stop)
                if ended is None:  # the server closed it (its timeoutSeconds): resume at once
                    cursor.failures = 0
                elif ended.step is Step.RELIST:
                    relist = True
                    cursor.relists += 1
                else:
                    cursor.failures += 1
                    retry_after = ended.retry_after_s
            except self._exc as e:
                if e.status == 410:
                    relist = True
                    cursor.relists += 1
                else:
                    cursor.failures += 1
                    retry_after = _retry_after(e)
            except Exception:  # connection reset, read timeout: resume from the version held
                cursor.failures += 1
            finally:
                if resp is not None:
                    with contextlib.suppress(Exception):
                        resp.release_conn()

    @staticmethod
    def _stream(
        resp: Any,
        what: str,
        cursor: Any,
        out: queue.Queue[tuple[str, str, dict[str, Any]]],
        stop: threading.Event,
    ) -> Any:
        """Pass one watch response's objects on; the decision that ended it early (a relist or
        a back-off), or None when the server closed it."""
        from tasks.backends.eks.watch import Step

        buf = LineBuffer(WATCH_LINE_CAP)
        for chunk in resp.stream(4096):
            if stop.is_set():
                return None
            for line in buf.feed(chunk):
                if not line.strip():
                    continue
                if line.endswith(CUT):  # no object is that large: never parsed
                    cursor.dropped["line too long"] = cursor.dropped.get("line too long", 0) + 1
                    continue
                d = cursor.on_line(line)
                if d.step is Step.EMIT and d.obj is not None:
                    out.put((what, d.type, d.obj))
                elif d.step in (Step.RELIST, Step.BACKOFF):
                    return d
        if buf.rest().strip():  # a stream cut mid-line: the partial line is dropped, not parsed
            cursor.dropped["cut mid-line"] = cursor.dropped.get("cut mid-line", 0) + 1
        return None


def _timed_out(e: BaseException) -> bool:
    import urllib3

    timeout = (urllib3.exceptions.TimeoutError, TimeoutError)
    return isinstance(e, timeout) or isinstance(getattr(e, "reason", None), timeout)


def _retry_after(e: Any) -> float | None:
    """An ApiException's Retry-After header, in seconds."""
    raw = (getattr(e, "headers", None) or {}).get("Retry-After")
    try:
        return float(raw) if raw else None
    except (TypeError, ValueError):
        return None


def iter_queue(q: queue.Queue[Any]) -> Iterator[Any]:
    while True:
        try:
            yield q.get_nowait()
        except queue.Empty:
            return
