"""Leader election with a ``coordination.k8s.io/v1`` Lease, as client-go's leaderelection does it.

Several replicas may run; one leads and reconciles, the others wait as warm standbys. The Lease
records ``holderIdentity``, ``leaseDurationSeconds``, ``acquireTime``, ``renewTime`` and
``leaseTransitions``; every write is a PUT with the resourceVersion read just before, so two
candidates racing for an expired lease cannot both win (the loser gets 409 Conflict).

Expiry is judged by the candidate's own clock from when it last saw the record change (not from
the ``renewTime`` written by another machine), so clock skew between nodes cannot make a
standby take over a live leader. The leader renews every ``retry_period``; when it has not
renewed for ``renew_deadline`` it stops leading (before the lease can expire for others, since
``renew_deadline < lease_duration``), and the process exits so the Deployment restarts it as a
standby. On a clean shutdown the leader releases the lease so a standby takes over at once.

An API server that cannot be reached, or answers 5xx, is a failed attempt like any other (the
client retries with backoff first): a candidate keeps trying, a leader steps down once its renew
deadline passes. An answer that says it may not use its Lease (401/403) is not a passing
outage: it is logged as an error (then every ``ERROR_LOG_SECONDS``), reported to ``on_error``
(the controller counts it), and kept in ``problem`` for readiness, which fails once it has
lasted ``unready_after`` seconds.
"""

from __future__ import annotations

import datetime
import logging
import threading
import time
from typing import Any, Callable, Optional

from xmem_admission.cluster.kube.client import Kube, Obj
from xmem_admission.contract.errors import KubeApiError, KubeUnavailable

log = logging.getLogger(__name__)

ERROR_LOG_SECONDS = 30.0


def micro_time(when: datetime.datetime) -> str:
    """``metav1.MicroTime``: RFC 3339 with microseconds."""
    return when.strftime("%Y-%m-%dT%H:%M:%S.%fZ")


class LeaderElector:
    """See the module docstring."""

    def __init__(self, kube: Kube, namespace: str, name: str, identity: str,
                 lease_duration: float = 15.0, renew_deadline: float = 10.0,
                 retry_period: float = 2.0,
                 clock: Callable[[], float] = time.monotonic,
                 on_error: Optional[Callable[[str], Any]] = None,
                 unready_after: float = 30.0) -> None:
        if not renew_deadline < lease_duration:
            raise ValueError("renew_deadline must be shorter than lease_duration")
        self.kube = kube
        self.namespace = namespace
        self.name = name
        self.identity = identity
        self.lease_duration = lease_duration
        self.renew_deadline = renew_deadline
        self.retry_period = retry_period
        self.clock = clock
        self.transitions = 0
        self._observed: Optional[str] = None  # the record we last saw (holder, renewTime)
        self._observed_at = 0.0
        self._renewed_at: Optional[float] = None
        self.on_error = on_error
        self.unready_after = unready_after
        self.problem: Optional[str] = None  # why the Lease cannot be used, while it cannot
        self._problem_since: Optional[float] = None
        self._problem_logged = -ERROR_LOG_SECONDS

    @property
    def blocked(self) -> bool:
        """True when the Lease has been refused to this candidate for a while: it will never
        lead until someone fixes its permissions (readiness says so)."""
        return self._problem_since is not None and \
            self.clock() - self._problem_since >= self.unready_after

    def _refused(self, action: str, exc: KubeApiError) -> bool:
        """A write or read the API refused; loud when it is about permissions. False."""
        if exc.status in (401, 403):
            self.problem = f"cannot {action} Lease {self.namespace}/{self.name}: {exc}"
            if self._problem_since is None:
                self._problem_since = self.clock()
            if self.clock() - self._problem_logged >= ERROR_LOG_SECONDS:
                self._problem_logged = self.clock()
                log.error("%s (check the controller's RBAC and --lease-name/--lease-namespace)",
                          self.problem)
            if self.on_error is not None:
                self.on_error(str(exc.status))
        else:
            log.debug("lease %s/%s: %s %s", self.namespace, self.name, action, exc)
        return False

    def _fine(self) -> None:
        self.problem = None
        self._problem_since = None

    @property
    def leading(self) -> bool:
        """True while the last successful renewal is younger than the renew deadline."""
        return self._renewed_at is not None and \
            self.clock() - self._renewed_at < self.renew_deadline

    def _now(self) -> datetime.datetime:
        return datetime.datetime.now(datetime.timezone.utc)

    def try_acquire_or_renew(self) -> bool:
        """One attempt; True when this candidate holds the lease afterwards."""
        try:
            return self._attempt()
        except KubeUnavailable as exc:
            log.warning("lease %s/%s: the API server is unavailable: %s", self.namespace,
                        self.name, exc)
            return False

    def _attempt(self) -> bool:
        now = self._now()
        try:
            lease = self.kube.read_lease(self.namespace, self.name)
        except KubeApiError as exc:
            if not exc.not_found:
                return self._refused("read", exc)
            body = {"apiVersion": "coordination.k8s.io/v1", "kind": "Lease",
                    "metadata": {"name": self.name, "namespace": self.namespace},
                    "spec": self._spec(now, now, 0)}
            try:
                self.kube.create_lease(self.namespace, body)
            except KubeApiError as exc:
                return self._refused("create", exc)
            self._fine()
            return self._won()
        self._fine()
        spec = lease.get("spec") or {}
        holder = spec.get("holderIdentity") or ""
        record = f"{holder}|{spec.get('renewTime')}|{spec.get('leaseTransitions')}"
        if record != self._observed:
            self._observed, self._observed_at = record, self.clock()
        duration = float(spec.get("leaseDurationSeconds") or self.lease_duration)
        if holder and holder != self.identity and self.clock() < self._observed_at + duration:
            self._renewed_at = None
            return False
        transitions = int(spec.get("leaseTransitions") or 0)
        acquired = spec.get("acquireTime") if holder == self.identity else None
        if holder != self.identity:
            transitions += 1
        new = dict(lease, spec=self._spec(now, None, transitions, acquired))
        try:
            self.kube.replace_lease(new)
        except KubeApiError as exc:
            return self._refused("update", exc)
        self.transitions = transitions
        return self._won()

    def _spec(self, now: datetime.datetime, acquire: Optional[datetime.datetime],
              transitions: int, acquired: Optional[str] = None) -> Obj:
        return {"holderIdentity": self.identity,
                "leaseDurationSeconds": int(self.lease_duration),
                "acquireTime": acquired or micro_time(acquire or now),
                "renewTime": micro_time(now), "leaseTransitions": transitions}

    def _won(self) -> bool:
        self._renewed_at = self.clock()
        return True

    def release(self) -> None:
        """Give the lease up (clean shutdown): a standby may take it without waiting."""
        if self._renewed_at is None:
            return
        try:
            lease = self.kube.read_lease(self.namespace, self.name)
            spec = lease.get("spec") or {}
            if spec.get("holderIdentity") != self.identity:
                return
            spec = dict(spec, holderIdentity="", leaseDurationSeconds=1,
                        renewTime=micro_time(self._now()))
            self.kube.replace_lease(dict(lease, spec=spec))
        except (KubeApiError, KubeUnavailable) as exc:
            log.warning("could not release the lease: %s", exc)
        self._renewed_at = None

    def run(self, stop: threading.Event, on_started: Callable[[], Any],
            on_stopped: Callable[[], Any]) -> bool:
        """Acquire, call ``on_started``, keep renewing; ``on_stopped`` and False when lost.

        Returns True when ``stop`` was set (a clean shutdown), after releasing the lease.
        """
        while not stop.is_set():
            if self.try_acquire_or_renew():
                break
            stop.wait(self.retry_period)
        if stop.is_set():
            return True
        log.info("%s leads (lease %s/%s)", self.identity, self.namespace, self.name)
        on_started()
        while not stop.wait(self.retry_period):
            if self.try_acquire_or_renew():
                continue
            if not self.leading:
                log.error("%s lost the lease %s/%s", self.identity, self.namespace, self.name)
                on_stopped()
                return False
        on_stopped()
        self.release()
        return True
