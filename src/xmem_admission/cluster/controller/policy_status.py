"""The policy's status: whether the controller and the webhook could load it (queue key
``("policy",)``, after every policy refresh and at every resync; the leader alone writes it).

``status.conditions`` (``metav1.Condition``) and ``status.observedGeneration`` on the
``GPUAdmissionPolicy`` the controller reads (``--policy-name``):

- ``Accepted``: the parser took this generation (``True``, reason ``Valid``), or refused it
  (``False``, reason ``Invalid``, the parser's message naming the field, e.g. a GPU the
  catalogue lacks: the API server's schema cannot know the webhook's catalogue).
- ``Ready``: a generation of this policy is in force (``True``, reason ``InForce``, or
  ``PreviousGenerationInForce`` when the newest was refused and the last good one stays);
  ``False`` (``NoValidGeneration``) when none ever loaded.

A refused generation also gets one Warning Event (reason ``PolicyRejected``) on the policy.
Nothing is read or written while the verdict is the one last written; a policy from a file
(``--policy``) has no object to write on.
"""

from __future__ import annotations

import logging
import uuid
from typing import Any, Dict, List, Optional

from xmem_admission.cluster.controller.context import EVENT_MESSAGE_LIMIT, Context
from xmem_admission.cluster.kube.client import EVENT, POLICY
from xmem_admission.cluster.kube.conditions import merged
from xmem_admission.contract.errors import KubeApiError, KubeUnavailable

log = logging.getLogger(__name__)
EVENT_NAMESPACE = "default"  # where Events on cluster-scoped objects go (as client-go's recorder)


def conditions(generation: int, error: Optional[str],
               in_force: Optional[int]) -> List[Dict[str, Any]]:
    """The two conditions for a generation (without lastTransitionTime)."""
    accepted: Dict[str, Any]
    ready: Dict[str, Any]
    if error is None:
        accepted = {"type": "Accepted", "status": "True", "reason": "Valid",
                    "message": f"generation {generation} is in force"}
    else:
        accepted = {"type": "Accepted", "status": "False", "reason": "Invalid",
                    "message": error[:EVENT_MESSAGE_LIMIT]}
    if in_force is None:
        ready = {"type": "Ready", "status": "False", "reason": "NoValidGeneration",
                 "message": "no generation of this policy was accepted: the webhook and the "
                            "controller serve no policy"}
    elif in_force == generation and error is None:
        ready = {"type": "Ready", "status": "True", "reason": "InForce",
                 "message": f"generation {generation} is in force"}
    else:
        ready = {"type": "Ready", "status": "True", "reason": "PreviousGenerationInForce",
                 "message": f"generation {in_force} stays in force: generation {generation} "
                            "was not accepted"}
    for condition in (accepted, ready):
        condition["observedGeneration"] = generation
    return [accepted, ready]


def reconcile(ctx: Context) -> Optional[float]:
    source = ctx.policy
    seen = getattr(source, "seen", None)
    name = getattr(source, "name", None)
    if seen is None or not isinstance(name, str):
        return None  # a policy from a file, or none read yet
    uid, generation, error = seen
    current = source.current()
    in_force = current.generation if current is not None and current.name == name else None
    verdict = (uid, generation, error, in_force)
    if getattr(source, "written", None) == verdict:
        return None
    try:
        obj = ctx.kube.get_cluster(POLICY, name)
    except KubeApiError as exc:
        if exc.not_found:  # deleted: nothing to write on until one is read again
            source.written = verdict
            return None
        raise
    meta = obj["metadata"]
    if meta.get("uid") != uid or meta.get("generation") != generation:
        source.refresh()  # read again: the next refresh queues this key once more
        return 1.0
    status = dict(obj.get("status") or {})
    wanted = conditions(generation, error, in_force)
    stamp = ctx.now().strftime("%Y-%m-%dT%H:%M:%SZ")
    new = merged(status.get("conditions"), wanted, stamp)
    if status.get("conditions") != new or status.get("observedGeneration") != generation:
        status.update(conditions=new, observedGeneration=generation)
        ctx.kube.replace_cluster_status(POLICY, dict(obj, status=status))
        if error is not None:
            log.error("GPUAdmissionPolicy %s generation %d not accepted: %s", name,
                      generation, error)
            _event(ctx, obj, error)
    source.written = verdict
    return None


def _event(ctx: Context, obj: Dict[str, Any], error: str) -> None:
    """A Warning Event on the policy (best effort: a lost Event never blocks the status)."""
    m = obj["metadata"]
    stamp = ctx.now().strftime("%Y-%m-%dT%H:%M:%SZ")
    message = f"generation {m.get('generation')} not accepted: {error}"[:EVENT_MESSAGE_LIMIT]
    body = {
        "apiVersion": "v1", "kind": "Event",
        "metadata": {"name": f"{m['name']}.{uuid.uuid4().hex[:16]}",
                     "namespace": EVENT_NAMESPACE},
        "involvedObject": {"apiVersion": obj.get("apiVersion"), "kind": obj.get("kind"),
                           "name": m["name"], "uid": m.get("uid"),
                           "resourceVersion": m.get("resourceVersion")},
        "reason": "PolicyRejected", "message": message, "type": "Warning", "count": 1,
        "firstTimestamp": stamp, "lastTimestamp": stamp,
        "source": {"component": "xmem-controller"},
        "reportingComponent": "xmem.io/controller", "reportingInstance": ctx.identity,
    }
    try:
        ctx.kube.create(EVENT, EVENT_NAMESPACE, body)
    except (KubeApiError, KubeUnavailable) as exc:
        log.warning("event PolicyRejected on %s not recorded: %s", m["name"], exc)
