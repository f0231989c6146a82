"""bench/convolution/conv_heuristics_table.py: cuDNN's first workspace per shape and architecture against the
fitted rule; the geometry inferred from the sizes, ambiguity reported, the rule's figures the
contract's."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from xmem_admission.contract import cudnn
from xmem_admission.estimator import cudnn_heuristics as ch

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("conv_heuristics_table",
                                               ROOT / "bench" / "convolution" / "conv_heuristics_table.py")
table = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(table)

SHAPE = {"x": [30, 46, 21, 21], "w": [58, 46, 3, 3], "y": [30, 58, 11, 11], "g": 1, "b": 4,
         "row": "cnn1p-000999"}


def test_stride_and_padding_come_from_the_sizes():
    conv, ambiguous = table.convolution(SHAPE)
    assert (conv.stride, conv.padding, ambiguous) == ((2, 2), (1, 1), False)


def test_a_shape_two_geometries_explain_is_reported_ambiguous():
    one_pixel = {"x": [2, 8, 3, 3], "w": [8, 8, 3, 3], "y": [2, 8, 1, 1], "g": 1, "b": 4}
    assert len(table.geometry_candidates(one_pixel["x"], one_pixel["w"], one_pixel["y"])[0]) > 1
    conv, ambiguous = table.convolution(one_pixel)
    assert ambiguous and conv.stride == (1, 1)


def test_a_shape_no_geometry_explains_is_refused():
    with pytest.raises(ValueError, match="no stride and padding"):
        table.convolution({**SHAPE, "y": [30, 58, 40, 40]})


def test_the_rule_column_is_the_contracts_rule_and_only_sm80_has_one():
    basis = (30 * 46 * 21 * 21 + 30 * 58 * 11 * 11 + 58 * 46 * 9) * 4
    rule = cudnn.rule_for((8, 0))
    assert rule is not None
    assert table.rule_bytes("A100-40GB", cudnn.ConvCall.FORWARD, SHAPE) == cudnn.workspace_bytes(
        rule, cudnn.ConvCall.FORWARD, 0, 0, basis)
    assert table.rule_bytes("H100-80GB", cudnn.ConvCall.FORWARD, SHAPE) is None


def test_the_table_holds_every_architecture_and_call_from_cudnn_itself(deviceless_cudnn):
    lib = deviceless_cudnn
    rows = table.evaluate([SHAPE], lib)
    cells = rows[0]["cells"]
    assert set(cells) == {f"{arch}/{call}" for arch, _ in table.GPUS
                          for call in ("fwd", "bwd_data", "bwd_filter")}
    conv, _ = table.convolution(SHAPE)
    from xmem_admission.contract.gpus import lookup
    assert cells["sm90/bwd_filter"]["first"] == ch.torch_workspaces(
        lookup("H100-80GB"), conv, cudnn.ConvCall.BACKWARD_FILTER, library=lib)[0]
    text = table.markdown(rows, lib.version_text)
    assert f"cuDNN {lib.version_text}" in text
    assert "| 30x46x21x21 -> 58, 3x3 s2 p1 |" in text
    assert text.count("no rule") == 9  # sm86, sm89, sm90: three calls each
