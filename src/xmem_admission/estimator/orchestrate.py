"""CPU trace -> the allocation stream a CUDA run of the same job would make on a given GPU.

The probe already drops host memory (only storages on the virtual GPU are traced) and already
runs the CUDA code paths whose tensors differ (autocast lists, fused dropout, flash /
memory-efficient attention, foreach optimizers: see ``virtual_cuda``). What is left are buffers
that exist only on a GPU and depend on the GPU model: the cuBLAS workspaces, and the cuDNN
convolution workspaces. The probe marks the
first BLAS op of each thread (``cublas:main`` for forward ops, ``cublas:autograd`` for the
autograd engine's device thread); here each mark becomes the allocations CUDA makes at that
moment, sized for the target GPU. They are never freed: PyTorch keeps a workspace per
(handle, stream) for the life of the process (CublasHandlePool.cpp, ``getCUDABlasLtWorkspace`` /
``getCurrentCUDABlasHandle`` cache them in a map).

The probe marks each convolution PyTorch runs through cuDNN (``cudnn:fwd``,
``cudnn:bwd_data+bwd_filter`` with the shapes, geometry, layout, dtype and cuDNN flags;
``conv_marks``); each call becomes a workspace allocated and freed at once, in the order of
``cudnn_convolution_backward`` (data, then filter). Its size comes from cuDNN itself where this
process can load a cuDNN that plans without a GPU (9.11 and newer, ``cudnn_heuristics``): the
plans PyTorch tries for the call on the target GPU, in its order, ride on the allocation
(``contract.cudnn.plans_phase``) and the simulator replays ``try_plans``: the first workspace
the allocator can give is used, a plan needing none always runs. With ``cudnn.benchmark`` on,
the first call of each shape also holds the search's block while the plans are timed, then
empties the cache (``benchmark_search``). Where no such cuDNN is here, or for a mark it cannot
plan (an older trace's, a 3-D convolution), the architecture's fitted rule (``contract.cudnn``)
sizes it, or nothing where there is none; which of them answered is in the trace's meta
(``conv_workspaces``) and the estimate's output.

The probe marks each reduction that runs through PyTorch's ``gpu_reduce_kernel`` on a GPU
(``reduce:``, ``reductions``); where the kernel's launch configuration for the target GPU (its
SM count) splits each output across thread blocks, the kernel's staging buffer and semaphores
are allocated after the reduction's output and freed at once, semaphores first. The meta's
``reduction_staging`` counts them.

Standard library only (probe bundle).
"""

from __future__ import annotations

import math
import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any, Dict, List, Mapping, Optional, Set, Tuple

from xmem_admission.contract import cudnn
from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator import cudnn_heuristics as heuristics
from xmem_admission.estimator import reductions
from xmem_admission.estimator.conv_marks import ConvMark
from xmem_admission.estimator.trace import (
    ALLOC,
    EMPTY_CACHE,
    FREE,
    MARK,
    Alloc,
    Category,
    EmptyCache,
    Event,
    Free,
    Trace,
)

_WORKSPACE_CONFIG = re.compile(r"^(:\d+:\d+)+$")


def cublas_workspace_bytes(gpu: GPU, env: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLAS workspace per handle: ``CUBLAS_WORKSPACE_CONFIG`` wins over the GPU default.

    The variable reads ``:SIZE_KIB:COUNT[:SIZE_KIB:COUNT...]`` and the workspace is the sum of
    SIZE_KIB * 1024 * COUNT (CublasHandlePool.cpp, ``parseChosenWorkspaceSize``); a malformed
    value falls back to the default there too.
    """
    env = os.environ if env is None else env
    config = env.get("CUBLAS_WORKSPACE_CONFIG", "")
    if config and _WORKSPACE_CONFIG.match(config):
        numbers = [int(n) for n in config.strip(":").split(":")]
        return sum(size * 1024 * count for size, count in zip(numbers[::2], numbers[1::2]))
    return gpu.cublas_workspace_bytes


def cublaslt_workspace_bytes(gpu: GPU, env: Optional[Mapping[str, str]] = None) -> int:
    """The cuBLASLt workspace per handle; zero when it shares the cuBLAS one.

    ``TORCH_CUBLASLT_UNIFIED_WORKSPACE=1`` makes Lt reuse the cuBLAS workspace, and
    ``CUBLASLT_WORKSPACE_SIZE`` (KiB) sets its size (CublasHandlePool.cpp,
    ``parseCUDABlasLtWorkspaceSize``).
    """
    env = os.environ if env is None else env
    if env.get("TORCH_CUBLASLT_UNIFIED_WORKSPACE") == "1":
        return 0
    size = env.get("CUBLASLT_WORKSPACE_SIZE", "")
    if size.isdigit():
        return int(size) * 1024
    return gpu.cublaslt_workspace_bytes


def conv_workspaces(label: str, rule: cudnn.ConvWorkspaceRule,
                    cap_bytes: Optional[int] = None) -> List[Tuple[str, int]]:
    """(call, workspace bytes) by the fitted ``rule`` for each cuDNN call of a ``cudnn:`` mark
    (``conv_marks``: marks of older traces and newer ones alike), in the order they run."""
    mark = ConvMark.parse(label)

    def nbytes(shape: Tuple[int, ...]) -> int:
        return math.prod(shape) * mark.itemsize

    x, y, w = nbytes(mark.x), nbytes(mark.y), nbytes(mark.w)
    return [(call, cudnn.workspace_bytes(rule, cudnn.ConvCall(call), x, y, w, cap_bytes))
            for call in mark.calls]


@dataclass(frozen=True)
class PlannedCall:
    """One cuDNN call of a mark as cuDNN's heuristics size it: the workspaces PyTorch tries in
    order (``tried_workspaces``), and with ``cudnn.benchmark`` those of the plans its search
    times (largest first), empty when the call's plan is already cached."""

    call: str
    workspaces: Tuple[int, ...]
    search: Tuple[int, ...] = ()
    # every plan's workspace in the heuristics' order, up to the first plan needing none (before
    # ``tried_workspaces`` drops those no smaller than an earlier one): the plans a GPU may run
    # for the call, the range of ``for_gpu``'s low and high ends
    ranked: Tuple[int, ...] = ()


def _traced_or_own(traced_library: Optional[str],
                   traced_cudnn: Optional[int]) -> heuristics.CudnnLibrary:
    """The libcudnn to plan with: the traced torch's own (the probe records its path) where it is
    on this machine and of the version the trace names and this process has no other cuDNN
    loaded, so `xmem estimate --python` plans as the estimation pod beside that torch does;
    else this environment's (``load_cudnn``)."""
    if traced_library and os.path.isfile(traced_library):
        try:
            lib = heuristics.load_cudnn(traced_library)
        except heuristics.CudnnPlanningUnavailable:
            pass
        else:
            if traced_cudnn is None or lib.version == traced_cudnn:
                return lib
    return heuristics.load_cudnn()


class ConvPlanner:
    """Sizes the convolution workspaces of one trace for one GPU: cuDNN's heuristics where a
    cuDNN here plans without a GPU, else the architecture's fitted rule (``source``, and
    ``cudnn`` the version that answered or could not). Keeps count of what answered."""

    def __init__(self, gpu: GPU, env: Optional[Mapping[str, str]] = None,
                 conv_rule: Optional[cudnn.ConvWorkspaceRule] = None,
                 library: Optional[heuristics.CudnnLibrary] = None,
                 use_heuristics: bool = True, resident_bytes: Optional[int] = None,
                 traced_cudnn: Optional[int] = None,
                 traced_library: Optional[str] = None) -> None:
        self.gpu = gpu
        self.env: Mapping[str, str] = os.environ if env is None else env
        self.rule = conv_rule if conv_rule is not None else cudnn.rule_for(
            gpu.compute_capability)
        self.cap = cudnn.workspace_cap_bytes(self.env)
        self.library: Optional[heuristics.CudnnLibrary] = None
        self.cudnn_version: Optional[str] = None
        self.why_not = ""
        if (use_heuristics and conv_rule is None and library is None and traced_cudnn
                and traced_cudnn < heuristics.DEVICELESS_MIN_VERSION):
            # The trace comes from a torch whose cuDNN cannot plan without a GPU (torch 2.2-2.6
            # bring 8.9 and 9.1): the estimation pod beside it takes the rule, and so does any
            # other place that simulates its trace (`xmem estimate --python`), whatever cuDNN
            # this process has.
            self.cudnn_version = heuristics.version_text(traced_cudnn)
            self.why_not = (f"the traced torch's cuDNN {self.cudnn_version} cannot plan without"
                            " a GPU (deviceless plans need 9.11 or newer)")
        elif use_heuristics and conv_rule is None:
            try:
                lib = library or _traced_or_own(traced_library, traced_cudnn)
                self.cudnn_version = lib.version_text
                if lib.deviceless:
                    self.library = lib
                else:
                    self.why_not = (f"cuDNN {lib.version_text} ({lib.path}) cannot plan without"
                                    " a GPU (deviceless plans need 9.11 or newer)")
            except heuristics.CudnnPlanningUnavailable as err:
                self.why_not = str(err)
        elif conv_rule is not None:
            self.why_not = "a rule was given"
        else:
            self.why_not = "cuDNN's heuristics not asked"
        self._benchmarked: Set[Tuple[Any, ...]] = set()
        self.planned_calls = 0
        self.rule_calls = 0
        self.unmodelled_calls = 0
        self.unplannable: Dict[str, int] = {}
        self.resident_override = resident_bytes
        self.resident_bytes = 0
        self.resident_source = ""
        # The range of a call the point sizes by the rule or not at all (a trace whose cuDNN
        # cannot plan without a GPU): the plans this process's cuDNN ranks for the target GPU,
        # where it plans without one (``range_library``).
        self.range_library: Optional[heuristics.CudnnLibrary] = None
        self.range_why_not = ""
        if self.library is None and use_heuristics and library is None:
            try:
                own = heuristics.load_cudnn()
            except heuristics.CudnnPlanningUnavailable as err:
                self.range_why_not = str(err)
            else:
                if own.deviceless:
                    self.range_library = own
                else:
                    self.range_why_not = (f"cuDNN {own.version_text} ({own.path}) cannot plan "
                                          "without a GPU")
        self.range_calls = 0  # calls whose workspace the GPU may pick otherwise than the point
        self.range_unknown_calls = 0  # calls sized by the rule or not at all, with no plans

    def hold_resident(self, planned: bool) -> int:
        """The bytes held from the first convolution on (``planned``: that convolution was
        sized by cuDNN's heuristics, else by the rule, whose own fitted figure goes with it)."""
        if self.resident_override is not None:
            size, source = self.resident_override, "given"
        elif planned:
            size, source = cudnn.heuristics_resident_bytes(self.gpu.compute_capability)
        elif self.rule is not None:
            size, source = self.rule.resident_bytes, self.rule.source
        else:
            size, source = 0, "no rule for this architecture"
        self.resident_bytes, self.resident_source = size, source
        return size

    @property
    def source(self) -> cudnn.WorkspaceSource:
        if self.library is not None and self.planned_calls:
            return cudnn.WorkspaceSource.HEURISTICS
        if self.rule is not None and (self.rule_calls or self.library is None):
            return cudnn.WorkspaceSource.FITTED_RULE
        return cudnn.WorkspaceSource.NONE

    def describe(self) -> Dict[str, Any]:
        """What sized the workspaces: the trace's ``conv_workspaces`` meta."""
        out: Dict[str, Any] = {"source": self.source.value, "cudnn": self.cudnn_version,
                               "planned_calls": self.planned_calls,
                               "rule_calls": self.rule_calls,
                               "unmodelled_calls": self.unmodelled_calls,
                               "resident_bytes": self.resident_bytes,
                               "resident_source": self.resident_source}
        if self.library is not None:
            out["cudnn_library"] = self.library.path
        if self.why_not:
            out["heuristics_unavailable"] = self.why_not
        if self.rule is not None:
            out["rule"] = self.rule.source
        if self.unplannable:
            out["not_planned"] = dict(self.unplannable)
        if self.range_calls or self.range_unknown_calls:
            ranged: Dict[str, Any] = {"calls": self.range_calls,
                                      "unknown_calls": self.range_unknown_calls}
            ranker = self.library or self.range_library
            if ranker is not None:
                ranged["cudnn"] = ranker.version_text
            elif self.range_why_not:
                ranged["unknown_why"] = self.range_why_not
            out["range"] = ranged
        return out

    def ranked(self, mark: ConvMark) -> Optional[List[Tuple[int, ...]]]:
        """Per call of the mark, the workspaces of the plans cuDNN's heuristics rank for the
        target GPU (``PlannedCall.ranked``), asked of ``range_library`` for a mark the point
        sizes by the rule or not at all; None where no cuDNN here can say."""
        if self.range_library is None:
            return None
        try:
            calls = heuristics.mark_calls(mark)
            if calls and calls[0][0].dtype == "bfloat16" and self.gpu.compute_capability < (8, 0):
                return [() for _ in mark.calls]
            return [tuple(self._ranked(conv, call, mark, self.range_library))
                    for conv, call in calls]
        except (ValueError, heuristics.CudnnCallError):
            return None

    def plan(self, mark: ConvMark) -> Optional[List[PlannedCall]]:
        """The mark's calls sized by cuDNN's heuristics; None where they cannot (no deviceless
        cuDNN here, or a mark it cannot plan: the reason is counted)."""
        if self.library is None:
            return None
        try:
            calls = heuristics.mark_calls(mark)
        except ValueError as err:
            reason = str(err)[:160]
            self.unplannable[reason] = self.unplannable.get(reason, 0) + 1
            return None
        if calls and calls[0][0].dtype == "bfloat16" and self.gpu.compute_capability < (8, 0):
            # supportsBFloat16ConvolutionWithCuDNNv8 (CUDAHooks.cpp): not cuDNN before 8.0
            self.planned_calls += len(calls)
            return [PlannedCall(name, ()) for name in mark.calls]
        out: List[PlannedCall] = []
        try:
            for name, (conv, call) in zip(mark.calls, calls):
                ranked = self._ranked(conv, call, mark, self.library)
                tried = cudnn.tried_workspaces(ranked)
                search: Tuple[int, ...] = ()
                if mark.benchmark:
                    key = (conv, call, mark.allow_tf32, mark.deterministic)
                    if key not in self._benchmarked:  # get_plans_from_find: once per key
                        self._benchmarked.add(key)
                        search = tuple(sorted(set(self._workspaces(conv, call, mark,
                                                                   benchmark=True)),
                                              reverse=True))
                out.append(PlannedCall(name, tuple(tried), search, tuple(ranked)))
        except heuristics.CudnnCallError as err:
            reason = f"cuDNN refused the graph: {err}"[:200]
            self.unplannable[reason] = self.unplannable.get(reason, 0) + 1
            return None
        self.planned_calls += len(out)
        return out

    def _workspaces(self, conv: heuristics.Convolution, call: cudnn.ConvCall, mark: ConvMark,
                    benchmark: bool,
                    library: Optional[heuristics.CudnnLibrary] = None) -> List[int]:
        sizes = _torch_workspaces(self.gpu, conv, call, mark.allow_tf32 is not False,
                                  bool(mark.deterministic), benchmark,
                                  self.env.get("TORCH_CUDNN_USE_HEURISTIC_MODE_B") == "1",
                                  self.env.get("CUDNN_ERRATA_JSON_FILE", ""),
                                  library or self.library)
        if self.cap is not None:  # CUDNN_CONV_WSCAP_DBG: only engines within the cap
            sizes = [s for s in sizes if s <= self.cap]
        return sizes

    def _ranked(self, conv: heuristics.Convolution, call: cudnn.ConvCall, mark: ConvMark,
                library: Optional[heuristics.CudnnLibrary]) -> List[int]:
        """The workspaces of the plans PyTorch would try for the call, in order, up to the first
        one needing none (``torch_workspaces(..., until_no_workspace=True)``)."""
        return self._workspaces(conv, call, mark, benchmark=False, library=library)


_PLAN_CACHE: Dict[Tuple[Any, ...], List[int]] = {}
_PLAN_LOCK = threading.Lock()


def _torch_workspaces(gpu: GPU, conv: heuristics.Convolution, call: cudnn.ConvCall,
                      allow_tf32: bool, deterministic: bool, benchmark: bool,
                      mode_b: bool, errata_file: str,
                      library: Optional[heuristics.CudnnLibrary]) -> List[int]:
    """``cudnn_heuristics.torch_workspaces``, remembered per process (about 8 ms a query)."""
    key = (gpu.key, conv, call, allow_tf32, deterministic, benchmark, mode_b, errata_file,
           library.path if library is not None else None)
    with _PLAN_LOCK:
        found = _PLAN_CACHE.get(key)
    if found is None:
        errata = heuristics.errata_from_env({"CUDNN_ERRATA_JSON_FILE": errata_file}
                                            if errata_file else {})
        found = heuristics.torch_workspaces(gpu, conv, call, allow_tf32, deterministic,
                                            heuristic_mode_b=mode_b, benchmark=benchmark,
                                            extra_errata=errata, library=library,
                                            until_no_workspace=not benchmark)
        with _PLAN_LOCK:
            _PLAN_CACHE[key] = found
    return list(found)


@dataclass
class _Stream:
    """The events of the rewritten trace, with fresh ids for what the rewrite adds."""

    events: List[Event]
    next_id: int
    category: str = field(default=Category.WORKSPACE.value)

    def transient(self, size: int, phase: str) -> None:
        self.events.append(Alloc(ALLOC, self.next_id, size, 0, self.category, phase))
        self.events.append(Free(FREE, self.next_id))
        self.next_id += 1

    def held(self, size: int, phase: str) -> None:
        self.events.append(Alloc(ALLOC, self.next_id, size, 0, self.category, phase))
        self.next_id += 1


# Which stream ``for_gpu`` makes: the point estimate's (cuDNN's first plan, the fitted rule), or
# the low or the high end of the range of plans a GPU may run for each convolution.
POINT, LOW, HIGH = "point", "low", "high"
ENDS = (POINT, LOW, HIGH)


def _ranged(calls: List[PlannedCall], end: str) -> List[PlannedCall]:
    """The planned calls with each one's first workspace taken at the ``end`` of its ranked
    plans: the smallest (the GPU runs a plan needing least), or the largest, tried first and
    then the point's own fall-through."""
    if end == POINT:
        return calls
    out = []
    for call in calls:
        ranked = call.ranked or call.workspaces
        if not ranked:
            out.append(call)
        elif end == LOW:
            out.append(PlannedCall(call.call, (min(ranked),), call.search, ranked))
        else:
            first = (max(ranked),) + tuple(call.workspaces)
            out.append(PlannedCall(call.call, tuple(cudnn.tried_workspaces(first)),
                                   call.search, ranked))
    return out


def _emit_planned(stream: _Stream, planned: List[PlannedCall]) -> None:
    for call in planned:
        if call.search and call.search[0] > 0:
            # get_plans_from_find (Conv_v8.cpp): generate_and_filter_plans holds the largest
            # workspace that fits while it times every plan, then "Replicate v7 behavior: clear
            # cached blocks" (emptyCache, _cudnn_get_conv_benchmark_empty_cache on by default)
            stream.transient(call.search[0], cudnn.plans_phase(
                f"{cudnn.SEARCH_PREFIX}{call.call}", cudnn.tried_workspaces(call.search)))
            stream.events.append(EmptyCache(EMPTY_CACHE))
        # the plan that runs: the fastest one timed is a measurement; the heuristics' order
        # (try_plans) stands for it
        if call.workspaces and call.workspaces[0] > 0:
            stream.transient(call.workspaces[0], cudnn.plans_phase(
                f"{cudnn.TRANSIENT_PREFIX}{call.call}", call.workspaces))


class _ReductionStaging:
    """Turns ``reduce:`` marks into the staging buffers and semaphores each launch takes on the
    GPU (``reductions``): buffer, semaphores, then their frees, semaphores first, as the
    ``at::DataPtr`` locals of ``gpu_reduce_kernel`` go; a reduction of a converted copy of its
    input holds that copy around them."""

    def __init__(self, gpu: GPU) -> None:
        self.device = reductions.device_of(gpu)
        self.marks = 0
        self.launches = 0
        self.largest = 0
        self.copies = 0
        self.unreadable = 0

    def add(self, label: str, stream: _Stream) -> None:
        self.marks += 1
        try:
            mark = reductions.ReductionMark.parse(label)
        except ValueError:
            self.unreadable += 1
            return
        phase = f"{reductions.PREFIX}{mark.op}"
        events = stream.events
        # the kernel's stream: the reduction's output is the block made just before the mark
        on = next((e.stream for e in reversed(events[-64:]) if e.op == ALLOC), 0)
        # held across every launch: the converted input (the iterator's, freed last) and the
        # accumulation buffer of an iterator split for 32-bit indexing (gpu_reduce_kernel's)
        held: List[int] = []
        for size, category in ((mark.copy_bytes, Category.TEMPORARY.value),
                               (reductions.accumulation_buffer(mark), stream.category)):
            if size > 0:
                held.append(stream.next_id)
                events.append(Alloc(ALLOC, stream.next_id, size, on, category, phase))
                stream.next_id += 1
        self.copies += 1 if mark.copy_bytes else 0
        for staging in (reductions.staging_blocks(mark, self.device)
                        if self.device is not None else []):
            buffer, semaphores = stream.next_id, stream.next_id + 1
            stream.next_id += 2
            events.append(Alloc(ALLOC, buffer, staging.buffer, on, stream.category, phase))
            events.append(Alloc(ALLOC, semaphores, staging.semaphores, on, stream.category, phase))
            events.append(Free(FREE, semaphores))
            events.append(Free(FREE, buffer))
            self.launches += 1
            self.largest = max(self.largest, staging.buffer)
        for ident in reversed(held):
            events.append(Free(FREE, ident))

    def describe(self) -> Dict[str, Any]:
        """The trace's ``reduction_staging`` meta: how many marks, how many launches staged in
        global memory on this GPU, the largest buffer."""
        out: Dict[str, Any] = {"marks": self.marks, "staged_launches": self.launches,
                               "largest_buffer_bytes": self.largest}
        if self.copies:
            out["converted_inputs"] = self.copies
        if self.device is None:
            out["not_modelled"] = "no launch limits for this GPU's architecture"
        if self.unreadable:
            out["unreadable_marks"] = self.unreadable
        return out


def _rule_end(planner: ConvPlanner, size: int, ranked: Optional[Tuple[int, ...]],
              end: str) -> int:
    """A rule-sized call's workspace at ``end``: with the plans this process's cuDNN ranks for
    the call, the smaller (low) or larger (high) of the rule's and theirs; without, the rule's."""
    if end == POINT:
        return size
    if not ranked:
        planner.range_unknown_calls += 1
        return size
    planner.range_calls += 1
    return min(size, min(ranked)) if end == LOW else max(size, max(ranked))


def for_gpu(trace: Trace, gpu: GPU, env: Optional[Mapping[str, str]] = None,
            conv_rule: Optional[cudnn.ConvWorkspaceRule] = None,
            planner: Optional[ConvPlanner] = None, end: str = POINT) -> Trace:
    """Return a new trace for ``gpu``: cuBLAS marks replaced by that GPU's workspaces, cuDNN
    marks by transient convolution workspaces (cuDNN's heuristics where a cuDNN here plans
    without a GPU, else ``conv_rule``, default the architecture's fitted rule; ``planner``
    to choose). The meta's ``conv_workspaces`` says which answered.

    ``end`` (``LOW``, ``HIGH``): each convolution's workspace taken at that end of the plans
    cuDNN's heuristics rank for the call on ``gpu`` instead of the first (a GPU's own heuristics
    rank them otherwise than a deviceless plan; which runs cannot be asked without the GPU). A
    call the point sizes by the rule or not at all takes the smaller (low) or the larger (high)
    of that and the ranked plans of this process's cuDNN, where one plans without a GPU; else
    the point's. The meta's ``conv_workspaces.range`` counts them."""
    if end not in ENDS:
        raise ValueError(f"unknown end {end!r}: one of {', '.join(ENDS)}")
    workspace = cublas_workspace_bytes(gpu, env)
    lt_workspace = cublaslt_workspace_bytes(gpu, env)
    if planner is None:
        traced = trace.meta.get("cudnn")
        library = trace.meta.get("cudnn_library")
        planner = ConvPlanner(gpu, env, conv_rule,
                              traced_cudnn=traced if isinstance(traced, int) else None,
                              traced_library=library if isinstance(library, str) else None)
    stream = _Stream([], 1 + max((e.id for e in trace.events if e.op == ALLOC), default=0))
    events = stream.events
    resident_done = False
    any_conv = False
    staged = _ReductionStaging(gpu)
    for event in trace.events:
        events.append(event)
        if event.op != MARK:
            continue
        if event.label.startswith("cudnn:"):
            any_conv = True
            mark = ConvMark.parse(event.label)
            planned = planner.plan(mark)
            if planned is None and planner.rule is None:
                planner.unmodelled_calls += len(mark.calls)
                ranked = planner.ranked(mark) if end != POINT else None
                if end == HIGH and ranked:
                    planner.range_calls += len(ranked)
                    for call, sizes in zip(mark.calls, ranked):
                        if sizes and max(sizes) > 0:
                            stream.transient(max(sizes), f"{cudnn.TRANSIENT_PREFIX}{call}")
                elif end == HIGH:
                    planner.range_unknown_calls += len(mark.calls)
                continue
            if not resident_done:
                resident = planner.hold_resident(planned is not None)
                if resident > 0:
                    stream.held(resident, cudnn.RESIDENT_PHASE)
            resident_done = True
            if planned is not None:
                planner.range_calls += sum(1 for c in planned if len(set(c.ranked)) > 1)
                _emit_planned(stream, _ranged(planned, end))
                continue
            assert planner.rule is not None
            planner.rule_calls += len(mark.calls)
            ranked = planner.ranked(mark) if end != POINT else None
            for index, (call, size) in enumerate(conv_workspaces(event.label, planner.rule,
                                                                 planner.cap)):
                size = _rule_end(planner, size, ranked[index] if ranked else None, end)
                if size > 0:
                    stream.transient(size, f"{cudnn.TRANSIENT_PREFIX}{call}")
            continue
        if event.label.startswith(reductions.PREFIX):
            staged.add(event.label, stream)
            continue
        if not event.label.startswith("cublas:"):
            continue
        for size in (workspace, lt_workspace):
            if size > 0:
                stream.held(size, event.label)
    meta = dict(trace.meta, gpu=gpu.key, cublas_workspace_bytes=workspace,
                cublaslt_workspace_bytes=lt_workspace)
    if any_conv:
        meta["conv_workspaces"] = planner.describe()
    if staged.marks:
        meta["reduction_staging"] = staged.describe()
    return Trace(events, meta)
