"""A ``record_function`` range (FSDP2 opens one around every collective and hook) is a name on the
profiler's timeline: the tracker passes its ops through without weighing them as host data or as
GPU memory."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from xmem_admission.estimator.probe.tracker import AllocationTracker
from xmem_admission.estimator.trace import Trace


def test_a_profiler_range_is_passed_through_without_being_weighed(monkeypatch):
    weighed = []
    real_host_data = AllocationTracker._host_data

    def host_data(self, func, *rest):
        weighed.append(str(func))
        return real_host_data(self, func, *rest)

    monkeypatch.setattr(AllocationTracker, "_host_data", host_data)
    mode = FakeTensorMode()
    trace = Trace()
    tracker = AllocationTracker(trace, fake=True, fake_mode=mode)
    with mode, tracker:
        with torch.autograd.profiler.record_function("FSDP::all_gather"):
            ones = torch.ones(4)
    assert ones.shape == (4,)
    # The factory inside the range is weighed as any op is; the range's enter and exit are not.
    assert weighed == ["aten.ones.default"]
    assert trace.events == []
