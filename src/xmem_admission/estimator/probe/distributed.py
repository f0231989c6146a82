"""Distributed jobs in one process: the probe traces one rank with a fake process group.

A data-parallel or sharded job (DDP, FSDP, FSDP2) runs the same program on every rank; what a rank
holds on its GPU depends on the world size (FSDP keeps 1/N of the parameters, gradients and
optimizer state) and on the communication it does (DDP's gradient buckets, FSDP's all-gather and
reduce-scatter buffers), not on what the other ranks compute. So the probe runs rank 0 alone:

- the launcher is not run (``contract.launch`` reads its command line); rank 0's environment is
  set as the launcher would set it (``Launch.rank0_environment``), and a script that calls
  ``init_process_group`` itself with ``env://`` variables keeps the ones it was given;
- ``init_process_group`` with any backend (``nccl``, ``gloo``, none) makes torch's fake process
  group (``torch.testing._internal.distributed.fake_pg``: backend ``"fake"`` over a
  ``FakeStore``), whose collectives return at once with outputs of the right shapes and no
  communication; ``new_group`` and device meshes make fake groups too;
- the fake group's work objects complete with a ``None`` future (FakeProcessGroup.hpp,
  ``FakeWork::getFuture``), and DDP's reducer copies the future's tensor back into its bucket
  (torch/csrc/distributed/c10d/comm.cpp, ``parseCppCommHookResult``): a DDP model without a comm
  hook gets the hook that does what the built-in allreduce hook does on a GPU (divide the
  bucket in place, all-reduce it in place: reducer.cpp ``AllReduceCommHook``), and an
  asynchronous ``all_reduce`` of the script's own hooks answers its tensor;
- the buckets that hook sees are DDP's communication buffers: they are tagged
  ``communication`` in the trace (unless they are the gradients themselves, with
  ``gradient_as_bucket_view=True``), and the communicators the job creates are recorded in the
  trace's metadata for the NCCL model (``estimator.nccl``);
- DeepSpeed's engine runs on the same fake group (``deepspeed``: its communication goes
  through ``torch.distributed``), so ZeRO's partitioning allocates what it allocates on a GPU.

Python >= 3.9, torch >= 2.2 with torch.distributed (FSDP2 from 2.6, where fully_shard is public); this module ships in the probe bundle.
"""

from __future__ import annotations

import os
from typing import Any, Callable, Dict, List, Optional, Tuple

from xmem_admission.estimator.probe.tracker import FLOATING_ON_GPU
from xmem_admission.estimator.trace import Category

# The trace metadata key under which the distributed setup is recorded.
META_KEY = "distributed"


def rank_environment(environ: Dict[str, str]) -> None:
    """Fill in what ``env://`` initialisation reads when a script is given only ``WORLD_SIZE``."""
    if "WORLD_SIZE" not in environ:
        return
    environ.setdefault("RANK", "0")
    environ.setdefault("LOCAL_RANK", "0")
    environ.setdefault("LOCAL_WORLD_SIZE", environ["WORLD_SIZE"])
    environ.setdefault("MASTER_ADDR", "127.0.0.1")
    environ.setdefault("MASTER_PORT", "29500")


class FakeWorld:
    """The process groups of the traced rank, recorded for the trace's metadata."""

    def __init__(self, tracker: Any) -> None:
        self.tracker = tracker
        self.rank = 0
        self.world_size = 1
        self.backend_asked = ""
        # One entry per communicator the job would create: the number of ranks in it.
        self.groups: List[int] = []
        self.ddp_buckets: List[int] = []

    def close(self) -> None:
        """Destroy the script's process groups (a real rank's exit would): the next run in this
        process starts without a default group."""
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()

    def record(self) -> None:
        if not self.groups:
            return
        self.tracker.trace.meta[META_KEY] = {
            "rank": self.rank, "world_size": self.world_size, "backend": self.backend_asked,
            "local_world_size": int(os.environ.get("LOCAL_WORLD_SIZE") or self.world_size),
            "groups": list(self.groups), "ddp_bucket_bytes": list(self.ddp_buckets),
        }


def install(patches: Any, tracker: Any, device_mode: Any) -> Optional[FakeWorld]:
    """Make every process group of the script fake; None when torch has no torch.distributed."""
    import torch
    import torch.distributed as dist

    if not dist.is_available():
        return None
    from torch.distributed import distributed_c10d as c10d

    # Importing the module registers the "fake" backend with torch.distributed.
    from torch.testing._internal.distributed.fake_pg import FakeStore

    world = FakeWorld(tracker)
    real_init = c10d.init_process_group
    real_new_group = c10d.new_group
    real_all_reduce = c10d.all_reduce

    def init_process_group(backend: Any = None, init_method: Any = None, timeout: Any = None,
                           world_size: int = -1, rank: int = -1, store: Any = None,
                           group_name: str = "", pg_options: Any = None, device_id: Any = None,
                           **_extra: Any) -> None:
        size = world_size if world_size and world_size > 0 else int(
            os.environ.get("WORLD_SIZE") or 1)
        me = rank if rank is not None and rank >= 0 else int(os.environ.get("RANK") or 0)
        world.rank, world.world_size = me, size
        world.backend_asked = str(backend or "default")
        world.groups.append(size)
        extra: Dict[str, Any] = {"timeout": timeout} if timeout is not None else {}
        real_init("fake", store=FakeStore(), rank=me, world_size=size, group_name=group_name,
                  **extra)
        world.record()

    def new_group(ranks: Any = None, timeout: Any = None, backend: Any = None,
                  pg_options: Any = None, *args: Any, **kwargs: Any) -> Any:
        kwargs.pop("device_id", None)
        group = real_new_group(ranks, timeout, None, None, *args, **kwargs)
        world.groups.append(len(ranks) if ranks else world.world_size)
        world.record()
        return group

    def all_reduce(tensor: Any, op: Any = c10d.ReduceOp.SUM, group: Any = None,
                   async_op: bool = False) -> Any:
        work = real_all_reduce(tensor, op=op, group=group, async_op=async_op)
        if not async_op or work is None:
            return work
        # A completed future holding the reduced tensor (in place), as NCCL's work gives.
        future: Any = torch.futures.Future()
        future.set_result([tensor])
        return torch._C._distributed_c10d._create_work_from_future(future)

    _patch_meshes(patches, tracker)
    real_resize = torch.UntypedStorage.resize_

    def resize_(storage: Any, size: int) -> Any:
        # FSDP frees and regrows its unsharded parameters this way (fsdp/_fully_shard/
        # _fsdp_common.py and fsdp/_common_utils.py: ``storage.resize_(0)``), which the
        # dispatcher never sees: tell the tracker.
        out = real_resize(storage, size)
        tracker.storage_resized(storage)
        return out

    patches.set(torch.UntypedStorage, "resize_", resize_)
    for module in (c10d, dist):
        patches.set(module, "init_process_group", init_process_group)
        patches.set(module, "new_group", new_group)
        patches.set(module, "all_reduce", all_reduce)
        patches.set(module, "is_nccl_available", lambda: True)
    _patch_ddp(patches, world, device_mode)
    _patch_fake_collectives(patches)
    _patch_fsdp1_device_id(patches)
    _patch_fsdp1(patches, world.tracker)
    _refuse_pipelines(patches)
    from xmem_admission.estimator.probe import deepspeed

    deepspeed.install(patches, world.tracker, _DEEPSPEED_IMPORT)
    return world


PIPELINE_REASON = (
    "pipeline-parallel jobs (torch.distributed.pipelining) are not estimated: each rank builds a "
    "different stage of the model and keeps a different number of microbatches' activations "
    "(1F1B: the first stage the most), so one rank's trace is not every GPU's peak; give the "
    "job a whole-GPU request")


def _refuse_pipelines(patches: Any) -> None:
    """Ranks of a pipeline-parallel job differ in memory; say so instead of tracing rank 0 as if
    it stood for all of them: building a stage refuses the job (``PIPELINE_REASON``)."""
    try:
        from torch.distributed.pipelining import stage
    except ImportError:  # torch < 2.4
        return
    base = getattr(stage, "_PipelineStageBase", None)
    if base is None:
        return

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        from xmem_admission.estimator.probe.outcomes import Refused

        raise Refused(PIPELINE_REASON)

    patches.set(base, "__init__", init)


class _AfterImport:
    """A ``sys.meta_path`` finder that, while armed, runs ``then(module)`` right after module
    ``name`` is executed, before any other code can take names from it; the module's own finder
    and loader do the finding and loading. One instance stays on ``sys.meta_path`` (inserted
    once, so a finder a library adds meanwhile is kept); a probe run arms it through its
    patches, and restoring them disarms it."""

    then: Optional[Callable[[Any], None]] = None  # armed when set

    def __init__(self, name: str) -> None:
        self.name, self._finding = name, False

    def arm(self, patches: Any, then: Callable[[Any], None]) -> None:
        import sys

        if self not in sys.meta_path:
            sys.meta_path.insert(0, self)
        patches.set(self, "then", then)

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        import importlib.util

        then = self.then
        if then is None or fullname != self.name or self._finding:
            return None
        self._finding = True
        try:
            spec = importlib.util.find_spec(fullname)
        finally:
            self._finding = False
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return None
        real_exec = loader.exec_module

        def exec_module(module: Any) -> None:
            real_exec(module)
            then(module)

        loader.exec_module = exec_module
        return spec


_DEEPSPEED_IMPORT = _AfterImport("deepspeed")


def _torch_version() -> str:
    import torch

    return str(torch.__version__)


def _release() -> Tuple[int, int]:
    """The running torch's (major, minor) release."""
    from xmem_admission.contract.torch_version import parse

    return parse(_torch_version()).release


def _loses_cpp_storages(tracker: Any) -> bool:
    """Fake mode with torch 2.3 (``_refuse_fake_on_2_3``)."""
    return bool(tracker.fake) and _release() == (2, 3)


def _refuse_fake_on_2_3(tracker: Any, what: str) -> None:
    """torch 2.3's fake mode loses storages that torch's C++ holds: DDP's reducer rebuilds its
    buckets after the first iteration and they are recorded freed in the backward pass while
    the reducer still holds them (tests/distributed/test_ddp_buckets.py with 2.3.1: no
    communication bytes left at the step's end; 2.2 and 2.4 keep them), and FSDP1's unsharded
    flat parameter is not seen freed (its own check "Expects storage to be freed" fails,
    test_fsdp1_sharding.py). An estimate without them is an under-estimate by the gradients'
    size, so such a job asks for real values: ``auto`` traces it in profile mode, which holds
    both (the same tests pass there)."""
    if _loses_cpp_storages(tracker):
        from xmem_admission.estimator.probe.virtual_cuda import NeedsRealValues

        raise NeedsRealValues(
            f"{what} cannot be traced in fake mode with torch {_torch_version()}: profile mode "
            f"traces them")


def _patch_fsdp1(patches: Any, tracker: Any) -> None:
    """FSDP1 with torch 2.3 in fake mode asks for real values (``_refuse_fake_on_2_3``)."""
    if not _loses_cpp_storages(tracker):
        return
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:
        return
    real_init = FullyShardedDataParallel.__init__

    def init(self: Any, *args: Any, **kwargs: Any) -> None:
        _refuse_fake_on_2_3(tracker, "FSDP's sharded and unsharded parameters")
        real_init(self, *args, **kwargs)

    patches.set(FullyShardedDataParallel, "__init__", init)


def _patch_ddp(patches: Any, world: FakeWorld, device_mode: Any) -> None:
    """DDP's reducer allocates its buckets in C++ with the parameters' tensor options and no
    tensor input (reducer.cpp, ``initialize_buckets``: ``at::empty({total_length}, options)``),
    which the tracker would take for host memory: its construction (``_ddp_init_helper``)
    and its pre-forward (where it
    rebuilds the buckets after the first iteration) run with floating-point factories on the
    virtual GPU (its bucket indices are integer host tensors: ``tracker.FLOATING_ON_GPU``)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    real_init_helper = DDP._ddp_init_helper
    real_pre_forward = DDP._pre_forward
    tracker = world.tracker

    def in_place_allreduce(_state: Any, bucket: Any) -> Any:
        """What the built-in allreduce hook does on a GPU, memory-wise: the bucket is divided
        and all-reduced in place (reducer.cpp, ``AllReduceCommHook::runHook``), so the
        future's tensor is the bucket itself."""
        import torch

        buffer = bucket.buffer()
        # Buckets are reduced in index order, and rebuilt after the first iteration
        # (reducer.cpp, ``rebuild_buckets``): the list holds the latest iteration's.
        if bucket.index() == 0:
            world.ddp_buckets.clear()
        world.ddp_buckets.append(buffer.numel() * buffer.element_size())
        world.record()
        if not any(tracker.is_cuda(p.grad) and _same_storage(p.grad, buffer)
                   for p in bucket.parameters() if p.grad is not None):
            tracker.tag(buffer, Category.COMMUNICATION)
        future: Any = torch.futures.Future()
        future.set_result(buffer)
        return future

    # DDP checks a hook's annotations against dist.GradBucket and Future (``_check_comm_hook``);
    # under ``from __future__ import annotations`` they are strings: it gets none.
    in_place_allreduce.__annotations__ = {}

    def init_helper(self: Any, *args: Any, **kwargs: Any) -> Any:
        _refuse_fake_on_2_3(tracker, "DDP's gradient buckets")
        with device_mode.on(FLOATING_ON_GPU):
            return real_init_helper(self, *args, **kwargs)

    real_register = DDP.register_comm_hook

    def register_comm_hook(self: Any, state: Any, hook: Any) -> Any:
        # 2.2-2.4 keep no Python-side list of the hooks (``_comm_hooks`` arrived later), and a
        # reducer takes one hook only: remember that the script registered its own.
        self._xmem_has_hook = True
        return real_register(self, state, hook)

    def pre_forward(self: Any, *inputs: Any, **kwargs: Any) -> Any:
        if not getattr(self, "_comm_hooks", None) and not getattr(self, "_xmem_has_hook", False):
            DDP.register_comm_hook(self, None, in_place_allreduce)
        with device_mode.on(FLOATING_ON_GPU):
            return real_pre_forward(self, *inputs, **kwargs)

    def compressed_allreduce(state: Any, bucket: Any) -> Any:
        """What the built-in FP16_COMPRESS hook does on a GPU, memory-wise (reducer's
        ``FP16CompressCommHook::runHook``, torch/csrc/distributed/c10d/default_comm_hooks.cpp):
        the bucket is copied to float16 (``buffer.to(kHalf)``), that copy is divided and
        all-reduced, and copied back into the bucket when the future completes; the copy lives
        from the hook until then."""
        import torch

        buffer = bucket.buffer()
        compressed = buffer.to(torch.float16)
        tracker.tag(compressed, Category.COMMUNICATION)
        future = in_place_allreduce(state, bucket)
        buffer.copy_(compressed)
        del compressed
        return future

    compressed_allreduce.__annotations__ = {}

    def register_builtin(self: Any, comm_hook_type: Any) -> Any:
        # A built-in hook runs in C++ on the fake group's empty future: a Python hook that
        # allocates what it allocates stands for it (ALLREDUCE: nothing; FP16_COMPRESS: a
        # float16 copy of the bucket).
        compress = getattr(comm_hook_type, "name", "") == "FP16_COMPRESS"
        DDP.register_comm_hook(self, None,
                               compressed_allreduce if compress else in_place_allreduce)

    patches.set(DDP, "register_comm_hook", register_comm_hook)
    patches.set(DDP, "_ddp_init_helper", init_helper)
    patches.set(DDP, "_pre_forward", pre_forward)
    patches.set(DDP, "_register_builtin_comm_hook", register_builtin)


def _patch_meshes(patches: Any, tracker: Any) -> None:
    """Device meshes live on the host; FSDP2 puts its state on the virtual GPU.

    A DTensor's device is its mesh's (C++ ``_dtensor__new__``), while its local shard really is
    a host tensor: a "cuda" mesh would make DTensors whose storage is on another device, which
    torch refuses. So every mesh is made a "cpu" mesh, and FSDP2 is told its device is the
    virtual GPU (fsdp/_fully_shard/_fully_shard.py takes it from ``_get_device_from_mesh``;
    its default mesh is on ``torch._C._get_accelerator()``, the host here): its sharded
    parameters, all-gather and reduce-scatter buffers are made with ``device=cuda:0``, which
    the virtual device records as GPU memory.
    """
    import torch

    try:
        from torch.distributed import device_mesh
        from torch.distributed.fsdp._fully_shard import _fsdp_init, _fully_shard
    except ImportError:  # torch < 2.4: no FSDP2
        return
    mesh_class = device_mesh.DeviceMesh
    real_init = mesh_class.__init__

    def init(self: Any, device_type: str, *args: Any, **kwargs: Any) -> None:
        real_init(self, "cpu" if device_type == "cuda" else device_type, *args, **kwargs)

    def device_from_mesh(_mesh: Any) -> Any:
        return torch.device("cuda", 0)

    patches.set(mesh_class, "__init__", init)
    _patch_dtensor_new(patches, tracker)
    if tracker.fake:
        _patch_fake_dispatch(patches, tracker)
        _patch_foreach_sharding(patches)
        _patch_shard_chunks(patches)
    patches.set(_fsdp_init, "_get_device_from_mesh", device_from_mesh)
    patches.set(_fully_shard, "_get_device_from_mesh", device_from_mesh)
    _patch_all_gather_copy_in(patches)


def _patch_all_gather_copy_in(patches: Any) -> None:
    """Up to 2.8 FSDP2's ``fsdp::all_gather_copy_in`` op makes the all-gather buffer inside its
    own kernel (``_fsdp_collectives.py``: ``torch.empty(..., device=device)`` in the op's CPU
    and CUDA implementation; from 2.9 the caller allocates it and passes it in). A kernel runs
    below the tracker, so with real host tensors (profile mode) that ``empty`` of the virtual
    GPU reached the CUDA runtime (2.6: "Found no NVIDIA driver"). The op's steps run at the
    script's level instead, where the buffer is made and recorded like any other: the buffer of
    ``world_size`` x the rank's input, this rank's slice of it, the inputs copied in."""
    import torch

    try:
        schema = torch.ops.fsdp.all_gather_copy_in.default._schema
    except (AttributeError, RuntimeError):  # not defined by this torch
        return
    if "device" not in [argument.name for argument in schema.arguments]:
        return  # 2.9+: the caller's buffer

    def all_gather_copy_in(inputs: Any, split_sizes: Any, input_numel: int, world_size: int,
                           rank: int, dtype: Any, device: Any, *_group: Any) -> Any:
        # 2.8 adds group_name and allocate_memory_from_process_group (the buffer from the
        # process group's own allocator when set, from the caching allocator otherwise:
        # _fsdp_collectives.py, allocate_memory); the fake group has no allocator of its own
        output = torch.empty((input_numel * world_size,), dtype=dtype, device=device)
        own = output.narrow(0, input_numel * rank, input_numel)
        with torch.no_grad():
            torch._foreach_copy_(list(torch.split(own, split_sizes)), list(inputs))
        return own, output

    patches.set(torch.ops.fsdp, "all_gather_copy_in", all_gather_copy_in)


def _patch_dtensor_new(patches: Any, tracker: Any) -> None:
    """Up to 2.7 DTensor's constructor is Python (``DTensor.__new__``: ``_make_wrapper_subclass``
    with ``device=local_tensor.device``), where a shard on the virtual GPU (fake or, in
    profile mode, a host tensor answered by ``DeviceMode``) would report ``cuda:0`` and make a
    "cuda" DTensor over host storage: FSDP2 then refuses the gradient ("attempting to assign a
    gradient with device type 'cuda' to a tensor with device type 'cpu'", 2.6). The constructor
    reads the real device, as the C++ one of later releases does."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:
        return
    real_new = DTensor.__dict__.get("__new__")
    if not isinstance(real_new, staticmethod):
        return
    patches.set(DTensor, "__new__", staticmethod(_seeing_real_devices(tracker, real_new.__func__)))


def _seeing_real_devices(tracker: Any, function: Callable[..., Any]) -> Callable[..., Any]:
    """``function`` run as torch's own code inside a dispatch: fake tensors report their real
    device to it (the tracker's ``dispatch_depth``)."""

    def call(*args: Any, **kwargs: Any) -> Any:
        tracker.dispatch_depth += 1
        try:
            return function(*args, **kwargs)
        finally:
            tracker.dispatch_depth -= 1

    return call


def _patch_fake_dispatch(patches: Any, tracker: Any) -> None:
    """DTensor runs its ops on the local shards in C++ (its dispatch fast path), below the
    tracker: fake mode then computes the shard's output device from the device fake tensors
    report to the script, the virtual GPU, and torch refuses a "cuda" tensor over host storage.
    Inside fake mode's own dispatch, torch's code sees the real device (the tracker's
    ``dispatch_depth``, as in ``torch_patches._patch_fake_tensor_device``)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    patches.set(FakeTensorMode, "__torch_dispatch__",
                _seeing_real_devices(tracker, FakeTensorMode.__torch_dispatch__))


def _patch_fsdp1_device_id(patches: Any) -> None:
    """FSDP1's initialisation makes devices from integers (fsdp/_init_utils.py:
    ``torch.device(device_id)`` for ``device_id=torch.cuda.current_device()``, and
    ``torch.device(device_handle.current_device())``). From 2.6 an integer alone asks the C++
    accelerator registry for the device type, which fails without a driver ("Cannot access
    accelerator device when none is available"); on the virtual GPU an integer names a CUDA
    device. That module alone sees a ``torch`` whose ``device`` reads integers so."""
    import types

    import torch

    try:
        from torch.distributed.fsdp import _init_utils
    except ImportError:
        return
    real_device = torch.device

    class _DeviceMeta(type):
        def __instancecheck__(cls, obj: Any) -> bool:
            return isinstance(obj, real_device)

        def __call__(cls, *args: Any, **kwargs: Any) -> Any:
            if len(args) == 1 and not kwargs and isinstance(args[0], int) \
                    and not isinstance(args[0], bool):
                return real_device("cuda", args[0])
            return real_device(*args, **kwargs)

    class device(metaclass=_DeviceMeta):  # noqa: N801 - stands for torch.device
        pass

    class _Torch(types.ModuleType):
        def __getattr__(self, name: str) -> Any:
            return getattr(torch, name)

    view = _Torch("torch")
    view.device = device  # type: ignore[attr-defined]
    patches.set(_init_utils, "torch", view)


def _patch_fake_collectives(patches: Any) -> None:
    """torch 2.3 and 2.4's fake mode has no kernel for the c10d collectives (``c10d.broadcast_``
    from DDP's ``_sync_module_states``, ``c10d.allreduce_`` from FSDP1's gradient reduction):
    it raises ``UnsupportedOperatorException`` where 2.2 and 2.5+ run them. On the fake process
    group a collective moves no data, so it runs on host stand-ins of its tensors (uninitialised,
    so untouched pages cost nothing) and hands back the script's own tensors: what a collective
    allocates on a GPU (DDP's coalesced broadcast buffers) is not traced on those releases."""
    import torch
    from torch._subclasses.fake_tensor import FakeTensorMode, UnsupportedOperatorException
    from torch.utils._python_dispatch import _disable_current_modes
    from torch.utils._pytree import tree_map

    current = FakeTensorMode.__torch_dispatch__

    def dispatch(self: Any, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        try:
            return current(self, func, types, args, kwargs)
        except UnsupportedOperatorException:
            if getattr(func, "namespace", "") != "c10d":
                raise
        originals: Dict[int, Any] = {}

        def stand_in(value: Any) -> Any:
            if not isinstance(value, torch.Tensor):
                return value
            # uninitialised host memory: pages the fake group never touches are never mapped in
            empty = torch.empty(tuple(value.shape), dtype=value.dtype)
            originals[id(empty)] = value
            return empty

        with _disable_current_modes():
            out = func(*tree_map(stand_in, tuple(args)), **tree_map(stand_in, dict(kwargs or {})))
        return tree_map(lambda v: originals.get(id(v), v) if isinstance(v, torch.Tensor) else v,
                        out)

    patches.set(FakeTensorMode, "__torch_dispatch__", dispatch)


def _patch_foreach_sharding(patches: Any) -> None:
    """DTensor works out the sharding of a foreach op (the optimizer's, over every parameter)
    child by child, and for each child scans every input spec of the whole op for
    ``_StridedShard`` placements (``_sharding_prop.py``, ``_propagate_use_strided_shard_flag``,
    called per child of a ``TupleStrategy``): quadratic in the number of parameters, 17 of the
    34 profiled seconds DTensor spent on the first optimizer step of a 7B model's 291 parameters
    (bench/coverage/distributed.py --speed). The scan's answer depends only on the op's input specs, so it
    is made once per op here; with no ``_StridedShard`` input (FSDP2's ``Shard(0)``) the function
    does nothing, as before, and otherwise the real function runs."""
    try:
        from torch.distributed.tensor import _sharding_prop
        from torch.distributed.tensor.placement_types import _StridedShard
    except ImportError:  # torch without DTensor
        return
    real = getattr(_sharding_prop, "_propagate_use_strided_shard_flag", None)
    if real is None:
        return
    last: List[Any] = [None, True]  # the op schema scanned last, and whether it has any

    def propagate_flag(op_strategy: Any, op_schema: Any) -> None:
        if op_schema is not last[0]:
            last[0] = op_schema
            last[1] = any(isinstance(p, _StridedShard)
                          for spec in op_schema.args_spec for p in spec.placements)
        if last[1]:
            real(op_strategy, op_schema)

    patches.set(_sharding_prop, "_propagate_use_strided_shard_flag", propagate_flag)
    _patch_foreach_dedupe(patches, _sharding_prop, _StridedShard)


_FOREACH_PREFIXES = ("aten::_foreach_", "aten::_amp_foreach_", "aten::_fused_")


def _first_of_each(keys: List[Any]) -> Optional[Tuple[List[int], List[int]]]:
    """For each position, the index among the distinct keys (in first-seen order) of its key,
    and the position where each distinct key is first seen; None when every key is distinct
    (nothing to share)."""
    seen: Dict[Any, int] = {}
    firsts: List[int] = []
    where = []
    for position, key in enumerate(keys):
        if key not in seen:
            seen[key] = len(firsts)
            firsts.append(position)
        where.append(seen[key])
    return None if len(firsts) == len(keys) else (where, firsts)


def _patch_foreach_dedupe(patches: Any, sharding_prop: Any, strided_shard: type) -> None:
    """The first step of an optimizer over DTensors propagates the sharding of each foreach op
    element by element (``single_dim_strategy._expand_single_dim_strategy_to_mesh``: a schema, a
    strategy expansion and a cost search per parameter) and runs the op once over fake copies of
    every parameter for its output shapes (``_propagate_tensor_meta_non_cached``); later steps hit
    DTensor's cache. A transformer's parameters repeat per block (a 7B model's 291 have 9
    distinct shapes), and an element's answer depends only on its own specs (input placements,
    shape, stride, dtype, and its output's metadata; a ``TupleStrategy`` child sees nothing of
    the other children, ``_translate_list_op_schema``), so each distinct element is worked out
    once and shared: 6 of the 8 seconds DTensor's first optimizer step took for rank 0 of a
    64-way FSDP2 7B job (bench/coverage/distributed.py --speed). Elements are told apart by the whole
    ``DTensorSpec`` (mesh, placements, tensor metadata) and, for the output shapes, by every
    per-element argument's value; ``_StridedShard`` inputs, tensor lists among keyword
    arguments, or all elements distinct run the real functions unchanged."""
    try:
        from torch.distributed.tensor._dtensor_spec import DTensorSpec
        from torch.distributed.tensor._op_schema import OpSchema, OpStrategy, TupleStrategy
    except ImportError:
        return
    real_expand = getattr(sharding_prop, "_expand_single_dim_strategy_to_mesh", None)
    propagator = getattr(sharding_prop, "ShardingPropagator", None)
    real_meta = getattr(propagator, "_propagate_tensor_meta_non_cached", None)
    if real_expand is None or real_meta is None:
        return

    def is_foreach(op_schema: Any) -> bool:
        return bool(op_schema.op.name().startswith(_FOREACH_PREFIXES))

    def strided(spec: Any) -> bool:
        return any(isinstance(p, strided_shard) for p in spec.placements)

    def child_key(child: Any) -> Any:
        if not isinstance(child, OpStrategy):
            return object()  # unknown: never shared
        specs = tuple(s.output_spec for s in child.strategies)
        return object() if any(strided(spec) for spec in specs) else specs

    def expand(mesh: Any, op_schema: Any, info: Any, out_meta: Any) -> Any:
        lists = [i for i, a in enumerate(op_schema.args_schema) if isinstance(a, TupleStrategy)]
        if (not lists or not is_foreach(op_schema)
                or any(isinstance(v, TupleStrategy) for v in op_schema.kwargs_schema.values())):
            return real_expand(mesh, op_schema, info, out_meta)
        count = len(op_schema.args_schema[lists[0]].children)
        if any(len(op_schema.args_schema[i].children) != count for i in lists):
            return real_expand(mesh, op_schema, info, out_meta)
        keys = [tuple(child_key(op_schema.args_schema[i].children[n]) for i in lists)
                + ((out_meta[n],) if out_meta is not None else ()) for n in range(count)]
        shared = _first_of_each(keys)
        if shared is None:
            return real_expand(mesh, op_schema, info, out_meta)
        where, picks = shared
        args = tuple(TupleStrategy([a.children[n] for n in picks])
                     if isinstance(a, TupleStrategy) else a for a in op_schema.args_schema)
        distinct = OpSchema(op_schema.op, args, op_schema.kwargs_schema,
                            schema_info=op_schema.schema_info)
        distinct_meta = (None if out_meta is None
                         else type(out_meta)(out_meta[n] for n in picks))
        expanded = real_expand(mesh, distinct, info, distinct_meta)

        def strategy(op: Any, _args_meta: Any, _kwargs_meta: Any) -> Any:
            result = expanded(op, distinct.args_meta, distinct.kwargs_meta)
            return TupleStrategy([result.children[w] for w in where])

        return strategy

    def element_key(value: Any, n: int, count: int) -> Any:
        if isinstance(value, (list, tuple)) and len(value) == count:
            item = value[n]
            if isinstance(item, DTensorSpec):
                return object() if strided(item) else item
            return (type(item), item) if isinstance(item, (bool, int, float)) else object()
        return None

    def tensor_meta(self: Any, op_schema: Any) -> Any:
        lists = [a for a in op_schema.args_schema
                 if isinstance(a, (list, tuple)) and a and isinstance(a[0], DTensorSpec)]
        if not lists or not is_foreach(op_schema):
            return real_meta(self, op_schema)
        count = len(lists[0])
        if any(isinstance(v, (list, tuple)) for v in op_schema.kwargs_schema.values()):
            return real_meta(self, op_schema)
        keys = [tuple(element_key(a, n, count) for a in op_schema.args_schema)
                for n in range(count)]
        shared = _first_of_each(keys)
        if shared is None:
            return real_meta(self, op_schema)
        where, index = shared
        args = tuple(type(a)(a[n] for n in index)
                     if isinstance(a, (list, tuple)) and len(a) == count else a
                     for a in op_schema.args_schema)
        metas = real_meta(self, OpSchema(op_schema.op, args, op_schema.kwargs_schema,
                                         schema_info=op_schema.schema_info))
        if metas is None:  # an in-place foreach op: no outputs
            return None
        if not isinstance(metas, (list, tuple)) or len(metas) != len(index):
            return real_meta(self, op_schema)  # not one output per element: no sharing
        return type(metas)(metas[w] for w in where)

    patches.set(sharding_prop, "_expand_single_dim_strategy_to_mesh", expand)
    patches.set(propagator, "_propagate_tensor_meta_non_cached", tensor_meta)


class _ShardChunks:
    """``torch.chunk(tensor, n, dim)`` padded with empty tensors to ``n`` (FSDP2's
    ``_fsdp_common._chunk_with_empty``), made on demand: FSDP2 reads rank ``r``'s chunk and the
    0th, but the list holds all ``n`` views, and on fake tensors each costs what a real op
    costs (64 views per parameter for a 64-way job: 24 of its 51 extra seconds over the
    single-process 7B trace, bench/coverage/distributed.py --speed). Views make no memory; the ones
    FSDP2 uses are the same views of the same storage."""

    def __init__(self, tensor: Any, num_chunks: int, dim: int) -> None:
        self._tensor, self._n, self._dim = tensor, num_chunks, dim
        size = tensor.size(dim)
        # torch.chunk: chunks of ceil(size / n) along dim, the last one shorter, fewer than n
        # when size is not enough for n (ATen's chunk: split_size = ceil(size / chunks)).
        self._step = -(-size // num_chunks)
        self._size = size
        self._made: Dict[int, Any] = {}

    def __len__(self) -> int:
        return self._n

    def __getitem__(self, index: int) -> Any:
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._n))]
        i = index + self._n if index < 0 else index
        if not 0 <= i < self._n:
            raise IndexError(index)
        if i not in self._made:
            start = i * self._step
            if start < self._size:
                self._made[i] = self._tensor.narrow(self._dim, start,
                                                    min(self._step, self._size - start))
            else:
                self._made[i] = self[0].new_empty(0)
        return self._made[i]

    def __iter__(self) -> Any:
        return (self[i] for i in range(self._n))


def _patch_shard_chunks(patches: Any) -> None:
    """FSDP2 shards each parameter by ``_chunk_with_empty``: on demand here (``_ShardChunks``)."""
    try:
        from torch.distributed.fsdp._fully_shard import _fsdp_param
    except ImportError:  # torch < 2.4: no FSDP2
        return
    real = getattr(_fsdp_param, "_chunk_with_empty", None)
    if real is None:
        return

    def chunk_with_empty(tensor: Any, num_chunks: int, dim: int) -> Any:
        if tensor.dim() == 0 or tensor.size(dim) == 0 or num_chunks <= 1:
            return real(tensor, num_chunks, dim)
        return _ShardChunks(tensor, num_chunks, dim)

    patches.set(_fsdp_param, "_chunk_with_empty", chunk_with_empty)


def _same_storage(a: Any, b: Any) -> bool:
    try:
        return bool(a.untyped_storage() is b.untyped_storage())
    except (RuntimeError, NotImplementedError):
        return False
