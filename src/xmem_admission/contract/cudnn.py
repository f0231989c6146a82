"""cuDNN convolution workspaces: how much a convolution asks the caching allocator for.

What PyTorch does (documented behaviour, the sources named on each line):

- Each cuDNN convolution (forward, gradient of the input, gradient of the weight) takes a
  workspace from the caching allocator inside the call and gives it back when the call returns
  (aten/src/ATen/native/cudnn/Conv_v8.cpp, ``run_conv_plan``: ``c10::cuda::CUDACachingAllocator::
  get()->allocate(workspace_size)``, a ``DataPtr`` freed at the end of the scope). Freed, it stays
  in the allocator's cache: reserved, and what ``nvidia-smi`` counts.
- With ``torch.backends.cudnn.benchmark`` off (the default), the engine configurations come in
  the order cuDNN's heuristics rank them, and PyTorch tries them in that order, taking the first
  whose workspace it can allocate (Conv_v8.cpp, ``try_plans``: an out-of-memory on the
  workspace moves on to the next plan; pytorch issue 49207: "PyTorch will try all algorithms in
  the order returned by cuDNN heuristics and will pick up the first algorithm that does not
  fail"). So a workspace that does not fit is never an OOM: a plan with a smaller one runs
  instead, down to implicit-GEMM engines that need none (pytorch issue 31500, ngimel: the
  implicit GEMM algorithm "is supported for all cases" and needs no workspace).
- The heuristics' first choice can ask for a workspace several times the size of the
  convolution's tensors (pytorch issue 31500: a 48 GiB request for a 2 GiB fp16 input; pytorch
  issue 49207: "the first layer uses 36GB workspace" on a 40 GB GPU).
- ``CUDNN_CONV_WSCAP_DBG`` caps the convolution workspace cuDNN may use, in MiB (PyTorch docs,
  "CUDA Environment Variables", cuda_environment_variables.rst: like CUBLAS_WORKSPACE_CONFIG,
  "the workspace configuration for cuDNN per allocation"; cuDNN then offers only engines within
  the cap).

What cuDNN's heuristics pick is not documented per shape, so the size is a rule per GPU
architecture with few parameters: a fraction of the bytes the convolution touches (the larger of
its input and output, or input + output + weight), one fraction per kind of call (the fitted
rule uses one for all three), fitted on measured jobs and scored on jobs it was not fitted on
(``bench/fits/README.md``, "cuDNN convolution workspaces").
Architectures without a fitted rule get none (no workspace is modelled there).

Standard library only (probe bundle and cluster side both read the contract).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Dict, List, Mapping, Optional, Sequence, Tuple

MiB = 1024 * 1024
# The phase of a convolution workspace's allocation in a simulated stream: an allocation the
# simulator may fail without an OOM (the next plan runs, Conv_v8.cpp ``try_plans``).
TRANSIENT_PREFIX = "cudnn:"
# The phase of the block that stands for ``ConvWorkspaceRule.resident_bytes``.
RESIDENT_PHASE = "cudnn-resident"
# Where cuDNN's heuristics gave a call's plans, its workspace allocation carries every workspace
# PyTorch tries, in order: phase "cudnn:fwd plans=W1,W2,...,0", the allocation's size W1. The
# simulator replays ``try_plans`` (Conv_v8.cpp): when W1 does not fit it tries W2, and so on;
# a 0 is a plan that needs no workspace (it always runs); none left is torch's "GET was unable
# to find an engine to execute this computation", a failed job.
PLANS_FIELD = " plans="
# The phase of the block ``cudnn.benchmark``'s search holds while it times the plans
# (Conv_v8.cpp ``generate_and_filter_plans``), with the plans' workspaces as its fall-through.
SEARCH_PREFIX = TRANSIENT_PREFIX + "benchmark-"


class ConvCall(str, enum.Enum):
    """The three cuDNN convolution calls a training step makes."""

    FORWARD = "fwd"
    BACKWARD_DATA = "bwd_data"
    BACKWARD_FILTER = "bwd_filter"


class WorkspaceSource(str, enum.Enum):
    """What sized the convolution workspaces of an estimate."""

    HEURISTICS = "cudnn-heuristics"  # cuDNN's own plans, deviceless, for the target GPU
    FITTED_RULE = "fitted-rule"  # ``RULES``: where no cuDNN here can plan without a GPU
    NONE = "none"  # no convolution, or neither: no workspace modelled


class ConvBasis(str, enum.Enum):
    """What a call's workspace is a fraction of."""

    LARGEST = "largest"  # the larger of the call's input and output (their gradients in backward)
    SUM = "sum"  # input + output + weight: a layout transform of every operand (NCHW to NHWC)


@dataclass(frozen=True)
class ConvWorkspaceRule:
    """Workspace = fraction[call] x the call's ``basis`` bytes; and
    ``resident_bytes`` that a process holds from its first cuDNN convolution on (the cuDNN
    handle and the kernels CUDA's lazy loading brings in on first use: outside the caching
    allocator, modelled as one block so that it takes capacity and counts in the total)."""

    fraction: Dict[ConvCall, float]
    resident_bytes: int
    source: str
    basis: ConvBasis = ConvBasis.LARGEST


# Ampere GA100 (compute capability 8.0: A100 40GB and 80GB): fitted by bench/fits/fit_conv_workspace.py
# on a 110-row stratified sample of GPUMemNet's A100-SXM4-40GB rows (94 CNN, 16 MLP for the
# floor; `xmem bench gpumemnet --sample 110`), the grid's best rule on all of them; scored
# leave-one-out there (bench/fits/README.md, "cuDNN convolution workspaces"). One fraction for every
# call: the earlier rule with a forward and a backward fraction (0.2 and 1.5, 512 MiB) scored
# worse on rows it was not fitted on (leave-one-out p90 22.7% against 19.0%, 26% of rows under
# against 16%) because the left-out fits jumped between distant pairs. 1.5 x (input + output +
# weight) is a fit, not a documented size (more than one copy of every operand, as a layout
# transform would take). Not fitted on the xMem paper's rows: none of its CNN rows ran on a
# compute capability 8.0 GPU.
_GA100_SOURCE = ("fitted on 110 GPUMemNet A100-SXM4-40GB rows (bench/fits/fit_conv_workspace.py; "
                 "bench/fits/README.md, cuDNN convolution workspaces)")
RULES: Dict[Tuple[int, int], ConvWorkspaceRule] = {
    (8, 0): ConvWorkspaceRule({ConvCall.FORWARD: 1.5, ConvCall.BACKWARD_DATA: 1.5,
                               ConvCall.BACKWARD_FILTER: 1.5}, 576 * MiB, _GA100_SOURCE,
                              ConvBasis.SUM),
}


# What a process holds outside the caching allocator from its first cuDNN convolution on (the
# handle, the kernels CUDA's lazy loading brings in) when cuDNN's heuristics size the
# workspaces: no published figure, so FITTED on measured jobs of that architecture by
# bench/fits/fit_conv_resident.py (the median of measured minus simulated over the CNN rows, floor
# already in), scored leave-one-out (bench/convolution/README.md, "cuDNN's heuristics in the estimate").
# Architectures without a fit get none: their runtime overhead (the catalogue) carries it.
HEURISTICS_RESIDENT: Dict[Tuple[int, int], Tuple[int, str]] = {
    # FITTED, not documented: 512 MiB on GPUMemNet's 110-row A100-SXM4-40GB sample (57 CNN rows
    # that ran; every left-out fit chose 512 too); leave-one-out CNN median 7.62%, p90 19.81%,
    # 12.3% under, no OOM row predicted to fit (bench/convolution/README.md, "cuDNN's heuristics in the
    # estimate"). cuDNN 9.24.0 planned the workspaces; the runs' own cuDNN was not recorded.
    (8, 0): (512 * MiB, "fitted on 110 GPUMemNet A100-SXM4-40GB rows with cuDNN 9.24.0's "
                        "workspaces (bench/fits/fit_conv_resident.py; bench/convolution/README.md)"),
}


def heuristics_resident_bytes(compute_capability: Tuple[int, int]) -> Tuple[int, str]:
    """(bytes, source) held from the first cuDNN convolution on, with cuDNN's own workspaces."""
    return HEURISTICS_RESIDENT.get(tuple(compute_capability),  # type: ignore[arg-type]
                                   (0, "no fitted figure for this architecture"))


def tried_workspaces(workspaces: Sequence[int]) -> List[int]:
    """The workspaces of ``workspaces`` (the plans in the order PyTorch tries them) that can
    matter: each one smaller than every one before it, up to the first 0. A plan whose workspace
    is not smaller than one that did not fit does not fit either."""
    kept: List[int] = []
    for size in workspaces:
        if not kept or size < kept[-1]:
            kept.append(int(size))
        if size == 0:
            break
    return kept


def plans_phase(name: str, workspaces: Sequence[int]) -> str:
    """The phase of a workspace allocation that falls through ``workspaces`` in order."""
    return f"{name}{PLANS_FIELD}{','.join(str(int(w)) for w in workspaces)}"


def later_plans(phase: str) -> Optional[List[int]]:
    """The workspaces tried after the first when it does not fit; None for a phase without
    plans (a fitted rule's workspace, whose next plan is taken to need none)."""
    _, found, sizes = phase.partition(PLANS_FIELD)
    return [int(s) for s in sizes.split(",")[1:]] if found else None


def rule_for(compute_capability: Tuple[int, int]) -> Optional[ConvWorkspaceRule]:
    return RULES.get(tuple(compute_capability))  # type: ignore[arg-type]


def workspace_cap_bytes(env: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """``CUDNN_CONV_WSCAP_DBG`` in bytes (MiB in the variable), None when unset or malformed."""
    env = os.environ if env is None else env
    value = env.get("CUDNN_CONV_WSCAP_DBG", "").strip()
    return int(value) * MiB if value.isdigit() else None


def workspace_bytes(rule: ConvWorkspaceRule, call: ConvCall, input_bytes: int,
                    output_bytes: int, weight_bytes: int,
                    cap_bytes: Optional[int] = None) -> int:
    basis = (max(input_bytes, output_bytes) if rule.basis is ConvBasis.LARGEST
             else input_bytes + output_bytes + weight_bytes)
    size = int(rule.fraction.get(call, 0.0) * basis)
    return size if cap_bytes is None else min(size, cap_bytes)
