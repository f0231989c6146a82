"""cuDNN's own first workspace per convolution against the fitted rule, four architectures.

For each shape of ``bench/data/conv_shapes.jsonl`` (120 forward convolutions of GPUMemNet's CNN
jobs, ``bench/convolution/conv_workspaces.py --make-shapes``) and each call (forward, data gradient, weight
gradient), the workspace of the first plan PyTorch would try with ``cudnn.benchmark`` off
(``estimator.cudnn_heuristics.torch_workspaces``: cuDNN's heuristics planned deviceless on the
CPU, in Conv_v8.cpp's order and filters, for torch's default flags: TF32 allowed, not
deterministic), fp32 NCHW, on one catalogue GPU per architecture: sm80 A100-40GB, sm86 A10,
sm89 L40S, sm90 H100-80GB. Against it, what the fitted rule (``contract.cudnn.workspace_bytes``
with ``rule_for``) gives the same call; only compute capability 8.0 has a rule, the others get
no workspace from it.

The shapes made from traces whose marks carry the geometry carry their marks' stride, padding, dilation,
dtype, layout and flags, used as they are. Older shape files carry x, w, y, groups and element
size only: stride and padding are then inferred per spatial dimension as the pairs (stride >= 1,
0 <= padding < kernel, dilation 1) with ``(in + 2 * padding - kernel) // stride + 1 == out``; a
shape with more than one pair is reported as ambiguous and takes the smallest stride.

    .venv/bin/python bench/convolution/conv_heuristics_table.py [--limit N] [--json OUT.json]

Prints markdown: the summary (medians, how often the first plan needs more than the rule, the
largest gaps) and the full table, one row per shape, MiB.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT / "src") not in sys.path:
    sys.path.insert(0, str(ROOT / "src"))

from xmem_admission.contract import cudnn  # noqa: E402
from xmem_admission.contract.gpus import lookup  # noqa: E402
from xmem_admission.estimator import cudnn_heuristics as ch  # noqa: E402

sys.path.insert(0, str(ROOT))
from bench.convolution.conv_workspaces import convolution as conv_shape  # noqa: E402

SHAPES = ROOT / "bench" / "data" / "conv_shapes.jsonl"
# One catalogue GPU per architecture the issue asks for.
GPUS = (("sm80", "A100-40GB"), ("sm86", "A10"), ("sm89", "L40S"), ("sm90", "H100-80GB"))
CALLS = (cudnn.ConvCall.FORWARD, cudnn.ConvCall.BACKWARD_DATA, cudnn.ConvCall.BACKWARD_FILTER)
MIB = 2**20


def geometry_candidates(x: Sequence[int], w: Sequence[int], y: Sequence[int]
                        ) -> List[List[Tuple[int, int]]]:
    """Per spatial dimension, every (stride, padding) that turns x into y with kernel w."""
    found = []
    for size, kernel, out in zip(x[2:], w[2:], y[2:]):
        found.append([(s, p) for s in range(1, max(size, kernel) + 1) for p in range(kernel)
                      if (size + 2 * p - kernel) // s + 1 == out])
    return found


def convolution(shape: Dict[str, Any]) -> Tuple[ch.Convolution, bool]:
    """The shape as a convolution, and whether its geometry was ambiguous (never for a shape
    whose mark carried its own geometry, dtype and layout: ``conv_workspaces.parse_mark``)."""
    if "s" in shape and "p" in shape:
        return conv_shape(shape), False
    x, w, y = shape["x"], shape["w"], shape["y"]
    candidates = geometry_candidates(x, w, y)
    if any(not c for c in candidates):
        raise ValueError(f"no stride and padding turn {x} into {y} with kernel {w}")
    chosen = [min(c) for c in candidates]
    dtype = {4: "float32", 2: "bfloat16"}[int(shape["b"])]
    conv = ch.Convolution(batch=x[0], in_channels=x[1], height=x[2], width=x[3],
                          out_channels=w[0], kernel=(w[2], w[3]),
                          stride=(chosen[0][0], chosen[1][0]),
                          padding=(chosen[0][1], chosen[1][1]), groups=int(shape["g"]),
                          dtype=dtype)
    if list(conv.shapes()[2]) != list(y):
        raise ValueError(f"inferred geometry does not give {y}")
    return conv, any(len(c) > 1 for c in candidates)


def rule_bytes(gpu_key: str, call: cudnn.ConvCall, shape: Dict[str, Any]) -> Optional[int]:
    """The fitted rule's workspace for the call; None where the architecture has no rule."""
    rule = cudnn.rule_for(lookup(gpu_key).compute_capability)
    if rule is None:
        return None
    size = int(shape["b"])

    def nbytes(dims: Sequence[int]) -> int:
        total = size
        for d in dims:
            total *= int(d)
        return total

    return cudnn.workspace_bytes(rule, call, nbytes(shape["x"]), nbytes(shape["y"]),
                                 nbytes(shape["w"]))


def evaluate(shapes: Sequence[Dict[str, Any]],
             library: Optional[ch.CudnnLibrary] = None) -> List[Dict[str, Any]]:
    """One row per shape: per architecture and call the first workspace torch would try, the
    smallest of its list (what runs when nothing bigger fits), and the rule's."""
    lib = library or ch.load_cudnn()
    rows = []
    for shape in shapes:
        conv, ambiguous = convolution(shape)
        row: Dict[str, Any] = {"row": shape.get("row"), "x": shape["x"], "w": shape["w"],
                               "y": shape["y"], "stride": list(conv.stride),
                               "padding": list(conv.padding), "ambiguous": ambiguous,
                               "cells": {}}
        for arch, gpu_key in GPUS:
            for call in CALLS:
                sizes = ch.torch_workspaces(lookup(gpu_key), conv, call, library=lib)
                row["cells"][f"{arch}/{call.value}"] = {
                    "first": sizes[0] if sizes else None,
                    "smallest": min(sizes) if sizes else None,
                    "plans": len(sizes), "rule": rule_bytes(gpu_key, call, shape)}
        rows.append(row)
    return rows


def _mib(value: Optional[float]) -> str:
    if value is None:
        return "-"
    if 0 < value < 0.05 * MIB:
        return "<0.1"
    return f"{value / MIB:.1f}"


def summary(rows: Sequence[Dict[str, Any]]) -> List[Dict[str, Any]]:
    """Per architecture and call: medians, how often the first plan needs more than the rule."""
    out = []
    for arch, gpu_key in GPUS:
        for call in CALLS:
            cells = [r["cells"][f"{arch}/{call.value}"] for r in rows]
            firsts = [c["first"] for c in cells if c["first"] is not None]
            rules = [c["rule"] or 0 for c in cells]
            more = sum(1 for c in cells if (c["first"] or 0) > (c["rule"] or 0))
            zero = sum(1 for c in cells if c["first"] == 0)
            out.append({"arch": arch, "gpu": gpu_key, "call": call.value,
                        "median_first": statistics.median(firsts) if firsts else None,
                        "max_first": max(firsts) if firsts else None,
                        "median_rule": statistics.median(rules) if rules else None,
                        "has_rule": any(c["rule"] is not None for c in cells),
                        "first_above_rule": more, "first_zero": zero, "shapes": len(cells),
                        "no_plan": sum(1 for c in cells if c["first"] is None)})
    return out


def largest_gaps(rows: Sequence[Dict[str, Any]], arch: str, count: int = 5
                 ) -> List[Tuple[int, Dict[str, Any], str]]:
    """The (first - rule) gaps largest in size on one architecture, either sign."""
    gaps = []
    for row in rows:
        for call in CALLS:
            cell = row["cells"][f"{arch}/{call.value}"]
            if cell["first"] is None:
                continue
            gaps.append((cell["first"] - (cell["rule"] or 0), row, call.value))
    gaps.sort(key=lambda g: -abs(g[0]))
    return gaps[:count]


def _shape_text(row: Dict[str, Any]) -> str:
    x, w = row["x"], row["w"]
    star = "*" if row["ambiguous"] else ""
    return (f"{x[0]}x{x[1]}x{x[2]}x{x[3]} -> {w[0]}, {w[2]}x{w[3]} s{row['stride'][0]}"
            f" p{row['padding'][0]}{star}")


def markdown(rows: Sequence[Dict[str, Any]], version: str) -> str:
    lines = [f"cuDNN {version}, deviceless plans; fp32 NCHW, TF32 allowed, not deterministic,"
             " benchmark off; MiB.", "",
             "| GPU | call | median first plan | largest first plan | median rule |"
             " first plan > rule | first plan needs 0 |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: |"]
    for s in summary(rows):
        rule = _mib(s["median_rule"]) if s["has_rule"] else "no rule"
        lines.append(f"| {s['arch']} {s['gpu']} | {s['call']} | {_mib(s['median_first'])} |"
                     f" {_mib(s['max_first'])} | {rule} |"
                     f" {s['first_above_rule']}/{s['shapes']} | {s['first_zero']}/{s['shapes']} |")
    lines += ["", "Largest gaps on sm80 (first plan - rule):", ""]
    for gap, row, call in largest_gaps(rows, "sm80"):
        cell = row["cells"][f"sm80/{call}"]
        lines.append(f"- {_shape_text(row)} {call}: first plan {_mib(cell['first'])},"
                     f" rule {_mib(cell['rule'])} ({'+' if gap >= 0 else '-'}"
                     f"{abs(gap) / MIB:.1f} MiB)")
    lines += ["", "| shape (N x C x H x W -> K, R x S, stride, padding) | rule sm80 |"
              + "".join(f" {arch} fwd / dgrad / wgrad |" for arch, _ in GPUS),
              "| --- | ---: |" + " ---: |" * len(GPUS)]
    for row in rows:
        rule = row["cells"]["sm80/fwd"]["rule"]
        cells = ["/".join(_mib(row["cells"][f"{arch}/{call.value}"]["first"]) for call in CALLS)
                 for arch, _ in GPUS]
        lines.append(f"| {_shape_text(row)} | {_mib(rule)} | " + " | ".join(cells) + " |")
    ambiguous = sum(1 for r in rows if r["ambiguous"])
    lines += ["", f"{ambiguous} of {len(rows)} shapes had more than one stride and padding"
              " (marked *, smallest stride taken)."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="conv_heuristics_table.py",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=Path, default=SHAPES)
    parser.add_argument("--limit", type=int, help="only the first N shapes")
    parser.add_argument("--json", type=Path, help="also write the rows as JSON here")
    args = parser.parse_args(argv)
    try:
        shapes = [json.loads(line) for line in args.shapes.read_text().splitlines()
                  if line.strip()][:args.limit]
        lib = ch.load_cudnn()
        rows = evaluate(shapes, lib)
    except (OSError, ValueError, ch.CudnnPlanningUnavailable) as exc:
        print(f"conv_heuristics_table: error: {exc}", file=sys.stderr)
        return 2
    if args.json:
        args.json.write_text(json.dumps({"cudnn": lib.version_text, "rows": rows}, indent=1))
    print(markdown(rows, lib.version_text))
    return 0


if __name__ == "__main__":
    sys.exit(main())
