"""Which fields of the device description move cuDNN's deviceless answer.

cuDNN plans without a GPU from a device description (``cudnn_heuristics.description_json``: SM
count, L2, clocks, memory, shared memory limits, ...). Where the plan a GPU chose differs from
the deviceless first plan (``bench/convolution/conv_workspaces.py --compare``), either a field of the
description is wrong, or the device's choice depends on something no description carries. This
asks cuDNN, for every shape of a measured file (or ``bench/data/conv_shapes.jsonl``) and every
call, for the first plan PyTorch would try (``CUDNN_HEUR_MODE_INSTANT``, then the fallback list;
down-converting engines dropped, as ``filterEngineConfigs`` does) with the catalogue GPU's
description and with each field changed alone, and prints how many of the calls change their
first plan (engine, knobs or workspace). With ``--measured FILE`` it also counts, per
description, how many calls the first plan explains (``held_by_measurement``), and does the same
for heuristics mode B (``TORCH_CUDNN_USE_HEURISTIC_MODE_B``).

    .venv/bin/python bench/convolution/conv_device_fields.py --measured bench/data/H200/conv_workspaces.jsonl \\
        [--cudnn LIBCUDNN]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

ROOT = Path(__file__).resolve().parents[2]
for _path in (str(ROOT / "src"),):
    if _path not in sys.path:
        sys.path.insert(0, _path)
_spec = importlib.util.spec_from_file_location(
    "conv_workspaces", ROOT / "bench" / "convolution" / "conv_workspaces.py")
cw = importlib.util.module_from_spec(_spec)  # type: ignore[arg-type]
_spec.loader.exec_module(cw)  # type: ignore[union-attr]

# Each field changed alone, far enough to cross any threshold a heuristic might have: the SM
# count halved and doubled (a green context's share, a larger part), L2 x4 and / 8, the memory
# clock / 3, the SM clock / 2, the shared memory a block may opt in to that of an sm80 part
# (101,376 bytes would be sm86's; 166,912 is sm80's, CUDA C++ Programming Guide table "Technical
# Specifications per Compute Capability"), the memory / 8, and a real PCI device id (0x2335,
# the H200 SXM's in the PCI ID repository) instead of 0.
VARIANTS: Dict[str, Dict[str, Any]] = {
    "SM count / 2": {"multiProcessorCount": 0.5},
    "SM count x 2": {"multiProcessorCount": 2.0},
    "L2 x 4": {"l2CacheSize": 4.0},
    "L2 / 8": {"l2CacheSize": 0.125},
    "memory clock / 3": {"memClockRateKHz": 1 / 3},
    "SM clock / 2": {"smClockRateKHz": 0.5},
    "shared memory opt-in of sm80": {"maxSharedMemoryPerBlockOptin": 166912},
    "global memory / 8": {"totalGlobalMem": 0.125},
    "PCI device id 0x2335": {"pciDeviceId": 0x2335},
}


def variant(base: Dict[str, Any], change: Dict[str, Any]) -> Dict[str, Any]:
    """``base`` with ``change`` applied: a float scales the field, an int replaces it."""
    out = dict(base)
    for key, value in change.items():
        out[key] = int(out[key] * value) if isinstance(value, float) else value
    return out


def first_plan(lib: Any, description: Dict[str, Any], conv: Any, call: Any,
               mode_b: bool = False) -> Optional[Tuple[int, Tuple[Tuple[int, int], ...], int]]:
    """(engine, knobs, workspace) of the first plan PyTorch tries for ``description``."""
    from xmem_admission.estimator import cudnn_heuristics as ch

    def kept(plan: Any) -> bool:  # filterEngineConfigs, TF32 allowed, not deterministic
        return ch.NumericalNote.DOWN_CONVERT_INPUTS not in plan.notes

    first = ch.HeuristicMode.B if mode_b else ch.HeuristicMode.INSTANT
    plans = [p for p in lib.plans(json.dumps(description), conv, call,
                                  (first, ch.HeuristicMode.FALLBACK), stop=kept) if kept(p)]
    return (plans[0].engine, plans[0].knobs, plans[0].workspace_bytes) if plans else None


def survey(rows: Sequence[Dict[str, Any]], gpu_name: str, lib: Any,
           measured: bool) -> Tuple[str, Dict[str, Any]]:
    """The table: per description, how many calls change their first plan (and, with
    measurements, how many the first plan explains); and the summary."""
    from xmem_admission.contract import cudnn
    from xmem_admission.contract.gpu_devices import device_description
    from xmem_admission.contract.gpus import lookup
    from xmem_admission.estimator import cudnn_heuristics as ch

    gpu = lookup(gpu_name)
    base = json.loads(ch.description_json(device_description(gpu)))
    descriptions = [("the catalogue's", base, False)]
    descriptions += [(name, variant(base, change), False) for name, change in VARIANTS.items()]
    descriptions.append(("heuristics mode B, the catalogue's", base, True))
    convs = [cw.convolution(r["shape"]) for r in rows]
    answers: Dict[str, List[Any]] = {}
    explained: Dict[str, Dict[str, int]] = {}
    for name, description, mode_b in descriptions:
        out: List[Any] = []
        hits = dict.fromkeys(cw.CALLS, 0)
        for row, conv in zip(rows, convs):
            firsts = {c: first_plan(lib, description, conv, cudnn.ConvCall(c), mode_b)
                      for c in cw.CALLS}
            out += [firsts[c] for c in cw.CALLS]
            if measured:
                held = cw.held_by_measurement(row["shape"], {c: (firsts[c] or (0, (), 0))[2]
                                                             for c in cw.CALLS})
                for c in cw.CALLS:
                    hits[c] += held[c][-1] == row["held_bytes"][c][-1]
        answers[name] = out
        explained[name] = hits
    reference = answers["the catalogue's"]
    total = len(reference)
    lines = [f"cuDNN {lib.version_text}, deviceless, the catalogue's {gpu.key} and each field "
             f"changed alone; {len(rows)} shapes x 3 calls", "",
             "| description | calls whose first plan changes |" +
             (" first plan explains fwd / bwd_data / bwd_filter |" if measured else ""),
             "| --- | --- |" + (" --- |" if measured else "")]
    summary: Dict[str, Any] = {"cudnn": lib.version_text, "gpu": gpu.key, "calls": total,
                               "descriptions": {}}
    for name, _, _ in descriptions:
        changed = sum(a != b for a, b in zip(answers[name], reference))
        line = f"| {name} | {changed} of {total} |"
        if measured:
            hits = explained[name]
            line += " " + " / ".join(str(hits[c]) for c in cw.CALLS) + f" of {len(rows)} |"
        lines.append(line)
        summary["descriptions"][name] = {"changed": changed,
                                         "explained": explained[name] if measured else None}
    return "\n".join(lines), summary


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(prog="conv_device_fields.py",
                                     description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--measured", type=Path, metavar="FILE",
                        help="a bench/convolution/conv_workspaces.py --measure file (its GPU and shapes)")
    source.add_argument("--shapes", type=Path, default=cw.SHAPES)
    parser.add_argument("--gpu", default="H200", help="catalogue GPU without --measured")
    parser.add_argument("--cudnn", metavar="LIBCUDNN", help="plan with this libcudnn")
    args = parser.parse_args(argv)
    from xmem_admission.estimator import cudnn_heuristics as ch

    try:
        if args.measured:
            rows = [r for r in cw.load_rows(args.measured) if r.get("held_bytes")
                    and r["held_bytes"]["fwd"][-1] is not None]
            if not rows:
                raise ValueError(f"{args.measured}: no shape measured on a GPU")
            gpu_name = str(rows[0].get("gpu_name"))
        else:
            rows = [{"shape": s} for s in cw.load_shapes(args.shapes)]
            gpu_name = args.gpu
        lib = ch.load_cudnn(args.cudnn)
        if not lib.deviceless:
            raise ValueError(f"cuDNN {lib.version_text} cannot plan without a GPU")
        table, _ = survey(rows, gpu_name, lib, measured=args.measured is not None)
    except (OSError, ValueError, ch.CudnnPlanningUnavailable) as exc:
        print(f"conv_device_fields: error: {exc}", file=sys.stderr)
        return 2
    except Exception as exc:  # a GPU name the catalogue does not know
        from xmem_admission.contract.errors import XmemError

        if not isinstance(exc, XmemError):
            raise
        print(f"conv_device_fields: error: {exc}", file=sys.stderr)
        return 2
    print(table)
    return 0


if __name__ == "__main__":
    sys.exit(main())
