"""An op whose output size depends on values fake execution lacks never ends an estimate: it is
sized from the values the probe has (masks made from host data), else at its largest, and the
trace says it is a bound; only an op without a bound, or a decision, needs real values (and
``auto`` traces again in profile mode), wherever in the script it is raised."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

# 8 x 128 rows of 64 fp32 (256 bytes each); the labels leave out 32 of each row's 128 tokens
ROW_BYTES = 64 * 4
ALL_ROWS = 8 * 128
LABELLED_ROWS = 8 * 96


def index_blocks(trace):
    """Sizes of the blocks ``aten.index`` made (the selected rows and the mask's nonzero)."""
    return {e.size for e in trace.events if e.op == "alloc" and e.source == "aten.index"}


def bounds(trace):
    return [n for n in trace.notes() if n["kind"] == "bounded"]


def test_a_mask_made_from_the_labels_selects_exactly_the_labelled_rows(probe_run, script):
    result, _ = probe_run([script("selects_by_value.py"), "known"])
    assert result.status == "ok", result.reason
    # the rows, and the CUDA kernel's nonzero of the mask: an int64 pair per selected element
    assert index_blocks(result.trace) == {LABELLED_ROWS * ROW_BYTES, LABELLED_ROWS * 2 * 8}
    assert bounds(result.trace) == []
    assert not result.trace.upper_bound


def test_a_mask_the_model_computes_is_taken_as_selecting_every_row(probe_run, script):
    result, _ = probe_run([script("selects_by_value.py"), "mask"])
    assert result.status == "ok", result.reason
    assert index_blocks(result.trace) == {ALL_ROWS * ROW_BYTES, ALL_ROWS * 2 * 8}
    (note,) = bounds(result.trace)
    assert "aten.index" in note["message"] and "selects_by_value.py" in note["message"]
    assert "8x128 mask taken as selecting every element" in note["message"]
    assert note["count"] == 3  # one note for the line, counted per step
    assert note["extra_bytes"] == 3 * ALL_ROWS * ROW_BYTES
    assert result.trace.upper_bound


@pytest.mark.parametrize("kind, op", [("nonzero", "aten.nonzero"), ("unique", "aten._unique2"),
                                      ("masked_select", "aten.masked_select")])
def test_nonzero_unique_and_masked_select_of_model_values_are_bounds(probe_run, script, kind, op):
    result, _ = probe_run([script("selects_by_value.py"), kind])
    assert result.status == "ok", result.reason
    assert [n["message"].split(" ")[0] for n in bounds(result.trace)] == [op]


def test_repeats_the_model_computes_have_no_bound_and_need_real_values(probe_run, script):
    result, _ = probe_run([script("selects_by_value.py"), "repeat"])
    assert result.status == "needs_real_values"
    assert "aten.repeat_interleave" in result.reason and "no bound" in result.reason


def test_the_need_for_values_is_found_inside_a_library_that_wraps_it(probe_run, script):
    result, _ = probe_run([script("selects_by_value.py"), "wrapped"])
    assert result.status == "needs_real_values", (result.status, result.reason)
    assert "aten.repeat_interleave" in result.reason


def run_estimate(*args):
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "estimate", "--json",
                           "--gpu", "H100-80GB", *args], capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout), proc.stderr


def test_xmem_estimate_says_the_estimate_is_an_upper_bound_and_why(script, tmp_path):
    report = tmp_path / "report.html"
    data, _ = run_estimate("--report", str(report), "--", "python",
                           script("selects_by_value.py"), "mask")
    assert data["mode"] == "fake"
    assert data["upper_bound"] is True
    assert [n["kind"] for n in data["notes"]] == ["bounded"]
    assert "taken as selecting every element" in data["notes"][0]["message"]
    assert data["notes"][0]["extra_bytes"] == 3 * ALL_ROWS * ROW_BYTES
    page = report.read_text()
    assert "upper bound: a size fake execution cannot know, taken at its largest" in page
    assert "mask taken as selecting every element (3 times, at most 768.00 KiB over" in page


def test_auto_traces_a_job_without_a_bound_again_in_profile_mode(script):
    data, _ = run_estimate("--", "python", script("selects_by_value.py"), "repeat")
    assert data["mode"] == "profile"
    assert "aten.repeat_interleave" in data["fallback_reason"]
    assert data["upper_bound"] is False


def test_an_addmm_into_an_fp32_accumulator_writes_the_accumulator(probe_run, script):
    import torch

    if "dtype_out" not in torch.ops.aten.addmm.overloads():
        import pytest

        pytest.skip(f"torch {torch.__version__}: addmm has no out_dtype before torch 2.8")
    result, _ = probe_run([script("addmm_out_dtype.py")])
    assert result.status == "ok", result.reason + result.traceback
    made = [e.size for e in result.trace.events if e.op == "alloc" and e.source == "aten.addmm"]
    # out=acc writes the accumulator (nothing made); without out, one fp32 32 x 512 result
    assert made.count(32 * 512 * 4) == 3, made
