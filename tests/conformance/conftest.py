from __future__ import annotations

import pytest

from tests.estimator.conftest import H200  # the virtual GPU (bf16, flash attention)


@pytest.fixture
def trace_script(capfd):
    """Run a corpus script under the probe in this process (torch is imported once: fast)."""
    from tests.conformance.counts import script
    from xmem_admission.estimator.probe import runner

    def run(name, *args, mode="fake", steps=3):
        result = runner.run([script(name), *args], mode, steps, H200)
        return result, capfd.readouterr()

    return run
