"""bitsandbytes jobs traced in fake (shape-only) mode: QLoRA with the Trainer, 4-bit FP4 and
8-bit LoRA loops, the 8-bit and paged optimizers. Each runs ``xmem estimate`` with the torch
environment that has the fine-tuning stack (``NEWEST``) and reads its trace: the packed weights,
the quantization state and the optimizer state must be there with the sizes bitsandbytes'
sources give (``src/xmem_admission/estimator/probe/bitsandbytes.py`` cites each)."""

from __future__ import annotations

import json
import subprocess
from collections import Counter
from pathlib import Path
from typing import Any, Dict, List, Tuple

from tests.support.torch_envs import NEWEST
from xmem_admission.estimator.trace import ALLOC, MARK, Trace

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "finetune" / "scripts"
XMEM = str(ROOT / ".venv" / "bin" / "xmem")
GIB = 2**30


def estimate(tmp_path: Path, script: str, *args: str) -> Tuple[Dict[str, Any], Trace]:
    """``xmem estimate`` in its default mode (auto: fake, or profile with the reason when fake
    mode cannot go on), its JSON result and trace."""
    trace = tmp_path / "trace.json"
    command = [XMEM, "estimate", "--python", NEWEST.interpreter, "--json", "--gpu", "H100-80GB",
               "--trace", str(trace), "--", "python", str(SCRIPTS / script), *args]
    proc = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, f"{' '.join(command)}\n{proc.stderr[-6000:]}"
    # (the probe's seconds and memory are the benchmark's figures: bench/coverage/finetune_matrix.py)
    return json.loads(proc.stdout), Trace.load(str(trace))


def allocations(trace: Trace, source: str, phase: str = "", category: str = "") -> List[Any]:
    return [e for e in trace.events if e.op == ALLOC and e.source == source
            and (not phase or e.phase == phase) and (not category or e.category == category)]


def sizes(events: List[Any]) -> Counter:
    return Counter(e.size for e in events)


def linear_shapes(checkpoint: Path, modules: Tuple[str, ...]) -> List[Tuple[int, int]]:
    """(out_features, in_features) of the named linear layers of every decoder layer, from the
    checkpoint's config (LlamaForCausalLM's layout)."""
    config = json.loads((checkpoint / "config.json").read_text())
    hidden, heads = config["hidden_size"], config["num_attention_heads"]
    kv = config.get("num_key_value_heads") or heads
    head_dim = config.get("head_dim") or hidden // heads
    shapes = {"q_proj": (heads * head_dim, hidden), "k_proj": (kv * head_dim, hidden),
              "v_proj": (kv * head_dim, hidden), "o_proj": (hidden, heads * head_dim),
              "gate_proj": (config["intermediate_size"], hidden),
              "up_proj": (config["intermediate_size"], hidden),
              "down_proj": (hidden, config["intermediate_size"])}
    return [shapes[name] for name in modules] * config["num_hidden_layers"]


ALL_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def blocks(n: int, blocksize: int) -> int:
    return -(n // -blocksize)


def notes(trace: Trace, kind: str) -> List[str]:
    return [item["message"] for item in trace.notes() if item["kind"] == kind]


def test_a_qlora_job_with_the_trainer_is_traced_in_fake_mode_with_nf4_double_quant_weights(
        tmp_path, llama_checkpoint):
    result, trace = estimate(tmp_path, "bnb_qlora_trainer.py", str(llama_checkpoint))
    assert result["mode"] == "fake" and result["steps"] == 3
    weights = [out * inp for out, inp in linear_shapes(llama_checkpoint, ALL_LINEARS)]
    # functional.quantize_4bit -> backends/cuda/ops.py quantize_4bit: the packed uint8 weight,
    # (n + 1) // 2 bytes, and one float32 absmax per block of 64 (freed: double quantization
    # keeps its 8-bit form)
    quantized = allocations(trace, "bitsandbytes.quantize_4bit", "setup")
    assert sizes([e for e in quantized if e.category == "parameter"]) == \
        Counter((n + 1) // 2 for n in weights)
    assert sizes([e for e in quantized if e.category != "parameter"]) == \
        Counter(blocks(n, 64) * 4 for n in weights)
    # quantize_blockwise(absmax - offset, blocksize=256): one uint8 per absmax and one float32
    # per 256 of them, kept as the weight's state
    nested = allocations(trace, "bitsandbytes.quantize_blockwise", "setup", "parameter")
    assert sizes(nested) == Counter([blocks(n, 64) for n in weights]
                                    + [blocks(blocks(n, 64), 256) * 4 for n in weights])
    # the 4-byte offset (absmax.mean()) of each weight
    assert sizes(allocations(trace, "aten.mean", "setup", "parameter")) == \
        Counter({4: len(weights)})
    # the backward pass dequantizes each weight to bf16 (MatMul4Bit.backward), N x K x 2 bytes
    dequantized = sizes(allocations(trace, "bitsandbytes.dequantize_4bit", "backward"))
    assert set(dequantized) == {n * 2 for n in weights}
    assert any("nf4 4-bit with double quantization" in m for m in notes(trace, "modelled"))


def test_fp4_without_double_quantization_keeps_a_float32_absmax_per_block(
        tmp_path, llama_checkpoint):
    result, trace = estimate(tmp_path, "bnb_lora_loop.py", str(llama_checkpoint),
                             "--bits", "4", "--quant-type", "fp4")
    assert result["mode"] == "fake" and result["steps"] == 3
    weights = [out * inp for out, inp in linear_shapes(llama_checkpoint, ALL_LINEARS)]
    quantized = allocations(trace, "bitsandbytes.quantize_4bit", "setup", "parameter")
    assert sizes(quantized) == Counter([(n + 1) // 2 for n in weights]
                                       + [blocks(n, 64) * 4 for n in weights])
    assert not allocations(trace, "bitsandbytes.quantize_blockwise")
    # the forward's bnb gemm on an H100 with 128 tokens: bitsandbytes' heuristic dequantizes
    # these small weights to bf16 and calls F.linear (backends/cuda/ops.py,
    # _dequant_linear_fallback): an N x K bf16 temporary per layer call
    forward = sizes(allocations(trace, "bitsandbytes.gemm_4bit", "forward"))
    assert all(forward[n * 2] >= 3 for n in set(weights))
    assert any("fp4 4-bit weights" in m for m in notes(trace, "modelled"))


def test_an_8bit_lora_job_keeps_int8_weights_and_a_float32_scale_per_row(
        tmp_path, llama_checkpoint):
    result, trace = estimate(tmp_path, "bnb_lora_loop.py", str(llama_checkpoint), "--bits", "8")
    assert result["mode"] == "fake" and result["steps"] == 3
    shapes = linear_shapes(llama_checkpoint, ALL_LINEARS)
    # Int8Params._quantize -> int8_vectorwise_quant: int8 weight, one float32 scale per row
    kept = allocations(trace, "bitsandbytes.int8_vectorwise_quant", "setup", "parameter")
    assert sizes(kept) == Counter([out * inp for out, inp in shapes] + [out * 4 for out, _ in shapes])
    # int8_scaled_mm: the int32 product of every 8-bit layer's matmul (tokens x out x 4 bytes)
    tokens = 2 * 64
    products = sizes(allocations(trace, "bitsandbytes.int8_scaled_mm", "forward"))
    assert {tokens * out * 4 for out, _ in shapes} <= set(products)


def test_an_8bit_job_with_an_outlier_threshold_falls_back_to_profile_mode(
        tmp_path, llama_checkpoint):
    result, _ = estimate(tmp_path, "bnb_lora_loop.py", str(llama_checkpoint), "--bits", "8",
                         "--threshold", "6.0")
    assert result["mode"] == "profile" and result["steps"] == 3
    assert "outlier threshold of 6.0" in result["fallback_reason"]


def optimizer_state_at_last_step(trace: Trace) -> Counter:
    """Sizes of the optimizer state live when the last step's mark is reached."""
    live: Dict[int, Any] = {}
    last: Counter = Counter()
    for e in trace.events:
        if e.op == ALLOC:
            live[e.id] = e
        elif e.op == "free":
            live.pop(e.id, None)
        elif e.op == MARK and e.label.startswith("step"):
            last = Counter(a.size for a in live.values() if a.category == "optimizer_state")
    return last


def test_adamw8bit_keeps_uint8_state_and_a_float32_absmax_per_256_block(tmp_path):
    result, trace = estimate(tmp_path, "bnb_optim_loop.py", "--optim", "adamw8bit",
                             "--width", "1024")
    assert result["mode"] == "fake" and result["steps"] == 3
    # optim/optimizer.py, Optimizer2State.init_state: parameters of 4,096 elements or more get
    # uint8 state1/state2 and float32 absmax1/absmax2 per block of 256; smaller ones float32
    # state; the two 256-entry float32 maps once
    state = optimizer_state_at_last_step(trace)
    expected = Counter()
    for n in (1024 * 1024, 256 * 1024):
        expected.update([n] * 2 + [blocks(n, 256) * 4] * 2)
    for n in (1024, 256):
        expected.update([n * 4] * 2)
    expected.update([256 * 4] * 2)
    assert state == expected


def test_paged_adamw8bit_state_is_resident_gpu_memory(tmp_path):
    result, trace = estimate(tmp_path, "bnb_optim_loop.py", "--optim", "paged_adamw8bit",
                             "--width", "1024")
    assert result["mode"] == "fake" and result["steps"] == 3
    # functional.get_paged for the parameters of 1e5 elements or more: uint8 state in managed
    # memory, counted on the GPU; the rest as AdamW8bit's
    state = optimizer_state_at_last_step(trace)
    for n in (1024 * 1024, 256 * 1024):
        assert state[n] == 2
    assert any("paged optimizer state" in m for m in notes(trace, "modelled"))
    assert result["gpus"][0]["breakdown"]["optimizer_state"] >= 2 * (1024 + 256) * 1024


def test_the_trainer_with_paged_adamw_8bit_traces_a_qlora_job_in_fake_mode(
        tmp_path, llama_checkpoint):
    result, trace = estimate(tmp_path, "bnb_qlora_trainer.py", str(llama_checkpoint),
                             "--optim", "paged_adamw_8bit", "--quant-type", "fp4",
                             "--no-double-quant")
    assert result["mode"] == "fake" and result["steps"] == 3
    # LoRA's adapters (r=8 on every linear layer) are under 4,096 elements: float32 state1 and
    # state2 each (optim/optimizer.py, Optimizer2State.init_state: min_8bit_size=4096), on the
    # GPU as bitsandbytes allocates it below 1e5 elements (Optimizer8bit.get_state_buffer)
    expected: Counter = Counter()
    for out, inp in linear_shapes(llama_checkpoint, ALL_LINEARS):
        expected.update([8 * inp * 4] * 2 + [out * 8 * 4] * 2)
    assert optimizer_state_at_last_step(trace) == expected
    assert any("fp4 4-bit weights" in m for m in notes(trace, "modelled"))


def test_a_four_token_batch_runs_the_fused_4bit_kernel_without_a_dequantized_weight(
        tmp_path, llama_checkpoint):
    result, trace = estimate(tmp_path, "bnb_lora_loop.py", str(llama_checkpoint),
                             "--bits", "4", "--quant-type", "nf4", "--batch-size", "1",
                             "--seq-len", "4")
    assert result["mode"] == "fake" and result["steps"] == 3
    # backends/cuda/ops.py, gemm_4bit: up to _GEMM_4BIT_CUSTOM_FLOOR_M = 4 rows the fused
    # kernel runs on any GPU and allocates its output only (4 x N bf16), unless the blocksize
    # (64) does not divide the inner dimension (down_proj's 172 here): then the weight is
    # dequantized to bf16 (N x K) for F.linear
    shapes = linear_shapes(llama_checkpoint, ALL_LINEARS)
    forward = sizes(allocations(trace, "bitsandbytes.gemm_4bit", "forward"))
    assert set(forward) == ({4 * out * 2 for out, _ in shapes}
                            | {out * inp * 2 for out, inp in shapes if inp % 64})
    assert any(inp % 64 for _, inp in shapes) and any(not inp % 64 for _, inp in shapes)


def test_linear4bit_used_directly_quantizes_its_weights_when_the_model_moves_to_the_gpu(
        tmp_path):
    result, trace = estimate(tmp_path, "bnb_linear4bit_loop.py", "--width", "1024")
    assert result["mode"] == "fake" and result["steps"] == 3
    n = 1024 * 1024
    # Params4bit._quantize: the float32 weight copied to the GPU (transient), then quantize_4bit's
    # packed weight and float32 absmax per block of 64, kept
    assert sizes(allocations(trace, "aten._to_copy", "setup", "input"))[n * 4] == 2
    assert sizes(allocations(trace, "bitsandbytes.quantize_4bit", "setup", "parameter")) == \
        Counter({n // 2: 2, blocks(n, 64) * 4: 2})
    # 8 rows on an H100: bitsandbytes' heuristic runs the fused kernel, the output only
    assert sizes(allocations(trace, "bitsandbytes.gemm_4bit", "forward")) == \
        Counter({8 * 1024 * 2: 2 * 3})


def test_trainable_int8_weights_quantize_input_and_weight_by_rows_and_columns(tmp_path):
    result, trace = estimate(tmp_path, "bnb_int8_trainable.py", "--width", "256",
                             "--batch-size", "32")
    assert result["mode"] == "fake" and result["steps"] == 3
    # MatMul8bitLt.forward with a weight that needs a gradient: int8_double_quant of the
    # float16 input (backends/cuda/ops.py): int8 row- and column-quantized copies (M x K each),
    # float32 row and column statistics, and the column pass's temporaries (|A| in float16,
    # the float32 quotient A * 127 / col_stats)
    rows, cols = 32, 256
    forward = sizes(allocations(trace, "bitsandbytes.int8_double_quant", "forward"))
    assert forward[rows * cols] >= 2 * 3
    assert {rows * 4, cols * 4, rows * cols * 2, rows * cols * 4} <= set(forward)


PREQUANTIZE = """
import sys
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer, BitsAndBytesConfig
quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                  bnb_4bit_use_double_quant=True,
                                  bnb_4bit_compute_dtype=torch.bfloat16)
model = AutoModelForCausalLM.from_pretrained(sys.argv[1], quantization_config=quantization,
                                             device_map="cpu")
model.save_pretrained(sys.argv[2])
AutoTokenizer.from_pretrained(sys.argv[1]).save_pretrained(sys.argv[2])
"""


def test_a_checkpoint_saved_already_quantized_is_traced_in_fake_mode_as_its_source_is(
        tmp_path, llama_checkpoint):
    # quantized on the CPU by bitsandbytes' own kernels and saved as bitsandbytes writes it:
    # packed weights beside each layer's quantization state (a JSON uint8 tensor, code maps)
    saved = tmp_path / "nf4"
    subprocess.run([NEWEST.interpreter, "-c", PREQUANTIZE, str(llama_checkpoint), str(saved)],
                   check=True, capture_output=True, timeout=600)
    args = ("--quant-type", "nf4", "--double-quant")
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    loaded, trace = estimate(tmp_path / "a", "bnb_lora_loop.py", str(saved), *args)
    quantized, _ = estimate(tmp_path / "b", "bnb_lora_loop.py", str(llama_checkpoint), *args)
    assert loaded["mode"] == "fake", loaded.get("fallback_reason")
    assert notes(trace, "modelled")
    # the same model on the GPU either way: within the few small state tensors that come as
    # host data from the file rather than from bitsandbytes' quantization
    gpu, again = loaded["gpus"][0], quantized["gpus"][0]
    assert abs(gpu["peak_allocated_bytes"] - again["peak_allocated_bytes"]) <= 4096
