"""The measured CNN jobs of a GPU run simulated again with the convolution workspaces of a chosen
cuDNN: which release plans moves the reserved peak, not the allocated one.

``bench/yardsticks/gpu_truth.py --estimate`` traces each job with this environment's torch and plans its
convolutions with this environment's cuDNN (9.24 in the development venv); the H200 ran torch
2.11 with cuDNN 9.19. This takes the traces ``xmem estimate --trace`` kept for those jobs (one
``<job>.json`` per measured job in ``TRACES``), plans their convolutions for the measured GPU with
the libcudnn given (``--cudnn``, e.g. the measured release's ``nvidia-cudnn`` wheel; default this
environment's), simulates them with the job's ``PYTORCH_CUDA_ALLOC_CONF`` and prints the
allocated and reserved peaks, and what the allocator holds cached but free at its reserved peak,
against the measurement (``max_memory_allocated`` / ``max_memory_reserved``).

    .venv/bin/xmem estimate --gpu H200 --json --trace TRACES/cnn-resnet50-b32-sgd.json -- \\
        python examples/train_cnn.py --model resnet50 --batch-size 32 --optimizer sgd --steps 3
    .venv/bin/python bench/convolution/conv_job_rows.py bench/data/H200/measurements.jsonl TRACES \\
        [--cudnn LIBCUDNN]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

GIB = 2**30


def job_row(measured: Dict[str, Any], trace_path: Path, gpu: Any, lib: Any) -> Dict[str, Any]:
    """One job's simulated peaks with ``lib``'s workspaces, beside its measured ones."""
    from xmem_admission.estimator.allocator.alloc_conf import config_from_env
    from xmem_admission.estimator.allocator.simulate import simulate
    from xmem_admission.estimator.orchestrate import ConvPlanner, for_gpu
    from xmem_admission.estimator.trace import Trace

    env = dict(measured.get("env") or {})
    trace = Trace.load(str(trace_path))
    stream = for_gpu(trace, gpu, env, planner=ConvPlanner(gpu, env, library=lib))
    sim = simulate(stream, config_from_env(env))
    allocated = int(measured["max_memory_allocated_bytes"])
    reserved = int(measured["max_memory_reserved_bytes"])
    return {"job": measured["job"], "cudnn": lib.version_text,
            "allocated": sim.peak_allocated_bytes, "reserved": sim.peak_reserved_bytes,
            "measured_allocated": allocated, "measured_reserved": reserved,
            "reserved_error": sim.peak_reserved_bytes / reserved - 1.0}


def table(rows: Sequence[Dict[str, Any]]) -> str:
    lines = ["| job | cuDNN planning | allocated (measured) | reserved (measured) | reserved error "
             "| cached but free (measured) |", "| --- | --- | --- | --- | --- | --- |"]
    for r in rows:
        lines.append(
            f"| {r['job']} | {r['cudnn']} | {r['allocated'] / GIB:.3f} "
            f"({r['measured_allocated'] / GIB:.3f}) GiB | {r['reserved'] / GIB:.3f} "
            f"({r['measured_reserved'] / GIB:.3f}) GiB | {100 * r['reserved_error']:+.1f}% | "
            f"{(r['reserved'] - r['allocated']) / GIB:.2f} "
            f"({(r['measured_reserved'] - r['measured_allocated']) / GIB:.2f}) GiB |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="conv_job_rows.py", description=__doc__.splitlines()[0])
    parser.add_argument("measurements", type=Path, help="bench/data/<GPU>/measurements.jsonl")
    parser.add_argument("traces", type=Path, help="folder of <job>.json kept by xmem estimate")
    parser.add_argument("--cudnn", metavar="LIBCUDNN", help="plan with this libcudnn")
    args = parser.parse_args(argv)
    from xmem_admission.contract.errors import XmemError
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator import cudnn_heuristics as ch

    try:
        lib = ch.load_cudnn(args.cudnn)
        if not lib.deviceless:
            raise ValueError(f"cuDNN {lib.version_text} cannot plan without a GPU")
        measured = [json.loads(line) for line in args.measurements.read_text().splitlines()
                    if line.strip()]
        rows: List[Dict[str, Any]] = []
        for row in measured:
            path = args.traces / f"{row.get('job')}.json"
            if not path.is_file() or not row.get("max_memory_reserved_bytes"):
                continue
            rows.append(job_row(row, path, lookup(str(row["gpu_name"])), lib))
        if not rows:
            raise ValueError(f"no trace in {args.traces} is named after a measured job")
    except (OSError, ValueError, KeyError, XmemError) as exc:
        print(f"conv_job_rows: error: {exc}", file=sys.stderr)
        return 2
    print(table(rows))
    return 0


if __name__ == "__main__":
    sys.exit(main())
