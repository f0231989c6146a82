"""``xmem replay``: prove the allocator simulator against a real GPU's memory snapshot.

Loads a ``torch.cuda.memory._dump_snapshot()`` pickle (data only: the unpickler refuses every
class), rebuilds the state before its trace began, replays the trace and compares every
``segment_alloc`` (or, with expandable segments, every ``segment_map``) and the reserved total
at the dump. Exit 0 when they match, 1 when not.

With ``--against TRACE`` it compares the run with a trace of the same job instead
(``estimator.divergence``): the trace rewritten for the GPU, aligned with the snapshot's
allocations step by step; it prints where they first part and the blocks each side has that
the other lacks, by module and op. Exit 0 when the streams are the same, 1 when not.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Dict, List


def register(subparsers: Any) -> None:
    """Add the ``replay`` subcommand to the ``xmem`` parser."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a real CUDA memory snapshot through the allocator simulator and compare",
        description="Replay the trace of a torch.cuda.memory._dump_snapshot() pickle through "
        "the caching-allocator simulator, starting from the state that existed before the "
        "trace began, and compare every cudaMalloc (segment_alloc: size and triggering "
        "request) and the reserved total at the dump. Exits 0 when everything matches, 1 when "
        "something does not, 2 when the file cannot be used.",
    )
    parser.add_argument("snapshot", metavar="SNAPSHOT.pickle",
                        help="a pickle written by torch.cuda.memory._dump_snapshot()")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (segment_allocs_expected, "
                        "segment_allocs_matched, reserved_expected_bytes, "
                        "reserved_simulated_bytes, match, ...; with --against: windows, "
                        "first_divergence, groups, by_size, ...)")
    parser.add_argument("--against", metavar="TRACE.json",
                        help="instead of replaying, align the snapshot's allocations with this "
                        "trace of the same job (xmem estimate --trace OUT.json) step by step "
                        "and print where they part and what each side has that the other "
                        "lacks, by the trace's module and op")
    parser.add_argument("--gpu", metavar="NAME",
                        help="with --against: the GPU the trace is rewritten for (cuBLAS and "
                        "cuDNN workspaces; default: the device the trace was traced as)")
    parser.add_argument("--device", type=_count, default=0, metavar="N",
                        help="with --against: the snapshot's device trace to compare "
                        "(default 0)")
    parser.add_argument("--max-edits", type=_count, default=None, metavar="N",
                        help="with --against: insertions and deletions per step above which "
                        "a step is matched by size counts instead of aligned (default "
                        "2000; the alignment costs time x N and memory x N squared)")
    parser.add_argument("--top", type=_count, default=12, metavar="N",
                        help="with --against: module/op groups printed (default 12)")
    parser.set_defaults(func=run)


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must not be negative, got {value}")
    return value


def run(args: Any) -> int:
    from xmem_admission.estimator.allocator.snapshot import load_snapshot, replay_snapshot

    if args.against is not None:
        return _against(args)
    report = replay_snapshot(load_snapshot(args.snapshot))
    result = report.to_dict()
    result["snapshot"] = args.snapshot
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
    return 0 if report.match else 1


def _table(r: Dict[str, Any]) -> str:
    """A short human summary: expected vs simulated, then the verdict and first mismatches."""
    made, released = (("pages mapped (segment_map)", "pages unmapped (segment_unmap)")
                      if r.get("expandable") else
                      ("cudaMalloc'd segments (segment_alloc)", "segments released (segment_free)"))
    rows = [
        ("", "GPU", "simulator"),
        (made, str(r["segment_allocs_expected"]),
         f"{r['segment_allocs_matched']} same size, same request"
         + (f", {r['segment_allocs_extra']} extra" if r["segment_allocs_extra"] else "")),
        (released, str(r["segment_frees_expected"]),
         f"{r['segment_frees_matched']} the same"),
        ("allocations placed at the GPU's address", str(r["allocs"]),
         str(r["addresses_matched"])),
        ("segments at the dump", str(r["segments_expected"]), str(r["segments_simulated"])),
        ("reserved at the dump (bytes)", str(r["reserved_expected_bytes"]),
         str(r["reserved_simulated_bytes"])),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"snapshot: {r['snapshot']} ({r['events']} trace events, {r['devices']} device(s))"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("result: " + ("MATCH" if r["match"] else "MISMATCH"))
    lines += [f"  - {m}" for m in r["mismatches"]]
    return "\n".join(lines)


# -- --against: a snapshot aligned with a trace -----------------------------------------------
def _against(args: Any) -> int:
    from xmem_admission.contract import gpus as catalogue
    from xmem_admission.contract.errors import TraceError, UnknownGPUError
    from xmem_admission.estimator import divergence
    from xmem_admission.estimator.allocator.snapshot import load_snapshot
    from xmem_admission.estimator.orchestrate import for_gpu
    from xmem_admission.estimator.trace import Trace

    data = load_snapshot(args.snapshot)
    _check_trace_kind(args.against)
    trace = Trace.load(args.against)
    if isinstance(trace.meta.get("gpu"), str):
        stream, gpu = trace, str(trace.meta["gpu"])  # already rewritten for its GPU
    else:
        name = args.gpu or trace.meta.get("device")
        if not isinstance(name, str) or not name:
            raise TraceError(f"{args.against}: the trace does not say which GPU it was traced "
                             f"as; name it with --gpu")
        try:
            target = catalogue.lookup(name)
        except UnknownGPUError as exc:
            raise UnknownGPUError(f"{exc} (give the GPU the snapshot ran on with --gpu)") \
                from None
        stream, gpu = for_gpu(trace, target), target.key
    kwargs = {} if args.max_edits is None else {"max_edits": args.max_edits}
    found = divergence.compare(data, stream, gpu, args.device, **kwargs)
    result = found.to_dict()
    result["snapshot"], result["trace"] = args.snapshot, args.against
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print("\n".join(_divergence_text(result, args.top)))
    return 0 if found.identical else 1


def _check_trace_kind(path: str) -> None:
    """A clear word for the files people mistake for a trace."""
    from xmem_admission.contract.errors import TraceError

    try:
        with open(path, "rb") as fh:
            head = fh.read(4096)
    except FileNotFoundError:
        raise TraceError(f"{path}: no such file") from None
    except OSError as exc:
        raise TraceError(f"{path}: cannot read: {exc.strerror or exc}") from None
    if head[:1] == b"\x80":
        raise TraceError(f"{path}: a pickle (a memory snapshot?), not an xmem trace; write "
                         f"one with `xmem estimate --trace OUT.json -- python train.py ...`")
    if b'"traceEvents"' in head:
        raise TraceError(f"{path}: a Chrome/Kineto profiler trace, not an xmem trace; write "
                         f"one with `xmem estimate --trace OUT.json -- python train.py ...`")


def _b(n: int) -> str:
    return f"{n:,} B"


def _gib(n: int) -> str:
    return f"{n / (1 << 30):.2f} GiB"


def _sizes(rows: List[Dict[str, int]], most: int = 3) -> str:
    parts = [f"{r['count']} more block{'s' if r['count'] > 1 else ''} of {_b(r['size'])}"
             for r in rows[:most]]
    if len(rows) > most:
        parts.append(f"{len(rows) - most} more size(s)")
    return ", ".join(parts)


def _divergence_text(r: Dict[str, Any], top: int) -> List[str]:
    steps = r["steps"]
    lines = [f"snapshot: {r['snapshot']} ({steps['snapshot']} optimizer steps)",
             f"trace:    {r['trace']} ({steps['trace']} steps, rewritten for {r['gpu']})"]
    table = [("step", "GPU allocs", "trace allocs", "matched", "moved", "GPU only",
              "trace only", "aligned by")]
    for w in r["windows"] + r["unaligned"]:
        table.append((w["step"], str(w["gpu_allocs"]), str(w["trace_allocs"]), str(w["matched"]),
                      str(w["moved"]),
                      f"{w['gpu_only']} ({_gib(w['gpu_only_bytes'])})",
                      f"{w['trace_only']} ({_gib(w['trace_only_bytes'])})", w["method"]))
    widths = [max(len(row[i]) for row in table) for i in range(len(table[0]))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in table]
    first = r["first_divergence"]
    if first is None:
        lines.append("result: SAME (every allocation of the aligned steps matches in size "
                     "and order)")
        return lines
    if not r["groups"]:
        lines.append(f"the same blocks, {r['moved']} of them in another order")

    def around(before: List[int], after: List[int]) -> str:
        head = " ".join(f"{n:,}" for n in before)
        rest = " ".join(f"{n:,}" for n in after[1:])
        here = f"[{after[0]:,}]" if after else "[end]"
        return " ".join(x for x in (head, here, rest) if x)

    where = f"{first['module'] or '(outside modules)'} / {first['op'] or '(op unknown)'}"
    lines += [f"first parting: {first['step']}, snapshot event {first['gpu_event']}, trace "
              f"event {first['trace_event']}, in {where}",
              f"  GPU:   {around(first['gpu_sizes_before'], first['gpu_sizes_after'])}",
              f"  trace: {around(first['trace_sizes_before'], first['trace_sizes_after'])}",
              f"over the aligned steps the GPU allocates {_gib(r['gpu_only_bytes'])} the trace "
              f"lacks and the trace {_gib(r['trace_only_bytes'])} the GPU lacks; by the "
              f"trace's module and op:"]
    for g in r["groups"][:top]:
        sides = []
        if g["gpu_more"]:
            then = g.get("gpu_more_before")
            sides.append(f"GPU has {_sizes(g['gpu_more'])}" + (
                f" (before the trace's {then['module']} / {then['op']})"
                if then and (then["module"], then["op"]) != (g["module"], g["op"]) else ""))
        if g["trace_more"]:
            sides.append(f"trace has {_sizes(g['trace_more'])}")
        lines.append(f"  {g['module']} / {g['op']}: " + "; ".join(sides))
    if len(r["groups"]) > top:
        lines.append(f"  ... {len(r['groups']) - top} more groups (--top, --json)")
    net = r["by_size"][:6]
    if net:
        lines.append("by size (all groups): " + "; ".join(
            f"{'GPU' if e['gpu_more'] > 0 else 'trace'} {abs(e['gpu_more'])} more of "
            f"{_b(e['size'])}" for e in net))
    lines.append("result: THEY PART")
    return lines
