"""Fit what a job holds outside the caching allocator from GPU-truth measurements, leave-one-out.

``bench/yardsticks/gpu_truth.py``'s measurements record, per job, the NVML device peak minus the level before
CUDA was initialised (``measured_total_bytes``), the CUDA context alone (``context_bytes``) and the
allocator's ``max_memory_reserved``. What lives outside the allocator is the first minus the last;
past the context, it is what the training step loads lazily (kernel modules, library handles):
the *runtime* figure of ``contract.overhead``, plus cuDNN's modules for jobs with convolutions.

The rule, per GPU and CUDA major (one measurement file is one of each):

- context: the largest ``context_bytes`` of the rows;
- runtime: the largest ``measured_total - reserved - context`` over the rows without
  convolutions;
- cuDNN: the largest excess of the rows with convolutions over that runtime figure (never
  below zero).

Largest, not a median: a request below what the job takes fails it on a shared GPU. A row is
used when the job ran to completion as expected and NVML's sampled peak saw at least the
allocator's reserved peak plus the context (NVML is sampled every few milliseconds: when its
peak is below that, the sample missed the peak, as in the H200's 6.7B row, and the row says
nothing about the overhead). Which jobs have convolutions: those of ``examples/train_cnn.py``,
whose torchvision models all start with one (ResNet's ``conv1``, ViT's ``conv_proj``,
EfficientNet's and MobileNet's stems).

Leave-one-out: each row's figure is fitted on the other rows, so that no row is scored with a
figure fitted on itself (``gpu_truth.py --estimate`` scores totals with these).

Usage: ``python3 bench/fits/fit_outside.py bench/data/H200/measurements.jsonl`` prints the fit on all
rows (the figures ``contract.overhead`` carries) and each row against its leave-one-out figure.
Standard library only.
"""

from __future__ import annotations

import json
import sys
from typing import Any, Dict, List, Optional, Sequence, Tuple

MiB = 1 << 20
CNN_SCRIPT = "examples/train_cnn.py"


def outside_bytes(row: Dict[str, Any]) -> int:
    """NVML's peak minus the allocator's reserved peak: all that lived outside the allocator."""
    return int(row["measured_total_bytes"]) - int(row["max_memory_reserved_bytes"])


def usable(row: Dict[str, Any]) -> bool:
    """A completed job whose NVML peak saw the allocator's peak (see the module docstring)."""
    return (not row.get("dry_run") and not row.get("oom") and not row.get("error")
            and row.get("expect") in ("fits", "edge")
            and outside_bytes(row) >= int(row["context_bytes"]))


def uses_cudnn(row: Dict[str, Any]) -> bool:
    return bool(row.get("script") == CNN_SCRIPT)


def fit(rows: Sequence[Dict[str, Any]]) -> Optional[Tuple[int, int, int]]:
    """(context, runtime, cuDNN) bytes fitted on ``rows`` (only the usable ones count); None
    when no usable row has no convolutions (the runtime figure needs one)."""
    used = [r for r in rows if usable(r)]
    plain = [r for r in used if not uses_cudnn(r)]
    if not plain:
        return None
    context = max(int(r["context_bytes"]) for r in used)
    runtime = max(outside_bytes(r) - int(r["context_bytes"]) for r in plain)
    convs = [outside_bytes(r) - int(r["context_bytes"]) - runtime for r in used if uses_cudnn(r)]
    return context, runtime, max([0] + convs)


def overhead_of(figures: Tuple[int, int, int], row: Dict[str, Any]) -> int:
    """The overhead the figures give a row's job: context + runtime (+ cuDNN with convolutions)."""
    context, runtime, cudnn = figures
    return context + runtime + (cudnn if uses_cudnn(row) else 0)


def leave_one_out(rows: Sequence[Dict[str, Any]]) -> Dict[str, int]:
    """Each job's overhead fitted on the other rows (jobs whose others allow no fit are left
    out)."""
    out: Dict[str, int] = {}
    for row in rows:
        figures = fit([r for r in rows if r["job"] != row["job"]])
        if figures is not None:
            out[row["job"]] = overhead_of(figures, row)
    return out


def report(rows: Sequence[Dict[str, Any]]) -> List[str]:
    """The fit on all rows, then every row's measured overhead against its leave-one-out one."""
    figures = fit(rows)
    if figures is None:
        return ["no usable row without convolutions: nothing to fit"]
    context, runtime, cudnn = figures
    lines = [f"fit on all {sum(map(usable, rows))} usable rows of {len(rows)}: context "
             f"{context} B ({context / MiB:.1f} MiB), runtime {runtime / MiB:.1f} MiB, "
             f"cuDNN {cudnn / MiB:.1f} MiB",
             f"{'job':<44} {'outside':>9} {'LOO fit':>9} {'diff':>8}  used"]
    loo = leave_one_out(rows)
    under = 0
    for row in rows:
        measured, fitted = outside_bytes(row), loo.get(row["job"])
        diff = "-" if fitted is None else f"{(fitted - measured) / MiB:+.0f}"
        if fitted is not None and usable(row) and fitted < measured:
            under += 1
        shown = "-" if fitted is None else f"{fitted / MiB:.0f} M"
        lines.append(f"{row['job']:<44} {measured / MiB:>7.0f} M {shown:>9} {diff:>8}  "
                     f"{'yes' if usable(row) else 'no'}")
    lines.append(f"usable rows whose leave-one-out figure is below what they held: {under}")
    return lines


def load(path: str) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: Sequence[str]) -> int:
    if len(argv) != 1:
        print(__doc__.strip().splitlines()[-2], file=sys.stderr)
        return 2
    try:
        rows = load(argv[0])
    except (OSError, ValueError) as exc:
        print(f"fit_outside: error: {argv[0]}: {exc}", file=sys.stderr)
        return 2
    print("\n".join(report(rows)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
