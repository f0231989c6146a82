"""softmax and log_softmax under CUDA autocast: fp16 reads half and writes float in one kernel.

Autocast asks both for fp32 (fp32_set_opt_dtype). For an fp16 input CUDA runs
``_softmax(input, dim, half_to_float=true)`` (SoftMax.cpp): no fp32 copy of the input, and the
backward returns fp16. A bf16 input is first copied to fp32 (``input_.toType(dtype)``).
"""

from __future__ import annotations

import textwrap
from collections import Counter

import pytest

from tests.estimator.trace_counts import allocations_of_step

BATCH, TOKENS = 8, 48
SCORES_HALF, SCORES_FLOAT = BATCH * TOKENS * TOKENS * 2, BATCH * TOKENS * TOKENS * 4

ATTENTION = textwrap.dedent(f"""
    import sys
    import torch
    import torch.nn.functional as F

    dtype = {{"fp16": torch.float16, "bf16": torch.bfloat16}}[sys.argv[1]]
    call = sys.argv[2]
    proj = torch.nn.Linear(64, 64).cuda()
    optimizer = torch.optim.SGD(proj.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn({BATCH}, {TOKENS}, 64, device="cuda")
        with torch.autocast("cuda", dtype=dtype):
            h = proj(x)
            scores = h @ h.transpose(1, 2)
            if call == "F.softmax":
                p = F.softmax(scores, dim=-1)
            elif call == "Tensor.softmax":
                p = scores.softmax(-1)
            else:
                p = torch.log_softmax(scores, -1)
            loss = (p @ h).float().sum()
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
""")


def scores_blocks(trace):
    """(half, float) counts of score-sized blocks in the second step, by phase."""
    counts: Counter = Counter()
    for e in allocations_of_step(trace, 1):
        if e.size in (SCORES_HALF, SCORES_FLOAT):
            phase = "backward" if e.phase == "backward" else "forward"
            counts[phase, "half" if e.size == SCORES_HALF else "float"] += 1
    return counts


@pytest.fixture
def attention(tmp_path):
    path = tmp_path / "attention.py"
    path.write_text(ATTENTION)
    return str(path)


@pytest.mark.parametrize("call", ["F.softmax", "Tensor.softmax", "torch.log_softmax"])
def test_fp16_softmax_makes_no_float_copy_of_its_input_and_returns_a_half_gradient(
        probe_run, attention, call):
    result, _ = probe_run([attention, "fp16", call])
    assert result.status == "ok", result.reason
    counts = scores_blocks(result.trace)
    # forward: the fp16 scores, the fp32 probabilities, their fp16 cast for the next matmul;
    # backward: the fp16 gradient of the probabilities (matmul), its fp32 cast (the cast's
    # backward), the fp16 gradient of the scores straight from the softmax's backward
    assert counts == {("forward", "half"): 2, ("forward", "float"): 1,
                      ("backward", "half"): 2, ("backward", "float"): 1}


def test_bf16_softmax_copies_its_input_to_float_first(probe_run, attention):
    result, _ = probe_run([attention, "bf16", "F.softmax"])
    assert result.status == "ok", result.reason
    counts = scores_blocks(result.trace)
    # the fp32 copy of the scores in forward; in backward the softmax's gradient is fp32 and
    # the copy's backward casts it to bf16
    assert counts == {("forward", "half"): 2, ("forward", "float"): 2,
                      ("backward", "half"): 2, ("backward", "float"): 2}


def test_profile_mode_keeps_the_cpus_softmax(probe_run, attention):
    # real CPU tensors cannot take the half-to-float kernel: the probe runs, with the cast
    result, _ = probe_run([attention, "fp16", "F.softmax"], "profile")
    assert result.status == "ok", result.reason
    assert scores_blocks(result.trace)["forward", "float"] == 2
