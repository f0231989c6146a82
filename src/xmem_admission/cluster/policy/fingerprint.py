"""The fingerprint of a workload: what its GPU memory depends on, as a stable hex digest.

Two workloads with the same fingerprint run the same program with the same inputs on the same
number and models of GPU, so one recorded estimate serves both: the webhook looks estimates up
by it, the controller records them under it. Both must compute it with ``of_templates``.

What goes in, per GPU-using container of each pod template (templates in the order the
integration lists them): image, command, args, working directory, the GPU count (counted the
same way in every backend's form, so the webhook's own rewrite never changes it), and the
environment, its entries as written, in name order: every literal ``value``, and for
``valueFrom``/``envFrom`` the reference (which secret or config map and key), not its content.
Variables that name the pod rather than the program (``HOSTNAME``, ``POD_NAME``, ...; see
``IGNORED_ENV``) are left out, as are labels, annotations and every other resource: none of
them change what the program allocates.

Its cost is bounded by the object's size, at C speed: the entries are filtered in one pass,
sorted by an ``itemgetter`` key and serialised by orjson, never rebuilt entry by entry in Python
(a 1.5 MiB object with tens of thousands of variables is fingerprinted in milliseconds).
Then the target GPU models of the policy, sorted, because an estimate covers exactly those.

What it cannot see: code or data mounted from volumes. A changed script in a config map with
the same name gives the same fingerprint; put a version in the image tag or an env var.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Tuple

import orjson

from xmem_admission.cluster.kube.resources import Slot, gpu_containers

VERSION = 2  # 2: environment entries as written, sorted by name (1 rebuilt them as triples)
DIGEST_CHARS = 32  # 128 bits; short enough to be a label value (63 characters at most)

# Set per pod by Kubernetes or by training operators; they name the pod, not the program.
IGNORED_ENV = frozenset(
    {
        "HOSTNAME", "POD_NAME", "POD_NAMESPACE", "POD_IP", "POD_UID", "NODE_NAME",
        "JOB_COMPLETION_INDEX", "MASTER_ADDR", "MASTER_PORT", "RANK", "LOCAL_RANK",
        "GROUP_RANK", "NODE_RANK", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT",
    }
)


_NAME = operator.itemgetter("name")


def _sort_key(item: Any) -> Tuple[int, str]:
    """The order of an entry whose name is not a string (only a malformed object has one)."""
    name = item.get("name") if type(item) is dict else None
    return (0, name) if type(name) is str else (1, type(name).__name__)


def _ignored(item: Any) -> bool:
    name = item.get("name") if type(item) is dict else None
    return type(name) is str and name in IGNORED_ENV


def _env(container: Mapping[str, Any]) -> List[Any]:
    env = container.get("env")
    if not isinstance(env, list):
        return []
    try:  # no Python call per entry; a malformed entry or name takes the careful way
        kept = [item for item in env
                if type(item) is not dict or item.get("name") not in IGNORED_ENV]
        return sorted(kept, key=_NAME)
    except (TypeError, KeyError):
        return sorted((item for item in env if not _ignored(item)), key=_sort_key)


def _plain(value: Any) -> Any:
    """``value`` with every integer beyond 64 bits as the float JSON parsers (orjson, the API
    server's clients) read it, so the digest never depends on which parser read the object."""
    if isinstance(value, bool) or value is None:
        return value
    if isinstance(value, int):
        if -(2**63) <= value < 2**64:
            return value
        try:
            return float(value)
        except OverflowError:
            return "overflow"
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    return value


def _container(container: Mapping[str, Any], gpus: int) -> Dict[str, Any]:
    return {
        "image": container.get("image"),
        "command": container.get("command"),
        "args": container.get("args"),
        "workingDir": container.get("workingDir"),
        "env": _env(container),
        "envFrom": container.get("envFrom"),
        "gpus": gpus,
    }


def of_templates(templates: Sequence[Mapping[str, Any]], gpu_models: Iterable[str]) -> str:
    """The fingerprint of a workload given its pod templates and the policy's target GPU keys.

    A bare Pod is its own single template (it has ``metadata`` and ``spec`` too).
    """
    return of_containers([list(gpu_containers(t)) for t in templates], gpu_models)


def of_containers(
    templates: Sequence[Sequence[Tuple[Slot, Mapping[str, Any], int]]], gpu_models: Iterable[str],
    world: Optional[Mapping[str, str]] = None,
) -> str:
    """The same digest from each template's GPU containers as ``resources.gpu_containers`` gives
    them (the webhook has them at hand already). ``world``: the distributed environment rank 0
    is traced in, for a kind whose world is not in its templates (a JobSet's replicas); left
    out when empty, so every other digest is what it always was."""
    document: Dict[str, Any] = {
        "v": VERSION,
        "gpus": sorted(set(gpu_models)),
        "templates": [[_container(c, count) for _, c, count in group] for group in templates],
    }
    if world:
        document["world"] = {str(k): str(v) for k, v in world.items()}
    try:
        text = orjson.dumps(document, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer beyond 64 bits somewhere (a client that reads them exactly)
        text = orjson.dumps(_plain(document), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(text).hexdigest()[:DIGEST_CHARS]
