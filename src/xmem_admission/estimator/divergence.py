"""Where a trace and a real run part: a GPU's memory snapshot aligned with a trace of the job.

A real run's ``torch.cuda.memory._dump_snapshot()`` holds the allocator's request stream
(``device_traces``: alloc, free_requested, free_completed, segment_*); a trace, once rewritten
for the GPU (``orchestrate.for_gpu``, what ``xmem estimate`` and ``xmem simulate`` replay),
holds the stream the estimator believes the job makes. Both are cut into optimizer steps: the
trace at its ``step N`` marks (``probe.runner``), the snapshot at the end of each
``Optimizer.step`` in its ``external_annotations`` (the profiler ranges ``torch.optim`` opens,
recorded with the snapshot's history; their ``time_us`` and the trace entries' ``time_us``
share one clock). Within each step the two allocation streams are aligned by size
(``rounded``: PyTorch's 512-byte rounding, so a few bytes of padding do not count) and order,
with Myers' O(ND) difference (the shortest edit script) after the common head and tail are
set aside; a step whose streams differ by more than ``max_edits`` insertions and deletions is
matched by size counts instead (the k-th block of a size on one side pairs with the k-th on the
other), which keeps the cost bounded on streams of 10^5 events.

Unmatched blocks of the same size on both sides of a step are counted as moved (made in
another order), not missing. What is left is what one side has and the other lacks. Trace-only blocks carry their
module and op (trace format v2); GPU-only blocks are placed where the alignment puts them: in
a run the trace replaced, at the trace's block of the same position, else at the trace's block
just before them (and the trace's block after them is named too). Both are grouped by (module with layer indices as ``*``, op) and counted by
size. Standard library only.
"""

from __future__ import annotations

import bisect
import dataclasses
import re
from collections import Counter, defaultdict
from typing import Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.contract.cudnn import PLANS_FIELD
from xmem_admission.contract.errors import SnapshotError, TraceError
from xmem_admission.estimator.trace import ALLOC, MARK, Category, Trace

_FREE_ACTIONS = ("free_completed", "free")
# a layer's index in a module path: GPT.blocks.3.mlp -> GPT.blocks.*.mlp, and torchvision's
# encoder.layers.encoder_layer_3 -> encoder_layer_* (ResNet's layer1..layer4 stay apart)
_LAYER_INDEX = re.compile(r"(?<=[._])\d+(?=\.|$)")
OUTSIDE = "(outside modules)"
UNKNOWN_OP = "(op unknown)"
DEFAULT_MAX_EDITS = 2000  # per step: Myers costs O((N + M) * D) time and O(D^2) memory


def rounded(size: int) -> int:
    """The block PyTorch gives a request (``round_size`` without roundup divisions): at least
    512 bytes, a multiple of 512 (CUDACachingAllocator.cpp, kMinBlockSize)."""
    return max(512, (size + 511) // 512 * 512)


@dataclasses.dataclass(frozen=True)
class Request:
    """One allocation on either side: where it sits in its own stream and what made it."""

    index: int  # event index: in the snapshot's device trace, or in the GPU-rewritten trace
    size: int  # bytes requested
    module: str = ""
    op: str = ""

    @property
    def key(self) -> int:
        return rounded(self.size)


@dataclasses.dataclass
class Window:
    """One optimizer step (or what follows the last one) on both sides."""

    label: str
    gpu: List[Request]
    trace: List[Request]
    method: str = ""  # "edit script" or "size counts"
    matched: int = 0
    # (GPU's block, the trace's block it is placed at, the trace's next block after it)
    gpu_only: List[Tuple[Request, Request, Request]] = dataclasses.field(default_factory=list)
    trace_only: List[Request] = dataclasses.field(default_factory=list)
    # blocks both sides make in the step, in another order: (GPU's, trace's)
    moved: List[Tuple[Request, Request]] = dataclasses.field(default_factory=list)
    first: Optional[Tuple[int, int]] = None  # positions (gpu, trace) where they first part

    def to_dict(self) -> Dict[str, Any]:
        return {"step": self.label, "method": self.method, "gpu_allocs": len(self.gpu),
                "trace_allocs": len(self.trace), "matched": self.matched,
                "moved": len(self.moved),
                "gpu_only": len(self.gpu_only), "trace_only": len(self.trace_only),
                "gpu_only_bytes": sum(r.size for r, _, _ in self.gpu_only),
                "trace_only_bytes": sum(r.size for r in self.trace_only)}


@dataclasses.dataclass
class Divergence:
    """The alignment of one snapshot with one trace (``compare``)."""

    gpu: str
    snapshot_steps: int
    trace_steps: int
    windows: List[Window]
    unaligned: List[Window]  # steps only one side has (the run went on, or the trace did)
    max_edits: int

    @property
    def identical(self) -> bool:
        return all(not w.gpu_only and not w.trace_only and not w.moved for w in self.windows)

    def first_divergence(self, context: int = 3) -> Optional[Dict[str, Any]]:
        """The step and place where the two streams first part, with the sizes around it."""
        for w in self.windows:
            if w.first is None:
                continue
            g, t = w.first
            near = w.trace[min(t, len(w.trace) - 1)] if w.trace else None
            return {
                "step": w.label,
                "gpu_event": w.gpu[g].index if g < len(w.gpu) else None,
                "trace_event": w.trace[t].index if t < len(w.trace) else None,
                "gpu_sizes_before": [r.size for r in w.gpu[max(0, g - context):g]],
                "gpu_sizes_after": [r.size for r in w.gpu[g:g + context + 2]],
                "trace_sizes_before": [r.size for r in w.trace[max(0, t - context):t]],
                "trace_sizes_after": [r.size for r in w.trace[t:t + context + 2]],
                "module": near.module if near else "",
                "op": near.op if near else "",
            }
        return None

    def groups(self) -> List[Dict[str, Any]]:
        """Unmatched blocks by (module, op), largest difference first, counted by size."""
        gpu_more: Dict[Tuple[str, str], Counter[int]] = defaultdict(Counter)
        trace_more: Dict[Tuple[str, str], Counter[int]] = defaultdict(Counter)
        followed: Dict[Tuple[str, str], Counter[Tuple[str, str]]] = defaultdict(Counter)
        for w in self.windows:
            for request, place, after in w.gpu_only:
                gpu_more[_group(place)][request.size] += 1
                followed[_group(place)][_group(after)] += 1
            for request in w.trace_only:
                trace_more[_group(request)][request.size] += 1
        out: List[Dict[str, Any]] = []
        for key in set(gpu_more) | set(trace_more):
            g, t = gpu_more.get(key, Counter()), trace_more.get(key, Counter())
            out.append({"module": key[0], "op": key[1],
                        "gpu_only_bytes": sum(s * n for s, n in g.items()),
                        "trace_only_bytes": sum(s * n for s, n in t.items()),
                        "gpu_more": _by_size(g), "trace_more": _by_size(t)})
            if key in followed:  # where the trace goes on after the GPU's extra blocks
                (module, op), _ = followed[key].most_common(1)[0]
                out[-1]["gpu_more_before"] = {"module": module, "op": op}
        out.sort(key=lambda e: (-(e["gpu_only_bytes"] + e["trace_only_bytes"]), e["module"],
                                e["op"]))
        return out

    def by_size(self) -> List[Dict[str, Any]]:
        """Net block counts by size over the aligned steps: which sizes one side has more of."""
        net: Counter[int] = Counter()
        for w in self.windows:
            net.update(r.size for r, _, _ in w.gpu_only)
            net.subtract(r.size for r in w.trace_only)
        rows = [{"size": s, "gpu_more": n} for s, n in net.items() if n]
        rows.sort(key=lambda e: (-abs(e["size"] * e["gpu_more"]), e["size"]))
        return rows

    def to_dict(self) -> Dict[str, Any]:
        return {
            "gpu": self.gpu,
            "identical": self.identical,
            "steps": {"snapshot": self.snapshot_steps, "trace": self.trace_steps,
                      "aligned": len(self.windows)},
            "max_edits": self.max_edits,
            "moved": sum(len(w.moved) for w in self.windows),
            "gpu_only_bytes": sum(w.to_dict()["gpu_only_bytes"] for w in self.windows),
            "trace_only_bytes": sum(w.to_dict()["trace_only_bytes"] for w in self.windows),
            "first_divergence": self.first_divergence(),
            "windows": [w.to_dict() for w in self.windows],
            "unaligned": [w.to_dict() for w in self.unaligned],
            "groups": self.groups(),
            "by_size": self.by_size(),
        }


def _group(request: Request) -> Tuple[str, str]:
    return (_LAYER_INDEX.sub("*", request.module) or OUTSIDE, request.op or UNKNOWN_OP)


def _by_size(counts: Counter[int]) -> List[Dict[str, int]]:
    return [{"size": s, "count": n}
            for s, n in sorted(counts.items(), key=lambda kv: (-kv[0] * kv[1], kv[0]))]


# -- the two streams, cut into steps ----------------------------------------------------------
def snapshot_steps(data: Dict[str, Any], device: int = 0) -> Tuple[List[List[Request]], int]:
    """The snapshot's allocations of ``device`` cut at the end of each optimizer step; the
    last list holds what came after the last step. Also returns the number of steps found."""
    traces = data["device_traces"]
    if not any(e["action"] == "alloc" for trace in traces for e in trace):
        raise SnapshotError("the snapshot holds no allocation history (no 'alloc' in its "
                            "device_traces): it was dumped without "
                            "torch.cuda.memory._record_memory_history() running")
    if not 0 <= device < len(traces):
        raise SnapshotError(f"the snapshot has no trace for device {device} "
                            f"({len(traces)} device trace(s))")
    entries = traces[device]
    allocs = [Request(i, e.get("size", 0)) for i, e in enumerate(entries)
              if e["action"] == "alloc"]
    if not allocs:
        raise SnapshotError(f"the snapshot's device {device} allocated nothing while its "
                            f"history was recorded (choose another with --device)")
    ends = sorted(a["time_us"] for a in data.get("external_annotations") or []
                  if isinstance(a, dict) and a.get("stage") == "END"
                  and str(a.get("name", "")).startswith("Optimizer.step")
                  and a.get("device", device) == device and isinstance(a.get("time_us"), int))
    times = [e.get("time_us", 0) for e in entries]
    if ends and any(not isinstance(t, int) for t in times):
        ends = []
    # an entry belongs to the step whose END comes at or after its time
    cuts = [bisect.bisect_right(times, end) for end in ends] if ends else []
    windows: List[List[Request]] = [[] for _ in range(len(cuts) + 1)]
    for request in allocs:
        windows[bisect.bisect_right(cuts, request.index)].append(request)
    return windows, len(cuts)


def trace_steps(trace: Trace) -> Tuple[List[List[Request]], int]:
    """The trace's allocations cut at its ``step N`` marks, as ``snapshot_steps``.

    A workspace the GPU rewrite added (``orchestrate``: cuBLAS, cuDNN) has no module or op of
    its own: its op is its phase (``cudnn:fwd``, ``cublas:main``, without the plans) and its
    module the one that made the block before it (the convolution's output)."""
    windows: List[List[Request]] = [[]]
    module = ""
    for index, event in enumerate(trace.events):
        if event.op == ALLOC:
            op = event.source
            if not op and event.category == Category.WORKSPACE.value:
                op = event.phase.split(PLANS_FIELD)[0]
            else:
                module = event.module
            if event.size > 0:  # a 0-byte request never reaches the allocator
                windows[-1].append(Request(index, event.size, event.module or module, op))
        elif event.op == MARK and event.label.startswith("step "):
            windows.append([])
    return windows, len(windows) - 1


# -- alignment --------------------------------------------------------------------------------
def edit_script(a: Sequence[int], b: Sequence[int],
                max_edits: int) -> Optional[List[Tuple[int, int]]]:
    """Pairs (i, j) of a longest common subsequence of ``a`` and ``b`` by Myers' greedy
    O((N + M) D) algorithm; None when more than ``max_edits`` insertions and deletions
    separate them."""
    head = 0
    while head < len(a) and head < len(b) and a[head] == b[head]:
        head += 1
    tail = 0
    while tail < len(a) - head and tail < len(b) - head and a[-1 - tail] == b[-1 - tail]:
        tail += 1
    pairs = [(i, i) for i in range(head)]
    x_end, y_end = len(a) - tail, len(b) - tail
    middle = _myers(a[head:x_end], b[head:y_end], max_edits)
    if middle is None:
        return None
    pairs += [(i + head, j + head) for i, j in middle]
    pairs += [(x_end + k, y_end + k) for k in range(tail)]
    return pairs


def _myers(a: Sequence[int], b: Sequence[int], max_edits: int) -> Optional[List[Tuple[int, int]]]:
    n, m = len(a), len(b)
    if n == 0 or m == 0:
        return [] if n + m <= max_edits else None
    offset = n + m
    v = [0] * (2 * offset + 2)
    history: List[List[int]] = []
    for d in range(min(n + m, max_edits) + 1):
        for k in range(-d, d + 1, 2):
            if k == -d or (k != d and v[offset + k - 1] < v[offset + k + 1]):
                x = v[offset + k + 1]  # down: an insertion from b
            else:
                x = v[offset + k - 1] + 1  # right: a deletion from a
            y = x - k
            while x < n and y < m and a[x] == b[y]:
                x += 1
                y += 1
            v[offset + k] = x
            if x >= n and y >= m:
                history.append(v[offset - d:offset + d + 1])
                return _backtrack(history, n, m)
        history.append(v[offset - d:offset + d + 1])
    return None


def _backtrack(history: List[List[int]], n: int, m: int) -> List[Tuple[int, int]]:
    """Walk the saved frontiers back from (n, m), collecting the diagonal (matching) moves."""
    pairs: List[Tuple[int, int]] = []
    x, y = n, m
    for d in range(len(history) - 1, 0, -1):
        prev = history[d - 1]  # frontier of d - 1 edits: diagonal kk at prev[kk + d - 1]
        k = x - y
        if k == -d or (k != d and prev[k - 1 + d - 1] < prev[k + 1 + d - 1]):
            prev_k = k + 1
        else:
            prev_k = k - 1
        prev_x = prev[prev_k + d - 1]
        prev_y = prev_x - prev_k
        # the snake (diagonal run) that ended at (x, y) began after the edit from prev
        start_x = prev_x if prev_k == k + 1 else prev_x + 1
        while x > start_x and y > start_x - k:
            x -= 1
            y -= 1
            pairs.append((x, y))
        x, y = prev_x, prev_y
    while x > 0 and y > 0:  # the snake of d = 0
        x -= 1
        y -= 1
        pairs.append((x, y))
    pairs.reverse()
    return pairs


def _by_counts(a: Sequence[int], b: Sequence[int]) -> List[Tuple[int, int]]:
    """Pair the k-th occurrence of each value in ``a`` with its k-th in ``b``."""
    positions: Dict[int, List[int]] = defaultdict(list)
    for j, value in enumerate(b):
        positions[value].append(j)
    taken: Counter[int] = Counter()
    pairs = []
    for i, value in enumerate(a):
        js = positions.get(value)
        if js and taken[value] < len(js):
            pairs.append((i, js[taken[value]]))
            taken[value] += 1
    pairs.sort(key=lambda p: p[1])
    # keep them increasing on both sides, as an alignment must
    kept: List[Tuple[int, int]] = []
    for i, j in pairs:
        if not kept or i > kept[-1][0]:
            kept.append((i, j))
    return kept


def align(window: Window, max_edits: int) -> None:
    """Fill ``window``'s matches and the blocks each side has that the other lacks."""
    a = [r.key for r in window.trace]
    b = [r.key for r in window.gpu]
    pairs = edit_script(a, b, max_edits)
    window.method = "edit script"
    if pairs is None:
        pairs = _by_counts(a, b)
        window.method = "size counts"
    window.matched = len(pairs)
    matched_trace = {i for i, _ in pairs}
    window.trace_only = [r for i, r in enumerate(window.trace) if i not in matched_trace]
    bounds = [(-1, -1)] + pairs + [(len(a), len(b))]
    for (i0, j0), (i1, j1) in zip(bounds, bounds[1:]):
        gap_t = list(range(i0 + 1, i1))
        gap_g = list(range(j0 + 1, j1))
        if (gap_t or gap_g) and window.first is None:
            window.first = (j0 + 1, i0 + 1)
        after = window.trace[i1] if i1 < len(window.trace) else Request(-1, 0)
        for n, j in enumerate(gap_g):
            if gap_t:  # a run the trace replaced: the trace's block at the same position
                place = window.trace[gap_t[n * len(gap_t) // len(gap_g)]]
            elif i0 >= 0:
                place = window.trace[i0]
            else:
                place = after
            window.gpu_only.append((window.gpu[j], place, after))
    _pair_moved(window)


def _pair_moved(window: Window) -> None:
    """Unmatched blocks of one size on both sides of a step are the same blocks made in
    another order (or where the alignment chose another partner): moved, not missing."""
    waiting: Dict[int, List[Request]] = defaultdict(list)
    for request in window.trace_only:
        waiting[request.key].append(request)
    gpu_only = []
    for request, place, after in window.gpu_only:
        partners = waiting.get(request.key)
        if partners:
            window.moved.append((request, partners.pop(0)))
        else:
            gpu_only.append((request, place, after))
    moved = {id(t) for _, t in window.moved}
    window.gpu_only = gpu_only
    window.trace_only = [r for r in window.trace_only if id(r) not in moved]


def compare(data: Dict[str, Any], trace: Trace, gpu: str = "", device: int = 0,
            max_edits: int = DEFAULT_MAX_EDITS) -> Divergence:
    """Align a loaded snapshot with a trace already rewritten for the GPU (``for_gpu``)."""
    if max_edits < 0:
        raise TraceError("max_edits must not be negative")
    gpu_windows, gpu_steps = snapshot_steps(data, device)
    trace_windows, steps = trace_steps(trace)
    if not any(trace_windows):
        raise TraceError("the trace holds no allocation")
    if gpu_steps and steps:
        count = min(gpu_steps, steps)
        labels = [f"step {n + 1}" for n in range(count)]
        windows = [Window(label, g, t) for label, g, t in
                   zip(labels, gpu_windows[:count], trace_windows[:count])]
        unaligned = [Window(f"after step {count} (snapshot)", [r for w in gpu_windows[count:]
                                                                for r in w], []),
                     Window(f"after step {count} (trace)", [],
                            [r for w in trace_windows[count:] for r in w])]
        unaligned = [w for w in unaligned if w.gpu or w.trace]
    else:  # no step boundaries on one side: the whole streams, as one window
        windows = [Window("whole run", [r for w in gpu_windows for r in w],
                          [r for w in trace_windows for r in w])]
        unaligned = []
    for window in windows:
        align(window, max_edits)
    for window in unaligned:
        window.method = "unaligned"
    return Divergence(gpu, gpu_steps, steps, windows, unaligned, max_edits)
