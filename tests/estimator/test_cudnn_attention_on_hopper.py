"""On an H200 with a recent torch and cuDNN, SDPA runs cuDNN's attention, and the trace
allocates what it allocates.

sdp_utils.cpp ``priority_order`` tries cudnn_attention before flash on compute capability 9.x
and 10.x once the runtime cuDNN is newer than 9.15.0 (``check_prefer_cudnn_attention``), unless
``TORCH_CUDNN_SDPA_DEPRIORITIZED`` is set. The H200 rows of bench/data/H200 (torch 2.11, cuDNN
9.19) show it: per layer, two 8-byte dropout tensors, a 256-byte workspace in the forward and one
backward workspace holding the fp32 dQ accumulator (MHA.cpp ``run_cudnn_SDP_bprop``), where the
flash kernel would have made a ``softmax_d`` and a padded ``dq_accum`` of its own."""

from __future__ import annotations

import os

import pytest
import torch

from xmem_admission.estimator.probe.attention import (
    CUDNN_ENGINE_WORKSPACE,
    choose_backend,
    cudnn_backward_workspace,
    cudnn_first,
)
from xmem_admission.estimator.trace import ALLOC

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
BATCH, SEQ, HIDDEN, HEADS, LAYERS, STEPS = 2, 64, 128, 2, 2, 2
HEAD_DIM = HIDDEN // HEADS
ARGS = ["--layers", str(LAYERS), "--hidden", str(HIDDEN), "--heads", str(HEADS), "--vocab", "256",
        "--seq-len", str(SEQ), "--batch-size", str(BATCH), "--optimizer", "adamw", "--amp",
        "bf16", "--steps", str(STEPS)]
NEWER_CUDNN = int(torch.backends.cudnn.version() or 0) > 91500 and \
    tuple(int(p) for p in torch.__version__.split("+")[0].split(".")[:2]) >= (2, 11)


def _sizes(trace, source: str, phase: str = "") -> list:
    return [e.size for e in trace.events if e.op == ALLOC and e.source == source
            and (not phase or e.phase == phase)]


def test_the_backward_workspace_is_what_an_h200_allocated_for_each_gpt_row():
    # bench/data/H200 snapshots, one block per layer and step, made after dq, dk, dv and freed
    # at once: gpt-834m (8 x 16 heads x 1024, head dim 96), gpt-134m (8 x 12, 64),
    # gpt-411m (4 x 16, 64), gpt-134m-ckpt (16 x 12, 64), llama-gqa-1.1b (4 x 32 x 2048, 64)
    assert cudnn_backward_workspace(8, 16, 1024, 96) == 50_856_192
    assert cudnn_backward_workspace(8, 12, 1024, 64) == 25_559_296
    assert cudnn_backward_workspace(4, 16, 1024, 64) == 17_039_616
    assert cudnn_backward_workspace(16, 12, 1024, 64) == 51_118_336
    assert cudnn_backward_workspace(4, 32, 2048, 64) == 68_157_696


def test_an_ampere_gpu_keeps_flash_attention_first():
    assert not cudnn_first((8, 0))
    q = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16)
    assert choose_backend(q, q, q, None, 0.0, (8, 0), False, cudnn_first((8, 0))) == "flash"


def test_head_dims_cudnn_cannot_take_fall_back_to_flash():
    q = torch.empty(2, 4, 64, 36, dtype=torch.bfloat16)  # not a multiple of 8
    assert choose_backend(q, q, q, None, 0.0, (9, 0), False, True) == "flash"
    q = torch.empty(2, 4, 64, 64, dtype=torch.float32)  # cuDNN's attention is fp16/bf16 only
    assert choose_backend(q, q, q, None, 0.0, (9, 0), False, True) == "efficient"
    q = torch.empty(2, 4, 64, 64, dtype=torch.bfloat16)
    assert choose_backend(q, q, q, None, 0.1, (9, 0), False, True) == "flash"  # not k/16


def test_the_variable_that_deprioritises_cudnn_is_honoured(monkeypatch):
    monkeypatch.setenv("TORCH_CUDNN_SDPA_DEPRIORITIZED", "1")
    assert not cudnn_first((9, 0))


@pytest.mark.skipif(not NEWER_CUDNN, reason="this torch's cuDNN is 9.15.0 or older")
def test_a_bf16_gpt_on_an_h200_traces_cudnn_attention_and_its_workspaces(probe_run):
    result, _ = probe_run([EXAMPLE] + ARGS, "fake", STEPS)
    assert result.status == "ok", result.reason
    trace = result.trace
    assert _sizes(trace, "aten._scaled_dot_product_flash_attention") == []
    made = _sizes(trace, "aten._scaled_dot_product_cudnn_attention", "forward")
    output, logsumexp = BATCH * SEQ * HIDDEN * 2, BATCH * HEADS * SEQ * 4
    assert sorted(made) == sorted([output, logsumexp, 8, 8] * (LAYERS * STEPS))
    workspaces = _sizes(trace, "aten.new_empty")
    backward = cudnn_backward_workspace(BATCH, HEADS, SEQ, HEAD_DIM)
    assert backward == BATCH * HEADS * SEQ * (HEAD_DIM + 1) * 4 + CUDNN_ENGINE_WORKSPACE
    assert workspaces.count(CUDNN_ENGINE_WORKSPACE) == LAYERS * STEPS
    assert workspaces.count(backward) == LAYERS * STEPS
