"""How fast the caching-allocator simulator replays real allocation streams.

Replays the alloc/free streams of the three real GPU snapshots in ``tests/data/snapshots/``
through ``xmem_admission.estimator.allocator.simulate.simulate`` (full PyTorch-style statistics and the
per-category peak breakdown, as the estimator uses it) over and over until at least
1,000,000 events have run, on one core, and prints the rate. The last line is
``events_per_second: N``. Target: at least 250,000 events per second.

    .venv/bin/python bench/speed/allocator_speed.py [--events N]
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from typing import List

from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.allocator.snapshot import load_snapshot, trace_from_snapshot
from xmem_admission.estimator.trace import Trace

HERE = os.path.dirname(os.path.abspath(__file__))
SNAPSHOTS = os.path.join(HERE, "..", "..", "tests", "data", "snapshots")
NAMES = (
    "memory_files_memory_ctx128_forward.pickle",
    "memory_files_memory_ctx128_fullstep.pickle",
    "cs336_systems_memory_logs_memory_ctx128_forward.pickle",
)


def main(argv: List[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=1_000_000,
                        help="replay at least this many events in total (default 1,000,000)")
    args = parser.parse_args(argv)
    traces: List[Trace] = [trace_from_snapshot(load_snapshot(os.path.join(SNAPSHOTS, n)))
                           for n in NAMES]
    for name, trace in zip(NAMES, traces):
        print(f"{name}: {len(trace.events)} alloc/free events")
    gc.collect()
    events = rounds = 0
    peaks = set()
    start = time.perf_counter()
    while events < args.events:
        for trace in traces:
            result = simulate(trace)
            events += result.num_events
            peaks.add(result.peak_reserved_bytes)
        rounds += 1
    elapsed = time.perf_counter() - start
    print(f"rounds: {rounds}  events: {events}  seconds: {elapsed:.2f}")
    print(f"distinct reserved peaks (must be 3, one per stream): {len(peaks)}")
    print(f"events_per_second: {int(events / elapsed)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
