"""An op on FSDP2's sharded parameters (DTensors over fake shards) runs once: the probe does not
take the DTensor for a real value of its own and run the op over it a second time."""

from __future__ import annotations

from collections import Counter

import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from tests.distributed.conftest import script

aten = torch.ops.aten


def test_each_optimizer_update_of_a_sharded_parameter_runs_once_per_step(trace_launch,
                                                                        monkeypatch):
    from torch.distributed.tensor._sharding_prop import ShardingPropagator

    calls: Counter = Counter()
    real_dispatch = FakeTensorMode.dispatch
    real_meta = ShardingPropagator._propagate_tensor_meta_non_cached
    in_meta = [0]

    def counted(self, func, types, args=(), kwargs=None):
        if func is aten.lerp_.Scalar:
            where = "metadata" if in_meta[0] else "run"
            calls[type(args[0]).__name__, where] += 1
        return real_dispatch(self, func, types, args, kwargs)

    def metadata(self, op_schema, *args, **kwargs):
        # DTensor works out an output's metadata by running the op over fake tensors of the
        # global shape (cached by sharding from some releases on; 2.9 runs it on every call)
        in_meta[0] += 1
        try:
            return real_meta(self, op_schema, *args, **kwargs)
        finally:
            in_meta[0] -= 1

    monkeypatch.setattr(FakeTensorMode, "dispatch", counted)
    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached", metadata)
    # The portable model's optimizer is AdamW's per-tensor loop: one lerp_ per parameter per
    # step, on the DTensor and then on its local shard. Every parameter's global size is under
    # the probe's limit for values it computes on the host, where the second run used to happen.
    result, _ = trace_launch(["torchrun", "--nproc-per-node", "8", script("fsdp2_gpt.py"),
                              "--portable", "--layers", "2"], steps=2)
    assert result.status == "ok", result.reason + result.traceback
    parameters = 2 + 2 * 12 + 2 + 1  # embeddings; per block (the script's Block); norm; head
    assert calls["DTensor", "run"] == 2 * parameters
    # Once per shard, besides DTensor's own metadata propagation: the second run this guards
    # against doubled the count (124 against 58).
    assert calls["FakeTensor", "run"] == 2 * parameters
    assert calls["FakeTensor", "metadata"] <= 2 * parameters


def test_a_dtensor_over_fake_shards_has_no_value_of_its_own():
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from xmem_admission.estimator.probe.tracker import AllocationTracker
    from xmem_admission.estimator.trace import Trace

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        mesh = init_device_mesh("cpu", (4,))
        mode = FakeTensorMode()
        with mode:
            local = torch.empty(2, 8)
        tracker = AllocationTracker(Trace(), fake=True, fake_mode=mode)
        sharded = DTensor.from_local(local, mesh, [Shard(0)], run_check=False)
        host = torch.arange(4)
        assert tracker.shadow(sharded) is None
        assert tracker.shadow(local) is None
        assert tracker.shadow(host) is host
    finally:
        dist.destroy_process_group()
