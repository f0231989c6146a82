"""A trace's GPU streams and their simulations, each made once.

The estimate (``estimate.estimate_trace``), the peak's explanation (``peak.explain``) and the
alternatives (``peak.alternatives``) each replay a trace for each GPU model: the GPU's stream
(``orchestrate.for_gpu``: cuBLAS and cuDNN marks turned into that GPU's workspaces), then the
allocator simulator on it. They ask for the same stream, and the estimate and the explanation
for the same simulation (same allocator settings, same room). A generation-heavy fine-tune
traces millions of events; each replay of them takes seconds, so ``Replays`` makes each once
and hands the same objects to every asker.

Two GPUs often get the same stream (the same workspaces: A100 40 and 80 GB, H100 and H200
for a job without convolutions). A simulation that the room never limited
(``SimulationResult.capacity_bound`` False) is the simulation under any room of at least its
reserved peak, so one replay serves every GPU whose stream is equal, event for event, and
whose room holds that peak. ``prepare`` makes the simulations a caller will ask for at once,
in up to ``workers`` forked processes (the replays are pure Python: one core each).

One ``Replays`` serves one trace: the first question binds it, and a question about another
trace is a programming error (asserted). The streams live as long as the ``Replays``; keep one
for the duration of one estimate.

Standard library only (probe bundle).
"""

from __future__ import annotations

import dataclasses
import os
import pickle
import select
from typing import Callable, Dict, List, Mapping, NoReturn, Optional, Sequence, Tuple

from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
from xmem_admission.estimator.allocator.simulate import SimulationResult, simulate
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.trace import Trace

# One simulation asked for: the GPU, the allocator settings, the room (None: unlimited).
Ask = Tuple[GPU, Optional[AllocatorConfig], Optional[int]]
Variant = Callable[[AllocatorConfig], AllocatorConfig]


class Replays:
    """Each GPU's stream and each (stream, settings, room) simulation of one trace, made once.

    ``workers``: processes ``prepare`` may fork at once (1: none, everything in this process).
    ``variants``: settings every asked simulation will also be asked under (the caller's next
    questions, e.g. ``peak.with_expandable_segments``), made by ``prepare`` alongside."""

    __slots__ = ("env", "workers", "variants", "_trace", "_streams", "_same", "_simulations")

    def __init__(self, env: Optional[Mapping[str, str]] = None, workers: int = 1,
                 variants: Sequence[Variant] = ()) -> None:
        self.env: Optional[Dict[str, str]] = dict(env) if env is not None else None
        self.workers = max(1, workers)
        self.variants = tuple(variants)
        self._trace: Optional[Trace] = None
        self._streams: Dict[str, Trace] = {}
        self._same: Dict[str, str] = {}  # GPU -> the first GPU whose stream equals its own
        self._simulations: Dict[Tuple[str, AllocatorConfig, Optional[int]],
                                SimulationResult] = {}

    def _bind(self, trace: Trace) -> None:
        if self._trace is None:
            self._trace = trace
        assert self._trace is trace, "one Replays serves one trace"

    def stream(self, trace: Trace, gpu: GPU) -> Trace:
        """``for_gpu(trace, gpu, env)`` (the point's workspaces), made once per GPU."""
        self._bind(trace)
        found = self._streams.get(gpu.key)
        if found is None:
            found = for_gpu(trace, gpu, self.env)
            for key, other in self._streams.items():
                # the trace's own events are shared objects (compared by identity); only the
                # workspaces each GPU added are compared by value
                if len(other.events) == len(found.events) and other.events == found.events:
                    self._same[gpu.key] = self._same.get(key, key)
                    found = Trace(other.events, found.meta)  # its own meta, one event list
                    break
            self._streams[gpu.key] = found
        return found

    def _cached(self, gpu: GPU, config: AllocatorConfig,
                capacity: Optional[int]) -> Optional[SimulationResult]:
        """The simulation asked for, made before for this GPU or for one with an equal stream
        (then under a room that never limited it and holds its peak), or None."""
        same = self._same.get(gpu.key, gpu.key)
        found = self._simulations.get((same, config, capacity))
        if found is not None:
            return found
        for (key, settings, _), result in self._simulations.items():
            if key == same and settings == config and not result.capacity_bound and (
                    capacity is None or result.peak_reserved_bytes <= capacity):
                found = dataclasses.replace(result, capacity_bytes=capacity)
                self._simulations[(same, config, capacity)] = found
                return found
        return None

    def simulation(self, trace: Trace, gpu: GPU, config: Optional[AllocatorConfig],
                   capacity: Optional[int]) -> SimulationResult:
        """``simulate`` of the GPU's stream under ``config`` with ``capacity`` bytes of room,
        made once per (stream, settings, room)."""
        config = config if config is not None else AllocatorConfig()
        stream = self.stream(trace, gpu)
        found = self._cached(gpu, config, capacity)
        if found is None:
            found = simulate(stream, config, capacity_bytes=capacity)
            self._simulations[(self._same.get(gpu.key, gpu.key), config, capacity)] = found
        return found

    def prepare(self, trace: Trace, asks: Sequence[Ask]) -> None:
        """Make the simulations of ``asks`` and of their ``variants``, the missing ones at once
        in up to ``workers`` processes: for each stream and settings, first the one with the
        largest room (it most likely serves the others too); any still missing after that in
        this process, by ``simulation``."""
        wanted: List[Tuple[GPU, AllocatorConfig, Optional[int]]] = []
        for gpu, config, capacity in asks:
            config = config if config is not None else AllocatorConfig()
            self.stream(trace, gpu)
            wanted.append((gpu, config, capacity))
            for variant in self.variants:
                other = variant(config)
                if other != config:
                    wanted.append((gpu, other, capacity))
        first: Dict[Tuple[str, AllocatorConfig], Tuple[GPU, AllocatorConfig, Optional[int]]] = {}
        for gpu, config, capacity in wanted:
            if self._cached(gpu, config, capacity) is not None:
                continue
            group = (self._same.get(gpu.key, gpu.key), config)
            held = first.get(group)
            if held is None or (held[2] is not None and
                                (capacity is None or capacity > held[2])):
                first[group] = (gpu, config, capacity)
        jobs = list(first.values())
        results = simulate_all([(self._streams[gpu.key], config, capacity)
                                for gpu, config, capacity in jobs], self.workers)
        for (gpu, config, capacity), result in zip(jobs, results):
            self._simulations[(self._same.get(gpu.key, gpu.key), config, capacity)] = result
        for gpu, config, capacity in wanted:
            self.simulation(trace, gpu, config, capacity)


# -- replays in forked processes --------------------------------------------------------------

def simulate_all(jobs: Sequence[Tuple[Trace, AllocatorConfig, Optional[int]]],
                 workers: int) -> List[SimulationResult]:
    """``simulate(stream, config, capacity_bytes=capacity)`` of each job, in order: up to
    ``workers`` at once, each in a forked child that sends its result back pickled (the
    streams reach the children by the fork, never through a pipe). One job, one worker, or no
    ``fork`` here: in this process."""
    if workers <= 1 or len(jobs) <= 1 or not hasattr(os, "fork"):
        return [simulate(stream, config, capacity_bytes=capacity)
                for stream, config, capacity in jobs]
    results: List[Optional[SimulationResult]] = [None] * len(jobs)
    running: Dict[int, Tuple[int, int, List[bytes]]] = {}  # read end -> (job, pid, data)
    waiting = list(range(len(jobs)))
    try:
        while waiting or running:
            while waiting and len(running) < workers:
                index = waiting.pop(0)
                read, write = os.pipe()
                pid = os.fork()
                if pid == 0:  # the child: replay, send, leave without Python's teardown
                    os.close(read)
                    _child(jobs[index], write)
                os.close(write)
                running[read] = (index, pid, [])
            ready, _, _ = select.select(list(running), [], [])
            for read in ready:
                chunk = os.read(read, 1 << 20)
                if chunk:
                    running[read][2].append(chunk)
                    continue
                index, pid, data = running.pop(read)
                os.close(read)
                _, status = os.waitpid(pid, 0)
                results[index] = _received(b"".join(data), status)
    finally:
        for read, (_, pid, _) in running.items():
            os.close(read)
            os.kill(pid, 9)
            os.waitpid(pid, 0)
    assert all(r is not None for r in results), "every replay sent its result"
    return [r for r in results if r is not None]


def _child(job: Tuple[Trace, AllocatorConfig, Optional[int]], write: int) -> NoReturn:
    code = 0
    try:
        stream, config, capacity = job
        payload = pickle.dumps((True, simulate(stream, config, capacity_bytes=capacity)))
    except BaseException as exc:  # noqa: BLE001 - the parent raises it
        code = 1
        try:
            payload = pickle.dumps((False, exc))
        except Exception:  # noqa: BLE001 - an exception that does not pickle: its words
            payload = pickle.dumps((False, RuntimeError(f"{type(exc).__name__}: {exc}")))
    try:
        view = memoryview(payload)
        while view:
            view = view[os.write(write, view):]
    finally:
        os._exit(code)


def _received(data: bytes, status: int) -> SimulationResult:
    if not data:
        raise RuntimeError(f"a replay's process ended without a result (wait status {status}; "
                           f"killed for memory?)")
    ok, value = pickle.loads(data)
    if not ok:
        raise value
    assert isinstance(value, SimulationResult)
    return value
