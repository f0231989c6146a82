"""A GPU tensor copied into a host buffer (``host.copy_(gpu_tensor)``) takes no GPU memory: the
host buffer is where the copy lands, though the op's other input is on the GPU. Fake mode
allocates what profile mode does."""

from __future__ import annotations

from xmem_admission.estimator.trace import ALLOC

HOST_BUFFER = 2_000_000 * 4


def test_a_copy_into_a_host_buffer_allocates_nothing_on_the_gpu(probe_run, script):
    fake, _ = probe_run([script("copies_to_host.py")], "fake")
    profile, _ = probe_run([script("copies_to_host.py")], "profile")
    assert fake.status == profile.status == "ok", (fake.reason, profile.reason)
    for result in (fake, profile):
        assert not [e for e in result.trace.events if e.op == ALLOC and e.size >= HOST_BUFFER]
    # the same GPU allocations, in the same order
    assert allocations(fake.trace) == allocations(profile.trace)


def allocations(trace):
    return [e.size for e in trace.events if e.op == ALLOC]
