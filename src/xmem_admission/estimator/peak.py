"""The peak explained: what holds the memory at each GPU's simulated peak, and what would change it.

``explain(trace, gpus, ...)`` takes each GPU model's simulation of the trace (``Replays``: the
one the estimate made, where it is given), the event at which reserved memory peaks (what the
request is sized on) and the allocator's figures there, and reads the stream up to that event:

- the live blocks, grouped by (module, category) with the op that made most of each group's
  bytes, largest first (module and op come from trace format v2; a v1 trace has neither and
  groups by category only); block bytes are the allocator's rounded sizes;
- the allocator's cached-but-free bytes (reserved minus allocated) and, of those, the bytes in
  free pieces of split segments (``inactive_split_bytes``: fragmentation, memory a larger
  request cannot use).

``alternatives(...)`` answers "what would change it" by simulating the same trace again: with
``expandable_segments:True``; with the request's margin and MIG rounding as applied; on every
catalogue GPU, which fit; and which module's activations dominate the peak (the lever for
activation checkpointing or a smaller batch, named, never priced: the trace cannot say what
the job would allocate under another batch size).

Standard library only (probe bundle: the estimation pod's compact result carries the top groups).
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import defaultdict
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple

from xmem_admission.contract import gpus as catalogue
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
from xmem_admission.estimator.allocator.caching import CachingAllocator
from xmem_admission.estimator.allocator.simulate import SimulationResult
from xmem_admission.estimator.estimate import (
    allocator_capacity,
    allocator_room,
    nccl_bytes,
    overhead_for,
)
from xmem_admission.estimator.replays import Replays
from xmem_admission.estimator.trace import ALLOC, FREE, MARK, Category, Trace

TOP_GROUPS = 10  # groups listed in --json and the report; the rest is one line
OUTSIDE = "(outside modules)"  # how a block made outside any nn.Module is shown
_INDEX = re.compile(r"\.\d+(?=\.|$)")


@dataclasses.dataclass
class Group:
    """Live bytes of one (module, category) at the peak."""

    module: str
    category: str
    op: str  # the op that made most of these bytes
    bytes: int
    blocks: int
    ops: List[str] = dataclasses.field(default_factory=list)  # its ops, most bytes first (<= 3)

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class Peak:
    """One GPU's peak, itemised."""

    gpu: str
    event: int  # index of the event reaching the reserved peak, in this GPU's stream
    phase: str  # phase of that allocation (forward, backward, optimizer...)
    step: int  # optimizer steps completed before it
    allocated_bytes: int
    reserved_bytes: int
    cached_free_bytes: int  # reserved but not allocated
    fragmentation_bytes: int  # free pieces of split segments (inactive_split_bytes)
    groups: List[Group]  # largest first, at most TOP_GROUPS
    rest_bytes: int  # allocated bytes of the groups not listed
    rest_groups: int
    # the module whose activations hold most of the peak, repeated layers taken together
    # (``GPT.blocks.*.mlp``): {module, bytes, share of the allocated peak}; None: no activation
    dominant_activations: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        out = dataclasses.asdict(self)
        out["groups"] = [g.to_dict() for g in self.groups]
        return out

    @property
    def largest(self) -> Optional[Group]:
        return self.groups[0] if self.groups else None


def display_module(module: str) -> str:
    return module or OUTSIDE


def explain(trace: Trace, gpus: Sequence[catalogue.GPU], config: Optional[AllocatorConfig] = None,
            env: Optional[Dict[str, str]] = None, top: int = TOP_GROUPS,
            replays: Optional[Replays] = None) -> List[Peak]:
    """Each GPU's peak, itemised (see the module docstring). ``replays``: the streams and
    simulations the estimate made of ``trace`` (``estimate_trace``'s), reused here."""
    config = config if config is not None else AllocatorConfig()
    replays = replays if replays is not None else Replays(env)
    out = []
    for gpu in gpus:
        stream = replays.stream(trace, gpu)
        sim = replays.simulation(trace, gpu, config,
                                 allocator_room(trace, stream, gpu, replays.env))
        out.append(itemise(stream, sim, gpu.key, top))
    return out


def itemise(stream: Trace, sim: SimulationResult, gpu: str = "", top: int = TOP_GROUPS) -> Peak:
    """The state of ``stream`` (a GPU's allocation stream) right after its reserved peak, from
    its simulation ``sim``: the blocks live there, grouped, and the allocator's figures at that
    event."""
    events = stream.events
    event = sim.peak_reserved_event
    if event < 0:  # nothing was ever allocated
        return Peak(gpu, event, "", 0, 0, 0, 0, 0, [], 0, 0, None)
    rounding = CachingAllocator(sim.config)
    live: Dict[int, Any] = {}
    step = 0
    for e in events[:event + 1]:
        if e.op == ALLOC:
            live[e.id] = e
        elif e.op == FREE:
            live.pop(e.id, None)
        elif e.op == MARK and e.label.startswith("step "):
            step += 1
    sizes: Dict[Tuple[str, str], int] = defaultdict(int)
    counts: Dict[Tuple[str, str], int] = defaultdict(int)
    ops: Dict[Tuple[str, str], Dict[str, int]] = defaultdict(lambda: defaultdict(int))
    for e in live.values():
        if e.size == 0:
            continue
        size = rounding.round_size(e.size)
        key = (e.module, e.category)
        sizes[key] += size
        counts[key] += 1
        op = e.source or (e.phase if e.category == Category.WORKSPACE.value else "")
        ops[key][op] += size
    ranked = sorted(sizes, key=lambda k: (-sizes[k], k))
    groups = []
    for k in ranked[:top]:
        made_by = sorted(ops[k].items(), key=lambda kv: (-kv[1], kv[0]))
        groups.append(Group(k[0], k[1], made_by[0][0], sizes[k], counts[k],
                            [op for op, _ in made_by[:3]]))
    allocated = sim.allocated_at_peak_reserved
    reserved = sim.peak_reserved_bytes
    listed = sum(g.bytes for g in groups)
    peak_event = events[event]
    return Peak(gpu=gpu, event=event,
                phase=peak_event.phase if peak_event.op == ALLOC else "", step=step,
                allocated_bytes=allocated, reserved_bytes=reserved,
                cached_free_bytes=reserved - allocated,
                fragmentation_bytes=sim.inactive_split_at_peak_reserved,
                groups=groups, rest_bytes=max(allocated - listed, 0),
                rest_groups=max(len(ranked) - len(groups), 0),
                dominant_activations=_dominant_activations(sizes, allocated))


# -- what would change it ----------------------------------------------------------------------

@dataclasses.dataclass
class Alternatives:
    """The same trace simulated again under other settings (see ``alternatives``)."""

    expandable_segments: List[Dict[str, Any]]  # per target GPU: total and request with it
    requests: List[Dict[str, Any]]  # per target GPU: total, margin, request, MIG slice
    catalogue: List[Dict[str, Any]]  # every catalogue GPU: total, request, fits
    dominant_activations: Optional[Dict[str, Any]]  # {module, bytes, share} at the peak

    def to_dict(self) -> Dict[str, Any]:
        return dataclasses.asdict(self)


def _total(trace: Trace, gpu: catalogue.GPU, config: AllocatorConfig,
           replays: Replays) -> Tuple[int, bool, bool]:
    """Total, fits, and whether the simulation ran out of memory (then the total is what it
    reached before)."""
    nccl = nccl_bytes(trace, gpu, replays.env)
    stream = replays.stream(trace, gpu)
    outside = overhead_for(stream, gpu).total_bytes
    sim = replays.simulation(trace, gpu, config, allocator_capacity(gpu, outside) - nccl)
    total = sim.peak_reserved_bytes + nccl + outside
    return total, sim.oom is None and total <= gpu.capacity_bytes, sim.oom is not None


def catalogue_request(entry: Dict[str, Any]) -> str:
    """What a catalogue GPU's entry of ``Alternatives.catalogue`` can be asked for: the request,
    or, where the total fits the card but the margin does not, the whole card (a request above
    the card's capacity can never be granted)."""
    if entry["out_of_memory"] or not entry["fits"]:
        return "-" if entry["out_of_memory"] else _gib(entry["recommended_request_bytes"])
    if entry["recommended_request_bytes"] <= entry["capacity_bytes"]:
        return _gib(entry["recommended_request_bytes"])
    return (f"the whole card: {_gib(entry['total_bytes'])} of {_gib(entry['capacity_bytes'])}, "
            f"no room for the margin")


def request_for(total: int, margin: float) -> int:
    """The request for a total: the margin on top, as ``estimate_trace`` sizes it."""
    return int(math.ceil(total * (1.0 + margin)))


def with_expandable_segments(config: AllocatorConfig) -> AllocatorConfig:
    """``config`` with ``expandable_segments:True``: the alternative ``alternatives`` simulates
    on every target GPU (a ``Replays`` variant, made beside the estimate's own replays)."""
    return dataclasses.replace(config, expandable_segments=True)


def alternatives(trace: Trace, estimates: Sequence[Any], config: AllocatorConfig, margin: float,
                 peaks: Sequence[Peak], env: Optional[Dict[str, str]] = None,
                 everywhere: bool = True, replays: Optional[Replays] = None) -> Alternatives:
    """What would change the estimate, each figure from a simulation of ``trace``.

    ``estimates`` are the target GPUs' ``GPUEstimate``s; ``peaks`` their ``explain`` results;
    ``everywhere`` simulates every catalogue GPU too; ``replays`` shares the GPU streams made
    for the estimate."""
    replays = replays if replays is not None else Replays(env)
    expandable = with_expandable_segments(config)
    by_key = {g.key: g for g in catalogue.all_gpus()}
    with_expandable = []
    requests = []
    for est in estimates:
        gpu = by_key[est.gpu]
        total, fits, _ = (est.total_bytes, est.fits, est.oom is not None) \
            if config.expandable_segments else _total(trace, gpu, expandable, replays)
        with_expandable.append({"gpu": est.gpu, "total_bytes": total,
                                "saves_bytes": est.total_bytes - total,
                                "recommended_request_bytes": request_for(total, margin),
                                "fits": fits})
        profile = catalogue.smallest_mig_profile(gpu, est.recommended_request_bytes)
        # the high end's excess over the point, then the margin on the point
        excess = max(getattr(est, "high_bytes", 0) - est.total_bytes, 0)
        requests.append({"gpu": est.gpu, "total_bytes": est.total_bytes,
                         "range_bytes": excess,
                         "margin_bytes": est.recommended_request_bytes - est.total_bytes - excess,
                         "recommended_request_bytes": est.recommended_request_bytes,
                         "mig_profile": profile.name if profile else None,
                         "mig_slice_bytes": profile.memory_bytes if profile else None})
    everything = []
    if everywhere:
        # a catalogue GPU that is not a target is simulated once: its stream is not kept (19
        # streams of a long trace would hold gigabytes to the end of the command)
        done = {est.gpu: est for est in estimates}
        for gpu in catalogue.all_gpus():
            est = done.get(gpu.key)
            total, fits, oom = (est.total_bytes, est.fits, est.oom is not None) \
                if est is not None else _total(trace, gpu, config, Replays(replays.env))
            everything.append({"gpu": gpu.key, "capacity_bytes": gpu.capacity_bytes,
                               "total_bytes": total,
                               "recommended_request_bytes": request_for(total, margin),
                               "fits": fits, "out_of_memory": oom})
    return Alternatives(with_expandable, requests, everything,
                        peaks[0].dominant_activations if peaks else None)


def _dominant_activations(sizes: Mapping[Tuple[str, str], int],
                          allocated: int) -> Optional[Dict[str, Any]]:
    by_module: Dict[str, int] = defaultdict(int)
    for (module, category), size in sizes.items():
        if category == Category.ACTIVATION.value:
            by_module[_INDEX.sub(".*", module)] += size
    if not by_module:
        return None
    module, size = max(by_module.items(), key=lambda kv: (kv[1], kv[0]))
    share = size / allocated if allocated else 0.0
    return {"module": display_module(module), "bytes": size, "share": round(share, 3)}


def compact(peak: Peak, count: int = 3, width: int = 60) -> List[List[Any]]:
    """The top ``count`` groups for the termination message: [module, category, op, bytes],
    module paths cut from the front to ``width`` characters (the end names the layer)."""
    rows = []
    for g in peak.groups[:count]:
        module = display_module(g.module)
        if len(module) > width:
            module = "..." + module[len(module) - width + 3:]
        rows.append([module, g.category, g.op[:40], g.bytes])
    return rows


def as_mapping(rows: Sequence[Sequence[Any]]) -> List[Mapping[str, Any]]:
    """Compact rows back to named fields."""
    return [{"module": r[0], "category": r[1], "op": r[2], "bytes": r[3]} for r in rows]


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


@dataclasses.dataclass
class Explained:
    """``explain`` and ``alternatives`` together: what ``xmem estimate`` prints and reports."""

    peaks: List[Peak]
    alternatives: Alternatives

    def into(self, estimate: Dict[str, Any]) -> Dict[str, Any]:
        """``Estimate.to_dict()`` with each GPU's ``peak`` and the ``alternatives`` added."""
        by_gpu = {p.gpu: p.to_dict() for p in self.peaks}
        out = dict(estimate, gpus=[dict(g, peak=by_gpu.get(g["gpu"]))
                                   for g in estimate.get("gpus", [])])
        out["alternatives"] = self.alternatives.to_dict()
        return out

    def lines(self, rows: int = 5) -> List[str]:
        """The text output's part: the first GPU's peak as a short table, one line for each
        other GPU, then what would change it."""
        out: List[str] = []
        for index, p in enumerate(self.peaks):
            where = (f"{p.phase or 'setup'} of step {p.step + 1}" if p.phase else "")
            head = (f"at the peak on {p.gpu} ({where}): {_gib(p.allocated_bytes)} allocated, "
                    f"{_gib(p.cached_free_bytes)} cached but free "
                    f"({_gib(p.fragmentation_bytes)} of it in split segments)")
            if index:
                largest = p.largest
                if largest is not None:
                    out.append(f"{head}; largest: {display_module(largest.module)} "
                               f"{largest.category} ({largest.op}) {_gib(largest.bytes)}")
                continue
            out += ["", head]
            table: List[Tuple[str, ...]] = [("module", "category", "op", "size", "blocks")]
            for g in p.groups[:rows]:
                table.append((display_module(g.module), g.category, g.op, _gib(g.bytes),
                              str(g.blocks)))
            rest = p.rest_bytes + sum(g.bytes for g in p.groups[rows:])
            more = p.rest_groups + max(len(p.groups) - rows, 0)
            if more:
                table.append((f"({more} more groups)", "", "", _gib(rest), ""))
            out += ["  " + line for line in _columns(table)]
        alt = self.alternatives
        out += ["", "what would change it (the same trace simulated again):"]
        for e in alt.expandable_segments:
            out.append(f"  expandable_segments:True on {e['gpu']}: {_gib(e['total_bytes'])} "
                       f"({-e['saves_bytes'] / 2**30:+.2f} GiB), request "
                       f"{_gib(e['recommended_request_bytes'])}")
        for r in alt.requests:
            slice_ = (f", MIG slice {r['mig_profile']} ({_gib(r['mig_slice_bytes'])})"
                      if r["mig_profile"] else "")
            ranged = (f" + the range's high end {_gib(r['range_bytes'])}"
                      if r.get("range_bytes") else "")
            out.append(f"  request on {r['gpu']}: {_gib(r['total_bytes'])}{ranged} + margin "
                       f"{_gib(r['margin_bytes'])} = {_gib(r['recommended_request_bytes'])}"
                       f"{slice_}")
        if alt.catalogue:
            fit = [f"{c['gpu']} ({catalogue_request(c)})" for c in alt.catalogue if c["fits"]]
            out.append(f"  fits: {', '.join(fit) if fit else 'no catalogue GPU'}")
        dom = alt.dominant_activations
        if dom:
            out.append(f"  activations: {dom['module']} holds {_gib(dom['bytes'])} "
                       f"({100 * dom['share']:.0f}% of the allocated peak); activation "
                       f"checkpointing there or a smaller batch shrinks them")
        return out

    def to_dict(self) -> Dict[str, Any]:
        return {"peaks": [p.to_dict() for p in self.peaks],
                "alternatives": self.alternatives.to_dict()}


def _columns(rows: List[Tuple[str, ...]]) -> List[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]
