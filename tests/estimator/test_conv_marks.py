"""The probe's cudnn: marks: the format old and new traces carry, and which convolutions PyTorch
sends to cuDNN at all (Convolution.cpp ``_select_conv_backend``, ``use_cudnn_depthwise``)."""

from __future__ import annotations

import pytest

from xmem_admission.contract import cudnn
from xmem_admission.estimator.conv_marks import ConvFlags, ConvMark, as_2d, routes_to_cudnn
from xmem_admission.estimator.orchestrate import conv_workspaces

OLD = "cudnn:bwd_data+bwd_filter x=32,64,56,56 w=128,64,3,3 y=32,128,28,28 g=1 b=4"
NEW = OLD + " s=2,2 p=1,1 d=1,1 cl=1 dt=float32 bm=1 det=0 tf32=1"


def test_an_old_mark_parses_with_its_new_fields_unknown():
    mark = ConvMark.parse(OLD)
    assert mark.calls == ("bwd_data", "bwd_filter")
    assert (mark.x, mark.w, mark.y, mark.groups, mark.itemsize) == (
        (32, 64, 56, 56), (128, 64, 3, 3), (32, 128, 28, 28), 1, 4)
    assert mark.stride is None and mark.dtype is None and mark.allow_tf32 is None
    assert mark.label() == OLD


def test_a_new_mark_carries_geometry_layout_dtype_and_flags_and_reads_back_the_same():
    mark = ConvMark.parse(NEW)
    assert (mark.stride, mark.padding, mark.dilation) == ((2, 2), (1, 1), (1, 1))
    assert mark.channels_last is True and mark.dtype == "float32"
    assert (mark.benchmark, mark.deterministic, mark.allow_tf32) == (True, False, True)
    assert not mark.transposed
    assert mark.label() == NEW
    assert ConvMark.parse(NEW + " tr=1").transposed


def test_the_fitted_rule_gives_old_and_new_marks_the_same_workspaces():
    fitted = cudnn.rule_for((8, 0))
    assert fitted is not None
    assert conv_workspaces(NEW, fitted) == conv_workspaces(OLD, fitted)
    assert conv_workspaces(OLD, fitted) == [
        ("bwd_data", int(1.5 * (32 * 64 * 56 * 56 + 32 * 128 * 28 * 28 + 128 * 64 * 9) * 4)),
        ("bwd_filter", int(1.5 * (32 * 64 * 56 * 56 + 32 * 128 * 28 * 28 + 128 * 64 * 9) * 4))]


@pytest.mark.parametrize("label", ["cublas:main", "cudnn: x=1 w=1 y=1", "cudnn:fwd x=1,2 w=1"])
def test_a_label_that_is_no_convolution_mark_is_refused(label):
    with pytest.raises(ValueError):
        ConvMark.parse(label)


def test_a_1d_convolution_is_marked_as_the_2d_one_cudnn_runs():
    mark = as_2d(ConvMark(("fwd",), (8, 16, 100), (32, 16, 5), (8, 32, 48), 1, 4, (2,), (1,),
                          (1,)))
    assert (mark.x, mark.w, mark.y) == ((8, 16, 1, 100), (32, 16, 1, 5), (8, 32, 1, 48))
    assert (mark.stride, mark.padding, mark.dilation) == ((1, 2), (0, 1), (1, 1))


DEFAULT = ConvFlags()


def _routes(x, w, groups=1, stride=(1, 1), dtype="float32", channels_last=False,
            flags=DEFAULT, dilation=(1, 1), transposed=False, output_padding=(0, 0),
            version=None):
    return routes_to_cudnn(x, w, groups, stride, (1, 1), dilation, transposed, output_padding,
                           dtype, channels_last, flags, version)


def test_plain_and_grouped_convolutions_go_to_cudnn():
    assert _routes((8, 64, 56, 56), (128, 64, 3, 3))
    assert _routes((8, 64, 56, 56), (64, 2, 3, 3), groups=32)  # grouped, not depthwise
    assert _routes((8, 64, 56, 56), (128, 64, 3, 3), dilation=(2, 2))


def test_an_fp32_nchw_depthwise_convolution_runs_on_torchs_own_kernel():
    assert not _routes((8, 64, 56, 56), (64, 1, 3, 3), groups=64)
    assert not _routes((8, 64, 56, 56), (128, 1, 3, 3), groups=64)  # depth multiplier 2
    assert not _routes((8, 64, 56, 56), (64, 1, 3, 3), groups=64, dtype="bfloat16")


def test_a_channels_last_depthwise_convolution_always_goes_to_cudnn():
    assert _routes((8, 64, 56, 56), (64, 1, 3, 3), groups=64, channels_last=True)


@pytest.mark.parametrize(
    "x, kernel, stride, expected",
    [((8, 64, 56, 56), 3, 1, True),  # stride 1, square 1/3/5 filter, width >= 7
     ((8, 64, 56, 56), 7, 1, False),  # 7x7 filter
     ((8, 64, 6, 6), 3, 1, False),  # narrower than 7
     ((8, 16, 56, 56), 3, 1, False),  # fewer than 32 channels
     ((8, 256, 28, 28), 3, 2, True),  # stride 2: 256 channels at width >= 28
     ((8, 256, 14, 14), 3, 2, False),
     ((8, 512, 14, 14), 5, 2, True),
     ((1, 64, 56, 56), 3, 2, True),  # batch 1, 3x3
     ((1, 64, 56, 56), 1, 2, False),  # batch 1, 1x1 wider than 28
     ((16, 128, 7, 7), 1, 2, True),
     ((32, 128, 7, 7), 1, 2, False),
     ((8, 64, 56, 56), 3, 3, False)])  # stride 3
def test_an_fp16_nchw_depthwise_convolution_goes_where_torchs_workload_table_says(
        x, kernel, stride, expected):
    assert _routes(x, (x[1], 1, kernel, kernel), groups=x[1], stride=(stride, stride),
                   dtype="float16") is expected


def test_the_depthwise_kernel_setting_overrides_the_workload_table():
    x, w = (8, 256, 14, 14), (256, 1, 3, 3)
    args = dict(groups=256, stride=(2, 2), dtype="float16")
    assert not _routes(x, w, **args)
    assert _routes(x, w, flags=ConvFlags(depthwise_kernel="cudnn"), **args)
    assert not _routes((8, 64, 56, 56), (64, 1, 3, 3), groups=64, dtype="float16",
                       flags=ConvFlags(depthwise_kernel="native"))


def test_a_1d_fp16_depthwise_convolution_with_stride_1_goes_to_cudnn():
    assert _routes((8, 64, 1, 100), (64, 1, 1, 5), groups=64, dtype="float16")


def test_cudnn_disabled_sends_every_convolution_elsewhere():
    off = ConvFlags(enabled=False)
    assert not _routes((8, 64, 56, 56), (128, 64, 3, 3), flags=off)
    assert not _routes((8, 64, 56, 56), (64, 1, 3, 3), groups=64, channels_last=True, flags=off)


def test_a_transposed_convolution_with_an_output_padding_as_big_as_its_stride_is_not_cudnns():
    assert _routes((8, 64, 28, 28), (64, 32, 3, 3), stride=(2, 2), transposed=True,
                   output_padding=(1, 1))
    assert not _routes((8, 64, 28, 28), (64, 32, 3, 3), stride=(2, 2), transposed=True,
                       output_padding=(2, 2))


def test_an_empty_batch_runs_no_kernel():
    assert not _routes((0, 64, 56, 56), (128, 64, 3, 3))


def test_a_convolution_too_big_for_32_bit_indexing_needs_cudnn_9_3():
    huge = (1, 64, 8192, 8192)  # 2^32 elements in one sample
    assert _routes(huge, (64, 64, 3, 3), version=90300)
    assert not _routes(huge, (64, 64, 3, 3), version=90100)
    assert _routes(huge, (64, 64, 3, 3))  # no version known: a cuDNN of the range's newer end


@pytest.fixture
def cudnn_flags_restored():
    """The script sets torch.backends.cudnn's flags in this very process: put them back."""
    import torch

    saved = (torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic)
    yield
    torch.backends.cudnn.benchmark, torch.backends.cudnn.deterministic = saved


def test_the_probe_marks_what_cudnn_runs_with_the_flags_of_the_script(probe_run, script,
                                                                     cudnn_flags_restored):
    result, _ = probe_run([script("depthwise_cnn.py")], mode="fake", steps=1)
    assert result.status == "ok", result.reason
    marks = [ConvMark.parse(e.label) for e in result.trace.events
             if e.op == "mark" and e.label.startswith("cudnn:")]
    # NCHW: only the 1x1 convolution; channels-last: the depthwise one too
    assert [(m.calls, m.groups, m.channels_last) for m in marks] == [
        (("fwd",), 1, False), (("fwd",), 32, True), (("fwd",), 1, True),
        (("bwd_data", "bwd_filter"), 1, True), (("bwd_data", "bwd_filter"), 32, True),
        (("bwd_data", "bwd_filter"), 1, False)]
    assert all(m.benchmark and m.deterministic and m.allow_tf32 for m in marks)
    assert {m.dtype for m in marks} == {"float32"}
    assert marks[1].padding == (1, 1) and marks[1].stride == (1, 1)
