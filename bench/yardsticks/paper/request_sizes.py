"""What the yardsticks' jobs would be granted: the request under the default policy, against
what each job measured, by family; and the OOM calls of the estimate's range.

A job's request is what the webhook writes under the default policy for its GPU (HAMi, 5%
margin, 256 MiB granularity, 1 GiB minimum: ``policy.sizing.size_request``) from the bench's
estimate and the high end of its range (``high_bytes``; a line without one, as the benches wrote
before the range existed, is sized from its estimate alone). A job that ran is **over its
request** when its measured peak is above the request: under HAMi, KAI or MIG it fails at its
first try. The cost is the request over the measured peak (median per family).

The OOM call of a line: "does not fit" (``predicted_oom``: the low end does not fit), "may not
fit" (``fit``: only the point or the high end does not), else "fits".

Usage (both benches' ``--out`` files, or an older one for the figures before):
``.venv/bin/python -m bench.yardsticks.paper.request_sizes RUNS.jsonl OUT.jsonl`` (the paper's rows: also with
each row's runtime overhead held out, ``benchmark.held_out``)
"""

from __future__ import annotations

import json
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence

from xmem_admission.cluster.policy.model import BackendName, Policy
from xmem_admission.cluster.policy.sizing import size_request
from xmem_admission.contract import gpus

# How the benches' families are reported: the paper's large transformers are transformers.
FAMILIES = {"cnn": "CNN", "transformer": "transformer", "large-transformer": "transformer",
            "mlp": "MLP"}
MAY_NOT_FIT = "may not fit"


def request_bytes(estimate_bytes: int, high_bytes: Optional[int], gpu_name: str) -> int:
    """The request the default policy gives a job on ``gpu_name`` (a catalogue name or key)."""
    gpu = gpus.lookup(gpu_name)
    settings = Policy.from_spec({"targets": [{"gpu": gpu.key,
                                              "backend": BackendName.HAMI.value}]}).defaults
    return size_request(int(estimate_bytes), settings, gpu.capacity_bytes, high_bytes)


@dataclass
class Requests:
    """One family's requests and OOM calls."""

    family: str
    ran: int = 0  # rows that ran, with an estimate
    over: int = 0  # of them, measured above their request
    oom_rows: int = 0  # rows that ran out of memory when measured
    oom_called: int = 0  # of them, said not to fit ("does not fit")
    oom_warned: int = 0  # of them, said "may not fit"
    ran_called_oom: int = 0  # rows that ran, said not to fit
    ran_warned: int = 0  # rows that ran, said "may not fit"
    ratios: Optional[List[float]] = None  # request / measured - 1, rows that ran

    @property
    def median_over_measured(self) -> float:
        return statistics.median(self.ratios) if self.ratios else float("nan")


def tally(rows: Iterable[Any], answers: Mapping[str, Mapping[str, Any]]) -> Dict[str, Requests]:
    """Per family (and "all"), from the benches' rows (``benchmark.Row``, ``gpumemnet.Row``:
    their ``oom`` and ``measured``; the paper's GPU in ``gpu_name``, GPUMemNet's in ``gpu``)
    and the bench's answers by id."""
    out: Dict[str, Requests] = {}
    for row in rows:
        answer = answers.get(row.id)
        if answer is None or answer.get("estimate_bytes") is None:
            continue
        family = FAMILIES.get(row.family, row.family)
        request = answer.get("request_bytes")
        if request is None:
            request = request_bytes(answer["estimate_bytes"], answer.get("high_bytes"),
                                    str(row.data.get("gpu_name") or row.data["gpu"]))
        warned = answer.get("fit") == MAY_NOT_FIT
        for key in (family, "all"):
            t = out.setdefault(key, Requests(key, ratios=[]))
            if row.oom:
                t.oom_rows += 1
                t.oom_called += bool(answer.get("predicted_oom"))
                t.oom_warned += warned
                continue
            if row.data.get("measured_is_lower_bound") or row.measured <= 0:
                continue
            measured = row.measured
            t.ran += 1
            t.over += measured > request
            t.ran_called_oom += bool(answer.get("predicted_oom"))
            t.ran_warned += warned
            assert t.ratios is not None
            t.ratios.append(request / measured - 1.0)
    return out


def table(title: str, tallies: Mapping[str, Requests]) -> str:
    lines = [title, f"{'family':12} {'ran':>4} {'over request':>12} {'request/measured':>16} "
             f"{'OOM rows':>8} {'said OOM':>8} {'may not fit':>11} {'ran, said OOM':>13} "
             f"{'ran, may not fit':>16}"]
    order = [k for k in ("CNN", "transformer", "MLP") if k in tallies]
    order += sorted(k for k in tallies if k not in order and k != "all") + ["all"]
    for key in order:
        t = tallies.get(key)
        if t is None:
            continue
        lines.append(f"{key:12} {t.ran:4d} {t.over:12d} {t.median_over_measured:+16.2%} "
                     f"{t.oom_rows:8d} {t.oom_called:8d} {t.oom_warned:11d} "
                     f"{t.ran_called_oom:13d} {t.ran_warned:16d}")
    return "\n".join(lines)


def _read(path: str) -> List[Dict[str, Any]]:
    with open(path, encoding="utf-8") as fh:
        return [json.loads(line) for line in fh if line.strip()]


def main(argv: Sequence[str]) -> int:
    if len(argv) != 2:
        print(__doc__.strip().splitlines()[-1], file=sys.stderr)
        return 2
    from bench.yardsticks.gpumemnet import Row as GPUMemNetRow
    from bench.yardsticks.paper.benchmark import Row, held_out

    data = _read(argv[0])
    results = _read(argv[1])
    answers = {str(a["id"]): a for a in results}
    paper = all("gpu_name" in r for r in data)
    rows = [Row(r) if paper else GPUMemNetRow(r) for r in data]
    print(table(f"requests under the default policy ({argv[1]})", tally(rows, answers)))
    if paper:  # the paper's rows: their runtime overhead held out too
        print(table("requests, held out (runtime overhead fitted on the other rows of the GPU)",
                    tally(rows, held_out([r for r in rows if isinstance(r, Row)], results))))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
