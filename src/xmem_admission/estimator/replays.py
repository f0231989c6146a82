"""A trace's GPU streams and their simulations, each made once.

The estimate (``estimate.estimate_trace``), the peak's explanation (``peak.explain``) and the
alternatives (``peak.alternatives``) each replay a trace for each GPU model: the GPU's stream
(``orchestrate.for_gpu``: cuBLAS and cuDNN marks turned into that GPU's workspaces), then the
allocator simulator on it. They ask for the same stream, and the estimate and the explanation
for the same simulation (same allocator settings, same room). A generation-heavy fine-tune
traces millions of events; each replay of them takes seconds, so ``Replays`` makes each once
and hands the same objects to every asker.

One ``Replays`` serves one trace: the first question binds it, and a question about another
trace is a programming error (asserted). The streams live as long as the ``Replays``; keep one
for the duration of one estimate.

Standard library only (probe bundle).
"""

from __future__ import annotations

from typing import Dict, Mapping, Optional, Tuple

from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
from xmem_admission.estimator.allocator.simulate import SimulationResult, simulate
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.trace import Trace


class Replays:
    """Each GPU's stream and each (GPU, settings, room) simulation of one trace, made once."""

    __slots__ = ("env", "_trace", "_streams", "_simulations")

    def __init__(self, env: Optional[Mapping[str, str]] = None) -> None:
        self.env: Optional[Dict[str, str]] = dict(env) if env is not None else None
        self._trace: Optional[Trace] = None
        self._streams: Dict[str, Trace] = {}
        self._simulations: Dict[Tuple[str, AllocatorConfig, Optional[int]], SimulationResult] = {}

    def _bind(self, trace: Trace) -> None:
        if self._trace is None:
            self._trace = trace
        assert self._trace is trace, "one Replays serves one trace"

    def stream(self, trace: Trace, gpu: GPU) -> Trace:
        """``for_gpu(trace, gpu, env)`` (the point's workspaces), made once per GPU."""
        self._bind(trace)
        found = self._streams.get(gpu.key)
        if found is None:
            found = self._streams[gpu.key] = for_gpu(trace, gpu, self.env)
        return found

    def simulation(self, trace: Trace, gpu: GPU, config: Optional[AllocatorConfig],
                   capacity: Optional[int]) -> SimulationResult:
        """``simulate`` of the GPU's stream under ``config`` with ``capacity`` bytes of room,
        made once per (GPU, settings, room)."""
        config = config if config is not None else AllocatorConfig()
        key = (gpu.key, config, capacity)
        found = self._simulations.get(key)
        if found is None:
            found = self._simulations[key] = simulate(self.stream(trace, gpu), config,
                                                      capacity_bytes=capacity)
        return found
