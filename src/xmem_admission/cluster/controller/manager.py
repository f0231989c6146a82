"""The controller's moving parts, wired: caches, queue, workers, resync, leadership, health.

``Controller.start()`` starts the informers (held-workload kinds, GPUMemoryEstimates, estimation
pods), waits for their first lists, then the workers that drain the queue and a resync loop
that re-queues every held workload and unfinished estimate (deadlines, missed events), reloads
the policy and refreshes the gauges. ``run()`` does that under leader election: only the replica
holding the Lease reconciles; losing it stops the controller and makes ``run()`` return False
(``xmem controller`` then exits non-zero and the Deployment restarts it as a standby).

Errors per work item: a 409 or 404 (someone wrote or deleted the object) retries at once from
fresh state; an unavailable API (429/5xx outlasting the client's retries) retries with a
per-item exponential backoff; anything else is logged, counted and retried in a few seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import (
    admission_checks,
    dra_claims,
    estimate_cache,
    estimation_line,
    estimation_pods,
    learned_overhead,
    observed_peaks,
    oom_retries,
    policy_status,
    records,
    scope,
    workloads,
)
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.controller.metrics import ControllerMetrics
from xmem_admission.cluster.integrations import ALL as INTEGRATIONS
from xmem_admission.cluster.integrations import Integration
from xmem_admission.cluster.kube.client import CONFIG_MAP, GME, POD, Kube, Obj
from xmem_admission.cluster.kube.informer import Informer, WorkQueue
from xmem_admission.cluster.kube.leader import LeaderElector
from xmem_admission.contract.errors import KubeApiError, KubeUnavailable

log = logging.getLogger(__name__)

# The kinds the controller can release: every registered integration that can be held.
KINDS: Dict[str, Integration] = {i.kind: i for i in INTEGRATIONS if i.can_hold}
# ("workload", kind, namespace, name), ("estimate", namespace, name), ("oom", namespace, pod)
# for a sized workload's pod that ran out of GPU memory, ("ended", kind, namespace, name) for a
# sized workload that finished (``observed_peaks``), and with Kueue ("kueue", namespace,
# name) for a Kueue Workload, ("check", name) for an AdmissionCheck; ("overhead",) learns the
# memory outside the allocator from every namespace's finished runs (``learned_overhead``);
# ("collect",) deletes estimates unused past their TTL, ("used", kind, namespace, name) records
# the use of a workload sized at CREATE, ("image", namespace, pod) compares a sized pod's image
# digest with its estimate's (``estimate_cache``); ("dispatch",) grants free estimation pod
# slots to the estimates whose turn it is (``estimation_line``).
QueueKey = Tuple[Any, ...]
POD_SELECTOR = f"{records.MANAGED_BY[0]}={records.MANAGED_BY[1]},{records.COMPONENT[0]}={records.COMPONENT[1]}"
# The pods of workloads xmem sizes: the webhook copies the opt-in label into their templates.
SIZED_POD_SELECTOR = f"{labels.OPT_IN}={labels.OPT_IN_VALUE}"


def ahead(key: QueueKey) -> bool:
    """Work that moves estimations on goes ahead of held workloads not looked at yet: the
    cluster-wide items (the dispatch) and an estimate's reconcile (its pod, its result)."""
    return len(key) == 1 or key[0] == "estimate"


class Controller:
    """See the module docstring."""

    def __init__(self, kube: Kube, policy: Any, probe_image: str,
                 kinds: Sequence[str] = tuple(KINDS),
                 metrics: Optional[ControllerMetrics] = None, identity: str = "xmem-controller",
                 workers: int = 2, resync_seconds: float = 30.0, sync_timeout: float = 30.0,
                 log_lines: int = 20, deadline_slack: float = 60.0,
                 policy_seconds: float = 2.0, kueue_check: Optional[str] = None) -> None:
        self.kube = kube
        self.metrics = metrics or ControllerMetrics()
        self.queue: WorkQueue[QueueKey] = WorkQueue(first=ahead)
        self.workers = workers
        self.resync_seconds = resync_seconds
        self.policy_seconds = policy_seconds
        self.sync_timeout = sync_timeout
        self.policy = policy
        self._stop = threading.Event()
        self._threads: List[threading.Thread] = []
        self._failures: Dict[QueueKey, int] = {}
        self.running = threading.Event()
        kinds_map: Dict[str, Workload] = {}
        # Workloads are cached only where the controller may act on them (``scope``).
        self.namespaces = scope.OptedInNamespaces(kube, self._relist_workloads)
        for kind in kinds:
            integration = KINDS[kind]
            kinds_map[kind] = Workload(integration, Informer(
                kube, integration.resource, self._on_workload(kind),
                keep=self.namespaces.wanted))
        self.ctx = Context(
            kube=kube, policy=policy, workloads=kinds_map,
            estimates=Informer(kube, GME, self._on_estimate),
            pods=Informer(kube, POD, self._on_pod, label_selector=POD_SELECTOR),
            queue=self.queue, metrics=self.metrics, probe_image=probe_image, identity=identity,
            log_lines=log_lines, deadline_slack=deadline_slack,
            sized_pods=Informer(kube, POD, self._on_sized_pod,
                                label_selector=SIZED_POD_SELECTOR),
            devices=dra_claims.DeviceView.of(kube),
            config_maps=Informer(kube, CONFIG_MAP, metadata_only=True),
        )
        # Kueue's AdmissionCheck (admission_checks), served under this controllerName when set.
        self.kueue_check = kueue_check
        self.kueue_workloads: Optional[Informer] = None
        self.admission_checks: Optional[Informer] = None
        if kueue_check:
            self.kueue_workloads = Informer(kube, admission_checks.WORKLOAD, self._on_kueue)
            self.admission_checks = Informer(kube, admission_checks.ADMISSION_CHECK,
                                             self._on_check)

    # --- events -> work ---------------------------------------------------------------------

    def _on_workload(self, kind: str) -> Any:
        def handler(type_: str, obj: Obj) -> None:
            m = obj["metadata"]
            if type_ == "DELETED":
                self.ctx.line.forget(obj)
            else:
                self.ctx.line.saw(obj)  # the order of arrival, within a creation second
            if workloads.is_held(obj):
                self.queue.add(("workload", kind, m.get("namespace", ""), m["name"]))
                return
            if type_ != "DELETED" and dra_claims.wants(self.ctx, kind, obj):
                self.queue.add(("claims", kind, m.get("namespace", ""), m["name"]))
            if type_ != "DELETED" and observed_peaks.wants(self.ctx, kind, obj):
                self.queue.add(("ended", kind, m.get("namespace", ""), m["name"]))
            if type_ == "ADDED" and estimate_cache.sized_at_create(obj):
                self.queue.add(("used", kind, m.get("namespace", ""), m["name"]))
        return handler

    def _on_estimate(self, _type: str, gme: Obj) -> None:
        m = gme["metadata"]
        self.queue.add(("estimate", m.get("namespace", ""), m["name"]))
        estimation_line.wake(self.ctx)
        estimate_cache.wake(self.ctx, gme)
        self._wake_kueue(gme)

    def _on_kueue(self, _type: str, wl: Obj) -> None:
        m = wl["metadata"]
        self.queue.add(("kueue", m.get("namespace", ""), m["name"]))

    def _on_check(self, _type: str, check: Obj) -> None:
        self.queue.add(("check", check["metadata"]["name"]))
        if self.kueue_workloads is not None:  # workloads that waited for the check to be known
            for wl in self.kueue_workloads.items():
                self._on_kueue(_type, wl)

    def _wake_kueue(self, gme: Obj) -> None:
        """Queue the Kueue Workloads whose job waits on this estimate."""
        if self.kueue_workloads is None:
            return
        uids = {uid for _kind, _name, uid in estimate_cache.waiting(self.ctx, gme)}
        for wl in self.kueue_workloads.items():
            if any(ref.get("uid") in uids for ref in wl["metadata"].get("ownerReferences") or []):
                self._on_kueue("MODIFIED", wl)

    def _on_pod(self, _type: str, pod: Obj) -> None:
        m = pod["metadata"]
        for ref in m.get("ownerReferences") or []:
            if ref.get("kind") == GME.kind:
                self.queue.add(("estimate", m.get("namespace", ""), ref.get("name")))
                estimation_line.wake(self.ctx)  # a slot may have come free

    def _on_sized_pod(self, type_: str, pod: Obj) -> None:
        if type_ != "DELETED" and oom_retries.failure(pod) is not None:
            m = pod["metadata"]
            self.queue.add(("oom", m.get("namespace", ""), m["name"]))
        if type_ != "DELETED" and estimate_cache.runs_image(pod):
            m = pod["metadata"]
            self.queue.add(("image", m.get("namespace", ""), m["name"]))

    def _relist_workloads(self) -> None:
        for workload in self.ctx.workloads.values():
            workload.informer.relist()

    # --- lifecycle --------------------------------------------------------------------------

    def informers(self) -> List[Informer]:
        kueue: List[Informer] = [i for i in (self.admission_checks, self.kueue_workloads)
                                 if i is not None]
        sized = [self.ctx.sized_pods] if self.ctx.sized_pods is not None else []
        sized += [self.ctx.config_maps] if self.ctx.config_maps is not None else []
        # ResourceSlices and DeviceClasses: not waited for (a cluster without resource.k8s.io/v1
        # or without any DRA driver is no stop; the dra backend then writes unrounded claims).
        devices = self.ctx.devices.informers() if self.ctx.devices is not None else []
        return [self.namespaces.informer] + \
            [w.informer for w in self.ctx.workloads.values()] + [self.ctx.estimates,
                                                                    self.ctx.pods] + sized + \
            kueue + devices

    def start(self) -> Controller:
        self._stop.clear()
        self.queue.reopen()
        self.ctx.line.reset()  # grants and arrival order start over with the caches
        self.policy.refresh()
        # The opted-in namespaces first: the workload informers' first listing keeps by them.
        if not self.namespaces.informer.start().synced.wait(min(5.0, self.sync_timeout)):
            log.warning("namespaces not listed (%s); until they are, only workloads that carry "
                        "xmem's marks are served", self.namespaces.informer.error)
        self.namespaces.seal()
        for informer in self.informers()[1:]:
            informer.start()
        needed = [self.ctx.estimates, self.ctx.pods] + (
            [self.ctx.sized_pods] if self.ctx.sized_pods is not None else []) + (
            [self.ctx.config_maps] if self.ctx.config_maps is not None else [])
        for informer in needed:
            if not informer.synced.wait(self.sync_timeout):
                raise KubeUnavailable(f"could not list {informer.kind.plural}: {informer.error}")
        # An absent CRD (no PyTorchJob, no TrainJob) is no stop; all are waited for together.
        until = time.monotonic() + min(5.0, self.sync_timeout)
        for workload in self.ctx.workloads.values():
            if not workload.informer.synced.wait(max(0.0, until - time.monotonic())):
                log.warning("%s not available (%s); its workloads are not released until it is",
                            workload.kind.plural, workload.informer.error)
        for kueue in (self.admission_checks, self.kueue_workloads):
            if kueue is not None and not kueue.synced.wait(min(5.0, self.sync_timeout)):
                log.warning("Kueue's %s not available (%s); is Kueue installed? The "
                            "AdmissionCheck is served once it is", kueue.kind.plural, kueue.error)
        for index in range(self.workers):
            self._spawn(self._work, f"worker-{index}")
        self._spawn(self._resync, "resync")
        self._spawn(self._refresh_policy, "policy")
        self.running.set()
        self.metrics.leader.set(1)
        return self

    def _spawn(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=f"xmem-controller-{name}", daemon=True)
        thread.start()
        self._threads.append(thread)

    def stop(self) -> None:
        self._stop.set()
        self.queue.close()
        self.namespaces.unseal()
        for informer in self.informers():
            informer.stop()
        for thread in self._threads:
            thread.join(timeout=10)
        self._threads = []
        self.running.clear()
        self.metrics.leader.set(0)

    # --- work -------------------------------------------------------------------------------

    def _work(self) -> None:
        while not self._stop.is_set():
            key = self.queue.get(timeout=0.5)
            if key is None:
                continue
            try:
                delay = self.reconcile(key)
                self._failures.pop(key, None)
                if delay is not None and not self._stop.is_set():
                    self.queue.add(key, delay)
            except KubeApiError as exc:
                if exc.conflict or exc.already_exists or exc.not_found:
                    log.debug("%s: %s; starting over", key, exc)
                    self.queue.add(key, 0.05)
                else:
                    self._retry(key, exc)
            except KubeUnavailable as exc:
                self._retry(key, exc)
            except Exception as exc:  # noqa: BLE001 - one bad object must not stop the rest
                log.exception("reconcile %s failed", key)
                self._retry(key, exc)
            finally:
                self.queue.done(key)

    def _retry(self, key: QueueKey, exc: Exception) -> None:
        failures = self._failures.get(key, 0) + 1
        self._failures[key] = failures
        self.metrics.errors.labels(str(key[0])).inc()
        delay = min(0.2 * 2 ** failures, 30.0)
        log.warning("reconcile %s: %s; again in %.1fs", key, exc, delay)
        self.queue.add(key, delay)

    def reconcile(self, key: QueueKey) -> Optional[float]:
        """One reconcile of a queue key; the delay after which to look again, or None."""
        if key[0] == "overhead":
            if not self.ctx.estimates.synced.is_set():
                return 5.0
            return learned_overhead.reconcile(self.ctx)
        if key[0] == "dispatch":
            return estimation_line.dispatch(self.ctx)
        if key[0] == "collect":
            return estimate_cache.collect(self.ctx)
        if key[0] == "policy":
            return policy_status.reconcile(self.ctx)
        if key[0] in ("workload", "ended", "claims", "used"):
            _, kind, namespace, name = key
            if not self.ctx.workloads[kind].informer.synced.is_set():
                return 5.0
            if key[0] == "claims":
                return dra_claims.reconcile(self.ctx, kind, namespace, name)
            if key[0] == "ended":
                return observed_peaks.reconcile(self.ctx, kind, namespace, name)
            if key[0] == "used":
                return estimate_cache.reconcile_used(self.ctx, kind, namespace, name)
            return workloads.reconcile(self.ctx, kind, namespace, name)
        if key[0] in ("kueue", "check"):
            checks, queued = self.admission_checks, self.kueue_workloads
            assert checks is not None and queued is not None and self.kueue_check
            if not checks.synced.is_set() or not queued.synced.is_set():
                return 5.0
            if key[0] == "check":
                return admission_checks.reconcile_check(self.ctx, checks, self.kueue_check,
                                                        key[1])
            return admission_checks.reconcile(self.ctx, queued, checks, self.kueue_check,
                                              key[1], key[2])
        _, namespace, name = key
        if key[0] == "oom":
            return oom_retries.reconcile(self.ctx, namespace, name)
        if key[0] == "image":
            return estimate_cache.check_image(self.ctx, namespace, name)
        return estimation_pods.reconcile(self.ctx, namespace, name)

    def _refresh_policy(self) -> None:
        """The policy is re-read every ``policy_seconds`` (as ``xmem serve`` does), not only at
        resync: a change reaches the next estimation pod within seconds."""
        while not self._stop.wait(self.policy_seconds):
            self.policy.refresh()
            self.queue.add(("policy",))  # its status: a no-op while the verdict is unchanged

    def _resync(self) -> None:
        while not self._stop.wait(self.resync_seconds):
            self.resync()

    def resync(self) -> None:
        """Queue everything that may need attention; reload the policy; refresh the gauges."""
        self.policy.refresh()
        now = self.ctx.now()
        ages: Dict[str, List[float]] = {}
        for kind, workload in self.ctx.workloads.items():
            for obj in workload.informer.find(workloads.is_held):
                m = obj["metadata"]
                self.queue.add(("workload", kind, m.get("namespace", ""), m["name"]))
                ages.setdefault(kind, []).append(
                    (now - workloads.held_since(obj)).total_seconds())
        self.metrics.set_held(ages, tuple(self.ctx.workloads))
        for kind, workload in self.ctx.workloads.items():  # an end whose record a write lost
            for obj in workload.informer.items():
                if observed_peaks.wants(self.ctx, kind, obj):
                    m = obj["metadata"]
                    self.queue.add(("ended", kind, m.get("namespace", ""), m["name"]))
        if self.admission_checks is not None and self.kueue_workloads is not None:
            for check in self.admission_checks.items():
                self.queue.add(("check", check["metadata"]["name"]))
            pending = self.kueue_workloads.find(lambda wl: admission_checks.pending(
                wl, self.admission_checks, self.kueue_check or ""))
            for wl in pending:
                self._on_kueue("SYNC", wl)
        if self.ctx.sized_pods is not None:  # an OOM whose record a failed write lost
            for pod in self.ctx.sized_pods.find(lambda p: oom_retries.failure(p) is not None):
                self._on_sized_pod("SYNC", pod)
        counts: Dict[str, int] = {}
        for gme in self.ctx.estimates.items():
            m = gme["metadata"]
            if records.phase(gme) not in records.TERMINAL or estimation_pods.needs_summary(gme) \
                    or (gme.get("status") or {}).get("actualBytes") is not None:
                self.queue.add(("estimate", m.get("namespace", ""), m["name"]))
            for estimate in (gme.get("status") or {}).get("estimates") or []:
                counts[estimate.get("gpu", "")] = counts.get(estimate.get("gpu", ""), 0) + 1
        self.metrics.set_estimates(counts)
        for informer in self.informers():
            self.metrics.cached.labels(":".join(filter(None, (
                informer.kind.plural, informer.label_selector)))).set(len(informer))
        self.queue.add(("overhead",))
        self.queue.add(("collect",))
        self.queue.add(estimation_line.DISPATCH)

    # --- leadership -------------------------------------------------------------------------

    def run(self, stop: threading.Event, elector: Optional[LeaderElector]) -> None:
        """Reconcile until ``stop``. With an elector, only while leading: a leader that cannot
        renew (an API server down past the renew deadline) stops reconciling, stands by and
        leads again when it can take the Lease, from a fresh listing."""
        if elector is None:
            self.start()
            stop.wait()
            self.stop()
            return
        while not elector.run(stop, self.start, self.stop):
            self.metrics.leadership_lost.inc()
            log.error("%s stepped down; standing by to lead again", self.ctx.identity)


class HealthServer:
    """``/metrics``, ``/healthz`` and ``/readyz`` on a plain HTTP port."""

    def __init__(self, controller: Controller, host: str, port: int,
                 elector: Optional[LeaderElector] = None) -> None:
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002
                pass

            def do_GET(self) -> None:  # noqa: N802
                if self.path.startswith("/metrics"):
                    body = generate_latest(controller.metrics.registry)
                    self._send(200, body, CONTENT_TYPE_LATEST)
                elif self.path.startswith("/healthz"):
                    self._send(200, b"ok\n", "text/plain")
                elif self.path.startswith("/readyz"):
                    ok, text = owner.readiness()
                    self._send(200 if ok else 503, text.encode() + b"\n", "text/plain")
                else:
                    self._send(404, b"not found\n", "text/plain")

            def _send(self, code: int, body: bytes, kind: str) -> None:
                self.send_response(code)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

        self.controller = controller
        self.elector = elector
        self.server = ThreadingHTTPServer((host, port), Handler)
        self.server.daemon_threads = True
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True,
                                       name="xmem-controller-health")

    @property
    def port(self) -> int:
        return int(self.server.server_address[1])

    def readiness(self) -> Tuple[bool, str]:
        if self.controller.running.is_set():
            return True, "leading"
        if self.elector is not None and self.elector.blocked:
            return False, f"standby that can never lead: {self.elector.problem}"
        if self.elector is not None:
            return True, "standby"
        return False, "starting"

    def start(self) -> HealthServer:
        self.thread.start()
        return self

    def stop(self) -> None:
        self.server.shutdown()
        self.server.server_close()
