"""The public estimator: a training command in, GPU memory per GPU model out.

``estimate(command, gpus)`` runs the probe on the command in a subprocess (isolation, a watchdog,
the script's stdout kept off ours), falls back from fake to profile mode when the script needs
real values, then for each target GPU rewrites the trace for that GPU (``orchestrate``),
replays it through the caching-allocator simulator and adds what lives outside the allocator
(the GPU catalogue's overhead). ``estimate_trace`` does the second half for a trace already
recorded. Standard library only, plus torch in the probe subprocess.

The probe subprocess runs under the interpreter the command names (``choose_interpreter``: a
path after ``--``, ``python=``, a launcher's ``#!`` line; a bare ``python`` is this process's
own), with that interpreter's torch, checked first (``inspect_interpreter``). Given the probe
bundle's folder (``xmem estimate`` passes ``bundle.cached()``), the subprocess imports the
probe from the bundle, first on ``PYTHONPATH`` as in an estimation pod, and nothing of this
process's environment; without it, only this process's own interpreter can be used.
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass, field
from typing import IO, Any, Dict, List, Optional, Sequence, Tuple

from xmem_admission.contract import gpus as catalogue
from xmem_admission.contract import nccl as nccl_model
from xmem_admission.contract import overhead as outside
from xmem_admission.contract import probe_env, torch_version
from xmem_admission.contract.errors import EstimateError, ProbeTimeout, ScriptFailed
from xmem_admission.estimator.allocator.alloc_conf import (
    AllocatorConfig,
    config_from_env,
    job_environment,
    parse_alloc_conf,
)
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.orchestrate import HIGH, LOW, for_gpu
from xmem_admission.estimator.replays import Replays
from xmem_admission.estimator.trace import UPPER_BOUND_NOTES, Category, Trace, gc_paused

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
    # what sized the convolution workspaces (cuDNN's heuristics and which cuDNN, or the fitted
    # rule and why): ``orchestrate.ConvPlanner.describe``; None for a job without convolutions
    conv_workspaces: Optional[Dict[str, Any]] = None
    # what ``overhead_bytes`` is made of: the context, runtime and cuDNN figures for the job's
    # CUDA major, each with its basis and source (``contract.overhead.Overhead.to_dict``)
    overhead: Optional[Dict[str, Any]] = None
    # The range the job's peak on a GPU may take (``Range``): the point (``total_bytes``) lies in
    # [low_bytes, high_bytes]; equal where nothing the estimate guesses changes the stream.
    low_bytes: int = 0
    high_bytes: int = 0
    # What makes the range wide, largest first: {what, low_bytes, high_bytes, detail}
    uncertain: List[Dict[str, Any]] = field(default_factory=list)
    # the OOM call: "fits" (the high end fits), "may not fit" (only the high end does not),
    # "does not fit" (the low end does not); ``fits`` is False only for the last
    fit: str = "fits"
    low_oom: bool = False  # the low end's simulation ran out of memory
    high_oom: bool = False  # the high end's simulation ran out of memory

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
    torch: str = ""  # the torch that traced the script, as it names itself
    python: str = ""  # the version of the interpreter that ran it
    interpreter: str = ""  # that interpreter's path
    # what the trace says about how it stands for the GPU run (``Trace.note``): sizes bounded,
    # compiled code traced eagerly, side effects turned off, library kernels modelled
    notes: List[Dict[str, Any]] = field(default_factory=list)

    @property
    def upper_bound(self) -> bool:
        """Is the estimate an upper bound (a size or a compiled region taken at its largest)?"""
        return any(n.get("kind") in UPPER_BOUND_NOTES for n in self.notes)

    def to_dict(self) -> Dict[str, Any]:
        out: Dict[str, Any] = {"mode": self.mode, "steps": self.steps,
                               "seconds": round(self.seconds, 3),
                               "gpus": [g.to_dict() for g in self.gpus]}
        if self.fallback_reason:
            out["fallback_reason"] = self.fallback_reason
        out["probe_seconds"] = round(self.probe_seconds, 3)
        out["probe_peak_rss_bytes"] = self.probe_peak_rss_bytes
        out["trace_events"] = self.trace_events
        out["torch"] = self.torch
        out["python"] = self.python
        out["interpreter"] = self.interpreter
        out["upper_bound"] = self.upper_bound
        out["notes"] = [{k: v for k, v in n.items() if k != "key"} for n in self.notes]
        return out


def resolve_gpus(names: Sequence[str]) -> List[catalogue.GPU]:
    """Catalogue entries for ``names`` (raises ``UnknownGPUError`` listing the choices)."""
    found: List[catalogue.GPU] = []
    for name in names:
        gpu = catalogue.lookup(name.strip())
        if gpu not in found:
            found.append(gpu)
    return found


def allocator_config(alloc_conf: Optional[str] = None, torch: Optional[str] = None,
                     meta: Optional[Dict[str, Any]] = None) -> AllocatorConfig:
    """The allocator settings to simulate, as the job's torch (``torch``: its version string,
    None for the newest supported) reads them: the given string, else the job's environment's
    (``PYTORCH_CUDA_ALLOC_CONF``, or ``PYTORCH_ALLOC_CONF`` where that torch reads it): as its
    trace recorded it (``meta``), else this process's."""
    if alloc_conf is not None:
        return parse_alloc_conf(alloc_conf, torch)
    return config_from_env(job_environment(meta or {}, os.environ), torch)


def allocator_capacity(gpu: catalogue.GPU, overhead_bytes: Optional[int] = None) -> int:
    """What cudaMalloc can still hand the caching allocator: the card minus what lives outside
    (``overhead_bytes``; the catalogue's conservative default when not given)."""
    return gpu.capacity_bytes - (gpu.overhead_bytes if overhead_bytes is None else overhead_bytes)


def overhead_for(stream: Trace, gpu: catalogue.GPU) -> outside.Overhead:
    """The memory outside the allocator for a job on ``gpu``, from its GPU stream (``for_gpu``'s
    output, whose meta is the trace's plus the GPU's): for the CUDA major the job's torch was
    built for (the probe records ``torch.version.cuda``; older traces only the torch version)
    and whether it calls cuDNN (the stream has convolution workspaces) (``contract.overhead``)."""
    meta = stream.meta
    major = outside.cuda_major_of(meta.get("cuda"), meta.get("torch"))
    return outside.for_gpu(gpu.key, major, uses_cudnn=bool(meta.get("conv_workspaces")))


def allocator_room(trace: Trace, stream: Trace, gpu: catalogue.GPU,
                   env: Optional[Dict[str, str]] = None) -> int:
    """What the simulated allocator of ``trace``'s GPU stream (``for_gpu``'s output) may reserve:
    the card less the memory outside the allocator for that job and NCCL's buffers."""
    return (allocator_capacity(gpu, overhead_for(stream, gpu).total_bytes)
            - nccl_bytes(trace, gpu, env))


FITS, MAY_NOT_FIT, DOES_NOT_FIT = "fits", "may not fit", "does not fit"


def request_bytes(total: int, high: int, margin: float) -> int:
    """The request for an estimate whose point is ``total`` and high end ``high``: the margin
    on the point, and the high end's excess over it on top (a job whose estimate is exact pays
    only the margin; one whose convolutions may pick larger workspaces pays for them too)."""
    return int(math.ceil(total * (1.0 + margin))) + max(high - total, 0)


@dataclass
class _End:
    """One end of the range, simulated: its total and whether it runs out of memory."""

    total: int
    oom: bool


def _simulate_end(stream: Trace, gpu: catalogue.GPU, config: Optional[AllocatorConfig],
                  capacity: int, outside_nccl: int) -> _End:
    sim = simulate(stream, config, capacity_bytes=capacity)
    return _End(sim.peak_reserved_bytes + outside_nccl, sim.oom is not None)


def _same_sizes(a: Trace, b: Trace) -> bool:
    return len(a.events) == len(b.events) and all(
        x.op == y.op and getattr(x, "size", 0) == getattr(y, "size", 0)
        for x, y in zip(a.events, b.events))


def _conv_range(trace: Trace, stream: Trace, gpu: catalogue.GPU,
                config: Optional[AllocatorConfig], capacity: int, outside_nccl: int,
                env: Optional[Dict[str, str]], point: _End) -> Tuple[_End, _End, Dict[str, Any]]:
    """The low and high ends of the convolution workspaces' range: the stream rebuilt with each
    call's workspace at that end of the plans cuDNN ranks (``orchestrate.for_gpu``'s ``end``)
    and simulated again where it differs (the reserved peak is not additive)."""
    ends = []
    described: Dict[str, Any] = {}
    for end in (LOW, HIGH):
        other = for_gpu(trace, gpu, env, end=end)
        if _same_sizes(other, stream):
            ends.append(point)
        else:
            ends.append(_simulate_end(other, gpu, config, capacity, outside_nccl))
        if end == HIGH:
            described = dict((other.meta.get("conv_workspaces") or {}).get("range") or {})
    return ends[0], ends[1], described


def estimate_trace(trace: Trace, gpus: Sequence[catalogue.GPU],
                   config: Optional[AllocatorConfig] = None, margin: float = DEFAULT_MARGIN,
                   env: Optional[Dict[str, str]] = None,
                   replays: Optional[Replays] = None) -> List[GPUEstimate]:
    """Simulate ``trace`` on each GPU, with the range of what it guesses (``GPUEstimate``'s
    ``low_bytes``/``high_bytes``/``uncertain``), call whether it fits, and size the request.
    ``replays`` keeps each GPU's stream and simulation for the peak's explanation (its ``env``
    is the one used; ``env`` makes a new one when it is not given)."""
    results = []
    replays = replays if replays is not None else Replays(env)
    env = replays.env
    bounded = [n for n in trace.notes() if n.get("kind") in UPPER_BOUND_NOTES]
    rooms = {gpu.key: allocator_room(trace, replays.stream(trace, gpu), gpu, env) for gpu in gpus}
    replays.prepare(trace, [(gpu, config, rooms[gpu.key]) for gpu in gpus])
    for gpu in gpus:
        nccl = nccl_bytes(trace, gpu, env)
        stream = replays.stream(trace, gpu)
        figures = overhead_for(stream, gpu)
        overhead = figures.total_bytes
        capacity = rooms[gpu.key]
        sim = replays.simulation(trace, gpu, config, capacity)
        total = sim.peak_reserved_bytes + nccl + overhead
        point = _End(total, sim.oom is not None)
        low, high, uncertain = point, point, []
        if stream.meta.get("conv_workspaces"):
            low, high, ranged = _conv_range(trace, stream, gpu, config, capacity,
                                            nccl + overhead, env, point)
            if low.total != total or high.total != total or ranged.get("unknown_calls"):
                uncertain.append(_conv_reason(ranged, min(low.total, total, high.total),
                                              max(high.total, total, low.total)))
        low, high = _outside_range(figures, point, low, high, uncertain)
        # a size fake execution could not know, taken at its largest: the point is the high end
        # and the low end is not known (the range's low end is that of the rest)
        for note in bounded:
            extra = int(note.get("extra_bytes") or 0)
            uncertain.append({"what": f"upper bound ({note.get('kind')})", "low_bytes": None,
                              "high_bytes": total,
                              "detail": str(note.get("message") or "") + (
                                  f"; the bound may cost up to {extra} B over the job's own "
                                  f"size" if extra else "") + "; the low end is not known"})
        fit = _fit_call(gpu, low, point, high, low_known=not bounded)
        recommended = request_bytes(total, high.total, margin)
        profile = catalogue.smallest_mig_profile(gpu, recommended)
        results.append(GPUEstimate(
            gpu=gpu.key, capacity_bytes=gpu.capacity_bytes,
            peak_allocated_bytes=sim.peak_allocated_bytes,
            peak_reserved_bytes=sim.peak_reserved_bytes, overhead_bytes=overhead,
            total_bytes=total, fits=fit != DOES_NOT_FIT, recommended_request_bytes=recommended,
            mig_profile=profile.name if profile is not None else None,
            breakdown=_breakdown(sim.allocated_by_category_at_peak_allocated,
                                 sim.peak_reserved_bytes, overhead, nccl),
            oom=sim.oom.to_dict() if sim.oom is not None else None,
            conv_workspaces=stream.meta.get("conv_workspaces"),
            overhead=figures.to_dict(),
            # the reserved peak is not monotone in the workspaces (a larger one can leave the
            # pool less fragmented): the range spans every simulated stream
            low_bytes=min(low.total, total, high.total),
            high_bytes=max(high.total, total, low.total),
            uncertain=uncertain, fit=fit, low_oom=low.oom, high_oom=high.oom,
        ))
    return results


def _outside_range(figures: outside.Overhead, point: _End, low: _End, high: _End,
                   uncertain: List[Dict[str, Any]]) -> Tuple[_End, _End]:
    """The ends moved by the spread of the memory outside the allocator (``contract.overhead``:
    each figure's rows spread around it), noted in ``uncertain`` where it has one: below the
    lowest simulated stream and above the highest. The simulated allocator keeps the room the
    point leaves it: the spread moves the total, not the pool."""
    below = figures.total_bytes - figures.low_bytes
    above = figures.high_bytes - figures.total_bytes
    if not below and not above:
        return low, high
    spreads = [f"{name} {f.low_bytes / 2**20:.0f}-{f.high_bytes / 2**20:.0f} MiB ({f.spread})"
               for name, f in (("context", figures.context), ("runtime", figures.runtime),
                               ("cuDNN", figures.cudnn))
               if f.spread and (name != "cuDNN" or figures.uses_cudnn)]
    uncertain.append({"what": "memory outside the allocator",
                      "low_bytes": figures.low_bytes, "high_bytes": figures.high_bytes,
                      "detail": f"the figures for {figures.gpu} with CUDA {figures.cuda_major} "
                                f"spread over the rows they were fitted on: " + "; ".join(spreads)})
    totals = (low.total, point.total, high.total)
    return _End(min(totals) - below, low.oom), _End(max(totals) + above, high.oom)


def _fits(gpu: catalogue.GPU, end: _End) -> bool:
    return not end.oom and end.total <= gpu.capacity_bytes


def _fit_call(gpu: catalogue.GPU, low: _End, point: _End, high: _End,
              low_known: bool = True) -> str:
    """The OOM call: "does not fit" only where the low end does not (and is known: an upper
    bound's is not); "may not fit" where the point or the high end does not."""
    if low_known and not _fits(gpu, low):
        return DOES_NOT_FIT
    if not (_fits(gpu, point) and _fits(gpu, high)):
        return MAY_NOT_FIT
    return FITS


def range_lines(estimates: Sequence[GPUEstimate]) -> List[str]:
    """What ``xmem estimate`` and the report say of each GPU's range: its ends, why the request
    is above the point's margin, and what makes the range wide (nothing for an exact one)."""
    out = []
    for g in estimates:
        if not g.uncertain:
            continue
        gib = 2**30
        out.append(f"{g.gpu}: range {g.low_bytes / gib:.2f}-{g.high_bytes / gib:.2f} GiB around "
                   f"{g.total_bytes / gib:.2f} GiB; the request covers the high end "
                   f"(+{(g.high_bytes - g.total_bytes) / gib:.2f} GiB over the point's margin)"
                   + (f"; {g.fit}" if g.fit != FITS else ""))
        for why in g.uncertain:
            out.append(f"  {why['what']}: {why['detail']}")
    return out


def _conv_reason(ranged: Dict[str, Any], low: int, high: int) -> Dict[str, Any]:
    calls = int(ranged.get("calls") or 0)
    unknown = int(ranged.get("unknown_calls") or 0)
    detail = (f"{calls} convolution call(s) whose plans, as cuDNN"
              f"{' ' + ranged['cudnn'] if ranged.get('cudnn') else ''}'s heuristics rank them "
              f"for this GPU, need different workspaces; which one the GPU runs cannot be asked "
              f"without it (low: each call's smallest workspace; high: its largest)")
    if unknown:
        detail += (f"; {unknown} call(s) with no ranked plans, taken as the point sizes them"
                   f"{' (' + ranged['unknown_why'] + ')' if ranged.get('unknown_why') else ''}")
    return {"what": "convolution workspaces", "low_bytes": low, "high_bytes": high,
            "detail": detail}


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


# The oldest Python the probe bundle is written for (ruff's py39 target over the bundle).
OLDEST_PYTHON = (3, 9)
INSPECT_TIMEOUT = 120.0
OWN = "xmem's own interpreter"


@dataclass
class Interpreter:
    """The Python that runs the probe, and its torch (``inspect_interpreter``)."""

    path: str  # as it is run: absolute, symbolic links kept (a venv's python is one)
    python: str  # "3.13.1"
    torch: str  # its torch's version as installed, "2.15.0+cu128"


def is_interpreter_word(word: str) -> bool:
    """Whether a command's first word names a Python interpreter (``python``, ``python3.13``,
    ``/venv/bin/python``), not a script (``python_train.py``)."""
    name = os.path.basename(word)
    return name.startswith("python") and not name.endswith(".py")


def choose_interpreter(command: Sequence[str], python: Optional[str] = None,
                       cwd: Optional[str] = None) -> Tuple[str, str]:
    """The interpreter that traces ``command``, and how it was chosen (for messages):

    - ``python`` (``--python``): that one, a bare name looked up on ``PATH``; an interpreter
      path after ``--`` that is another one is an error (two interpreters);
    - a path after ``--`` (``/venv/bin/python train.py``): that interpreter;
    - a launcher or another installed program given by its path (``/venv/bin/torchrun ...``,
      ``/venv/bin/axolotl ...``; ``resolve_program`` gives a bare name its path): the
      interpreter of its ``#!`` line, the one of the environment it is installed in;
    - otherwise (a bare ``python``/``python3``, a bare ``torchrun``, a script): the interpreter
      this process runs under (``sys.executable``).

    Relative paths are read from ``cwd``. Raises ``EstimateError`` for a path that is not an
    executable file.
    """
    from xmem_admission.contract import launch

    first = command[0] if command else ""
    named = is_interpreter_word(first) and os.sep in first
    if python is not None:
        if not python.strip():
            raise EstimateError("--python names no interpreter")
        if os.sep not in python:
            import shutil

            found = shutil.which(python)
            if found is None:
                raise EstimateError(f"--python {python}: no such interpreter on PATH")
            path = found
        else:
            path = _absolute(python, cwd)
        _require_executable(path, f"--python {python}")
        if named and _absolute(first, cwd) != path:
            raise EstimateError(f"two interpreters: --python {python} and {first} after --; "
                                f"give one")
        return path, f"--python {python}"
    if named:
        path = _absolute(first, cwd)
        _require_executable(path, f"{first} (the interpreter after --)")
        return path, "the interpreter after --"
    launcher = launch.launcher_of(command) is not None
    if os.sep in first and (launcher or not first.endswith(".py")):
        path = _absolute(first, cwd)
        what = "the launcher after --" if launcher else "the program after --"
        _require_executable(path, f"{first} ({what})")
        interpreter = _shebang_interpreter(path)
        if interpreter is None:
            line = _first_line(path)
            if not line.startswith("#!") or "python" not in line:
                said = f"its first line is {line!r}" if line.startswith("#!") else "no #! line"
                raise EstimateError(f"{first} is not a Python program ({said}): the probe "
                                    f"traces Python programs; give the Python command it runs")
            raise EstimateError(f"cannot tell which Python {first} runs under (its first line "
                                f"names no interpreter by its path): give it with --python PATH")
        _require_executable(interpreter, f"{interpreter} (the interpreter of {first})")
        return interpreter, f"{first}'s interpreter"
    return sys.executable, OWN


def resolve_program(command: Sequence[str], python: Optional[str] = None,
                    cwd: Optional[str] = None) -> List[str]:
    """``command`` with a program given by its bare name (``axolotl train cfg.yml``,
    ``llamafactory-cli train cfg.yaml``: a console script that pip installed beside its
    environment's interpreter) replaced by its path, found as a shell would run it from that
    environment: beside the ``--python`` interpreter, else on ``PATH``. A script in ``cwd``, an
    interpreter or a launcher (``torchrun``) is left as it is. Raises ``EstimateError`` for a
    name found nowhere."""
    import shutil

    from xmem_admission.contract import launch

    first = command[0] if command else ""
    if (not first or os.sep in first or first == "-m" or is_interpreter_word(first)
            or launch.launcher_of(command) is not None
            or os.path.isfile(os.path.join(cwd or ".", first))):
        return list(command)
    places = []
    if python is not None and python.strip():
        found = python if os.sep in python else shutil.which(python)
        if found is not None:
            places.append(os.path.dirname(_absolute(found, cwd)))
    places.append(os.environ.get("PATH", os.defpath))
    path = shutil.which(first, path=os.pathsep.join(places))
    if path is None:
        beside = f", not beside --python {python}" if python else ""
        raise EstimateError(f"script not found: {first} (not a file in "
                            f"{os.path.abspath(cwd or '.')}{beside}, not on PATH)")
    return [_absolute(path, cwd), *command[1:]]


def _first_line(path: str) -> str:
    try:
        with open(path, "rb") as handle:
            return handle.readline(200).decode("utf-8", "replace").rstrip()
    except OSError:
        return ""


def _absolute(path: str, cwd: Optional[str]) -> str:
    # abspath, not realpath: a venv's bin/python is a link to the base interpreter, and only
    # run by the link's path does it find the venv's site-packages.
    return os.path.abspath(os.path.join(cwd or os.getcwd(), os.path.expanduser(path)))


def _require_executable(path: str, what: str) -> None:
    if not os.path.exists(path):
        raise EstimateError(f"{what}: no such file")
    if not os.path.isfile(path) or not os.access(path, os.X_OK):
        raise EstimateError(f"{what}: not an executable file")


_PIP_SH_EXEC = re.compile(r"""^'''exec' (?:"([^"]+)"|(\S+))""")


def _shebang_interpreter(path: str) -> Optional[str]:
    """The interpreter an installed console script (torchrun) starts: its ``#!`` line, or the
    ``exec`` line pip writes under ``#!/bin/sh`` when the interpreter's path is too long for
    one; None when it names none by absolute path (``#!/usr/bin/env python3``, a binary)."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(4096).decode("utf-8", "replace").splitlines()
    except OSError:
        return None
    if not head or not head[0].startswith("#!"):
        return None
    words = head[0][2:].split()
    if words and is_interpreter_word(words[0]) and os.path.isabs(words[0]):
        return words[0]
    if words and os.path.basename(words[0]) == "sh":
        for line in head[1:4]:
            match = _PIP_SH_EXEC.match(line)
            if match:
                return match.group(1) or match.group(2)
    return None


# Run by the interpreter under test: its version first (readable even where the rest fails,
# Python 2 included), then the version of the torch it would import, read from that torch's
# version.py without importing it (an import costs seconds), else from its installed metadata;
# "-" for no torch.
_INSPECT = r"""
import sys
sys.stdout.write("%d.%d.%d\n" % tuple(sys.version_info[:3]))
sys.stdout.flush()
import importlib.util, os, re
spec = importlib.util.find_spec("torch")
version = ""
if spec is not None:
    for folder in spec.submodule_search_locations or ():
        try:
            with open(os.path.join(folder, "version.py")) as handle:
                found = re.search(r"^__version__\s*(?::\s*str\s*)?=\s*['\"]([^'\"]+)",
                                  handle.read(), re.M)
        except (IOError, OSError):
            continue
        if found:
            version = found.group(1)
            break
    if not version:
        try:
            from importlib import metadata
            version = metadata.version("torch")
        except Exception:
            version = "unknown"
sys.stdout.write((version or "-") + "\n")
"""


def inspect_interpreter(path: str, how: str, env: Optional[Dict[str, str]] = None,
                        cwd: Optional[str] = None) -> Interpreter:
    """Check that ``path`` is a Python the probe runs on (3.9 or newer) with a torch of the
    supported range (``contract.torch_version``), in the environment the probe will have;
    raises ``EstimateError`` with one line saying what is wrong."""
    try:
        proc = subprocess.run([path, "-c", _INSPECT], stdin=subprocess.DEVNULL,
                              capture_output=True, text=True, timeout=INSPECT_TIMEOUT,
                              check=False, env=env, cwd=cwd)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise EstimateError(f"{how} ({path}) cannot be run: {exc}") from None
    lines = proc.stdout.split()
    match = re.match(r"^(\d+)\.(\d+)\.(\d+)$", lines[0]) if lines else None
    last = (proc.stderr.strip().splitlines() or [""])[-1].strip()
    if match is None:
        raise EstimateError(f"{how} ({path}) is not a Python interpreter (exit status "
                            f"{proc.returncode}{': ' + last if last else ''})")
    python = lines[0]
    if (int(match.group(1)), int(match.group(2))) < OLDEST_PYTHON:
        raise EstimateError(f"{how} ({path}) is Python {python}; the probe needs Python "
                            f"{OLDEST_PYTHON[0]}.{OLDEST_PYTHON[1]} or newer")
    if proc.returncode != 0 or len(lines) < 2:
        raise EstimateError(f"{how} ({path}, Python {python}) failed (exit status "
                            f"{proc.returncode}{': ' + last if last else ''})")
    torch = lines[1]
    where = f"{how} ({'' if path in how else path + ', '}Python {python})"
    if torch == "-":
        hint = ""
        if how == OWN:
            hint = ("; or name the interpreter of an environment that has it: `xmem estimate "
                    "-- /path/to/venv/bin/python train.py` or --python PATH")
        raise EstimateError(f"{where} has no torch: install torch "
                            f"({torch_version.supported_range()}) there{hint}")
    try:
        version = torch_version.parse(torch)
    except torch_version.TorchVersionError as exc:
        raise EstimateError(f"{where}: {exc}") from None
    if version.release < torch_version.OLDEST:
        raise EstimateError(f"{where} has torch {torch}, older than the probe supports (torch "
                            f"{torch_version.supported_range()})")
    return Interpreter(path=path, python=python, torch=torch)


def probe_environment(bundle: Optional[str] = None,
                      base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    """The probe subprocess's environment: this one's (or ``base``), with ``bundle`` first on
    ``PYTHONPATH`` as the controller puts it in an estimation pod (the user's own
    ``PYTHONPATH`` after it), and without the estimation pod's ``XMEM_PROBE*`` settings, which
    would start the bundle's site hook on the runner itself."""
    env = dict(os.environ if base is None else base)
    for name in probe_env.ALL:
        env.pop(name, None)
    if bundle is not None:
        rest = env.get("PYTHONPATH", "")
        env["PYTHONPATH"] = bundle + (os.pathsep + rest if rest else "")
    return env


def run_probe(command: Sequence[str], gpu: catalogue.GPU, mode: str, steps: int,
              timeout: float, stream: Optional[IO[str]] = None,
              cwd: Optional[str] = None, interpreter: Optional[str] = None,
              bundle: Optional[str] = None,
              extra_env: Optional[Dict[str, str]] = None) -> Dict[str, Any]:
    """Run the probe in a subprocess (in ``cwd``, default this process's) with ``interpreter``
    (default this process's), the probe bundle ``bundle`` first on ``PYTHONPATH`` and
    ``extra_env`` set, and return its JSON result (raises on timeout)."""
    stream = stream if stream is not None else sys.stderr
    with tempfile.TemporaryDirectory(prefix="xmem-probe-") as tmp:
        out = os.path.join(tmp, "result.json")
        argv = [interpreter or sys.executable, "-m", "xmem_admission.estimator.probe.runner",
                "--out", out, "--mode", mode, "--steps", str(steps),
                "--device-json", device_json(gpu), "--", *command]
        try:
            proc = subprocess.run(argv, stdin=subprocess.DEVNULL, stdout=stream, stderr=stream,
                                  timeout=timeout, check=False, cwd=cwd,
                                  env={**probe_environment(bundle), **(extra_env or {})})
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
        with open(out, encoding="utf-8") as fh, gc_paused():
            result: Dict[str, Any] = json.load(fh)
            return result


def estimate(command: Sequence[str], gpu_names: Sequence[str] = DEFAULT_GPUS, mode: str = "auto",
             steps: int = 3, alloc_conf: Optional[str] = None, margin: float = DEFAULT_MARGIN,
             timeout: float = DEFAULT_TIMEOUT, stream: Optional[IO[str]] = None,
             progress: Optional[IO[str]] = None,
             cwd: Optional[str] = None, python: Optional[str] = None,
             bundle: Optional[str] = None,
             replays: Optional[Replays] = None) -> tuple[Estimate, Trace]:
    """Trace ``command`` once, run from ``cwd`` (default this process's working directory),
    and estimate it for every GPU of ``gpu_names``.

    The interpreter is ``choose_interpreter(command, python, cwd)``'s; ``bundle`` is the probe
    bundle's folder, needed for any interpreter but this process's own (see the module's
    docstring). ``replays``, when given (empty), keeps the GPU streams and simulations of the
    trace for the peak's explanation."""
    if mode not in MODES:
        raise EstimateError(f"unknown mode {mode!r}: choose one of {', '.join(MODES)}")
    if steps < 1:
        raise EstimateError("--steps must be at least 1")
    gpus = resolve_gpus(gpu_names)
    if not gpus:
        raise EstimateError("no GPU given")
    allocator_config(alloc_conf)  # a malformed string fails before anything runs
    command = resolve_program(command, python, cwd)
    _check_command(command, cwd)
    path, how = choose_interpreter(command, python, cwd)
    if bundle is None and path != sys.executable:
        raise EstimateError(f"tracing with {how} ({path}) needs the probe bundle: build it with "
                            f"`python -m xmem_admission.bundle DIR` and pass bundle=DIR")
    interpreter = inspect_interpreter(path, how, probe_environment(bundle), cwd)

    def say(msg: str) -> None:
        if progress:
            print(msg, file=progress, flush=True)

    started = time.perf_counter()
    first = "fake" if mode in ("auto", "fake") else "profile"
    say(f"xmem: tracing {' '.join(command)} ({first} mode, {steps} steps) as {gpus[0].cuda_name}"
        f" with torch {interpreter.torch} on Python {interpreter.python} ({interpreter.path})")
    result = run_probe(command, gpus[0], first, steps, timeout, stream, cwd, path, bundle)
    extra: Dict[str, str] = {}
    if result["status"] == "unsupported" and result.get("retry_env"):
        # a shortcut of the probe's own failed its check: trace again without it
        extra = dict(result["retry_env"])
        say(f"xmem: {result['reason']}; tracing again with "
            f"{' '.join(f'{k}={v}' for k, v in sorted(extra.items()))}")
        result = run_probe(command, gpus[0], first, steps, timeout, stream, cwd, path, bundle,
                           extra)
    reason = ""
    if result["status"] == "needs_real_values" and mode == "auto":
        reason = result["reason"]
        say(f"xmem: fake mode needs real values ({reason}); tracing again in profile mode")
        result = run_probe(command, gpus[0], "profile", steps, timeout, stream, cwd, path,
                           bundle, extra)
    _raise_for_status(result, command)
    trace = Trace.from_dict(result["trace"])
    say(f"xmem: {result['steps']} steps traced in {result['seconds']:.1f} s "
        f"({len(trace)} events); simulating {len(gpus)} GPU model(s)")
    # the caching allocator of the torch that ran the job (keys, parsing, defaults), with the
    # settings its environment had
    config = allocator_config(alloc_conf, interpreter.torch, trace.meta)
    per_gpu = estimate_trace(trace, gpus, config, margin, replays=replays)
    est = Estimate(mode=result["mode"], steps=result["steps"],
                   seconds=time.perf_counter() - started, gpus=per_gpu, fallback_reason=reason,
                   probe_seconds=result["seconds"], probe_peak_rss_bytes=result["peak_rss_bytes"],
                   trace_events=len(trace), torch=str(trace.meta.get("torch") or interpreter.torch),
                   python=interpreter.python, interpreter=interpreter.path,
                   notes=trace.notes())
    return est, trace


def _check_command(command: Sequence[str], cwd: Optional[str] = None) -> None:
    from xmem_admission.estimator.command import split_command

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
