"""Run one training script under the ground-truth measuring hooks; one process per job.

``bench/yardsticks/gpu_truth.py`` starts this file once per job, in a fresh process, so that every job gets
a fresh CUDA context and a caching allocator that starts empty: what it measures is what that job
alone costs, context included. The training script itself is not modified: this runner takes the
measurements a script cannot take about itself (the device level before CUDA exists, the context
on its own, a memory history from the very first allocation) and then runs the script with
``runpy`` exactly as ``python SCRIPT ARGS`` would.

In order:

1. NVML opens the device and reads its ``used`` memory before this process touches CUDA (the
   baseline), and a thread samples it every ``--interval`` seconds from then on, keeping the peak.
2. CUDA is initialised on its own (``torch.cuda.synchronize()`` creates the primary context
   without going through the caching allocator); NVML's level then, minus the baseline, is the
   context.
3. The allocator's memory history is switched on (no stack traces: they would make the snapshot
   ten times larger and the replay does not read them).
4. The script runs; an optimizer step post-hook counts the steps it made. A CUDA out-of-memory
   error ends it and is recorded as an OOM, any other failure as an error.
5. After a last NVML sample: the allocator's peaks, the snapshot (``_dump_snapshot``), the
   versions, and one JSON object written to ``--result``.

It must run where only the standard library, torch and NVML's Python binding (``pynvml``, from
nvidia-ml-py) are installed, so it imports nothing else. ``--dry-run`` runs the same steps on the
CPU without NVML: the GPU fields are then zeros and the result says ``dry_run: true``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import runpy
import sys
import threading
import time
import traceback
from typing import Any, Dict, List, Optional

SCHEMA = "xmem-gpu-truth-measurement/1"
# Entries kept by the allocator's history ring buffer: far above the ~1e5 events the largest job
# of the matrix is expected to make in a few steps, so the trace starts at the first allocation.
MAX_HISTORY_ENTRIES = 4_000_000
# The caching allocator's statistics worth keeping beside the peaks (names as in
# torch.cuda.memory_stats()): retries and OOMs say whether the allocator had to free its cache.
KEPT_STATS = (
    "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free",
    "reserved_bytes.all.current", "allocated_bytes.all.current",
    "active_bytes.all.peak", "requested_bytes.all.peak",
)


class NvmlSampler:
    """Samples NVML's device ``used`` memory on a thread and keeps the highest value seen.

    NVML reports the device, not this process: the harness runs one job at a time on an otherwise
    idle GPU, and subtracts the level read before this process created its CUDA context.
    """

    def __init__(self, pynvml: Any, handle: Any, interval: float) -> None:
        self._nvml = pynvml
        self._handle = handle
        self._interval = interval
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.peak = 0
        self.samples = 0
        self._thread = threading.Thread(target=self._run, name="nvml-sampler", daemon=True)

    def read(self) -> int:
        """One sample, folded into the peak; also used for the levels before and after init."""
        used = int(self._nvml.nvmlDeviceGetMemoryInfo(self._handle).used)
        with self._lock:
            self.peak = max(self.peak, used)
            self.samples += 1
        return used

    def start(self) -> None:
        self._started = time.perf_counter()
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self._interval):
            self.read()

    def stop(self) -> Dict[str, Any]:
        """Stop the thread, take a last sample, and say how often sampling really happened."""
        self._stop.set()
        self._thread.join()
        final = self.read()
        elapsed = time.perf_counter() - self._started
        return {"nvml_peak_used_bytes": self.peak, "nvml_final_used_bytes": final,
                "nvml_samples": self.samples,
                "nvml_mean_interval_s": round(elapsed / max(self.samples, 1), 6)}


def _nvml_open(index: int) -> Any:
    """Import pynvml and open device ``index`` (the harness checked NVML works before)."""
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    return pynvml, pynvml.nvmlDeviceGetHandleByIndex(index)


def _nvml_index() -> int:
    """The NVML index of CUDA device 0: the first entry of CUDA_VISIBLE_DEVICES when numeric."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",")[0].strip()
    return int(visible) if visible.isdigit() else 0


def _text(value: Any) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


def _count_optimizer_steps(torch: Any) -> List[int]:
    """Count optimizer steps with torch's global post-hook (the estimator's probe does the same)."""
    counter = [0]

    def hook(optimizer: Any, args: Any, kwargs: Any) -> None:
        counter[0] += 1

    from torch.optim.optimizer import register_optimizer_step_post_hook

    register_optimizer_step_post_hook(hook)
    return counter


def _run_script(script: str, script_args: List[str], result: Dict[str, Any], torch: Any) -> None:
    """``python SCRIPT ARGS`` in this process; records OOM, exit status or failure."""
    sys.argv = [script, *script_args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    try:
        runpy.run_path(script, run_name="__main__")
    except torch.cuda.OutOfMemoryError as exc:
        result["oom"] = True
        result["oom_message"] = str(exc).splitlines()[0][:500]
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if code:
            result["error"] = f"the script exited with status {code}"
    except Exception as exc:  # the script's own failure: recorded, the job row says so
        traceback.print_exc()
        result["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:300] if str(exc) else ''}"


def _record_history(torch: Any) -> None:
    """Memory history without stack traces (compact), from before the first allocation."""
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=MAX_HISTORY_ENTRIES)


def measure(args: argparse.Namespace) -> Dict[str, Any]:
    """Everything in the module docstring, returning the result object."""
    started = time.perf_counter()
    result: Dict[str, Any] = {
        "schema": SCHEMA, "dry_run": bool(args.dry_run), "device": "cpu", "oom": False,
        "oom_message": None, "error": None, "python_version": platform.python_version(),
        "pid": os.getpid(),
    }
    sampler: Optional[NvmlSampler] = None
    before = 0
    if not args.dry_run:
        pynvml, handle = _nvml_open(_nvml_index())
        sampler = NvmlSampler(pynvml, handle, args.interval)
        before = sampler.read()
        memory = pynvml.nvmlDeviceGetMemoryInfo(handle)
        result.update(
            nvml_name=_text(pynvml.nvmlDeviceGetName(handle)),
            nvml_uuid=_text(pynvml.nvmlDeviceGetUUID(handle)),
            nvml_total_bytes=int(memory.total),
            driver_version=_text(pynvml.nvmlSystemGetDriverVersion()),
        )
        sampler.start()
    result["nvml_before_cuda_bytes"] = before

    import torch

    result.update(torch_version=torch.__version__, cuda_version=torch.version.cuda,
                  cudnn_version=torch.backends.cudnn.version() if torch.backends.cudnn.is_available()
                  else None)
    cuda = torch.cuda.is_available() and not args.dry_run
    if not cuda and not args.dry_run:
        # Running the job on the CPU instead would measure nothing and could take hours (7B).
        result.update(error="CUDA is not available to torch here (driver, CUDA_VISIBLE_DEVICES "
                      "or a CPU-only torch build)", measured_total_bytes=0, context_bytes=0,
                      max_memory_reserved_bytes=0, max_memory_allocated_bytes=0, gpu_name=None,
                      wall_s=round(time.perf_counter() - started, 3))
        if sampler:
            result.update(sampler.stop())
        return result
    if cuda:
        torch.cuda.synchronize()  # creates the primary context; no allocator involved
        after_context = sampler.read() if sampler else 0
        free, total = torch.cuda.mem_get_info()
        props = torch.cuda.get_device_properties(0)
        result.update(
            device="cuda", gpu_name=torch.cuda.get_device_name(0),
            gpu_total_memory_bytes=int(props.total_memory),
            gpu_uuid=str(getattr(props, "uuid", "")) or None,
            compute_capability=[props.major, props.minor],
            multi_processor_count=props.multi_processor_count,
            nvml_after_context_bytes=after_context,
            context_bytes=after_context - before,
            cuda_free_after_context_bytes=int(free), cuda_total_bytes=int(total),
        )
        try:
            _record_history(torch)
        except Exception as exc:  # the peaks stand without a snapshot; the row says why
            result["snapshot_error"] = f"history not recorded: {type(exc).__name__}: {exc}"
    else:
        result.update(gpu_name=None, gpu_total_memory_bytes=0, nvml_after_context_bytes=0,
                      context_bytes=0)

    steps = _count_optimizer_steps(torch)
    _run_script(args.script, args.script_args, result, torch)
    result["optimizer_steps"] = steps[0]

    if cuda:
        torch.cuda.synchronize()
    nvml = sampler.stop() if sampler else {
        "nvml_peak_used_bytes": 0, "nvml_final_used_bytes": 0, "nvml_samples": 0,
        "nvml_mean_interval_s": 0.0}
    result.update(nvml)
    result["measured_total_bytes"] = (nvml["nvml_peak_used_bytes"] - before) if sampler else 0
    if cuda:
        stats = torch.cuda.memory_stats()
        result.update(
            max_memory_reserved_bytes=int(torch.cuda.max_memory_reserved()),
            max_memory_allocated_bytes=int(torch.cuda.max_memory_allocated()),
            memory_stats={k: int(stats.get(k, 0)) for k in KEPT_STATS},
        )
        if "snapshot_error" not in result:
            try:
                torch.cuda.memory._dump_snapshot(args.snapshot)
                result["snapshot_file"] = os.path.basename(args.snapshot)
            except Exception as exc:  # the measurements stand without it; the row says why
                result["snapshot_error"] = f"{type(exc).__name__}: {exc}"
            torch.cuda.memory._record_memory_history(enabled=None)
    else:
        result.update(max_memory_reserved_bytes=0, max_memory_allocated_bytes=0, memory_stats={})
    result["wall_s"] = round(time.perf_counter() - started, 3)
    return result


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--result", required=True, help="JSON file to write the measurements to")
    parser.add_argument("--snapshot", required=True, help="where to dump the memory snapshot")
    # 5 ms: the fastest end of the 5-10 ms the harness is specified to sample at; one NVML
    # memory query costs well under that, so the thread keeps up.
    parser.add_argument("--interval", type=float, default=0.005, help="NVML sampling period (s)")
    parser.add_argument("--dry-run", action="store_true",
                        help="on the CPU, without NVML: GPU fields are zeros")
    parser.add_argument("script")
    parser.add_argument("script_args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    if args.script_args[:1] == ["--"]:
        args.script_args = args.script_args[1:]
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    result = measure(args)
    with open(args.result, "w") as fh:
        json.dump(result, fh)
    sys.stdout.flush()
    # The script's error is in the result; the exit status only says the runner itself worked.
    return 0


if __name__ == "__main__":
    sys.exit(main())
