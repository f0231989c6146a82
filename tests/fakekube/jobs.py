"""The part of the Job controller an admission test needs: an unsuspended Job gets its pods.

A client of the API server like the real one: it watches Jobs and Pods, and for each Job that
is not suspended and has fewer active pods than its parallelism (and has not finished), creates
a Pod from ``spec.template`` (``generateName: <job>-``, the template's labels, an owner reference
with ``controller: true``). The Pod CREATE goes through the API server's admission chain, which
is where the webhook turns the estimate in the template's annotations into the backend's
resources. It also keeps ``status.startTime``, ``active``, ``succeeded`` and ``failed`` and the
``Complete``/``Failed`` conditions (failed pods are replaced up to ``backoffLimit``). Not
modelled: indexed completion, pod failure policies, ``activeDeadlineSeconds`` of the Job.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Dict, List, Optional

from tests.fakekube.apiserver import ApiServer
from tests.fakekube.objects import now
from tests.fakekube.rbac import service_account


class JobController:
    """See the module docstring."""

    def __init__(self, server: ApiServer, resync: float = 0.2) -> None:
        self.server = server
        self.resync = resync
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self.errors: List[str] = []  # pod creations the API refused (a webhook denial, ...)

    def start(self) -> JobController:
        from kubernetes import client

        # As the Job controller of kube-controller-manager (--use-service-account-credentials):
        # the user the webhook sees on the pods it creates.
        identity = service_account("kube-system", "job-controller", superuser=True)
        api_client = self.server.api_client(self.server.add_user(identity))
        self._batch = client.BatchV1Api(api_client)
        self._core = client.CoreV1Api(api_client)
        self._thread = threading.Thread(target=self._loop, name="standin-jobs", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def _loop(self) -> None:
        import json

        while not self._stop.is_set():
            try:
                jobs = json.loads(self._batch.list_job_for_all_namespaces(
                    _preload_content=False).data)["items"]
                for job in jobs:
                    self._sync(job)
            except Exception as exc:  # noqa: BLE001 - keep reconciling through API hiccups
                self.errors.append(str(exc))
            self._stop.wait(self.resync)

    def _sync(self, job: Dict[str, Any]) -> None:
        import json

        m = job["metadata"]
        spec, status = job["spec"], dict(job.get("status") or {})
        if "deletionTimestamp" in m or any(
                c.get("type") in ("Complete", "Failed") and c.get("status") == "True"
                for c in status.get("conditions") or []):
            return
        pods = [p for p in json.loads(self._core.list_namespaced_pod(
            m["namespace"], label_selector=f"batch.kubernetes.io/controller-uid={m['uid']}",
            _preload_content=False).data)["items"]
            if any(r.get("uid") == m["uid"] for r in p["metadata"].get("ownerReferences") or [])]
        phases = [(p.get("status") or {}).get("phase", "Pending") for p in pods]
        active = sum(1 for p in phases if p in ("Pending", "Running"))
        succeeded = phases.count("Succeeded")
        failed = phases.count("Failed")
        new = {"active": active, "succeeded": succeeded, "failed": failed}
        if succeeded >= int(spec.get("completions") or 1):
            new["conditions"] = [{"type": "Complete", "status": "True", "lastProbeTime": now(),
                                  "lastTransitionTime": now()}]
            new["completionTime"] = now()
        elif failed > int(spec.get("backoffLimit", 6)):
            new["conditions"] = [{"type": "Failed", "status": "True", "reason": "BackoffLimitExceeded",
                                  "message": "Job has reached the specified backoff limit",
                                  "lastProbeTime": now(), "lastTransitionTime": now()}]
        elif not spec.get("suspend") and active < int(spec.get("parallelism") or 1):
            self._create_pod(job)
            new["active"] = active + 1
            status.setdefault("startTime", now())
        if not spec.get("suspend") and "startTime" not in status and (pods or new["active"]):
            status["startTime"] = now()
        merged = dict(status, **new)
        if merged != (job.get("status") or {}):
            self._batch.patch_namespaced_job_status(m["name"], m["namespace"], {"status": merged},
                                                    _preload_content=False)

    def _create_pod(self, job: Dict[str, Any]) -> None:
        m = job["metadata"]
        template = job["spec"]["template"]
        meta = dict(template.get("metadata") or {})
        pod = {
            "apiVersion": "v1", "kind": "Pod",
            "metadata": {
                "generateName": f"{m['name']}-", "namespace": m["namespace"],
                "labels": dict(meta.get("labels") or {}),
                "annotations": dict(meta.get("annotations") or {}),
                "ownerReferences": [{"apiVersion": "batch/v1", "kind": "Job", "name": m["name"],
                                     "uid": m["uid"], "controller": True,
                                     "blockOwnerDeletion": True}],
            },
            "spec": template["spec"],
        }
        try:
            self._core.create_namespaced_pod(m["namespace"], pod, _preload_content=False)
        except Exception as exc:  # noqa: BLE001 - recorded; a real controller emits an Event
            self.errors.append(f"{m['namespace']}/{m['name']}: {exc}")
            time.sleep(self.resync)
