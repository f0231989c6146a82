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
    (json.dumps({"v": 3, "status": "ok"}), "not a version-1 or -2"),
    (json.dumps({"v": 2, "status": "ok", "gpus": [["A100-80GB", 1, 0, 0, 0, True, None]],
                 "peak": {"gpu": "A100-80GB", "groups": [["m", "activation", "aten.mm", -5]]}}),
     "malformed peak"),
    (json.dumps({"v": 1, "status": "ok", "gpus": [["A100-80GB", -1, 0, 0, 0, True, None]]}),
     "malformed GPU row"),
    (json.dumps({"v": 1, "status": "exploded"}), "unknown status"),
])
def test_anything_but_a_well_formed_result_is_refused_with_why(text, complaint):
    with pytest.raises(TerminationMessageError, match=complaint):
        termination.decode(text)


# FSDP1 with activation checkpointing, as the module paths would read without the probe's
# removal of wrapper levels: the longest paths a user's job can give.
FSDP_PATH = ("FullyShardedDataParallel._fsdp_wrapped_module.model.layers.31."
             "_fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj")


def test_every_catalogue_gpu_and_fsdp_module_paths_fit_4_kib_with_the_top_groups():
    from xmem_admission.contract import gpus as catalogue
    from xmem_admission.estimator import peak

    rows = []
    for g in catalogue.all_gpus():
        profile = max(g.mig_profiles, key=lambda p: len(p.name), default=None)
        rows.append(dict(GPU, gpu=g.key, capacity_bytes=g.capacity_bytes,
                         peak_reserved_bytes=g.capacity_bytes - 1, total_bytes=g.capacity_bytes,
                         recommended_request_bytes=g.capacity_bytes * 2,
                         mig_profile=profile.name if profile else None))
    groups = [peak.Group(FSDP_PATH + f".{i}", "optimizer_state",
                         "aten._foreach_addcdiv_with_a_long_name_for_the_test", 10**15 + i, 9)
              for i in range(5)]
    found = peak.Peak("B200", 123456, "backward", 2, 10**15, 10**15, 10**14, 10**14, groups,
                      10**15, 400)
    compact = {"gpu": "B200", "groups": peak.compact(found), "cached": 10**14,
               "fragmentation": 10**14}
    text = termination.encode_ok("profile", 3, 1234.5, rows, "x" * 300, compact)
    assert len(text.encode()) <= termination.LIMIT_BYTES
    result = termination.decode(text)
    assert [g["gpu"] for g in result.gpus] == [g.key for g in catalogue.all_gpus()]
    assert len(result.peak_groups) == 3
    assert result.peak_groups[0]["module"].endswith("self_attn.q_proj.0")
    assert result.peak_groups[0]["bytes"] == 10**15
    assert result.peak_cached_bytes == 10**14 and result.fallback == "x" * 300


def test_a_version_1_result_of_an_older_bundle_is_still_read():
    text = json.dumps({"v": 1, "status": "ok", "mode": "fake", "steps": 3, "seconds": 1.0,
                       "gpus": [[GPU[c] for c in termination.COLUMNS]]})
    result = termination.decode(text)
    assert result.ok and result.gpus[0] == GPU and result.version == 1
    assert result.peak_groups == []
