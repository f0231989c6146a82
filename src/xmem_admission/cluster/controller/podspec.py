"""The estimation pod: the workload's program, on a CPU, under the probe.

Built from the workload's first GPU pod template and its first GPU container (the training
process; single-process estimation):

- the same image, command, args, working directory, ``env`` and ``envFrom``, service account
  (for its image pull secrets), ``imagePullSecrets`` and ``runtimeClassName`` (a sandboxed
  runtime such as gVisor or Kata keeps holding the user's code);
- Pod Security ``restricted``, init container included: non-root (the workload's own user when
  it names a non-root one, else 65532), ``RuntimeDefault`` seccomp (or the workload's
  ``Localhost`` profile), no privilege escalation, every capability dropped; of the workload's
  security contexts only the user, groups and a read-only root file system are kept;
- its volumes that carry inputs (config maps, secrets, downward API, projected sources without
  service-account tokens, persistent volume claims, CSI), all mounted read-only, and its
  ``emptyDir`` scratch space; never host paths (nor NFS, which ``restricted`` does not allow:
  mount it through a PersistentVolumeClaim);
- no GPU: no GPU resources, no node selector, affinity or tolerations aimed at GPU nodes,
  ``CUDA_VISIBLE_DEVICES=""`` and ``NVIDIA_VISIBLE_DEVICES=void`` so that a node whose default
  runtime is NVIDIA's does not hand it a device anyway; the policy's placement instead
  (``spec.estimation.placement``: node selector, tolerations, PriorityClass);
- named after its workload: ``<workload>-xmem-<hash>`` (``pod_name``: the workload's name cut to
  fit 63 characters, and 8 hex digits of the estimate's uid and attempt, so each estimation
  unit and each attempt has its own);
- CPU and memory limits and ``activeDeadlineSeconds`` from the policy, ``restartPolicy:
  Never``, ``automountServiceAccountToken: false``, ``enableServiceLinks: false``;
- an init container from the controller's image that writes the probe bundle into an emptyDir
  (``python -m xmem_admission.bundle``), and ``PYTHONPATH`` pointing there first (before the
  user's own ``PYTHONPATH`` from the pod spec, kept by reference); ``XMEM_PROBE=1`` and the
  probe settings make the bundle's ``sitecustomize`` trace the program (see ``sitehook``);
- where the pod spec sets no ``PYTHONPATH``, a second init container from the workload's own
  image, pulled by the kubelet with the pod's own pull secrets, records the ``PYTHONPATH`` of the
  image's environment (Dockerfile ``ENV``) beside the bundle, and the bundle's
  ``sitecustomize`` puts it after itself, so the image keeps it (a pod spec cannot refer to the
  image's environment; reading the image's configuration from its registry would need the
  pod's pull secrets and the node's mirrors in the controller). It runs the workload's
  interpreter when the command names one (``python``, ``python3.11``, a path to either), else
  ``python3``, with ``-S`` (no site, so nothing of the image's own runs);
- a scratch ``emptyDir`` (``XMEM_PROBE_SCRATCH``): the probe's processes get it as ``HOME`` and
  ``TMPDIR`` where the image's are not writable for the pod's user;
- several estimates of one program in one pod (``carry``): estimates whose pods would be the
  same but for their command lines' option values (a sweep's trials of one family) ride in the
  first one's pod; the probe starts the interpreter and imports torch once and forks a trace
  per estimate (``XMEM_PROBE_BATCH``: each estimate's name and command line), one after the
  other, so CPU and memory stay one trace's (and tens of MiB of the first process's own),
  ``activeDeadlineSeconds`` is the policy's times the number of traces and each trace is
  stopped past the policy's (``XMEM_PROBE_TRACE_SECONDS``); each carried estimate is an owner of the pod (the first, its
  controller) and the annotation ``xmem.io/estimates`` lists them;
- the switches that turn experiment trackers off (``contract.side_effects``: ``WANDB_MODE=
  disabled``, MLflow's tracking URI on a throw-away store in the scratch folder, Comet's), in
  place of the workload's own values, so that ``kubectl describe pod`` shows them.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import re
from typing import TYPE_CHECKING, Any, Dict, List, Mapping, Optional, Tuple

from xmem_admission.cluster.controller import records
from xmem_admission.cluster.integrations import GpuTemplate, TemplateRef, estimation_units
from xmem_admission.cluster.integrations.base import for_kind
from xmem_admission.cluster.kube.client import Obj
from xmem_admission.cluster.policy.model import Settings
from xmem_admission.contract import probe_env, side_effects

if TYPE_CHECKING:
    from xmem_admission.cluster.controller.context import Workload

PROBE_DIR = "/xmem/probe"
PROBE_VOLUME = "xmem-probe"
RESULT_PATH = probe_env.DEFAULT_RESULT_PATH
INIT_NAME = "xmem-probe"
IMAGE_ENV_NAME = "xmem-image-env"  # the init container that reads the image's PYTHONPATH
SCRATCH_DIR = "/xmem/scratch"
SCRATCH_VOLUME = "xmem-scratch"
SCRATCH_LIMIT = "2Gi"  # caches a probe may fill: torch's kernel and compile caches, pip's
_PYTHON = re.compile(r"python(\d+(\.\d+)?)?")
# The second init container's program: the image's PYTHONPATH (null when unset) as JSON.
IMAGE_ENV_SCRIPT = ("import json, os, sys\n"
                    "with open(sys.argv[1], 'w') as f:\n"
                    "    json.dump({'PYTHONPATH': os.environ.get('PYTHONPATH')}, f)\n")
INIT_RESOURCES = {"limits": {"cpu": "200m", "memory": "128Mi"},
                  "requests": {"cpu": "50m", "memory": "64Mi"}}
USER_PYTHONPATH = "XMEM_USER_PYTHONPATH"
INPUT_VOLUMES = ("configMap", "secret", "downwardAPI", "projected", "persistentVolumeClaim",
                 "csi", "emptyDir")  # all allowed by Pod Security "restricted"
NON_ROOT = 65532  # the user an estimation pod runs as when the workload names no other
RESTRICTED_CONTAINER = {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]},
                        "runAsNonRoot": True}
OURS = probe_env.ALL + ("CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", USER_PYTHONPATH) \
    + side_effects.VARIABLES


CARRIED = "xmem.io/estimates"  # the estimates a pod traces, in order, where it traces several
POD_NAME_LIMIT = 63  # a DNS label: the pod's hostname is its name
POD_INFIX = "-xmem-"


def pod_name(gme: Obj) -> str:
    """The estimation pod's name for the estimate's current attempt: ``<workload>-xmem-<hash>``,
    at most 63 characters; the hash (8 hex digits of the estimate's uid and attempt) makes it
    unique per estimation unit and attempt."""
    m = gme["metadata"]
    workload = str(((gme.get("spec") or {}).get("workload") or {}).get("name") or "")
    return _pod_name(workload, str(m.get("uid") or m["name"]), records.attempt(gme))


@functools.lru_cache(maxsize=65536)
def _pod_name(workload: str, unit: str, attempt: int) -> str:
    digest = hashlib.sha256(f"{unit}/{attempt}".encode())
    stem = re.sub(r"[^a-z0-9-]+", "-", workload.lower())
    stem = stem[:POD_NAME_LIMIT - len(POD_INFIX) - 8].strip("-") or "estimate"
    return f"{stem}{POD_INFIX}{digest.hexdigest()[:8]}"


def placement(settings: Settings) -> Dict[str, Any]:
    """The pod spec fields the policy's ``spec.estimation.placement`` sets."""
    given = settings.estimation.placement
    out: Dict[str, Any] = {}
    if given.node_selector:
        out["nodeSelector"] = dict(given.node_selector)
    if given.tolerations:
        out["tolerations"] = [t.as_dict() for t in given.tolerations]
    if given.priority_class_name:
        out["priorityClassName"] = given.priority_class_name
    return out


def _volume(volume: Mapping[str, Any]) -> Any:
    """A copy of an input volume, made read-only where the source allows; None to leave out."""
    kind = next((k for k in INPUT_VOLUMES if k in volume), None)
    if kind is None:
        return None
    out = dict(volume)
    if kind == "projected":
        sources = [s for s in volume["projected"].get("sources") or []
                   if "serviceAccountToken" not in s]
        if not sources:
            return None
        out["projected"] = dict(volume["projected"], sources=sources)
    elif kind in ("persistentVolumeClaim", "csi"):
        out[kind] = dict(volume[kind], readOnly=True)
    return out


def _env(container: Mapping[str, Any], gme: Obj, settings: Settings,
         world: Mapping[str, str]) -> List[Dict[str, Any]]:
    env: List[Dict[str, Any]] = []
    user_path = None
    for item in container.get("env") or []:
        if item.get("name") in OURS or item.get("name") in world:
            continue
        if item.get("name") == "PYTHONPATH":
            user_path = item
            continue
        env.append(dict(item))
    if user_path is None:
        python_path = PROBE_DIR
    elif "valueFrom" in user_path:
        env.append({"name": USER_PYTHONPATH, "valueFrom": user_path["valueFrom"]})
        python_path = f"{PROBE_DIR}:$({USER_PYTHONPATH})"
    else:
        value = str(user_path.get("value", ""))
        python_path = f"{PROBE_DIR}:{value}" if value else PROBE_DIR
    estimation = settings.estimation
    # A distributed workload's rank 0 (a PyTorchJob's master): the probe traces that rank.
    env += [{"name": name, "value": value} for name, value in world.items()]
    env += [
        {"name": "PYTHONPATH", "value": python_path},
        {"name": probe_env.ON, "value": probe_env.ON_VALUE},
        {"name": probe_env.GPUS, "value": ",".join((gme.get("spec") or {}).get("gpus") or [])},
        {"name": probe_env.STEPS, "value": str(estimation.steps)},
        {"name": probe_env.MODE, "value": estimation.mode},
        {"name": probe_env.RESULT_PATH, "value": RESULT_PATH},
        {"name": probe_env.SCRATCH, "value": SCRATCH_DIR},
        {"name": "CUDA_VISIBLE_DEVICES", "value": ""},
        {"name": "NVIDIA_VISIBLE_DEVICES", "value": "void"},
    ]
    # experiment trackers and Hub telemetry off (contract.side_effects), in place of the job's own
    env += [{"name": name, "value": value}
            for name, value in side_effects.environment(SCRATCH_DIR).items()]
    return env


def _rank0_environment(workload: Obj) -> Dict[str, str]:
    group, _, version = str(workload.get("apiVersion") or "").rpartition("/")
    integration = for_kind(group, version, str(workload.get("kind") or ""))
    return integration.rank0_environment(workload) if integration is not None else {}


def _user(context: Any) -> Dict[str, Any]:
    """The user and groups of a security context, where they are not root."""
    if not isinstance(context, dict):
        return {}
    out: Dict[str, Any] = {}
    for key in ("runAsUser", "runAsGroup"):
        value = context.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > 0:
            out[key] = value
    return out


def pod_security(spec: Mapping[str, Any]) -> Dict[str, Any]:
    """The pod's security context: ``restricted``, with the workload's non-root user and groups."""
    given = spec.get("securityContext")
    given = given if isinstance(given, dict) else {}
    out: Dict[str, Any] = {"runAsNonRoot": True, "runAsUser": NON_ROOT, "runAsGroup": NON_ROOT}
    out.update(_user(given))
    for key in ("fsGroup", "supplementalGroups", "fsGroupChangePolicy"):
        if given.get(key) is not None:
            out[key] = given[key]
    seccomp = given.get("seccompProfile")
    if isinstance(seccomp, dict) and seccomp.get("type") == "Localhost":
        out["seccompProfile"] = dict(seccomp)
    else:
        out["seccompProfile"] = {"type": "RuntimeDefault"}
    return out


def container_security(container: Mapping[str, Any]) -> Dict[str, Any]:
    """A container's security context: ``restricted``, with its own non-root user kept."""
    given = container.get("securityContext")
    out: Dict[str, Any] = dict(RESTRICTED_CONTAINER, capabilities={"drop": ["ALL"]})
    out.update(_user(given))
    if isinstance(given, dict) and given.get("readOnlyRootFilesystem") is True:
        out["readOnlyRootFilesystem"] = True
    return out


def interpreter(container: Mapping[str, Any]) -> str:
    """The Python the workload's command starts, where its first word names one; else
    ``python3``, the name every image with a Python 3 has (Debian's, conda's, NGC's)."""
    command = container.get("command") or []
    first = str(command[0]) if command else ""
    return first if _PYTHON.fullmatch(os.path.basename(first)) else "python3"


def image_env_container(container: Mapping[str, Any]) -> Optional[Dict[str, Any]]:
    """The init container that records the image's own PYTHONPATH, or None where the pod spec
    sets one (it replaces the image's in the workload's own pod too)."""
    if any(item.get("name") == "PYTHONPATH" for item in container.get("env") or []):
        return None
    out: Dict[str, Any] = {
        "name": IMAGE_ENV_NAME,
        "image": container["image"],
        "command": [interpreter(container), "-S", "-c", IMAGE_ENV_SCRIPT,
                    f"{PROBE_DIR}/{probe_env.IMAGE_ENV_FILE}"],
        "resources": INIT_RESOURCES,
        "volumeMounts": [{"name": PROBE_VOLUME, "mountPath": PROBE_DIR}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(container_security(container), readOnlyRootFilesystem=True),
    }
    if container.get("imagePullPolicy") is not None:
        out["imagePullPolicy"] = container["imagePullPolicy"]
    return out


def unit_template(workload: Workload, obj: Obj, templates: List[GpuTemplate], gme: Obj,
                  settings: Any, versions: Any = None,
                  ) -> Tuple[TemplateRef, List[Any], Optional[Dict[str, str]]]:
    """The GPU template the GME's program runs in, and the world to trace it in: the first
    GPU template for a workload estimated as one unit; for one whose templates run different
    programs, the first template of the unit the GME is recorded under, in that unit's world
    (``integrations.estimation_units``)."""
    wanted = (gme.get("spec") or {}).get("fingerprint")
    units = estimation_units(workload.integration, obj, settings.gpu_keys, versions)
    unit = next((u for u in units if u.fingerprint == wanted), None)
    if len(units) < 2 or unit is None:
        ref, containers = templates[0]
        return ref, containers, None
    ref, containers = templates[unit.templates[0]]
    roles = [templates[i][0].role for i in unit.templates]
    return ref, containers, workload.integration.unit_environment(obj, roles)


def build(gme: Obj, workload: Obj, template: Mapping[str, Any], container: Mapping[str, Any],
          settings: Settings, probe_image: str,
          world: Optional[Mapping[str, str]] = None) -> Obj:
    """The estimation pod for a GME, from the workload's GPU template and container; rank 0's
    ``world`` when given (one program of several: ``estimation_pods``), else the workload's."""
    spec = template.get("spec") or {}
    limits = {"cpu": settings.estimation.cpu, "memory": settings.estimation.memory}
    volumes = []
    kept = set()
    for volume in spec.get("volumes") or []:
        copied = _volume(volume)
        if copied is not None:
            volumes.append(copied)
            kept.add(volume["name"])
    scratch = {v["name"] for v in volumes if "emptyDir" in v}
    mounts = [dict(m, readOnly=m["name"] not in scratch or bool(m.get("readOnly")))
              for m in container.get("volumeMounts") or [] if m.get("name") in kept]
    volumes += [{"name": PROBE_VOLUME, "emptyDir": {"sizeLimit": "64Mi"}},
                {"name": SCRATCH_VOLUME, "emptyDir": {"sizeLimit": SCRATCH_LIMIT}}]
    mounts += [{"name": PROBE_VOLUME, "mountPath": PROBE_DIR, "readOnly": True},
               {"name": SCRATCH_VOLUME, "mountPath": SCRATCH_DIR}]
    main: Dict[str, Any] = {
        "name": container.get("name") or "train",
        "image": container["image"],
        "env": _env(container, gme, settings,
                    dict(world) if world is not None else _rank0_environment(workload)),
        "resources": {"limits": dict(limits), "requests": dict(limits)},
        "volumeMounts": mounts,
        "terminationMessagePath": RESULT_PATH,
        # No result written and a failure: the kubelet puts the last log lines here instead,
        # which is how the controller quotes them without reading any pod's logs.
        "terminationMessagePolicy": "FallbackToLogsOnError",
    }
    for key in ("command", "args", "workingDir", "envFrom", "imagePullPolicy"):
        if container.get(key) is not None:
            main[key] = container[key]
    main["securityContext"] = container_security(container)
    init = {
        "name": INIT_NAME,
        "image": probe_image,
        "command": ["python", "-m", "xmem_admission.bundle", PROBE_DIR],
        "resources": INIT_RESOURCES,
        "volumeMounts": [{"name": PROBE_VOLUME, "mountPath": PROBE_DIR}],
        "terminationMessagePolicy": "FallbackToLogsOnError",
        "securityContext": dict(RESTRICTED_CONTAINER, capabilities={"drop": ["ALL"]},
                                readOnlyRootFilesystem=True, runAsUser=NON_ROOT,
                                runAsGroup=NON_ROOT, seccompProfile={"type": "RuntimeDefault"}),
    }
    m = workload["metadata"]
    gme_meta = gme["metadata"]
    pod_spec: Dict[str, Any] = {
        "restartPolicy": "Never",
        "activeDeadlineSeconds": settings.estimation.active_deadline_seconds,
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "terminationGracePeriodSeconds": 10,
        "initContainers": [init] + [c for c in [image_env_container(container)] if c],
        "containers": [main],
        "volumes": volumes,
        "securityContext": pod_security(spec),
    }
    for key in ("serviceAccountName", "imagePullSecrets", "runtimeClassName"):
        if spec.get(key):
            pod_spec[key] = spec[key]
    pod_spec.update(placement(settings))
    return {
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {
            "name": pod_name(gme),
            "namespace": m["namespace"],
            "labels": {records.FINGERPRINT_LABEL: gme["spec"]["fingerprint"],
                       records.MANAGED_BY[0]: records.MANAGED_BY[1],
                       records.COMPONENT[0]: records.COMPONENT[1]},
            "annotations": {"xmem.io/workload": f"{workload['kind']}/{m['name']}"},
            "ownerReferences": [{"apiVersion": gme["apiVersion"], "kind": gme["kind"],
                                 "name": gme_meta["name"], "uid": gme_meta["uid"],
                                 "controller": True, "blockOwnerDeletion": True}],
        },
        "spec": pod_spec,
    }


def words(container: Mapping[str, Any]) -> List[str]:
    """A container's command line as written: its command, then its arguments."""
    return [str(w) for w in (container.get("command") or []) + (container.get("args") or [])]


def batchable(first: Obj, other: Obj) -> Optional[List[str]]:
    """The command line of ``other`` (an estimation pod as ``build`` makes it) when it can be
    traced in ``first``'s pod: the same pod but for the command line, of the same length (one
    program, other option values); None otherwise."""
    def rest(body: Obj) -> Any:
        spec = dict(body["spec"])
        spec["containers"] = [{k: v for k, v in c.items() if k not in ("command", "args")}
                              for c in spec["containers"]]
        return spec

    mine, theirs = words(first["spec"]["containers"][0]), words(other["spec"]["containers"][0])
    if not mine or len(mine) != len(theirs) or rest(first) != rest(other):
        return None
    return theirs


def carry(body: Obj, traces: List[Any], settings: Settings) -> Obj:
    """``body`` (the first estimate's pod) made to trace each of ``traces`` ((GME, command
    line) each, the first estimate's own first): see the module docstring."""
    if len(traces) < 2:
        return body
    names = [gme["metadata"]["name"] for gme, _ in traces]
    main = body["spec"]["containers"][0]
    main["env"] = main["env"] + [
        {"name": probe_env.BATCH,
         "value": json.dumps({"estimates": names, "argv": [list(w) for _, w in traces]},
                             separators=(",", ":"))},
        {"name": probe_env.TRACE_SECONDS,
         "value": str(settings.estimation.active_deadline_seconds)}]
    body["spec"]["activeDeadlineSeconds"] = settings.estimation.active_deadline_seconds * len(
        traces)
    body["metadata"]["annotations"][CARRIED] = ",".join(names)
    body["metadata"]["ownerReferences"] += [
        {"apiVersion": gme["apiVersion"], "kind": gme["kind"], "name": gme["metadata"]["name"],
         "uid": gme["metadata"]["uid"]} for gme, _ in traces[1:]]
    return body


def carried(pod: Obj) -> List[Dict[str, Any]]:
    """The traces of a pod that carries several estimates: ``{"estimate": name, "words":
    [...]}`` each, in order, read from its container's environment (which no one can change
    after the pod is made); [] for a pod of one estimate."""
    container = ((pod.get("spec") or {}).get("containers") or [{}])[0]
    for item in container.get("env") or []:
        if item.get("name") == probe_env.BATCH:
            try:
                spec = json.loads(str(item.get("value") or ""))
                return [{"estimate": str(n), "words": [str(w) for w in a]}
                        for n, a in zip(spec["estimates"], spec["argv"])]
            except (ValueError, KeyError, TypeError):
                return []
    return []
