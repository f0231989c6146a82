"""An empty tensor on the GPU is a GPU tensor though it holds no memory: a parameter freed to
one between uses (DeepSpeed ZeRO-3's partitioned parameters) still reads as on the GPU, and what
the script makes on its device is made on the GPU, not on the host."""

from __future__ import annotations


def test_a_parameter_freed_to_an_empty_tensor_stays_on_the_gpu(probe_run, script):
    result, out = probe_run([script("freed_parameters.py")], "fake")
    assert result.status == "ok", result.reason
    # the freed weight reads as on the GPU, so the partition moved to its device stays there
    # (the probe ends the script at its third step, before that step's free)
    assert out.count("freed: ") == out.count("freed: cuda True True") == 2
