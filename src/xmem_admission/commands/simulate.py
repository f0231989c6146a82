"""``xmem simulate``: run an allocation trace through the caching-allocator simulator.

Prints the peak allocated and reserved memory, what was allocated at the reserved peak by
category, and an out-of-memory if the capacity was too small; ``--json`` adds the full
``torch.cuda.memory_stats()``-style statistics. Exit 0, or 1 when the simulation ran out of
memory.
"""

from __future__ import annotations

import argparse
import json
from typing import Any, Optional

GiB = 1 << 30


def _capacity(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of bytes, got {text!r}") \
            from None
    if value <= 0:
        raise argparse.ArgumentTypeError(f"capacity must be positive, got {value}")
    return value


def register(subparsers: Any) -> None:
    """Add the ``simulate`` subcommand to the ``xmem`` parser."""
    parser = subparsers.add_parser(
        "simulate",
        help="replay an allocation trace (xmem-trace JSON) through the allocator simulator",
        description="Replay an xmem allocation trace through the simulated PyTorch CUDA "
        "caching allocator and report peak allocated and reserved memory. Exits 0, or 1 when "
        "the simulated device ran out of memory (the replay stops there, like a real job).",
    )
    parser.add_argument("trace", metavar="TRACE.json", help="an xmem-trace JSON file")
    parser.add_argument("--alloc-conf", default="", metavar="STR",
                        help="PYTORCH_CUDA_ALLOC_CONF to simulate, e.g. "
                        "'expandable_segments:True' (default: PyTorch's defaults)")
    parser.add_argument("--torch", default=None, metavar="VERSION",
                        help="the torch release whose allocator to simulate, e.g. 2.6 or "
                        "2.6.0a0+ecf3bae40a (default: the trace's meta.torch, else the newest "
                        "release xmem knows); decides which --alloc-conf options exist and how "
                        "they parse")
    parser.add_argument("--capacity-bytes", type=_capacity, default=None, metavar="N",
                        help="bytes the allocator may reserve before cudaMalloc fails "
                        "(default: unlimited)")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object with the peaks, OOM and all statistics")
    parser.set_defaults(func=run)


def trace_torch(meta: Any, override: Optional[str] = None) -> Optional[str]:
    """The torch version whose allocator a trace is simulated with.

    ``override`` (``--torch``) wins; else the trace's ``meta["torch"]`` (the probe records
    ``torch.__version__``); else None, the newest release the simulator knows. A ``meta.torch``
    that is not a string is an error, not a silent default.
    """
    if override is not None:
        return override
    value = meta.get("torch") if isinstance(meta, dict) else None
    if value is None:
        return None
    if not isinstance(value, str):
        from xmem_admission.contract.errors import TraceError

        raise TraceError(f"the trace's meta.torch must be a version string, got {value!r}")
    return value


def run(args: Any) -> int:
    from xmem_admission.estimator.allocator.alloc_conf import parse_alloc_conf
    from xmem_admission.estimator.allocator.simulate import simulate
    from xmem_admission.estimator.trace import Trace

    trace = Trace.load(args.trace)
    torch = trace_torch(trace.meta, args.torch)
    # The traced torch's rules: its options, its parsing (torch_releases.py).
    config = parse_alloc_conf(args.alloc_conf, torch)
    result = simulate(trace, config, capacity_bytes=args.capacity_bytes)
    if args.json:
        out = result.to_dict()
        out["trace"] = args.trace
        print(json.dumps(out, indent=2))
    else:
        print(f"trace: {args.trace} ({len(trace.events)} events, {result.num_events} replayed)")
        release = config.torch_release
        print(f"allocator of torch {release[0]}.{release[1]}"
              + (f" (traced with torch {torch})" if isinstance(torch, str) else ""))
        print(f"peak allocated: {result.peak_allocated_bytes} bytes "
              f"({result.peak_allocated_bytes / GiB:.3f} GiB)")
        print(f"peak reserved:  {result.peak_reserved_bytes} bytes "
              f"({result.peak_reserved_bytes / GiB:.3f} GiB)")
        parts = [f"{name} {nbytes / GiB:.3f}"
                 for name, nbytes in result.allocated_by_category_at_peak_reserved.items() if nbytes]
        if parts:
            print("allocated at the reserved peak (GiB): " + ", ".join(parts))
        stats = result.stats
        print(f"cudaMalloc calls: {stats['num_device_alloc']}, retries after freeing the "
              f"cache: {stats['num_alloc_retries']}")
        if result.oom is not None:
            print(f"OUT OF MEMORY at event {result.oom.event_index}: {result.oom.message}")
    return 1 if result.oom is not None else 0
