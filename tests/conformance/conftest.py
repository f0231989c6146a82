from __future__ import annotations

import pytest

# The virtual GPU the corpus is traced on (an H200: bf16, flash attention).
H200 = {"name": "NVIDIA H200", "total_memory": 150_754_820_096, "compute_capability": [9, 0],
        "multi_processor_count": 132}


@pytest.fixture
def trace_script(capfd):
    """Run a corpus script under the probe in this process (torch is imported once: fast)."""
    from tests.conformance.counts import script
    from xmem_admission.estimator.probe import runner

    def run(name, *args, mode="fake", steps=3):
        result = runner.run([script(name), *args], mode, steps, H200)
        return result, capfd.readouterr()

    return run
