"""``xmem gpus``: show the GPU catalogue the estimator and the admission side work from.

Admins check here which names a policy may use and what each model's figures are based on; the
JSON form carries every field, sources included, for tooling and dashboards.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
from typing import Any, Dict, List

from xmem_admission.contract import overhead

MiB = 1 << 20
GiB = 1 << 30


def register(subparsers: Any) -> None:
    """Add the ``gpus`` subcommand to the ``xmem`` parser."""
    parser = subparsers.add_parser(
        "gpus",
        help="list the GPU catalogue (capacity, overhead, cuBLAS workspace, MIG profiles)",
        description="List the GPU models the estimator knows: the memory CUDA reports, the "
        "overhead outside the caching allocator, the cuBLAS workspace per stream and the MIG "
        "profiles, each figure with its source (shown with --json).",
    )
    parser.add_argument(
        "--json", action="store_true", help="print one JSON object with every field and source"
    )
    parser.set_defaults(func=run)


def gpu_record(gpu: Any) -> Dict[str, Any]:
    """Every field of a catalogue entry as plain JSON types, derived values included."""
    record = dataclasses.asdict(gpu)
    record["compute_capability"] = list(gpu.compute_capability)
    record["aliases"] = list(gpu.aliases)
    record["context_bytes"] = gpu.context_bytes
    record["runtime_overhead_bytes"] = gpu.runtime_overhead_bytes
    record["overhead_source"] = gpu.overhead_source
    record["overhead_bytes"] = gpu.overhead_bytes
    record["overhead_by_cuda_major"] = {
        str(major): overhead.for_gpu(gpu.key, major).to_dict()
        for major in overhead.cuda_majors(gpu.key)
    }
    record["mig_profiles"] = [
        dict(dataclasses.asdict(p), resource_name=p.resource_name) for p in gpu.mig_profiles
    ]
    return record


def _table(gpus: List[Any]) -> str:
    """A fixed-width table: one line per GPU, sizes in GiB/MiB so they read at a glance."""
    header = ("GPU", "CUDA name", "capacity", "outside", "context", "runtime", "cuDNN",
              "cuBLAS ws", "CC", "SMs", "MIG profiles")
    rows = [header]
    for gpu in gpus:
        default = overhead.for_gpu(gpu.key)
        mig = " ".join(
            f"{p.name}({p.memory_bytes / GiB:.2f}G)x{p.max_instances}" for p in gpu.mig_profiles
        )
        rows.append((
            gpu.key,
            gpu.cuda_name,
            f"{gpu.capacity_bytes / GiB:.2f} GiB",
            f"{gpu.overhead_bytes / MiB:.0f} MiB",
            *(_figure(f) for f in (default.context, default.runtime, default.cudnn)),
            f"{gpu.cublas_workspace_bytes / MiB:.2f} MiB",
            "{}.{}".format(*gpu.compute_capability),
            str(gpu.multi_processor_count),
            mig or "-",
        ))
    widths = [max(len(row[i]) for row in rows) for i in range(len(header) - 1)]
    lines = []
    for row in rows:
        cells = [cell.ljust(width) for cell, width in zip(row, widths)]
        lines.append("  ".join(cells + [row[-1]]).rstrip())
    lines.append("")
    lines.append(f"Outside the allocator (\"outside\" = context + runtime + cuDNN, for a job built "
                 f"for CUDA {overhead.NEWEST_CUDA_MAJOR} that calls cuDNN; an estimate uses the "
                 f"job's own CUDA and libraries): m measured, f fitted on measured runs, "
                 f"i inferred from another GPU or CUDA.")
    others = [(gpu.key, major) for gpu in gpus for major in overhead.cuda_majors(gpu.key)
              if major != overhead.NEWEST_CUDA_MAJOR]
    for key, major in others:
        figures = overhead.for_gpu(key, major)
        lines.append(f"  {key} with CUDA {major}: context {_figure(figures.context)}, runtime "
                     f"{_figure(figures.runtime)}, cuDNN {_figure(figures.cudnn)}")
    lines.append("Sources of every figure: xmem gpus --json")
    return "\n".join(lines)


def _figure(figure: Any) -> str:
    """A figure in MiB with its basis' initial and the spread of its rows where it has one:
    "527 MiB m", "240 MiB f (224-240)"."""
    text = f"{figure.bytes / MiB:.0f} MiB {figure.basis.value[0]}"
    if figure.low_bytes != figure.bytes or figure.high_bytes != figure.bytes:
        text += f" ({figure.low_bytes / MiB:.0f}-{figure.high_bytes / MiB:.0f})"
    return text


def run(args: argparse.Namespace) -> int:
    """Print the catalogue as a table or, with ``--json``, as one JSON object."""
    from xmem_admission.contract.gpus import all_gpus

    gpus = all_gpus()
    if args.json:
        print(json.dumps({"gpus": [gpu_record(g) for g in gpus]}, indent=2))
    else:
        print(_table(gpus))
    return 0
