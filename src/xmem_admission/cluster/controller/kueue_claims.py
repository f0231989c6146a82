"""A queued job's Kueue Workload freed from the DRA error it met before xmem made its claim
template.

A Job sized at its CREATE under the ``DRA`` backend names a ResourceClaimTemplate the xmem
controller makes when it sees the Job (``dra_claims.reconcile``). Kueue makes the Job's Workload
at the same moment and reads the templates its podSets name to charge DRA quota (Kueue v0.19.0,
pkg/dra/claims.go ``getClaimSpec``); when it is first, the template is not found, and the
Workload reconciler (pkg/controller/core/workload_controller.go ``Reconcile``) writes
``QuotaReserved=False`` and ``Requeued=False``, reason ``Inadmissible``, and retries with
backoff. The retry that finds the template clears those conditions on its in-memory copy only
and queues that copy, so the API object keeps ``Requeued=False``. After a failed scheduling
attempt the scheduler re-reads the Workload (pkg/cache/queue/manager.go ``RequeueWorkload``) and
parks that copy, condition included, among the inadmissible ones. When quota is released (a
Workload deleted or finished: ``QueueAssociatedInadmissibleWorkloadsAfter``) Kueue moves back to
the heap only workloads whose backoff has expired, and ``backoffWaitingTimeExpired``
(pkg/cache/queue/cluster_queue.go) is false while ``Requeued`` is ``False``. Whether the job is
admitted then depends on which copy Kueue parked last (a later reconcile of the Workload parks
its cleared copy): in one run in three the third job of tests/e2e_real/test_kueue_dra_quota.py
waited past 180 s with the condition on its Workload.

So once the controller has made the Job's templates (the Job's uid is in ``ctx.claimed``), it
removes that stale condition from the Workload's status, once per Workload: the update makes
Kueue reconcile the Workload again, find the templates, and queue it without the condition.
"""

from __future__ import annotations

import copy
import logging
from typing import Any, Optional, Set

from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller import dra_claims
from xmem_admission.cluster.controller.context import Context
from xmem_admission.cluster.integrations.base import controlling_owner
from xmem_admission.cluster.kube.client import Kind, Obj

log = logging.getLogger(__name__)

REQUEUED = "Requeued"
INADMISSIBLE = "Inadmissible"
LOOK_AGAIN = 1.0  # seconds, while the job's templates are not made yet
MAX_CLEARED = 10_000
_cleared: Set[str] = set()  # Workload uids whose condition was removed: never twice


def _templates(wl: Obj) -> Set[str]:
    """The xmem claim templates the Workload's podSets name."""
    out = set()
    for pod_set in (wl.get("spec") or {}).get("podSets") or []:
        spec = ((pod_set or {}).get("template") or {}).get("spec") or {}
        for claim in spec.get("resourceClaims") or []:
            name = str((claim or {}).get("resourceClaimTemplateName") or "")
            if name and dra.request_of(name) is not None:
                out.add(name)
    return out


def stale_condition(wl: Obj) -> Optional[int]:
    """The index of a ``Requeued=False`` (``Inadmissible``) condition whose message names one
    of xmem's claim templates of the Workload, or None."""
    names = _templates(wl)
    for at, condition in enumerate((wl.get("status") or {}).get("conditions") or []):
        if not isinstance(condition, dict) or condition.get("type") != REQUEUED or \
                condition.get("status") != "False" or condition.get("reason") != INADMISSIBLE:
            continue
        message = str(condition.get("message") or "")
        if "ResourceClaimTemplate" in message and any(n in message for n in names):
            return at
    return None


def unstick(ctx: Context, wl: Obj, kind: Kind) -> None:
    """Remove the stale condition once the Workload's job has its templates (see the module
    docstring); look again shortly while the controller has yet to make them."""
    at = stale_condition(wl)
    m = wl["metadata"]
    if at is None or m.get("uid") in _cleared or "deletionTimestamp" in m:
        return
    ref = controlling_owner(wl)
    if ref is None or str(ref.get("kind")) not in ctx.workloads:
        return
    job_kind = str(ref.get("kind"))
    owner = ctx.workloads[job_kind].informer.get(m.get("namespace", ""), str(ref.get("name")))
    if owner is None or owner["metadata"].get("uid") != ref.get("uid"):
        return
    if owner["metadata"]["uid"] not in ctx.claimed:
        if dra_claims.wants(ctx, job_kind, owner):
            ctx.queue.add(("kueue", m.get("namespace", ""), m["name"]), LOOK_AGAIN)
        return
    status: Any = copy.deepcopy(wl.get("status") or {})
    condition = status["conditions"].pop(at)
    ctx.kube.replace_status(kind, dict(wl, status=status))
    if len(_cleared) >= MAX_CLEARED:
        _cleared.clear()
    _cleared.add(m["uid"])
    log.info("Kueue Workload %s/%s: removed its Requeued=False condition (%s) now that its "
             "claim templates exist", m.get("namespace", ""), m["name"],
             condition.get("message"))
