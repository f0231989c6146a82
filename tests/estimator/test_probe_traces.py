"""What the probe records when it runs a real training script under the virtual GPU."""

from __future__ import annotations

from collections import Counter

import pytest

from xmem_admission.estimator.trace import ALLOC, FREE, MARK


def allocs(trace):
    return [e for e in trace.events if e.op == ALLOC]


def allocs_in(trace, step, phase):
    """The allocations of one phase within step ``step`` (0-based) of a trace."""
    current = 0
    for e in trace.events:
        if e.op == MARK and e.label.startswith("step"):
            current += 1
        elif current == step and e.op == ALLOC and e.phase == phase:
            yield e


def bytes_by_category(trace):
    total = Counter()
    for e in allocs(trace):
        total[e.category] += e.size
    return total


def without_ids_and_frees(trace):
    """The stream without allocation ids and frees: what both modes must agree on."""
    return [(e.op, e.size, e.stream, e.category) if e.op == ALLOC else (e.op,)
            for e in trace.events if e.op != FREE]


def test_fake_and_profile_modes_record_the_same_allocation_stream(probe_run, script):
    fake, _ = probe_run([script("tiny_mlp.py"), "--batch", "16", "--hidden", "64"], "fake")
    real, _ = probe_run([script("tiny_mlp.py"), "--batch", "16", "--hidden", "64"], "profile")
    assert fake.status == real.status == "ok"
    assert without_ids_and_frees(fake.trace) == without_ids_and_frees(real.trace)
    assert [e for e in fake.trace.events if e.op == MARK] == \
        [e for e in real.trace.events if e.op == MARK]


def test_gradient_sums_allocate_what_autograd_allocates_with_no_dispatch_mode(
        probe_run, script, tmp_path):
    # Autograd sums two gradients of one input (residual junctions, a weight used twice) in
    # place on plain tensors, never under a dispatch mode such as the probe's. The oracle is the
    # script itself on the CPU with no mode: torch.profiler's record of its last backward.
    import json
    import subprocess
    import sys

    record = tmp_path / "sizes.json"
    subprocess.run([sys.executable, script("residual.py"), "--record", str(record)], check=True,
                   capture_output=True)
    oracle = Counter(json.loads(record.read_text()))
    for mode in ("fake", "profile"):
        result, _ = probe_run([script("residual.py")], mode)
        assert result.status == "ok", result.reason
        traced = Counter(e.size for e in allocs_in(result.trace, 2, "backward"))
        # residual gradients (3,072 B), the weight used twice without a view (4,096 B: summed in
        # place), the tied weight whose first gradient is a view (6,144 B: summed out of place)
        for size in (3072, 4096, 6144):
            assert traced[size] == oracle[size], (mode, size)
    # the view case: two contributions and their sum; the no-view case: two, summed in place
    assert (oracle[4096], oracle[6144]) == (2, 3)


def test_autograd_sums_gradients_in_place_when_no_dispatch_mode_is_active():
    # The premise of the test above, on plain tensors: a residual junction's two gradients are
    # summed into the first one's memory (torch/csrc/autograd/input_buffer.cpp).
    import torch

    first, second = torch.nn.Linear(64, 64), torch.nn.Linear(64, 64)
    seen = {}
    h = first(torch.randn(8, 64))
    y = h + second(torch.relu(h))
    y.register_hook(lambda g: seen.__setitem__("branch", g.data_ptr()))
    h.register_hook(lambda g: seen.__setitem__("sum", g.data_ptr()))
    y.square().sum().backward()
    assert seen["sum"] == seen["branch"]


def test_the_script_sees_the_target_gpu_and_its_tensors_on_cuda(probe_run, script):
    result, out = probe_run([script("tiny_mlp.py"), "--hidden", "32"])
    assert result.status == "ok"
    assert "gpu NVIDIA H200 150754820096 cc 9.0" in out
    assert "on cuda:0 cuda=True" in out


def test_the_probe_stops_right_after_the_last_recorded_step(probe_run, script, tmp_path):
    marker = tmp_path / "checkpoint.txt"
    result, out = probe_run([script("tiny_mlp.py"), "--steps", "10", "--checkpoint",
                             str(marker)], steps=2)
    assert result.status == "ok" and result.steps == 2
    assert [e.label for e in result.trace.events
            if e.op == MARK and e.label.startswith("step")] == \
        ["step 1", "step 2"]
    assert not marker.exists(), "code after the last recorded step must not run"
    assert "step 1 loss" not in out  # the print after step 2's optimizer.step() never ran


def test_printing_the_loss_works_in_fake_mode(probe_run, script):
    result, out = probe_run([script("tiny_mlp.py"), "--hidden", "32"], "fake")
    assert result.status == "ok"
    assert "step 0 loss 0.0000" in out


def test_a_decision_on_the_loss_asks_for_real_values_and_says_where(probe_run, script):
    result, _ = probe_run([script("tiny_mlp.py"), "--decide-on-loss"], "fake")
    assert result.status == "needs_real_values"
    assert "tiny_mlp.py:" in result.reason and "value < best" in result.reason
    real, _ = probe_run([script("tiny_mlp.py"), "--decide-on-loss"], "profile")
    assert real.status == "ok"


def test_a_model_sized_by_tensor_arithmetic_is_traced_at_its_real_size(probe_run, script):
    result, out = probe_run([script("regnet_widths.py")], "fake")
    assert result.status == "ok"
    assert "widths [32, 48, 64, 80]" in out
    weights = sorted(e.size for e in allocs(result.trace) if e.category == "parameter")
    # Linear weights 8x32, 32x48, 48x64, 64x80 and their biases, fp32
    expected = sorted([8 * 32 * 4, 32 * 48 * 4, 48 * 64 * 4, 64 * 80 * 4,
                       32 * 4, 48 * 4, 64 * 4, 80 * 4])
    assert weights == expected


def test_parameters_gradients_and_optimizer_state_are_told_apart(probe_run, script):
    hidden = 64
    result, _ = probe_run([script("tiny_mlp.py"), "--hidden", str(hidden)], "fake")
    params = (hidden * 4 * hidden + 4 * hidden + 4 * hidden * 10 + 10) * 4
    by_cat = bytes_by_category(result.trace)
    assert by_cat["parameter"] == params
    # AdamW keeps exp_avg and exp_avg_sq per parameter, allocated once
    assert by_cat["optimizer_state"] == 2 * params
    # set_to_none=True: gradients are allocated anew every step
    assert by_cat["gradient"] == 3 * params


def test_bf16_autocast_follows_cuda_lists(probe_run, script):
    fp32, _ = probe_run([script("tiny_mlp.py"), "--hidden", "128", "--batch", "32"], "fake")
    bf16, _ = probe_run([script("tiny_mlp.py"), "--hidden", "128", "--batch", "32",
                         "--amp", "bfloat16"], "fake")
    assert bf16.status == "ok"
    sizes = Counter(e.size for e in allocs(bf16.trace))
    # CUDA autocast casts the 128x512 weight to bf16 once per step (cached for the region)
    assert sizes[128 * 512 * 2] >= 3
    # CUDA autocast lists nll_loss as fp32: cross_entropy's bf16 log-softmax of the 32x10 logits
    # is copied to fp32 for it
    assert sizes[32 * 10 * 4] >= 3
    assert sum(bytes_by_category(bf16.trace).values()) != sum(
        bytes_by_category(fp32.trace).values())


@pytest.mark.parametrize("mode", ["fake", "profile"])
def test_cublas_marks_are_recorded_for_forward_and_backward_threads(probe_run, script, mode):
    result, _ = probe_run([script("tiny_mlp.py"), "--hidden", "32"], mode)
    marks = [e.label for e in result.trace.events if e.op == MARK and e.label.startswith("cublas")]
    assert marks == ["cublas:main", "cublas:autograd"]


def test_a_script_that_raises_is_reported_with_its_traceback(probe_run, script):
    result, _ = probe_run([script("raises.py")])
    assert result.status == "script_error"
    assert "ValueError: bad config" in result.reason
    assert "raises.py" in result.traceback and result.exit_code == 1


def test_a_script_that_raises_after_its_first_step_is_reported_with_the_steps_it_made(
        probe_run, script):
    result, _ = probe_run([script("raises_after_first_step.py")], steps=3)
    assert (result.status, result.steps, result.exit_code) == ("script_error", 1, 1)
    assert result.reason == ("the script raised RuntimeError: corrupt record in shard 3 "
                             "after 1 of 3 optimizer steps")
    assert "raises_after_first_step.py" in result.traceback


def test_a_script_without_an_optimizer_step_is_reported(probe_run, script):
    result, _ = probe_run([script("no_step.py")])
    assert result.status == "no_step"


@pytest.mark.parametrize("amp", [[], ["--amp", "bf16"], ["--amp", "fp16"]])
def test_activation_checkpointing_recomputes_under_the_virtual_gpu(probe_run, amp):
    import os

    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
    args = [example, "--layers", "2", "--hidden", "64", "--heads", "4", "--vocab", "128",
            "--seq-len", "16", "--batch-size", "2"] + amp
    plain, _ = probe_run(args, "fake", steps=2)
    ckpt, _ = probe_run(args + ["--grad-ckpt"], "fake", steps=2)
    assert plain.status == ckpt.status == "ok", ckpt.reason
    # the recomputation in backward allocates the block's activations a second time
    forward_allocs = sum(1 for e in allocs(ckpt.trace) if e.phase == "backward")
    assert forward_allocs > sum(1 for e in allocs(plain.trace) if e.phase == "backward")


def test_a_hugging_face_trainer_with_gradient_accumulation_traces_in_fake_mode(probe_run, script):
    result, _ = probe_run([script("hf_trainer.py")], "fake", steps=2)
    assert result.status == "ok", result.reason
    assert result.steps == 2
    by_cat = bytes_by_category(result.trace)
    # GPT-2, 2 layers, 64 wide, 256 tokens, 64 positions (lm_head tied to the token embedding):
    # wte 16,384 + wpe 4,096 + 2 x 49,984 per block + ln_f 128 = 120,576 fp32 parameters;
    # AdamW keeps two states per parameter
    params = 256 * 64 + 64 * 64 + 2 * (2 * 128 + 64 * 192 + 192 + 64 * 64 + 64
                                       + 64 * 256 + 256 + 256 * 64 + 64) + 128
    assert params == 120_576
    # plus the model's buffers, which depend on the transformers release (4.x keeps a causal
    # mask and a masked_bias per block on the device)
    from transformers import GPT2Config, GPT2LMHeadModel

    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=64, n_head=4, vocab_size=256,
                                       n_positions=64))
    buffers = sum(b.numel() * b.element_size() for b in model.buffers())
    assert by_cat["parameter"] == params * 4 + buffers
    # Recent transformers releases pick fused AdamW on CUDA, which keeps each of the 28 parameter
    # tensors' step counter on the GPU as a 4-byte float (optimizer.py, _get_scalar_dtype / fused
    # init); 4.x picks the foreach AdamW, whose step counters stay on the host.
    from transformers import TrainingArguments

    optim = TrainingArguments(output_dir="unused", report_to=[]).optim
    fused = "fused" in str(getattr(optim, "value", optim))  # an enum member on Python 3.11+
    assert by_cat["optimizer_state"] == 2 * params * 4 + (28 * 4 if fused else 0)
    # two micro-batches per optimizer step, each its own forward
    assert sum(1 for e in result.trace.events
               if e.op == MARK and e.label.startswith("step")) == 2
