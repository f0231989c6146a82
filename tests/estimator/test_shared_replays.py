"""GPUs whose streams are equal share one replay, and replays run in forked processes: each
simulation a caller gets is the one it would have made alone, GPU by GPU, in this process."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import TraceError
from xmem_admission.estimator import replays as replays_module
from xmem_admission.estimator.allocator.alloc_conf import parse_alloc_conf
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.estimate import allocator_room, resolve_gpus
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.peak import with_expandable_segments
from xmem_admission.estimator.replays import Replays, simulate_all
from xmem_admission.estimator.trace import Trace

MIB = 2**20
GPUS = resolve_gpus(["A100-40GB", "A100-80GB", "H100-80GB", "H200", "L40S"])


def a_job(steps: int = 3) -> Trace:
    """Weights, a cuBLAS handle, then steps of activations freed in reverse."""
    trace = Trace(meta={"torch": "2.11.0"})
    trace.alloc(1, 3000 * MIB, category="parameter")
    trace.mark("cublas:handle")
    ident = 2
    for _ in range(steps):
        live = []
        for size in (700, 90, 2300, 5, 1200, 64):
            trace.alloc(ident, size * MIB + 4096, category="activation")
            live.append(ident)
            ident += 1
        for old in reversed(live):
            trace.free(old)
    return trace


def alone(trace: Trace, gpu, config, capacity):
    return simulate(for_gpu(trace, gpu), config, capacity_bytes=capacity).to_dict()


@pytest.mark.parametrize("conf", ["", "expandable_segments:True", "max_split_size_mb:200",
                                  "roundup_power2_divisions:4"])
@pytest.mark.parametrize("workers", [1, 2])
def test_every_gpu_gets_the_replay_it_would_have_made_alone(conf, workers):
    trace = a_job()
    config = parse_alloc_conf(conf, "2.11.0")
    shared = Replays(workers=workers, variants=(with_expandable_segments,))
    rooms = {g.key: allocator_room(trace, shared.stream(trace, g), g) for g in GPUS}
    shared.prepare(trace, [(g, config, rooms[g.key]) for g in GPUS])
    for gpu in GPUS:
        for settings in (config, with_expandable_segments(config)):
            got = shared.simulation(trace, gpu, settings, rooms[gpu.key]).to_dict()
            assert got == alone(trace, gpu, settings, rooms[gpu.key]), (gpu.key, settings)


def test_gpus_with_equal_streams_make_one_replay(monkeypatch):
    made = []

    def counting(stream, config, **kwargs):
        made.append(stream.meta["gpu"])
        return simulate(stream, config, **kwargs)

    monkeypatch.setattr(replays_module, "simulate", counting)
    trace = a_job()
    shared = Replays()
    shared.prepare(trace, [(g, None, allocator_room(trace, shared.stream(trace, g), g))
                           for g in GPUS])
    # the cuBLAS workspace is Hopper's on H100 and H200 and the same smaller one on the others
    # (the catalogue's cublas_workspace_bytes): one replay each, under the largest room
    assert sorted(made) == ["A100-80GB", "H200"]


def test_a_room_too_small_for_the_shared_replays_peak_gets_a_replay_of_its_own():
    trace = a_job()
    gpu, config = GPUS[0], parse_alloc_conf("", "2.11.0")
    shared = Replays(workers=2)
    roomy = shared.simulation(trace, gpu, config, None)
    assert not roomy.capacity_bound
    tight = roomy.peak_reserved_bytes - 600 * MIB
    got = shared.simulation(trace, gpu, config, tight)
    assert got.capacity_bound
    assert got.to_dict() == alone(trace, gpu, config, tight)
    assert got.to_dict() != dict(roomy.to_dict(), capacity_bytes=tight)


def test_a_replay_that_fails_in_its_process_raises_its_error_here():
    broken = a_job()
    broken.free(12345)
    with pytest.raises(TraceError, match="12345"):
        simulate_all([(a_job(), parse_alloc_conf("", "2.11.0"), None),
                      (broken, parse_alloc_conf("", "2.11.0"), None)], workers=2)
