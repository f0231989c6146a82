"""In an estimation pod, a model left on the host is reported as not estimated (the
termination message's ``unsupported``, with the module named), never as an estimate."""

from __future__ import annotations

import sys

from tests.controller.test_probe_bundle import _run, built  # noqa: F401 - the bundle fixture


def test_an_estimation_pod_refuses_a_model_left_on_the_host(built, tmp_path, script):  # noqa: F811
    run = _run(built, [sys.executable, script("placement.py"), "--idiom", "to_device_keyword",
                       "--host-only"], tmp_path)
    assert run["code"] == 1, run["output"]
    result = run["result"]
    assert result is not None and result.status == "unsupported"
    assert "AdamW.step() updates 6 parameter tensors" in result.reason
    assert "of the model (Net)" in result.reason
