"""What cuDNN convolutions really ask the caching allocator for, shape by shape, on a GPU; and how
the workspace rule of ``contract/cudnn.py`` compares.

The rule for compute capability 8.0 is a fit on whole jobs (bench/fits/README.md, "cuDNN convolution
workspaces"): what cuDNN's heuristics pick per shape is not documented, and the jobs' residual
error is in those sizes. This measures them directly, one convolution at a time:

**Measuring** (``--measure``; the GPU machine, torch and the standard library only): for each
shape of ``--shapes`` (JSON lines ``{"x": [N, C, H, W], "w": [K, C/g, R, S], "y": [N, K, P, Q],
"g": G, "b": element bytes, "row": where it came from}``), runs the forward call, the gradient of
the input and the gradient of the weight (``aten.convolution`` and ``aten.convolution_backward``
with one output each, what autograd runs, ConvShared.cpp), each twice, with cuDNN's defaults
(``benchmark`` off, TF32 allowed for fp32), and records the bytes the call held beyond what it
returned: ``max_memory_allocated() - memory_allocated()`` after the call, with the peak reset
before it (the caching allocator's own counters; the workspace is allocated and freed inside the
call, Conv_v8.cpp ``run_conv_plan``). Stride and padding are the smallest that turn ``x`` into
``y`` (dilation 1). A shape that does not fit is recorded as such. Writes one JSON line per
shape to ``--out`` and stops starting shapes when ``--budget-s`` is spent. ``--dry-run`` runs the
same code on the CPU (no cuDNN: every figure is null), with the batch cut to 2.

**Comparing** (``--compare FILE``; here, with the project's environment): prints, for each call,
the measured bytes as a multiple of the rule's basis (input + output + weight, or the larger of
input and output) and, where the measured GPU's architecture has a rule, how often the rule's
size is below the measured one; and, where this machine's cuDNN plans deviceless (9.11 and
newer), how often the measured bytes are the workspace of the first plan PyTorch would try per
cuDNN's heuristics for the measured GPU (``compare_heuristics``).

**Shapes** (``--make-shapes TRACES``): the distinct convolutions of kept GPUMemNet traces (the
``OUT.jsonl.traces`` folder of ``xmem bench gpumemnet``: each trace's ``cudnn:fwd`` marks), a
sample stratified by the rule's basis up to ``--max-basis-mib``; ``bench/data/conv_shapes.jsonl``
was made this way from the 110-row sample.

    .venv/bin/python bench/convolution/conv_workspaces.py --make-shapes DIR.traces --out bench/data/conv_shapes.jsonl
    python3 bench/convolution/conv_workspaces.py --measure --shapes bench/data/conv_shapes.jsonl --out OUT.jsonl
    .venv/bin/python bench/convolution/conv_workspaces.py --compare OUT.jsonl [--cudnn LIBCUDNN]

``bench/yardsticks/gpu_truth.py`` runs the measuring half after its job matrix and the comparison in its
estimating half.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, Iterable, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
SHAPES = ROOT / "bench" / "data" / "conv_shapes.jsonl"
SCHEMA = "xmem-conv-workspace/1"
CALLS = ("fwd", "bwd_data", "bwd_filter")
MIB = 2**20


# --- Shapes ---------------------------------------------------------------------------------------


def _dims(text: str) -> List[int]:
    return [int(d) for d in text.split(",") if d]


# The fields a newer probe's mark carries (``estimator/conv_marks.py``): stride, padding,
# dilation (lists), channels-last, dtype, and torch.backends.cudnn's benchmark, deterministic and
# allow_tf32 at trace time (1/0).
_GEOMETRY = ("s", "p", "d")
_FLAGS = ("cl", "bm", "det", "tf32")


def parse_mark(label: str) -> Optional[Dict[str, Any]]:
    """A probe ``cudnn:`` mark (``convolutions.conv_mark``) as a shape, or None for other marks;
    the geometry, dtype and flags of a newer probe's marks come with it."""
    head, _, rest = label.partition(" ")
    if not head.startswith("cudnn:"):
        return None
    fields = dict(part.split("=", 1) for part in rest.split() if "=" in part)
    if not all(k in fields for k in ("x", "w", "y")):
        return None
    shape: Dict[str, Any] = {"x": _dims(fields["x"]), "w": _dims(fields["w"]),
                             "y": _dims(fields["y"]), "g": int(fields.get("g", "1")),
                             "b": int(fields.get("b", "4"))}
    for key in _GEOMETRY:
        if key in fields:
            shape[key] = _dims(fields[key])
    for key in _FLAGS:
        if key in fields:
            shape[key] = int(fields[key] == "1")
    if "dt" in fields:
        shape["dt"] = fields["dt"]
    return shape


def operand_bytes(shape: Dict[str, Any]) -> Tuple[int, int, int]:
    """Bytes of the input, output and weight of a shape."""
    size = int(shape["b"])
    return (math.prod(shape["x"]) * size, math.prod(shape["y"]) * size,
            math.prod(shape["w"]) * size)


def make_shapes(traces: Path, count: int, max_basis: int, seed: int = 0) -> List[Dict[str, Any]]:
    """Distinct forward convolutions of the traces (``torchsummary``'s batch-of-2 pass left
    out), ``count`` of them spread evenly over the basis (input + output + weight) up to
    ``max_basis`` bytes."""
    seen: Dict[str, Dict[str, Any]] = {}
    for path in sorted(traces.glob("*.json")):
        events = json.loads(path.read_text())["trace"]["events"]
        for event in events:
            if event[0] != "mark" or not event[1].startswith("cudnn:fwd "):
                continue
            shape = parse_mark(event[1])
            if shape is None or shape["x"][0] <= 2:
                continue
            key = event[1][len("cudnn:fwd "):]
            if key not in seen and sum(operand_bytes(shape)) <= max_basis:
                seen[key] = dict(shape, row=path.stem)
    ranked = sorted(seen.values(), key=lambda s: (sum(operand_bytes(s)), json.dumps(s)))
    if len(ranked) <= count:
        return ranked
    rng = random.Random(seed)
    step = len(ranked) / count
    return [ranked[min(len(ranked) - 1, int(i * step + rng.random() * step))]
            for i in range(count)]


def load_shapes(path: Path) -> List[Dict[str, Any]]:
    shapes = []
    for number, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        shape = json.loads(line)
        for key in ("x", "w", "y"):
            if not (isinstance(shape.get(key), list) and len(shape[key]) == 4
                    and all(isinstance(d, int) and d > 0 for d in shape[key])):
                raise ValueError(f"{path}:{number}: {key!r} must be four positive integers")
        if shape.get("b") not in (2, 4):
            raise ValueError(f"{path}:{number}: 'b' must be 2 (bf16) or 4 (fp32)")
        shapes.append(shape)
    return shapes


def geometry(shape: Dict[str, Any]) -> Tuple[List[int], List[int]]:
    """The shape's stride and padding: the mark's own (``s``, ``p``) where it has them, else the
    smallest stride, then padding, that make ``y`` from ``x`` with kernel ``w`` (dilation 1):
    out = (in + 2 * pad - kernel) // stride + 1 per spatial dimension."""
    if "s" in shape and "p" in shape:
        return list(shape["s"]), list(shape["p"])
    stride, padding = [], []
    for size, kernel, out in zip(shape["x"][2:], shape["w"][2:], shape["y"][2:]):
        found = next(((s, p) for s in range(1, max(size, kernel) + 1) for p in range(kernel)
                      if (size + 2 * p - kernel) // s + 1 == out), None)
        if found is None:
            raise ValueError(f"no stride and padding turn {shape['x']} into {shape['y']} "
                             f"with kernel {shape['w']}")
        stride.append(found[0])
        padding.append(found[1])
    return stride, padding


# --- Measuring (the GPU machine: torch and the standard library only) ----------------------------


def convolution(shape: Dict[str, Any]) -> Any:
    """The shape as ``cudnn_heuristics.Convolution`` (the project's environment, not the GPU
    machine's): its own geometry, dtype and layout where the mark gave them."""
    from xmem_admission.estimator import cudnn_heuristics as ch

    stride, padding = geometry(shape)
    dilation = shape.get("d", [1, 1])
    x, w = shape["x"], shape["w"]
    conv = ch.Convolution(batch=x[0], in_channels=x[1], height=x[2], width=x[3],
                          out_channels=w[0], kernel=(w[2], w[3]),
                          stride=(stride[0], stride[1]), padding=(padding[0], padding[1]),
                          dilation=(dilation[0], dilation[1]), groups=int(shape["g"]),
                          dtype=shape.get("dt") or ("float32" if shape["b"] == 4 else "bfloat16"),
                          channels_last=bool(shape.get("cl", 0)))
    if list(conv.shapes()[2]) != list(shape["y"]):
        raise ValueError(f"the geometry does not give {shape['y']}")
    return conv


def measure_shape(torch: Any, shape: Dict[str, Any], device: str) -> Dict[str, Any]:
    """The transient bytes of each call, first and second run; None on the CPU."""
    cuda = device == "cuda"
    dtype = torch.float32 if shape["b"] == 4 else torch.bfloat16
    stride, padding = geometry(shape)
    x = torch.randn(shape["x"], device=device, dtype=dtype)
    w = torch.randn(shape["w"], device=device, dtype=dtype)
    common = (stride, padding, list(shape.get("d", [1, 1])), False, [0, 0], shape["g"])

    def held(call: Any) -> Tuple[Any, Optional[int]]:
        if not cuda:
            return call(), None
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        out = call()
        torch.cuda.synchronize()
        return out, int(torch.cuda.max_memory_allocated() - torch.cuda.memory_allocated())

    result: Dict[str, Any] = {}
    y: Any = None
    for _ in range(2):
        y, size = held(lambda: torch.ops.aten.convolution(x, w, None, *common))
        result.setdefault("fwd", []).append(size)
    if list(y.shape) != shape["y"]:
        raise ValueError(f"output {list(y.shape)} is not the shape's {shape['y']}")
    grad = torch.randn_like(y)
    del y
    for call, mask in (("bwd_data", [True, False, False]), ("bwd_filter", [False, True, False])):
        def backward(mask: List[bool] = mask) -> Any:
            return torch.ops.aten.convolution_backward(grad, x, w, None, *common, mask)

        for _ in range(2):
            out, size = held(backward)
            del out
            result.setdefault(call, []).append(size)
    return result


def measure(shapes: Sequence[Dict[str, Any]], out: Path, *, budget_s: float,
            dry_run: bool) -> int:
    """Measure every shape that the budget allows; returns how many were measured."""
    import torch

    device = "cpu" if dry_run else "cuda"
    if not dry_run and not torch.cuda.is_available():
        raise SystemExit("conv_workspaces: --measure needs a CUDA GPU (--dry-run runs on the CPU)")
    header: Dict[str, Any] = {
        "schema": SCHEMA, "dry_run": dry_run, "torch_version": torch.__version__,
        "cudnn_version": torch.backends.cudnn.version() if not dry_run else None,
        "cudnn_benchmark": bool(torch.backends.cudnn.benchmark),
        "allow_tf32": bool(torch.backends.cudnn.allow_tf32),
        "wscap_dbg": os.environ.get("CUDNN_CONV_WSCAP_DBG"),
    }
    if not dry_run:
        props = torch.cuda.get_device_properties(0)
        header.update(gpu_name=props.name, compute_capability=[props.major, props.minor],
                      gpu_total_memory_bytes=int(props.total_memory))
    deadline, done = time.monotonic() + budget_s, 0
    with open(out, "w") as sink:
        for index, shape in enumerate(shapes):
            if time.monotonic() > deadline:
                print(f"conv_workspaces: budget spent after {done} of {len(shapes)} shapes",
                      flush=True)
                break
            if dry_run:
                shape = dict(shape, x=[min(2, shape["x"][0])] + shape["x"][1:],
                             y=[min(2, shape["y"][0])] + shape["y"][1:])
            row: Dict[str, Any] = dict(header, index=index, shape=shape)
            started = time.perf_counter()
            try:
                row["held_bytes"] = measure_shape(torch, shape, device)
            except torch.OutOfMemoryError:
                row["oom"] = True
            except (RuntimeError, ValueError) as exc:
                row["error"] = f"{type(exc).__name__}: {exc}"[:300]
            if not dry_run:
                torch.cuda.empty_cache()
            row["seconds"] = round(time.perf_counter() - started, 4)
            sink.write(json.dumps(row, sort_keys=True) + "\n")
            sink.flush()
            done += 1
    print(f"conv_workspaces: {done} of {len(shapes)} shapes into {out}", flush=True)
    return done


# --- Comparing (here) ----------------------------------------------------------------------------


def compare(rows: Iterable[Dict[str, Any]], library: Any = None
            ) -> Tuple[str, Dict[str, Any]]:
    """The markdown table of measured bytes against the rule's basis and size, and the summary;
    ``library``: the libcudnn that plans (``compare_heuristics``)."""
    for path in (str(ROOT), str(ROOT / "src")):
        if path not in sys.path:
            sys.path.insert(0, path)
    from bench.yardsticks.paper.benchmark import quantile
    from xmem_admission.contract import cudnn

    rows = [r for r in rows if r.get("held_bytes")]
    measured = [r for r in rows if r["held_bytes"]["fwd"][-1] is not None]
    if not measured:
        return "no shape was measured on a GPU (a dry run, or every shape failed)", {
            "shapes": len(rows), "measured": 0}
    capability = tuple(measured[0].get("compute_capability") or ())
    rule = cudnn.rule_for(capability) if len(capability) == 2 else None
    lines = [f"{measured[0].get('gpu_name')} (compute capability "
             f"{'.'.join(map(str, capability))}), cuDNN {measured[0].get('cudnn_version')}, "
             f"{len(measured)} shapes; steady figures (the second run of each call)", "",
             "| call | median bytes / (in+out+w) | p90 | max | shapes holding nothing "
             "| rule's size below measured |", "| --- | --- | --- | --- | --- | --- |"]
    summary: Dict[str, Any] = {"shapes": len(rows), "measured": len(measured),
                               "gpu_name": measured[0].get("gpu_name"),
                               "compute_capability": list(capability), "calls": {}}
    for call in CALLS:
        ratios, zero, under = [], 0, 0
        for row in measured:
            size = row["held_bytes"][call][-1]
            x, y, w = operand_bytes(row["shape"])
            ratios.append(size / (x + y + w))
            zero += size == 0
            if rule is not None:
                under += cudnn.workspace_bytes(rule, cudnn.ConvCall(call), x, y, w) < size
        share = f"{under / len(measured):.0%}" if rule is not None else "no rule"
        lines.append(f"| {call} | {statistics.median(ratios):.3f} | "
                     f"{quantile(ratios, 0.9):.3f} | {max(ratios):.3f} | "
                     f"{zero} of {len(measured)} | {share} |")
        summary["calls"][call] = {"median_ratio": statistics.median(ratios),
                                  "p90_ratio": quantile(ratios, 0.9), "max_ratio": max(ratios),
                                  "zero": zero, "rule_under": under if rule else None}
    first_differs = sum(any(r["held_bytes"][c][0] != r["held_bytes"][c][-1] for c in CALLS)
                        for r in measured)
    lines.append("")
    lines.append(f"first run differs from the second in {first_differs} of {len(measured)} "
                 f"shapes; rule: " + ("none for this architecture" if rule is None else
                                      f"{rule.basis.value} x {dict(rule.fraction)}"))
    summary["first_run_differs"] = first_differs
    heuristics = compare_heuristics(measured, library)
    if heuristics is not None:
        lines += ["", heuristics[0]]
        summary["heuristics"] = heuristics[1]
    return "\n".join(lines), summary


def _allocator_rounded(size: int) -> int:
    """What the caching allocator counts for a request: a multiple of 512 bytes
    (CUDACachingAllocator.cpp ``round_size``, kMinBlockSize)."""
    return -(-size // 512) * 512


# --- What the measured bytes are -----------------------------------------------------------------
#
# ``max_memory_allocated() - memory_allocated()`` after a call is the size of the *block* the
# caching allocator handed the workspace, not the workspace: the allocator counts a block's size
# in ``allocated_bytes`` (CUDACachingAllocator.cpp ``malloc``: ``stats.allocated_bytes`` grows by
# ``block->size`` after ``alloc_found_block``), and a block is the request rounded to 512 bytes
# only when it was split off a larger one. A request above 10 MiB (kMinLargeAlloc) gets a new
# segment rounded up to 2 MiB (kRoundLarge, ``get_allocation_size``), and the large pool splits a
# block only when more than 1 MiB (kSmallSize) would be left (``should_split``): a 16,365,568-byte
# workspace in a fresh 16 MiB segment is held as the whole 16,777,216-byte block. A cached block
# freed by an earlier call (the first run's workspace, an output freed since) is reused the same
# way. Nothing else is held: the shapes are fp32 and contiguous NCHW, so ``convolution_backward``'s
# ``contiguous(memory_format)`` of the gradient, input and weight is a no-op and there is no cast
# (ConvShared.cpp), and the second run of a call takes the plan cached by the first
# (Conv_v8.cpp ``run_single_conv``: ``benchmark_cache.find(key)``), hence the same workspace
# (first and second run agree on every shape). ``try_plans`` never met an allocation failure
# here: the largest block measured is 6.4 GiB of the H200's 140 GiB.
#
# So a plan is "what was measured" when replaying the measurement (``measure_shape``'s order of
# allocations) through the project's allocator simulator with that plan's workspace gives the
# measured bytes: ``held_by_measurement``.


def held_by_measurement(shape: Dict[str, Any], workspaces: Dict[str, int]) -> Dict[str, List[int]]:
    """The bytes ``measure_shape`` would record for each call (first and second run) if each
    call's workspace were ``workspaces[call]``: its allocations (input and weight, each call's
    output, the gradient) and the workspaces, in its order, through the project's simulation of
    the caching allocator (a fresh one: ``measure`` empties the cache between shapes)."""
    from xmem_admission.estimator.allocator.caching import CachingAllocator

    allocator = CachingAllocator()
    size = int(shape["b"])
    x_bytes, y_bytes, w_bytes = (math.prod(shape[k]) * size for k in ("x", "y", "w"))
    allocator.malloc(x_bytes)
    allocator.malloc(w_bytes)

    def held(out_bytes: int, workspace: int) -> Tuple[Any, int]:
        out = allocator.malloc(out_bytes)
        peak = allocator.allocated_bytes
        if workspace:
            block = allocator.malloc(workspace)
            peak = allocator.allocated_bytes
            allocator.free(block)
        return out, peak - allocator.allocated_bytes

    result: Dict[str, List[int]] = {c: [] for c in CALLS}
    first_y, bytes_held = held(y_bytes, workspaces["fwd"])
    result["fwd"].append(bytes_held)
    # y, size = held(...): the first run's output lives until the second one's replaces it
    y, bytes_held = held(y_bytes, workspaces["fwd"])
    result["fwd"].append(bytes_held)
    allocator.free(first_y)
    allocator.malloc(y_bytes)  # grad = torch.randn_like(y)
    allocator.free(y)  # del y
    for call, out_bytes in (("bwd_data", x_bytes), ("bwd_filter", w_bytes)):
        for _ in range(2):
            out, bytes_held = held(out_bytes, workspaces[call])
            result[call].append(bytes_held)
            allocator.free(out)  # del out
    return result


def compare_heuristics(measured: Sequence[Dict[str, Any]], library: Any = None
                       ) -> Optional[Tuple[str, Dict[str, Any]]]:
    """The measured bytes against cuDNN's own answer planned here without a GPU: the
    plans PyTorch tries for the measured GPU's catalogue entry with the run's TF32 setting
    (``cudnn_heuristics.torch_plans``), with this environment's cuDNN or ``library``. Per call:
    how often replaying the measurement with the first plan's workspace gives the measured
    bytes (``held_by_measurement``), how often a later plan's does (the device skipped the first
    ones: ``try_plans`` moves on when building or running a plan fails), and how often no plan
    PyTorch tries gives them; and how often the first plan rounded to 512 bytes equals the
    measurement (the older comparison). None where no cuDNN here plans deviceless, the GPU is not in the
    catalogue, or the run benchmarked (the fastest plan is a measurement)."""
    from xmem_admission.contract import cudnn
    from xmem_admission.contract.errors import XmemError
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator import cudnn_heuristics as ch

    first = measured[0]
    if first.get("cudnn_benchmark"):
        return None
    try:
        gpu = lookup(str(first.get("gpu_name")))
        lib = library if library is not None else ch.load_cudnn()
        if not lib.deviceless:
            return None
    except XmemError:  # not a catalogue GPU, or no cuDNN that plans without one
        return None
    counts = {call: {"first": 0, "later": 0, "none": 0, "rounded_equal": 0, "below": 0}
              for call in CALLS}
    ratios: Dict[str, List[float]] = {call: [] for call in CALLS}
    later_at: Dict[str, List[int]] = {call: [] for call in CALLS}
    for row in measured:
        shape = row["shape"]
        conv = convolution(shape)
        chosen: Dict[str, int] = {}
        for call in CALLS:
            try:
                sizes = [p.workspace_bytes for p in ch.torch_plans(
                    gpu, conv, cudnn.ConvCall(call),
                    allow_tf32=bool(row.get("allow_tf32", True)), library=lib)]
            except ch.CudnnCallError:
                sizes = []
            size = row["held_bytes"][call][-1]
            planned = sizes[0] if sizes else 0
            counts[call]["rounded_equal"] += size == _allocator_rounded(planned)
            counts[call]["below"] += _allocator_rounded(planned) < size
            if planned:
                ratios[call].append(size / _allocator_rounded(planned))
            found = None
            for workspace in dict.fromkeys(sizes):
                trial = {c: chosen.get(c, 0) for c in CALLS}
                trial[call] = workspace
                if held_by_measurement(shape, trial)[call][-1] == size:
                    found = sizes.index(workspace)
                    break
            kind = "none" if found is None else ("first" if found == 0 else "later")
            counts[call][kind] += 1
            if found is not None and found > 0:
                later_at[call].append(found)
            # later calls see the allocator as this call left it: the workspace that explains
            # the measurement, else the first plan's
            chosen[call] = sizes[found] if found is not None else planned
    n = len(measured)
    lines = [f"cuDNN's heuristics for the catalogue's {gpu.key}, planned here with cuDNN "
             f"{lib.version_text} (measured with {first.get('cudnn_version')}); the plans PyTorch "
             f"tries, TF32 {'on' if first.get('allow_tf32', True) else 'off'}; a plan explains a "
             "call when the measurement replayed through the allocator simulator with its "
             "workspace gives the measured bytes", "",
             "| call | first plan | a later plan (its place) | no plan | first plan rounded to "
             "512 B = measured (before deviceless planning) | median measured / first plan |",
             "| --- | --- | --- | --- | --- | --- |"]
    summary: Dict[str, Any] = {"gpu": gpu.key, "cudnn_here": lib.version_text, "calls": {}}
    for call in CALLS:
        c = counts[call]
        median = statistics.median(ratios[call]) if ratios[call] else None
        places = ",".join(str(i) for i in sorted(later_at[call])) or "-"
        lines.append(f"| {call} | {c['first']} of {n} | {c['later']} ({places}) | {c['none']} | "
                     f"{c['rounded_equal']} | {f'{median:.3f}' if median else '-'} |")
        summary["calls"][call] = {"equal": c["first"], "later": c["later"], "none": c["none"],
                                  "later_places": sorted(later_at[call]),
                                  "rounded_equal": c["rounded_equal"], "below": c["below"],
                                  "median_ratio": median}
    return "\n".join(lines), summary


def load_rows(path: Path) -> List[Dict[str, Any]]:
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows or any(r.get("schema") != SCHEMA for r in rows):
        raise ValueError(f"{path}: not a {SCHEMA} file")
    return rows


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="conv_workspaces.py",
                                     description=__doc__.splitlines()[0])
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--measure", action="store_true", help="measure on this machine's GPU")
    mode.add_argument("--dry-run", action="store_true", help="the measuring code on the CPU")
    mode.add_argument("--compare", type=Path, metavar="FILE", help="compare measured shapes")
    mode.add_argument("--make-shapes", type=Path, metavar="TRACES",
                      help="sample shapes from kept GPUMemNet traces")
    parser.add_argument("--shapes", type=Path, default=SHAPES)
    parser.add_argument("--out", type=Path)
    parser.add_argument("--budget-s", type=float, default=60.0)
    parser.add_argument("--count", type=int, default=120)
    parser.add_argument("--max-basis-mib", type=int, default=4096)
    parser.add_argument("--limit", type=int, help="measure only the first N shapes")
    parser.add_argument("--cudnn", metavar="LIBCUDNN",
                        help="--compare: plan with this libcudnn (e.g. the measured release's, "
                             "from its nvidia-cudnn wheel) instead of this environment's")
    args = parser.parse_args(argv)
    try:
        if args.compare:
            library = None
            if args.cudnn:
                from xmem_admission.estimator import cudnn_heuristics as ch

                try:
                    library = ch.load_cudnn(args.cudnn)
                except ch.CudnnPlanningUnavailable as exc:
                    raise ValueError(str(exc)) from None
            table, _ = compare(load_rows(args.compare), library)
            print(table)
            return 0
        if args.out is None:
            parser.error("--out is required")
        if args.make_shapes:
            shapes = make_shapes(args.make_shapes, args.count, args.max_basis_mib * MIB)
            args.out.write_text("".join(json.dumps(s, sort_keys=True) + "\n" for s in shapes))
            print(f"{len(shapes)} shapes into {args.out}")
            return 0
        shapes = load_shapes(args.shapes)[:args.limit]
        measure(shapes, args.out, budget_s=args.budget_s, dry_run=args.dry_run)
        return 0
    except (OSError, ValueError) as exc:
        print(f"conv_workspaces: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
