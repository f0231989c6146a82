"""What asking cuDNN's heuristics costs an estimate: loading libcudnn, then planning every
convolution of a trace for one GPU, in time and host memory (resident set).

    .venv/bin/python bench/convolution/conv_planning_cost.py TRACE.json [--gpu A100-40GB]

TRACE.json is a kept trace (``xmem bench gpumemnet --out OUT.jsonl`` keeps them in
``OUT.jsonl.traces/``, ``xmem bench paper`` too) or one ``xmem estimate --trace`` wrote. Run it in
a fresh process: the figures are this process's. Prints the cuDNN that answered, the seconds and
MiB of loading it, of the first planning of the trace (``orchestrate.for_gpu``: every distinct
convolution call planned), of a second one (answers remembered per process), and the
simulation's seconds for comparison.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import time
from typing import List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from xmem_admission.contract.gpus import lookup  # noqa: E402
from xmem_admission.estimator import cudnn_heuristics as ch  # noqa: E402
from xmem_admission.estimator.allocator.simulate import simulate  # noqa: E402
from xmem_admission.estimator.orchestrate import for_gpu  # noqa: E402
from xmem_admission.estimator.trace import Trace  # noqa: E402

MIB = 2**20


def resident_mib() -> float:
    """This process's resident set now (/proc/self/statm, pages)."""
    with open("/proc/self/statm", encoding="ascii") as statm:
        pages = int(statm.read().split()[1])
    return pages * os.sysconf("SC_PAGE_SIZE") / MIB


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("trace")
    parser.add_argument("--gpu", default="A100-40GB")
    args = parser.parse_args(argv)
    with open(args.trace, encoding="utf-8") as fh:
        data = json.load(fh)
    trace = Trace.from_dict(data.get("trace", data))  # a kept trace wraps it
    gpu = lookup(args.gpu)
    marks = sum(1 for e in trace.events if e.op == "mark" and e.label.startswith("cudnn:"))
    before = resident_mib()
    started = time.perf_counter()
    lib = ch.load_cudnn()
    loaded = time.perf_counter() - started
    after_load = resident_mib()
    started = time.perf_counter()
    stream = for_gpu(trace, gpu, {})
    first = time.perf_counter() - started
    after_plan = resident_mib()
    started = time.perf_counter()
    for_gpu(trace, gpu, {})
    again = time.perf_counter() - started
    started = time.perf_counter()
    simulate(stream)
    simulated = time.perf_counter() - started
    info = stream.meta.get("conv_workspaces") or {}
    print(f"cuDNN {lib.version_text} ({lib.path}), deviceless: {lib.deviceless}")
    print(f"trace: {marks} cudnn: marks, {info.get('planned_calls', 0)} calls planned for "
          f"{gpu.key} ({info.get('source', 'no convolution')})")
    print(f"load: {loaded:.3f} s, +{after_load - before:.0f} MiB resident")
    print(f"first planning: {first:.2f} s, +{after_plan - after_load:.0f} MiB resident; "
          f"again: {again:.3f} s; simulation: {simulated:.2f} s")
    print(f"peak resident: {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB")
    return 0


if __name__ == "__main__":
    sys.exit(main())
