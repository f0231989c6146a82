"""PyTorch's order and filters over cuDNN's heuristics (Conv_v8.cpp, cudnn.benchmark off).

The filter logic is held on made-up plans (each numerical note, each errata rule); the order and
the effect of torch's flags on real answers of the development venv's cuDNN (9.24).
"""

from __future__ import annotations

import json

import pytest

from xmem_admission.contract.cudnn import ConvCall
from xmem_admission.contract.gpus import lookup
from xmem_admission.estimator import cudnn_heuristics as ch
from xmem_admission.estimator.conv_marks import ConvMark

N = ch.NumericalNote
RESNET_BLOCK = ch.Convolution(batch=64, in_channels=64, height=56, width=56, out_channels=64,
                              kernel=(3, 3), padding=(1, 1))


def _plan(engine, workspace, *notes, mode=ch.HeuristicMode.INSTANT, knobs=()):
    return ch.Plan(engine, tuple(knobs), workspace, mode, tuple(notes))


MADE_UP = [
    _plan(30, 300, N.TENSOR_CORE),
    _plan(25, 250, N.NONDETERMINISTIC),
    _plan(7, 700, N.DOWN_CONVERT_INPUTS),
    _plan(5, 500),
    _plan(1, 100),
    _plan(0, 0, N.STRICT_NAN_PROP, mode=ch.HeuristicMode.FALLBACK),
]


@pytest.fixture
def made_up(monkeypatch):
    asked = []

    def fake_plans(gpu, conv, call, library=None, modes=ch.DEFAULT_MODES, stop=None):
        asked.append(tuple(modes))
        found = []
        for plan in MADE_UP:  # as CudnnLibrary.plans: nothing after the plan ``stop`` takes
            found.append(plan)
            if stop is not None and stop(plan):
                break
        return found

    monkeypatch.setattr(ch, "conv_plans", fake_plans)
    return asked


def _kept(call=ConvCall.FORWARD, conv=RESNET_BLOCK, gpu="A100-40GB", **flags):
    flags.setdefault("compiled_cudnn", 92400)
    return ch.torch_workspaces(lookup(gpu), conv, call, library=object(), **flags)


def test_torch_asks_the_instant_heuristics_then_the_fallback_list(made_up):
    _kept()
    assert made_up == [(ch.HeuristicMode.INSTANT, ch.HeuristicMode.FALLBACK)]


def test_heuristic_mode_b_replaces_instant_when_asked(made_up):
    _kept(heuristic_mode_b=True)
    assert made_up == [(ch.HeuristicMode.B, ch.HeuristicMode.FALLBACK)]


def test_by_default_only_down_converting_engines_are_dropped(made_up):
    assert _kept() == [300, 250, 500, 100, 0]


def test_planning_can_stop_at_the_first_plan_torch_runs_without_a_workspace(made_up):
    assert _kept(until_no_workspace=True) == [300, 250, 500, 100, 0]
    stopped = list(MADE_UP)
    stopped.insert(1, _plan(9, 0, N.DOWN_CONVERT_INPUTS))  # dropped by torch: not where it stops
    stopped.insert(3, _plan(8, 0))
    MADE_UP[:] = stopped
    try:
        assert _kept(until_no_workspace=True) == [300, 250, 0]
        assert _kept() == [300, 250, 0, 500, 100, 0]
    finally:
        del MADE_UP[3]
        del MADE_UP[1]


def test_tf32_off_drops_tensor_core_engines_for_float32_only(made_up):
    assert _kept(allow_tf32=False) == [250, 500, 100, 0]
    half = ch.Convolution(**{**RESNET_BLOCK.__dict__, "dtype": "float16"})
    assert _kept(conv=half, allow_tf32=False) == [300, 250, 500, 100, 0]


def test_deterministic_drops_nondeterministic_engines(made_up):
    assert _kept(deterministic=True) == [300, 500, 100, 0]


def test_each_drop_names_its_reason(made_up):
    verdicts = ch.torch_verdicts(lookup("A100-40GB"), RESNET_BLOCK, ConvCall.FORWARD,
                                 allow_tf32=False, deterministic=True, compiled_cudnn=92301,
                                 library=object())
    assert [v.dropped for v in verdicts] == [
        "TF32 tensor cores (torch.backends.cudnn.allow_tf32 off)",
        "nondeterministic (torch.backends.cudnn.deterministic)",
        "down-converts its inputs", "errata rule 188288", None, None]


def test_errata_188288_blocks_forward_engine_5_only_for_cudnn_9_23_1_up_to_9_24(made_up):
    assert 500 not in _kept(compiled_cudnn=92301)
    assert 500 in _kept(compiled_cudnn=92400)
    assert 500 in _kept(compiled_cudnn=92300)
    assert 500 in _kept(call=ConvCall.BACKWARD_DATA, compiled_cudnn=92301)


def test_sm120_errata_apply_only_to_compute_capability_12_0():
    rule = next(r for r in ch.TORCH_ERRATA if r.rule_id == "sm120_conv_bwd_data_engine_63")
    plan = _plan(63, 1)
    assert rule.blocks(ConvCall.BACKWARD_DATA, plan, 92400, (12, 0))
    assert not rule.blocks(ConvCall.BACKWARD_DATA, plan, 92400, (9, 0))
    assert not rule.blocks(ConvCall.BACKWARD_FILTER, _plan(58, 1), 92400, (12, 0))
    assert not rule.blocks(ConvCall.BACKWARD_DATA, plan, 92200, (12, 0))


def test_an_errata_file_adds_rules_with_knobs_and_open_ends(made_up, tmp_path):
    path = tmp_path / "errata.json"
    path.write_text(json.dumps({"version": 1, "rules": [
        {"rule_id": "mine", "operation": "ConvFwd", "engine": 1, "cudnn_version_start": 90000,
         "cudnn_version_end": -1},
        {"rule_id": "knobbed", "operation": "ConvFwd", "engine": 30, "knob": ["k2=9"]}]}))
    rules = ch.errata_from_env({"CUDNN_ERRATA_JSON_FILE": str(path)})
    assert [r.rule_id for r in rules] == ["mine", "knobbed"]
    assert rules[0].cudnn_end is None
    assert _kept(extra_errata=rules) == [300, 250, 500, 0]


def test_an_unreadable_errata_file_adds_nothing_and_a_malformed_one_is_refused(tmp_path):
    assert ch.errata_from_env({"CUDNN_ERRATA_JSON_FILE": str(tmp_path / "missing")}) == ()
    assert ch.errata_from_env({}) == ()
    bad = tmp_path / "bad.json"
    bad.write_text('{"rules": [{"engine": 1}]}')
    with pytest.raises(ValueError, match="malformed cuDNN errata"):
        ch.errata_from_env({"CUDNN_ERRATA_JSON_FILE": str(bad)})


@pytest.mark.parametrize("available, chosen", [(1000, 300), (299, 250), (99, 0), (-1, None)])
def test_the_first_workspace_that_fits_is_the_one_torch_runs(available, chosen):
    assert ch.first_fitting([300, 250, 500, 100, 0], available) == chosen


# --- the real cuDNN -----------------------------------------------------------------------------

@pytest.fixture
def lib(deviceless_cudnn) -> ch.CudnnLibrary:
    return deviceless_cudnn


@pytest.mark.parametrize("call", list(ConvCall))
def test_instant_gives_the_same_plans_as_mode_a(lib, call):
    gpu = lookup("H100-80GB")
    instant = ch.conv_plans(gpu, RESNET_BLOCK, call, lib,
                            (ch.HeuristicMode.INSTANT, ch.HeuristicMode.FALLBACK))
    assert [p.tag for p in instant] == [p.tag for p in ch.conv_plans(gpu, RESNET_BLOCK, call, lib)]


def test_torch_order_with_default_flags_starts_with_the_heuristics_first_plan(lib):
    gpu = lookup("A100-40GB")
    for call in ConvCall:
        assert (ch.torch_plans(gpu, RESNET_BLOCK, call, library=lib)[0].tag
                == ch.conv_plans(gpu, RESNET_BLOCK, call, lib)[0].tag)


def test_fp32_without_tf32_leaves_no_tensor_core_plan_and_ends_with_an_engine_without_workspace(
        lib):
    gpu = lookup("A100-40GB")
    for call in ConvCall:
        plans = ch.torch_plans(gpu, RESNET_BLOCK, call, allow_tf32=False, library=lib)
        assert plans and all(N.TENSOR_CORE not in p.notes for p in plans)
        assert plans[-1].workspace_bytes == 0
    # with TF32 the heuristics' first forward plan is a tensor-core one needing 49.1 MiB
    first = ch.torch_workspaces(gpu, RESNET_BLOCK, ConvCall.FORWARD, library=lib)[0]
    assert first > 40 << 20


def test_deterministic_removes_every_nondeterministic_plan_of_the_weight_gradient(lib):
    gpu = lookup("A100-40GB")
    every = ch.torch_verdicts(gpu, RESNET_BLOCK, ConvCall.BACKWARD_FILTER, library=lib)
    assert any(N.NONDETERMINISTIC in v.plan.notes for v in every)
    kept = ch.torch_plans(gpu, RESNET_BLOCK, ConvCall.BACKWARD_FILTER, deterministic=True,
                          library=lib)
    assert kept and all(N.NONDETERMINISTIC not in p.notes for p in kept)
    assert len(kept) < len(every)


# --- cudnn.benchmark ----------------------------------------------------------------------------

def test_the_benchmark_search_asks_instant_even_with_mode_b_set(made_up):
    _kept(heuristic_mode_b=True, benchmark=True)
    assert made_up == [(ch.HeuristicMode.INSTANT, ch.HeuristicMode.FALLBACK)]


def test_the_benchmark_search_holds_the_largest_workspace_that_the_device_could_hold():
    sizes = [300, 250, 500, 100, 0]
    assert ch.benchmark_search_block(sizes, available=1000) == 500
    assert ch.benchmark_search_block(sizes, available=400) == 300  # 500 dropped up front
    assert ch.benchmark_search_block([0, 0], available=1000) == 0


def test_the_benchmark_search_halves_its_block_until_the_allocator_gives_it():
    # free memory says 500 fits, but no 500-byte block can be had: 250 then, and only plans
    # up to 250 are timed
    assert ch.benchmark_search_block([300, 500], available=500,
                                      fits=lambda size: size <= 260) == 250
    assert ch.benchmark_search_block([500], available=500, fits=lambda size: False) == 0


# --- from a probe mark --------------------------------------------------------------------------

def test_a_marks_calls_are_the_convolution_it_names():
    mark = ConvMark.parse("cudnn:bwd_data+bwd_filter x=64,64,56,56 w=64,64,3,3"
                             " y=64,64,56,56 g=1 b=4 s=1,1 p=1,1 d=1,1 cl=0 dt=float32 bm=0"
                             " det=0 tf32=1")
    calls = ch.mark_calls(mark)
    assert [call for _, call in calls] == [ConvCall.BACKWARD_DATA, ConvCall.BACKWARD_FILTER]
    assert calls[0][0] == RESNET_BLOCK


def test_a_transposed_convolution_runs_as_the_gradient_of_the_convolution_it_inverts():
    # ConvTranspose2d(32, 16, 4, stride=2, padding=1): 8x8 -> 16x16; weight (C_in, C_out, R, S)
    mark = ConvMark.parse("cudnn:fwd x=2,32,8,8 w=32,16,4,4 y=2,16,16,16 g=1 b=2 s=2,2"
                             " p=1,1 d=1,1 cl=1 dt=float16 bm=0 det=0 tf32=1 tr=1")
    [(conv, call)] = ch.mark_calls(mark)
    assert call is ConvCall.BACKWARD_DATA
    assert conv.shapes() == ([2, 16, 16, 16], [32, 16, 4, 4], [2, 32, 8, 8])
    assert conv.channels_last and conv.dtype == "float16"
    backward = ConvMark.parse(mark.label().replace("cudnn:fwd", "cudnn:bwd_data+bwd_filter"))
    assert [c for _, c in ch.mark_calls(backward)] == [ConvCall.FORWARD,
                                                        ConvCall.BACKWARD_FILTER]


@pytest.mark.parametrize("label", [
    "cudnn:fwd x=4,3,32,32 w=8,3,3,3 y=4,8,32,32 g=1 b=4",  # an older trace's mark
    "cudnn:fwd x=4,3,32,32 w=8,3,3,3 y=4,8,30,30 g=1 b=4 s=1,1 p=1,1 d=1,1 cl=0 dt=float32"
    " bm=0 det=0 tf32=1",  # geometry and output disagree
    "cudnn:fwd x=2,4,8,8,8 w=4,4,3,3,3 y=2,4,8,8,8 g=1 b=4 s=1,1,1 p=1,1,1 d=1,1,1 cl=0"
    " dt=float32 bm=0 det=0 tf32=1",  # 3-D
])
def test_a_mark_cudnn_cannot_be_asked_about_is_refused(label):
    with pytest.raises(ValueError):
        ch.mark_calls(ConvMark.parse(label))
