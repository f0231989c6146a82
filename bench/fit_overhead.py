"""Fit the per-GPU runtime overhead of the catalogue from ``xmem bench paper`` output.

``measured_peak_bytes`` in the xMem paper's rows is NVML device memory at its peak minus the
first sample, taken after CUDA was initialised: the allocator's segments plus what training
loads outside the allocator after start-up (lazily loaded kernel modules, cuBLAS/cuDNN handle
memory). The second part is one number per GPU model in the catalogue
(``GPU.runtime_overhead_bytes``). This script fits it as the median, over the GPU's rows that did
not run out of memory, of measured minus simulated peak reserved, clamped at zero (memory
outside the allocator cannot be negative), rounded down to a whole MiB.

Usage: ``.venv/bin/python bench/fit_overhead.py RUNS.jsonl OUT.jsonl`` where OUT.jsonl is what
``xmem bench paper --out`` wrote (``peak_reserved_bytes``, or
``estimate_bytes`` minus the catalogue's overhead at the time).
"""

from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict

from xmem_admission import gpus

MiB = 1 << 20


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
    with open(sys.argv[2], encoding="utf-8") as fh:
        for line in fh:
            result = json.loads(line)
            row = runs.get(result["id"])
            if row is None or row["measured_oom"] or "estimate_bytes" not in result:
                continue
            reserved = result.get("peak_reserved_bytes")
            if reserved is None:  # estimate_bytes = reserved + the catalogue's overhead then
                reserved = (result["estimate_bytes"]
                            - gpus.lookup(row["gpu_name"]).runtime_overhead_bytes)
            residuals[row["gpu_name"]].append(row["measured_peak_bytes"] - reserved)
    for gpu, values in sorted(residuals.items()):
        median = statistics.median(values)
        fitted = max(0, int(median) // MiB * MiB)
        print(f"{gpu}: n={len(values)} median residual {median / MiB:.1f} MiB -> "
              f"runtime_overhead_bytes = {fitted} ({fitted // MiB} MiB)")


if __name__ == "__main__":
    main()
