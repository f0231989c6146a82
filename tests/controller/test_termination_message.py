"""The estimation result fits a termination message and reads back exactly."""

from __future__ import annotations

import json

import pytest

from xmem_admission.contract import termination
from xmem_admission.contract.errors import TerminationMessageError

GPU = {"gpu": "A100-80GB", "capacity_bytes": 84970559242, "peak_reserved_bytes": 12 << 30,
       "total_bytes": (12 << 30) + (290 << 20), "recommended_request_bytes": 13 << 30,
       "fits": True, "mig_profile": "2g.20gb"}


def test_a_success_round_trips_every_gpu_field():
    text = termination.encode_ok("fake", 3, 12.34, [GPU, dict(GPU, gpu="H100-80GB")], "why")
    result = termination.decode(text)
    assert result.ok and (result.mode, result.steps, result.fallback) == ("fake", 3, "why")
    assert result.gpus[0] == GPU
    assert [g["gpu"] for g in result.gpus] == ["A100-80GB", "H100-80GB"]


def test_a_failure_with_a_huge_traceback_is_cut_from_the_front_to_fit_4_kib():
    traceback = "".join(f"  File \"train.py\", line {i}, in step\n" for i in range(500)) + \
        "ValueError: the last line matters"
    text = termination.encode_failure("script_error", "the script raised ValueError", 1, traceback)
    assert len(text.encode()) <= termination.LIMIT_BYTES
    result = termination.decode(text)
    assert result.traceback.endswith("ValueError: the last line matters")
    assert result.traceback.startswith("...")
    assert (result.status, result.exit_code) == ("script_error", 1)


def test_twenty_target_gpus_still_fit():
    text = termination.encode_ok("profile", 3, 1.0, [dict(GPU, gpu=f"GPU-{i}") for i in range(20)])
    assert len(text.encode()) <= termination.LIMIT_BYTES


@pytest.mark.parametrize("text, complaint", [
    ("", "left no termination message"),
    ("Killed", "not an estimation result"),
    (json.dumps({"v": 2, "status": "ok"}), "not a version-1"),
    (json.dumps({"v": 1, "status": "ok", "gpus": [["A100-80GB", -1, 0, 0, 0, True, None]]}),
     "malformed GPU row"),
    (json.dumps({"v": 1, "status": "exploded"}), "unknown status"),
])
def test_anything_but_a_well_formed_result_is_refused_with_why(text, complaint):
    with pytest.raises(TerminationMessageError, match=complaint):
        termination.decode(text)
