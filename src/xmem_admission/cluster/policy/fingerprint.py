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

The ConfigMaps a GPU container mounts or reads (volumes it mounts, ``projected`` sources among
them; ``envFrom``; ``valueFrom.configMapKeyRef``) go in by their ``uid`` and
``resourceVersion`` when the caller gives a lookup (``versions``: the webhook's and the
controller's metadata-only caches of ConfigMaps), so a script edited in its ConfigMap and
submitted again is estimated again; a ConfigMap not (yet) in the cache goes in by its name
alone. Without a lookup (``xmem serve`` stand-alone) they go in by name only, as the references
written. Secrets go in by reference only (``envFrom``/``valueFrom`` as written): reading their
versions would take list and watch on every Secret in the cluster, which RBAC cannot narrow to
metadata.

What it cannot see: code or data fetched at run time (a PVC, object storage, a git clone); put
a version in the image tag, an env var or the ConfigMap.
"""

from __future__ import annotations

import hashlib
import operator
from typing import Any, Callable, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import orjson

from xmem_admission.cluster.kube.resources import Slot, gpu_containers

VERSION = 2  # 2: environment entries as written, sorted by name (1 rebuilt them as triples)
# (kind, name) in the workload's namespace -> (uid, resourceVersion), None when not known.
Versions = Callable[[str, str], Optional[Tuple[str, str]]]
VERSIONED = "ConfigMap"  # the kind whose versions are read (see the module docstring)
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


def of_templates(templates: Sequence[Mapping[str, Any]], gpu_models: Iterable[str],
                 versions: Optional[Versions] = None) -> str:
    """The fingerprint of a workload given its pod templates and the policy's target GPU keys.

    A bare Pod is its own single template (it has ``metadata`` and ``spec`` too).
    """
    return of_containers([list(gpu_containers(t)) for t in templates], gpu_models,
                         inputs=inputs_of(templates, versions))


def _name(ref: Any) -> Optional[str]:
    name = ref.get("name") if isinstance(ref, dict) else None
    return name if isinstance(name, str) and name else None


def _volume_maps(volume: Any) -> List[str]:
    """The ConfigMaps a volume shows (a ``configMap`` volume, ``projected`` sources)."""
    if not isinstance(volume, dict):
        return []
    out = [_name(volume.get("configMap"))]
    projected = volume.get("projected")
    sources = projected.get("sources") if isinstance(projected, dict) else None
    for source in sources if isinstance(sources, list) else []:
        if isinstance(source, dict):
            out.append(_name(source.get("configMap")))
    return [n for n in out if n is not None]


def config_maps(template: Mapping[str, Any]) -> Set[str]:
    """The ConfigMaps the template's GPU containers mount or read, by name."""
    spec = template.get("spec")
    spec = spec if isinstance(spec, dict) else {}
    volumes = spec.get("volumes")
    by_name = {v.get("name"): v for v in volumes if isinstance(v, dict)} \
        if isinstance(volumes, list) else {}
    found: Set[str] = set()
    for _slot, container, _count in gpu_containers(template):
        mounts = container.get("volumeMounts")
        for mount in mounts if isinstance(mounts, list) else []:
            if isinstance(mount, dict) and isinstance(mount.get("name"), str):
                found.update(_volume_maps(by_name.get(mount["name"])))
        sources = container.get("envFrom")
        for source in sources if isinstance(sources, list) else []:
            name = _name(source.get("configMapRef")) if isinstance(source, dict) else None
            if name is not None:
                found.add(name)
        env = container.get("env")
        for item in env if isinstance(env, list) else []:
            value_from = item.get("valueFrom") if isinstance(item, dict) else None
            name = _name(value_from.get("configMapKeyRef")) \
                if isinstance(value_from, dict) else None
            if name is not None:
                found.add(name)
    return found


def inputs_of(templates: Sequence[Mapping[str, Any]],
              versions: Optional[Versions]) -> List[List[Optional[str]]]:
    """The versions of the ConfigMaps the templates' GPU containers mount or read, sorted:
    ``[kind, name, uid, resourceVersion]`` each (uid and version None when the lookup does not
    know it); [] without a lookup."""
    if versions is None:
        return []
    names: Set[str] = set()
    for template in templates:
        names |= config_maps(template)
    out: List[List[Optional[str]]] = []
    for name in sorted(names):
        found = versions(VERSIONED, name)
        out.append([VERSIONED, name, found[0] if found else None, found[1] if found else None])
    return out


def of_containers(
    templates: Sequence[Sequence[Tuple[Slot, Mapping[str, Any], int]]], gpu_models: Iterable[str],
    world: Optional[Mapping[str, str]] = None,
    inputs: Optional[Sequence[Sequence[Optional[str]]]] = None,
) -> str:
    """The same digest from each template's GPU containers as ``resources.gpu_containers`` gives
    them (the webhook has them at hand already). ``world``: the distributed environment rank 0
    is traced in, for a kind whose world is not in its templates (a JobSet's replicas);
    ``inputs``: the versions of the ConfigMaps they read (``inputs_of``); each left out when
    empty, so every other digest is what it always was."""
    document: Dict[str, Any] = {
        "v": VERSION,
        "gpus": sorted(set(gpu_models)),
        "templates": [[_container(c, count) for _, c, count in group] for group in templates],
    }
    return _digest(document, world, inputs)


def _digest(document: Dict[str, Any], world: Optional[Mapping[str, str]],
            inputs: Optional[Sequence[Sequence[Optional[str]]]]) -> str:
    if world:
        document["world"] = {str(k): str(v) for k, v in world.items()}
    if inputs:
        document["inputs"] = [list(i) for i in inputs]
    try:
        text = orjson.dumps(document, option=orjson.OPT_SORT_KEYS)
    except TypeError:  # an integer beyond 64 bits somewhere (a client that reads them exactly)
        text = orjson.dumps(_plain(document), option=orjson.OPT_SORT_KEYS)
    return hashlib.sha256(text).hexdigest()[:DIGEST_CHARS]


# --- trial families ---------------------------------------------------------------------------
#
# A sweep's trials run one program with different option values. Their *family* is the
# fingerprint's document with the values of long command-line options (``--lr 0.1``,
# ``--lr=0.1``) and of literal environment variables taken out; each trial keeps those values as
# its *options*. Only plain values are taken out (letters, digits and ``._+-:,``, at most
# ``OPTION_VALUE_CHARS``): a path, a shell snippet, a short option's value (``-m module``,
# ``-c code``) and every positional word stay in the family, so two trials of one family run the
# same image, the same program and the same option names. Whether an option's value changes the
# program's memory is learned from traces (``controller.trials``), never assumed here.

OPTION_VALUE_CHARS = 64
_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789._+-:,")
_HOLE = "\x00"  # where a value was taken out


def _plain_value(value: Any) -> bool:
    return isinstance(value, str) and 0 < len(value) <= OPTION_VALUE_CHARS and \
        set(value) <= _PLAIN


def _is_number(word: str) -> bool:
    try:
        float(word)
    except ValueError:
        return False
    return True


def _is_option(word: Any) -> bool:
    return isinstance(word, str) and word.startswith("-") and len(word) > 1 and \
        not _is_number(word)


def split_argv(argv: Sequence[Any]) -> Tuple[List[Any], List[Tuple[str, str]]]:
    """The words with each long option's plain value replaced by a hole, and the (option,
    value) pairs taken out, in order. ``--lr 0.1`` and ``--lr=0.1`` both give ``("--lr",
    "0.1")``; a long option followed by another option or by nothing is a flag (no value)."""
    shape: List[Any] = []
    found: List[Tuple[str, str]] = []
    index = 0
    while index < len(argv):
        word = argv[index]
        index += 1
        if not (isinstance(word, str) and word.startswith("--") and len(word) > 2):
            shape.append(word)
            continue
        if "=" in word:
            name, value = word.split("=", 1)
            if _plain_value(value):
                shape.append(name + "=" + _HOLE)
                found.append((name, value))
            else:
                shape.append(word)
            continue
        shape.append(word)
        following = argv[index] if index < len(argv) else None
        if following is not None and not _is_option(following) and _plain_value(following):
            shape.append(_HOLE)
            found.append((word, following))
            index += 1
    return shape, found


def _trial_container(container: Mapping[str, Any], gpus: int, prefix: str,
                     options: Dict[str, str]) -> Dict[str, Any]:
    """The container's part of the family document; its option values go into ``options``."""
    doc = _container(container, gpus)
    words: List[Any] = []
    for part in ("command", "args"):
        value = doc.get(part)
        words.extend(value if isinstance(value, list) else [])
    shape, found = split_argv(words)
    seen: Dict[str, int] = {}
    for name, value in found:
        seen[name] = seen.get(name, 0) + 1
        options[f"{prefix}{name}" + (f"#{seen[name]}" if seen[name] > 1 else "")] = value
    split = len(doc["command"]) if isinstance(doc.get("command"), list) else 0
    doc["command"] = shape[:split] if isinstance(doc.get("command"), list) else doc["command"]
    doc["args"] = shape[split:] if isinstance(doc.get("args"), list) else doc["args"]
    env: List[Any] = []
    for item in doc["env"]:
        if type(item) is dict and type(item.get("name")) is str and \
                set(item) <= {"name", "value"} and _plain_value(item.get("value")):
            options[f"{prefix}${item['name']}"] = item["value"]
            env.append({"name": item["name"], "value": _HOLE})
        else:
            env.append(item)
    doc["env"] = env
    return doc


def trial_of(templates: Sequence[Sequence[Tuple[Slot, Mapping[str, Any], int]]],
             gpu_models: Iterable[str], world: Optional[Mapping[str, str]] = None,
             inputs: Optional[Sequence[Sequence[Optional[str]]]] = None,
             ) -> Tuple[str, Dict[str, str]]:
    """The trial family (a digest like the fingerprint's) and the trial's option values, from
    what ``of_containers`` takes. Option names are ``--name`` or ``$VARIABLE``; with more than
    one GPU container, prefixed by ``<template>.<container>:``. The whole fingerprint is the
    family plus the options: two workloads of one family with equal options have one
    fingerprint."""
    many = sum(len(group) for group in templates) > 1
    options: Dict[str, str] = {}
    document: Dict[str, Any] = {
        "v": VERSION, "family": 1,
        "gpus": sorted(set(gpu_models)),
        "templates": [[_trial_container(c, count, f"{t}.{i}:" if many else "", options)
                       for i, (_, c, count) in enumerate(group)]
                      for t, group in enumerate(templates)],
    }
    return _digest(document, world, inputs), options
