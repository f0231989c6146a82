"""cuDNN's heuristics planned on the CPU: the workspaces of a convolution per GPU, no GPU needed.

Runs against the libcudnn that the development venv's torch brings (cuDNN 9.24 from
nvidia-cudnn-cu13); the exact sizes are those of that release (the table below).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xmem_admission.contract.cudnn import ConvCall
from xmem_admission.contract.gpu_devices import device_description
from xmem_admission.contract.gpus import all_gpus, lookup
from xmem_admission.estimator import cudnn_heuristics as ch

MiB = 1 << 20


@pytest.fixture(scope="module")
def lib(deviceless_cudnn) -> ch.CudnnLibrary:
    return deviceless_cudnn


@pytest.fixture(scope="module")
def pinned(lib: ch.CudnnLibrary) -> ch.CudnnLibrary:
    """The cuDNN of the development pin, whose answers the table below records."""
    if lib.version_text != "9.24.0":
        pytest.skip(f"sizes recorded with cuDNN 9.24.0, this is {lib.version_text}")
    return lib


RESNET_BLOCK = dict(batch=64, in_channels=64, height=56, width=56, out_channels=64, kernel=(3, 3),
                    padding=(1, 1))
DEEP_BLOCK = dict(batch=32, in_channels=256, height=14, width=14, out_channels=256, kernel=(3, 3),
                  padding=(1, 1))
STEM = dict(batch=64, in_channels=3, height=224, width=224, out_channels=64, kernel=(7, 7),
            stride=(2, 2), padding=(3, 3))


def _first_mib(lib, gpu, conv, call) -> float:
    return round(ch.conv_workspaces(lookup(gpu), conv, call, lib)[0] / MiB, 1)


# The A100's table, first plan of each call. Two of its fp32 forward figures came
# out 98.1 and 36.8 MiB (and 14.5 for the 256-channel block) because the frontend, asked for an
# NCHW convolution without output strides, infers a channels-last output: a layout PyTorch never
# asks for. With an NCHW output (as torch allocates it, and as the oracle test below sets it)
# cuDNN says 49.1, 8.4 and 232.8 MiB. Every other figure is the issue's.
@pytest.mark.parametrize(
    "shape, dtype, channels_last, call, mib",
    [
        (RESNET_BLOCK, "float32", False, ConvCall.FORWARD, 49.1),
        (RESNET_BLOCK, "float32", False, ConvCall.BACKWARD_DATA, 98.1),
        (RESNET_BLOCK, "float32", False, ConvCall.BACKWARD_FILTER, 107.5),
        (RESNET_BLOCK, "float16", True, ConvCall.FORWARD, 0.0),
        (RESNET_BLOCK, "float16", True, ConvCall.BACKWARD_DATA, 0.0),
        (RESNET_BLOCK, "float16", True, ConvCall.BACKWARD_FILTER, 2.3),
        (DEEP_BLOCK, "float32", False, ConvCall.FORWARD, 8.4),
        (DEEP_BLOCK, "float32", False, ConvCall.BACKWARD_DATA, 14.5),
        (DEEP_BLOCK, "float32", False, ConvCall.BACKWARD_FILTER, 28.0),
        (DEEP_BLOCK, "float16", True, ConvCall.BACKWARD_FILTER, 4.5),
        (STEM, "float32", False, ConvCall.FORWARD, 232.8),
        (STEM, "float16", True, ConvCall.FORWARD, 24.5),
    ],
)
def test_the_a100_workspaces_of_the_issue_table(pinned, shape, dtype, channels_last, call, mib):
    conv = ch.Convolution(**shape, dtype=dtype, channels_last=channels_last)
    assert _first_mib(pinned, "A100-40GB", conv, call) == mib


def test_each_architecture_gets_its_own_answer(pinned):
    conv = ch.Convolution(**DEEP_BLOCK)
    firsts = {gpu: _first_mib(pinned, gpu, conv, ConvCall.BACKWARD_FILTER)
              for gpu in ("A100-40GB", "A10", "L40S", "H100-80GB")}
    assert firsts == {"A100-40GB": 28.0, "A10": 14.5, "L40S": 16.8, "H100-80GB": 14.5}


def test_every_catalogue_gpu_gets_plans_for_a_plain_convolution(lib):
    conv = ch.Convolution(**DEEP_BLOCK)
    for gpu in all_gpus():
        plans = ch.conv_plans(gpu, conv, ConvCall.FORWARD, lib)
        assert plans, gpu.key
        assert all(p.workspace_bytes >= 0 for p in plans)


def test_plans_come_without_duplicates_and_end_with_the_fallback_list(lib):
    plans = ch.conv_plans(lookup("A100-40GB"), ch.Convolution(**RESNET_BLOCK),
                          ConvCall.FORWARD, lib)
    tags = [p.tag for p in plans]
    assert len(tags) == len(set(tags))
    modes = [p.mode for p in plans]
    assert modes[0] is ch.HeuristicMode.A and modes[-1] is ch.HeuristicMode.FALLBACK
    assert modes == sorted(modes, key=lambda m: m is ch.HeuristicMode.FALLBACK)


def test_the_fallback_list_always_has_an_engine_without_workspace(lib):
    plans = ch.conv_plans(lookup("H100-80GB"), ch.Convolution(**STEM), ConvCall.FORWARD, lib)
    assert min(p.workspace_bytes for p in plans if p.mode is ch.HeuristicMode.FALLBACK) == 0


def test_a_grouped_convolution_is_planned_with_its_per_group_weight(lib):
    conv = ch.Convolution(**{**DEEP_BLOCK, "groups": 32})
    assert conv.shapes()[1] == [256, 8, 3, 3]
    assert ch.conv_plans(lookup("A100-40GB"), conv, ConvCall.BACKWARD_DATA, lib)


def test_a_cudnn_older_than_9_11_is_refused_by_name(lib):
    old = ch.CudnnLibrary(lib.path)
    old.version = 91002  # torch 2.9's cuDNN 9.10.2
    with pytest.raises(ch.CudnnPlanningUnavailable, match=r"cuDNN 9\.10\.2 .*9\.11 or newer"):
        old.plans("{}", ch.Convolution(**DEEP_BLOCK), ConvCall.FORWARD)


def test_a_description_missing_a_key_is_refused_with_cudnn_words(lib):
    text = json.loads(ch.description_json(device_description(lookup("A100-40GB"))))
    del text["l2CacheSize"]
    with pytest.raises(ch.CudnnPlanningUnavailable, match="rejects the device description"):
        lib.plans(json.dumps(text), ch.Convolution(**DEEP_BLOCK), ConvCall.FORWARD)


def test_no_libcudnn_is_a_clear_error(monkeypatch):
    monkeypatch.setattr(ch, "find_libcudnn", lambda: None)
    ch.load_cudnn.cache_clear()
    try:
        with pytest.raises(ch.CudnnPlanningUnavailable, match="no libcudnn found"):
            ch.load_cudnn()
    finally:
        ch.load_cudnn.cache_clear()


def test_the_description_json_has_every_key_cudnn_reads():
    keys = set(json.loads(ch.description_json(device_description(lookup("H200")))))
    assert {"deviceVer", "multiProcessorCount", "smCountOrigin", "maxSharedMemoryPerBlockOptin",
            "reservedSharedMemoryPerBlock", "maxCtasPerSM", "l2CacheSize", "totalGlobalMem",
            "driverVer", "deviceName", "maxGridSize", "maxBlockSize"} <= keys


@pytest.mark.parametrize(
    "geometry, output",
    [(dict(kernel=(3, 3), padding=(1, 1)), (14, 14)), (dict(kernel=(3, 3)), (12, 12)),
     (dict(kernel=(3, 3), stride=(2, 2), padding=(1, 1)), (7, 7)),
     (dict(kernel=(3, 3), dilation=(2, 2), padding=(2, 2)), (14, 14))],
)
def test_the_output_size_is_torchs(geometry, output):
    conv = ch.Convolution(batch=1, in_channels=8, height=14, width=14, out_channels=8, **geometry)
    assert conv.output_size() == output


@pytest.mark.parametrize("bad", [dict(dtype="int8"), dict(groups=3), dict(kernel=(17, 17))])
def test_an_impossible_convolution_is_refused(bad):
    with pytest.raises(ValueError):
        ch.Convolution(**{**DEEP_BLOCK, **bad})


# --- NVIDIA's frontend as the oracle ------------------------------------------------------------

def _frontend_tags(cudnn, shape, call):
    """The frontend's plan names for an NCHW fp32 call on the catalogue's A100 description."""
    conv = ch.Convolution(**shape)
    device = cudnn.create_device_properties(
        ch.description_json(device_description(lookup("A100-40GB"))))
    graph = cudnn.pygraph(io_data_type=cudnn.data_type.FLOAT,
                          compute_data_type=cudnn.data_type.FLOAT, device_property=device,
                          sm_version=80, sm_count=108)
    x_dims, w_dims, y_dims = conv.shapes()
    x = graph.tensor(name="x", dim=x_dims, stride=conv.strides(x_dims),
                     data_type=cudnn.data_type.FLOAT)
    w = graph.tensor(name="w", dim=w_dims, stride=conv.strides(w_dims),
                     data_type=cudnn.data_type.FLOAT)
    y = graph.tensor(name="y", dim=y_dims, stride=conv.strides(y_dims),
                     data_type=cudnn.data_type.FLOAT)
    geometry = dict(padding=list(conv.padding), stride=list(conv.stride),
                    dilation=list(conv.dilation))
    if call is ConvCall.FORWARD:
        out, dims = graph.conv_fprop(x, w, **geometry), y_dims
    elif call is ConvCall.BACKWARD_DATA:
        out, dims = graph.conv_dgrad(y, w, **geometry), x_dims
    else:
        out, dims = graph.conv_wgrad(y, x, **geometry), w_dims
    out.set_output(True).set_dim(dims).set_stride(conv.strides(dims)).set_data_type(
        cudnn.data_type.FLOAT)
    graph.validate()
    graph.build_operation_graph()
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans(cudnn.build_plan_policy.ALL)
    return [(graph.get_plan_name_at_index(i), graph.get_workspace_size_plan_at_index(i))
            for i in range(graph.get_execution_plan_count())]


@pytest.mark.parametrize(
    "shape, call",
    [(RESNET_BLOCK, call) for call in ConvCall] + [(STEM, ConvCall.FORWARD)],
    ids=[f"resnet-block-{call.value}" for call in ConvCall] + ["stem-fwd"],
)
def test_the_frontend_plans_the_same_engines_in_the_same_order(lib, shape, call):
    cudnn = pytest.importorskip("cudnn")
    if cudnn.backend_version() != lib.version:
        pytest.skip("the frontend loaded another cuDNN")
    theirs = _frontend_tags(cudnn, shape, call)
    ours = [(p.tag, p.workspace_bytes) for p in
            ch.conv_plans(lookup("A100-40GB"), ch.Convolution(**shape), call, lib)]
    assert theirs[0] == ours[0]
    # Ours may hold a few more mode-A configurations (the frontend drops two eng48 ones for the
    # ResNet block's forward call); every one of the frontend's is ours, in the same order.
    positions = [ours.index(plan) for plan in theirs]
    assert positions == sorted(positions)
    assert len(ours) - len(theirs) <= 2


@pytest.mark.parametrize("number,text", [(92400, "9.24.0"), (90100, "9.1.0"), (91100, "9.11.0"),
                                         (8902, "8.9.2"), (8600, "8.6.0"), (7605, "7.6.5")])
def test_cudnn_version_numbers_read_as_their_release_in_both_numbering_schemes(number, text):
    assert ch.version_text(number) == text


def test_a_second_cudnn_release_is_refused_while_one_is_loaded(lib, tmp_path):
    # Its engine libraries are opened by soname and would bind to the loaded release's: the
    # copy stands for another release's libcudnn (another path), and is refused before loading.
    other = tmp_path / "libcudnn.so.9"
    other.write_bytes(Path(lib.path).read_bytes())
    with pytest.raises(ch.CudnnPlanningUnavailable, match="side by side"):
        ch.CudnnLibrary(str(other))
    assert ch.CudnnLibrary(lib.path).version == lib.version  # the loaded one itself is fine
