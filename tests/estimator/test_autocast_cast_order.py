"""Under CUDA autocast an op's arguments are cast right to left, as the GPU casts them.

The CUDA autocast wrapper casts every argument inside one call,
``(*F)(cached_cast(to_type, args, device_type)...)`` (aten/src/ATen/autocast_mode.h); GCC, which
builds PyTorch's Linux wheels, evaluates those arguments right to left. An H200 running GPT 834M
bf16 (bench/data/H200, snapshot gpt-834m-bf16-b8-adamw-expandable) made each linear's bf16
weight before its bf16 input; traced the other way round the blocks sat a few MiB apart and the
expandable segment's mapped peak came out 0.76 GiB (2.4%) low."""

from __future__ import annotations

import os

from xmem_admission.estimator.trace import ALLOC

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
BATCH, SEQ, HIDDEN = 2, 32, 128


def test_a_bf16_linear_casts_its_weight_before_its_input(probe_run):
    result, _ = probe_run([EXAMPLE, "--layers", "1", "--hidden", str(HIDDEN), "--heads", "2",
                           "--vocab", "256", "--seq-len", str(SEQ), "--batch-size", str(BATCH),
                           "--optimizer", "sgd", "--amp", "bf16", "--steps", "1"], "fake", 1)
    assert result.status == "ok", result.reason
    forward = [e for e in result.trace.events if e.op == ALLOC and e.phase == "forward"]
    first_mm = next(i for i, e in enumerate(forward) if e.source in ("aten.mm", "aten.addmm"))
    casts = [e.size for e in forward[:first_mm] if e.source == "aten._to_copy"]
    weight, activation = HIDDEN * HIDDEN * 2, BATCH * SEQ * HIDDEN * 2
    assert casts[-2:] == [weight, activation]
