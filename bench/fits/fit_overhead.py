"""Fit the per-GPU runtime overhead of the catalogue from ``xmem bench paper`` output.

``measured_peak_bytes`` in the xMem paper's rows is NVML device memory at its peak minus the
first sample, taken after CUDA was initialised: the allocator's segments plus what training
loads outside the allocator after start-up (lazily loaded kernel modules, cuBLAS/cuDNN handle
memory). The second part is one number per GPU model in the catalogue
(``GPU.runtime_overhead_bytes``). This script fits it, over the GPU's rows that did not run out
of memory, as the 85th percentile of measured minus simulated peak reserved, clamped at zero
(memory outside the allocator cannot be negative) and rounded up to a whole MiB: the smallest
figure under which at most 15% of that GPU's measured jobs needed more than the estimate. A
request sized below what the job takes is an OOM on a shared GPU, so the fit errs on that side
rather than at the median (which under-estimates half the jobs by construction).

The spread of that figure for jobs with convolutions (the catalogue's cuDNN figure's high end,
``contract.overhead``): what the GPU's convolution rows needed beyond their simulated high end
(``high_reserved_bytes``: each convolution at the largest workspace cuDNN ranks), at its largest,
less the runtime figure: ``spread_over_runtime``. Their excess holds cuDNN's modules and what the
deviceless ranking cannot see of the plans the runs' cuDNN picked.

Usage: ``.venv/bin/python bench/fits/fit_overhead.py RUNS.jsonl OUT.jsonl`` where OUT.jsonl is what
``xmem bench paper --out`` wrote (``peak_reserved_bytes``, or
``estimate_bytes`` minus the catalogue's overhead at the time).
"""

from __future__ import annotations

import json
import math
import sys
from collections import defaultdict
from typing import Sequence

from bench.yardsticks.paper.benchmark import PAPER_CUDA_MAJOR, quantile
from xmem_admission.contract import gpus, overhead

MiB = 1 << 20
# At most this share of a GPU's measured jobs may need more than the estimate.
UNDER_SHARE = 0.15


def fitted_overhead(residuals: Sequence[float]) -> int:
    """The overhead under which at most ``UNDER_SHARE`` of the residuals (measured minus
    simulated peak reserved) lie above it: their 85th percentile, clamped at zero and rounded
    up to a whole MiB."""
    return max(0, math.ceil(quantile(list(residuals), 1 - UNDER_SHARE) / MiB)) * MiB


def spread_over_runtime(beyond_high: Sequence[float], runtime: int) -> int:
    """How far above the runtime figure a job with convolutions may need: the largest of the
    convolution rows' measured minus simulated high end reserved (``beyond_high``), less the
    runtime figure, clamped at zero and rounded up to a whole MiB."""
    if not beyond_high:
        return 0
    return max(0, math.ceil((max(beyond_high) - runtime) / MiB)) * MiB


def main() -> None:
    if len(sys.argv) != 3:
        raise SystemExit(__doc__.strip().splitlines()[-2])
    runs = {}
    with open(sys.argv[1], encoding="utf-8") as fh:
        for line in fh:
            if line.strip():
                row = json.loads(line)
                runs[row["id"]] = row
    residuals = defaultdict(list)
    beyond_high = defaultdict(list)  # convolution rows: measured - the high end's reserved peak
    with open(sys.argv[2], encoding="utf-8") as fh:
        for line in fh:
            result = json.loads(line)
            row = runs.get(result["id"])
            if row is None or row["measured_oom"] or "estimate_bytes" not in result:
                continue
            reserved = result.get("peak_reserved_bytes")
            if reserved is None:  # estimate_bytes = reserved + the catalogue's overhead then
                reserved = (result["estimate_bytes"] - overhead.for_gpu(
                    gpus.lookup(row["gpu_name"]).key, PAPER_CUDA_MAJOR).runtime_bytes)
            residuals[row["gpu_name"]].append(row["measured_peak_bytes"] - reserved)
            if result.get("convolutions") and result.get("high_reserved_bytes") is not None:
                beyond_high[row["gpu_name"]].append(row["measured_peak_bytes"]
                                                    - result["high_reserved_bytes"])
    for gpu, values in sorted(residuals.items()):
        q = quantile(values, 1 - UNDER_SHARE)
        fitted = fitted_overhead(values)
        print(f"{gpu}: n={len(values)} residual p{round(100 * (1 - UNDER_SHARE))} "
              f"{q / MiB:.1f} MiB (median {quantile(values, 0.5) / MiB:.1f}) -> "
              f"runtime_overhead_bytes = {fitted} ({fitted // MiB} MiB)")
        convs = beyond_high.get(gpu, [])
        if convs:
            spread = spread_over_runtime(convs, fitted)
            print(f"  {len(convs)} convolution rows: up to {max(convs) / MiB:.0f} MiB over their "
                  f"high end's reserved peak -> cuDNN spread {spread // MiB} MiB over the runtime "
                  f"figure")


if __name__ == "__main__":
    main()
