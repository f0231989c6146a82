"""The Kueue AdmissionCheck xmem serves (policy ``integration: Kueue``, ``docs/kueue.md``).

On a cluster that queues jobs with Kueue, Kueue owns the suspend flag: it unsuspends a job when
its ClusterQueue admits the job's ``Workload``. An AdmissionCheck is how an outside controller
takes part: a ClusterQueue lists checks, Kueue puts each into the Workload's
``status.admissionChecks`` as ``Pending`` as soon as the Workload has a ClusterQueue, before any
quota is reserved, and admits the Workload only
when every check is ``Ready``, applying the checks' ``podSetUpdates`` (labels, annotations, node
selectors, tolerations) to the job's pod templates as it starts it.

This module serves every AdmissionCheck whose ``spec.controllerName`` is ours
(``CONTROLLER_NAME``, or the one ``xmem controller --kueue-controller-name`` gives):

- the AdmissionCheck gets the ``Active`` condition (Kueue keeps workloads of a ClusterQueue
  whose checks are not active from being admitted);
- a Workload with one of our checks ``Pending`` is estimated like a held job, through the same
  steps (``gate``): its owner (the Job, PyTorchJob, JobSet or TrainJob, whose pod templates are
  the podSets; a TrainJob's resolved from its runtime) is fingerprinted, the
  ``GPUMemoryEstimate`` for that fingerprint is created or joined and its estimation pod runs
  (``estimation_pods``); a known fingerprint is ``Ready`` at once;
- succeeded: ``Ready``, with a podSetUpdate per GPU podSet carrying the sizing annotations
  (``xmem.io/request-bytes``, ``xmem.io/gpu-model``, ``xmem.io/estimate-bytes``) and the opt-in
  label ``xmem.io/estimate: "true"`` (so the job's pods reach the Pod webhook's object entry);
  the backend's request itself (HAMi's ``nvidia.com/gpumem``, a MIG profile's resource, a MIG
  node affinity) is written by the Pod webhook at Pod CREATE, as under the ``Suspend`` integration, because a
  podSetUpdate can change neither resources nor affinity. Keys a template already has are left
  out: Kueue refuses a podSetUpdate that conflicts with the template (``podset.Merge``);
- a workload an admin exempted (``xmem.io/break-glass`` in every GPU pod template, where
  only the webhook writes it for an honoured break-glass): ``Ready`` unchanged, not estimated;
- an estimate that fits no GPU of the policy: ``Rejected`` where the policy enforces (Kueue then
  deactivates the Workload), else as a failure;
- failed, or no estimate within ``maxHoldSeconds`` of the Workload's creation: the policy's
  ``onEstimationFailure``: ``Release`` is ``Ready`` unchanged, ``Default`` is ``Ready`` with the
  default request, ``Hold`` is ``Retry`` (Kueue releases the quota and queues the Workload again;
  past ``maxHoldSeconds`` it becomes ``Ready`` unchanged). The reason is in the check's message.

Every status write is a PUT of the status subresource with the resourceVersion read, as Kueue's
own workload controller syncs admission checks (``Status().Update``, pkg/controller/core/
workload_controller.go, sigs.k8s.io/kueue v0.17.0): a 409 starts the pass over. Kueue v0.17
stores ``v1beta2`` (its CRDs' storage version), which is the version read and written here.
"""

from __future__ import annotations

import copy
import datetime
import logging
from typing import Any, Dict, Iterable, List, Mapping, Optional, Tuple

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import estimate_cache, gate, kueue_claims, records
from xmem_admission.cluster.controller.context import Context, Workload
from xmem_admission.cluster.controller.gate import Hold
from xmem_admission.cluster.integrations import gpu_templates
from xmem_admission.cluster.kube.client import Kind, Obj
from xmem_admission.cluster.kube.informer import Informer
from xmem_admission.cluster.kube.quantity import gib
from xmem_admission.cluster.policy.model import FailureAction
from xmem_admission.cluster.policy.sizing import Plan
from xmem_admission.contract.errors import InvalidObjectError

log = logging.getLogger(__name__)

CONTROLLER_NAME = "xmem.io/gpu-memory"
KUEUE_GROUP = "kueue.x-k8s.io"
KUEUE_VERSION = "v1beta2"  # storage: true in config/components/crd/bases (kueue v0.17.0)
WORKLOAD = Kind(KUEUE_GROUP, KUEUE_VERSION, "workloads", "Workload")
ADMISSION_CHECK = Kind(KUEUE_GROUP, KUEUE_VERSION, "admissionchecks", "AdmissionCheck")

# Check states (CheckState, apis/kueue/v1beta2/admissioncheck_types.go, kueue v0.17.0).
PENDING, READY, RETRY, REJECTED = "Pending", "Ready", "Retry", "Rejected"
# The AdmissionCheck condition Kueue reads (AdmissionCheckActive, same file).
ACTIVE = "Active"
# Kueue's own podSet name for a Job (DefaultPodSetName, apis/kueue/v1beta2/constants.go); a
# Kubeflow job's podSets are named after its replica types, lower-cased
# (pkg/controller/jobs/kubeflow/kubeflowjob, kueue v0.17.0); a JobSet's and a TrainJob's after
# the replicated Jobs, as named (pkg/controller/jobs/jobset PodSets; jobs/trainjob PodSets reads
# its JobSet's, and RunWithPodSetsInfo writes each podSet's info into Kueue's runtime patch
# under the replicated Job of that name, kueue v0.17.0): DNS labels, which lower-casing keeps.
DEFAULT_POD_SET = "main"
MESSAGE_LIMIT = 1024  # the API allows 32768 (AdmissionCheckState.message); keep it readable
RETRY_SECONDS = 30  # requeueAfterSeconds on Retry: the same pace as an Event-worthy re-check


def stamp(when: datetime.datetime) -> str:
    return when.strftime("%Y-%m-%dT%H:%M:%SZ")


def is_ours(check: Optional[Obj], controller_name: str) -> bool:
    return check is not None and (check.get("spec") or {}).get("controllerName") == controller_name


def our_states(wl: Obj, checks: Informer, controller_name: str) -> List[Dict[str, Any]]:
    """The Workload's admission-check states whose AdmissionCheck is served by us."""
    states = (wl.get("status") or {}).get("admissionChecks") or []
    return [s for s in states if isinstance(s, dict)
            and is_ours(checks.get("", str(s.get("name", ""))), controller_name)]


def pending(wl: Obj, checks: Optional[Informer], controller_name: str) -> bool:
    """Whether one of our checks waits on this Workload (what a resync looks at again)."""
    return checks is not None and any(s.get("state") == PENDING
                                      for s in our_states(wl, checks, controller_name))


def owner_of(ctx: Context, wl: Obj) -> Tuple[Optional[Workload], Optional[Obj], str]:
    """The job a Workload stands for: (its kind's handle, the object, '' ) when it is in the
    cache; (None, None, why) when it is of a kind we do not size or not there (yet)."""
    refs = [r for r in (wl["metadata"].get("ownerReferences") or []) if isinstance(r, dict)]
    ref = next((r for r in refs if r.get("controller") is True), refs[0] if refs else None)
    if ref is None:
        return None, None, "the Workload has no owner"
    workload = ctx.workloads.get(str(ref.get("kind", "")))
    if workload is None:
        return None, None, f"xmem does not size {ref.get('kind')} workloads"
    obj = workload.informer.get(wl["metadata"]["namespace"], str(ref.get("name", "")))
    if obj is None or obj["metadata"].get("uid") != ref.get("uid"):
        return workload, None, f"{ref.get('kind')} {ref.get('name')} is not in the cache yet"
    return workload, obj, ""


def pod_set_name(role: str, names: Iterable[str]) -> str:
    """The Workload's podSet for a pod template role ('' for a Job's only template)."""
    known = list(names)
    wanted = role.lower() if role else DEFAULT_POD_SET
    if wanted in known or not known:
        return wanted
    if not role and len(known) == 1:
        return known[0]
    raise InvalidObjectError(f"the Workload has no podSet for {role or 'the pod template'} "
                             f"(podSets: {', '.join(known)})")


def pod_set_updates(workload: Workload, obj: Obj, wl: Obj,
                    values: Mapping[int, Dict[str, str]]) -> List[Dict[str, Any]]:
    """One podSetUpdate per GPU template given annotations for (by position): the annotations
    and the opt-in label, less every key the template already has (Kueue refuses conflicts)."""
    names = [str(p.get("name")) for p in (wl.get("spec") or {}).get("podSets") or []
             if isinstance(p, dict)]
    out: List[Dict[str, Any]] = []
    for index, (ref, _containers) in enumerate(gpu_templates(workload.integration, obj)):
        meta = ref.template.get("metadata") or {}
        have_ann = meta.get("annotations") or {}
        have_labels = meta.get("labels") or {}
        update: Dict[str, Any] = {"name": pod_set_name(ref.role, names)}
        annotations = {k: v for k, v in values.get(index, {}).items() if k not in have_ann}
        if annotations:
            update["annotations"] = annotations
        if not labels.is_opted_in(have_labels) and labels.OPT_IN not in have_labels:
            update["labels"] = {labels.OPT_IN: labels.OPT_IN_VALUE}
        if len(update) > 1:
            out.append(update)
    return out


def _set_state(ctx: Context, wl: Obj, names: List[str], state: str, message: str,
               updates: Optional[List[Dict[str, Any]]] = None,
               requeue: Optional[int] = None) -> Obj:
    """Write our checks' state into the Workload's status (PUT with its resourceVersion)."""
    new = copy.deepcopy(wl)
    now = stamp(ctx.now())
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 4] + " ..."
    for entry in new["status"]["admissionChecks"]:
        if entry.get("name") not in names:
            continue
        if entry.get("state") != state:
            entry["lastTransitionTime"] = now
        entry.update(state=state, message=message)
        entry.pop("podSetUpdates", None)
        entry.pop("requeueAfterSeconds", None)
        if updates:
            entry["podSetUpdates"] = updates
        if requeue is not None:
            entry["requeueAfterSeconds"] = requeue
    written = ctx.kube.replace_status(WORKLOAD, new)
    return written


def reconcile_check(ctx: Context, checks: Informer, controller_name: str,
                    name: str) -> Optional[float]:
    """Mark one of our AdmissionChecks Active (Kueue admits nothing through an inactive one)."""
    check = checks.get("", name)
    if not is_ours(check, controller_name):
        return None
    assert check is not None
    conditions = list((check.get("status") or {}).get("conditions") or [])
    current = next((c for c in conditions if c.get("type") == ACTIVE), None)
    generation = check["metadata"].get("generation")
    if current is not None and current.get("status") == "True" and \
            current.get("observedGeneration") == generation:
        return None
    condition = {"type": ACTIVE, "status": "True", "reason": "Active",
                 "message": "xmem estimates each Workload's GPU memory before admission",
                 "lastTransitionTime": stamp(ctx.now())}
    if generation is not None:
        condition["observedGeneration"] = generation
    conditions = [c for c in conditions if c.get("type") != ACTIVE] + [condition]
    new = copy.deepcopy(check)
    new.setdefault("status", {})["conditions"] = conditions
    checks.put(ctx.kube.replace_cluster_status(ADMISSION_CHECK, new))
    return None


def reconcile(ctx: Context, workloads: Informer, checks: Informer, controller_name: str,
              namespace: str, name: str) -> Optional[float]:
    """One pass over a Kueue Workload; the delay after which to look again, or None."""
    wl = workloads.get(namespace, name)
    if wl is None or "deletionTimestamp" in wl["metadata"]:
        return None
    kueue_claims.unstick(ctx, wl, WORKLOAD)  # Kueue's DRA error before xmem made the template
    pending = [s for s in our_states(wl, checks, controller_name) if s.get("state") == PENDING]
    if not pending:
        return None
    names = [str(s["name"]) for s in pending]
    # When this round of the check began: a failure recorded before it is an older round's.
    began = [t for t in (records.parse_time(s.get("lastTransitionTime")) for s in pending) if t]
    since = min(began) if began else \
        records.parse_time(wl["metadata"].get("creationTimestamp")) or ctx.now()
    workload, obj, why = owner_of(ctx, wl)
    created = records.parse_time(wl["metadata"].get("creationTimestamp")) or since
    hold = Hold.of(ctx, namespace, since, began=created)
    answer = _Answer(ctx, wl, names, hold)
    if workload is None:
        return answer.ready(f"xmem: {why}; admitted unchanged")
    if obj is None:
        if ctx.now() >= hold.deadline:
            return answer.ready(f"xmem: {why} within maxHoldSeconds; admitted unchanged")
        return 1.0
    decision = gate.decide(ctx, workload, obj, hold, held=False)
    if isinstance(decision, gate.Wait):
        return decision.seconds
    if isinstance(decision, gate.Disabled):
        return answer.ready("xmem: the policy for this namespace is disabled; admitted unchanged")
    if isinstance(decision, gate.NoGpu):
        return answer.ready("xmem: the workload requests no GPU; admitted unchanged")
    if isinstance(decision, gate.Exempt):
        return answer.ready("xmem: break-glass (xmem.io/break-glass); admitted unchanged")
    if isinstance(decision, gate.Failed):  # the policy's Default request: a workload read
        return answer.failed(decision.reason, decision.message, timed_out=decision.timed_out,
                             workload=workload, obj=decision.obj if decision.read else None)
    if isinstance(decision, gate.Misfit):
        return answer.misfit(workload, decision)
    if isinstance(decision, gate.Estimated):
        return answer.estimated(workload, decision)
    assert isinstance(decision, gate.Estimating), decision  # Changed: only a held job's
    message = f"xmem: estimating GPU memory (fingerprint {decision.fingerprint[:12]})"
    if any(s.get("message") != message for s in pending):
        _set_state(ctx, wl, names, PENDING, message)
    return hold.left(ctx.now())


class _Answer:
    """The ways a pass ends for one Workload's Pending checks (each one status write)."""

    def __init__(self, ctx: Context, wl: Obj, names: List[str], hold: Hold) -> None:
        self.ctx, self.wl, self.names, self.hold = ctx, wl, names, hold

    def ready(self, message: str, updates: Optional[List[Dict[str, Any]]] = None,
              outcome: str = "unchanged") -> Optional[float]:
        _set_state(self.ctx, self.wl, self.names, READY, message, updates)
        self.ctx.metrics.released.labels(WORKLOAD.kind, outcome).inc()
        return None

    def misfit(self, workload: Workload, misfit: gate.Misfit) -> Optional[float]:
        """Rejected where the policy enforces (Kueue deactivates the Workload), else a
        failure."""
        assert self.hold.settings is not None  # estimated, so a policy was loaded
        if self.hold.settings.enforcing:
            _set_state(self.ctx, self.wl, self.names, REJECTED,
                       f"xmem: the estimate fits no GPU of the policy: {misfit.message}")
            self.ctx.metrics.released.labels(WORKLOAD.kind, "rejected").inc()
            return None
        return self.failed("FitsNoGPU", misfit.message, workload=workload, obj=misfit.obj)

    def estimated(self, workload: Workload, estimated: gate.Estimated) -> Optional[float]:
        obj, gmes, plans = estimated.obj, estimated.gmes, estimated.plans
        gme = gmes[0]
        values = {i: p.annotations() for i, p in enumerate(plans) if p is not None}
        updates = pod_set_updates(workload, obj, self.wl, values)
        estimate_cache.used(self.ctx, gmes)
        chosen: Optional[Plan] = next((p for p in plans if p is not None), None)
        if chosen is not None:
            message = (f"xmem: estimated {gib(chosen.estimate_bytes)} GiB peak on "
                       f"{chosen.target.gpu.key}; request {gib(chosen.request_bytes)} GiB per GPU "
                       f"({gme['metadata']['name']})")
        else:
            message = "xmem: GPU memory estimated; the pod templates already carry a request"
        return self.ready(message, updates, outcome="estimated")

    def failed(self, reason: str, message: str, timed_out: bool = False,
               workload: Optional[Workload] = None, obj: Optional[Obj] = None) -> Optional[float]:
        """The policy's onEstimationFailure, as a check state."""
        settings = self.hold.settings
        action = self.hold.action(self.ctx.now(), timed_out)
        why = gate.failure_text(reason, message)
        if action is FailureAction.HOLD:
            _set_state(self.ctx, self.wl, self.names, RETRY, f"{why}; retried (policy "
                       "onEstimationFailure: Hold)", requeue=RETRY_SECONDS)
            self.ctx.metrics.released.labels(WORKLOAD.kind, "retry").inc()
            return None
        if action is FailureAction.DEFAULT and settings is not None and workload is not None \
                and obj is not None and settings.default_request_bytes is not None:
            values: Dict[int, Dict[str, str]] = {}
            for index, (ref, _containers) in enumerate(gpu_templates(workload.integration, obj)):
                annotations = (ref.template.get("metadata") or {}).get("annotations") or {}
                pinned = annotations.get(labels.GPU_MODEL)
                target = (settings.target(pinned) if isinstance(pinned, str) else None) \
                    or settings.targets[0]
                values[index] = {labels.REQUEST_BYTES: str(settings.default_request_bytes),
                                 labels.GPU_MODEL: target.gpu.key}
            updates = pod_set_updates(workload, obj, self.wl, values)
            return self.ready(f"{why}; admitted with the policy's default request "
                              f"{gib(settings.default_request_bytes)} GiB", updates, "default")
        return self.ready(f"{why}; admitted unchanged")
