"""Code that calls bitsandbytes' native library itself through ctypes (fused LoRA kernels
dequantize their NF4 weights so), estimated with the torch environment that has the fine-tuning
stack (``NEWEST``). The script ``scripts/bnb_ctypes_dequant.py`` makes its buffers with torch and
hands their pointers and the raw CUDA stream to ``cdequantize_blockwise_*``: in fake mode those
buffers are its GPU memory, the native calls write into them and allocate nothing
(``src/xmem_admission/estimator/probe/bitsandbytes.py`` cites bitsandbytes' csrc)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import List, Tuple

from tests.support.torch_envs import NEWEST
from xmem_admission.estimator.trace import ALLOC, Trace

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "finetune" / "scripts" / "bnb_ctypes_dequant.py"
XMEM = str(ROOT / ".venv" / "bin" / "xmem")
OUT, IN, STEPS = 384, 256, 3


def estimate(tmp_path: Path, *options: str, script: Tuple[str, ...] = ()
             ) -> Tuple[subprocess.CompletedProcess, Path]:
    """``xmem estimate`` (its default mode unless ``options`` say) of the script."""
    trace = tmp_path / "trace.json"
    command = [XMEM, "estimate", "--python", NEWEST.interpreter, "--json", "--gpu", "H100-80GB",
               "--trace", str(trace), *options, "--", "python", str(SCRIPT),
               "--out", str(OUT), "--in", str(IN), "--steps", str(STEPS), *script]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300), trace


def refusal(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-4000:]
    lines = [line for line in proc.stderr.splitlines() if line.startswith("xmem estimate: error:")]
    assert lines, proc.stderr[-4000:]
    return lines[-1]


def empties(trace: Trace) -> List[int]:
    """Sizes of the buffers made with torch.empty, the adapter's weights left out."""
    return [e.size for e in trace.events if e.op == ALLOC and e.source == "aten.empty"
            and e.category != "parameter"]


def test_a_layer_that_dequantizes_through_the_native_library_is_traced_in_fake_mode(tmp_path):
    proc, trace_path = estimate(tmp_path)
    assert proc.returncode == 0, proc.stderr[-6000:]
    result = json.loads(proc.stdout)
    assert result["mode"] == "fake" and result["steps"] == STEPS
    trace = Trace.load(str(trace_path))
    made = empties(trace)
    # each step makes the float32 absmax (one per block of 64 weights) and the bf16 weight with
    # torch.empty; the native calls write into them and add nothing
    absmax, weight = -(OUT * IN // -64) * 4, OUT * IN * 2
    assert made.count(absmax) == STEPS and made.count(weight) == STEPS
    assert not [e for e in trace.events if e.op == ALLOC and "bitsandbytes" in e.source
                and e.phase != "setup"]
    messages = [n["message"] for n in result["notes"] if n["kind"] == "modelled"]
    assert any("__main__ asks for the raw CUDA stream to call bitsandbytes' native library" in m
               for m in messages)


def test_the_raw_stream_stays_refused_to_code_that_holds_another_native_library(tmp_path):
    # the same script, its module holding a native library of its own (what a custom CUDA
    # extension would launch with the stream is not known)
    proc, _ = estimate(tmp_path, script=("--own-library",))
    line = refusal(proc)
    assert "torch._C._cuda_getCurrentRawStream needs a real GPU" in line
    assert "for custom CUDA extensions" in line


def test_a_native_kernel_the_probe_does_not_model_is_refused_when_called(tmp_path):
    proc, _ = estimate(tmp_path, script=("--gemv",))
    line = refusal(proc)
    assert "bitsandbytes' native cgemm_4bit_inference_naive_bf16 needs a real GPU" in line


def test_profile_mode_refuses_bitsandbytes_native_kernels_with_the_reason(tmp_path):
    proc, _ = estimate(tmp_path, "--mode", "profile")
    line = refusal(proc)
    assert "a raw cudaStream_t for bitsandbytes' native CUDA kernels, called through ctypes " \
           "by __main__: profile mode runs the job on the host" in line
