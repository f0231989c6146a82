"""The public estimator: a training command in, GPU memory per GPU model out.

``estimate(command, gpus)`` runs the probe on the command in a subprocess (isolation, a watchdog,
the script's stdout kept off ours), falls back from fake to profile mode when the script needs
real values, then for each target GPU rewrites the trace for that GPU (``orchestrate``),
replays it through the caching-allocator simulator and adds what lives outside the allocator
(the GPU catalogue's overhead). ``estimate_trace`` does the second half for a trace already
recorded. Standard library only, plus torch in the probe subprocess.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from typing import IO, Any, Dict, List, Optional, Sequence

from xmem_admission.contract import gpus as catalogue
from xmem_admission.contract import nccl as nccl_model
from xmem_admission.contract.errors import EstimateError, ProbeTimeout, ScriptFailed
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig, parse_alloc_conf
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.trace import Category, Trace

DEFAULT_GPUS = ("A100-40GB", "A100-80GB", "H100-80GB", "L40S")
DEFAULT_MARGIN = 0.05
DEFAULT_TIMEOUT = 900.0
MODES = ("auto", "fake", "profile")

# Breakdown keys, in the order they are printed; they add up to total_bytes.
BREAKDOWN_KEYS = ("parameters", "gradients", "optimizer_state", "activations", "temporaries",
                  "inputs", "workspaces", "communication", "other", "allocator_cache", "nccl",
                  "overhead")
_CATEGORY_KEY = {
    Category.PARAMETER.value: "parameters",
    Category.GRADIENT.value: "gradients",
    Category.OPTIMIZER_STATE.value: "optimizer_state",
    Category.ACTIVATION.value: "activations",
    Category.TEMPORARY.value: "temporaries",
    Category.INPUT.value: "inputs",
    Category.WORKSPACE.value: "workspaces",
    Category.COMMUNICATION.value: "communication",
}


@dataclass
class GPUEstimate:
    """The answer for one GPU model; the fields of ``xmem estimate --json``'s ``gpus`` items."""

    gpu: str
    capacity_bytes: int
    peak_allocated_bytes: int
    peak_reserved_bytes: int
    overhead_bytes: int
    total_bytes: int
    fits: bool
    recommended_request_bytes: int
    mig_profile: Optional[str]
    breakdown: Dict[str, int]
    oom: Optional[Dict[str, Any]] = None

    def to_dict(self) -> Dict[str, Any]:
        return asdict(self)


@dataclass
class Estimate:
    mode: str
    steps: int
    seconds: float
    gpus: List[GPUEstimate]
    fallback_reason: str = ""
    probe_seconds: float = 0.0
    probe_peak_rss_bytes: int = 0
    trace_events: int = 0

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"mode": self.mode, "steps": self.steps,
                               "seconds": round(self.seconds, 3),
                               "gpus": [g.to_dict() for g in self.gpus]}
        if self.fallback_reason:
            out["fallback_reason"] = self.fallback_reason
        out["probe_seconds"] = round(self.probe_seconds, 3)
        out["probe_peak_rss_bytes"] = self.probe_peak_rss_bytes
        out["trace_events"] = self.trace_events
        return out


def resolve_gpus(names: Sequence[str]) -> List[catalogue.GPU]:
    """Catalogue entries for ``names`` (raises ``UnknownGPUError`` listing the choices)."""
    found: List[catalogue.GPU] = []
    for name in names:
        gpu = catalogue.lookup(name.strip())
        if gpu not in found:
            found.append(gpu)
    return found


def allocator_config(alloc_conf: Optional[str] = None) -> AllocatorConfig:
    """The allocator settings to simulate: the given string, else the environment's."""
    return parse_alloc_conf(alloc_conf if alloc_conf is not None
                            else os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))


def allocator_capacity(gpu: catalogue.GPU) -> int:
    """What cudaMalloc can still hand the caching allocator: the card minus what lives outside."""
    return gpu.capacity_bytes - gpu.overhead_bytes


def estimate_trace(trace: Trace, gpus: Sequence[catalogue.GPU],
                   config: Optional[AllocatorConfig] = None, margin: float = DEFAULT_MARGIN,
                   env: Optional[Dict[str, str]] = None) -> List[GPUEstimate]:
    """Simulate ``trace`` on each GPU and size the request."""
    results = []
    for gpu in gpus:
        nccl = nccl_bytes(trace, gpu, env)
        sim = simulate(for_gpu(trace, gpu, env), config,
                       capacity_bytes=allocator_capacity(gpu) - nccl)
        overhead = gpu.overhead_bytes
        total = sim.peak_reserved_bytes + nccl + overhead
        fits = sim.oom is None and total <= gpu.capacity_bytes
        recommended = int(math.ceil(total * (1.0 + margin)))
        profile = catalogue.smallest_mig_profile(gpu, recommended)
        results.append(GPUEstimate(
            gpu=gpu.key, capacity_bytes=gpu.capacity_bytes,
            peak_allocated_bytes=sim.peak_allocated_bytes,
            peak_reserved_bytes=sim.peak_reserved_bytes, overhead_bytes=overhead,
            total_bytes=total, fits=fits, recommended_request_bytes=recommended,
            mig_profile=profile.name if profile is not None else None,
            breakdown=_breakdown(sim.allocated_by_category_at_peak_allocated,
                                 sim.peak_reserved_bytes, overhead, nccl),
            oom=sim.oom.to_dict() if sim.oom is not None else None,
        ))
    return results


def nccl_bytes(trace: Trace, gpu: catalogue.GPU, env: Optional[Dict[str, str]] = None) -> int:
    """NCCL's buffers outside the allocator for the communicators the traced rank created
    (``contract.nccl``; none for a single-process job)."""
    setup = trace.meta.get("distributed") or {}
    groups = [int(n) for n in setup.get("groups", [])]
    return nccl_model.process_bytes(groups, gpu.multi_processor_count,
                                    os.environ if env is None else env)


def _breakdown(by_category: Dict[str, int], reserved: int, overhead: int,
               nccl: int = 0) -> Dict[str, int]:
    """Split the total: what is allocated at the allocated peak, by category; what the allocator
    holds beyond that at its reserved peak (cached blocks, fragmentation); NCCL's buffers; the
    overhead."""
    out = dict.fromkeys(BREAKDOWN_KEYS, 0)
    for category, size in by_category.items():
        out[_CATEGORY_KEY.get(category, "other")] += size
    out["allocator_cache"] = reserved - sum(by_category.values())
    out["nccl"] = nccl
    out["overhead"] = overhead
    return out


def device_json(gpu: catalogue.GPU) -> str:
    """The virtual device the script sees, for the probe."""
    return json.dumps({"name": gpu.cuda_name, "total_memory": gpu.capacity_bytes,
                       "compute_capability": list(gpu.compute_capability),
                       "multi_processor_count": gpu.multi_processor_count})


def run_probe(command: Sequence[str], gpu: catalogue.GPU, mode: str, steps: int,
              timeout: float, stream: Optional[IO[str]] = None,
              cwd: Optional[str] = None) -> Dict[str, Any]:
    """Run the probe in a subprocess (in ``cwd``, default this process's) and return its JSON
    result (raises on timeout)."""
    stream = stream if stream is not None else sys.stderr
    with tempfile.TemporaryDirectory(prefix="xmem-probe-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [sys.executable, "-m", "xmem_admission.estimator.probe.runner", "--out", out, "--mode", mode,
                "--steps", str(steps), "--device-json", device_json(gpu), "--", *command]
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=stream, stderr=stream,
                                  timeout=timeout, check=False, cwd=cwd)
        except subprocess.TimeoutExpired:
            raise ProbeTimeout(
                f"no result within {timeout:.0f} s: the script made fewer than {steps} optimizer "
                f"steps in that time (the probe was stopped; raise --timeout for slow jobs)"
            ) from None
        if not os.path.exists(out):
            if proc.returncode == -9:
                raise EstimateError(
                    f"the probe was killed (signal 9) in {mode} mode: most likely the host ran "
                    f"out of memory (profile mode needs about as much host memory as the job "
                    f"needs GPU memory; fake mode does not)")
            raise EstimateError(f"the probe died without a result (exit status "
                                f"{proc.returncode}); its output is above")
        with open(out, encoding="utf-8") as fh:
            result: Dict[str, Any] = json.load(fh)
            return result


def estimate(command: Sequence[str], gpu_names: Sequence[str] = DEFAULT_GPUS, mode: str = "auto",
             steps: int = 3, alloc_conf: Optional[str] = None, margin: float = DEFAULT_MARGIN,
             timeout: float = DEFAULT_TIMEOUT, stream: Optional[IO[str]] = None,
             progress: Optional[IO[str]] = None,
             cwd: Optional[str] = None) -> tuple[Estimate, Trace]:
    """Trace ``command`` once, run from ``cwd`` (default this process's working directory),
    and estimate it for every GPU of ``gpu_names``."""
    if mode not in MODES:
        raise EstimateError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if steps < 1:
        raise EstimateError("--steps must be at least 1")
    gpus = resolve_gpus(gpu_names)
    if not gpus:
        raise EstimateError("no GPU given")
    config = allocator_config(alloc_conf)
    _check_command(command, cwd)

    def say(msg: str) -> None:
        if progress:
            print(msg, file=progress, flush=True)

    started = time.perf_counter()
    first = "fake" if mode in ("auto", "fake") else "profile"
    say(f"xmem: tracing {' '.join(command)} ({first} mode, {steps} steps) as {gpus[0].cuda_name}")
    result = run_probe(command, gpus[0], first, steps, timeout, stream, cwd)
    reason = ""
    if result["status"] == "needs_real_values" and mode == "auto":
        reason = result["reason"]
        say(f"xmem: fake mode needs real values ({reason}); tracing again in profile mode")
        result = run_probe(command, gpus[0], "profile", steps, timeout, stream, cwd)
    _raise_for_status(result, command)
    trace = Trace.from_dict(result["trace"])
    say(f"xmem: {result['steps']} steps traced in {result['seconds']:.1f} s "
        f"({len(trace)} events); simulating {len(gpus)} GPU model(s)")
    per_gpu = estimate_trace(trace, gpus, config, margin)
    est = Estimate(mode=result["mode"], steps=result["steps"],
                   seconds=time.perf_counter() - started, gpus=per_gpu, fallback_reason=reason,
                   probe_seconds=result["seconds"], probe_peak_rss_bytes=result["peak_rss_bytes"],
                   trace_events=len(trace))
    return est, trace


def _check_command(command: Sequence[str], cwd: Optional[str] = None) -> None:
    from xmem_admission.estimator.probe.runner import split_command

    argv = split_command(command)
    if not argv:
        raise EstimateError("no training command given: use `xmem estimate -- python train.py`")
    if argv[0] == "-m":
        if len(argv) < 2:
            raise EstimateError("`-m` needs a module name")
        return
    if not os.path.isfile(os.path.join(cwd or ".", argv[0])):
        raise EstimateError(f"script not found: {argv[0]}")


def _raise_for_status(result: Dict[str, Any], command: Sequence[str]) -> None:
    status = result["status"]
    if status == "ok":
        return
    if status == "script_error":
        detail = result.get("traceback") or ""
        # The probe's reason says how many steps were made when there were any.
        when = " before its first optimizer step" if not result.get("steps") else ""
        raise ScriptFailed(f"{result['reason']} (exit status {result['exit_code']}){when}"
                           f"\n{detail}".rstrip(), result["exit_code"])
    if status == "no_step":
        raise EstimateError(f"{result['reason']}: nothing to estimate (a step is a torch.optim "
                            f"optimizer's step, or in-place updates of the model's parameters "
                            f"on the GPU after a backward pass)")
    if status in ("not_on_gpu", "unsupported"):
        raise EstimateError(f"not estimated: {result['reason']}")
    if status == "needs_real_values":
        raise EstimateError(f"fake mode cannot run this script: {result['reason']}; use "
                            f"--mode auto or --mode profile")
    raise EstimateError(f"probe failed: {result.get('reason') or status}")
