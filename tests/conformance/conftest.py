from __future__ import annotations

import pytest

from tests.estimator.conftest import H200  # the virtual GPU (bf16, flash attention)


@pytest.fixture
def trace_script(capfd):
    """Run a corpus script under the probe in this process (torch is imported once: fast)."""
    from tests.conformance.counts import script
    from xmem_admission.estimator.probe import runner

    def run(name, *args, mode="fake", steps=3):
        _fresh_accelerate_state()
        result = runner.run([script(name), *args], mode, steps, H200)
        return result, capfd.readouterr()

    return run


def _fresh_accelerate_state():
    """accelerate keeps its device in a process-wide singleton: one made earlier in this test
    process without the virtual GPU (a test building TrainingArguments) would put a script's
    model on the host (which the probe refuses). A script's own process starts without one."""
    import sys

    state = sys.modules.get("accelerate.state")
    if state is not None:
        state.AcceleratorState._reset_state(reset_partial_state=True)
