"""The probe prints nothing of its own making: no warning caused by its machinery."""

from __future__ import annotations

import pytest

from tests.estimator.conftest import H200


@pytest.mark.parametrize("mode", ["fake", "profile"])
def test_a_compiled_model_reading_data_pointers_traces_without_a_warning(script, capfd, mode):
    from xmem_admission.estimator.probe import runner

    result = runner.run([script("compiled.py")], mode, 3, H200)
    out, err = capfd.readouterr()
    assert (result.status, result.steps) == ("ok", 3), result.reason
    assert "step 1 over 4 tensors" in out
    assert "Warning" not in err, err
