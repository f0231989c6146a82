"""``nn.MultiheadAttention`` in fp32 training allocates what CUDA's memory-efficient kernel
allocates.

On a GPU, ``F.multi_head_attention_forward`` (need_weights=False) calls SDPA, which takes the
memory-efficient kernel for fp32 (sdp_utils.cpp: flash needs fp16/bf16). Its backward copies the
output's gradient into (batch, query, head, dim) order, computes ``delta`` with a full-size fp32
product and asks for the cutlass kernel's dQ staging workspace (attention_backward.cu,
``_efficient_attention_backward``; kernel_backward.h, ``workspace_size``). An H200 running
torchvision's ViT-B/16 (bench/data/H200, snapshot cnn-vit_b_16-b32-adamw) allocated, per encoder
layer and step, a logsumexp of 344,064 bytes, two deltas of 302,592 and a workspace of
25,190,400; the probe traced the CPU's flash kernel there instead."""

from __future__ import annotations

import math

import pytest
import torch

from xmem_admission.estimator.probe.attention import (
    efficient_backward_kernel,
    efficient_backward_workspace,
)
from xmem_admission.estimator.trace import ALLOC

BATCH, TOKENS, WIDTH, HEADS = 4, 50, 128, 2
HEAD_DIM = WIDTH // HEADS
LAYERS, STEPS = 2, 3


@pytest.fixture(scope="module")
def traced(request):
    from tests.estimator.conftest import H200, SCRIPTS
    from xmem_admission.estimator.probe import runner

    result = runner.run([f"{SCRIPTS}/mha_encoder.py", "--steps", str(STEPS)], "fake", STEPS, H200)
    assert result.status == "ok", result.reason
    return result.trace


def _sizes(trace, source: str, phase: str = "") -> list:
    return [e.size for e in trace.events if e.op == ALLOC and e.source == source
            and (not phase or e.phase == phase)]


def test_attention_of_multihead_attention_runs_the_memory_efficient_kernel(traced):
    assert _sizes(traced, "aten._scaled_dot_product_flash_attention_for_cpu") == []
    assert _sizes(traced, "aten._scaled_dot_product_attention_math") == []
    made = _sizes(traced, "aten._scaled_dot_product_efficient_attention", "forward")
    output = BATCH * TOKENS * WIDTH * 4
    logsumexp = BATCH * HEADS * math.ceil(TOKENS / 32) * 32 * 4  # padded to 32 queries
    assert sorted(set(made) - {8}) == sorted({output, logsumexp})
    assert made.count(logsumexp) == LAYERS * STEPS


def test_its_backward_makes_the_workspace_and_delta_the_cuda_kernel_makes(traced):
    per_head_rows = math.ceil(TOKENS / 64) * (4 + 64 * 64)  # one dQ tile of 64 x 64 floats
    workspace = BATCH * HEADS * per_head_rows * 4
    assert _sizes(traced, "aten.new_empty", "backward") == [workspace] * (LAYERS * STEPS)
    delta = BATCH * TOKENS * HEADS * 4
    assert _sizes(traced, "aten.sum", "backward").count(delta) == LAYERS * STEPS
    assert _sizes(traced, "aten.mul", "backward").count(BATCH * TOKENS * WIDTH * 4) >= \
        LAYERS * STEPS


def test_the_workspace_is_what_an_h200_allocated_for_vit_and_gpt():
    # bench/data/H200 snapshots: cnn-vit_b_16-b32-adamw (batch 32, 12 heads, 197 tokens, head
    # dim 64) allocated 36 blocks of 25,190,400 bytes; gpt-1.4b-fp32-b4-adamw (batch 4, 16 heads,
    # 1024 tokens, head dim 128) 72 of 33,570,816, its 128 x 64 kernel's tiles.
    vit = efficient_backward_kernel(torch.float32, (9, 0), 64)
    assert efficient_backward_workspace(vit, 32, 12, 197, 197, 64, 64) == 25_190_400
    gpt = efficient_backward_kernel(torch.float32, (9, 0), 128)
    assert efficient_backward_workspace(gpt, 4, 16, 1024, 1024, 128, 128) == 33_570_816


def test_a_kernel_before_volta_stages_no_fp32_gradient():
    # kernel_backward.h: kEnableSplitKeys = kMinSm >= 70, and fp32 accumulates in its output
    kernel = efficient_backward_kernel(torch.float32, (6, 1), 64)
    assert efficient_backward_workspace(kernel, 8, 12, 1024, 1024, 64, 64) == 0


def test_a_mask_whose_rows_are_not_eight_wide_is_padded_as_sdpa_pads_it(probe_run, script):
    # attention.cpp preprocess_mask: a (2, 2, 33, 33) fp32 mask has strides that are not
    # multiples of 8 elements, so the memory-efficient kernel gets a copy padded to 40 columns
    result, _ = probe_run([script("masked_attention.py"), "--steps", "2"], "fake", 2)
    assert result.status == "ok", result.reason
    padded = [e.size for e in result.trace.events
              if e.op == ALLOC and e.source == "aten.constant_pad_nd"]
    assert padded == [2 * 2 * 33 * 40 * 4] * 2
