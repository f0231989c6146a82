"""The probe works out DTensor's sharding of a foreach op once per distinct element
(``distributed._patch_foreach_dedupe``): for an optimizer-like foreach op over DTensors whose
shapes repeat, the output sharding, the redistribution DTensor asks for and the output shapes
are what torch's own element-by-element propagation gives."""

from __future__ import annotations

from typing import Any, Iterator, List

import pytest
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._op_schema import OpSchema
from torch.testing._internal.distributed.fake_pg import FakeStore

from xmem_admission.estimator.probe.distributed import _patch_foreach_sharding
from xmem_admission.estimator.probe.torch_patches import Patches

aten = torch.ops.aten


@pytest.fixture
def mesh() -> Iterator[Any]:
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        yield init_device_mesh("cpu", (4,))
    finally:
        dist.destroy_process_group()


def _params(mesh: Any) -> List[DTensor]:
    """A transformer's parameters repeat per block: three blocks of the same four shapes, one
    of them replicated, and an odd one out."""
    shapes = [(8, 4), (4, 8), (8,), (6, 4)] * 3 + [(5, 3)]
    placements = [Shard(0), Shard(0), Replicate(), Shard(1)] * 3 + [Shard(0)]
    return [distribute_tensor(torch.zeros(shape), mesh, [p])
            for shape, p in zip(shapes, placements)]


def _schemas(mesh: Any) -> List[OpSchema]:
    params, grads = _params(mesh), _params(mesh)
    specs = [p._spec for p in params]
    grad_specs = [g._spec for g in grads]
    return [
        OpSchema(aten._foreach_mul.Scalar, (specs, 0.5), {}),
        OpSchema(aten._foreach_add.List, (specs, grad_specs), {"alpha": 2.0}),
        OpSchema(aten._foreach_addcdiv_.ScalarList, (specs, grad_specs, grad_specs,
                                                     [0.1] * 12 + [0.2]), {}),
        OpSchema(aten._foreach_sqrt.default, (grad_specs,), {}),
    ]


def _propagate(schema: OpSchema) -> Any:
    propagator = DTensor._op_dispatcher.sharding_propagator
    return propagator.propagate_op_sharding_non_cached(schema)


def _seen(sharding: Any) -> Any:
    suggestion = sharding.redistribute_schema
    return (sharding.output_spec, sharding.needs_redistribute,
            None if suggestion is None else suggestion.args_schema)


@pytest.mark.parametrize("which", range(4), ids=["mul", "add", "addcdiv_", "sqrt"])
def test_each_foreach_op_shards_as_torch_shards_it_element_by_element(mesh, which):
    from torch.distributed.tensor import _sharding_prop

    if not hasattr(_sharding_prop, "_expand_single_dim_strategy_to_mesh"):
        pytest.skip(f"torch {torch.__version__} works out foreach shardings without "
                    f"_expand_single_dim_strategy_to_mesh: the probe's dedupe does not apply")
    schema = _schemas(mesh)[which]
    theirs = _seen(_propagate(schema))
    patches, elements = Patches(), []
    real = _sharding_prop._expand_single_dim_strategy_to_mesh

    def counted(mesh: Any, op_schema: Any, info: Any, meta: Any) -> Any:
        elements.append(len(op_schema.args_schema[0].children))
        return real(mesh, op_schema, info, meta)

    try:
        patches.set(_sharding_prop, "_expand_single_dim_strategy_to_mesh", counted)
        _patch_foreach_sharding(patches)
        ours = _seen(_propagate(schema))
    finally:
        patches.restore()
    assert ours == theirs
    if schema.op in getattr(DTensor._op_dispatcher.sharding_propagator,
                            "op_single_dim_strategy_funcs", {}):
        assert elements == [5]  # 4 shapes per block and the odd one, each worked out once
    else:  # this release registers the op's list strategy whole (2.11's list_pointwise_strategy)
        assert elements == []
    outputs = ours[0]
    if outputs is not None:
        assert [o.tensor_meta.shape for o in outputs] == [
            torch.Size(s) for s in [(8, 4), (4, 8), (8,), (6, 4)] * 3 + [(5, 3)]]
