"""A ``record_function`` range (FSDP2 opens one around every collective and hook) is a name on the
profiler's timeline: the tracker passes its ops through without weighing them as host data or as
GPU memory."""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from xmem_admission.estimator.probe import tracker as tracker_module
from xmem_admission.estimator.probe.tracker import HOST_FACTORY_NUMEL, AllocationTracker
from xmem_admission.estimator.trace import Trace


def test_a_profiler_range_is_passed_through_without_being_weighed(monkeypatch):
    weighed = []
    real_host_data = tracker_module.host_data

    def host_data(func, *rest):
        weighed.append(str(func))
        return real_host_data(func, *rest)

    monkeypatch.setattr(tracker_module, "host_data", host_data)
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


def test_a_profiler_range_never_reaches_the_fake_mode_below_the_tracker(monkeypatch):
    seen = []
    real_dispatch = FakeTensorMode.dispatch

    def dispatch(self, func, *rest, **kwargs):
        seen.append(str(func))
        return real_dispatch(self, func, *rest, **kwargs)

    monkeypatch.setattr(FakeTensorMode, "dispatch", dispatch)
    mode = FakeTensorMode()
    tracker = AllocationTracker(Trace(), fake=True, fake_mode=mode)
    with mode, tracker:
        with torch.autograd.profiler.record_function("FSDP::post_backward_reduce"):
            grads = torch.empty(2 * HOST_FACTORY_NUMEL)  # a host block this large is fake
    assert grads.shape == (2 * HOST_FACTORY_NUMEL,)
    assert [name for name in seen if name.startswith("aten.")]  # the factory inside reached it
    assert not [name for name in seen if name.startswith("profiler.")]
