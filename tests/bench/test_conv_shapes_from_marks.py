"""The convolution shapes of the benchmarks carry what the probe's marks say: stride,
padding, dilation, dtype, layout and cuDNN flags, used as they are instead of inferred."""

from __future__ import annotations

from bench.convolution import conv_heuristics_table as table
from bench.convolution import conv_workspaces as cw

# 5 -> 3 with a 3x3 kernel is stride 1 padding 0 or stride 2 padding 1: the mark says which
MARK = ("cudnn:fwd x=4,8,5,5 w=16,8,3,3 y=4,16,3,3 g=1 b=4 s=2,2 p=1,1 d=1,1 cl=0 dt=float32"
        " bm=0 det=0 tf32=1")


def test_a_new_marks_shape_keeps_its_geometry_dtype_and_flags():
    shape = cw.parse_mark(MARK)
    assert shape is not None
    assert (shape["s"], shape["p"], shape["d"]) == ([2, 2], [1, 1], [1, 1])
    assert (shape["dt"], shape["cl"], shape["bm"], shape["det"], shape["tf32"]) == (
        "float32", 0, 0, 0, 1)
    assert cw.geometry(shape) == ([2, 2], [1, 1])
    conv, ambiguous = table.convolution(shape)
    assert (conv.stride, conv.padding, ambiguous) == ((2, 2), (1, 1), False)


def test_an_older_marks_shape_still_has_its_geometry_inferred():
    old = cw.parse_mark("cudnn:fwd x=4,8,5,5 w=16,8,3,3 y=4,16,3,3 g=1 b=4")
    assert old is not None and "s" not in old
    assert cw.geometry(old) == ([1, 1], [0, 0])
    conv, ambiguous = table.convolution(old)
    assert conv.stride == (1, 1) and ambiguous


def test_the_shapes_file_was_made_from_marks_with_their_geometry():
    shapes = cw.load_shapes(cw.SHAPES)
    assert len(shapes) == 120
    for shape in shapes:
        assert {"s", "p", "d", "dt", "cl", "tf32"} <= set(shape), shape
        conv, ambiguous = table.convolution(shape)
        assert list(conv.shapes()[2]) == shape["y"] and not ambiguous
