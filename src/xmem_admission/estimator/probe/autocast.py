"""CUDA autocast's casting policy, applied by the probe on CPU tensors.

Without a GPU ``torch.autocast("cuda")`` does nothing to CPU tensors, and CPU autocast has other
op lists (under CPU bf16 autocast ``softmax`` returns bf16; CUDA autocast runs it in fp32: it is
in ``AT_FORALL_FP32_SET_OPT_DTYPE`` of ``aten/src/ATen/autocast_mode.h``). What a CUDA run allocates depends on CUDA's lists, so the
probe applies them itself, at the torch-function level (above autograd, where the real autocast
casts too, so the casts are recorded by autograd and their memory is what a GPU run holds).

The lists follow ``aten/src/ATen/autocast_mode.cpp`` (``AT_FORALL_LOWER_PRECISION_FP``,
``AT_FORALL_FP32``, ``AT_FORALL_FP32_SET_OPT_DTYPE``, ``AT_FORALL_PROMOTE``, the CUDA
registrations ``TORCH_LIBRARY_IMPL(aten, AutocastCUDA, m)``), mapped to the Python entry points
that reach those ATen ops. Like the real cast cache (``autocast_mode.cpp``, ``cached_cast``),
casts of leaf tensors that require grad (the weights) are cached until the outermost autocast
region exits.

An op on no CUDA list passes through autocast (``TORCH_LIBRARY_IMPL(_, Autocast, m)``, a
fallthrough) and a composite one meets the lists again in the ops it calls. That is invisible at
the torch-function level for a composite reached through one Python function, so those are
decomposed here as ATen decomposes them, each inner op under the policy (``COMPOSITES``).
"""

from __future__ import annotations

from typing import Any, Callable, Dict, Iterator, Optional, Tuple

import torch
import torch.nn.functional as F
from torch.nn import _reduction
from torch.utils.weak import WeakIdKeyDictionary

from xmem_admission.estimator.probe.tracker import is_fake

LOWER = "lower"      # run in the autocast dtype (fp16/bf16)
FP32 = "fp32"        # run in float32
FP32_OPT = "fp32_opt_dtype"  # output float32 through the op's dtype argument
PROMOTE = "promote"  # run in the widest input dtype


def _entries() -> Dict[Callable[..., Any], str]:
    table: Dict[Callable[..., Any], str] = {}

    def add(policy: str, *names: str) -> None:
        for dotted in names:
            obj: Any = torch
            root, _, rest = dotted.partition(".")
            obj = {"torch": torch, "F": F, "Tensor": torch.Tensor}[root]
            for part in rest.split("."):
                obj = getattr(obj, part, None)
                if obj is None:
                    break
            if obj is not None:
                table[obj] = policy

    # AT_FORALL_LOWER_PRECISION_FP (autocast_mode.h)
    add(LOWER, "F.linear", "torch.matmul", "Tensor.matmul", "Tensor.__matmul__",
        "Tensor.__rmatmul__", "torch.mm", "Tensor.mm", "torch.bmm", "Tensor.bmm", "torch.addmm",
        "Tensor.addmm", "torch.baddbmm", "Tensor.baddbmm", "torch.addbmm", "torch.einsum",
        "torch.mv", "torch.addmv", "torch.addr", "torch.chain_matmul", "torch.linalg.multi_dot",
        "torch.linalg.vecdot", "F.conv1d", "F.conv2d", "F.conv3d", "F.conv_transpose1d",
        "F.conv_transpose2d", "F.conv_transpose3d", "F.prelu", "torch.conv1d", "torch.conv2d",
        "torch.conv3d", "F.scaled_dot_product_attention")
    # AT_FORALL_FP32 (autocast_mode.h)
    add(FP32, "torch.acos", "torch.asin", "torch.cosh", "torch.erfinv", "torch.exp",
        "Tensor.exp", "torch.expm1", "torch.log", "Tensor.log", "torch.log10", "torch.log2",
        "torch.log1p", "torch.reciprocal", "torch.rsqrt", "Tensor.rsqrt", "torch.sinh",
        "torch.tan", "torch.pow", "Tensor.pow", "Tensor.__pow__", "F.softplus", "F.layer_norm",
        "torch.layer_norm", "F.group_norm", "torch.group_norm", "torch.norm", "Tensor.norm",
        "F.cosine_similarity", "F.poisson_nll_loss", "F.cosine_embedding_loss", "F.nll_loss",
        "F.hinge_embedding_loss", "F.kl_div", "F.l1_loss", "F.smooth_l1_loss", "F.huber_loss",
        "F.mse_loss", "F.margin_ranking_loss", "F.multilabel_margin_loss",
        "F.soft_margin_loss", "F.triplet_margin_loss", "F.multi_margin_loss",
        "F.binary_cross_entropy_with_logits", "torch.dist", "torch.pdist", "torch.cdist",
        "torch.renorm", "torch.logsumexp", "Tensor.logsumexp", "F.rms_norm")
    # F.cross_entropy is on no list: see _cross_entropy (COMPOSITE)
    # AT_FORALL_FP32_SET_OPT_DTYPE (autocast_mode.h)
    add(FP32_OPT, "F.softmax", "torch.softmax", "Tensor.softmax", "F.log_softmax",
        "torch.log_softmax", "Tensor.log_softmax", "torch.cumsum", "Tensor.cumsum",
        "torch.cumprod", "Tensor.cumprod", "torch.prod", "Tensor.prod", "torch.sum",
        "Tensor.sum", "torch.linalg.vector_norm", "torch.linalg.matrix_norm")
    # AT_FORALL_PROMOTE (autocast_mode.h)
    add(PROMOTE, "torch.addcdiv", "Tensor.addcdiv", "torch.addcmul", "Tensor.addcmul",
        "torch.atan2", "F.bilinear", "torch.cross", "torch.dot", "torch.vdot",
        "F.grid_sample", "torch.index_put", "torch.tensordot", "torch.scatter_add")
    return table


POLICY: Dict[Callable[..., Any], str] = _entries()
_FLOAT_TYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


class CudaAutocastState:
    """Whether emulated CUDA autocast is on, its dtype, and the weight-cast cache."""

    def __init__(self) -> None:
        self.enabled = False
        self.dtype = torch.float16  # CUDA autocast's default dtype (autocast_mode.py)
        self.cache_enabled = True
        self.depth = 0
        self._cache = WeakIdKeyDictionary()

    def clear_cache(self) -> None:
        self._cache = WeakIdKeyDictionary()

    def call(self, func: Callable[..., Any], args: Tuple[Any, ...],
             kwargs: Dict[str, Any]) -> Any:
        """Run ``func`` as it runs under CUDA autocast: decomposed, cast, or untouched."""
        composite = COMPOSITES.get(func)
        if composite is not None:
            return composite(self, *args, **kwargs)
        if func in _HALF_TO_FLOAT:
            out = _half_to_float(func, args, kwargs)
            if out is not None:
                return out
        cast = self.cast_args(func, args, kwargs)
        if cast is not None:
            args, kwargs = cast
        return func(*args, **kwargs)

    def run(self, func: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """``call`` with the arguments spelled out (the inner ops of a decomposition)."""
        return self.call(func, args, kwargs)

    def cast_args(self, func: Callable[..., Any], args: Tuple[Any, ...],
                  kwargs: Dict[str, Any]) -> Optional[Tuple[Tuple[Any, ...], Dict[str, Any]]]:
        """Return (args, kwargs) cast as CUDA autocast would for ``func``, or None if untouched."""
        policy = POLICY.get(func)
        if policy is None:
            return None
        if policy == LOWER:
            target: Optional[torch.dtype] = self.dtype
        elif policy == FP32:
            target = torch.float32
        elif policy == FP32_OPT:
            if "dtype" in kwargs and kwargs["dtype"] is not None:
                return None
            if not any(_is_lower(a) for a in args if isinstance(a, torch.Tensor)):
                return None
            return args, dict(kwargs, dtype=torch.float32)
        else:
            dtypes = [a.dtype for a in _tensors(args, kwargs) if a.dtype in _FLOAT_TYPES]
            if not dtypes:
                return None
            target = max(dtypes, key=lambda d: torch.finfo(d).bits)
        # The CUDA wrapper casts in one call, ``(*F)(cached_cast(to_type, args, device_type)...)``
        # (autocast_mode.h, WrapFunction_): C++ leaves the order of argument evaluation open and
        # GCC, which builds the Linux wheels, evaluates right to left. An H200 (bench/data/H200,
        # gpt-834m-bf16-b8-adamw-expandable) cast each linear's weight before its input.
        cast_kwargs = {k: self._cast(kwargs[k], target) for k in reversed(list(kwargs))}
        return self._cast_all(args, target), {k: cast_kwargs[k] for k in kwargs}

    def _cast_all(self, args: Tuple[Any, ...], dtype: torch.dtype) -> Tuple[Any, ...]:
        return tuple(reversed([self._cast(a, dtype) for a in reversed(args)]))

    def _cast(self, value: Any, dtype: torch.dtype) -> Any:
        if isinstance(value, (list, tuple)):
            return type(value)(self._cast(v, dtype) for v in value)
        if not isinstance(value, torch.Tensor) or value.dtype == dtype:
            return value
        if not value.is_floating_point() or value.dtype == torch.float64:
            # autocast casts only fp16/bf16/fp32 tensors (autocast_mode.h, is_eligible)
            return value
        cacheable = self.cache_enabled and value.is_leaf and value.requires_grad
        if cacheable:
            hit = self._cache.get(value)
            if hit is not None and hit.dtype == dtype:
                return hit
        out = value.to(dtype)
        if cacheable:
            self._cache[value] = out
        return out


def _is_lower(t: torch.Tensor) -> bool:
    return t.dtype in (torch.float16, torch.bfloat16)


def _tensors(args: Tuple[Any, ...], kwargs: Dict[str, Any]) -> Iterator[torch.Tensor]:
    for a in list(args) + list(kwargs.values()):
        if isinstance(a, torch.Tensor):
            yield a
        elif isinstance(a, (list, tuple)):
            for b in a:
                if isinstance(b, torch.Tensor):
                    yield b


def _cross_entropy(state: CudaAutocastState, input: torch.Tensor, target: torch.Tensor,
                   weight: Optional[torch.Tensor] = None, size_average: Optional[bool] = None,
                   ignore_index: int = -100, reduce: Optional[bool] = None,
                   reduction: str = "mean", label_smoothing: float = 0.0) -> torch.Tensor:
    """``F.cross_entropy`` as CUDA autocast runs it: ``cross_entropy_loss`` decomposed.

    ``cross_entropy_loss`` is on no CUDA autocast list (``autocast_mode.cpp`` registers it for
    ``AutocastCPU`` only, as fp32), so it runs as ``cross_entropy_loss_symint`` of
    ``aten/src/ATen/native/LossNLL.cpp`` writes it, and autocast meets its inner ops. Its
    log-softmax passes the input's own dtype (``at::log_softmax(self, class_dim,
    self.scalar_type())``), which the fp32_set_opt_dtype policy respects (``set_opt_dtype`` in
    ``autocast_mode.h``: an explicit dtype is kept): under bf16 autocast the log-probabilities
    are bf16, the size of the logits in bf16 rather than fp32. ``nll_loss`` (``AT_FORALL_FP32``)
    then casts them to fp32, a copy its backward keeps (``nll_loss_forward`` saves ``self`` in
    ``derivatives.yaml``). Measured on the H200 (torch 2.11, bench/data/H200, GPT 134M bf16 b8):
    per step two fp32 and four bf16 logits-sized blocks, which is what this decomposition makes.
    """
    if size_average is not None or reduce is not None:
        reduction = _reduction.legacy_get_string(size_average, reduce)
    class_dim = 0 if input.dim() == 1 else 1
    log_probs = state.run(torch.log_softmax, input, class_dim, dtype=input.dtype)
    if input.shape == target.shape:  # class probabilities (cross_entropy_loss_prob_target)
        return _cross_entropy_soft(state, log_probs, target, weight, reduction, label_smoothing,
                                   class_dim)
    nll = state.run(F.nll_loss, log_probs, target, weight, ignore_index=ignore_index,
                    reduction=reduction)
    if label_smoothing <= 0.0:
        return nll
    # cross_entropy_loss_label_smoothing (LossNLL.cpp)
    n_classes = log_probs.shape[class_dim]
    if weight is not None:
        smooth = -state.run(torch.sum, log_probs * _along(weight, log_probs.dim(), class_dim),
                            class_dim)
    else:
        smooth = -state.run(torch.sum, log_probs, class_dim)
    ignored = target == ignore_index
    smooth.masked_fill_(ignored, 0.0)
    if reduction == "mean":
        if weight is not None:
            total = state.run(torch.sum, weight.gather(0, target.masked_select(~ignored)
                                                       .flatten()))
        else:
            total = (~ignored).sum()
        smoothed = state.run(torch.sum, smooth) / total
    elif reduction == "sum":
        smoothed = state.run(torch.sum, smooth)
    else:
        smoothed = smooth
    return (1 - label_smoothing) * nll + smoothed * (label_smoothing / n_classes)


def _cross_entropy_soft(state: CudaAutocastState, log_probs: torch.Tensor, target: torch.Tensor,
                        weight: Optional[torch.Tensor], reduction: str, label_smoothing: float,
                        class_dim: int) -> torch.Tensor:
    """``cross_entropy_loss_prob_target`` (LossNLL.cpp), its reductions under the policy."""
    n_classes = log_probs.shape[class_dim]
    if label_smoothing > 0.0:
        target = target * (1 - label_smoothing) + label_smoothing / n_classes
    product = log_probs * target
    if weight is not None:
        product = product * _along(weight, log_probs.dim(), class_dim)
    if reduction == "mean":
        return -state.run(torch.sum, product) / (log_probs.numel() / n_classes)
    if reduction == "sum":
        return -state.run(torch.sum, product)
    return -state.run(torch.sum, product, class_dim)


def _along(weight: torch.Tensor, dims: int, class_dim: int) -> torch.Tensor:
    """A per-class weight viewed to broadcast along ``class_dim`` of a ``dims``-d tensor."""
    if dims <= 1:
        return weight
    shape = [1] * dims
    shape[class_dim] = weight.shape[0]
    return weight.view(shape)


COMPOSITES: Dict[Callable[..., Any], Callable[..., Any]] = {F.cross_entropy: _cross_entropy}

# softmax and log_softmax of fp16 asked for fp32 (what fp32_set_opt_dtype asks) run on CUDA as
# one kernel that reads fp16 and writes fp32: ``softmax`` / ``log_softmax`` of
# aten/src/ATen/native/SoftMax.cpp take ``_softmax(input, dim, half_to_float=true)`` when
# ``input_.is_cuda() && input_.scalar_type() == ScalarType::Half && dtype == ScalarType::Float``
# (Half only: bf16 takes the other branch, ``input_.toType(dtype)`` then ``_softmax``). No fp32
# copy of the input, and the backward (``_softmax_backward_data`` with ``input_dtype`` Half, its
# meta function) hands back fp16 directly, where the CPU path makes an fp32 gradient and a cast.
_HALF_TO_FLOAT: Dict[Callable[..., Any], Tuple[Callable[..., Any], Tuple[str, ...]]] = {
    F.softmax: (torch._softmax, ("input", "dim", "_stacklevel", "dtype")),
    torch.softmax: (torch._softmax, ("input", "dim", "dtype")),
    torch.Tensor.softmax: (torch._softmax, ("input", "dim", "dtype")),
    F.log_softmax: (torch._log_softmax, ("input", "dim", "_stacklevel", "dtype")),
    torch.log_softmax: (torch._log_softmax, ("input", "dim", "dtype")),
    torch.Tensor.log_softmax: (torch._log_softmax, ("input", "dim", "dtype")),
}


def _half_to_float(func: Callable[..., Any], args: Tuple[Any, ...],
                   kwargs: Dict[str, Any]) -> Optional[torch.Tensor]:
    """CUDA's half-to-float softmax for an fp16 input under autocast, or None where it is not.

    Only for fake tensors: the CPU kernels refuse half_to_float ("softmax with half to float
    conversion is not supported on CPU"), so a profile-mode run keeps the cast path.
    """
    kernel, names = _HALF_TO_FLOAT[func]
    bound = dict(zip(names, args))
    bound.update(kwargs)
    x, dim = bound.get("input", bound.get("self")), bound.get("dim")
    if (not isinstance(x, torch.Tensor) or x.dtype != torch.float16 or not is_fake(x)
            or bound.get("dtype") is not None or not isinstance(dim, int)):
        return None
    out: torch.Tensor = kernel(x, dim, True)
    return out
