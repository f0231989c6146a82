"""``xmem replay``: prove the allocator simulator against a real GPU's memory snapshot.

Loads a ``torch.cuda.memory._dump_snapshot()`` pickle (data only: the unpickler refuses every
class), rebuilds the state before its trace began, replays the trace and compares every
``segment_alloc`` and the reserved total at the dump. Exit 0 when they match, 1 when not.
"""

from __future__ import annotations

import json
from typing import Any, Dict


def register(subparsers: Any) -> None:
    """Add the ``replay`` subcommand to the ``xmem`` parser."""
    parser = subparsers.add_parser(
        "replay",
        help="replay a real CUDA memory snapshot through the allocator simulator and compare",
        description="Replay the trace of a torch.cuda.memory._dump_snapshot() pickle through "
        "the caching-allocator simulator, starting from the state that existed before the "
        "trace began, and compare every cudaMalloc (segment_alloc: size and triggering "
        "request) and the reserved total at the dump. Exits 0 when everything matches, 1 when "
        "something does not, 2 when the file cannot be used.",
    )
    parser.add_argument("snapshot", metavar="SNAPSHOT.pickle",
                        help="a pickle written by torch.cuda.memory._dump_snapshot()")
    parser.add_argument("--json", action="store_true",
                        help="print one JSON object (segment_allocs_expected, "
                        "segment_allocs_matched, reserved_expected_bytes, "
                        "reserved_simulated_bytes, match, ...)")
    parser.set_defaults(func=run)


def run(args: Any) -> int:
    from xmem_admission.estimator.allocator.snapshot import load_snapshot, replay_snapshot

    report = replay_snapshot(load_snapshot(args.snapshot))
    result = report.to_dict()
    result["snapshot"] = args.snapshot
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(_table(result))
    return 0 if report.match else 1


def _table(r: Dict[str, Any]) -> str:
    """A short human summary: expected vs simulated, then the verdict and first mismatches."""
    made, released = (("pages mapped (segment_map)", "pages unmapped (segment_unmap)")
                      if r.get("expandable") else
                      ("cudaMalloc'd segments (segment_alloc)", "segments released (segment_free)"))
    rows = [
        ("", "GPU", "simulator"),
        (made, str(r["segment_allocs_expected"]),
         f"{r['segment_allocs_matched']} same size, same request"
         + (f", {r['segment_allocs_extra']} extra" if r["segment_allocs_extra"] else "")),
        (released, str(r["segment_frees_expected"]),
         f"{r['segment_frees_matched']} the same"),
        ("allocations placed at the GPU's address", str(r["allocs"]),
         str(r["addresses_matched"])),
        ("segments at the dump", str(r["segments_expected"]), str(r["segments_simulated"])),
        ("reserved at the dump (bytes)", str(r["reserved_expected_bytes"]),
         str(r["reserved_simulated_bytes"])),
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    lines = [f"snapshot: {r['snapshot']} ({r['events']} trace events, {r['devices']} device(s))"]
    lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
    lines.append("result: " + ("MATCH" if r["match"] else "MISMATCH"))
    lines += [f"  - {m}" for m in r["mismatches"]]
    return "\n".join(lines)
