"""Reading a trace the way the tests check it: what is live, by category, at a mark."""

from __future__ import annotations

from collections import Counter

from xmem_admission.estimator.trace import ALLOC, FREE, MARK, Trace

MIB = 2**20


def traced(*labels: str) -> Trace:
    """A 64 MiB activation live across the marks ``labels`` (cudnn: marks, for instance)."""
    t = Trace()
    t.alloc(1, 64 * MIB, category="activation", phase="forward")
    for label in labels:
        t.mark(label)
    t.free(1)
    return t


def live_by_category_at(trace, label: str) -> Counter:
    """Bytes of the allocations live when the trace reaches the mark ``label``, by category."""
    live = {}
    for e in trace.events:
        if e.op == ALLOC:
            live[e.id] = e
        elif e.op == FREE:
            live.pop(e.id, None)
        elif e.op == MARK and e.label == label:
            total: Counter = Counter()
            for a in live.values():
                total[a.category] += a.size
            return total
    raise AssertionError(f"the trace has no mark {label!r}")


def allocations_of_step(trace, step: int):
    """The allocations between the ``step``-th and the next step mark (0: before the first)."""
    steps = 0
    for e in trace.events:
        if e.op == MARK and e.label.startswith("step"):
            steps += 1
        elif e.op == ALLOC and steps == step:
            yield e
