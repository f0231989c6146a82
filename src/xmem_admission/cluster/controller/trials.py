"""Trials share what they can: a workload that differs from an estimated one only in option
values that do not change its memory is sized from that estimate, without an estimation pod.

Families. A sweep's trials (Katib's, the Kubeflow SDK's, a shell loop's) run one image and
program with different option values. ``policy.fingerprint.trial_of`` splits a workload into its
*family* (the fingerprint's document with the plain values of long options and literal
variables taken out) and its *options* (``--lr: 0.1``, ``$SEED: 3``). Each estimate records
both (``spec.trial``, label ``xmem.io/trial-family``), and a traced one the digest of its traced
allocation sequence and per-GPU results (``status.allocationDigest``, from the probe).

Neutral options. Within a family (in one namespace), two traced estimates that differ in one
option's value only (the options already judged neutral aside) and have one digest make that
option *neutral*: the probe replayed the same allocations for both values. Two such estimates
with different digests make it *not neutral*, for good. Everything is read back from the
family's estimates (``knowledge``), so a restarted controller knows what it knew.

Sharing. A held workload whose fingerprint has no usable estimate is sized from a traced,
usable estimate of its family whose options differ from its own only in neutral ones
(``share``): its own estimate is written as a copy of that one's result with
``status.sharedFrom`` (the estimate, the options it differs in), and an Event
``EstimateShared`` on the workload says which estimate and which options. An option never
tested is not neutral: a trial whose value of such an option is new is traced.

Learning. While an option's neutrality is unknown, the line (``estimation_line``) asks
``select`` which waiting estimates of a family to trace: in line order, one that differs from a
traced (or tracing) one in one unknown option is traced, to learn it; one that would be sized
by sharing once the traces running now are read waits for them, and so does every later one of
its family that cannot be shared now (the family's pods start in line order); any other is
traced. A family's sweep is so traced once per value of each option that changes memory, plus
one trace per option learned. A family whose estimations fail (and none succeeded) teaches
nothing: its trials are traced as they come.

The safety net. A workload sized by sharing that runs out of GPU memory (``oom_retries``) is
retried as any other, and its estimate records the options it was shared over as not neutral
(``status.sharedFrom.refuted``): no later trial of the family shares over them.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import (
    TYPE_CHECKING,
    Any,
    Dict,
    FrozenSet,
    List,
    Mapping,
    Optional,
    Sequence,
    Set,
    Tuple,
)

from xmem_admission.cluster import labels
from xmem_admission.cluster.controller import records
from xmem_admission.cluster.integrations import fingerprint_of, gpu_templates
from xmem_admission.cluster.kube.client import GME, Obj
from xmem_admission.cluster.kube.resources import gpu_containers
from xmem_admission.cluster.policy import fingerprint
from xmem_admission.contract.errors import InvalidObjectError, KubeApiError

if TYPE_CHECKING:  # the context imports the line, which imports this module
    from xmem_admission.cluster.controller.context import Context

log = logging.getLogger(__name__)

FAMILY_LABEL = labels.PREFIX + "trial-family"
DIGEST = "allocationDigest"
SHARED_FROM = "sharedFrom"
SHARED_EVENT = "EstimateShared"
MEMBERS = 256  # a family's newest traced estimates the learning reads
DECIDE = 64  # traced estimates a waiting trial is compared with, traces chosen per pass
# What a shared estimate copies of its source's status (the result, not the source's history).
COPIED = ("mode", "steps", "seconds", "fallbackReason", "imageID", "peak", "estimates")

Options = Dict[str, str]


@dataclasses.dataclass(frozen=True)
class Trial:
    """A workload's place in its family."""

    family: str
    options: Mapping[str, str]


@dataclasses.dataclass
class Member:
    """One estimate of a family, as the learning reads it."""

    name: str
    options: Mapping[str, str]
    digest: str  # '' until traced (or never: shared, failed)
    usable: bool


@dataclasses.dataclass
class Knowledge:
    """What a family's estimates say: options judged neutral, options judged not neutral (and
    the pair of estimates that showed each), and its traced members."""

    neutral: Dict[str, Tuple[str, str]]
    not_neutral: Dict[str, str]
    traced: List[Member]


def differ(a: Mapping[str, str], b: Mapping[str, str]) -> Set[str]:
    """The options whose values differ (an option one lacks differs too)."""
    return {k for k in set(a) | set(b) if a.get(k) != b.get(k)}


def trial_of(ctx: Context, obj: Obj, fp: str, gpu_keys: Sequence[str]) -> Optional[Trial]:
    """The workload's trial, when it is one program estimated under ``fp`` (a workload that runs
    several programs is estimated per program, never shared)."""
    workload = ctx.workloads.get(str(obj.get("kind", "")))
    if workload is None:
        return None
    integration = workload.integration
    namespace = obj["metadata"]["namespace"]
    try:
        versions = ctx.versions(namespace)
        if fingerprint_of(integration, obj, gpu_keys, versions=versions) != fp:
            return None
        refs = integration.pod_templates(obj)
        groups = [list(gpu_containers(ref.template)) for ref in refs]
        world = integration.rank0_environment(obj) if integration.world_in_fingerprint else None
        inputs = fingerprint.inputs_of([ref.template for ref in refs], versions)
    except InvalidObjectError:
        return None
    family, options = fingerprint.trial_of(groups, gpu_keys, world, inputs)
    return Trial(family, options) if options else None


def mark(body: Obj, trial: Optional[Trial]) -> Obj:
    """A new estimate's body with its trial (``spec.trial``, the family label)."""
    if trial is None:
        return body
    body["metadata"].setdefault("labels", {})[FAMILY_LABEL] = trial.family
    body["spec"]["trial"] = {"family": trial.family, "options": dict(trial.options)}
    return body


def _trial(gme: Obj) -> Optional[Trial]:
    found = (gme.get("spec") or {}).get("trial")
    if not isinstance(found, dict) or not isinstance(found.get("family"), str):
        return None
    options = found.get("options")
    if not isinstance(options, dict):
        return None
    return Trial(found["family"], {str(k): str(v) for k, v in options.items()})


def _members(ctx: Context, namespace: str, family: str) -> List[Tuple[Obj, Trial]]:
    out: List[Tuple[Obj, Trial]] = []
    for gme in ctx.estimates.items():
        m = gme["metadata"]
        if m.get("namespace") != namespace or (m.get("labels") or {}).get(FAMILY_LABEL) != family \
                or "deletionTimestamp" in m:
            continue
        trial = _trial(gme)
        if trial is not None and trial.family == family:
            out.append((gme, trial))
    return out


def refuted(gme: Obj) -> Set[str]:
    """The options a shared estimate's out-of-memory showed not neutral."""
    shared = (gme.get("status") or {}).get(SHARED_FROM) or {}
    if not isinstance(shared, dict) or not shared.get("refuted"):
        return set()
    return {str(o) for o in shared.get("options") or []}


def learn(traced: Sequence[Member], refutations: Set[str]) -> Knowledge:
    """Judge each option from the traced members (see the module docstring): grouped by every
    other option's value (neutral ones left out), a group with two values of the option and one
    digest makes it neutral, a group whose digests differ makes it not neutral. Repeated while
    new neutral options regroup the members."""
    not_neutral: Dict[str, str] = {o: "an estimate shared over it ran out of GPU memory"
                                   for o in refutations}
    neutral: Dict[str, Tuple[str, str]] = {}
    names = sorted({k for m in traced for k in m.options})
    while True:
        found = False
        for option in names:
            if option in neutral or option in not_neutral:
                continue
            groups: Dict[Tuple[Tuple[str, Optional[str]], ...], List[Member]] = {}
            for member in traced:
                key = tuple((k, member.options.get(k)) for k in names
                            if k != option and k not in neutral)
                groups.setdefault(key, []).append(member)
            evidence: Optional[Tuple[str, str]] = None
            against: Optional[str] = None
            for group in groups.values():
                values = {m.options.get(option) for m in group}
                digests = {m.digest for m in group}
                if len(digests) > 1:
                    a, b = sorted(group, key=lambda m: m.digest)[0], \
                        sorted(group, key=lambda m: m.digest)[-1]
                    against = f"{a.name} and {b.name} differ in it and allocate differently"
                    break
                if len(values) > 1 and evidence is None:
                    pair = sorted(group, key=lambda m: str(m.options.get(option)))
                    evidence = (pair[0].name, pair[-1].name)
            if against is not None:
                not_neutral[option] = against
            elif evidence is not None:
                neutral[option] = evidence
                found = True
        if not found:
            break
    return Knowledge(neutral, not_neutral, list(traced))


def knowledge(ctx: Context, namespace: str, family: str,
              members: Optional[List[Tuple[Obj, Trial]]] = None) -> Knowledge:
    """What the family's estimates in the namespace say now."""
    found = members if members is not None else _members(ctx, namespace, family)
    traced: List[Member] = []
    refutations: Set[str] = set()
    for gme, trial in found:
        refutations |= refuted(gme)
        digest = (gme.get("status") or {}).get(DIGEST)
        if isinstance(digest, str) and digest and records.phase(gme) == records.SUCCEEDED \
                and not (gme.get("status") or {}).get(SHARED_FROM):
            traced.append(Member(gme["metadata"]["name"], trial.options, digest,
                                 records.usable(gme)))
    traced.sort(key=lambda m: m.name)
    return learn(traced[-MEMBERS:] if len(traced) > MEMBERS else traced, refutations)


def source_for(known: Knowledge, options: Mapping[str, str]) -> Optional[Tuple[Member, Set[str]]]:
    """A usable traced member whose options differ from ``options`` only in neutral ones (the
    fewest such differences first), and those options."""
    best: Optional[Tuple[Member, Set[str]]] = None
    for member in known.traced:
        if not member.usable:
            continue
        diff = differ(member.options, options)
        if diff <= set(known.neutral) and (best is None or len(diff) < len(best[1])):
            best = (member, diff)
    return best


# --- sharing, from a held workload's reconcile ------------------------------------------------

def share(ctx: Context, obj: Obj, fp: str, gpu_keys: Sequence[str],
          gme: Optional[Obj]) -> Optional[Obj]:
    """Size the workload's estimate (``gme``: none yet, or one still waiting for its pod) from
    a traced estimate of its family, when its options differ from that one's only in neutral
    ones; the estimate written, or None (then it is traced)."""
    namespace = obj["metadata"]["namespace"]
    if gme is not None and (records.phase(gme) != records.PENDING or
                            ctx.line.granted((namespace, gme["metadata"]["name"])) or
                            ctx.pods.get(namespace, records.pod_name(gme)) is not None):
        return None
    trial = _trial(gme) if gme is not None else None
    if trial is None:
        trial = trial_of(ctx, obj, fp, gpu_keys)
    if trial is None:
        return None
    known = knowledge(ctx, namespace, trial.family)
    found = source_for(known, trial.options)
    if found is None:
        return None
    member, diff = found
    source = ctx.estimates.get(namespace, member.name)
    if source is None or not records.usable(source) or not diff:
        return None
    status: Dict[str, Any] = {k: v for k, v in (source.get("status") or {}).items()
                              if k in COPIED}
    if "mode" in status:  # an older source GME wrote fake/profile
        status["mode"] = records.mode_name(status["mode"])
    status.update(phase=records.SUCCEEDED, completionTime=records.stamp(ctx.now()),
                  lastUsedTime=records.stamp(ctx.now()))
    status[SHARED_FROM] = {
        "estimate": member.name,
        "workload": ((source.get("spec") or {}).get("workload") or {}).get("name", ""),
        "options": sorted(diff),
        "evidence": {o: list(known.neutral[o]) for o in sorted(diff)},
    }
    try:
        if gme is None:
            image = ""
            for _ref, containers in gpu_templates(ctx.workloads[obj["kind"]].integration, obj):
                image = str(containers[0][1].get("image", "")) if containers else ""
                break
            gme = ctx.kube.create(GME, namespace, mark(records.new(obj, fp, list(gpu_keys),
                                                                   image), trial))
        written = ctx.kube.replace_status(GME, records.with_status(gme, status, ctx.now()))
    except KubeApiError as exc:
        if exc.conflict:  # someone else wrote it first: the next pass reads what they wrote
            return None
        raise
    ctx.estimates.put(written)
    changes = ", ".join(f"{o} {member.options.get(o)} -> {trial.options.get(o)}"
                        for o in sorted(diff))
    why = "; ".join(f"{o}: {a} and {b} differ only in it and allocate identically"
                    for o, (a, b) in ((o, known.neutral[o]) for o in sorted(diff)))
    ctx.emit(obj, "Normal", SHARED_EVENT,
             f"xmem: sized from estimate {member.name} (workload "
             f"{status[SHARED_FROM]['workload']}) without an estimation pod: it differs only in "
             f"{changes}, judged memory-neutral for this program ({why})")
    log.info("%s %s/%s shares estimate %s (%s)", obj.get("kind"), namespace,
             obj["metadata"]["name"], member.name, changes)
    return written


# --- choosing what to trace, from the line's dispatch -----------------------------------------

TRACE, LEARN, WAIT, SHARE = "trace", "learn", "wait", "share"


def _key(options: Mapping[str, str], neutral: Set[str]) -> Tuple[Tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in options.items() if k not in neutral))


def decide(known: Knowledge, pending: Sequence[Mapping[str, str]],
           waiting: Sequence[Mapping[str, str]], learning: bool = True,
           limit: int = DECIDE) -> List[str]:
    """For each waiting trial (in line order): ``SHARE`` (a traced member serves it now),
    ``WAIT`` (a trace running now, or chosen before it in this pass, will serve it or settle
    what it needs), ``LEARN`` (traced: it differs from another member in one unknown option
    only, so its trace settles that option) or ``TRACE``. ``pending``: the options of the
    family's estimates being traced now. Once one waits, every later one that cannot be shared
    waits too, so the family's pods still start in line order; so do those after the first
    ``limit`` traces of this pass (the line starts fewer at a time). ``learning`` False (a
    family whose traces fail teaches nothing): none waits."""
    neutral = set(known.neutral)
    settled = neutral | set(known.not_neutral)
    done = [m.options for m in known.traced if m.usable][-DECIDE:]
    serving = {_key(m.options, neutral) for m in known.traced if m.usable}
    ahead: List[Mapping[str, str]] = list(pending)
    testing: Set[str] = set()
    # The options the pending traces test already: each differs from another member (traced or
    # pending) in one unknown option only.
    for index, options in enumerate(ahead):
        for other in done + ahead[:index]:
            diff = differ(options, other) - neutral
            if len(diff) == 1 and not diff & settled:
                testing |= diff
    out: List[str] = []
    blocked = False
    chosen = 0
    for options in waiting:
        if _key(options, neutral) in serving:
            out.append(SHARE)
            continue
        if not learning:
            out.append(TRACE)
            continue
        hopeful = neutral | testing
        if blocked or chosen >= limit or any(differ(options, p) <= hopeful for p in ahead) or \
                any((differ(options, d) & testing) and differ(options, d) <= hopeful
                    for d in done):
            blocked = True
            out.append(WAIT)
            continue
        single = [differ(options, o) - neutral for o in done + ahead]
        learnable = [d for d in single if len(d) == 1 and not d & settled]
        if learnable:
            testing |= learnable[0]
        ahead.append(options)
        chosen += 1
        out.append(LEARN if learnable else TRACE)
    return out


def _families(ctx: Context) -> Dict[Tuple[str, str], List[Tuple[Obj, Trial]]]:
    """Every estimate that is a trial, by (namespace, family): one pass over the cache."""
    out: Dict[Tuple[str, str], List[Tuple[Obj, Trial]]] = {}
    for gme in ctx.estimates.items():
        m = gme["metadata"]
        family = (m.get("labels") or {}).get(FAMILY_LABEL)
        if not family or "deletionTimestamp" in m:
            continue
        trial = _trial(gme)
        if trial is not None and trial.family == family:
            out.setdefault((m.get("namespace", ""), family), []).append((gme, trial))
    return out


def select(ctx: Context, lines: Mapping[str, Sequence[Tuple[str, str]]],
           tracing: Set[Tuple[str, str]]) -> Tuple[Dict[str, List[Tuple[str, str]]],
                                                   List[Tuple[str, str]]]:
    """Of each namespace's waiting estimates (in line order), those to trace now and those that
    can be shared now (their workloads are woken to do it); the rest wait. ``tracing``: the
    estimates granted a slot or running."""
    families = _families(ctx) if any(lines.values()) else {}
    kept: Dict[str, List[Tuple[str, str]]] = {}
    shared: List[Tuple[str, str]] = []
    for namespace, keys in lines.items():
        by_family: Dict[str, List[Tuple[int, Obj, Trial]]] = {}
        chosen: Dict[int, bool] = {}
        for index, key in enumerate(keys):
            gme = ctx.estimates.get(*key)
            trial = _trial(gme) if gme is not None else None
            if gme is None or trial is None:
                chosen[index] = True
                continue
            by_family.setdefault(trial.family, []).append((index, gme, trial))
        for family, entries in by_family.items():
            members = families.get((namespace, family), [])
            known = knowledge(ctx, namespace, family, members)
            waiting_names: FrozenSet[str] = frozenset(g["metadata"]["name"]
                                                      for _, g, _ in entries)
            pending = [t.options for g, t in members
                       if g["metadata"]["name"] not in waiting_names and (
                           records.phase(g) == records.RUNNING or
                           (namespace, g["metadata"]["name"]) in tracing)]
            # A family whose traces fail and never succeed teaches nothing: trace, do not wait.
            failing = not known.traced and any(records.phase(g) == records.FAILED
                                               for g, _ in members)
            answers = decide(known, pending, [t.options for _, _, t in entries], not failing)
            for (index, _gme, _entry), answer in zip(entries, answers):
                chosen[index] = answer in (TRACE, LEARN)
                if answer == SHARE:
                    shared.append(keys[index])
        kept[namespace] = [k for i, k in enumerate(keys) if chosen.get(i)]
    return kept, shared


def shareable(ctx: Context, gme: Optional[Obj]) -> bool:
    """Whether a held workload's reconcile should look for an estimate to share: it has none
    yet, or the line's last dispatch found one for its waiting estimate."""
    if gme is None:
        return True
    key = (gme["metadata"]["namespace"], gme["metadata"]["name"])
    return key in ctx.line.shareable


# --- the safety net ---------------------------------------------------------------------------

def after_oom(ctx: Context, gme: Obj, workload: Obj, status: Dict[str, Any]) -> Dict[str, Any]:
    """A workload sized from ``gme`` ran out of GPU memory: when ``gme`` was shared, the options
    it was shared over are not neutral for its family from now on (the status to write)."""
    shared = status.get(SHARED_FROM)
    if not isinstance(shared, dict) or shared.get("refuted"):
        return status
    status = dict(status)
    status[SHARED_FROM] = dict(shared, refuted=records.stamp(ctx.now()))
    options = ", ".join(str(o) for o in shared.get("options") or [])
    ctx.emit(workload, "Warning", SHARED_EVENT,
             f"xmem: the workload ran out of GPU memory with the estimate shared from "
             f"{shared.get('estimate')}; {options} no longer judged memory-neutral for this "
             f"program: trials that differ in {'them' if ',' in options else 'it'} are traced")
    return status
