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
  convolution's tensors (pytorch issue 31500: a 48 GiB request for a 2 GiB fp16 input; issue
  49207: "the first layer uses 36GB workspace" on a 40 GB GPU).
- ``CUDNN_CONV_WSCAP_DBG`` caps the convolution workspace cuDNN may use, in MiB (PyTorch docs,
  "CUDA Environment Variables", cuda_environment_variables.rst: like CUBLAS_WORKSPACE_CONFIG,
  "the workspace configuration for cuDNN per allocation"; cuDNN then offers only engines within
  the cap).

What cuDNN's heuristics pick is not documented per shape, so the size is a rule per GPU
architecture with few parameters: a fraction of the bytes the convolution touches (the larger of
its input and output, or input + output + weight), one fraction per kind of call (the fitted
rule uses one for all three), fitted on measured jobs and scored on jobs it was not fitted on
(``bench/README.md``, "cuDNN convolution workspaces").
Architectures without a fitted rule get none (no workspace is modelled there).

Standard library only (probe bundle and cluster side both read the contract).
"""

from __future__ import annotations

import enum
import os
from dataclasses import dataclass
from typing import Dict, Mapping, Optional, Tuple

MiB = 1024 * 1024
# The phase of a convolution workspace's allocation in a simulated stream: an allocation the
# simulator may fail without an OOM (the next plan runs, Conv_v8.cpp ``try_plans``).
TRANSIENT_PREFIX = "cudnn:"
# The phase of the block that stands for ``ConvWorkspaceRule.resident_bytes``.
RESIDENT_PHASE = "cudnn-resident"


class ConvCall(str, enum.Enum):
    """The three cuDNN convolution calls a training step makes."""

    FORWARD = "fwd"
    BACKWARD_DATA = "bwd_data"
    BACKWARD_FILTER = "bwd_filter"


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


# Ampere GA100 (compute capability 8.0: A100 40GB and 80GB): fitted by bench/fit_conv_workspace.py
# on a 110-row stratified sample of GPUMemNet's A100-SXM4-40GB rows (94 CNN, 16 MLP for the
# floor; `xmem bench gpumemnet --sample 110`), the grid's best rule on all of them; scored
# leave-one-out there (bench/README.md, "cuDNN convolution workspaces"). One fraction for every
# call: the earlier rule with a forward and a backward fraction (0.2 and 1.5, 512 MiB) scored
# worse on rows it was not fitted on (leave-one-out p90 22.7% against 19.0%, 26% of rows under
# against 16%) because the left-out fits jumped between distant pairs. 1.5 x (input + output +
# weight) is a fit, not a documented size (more than one copy of every operand, as a layout
# transform would take). Not fitted on the xMem paper's rows: none of its CNN rows ran on a
# compute capability 8.0 GPU.
_GA100_SOURCE = ("fitted on 110 GPUMemNet A100-SXM4-40GB rows (bench/fit_conv_workspace.py; "
                 "bench/README.md, cuDNN convolution workspaces)")
RULES: Dict[Tuple[int, int], ConvWorkspaceRule] = {
    (8, 0): ConvWorkspaceRule({ConvCall.FORWARD: 1.5, ConvCall.BACKWARD_DATA: 1.5,
                               ConvCall.BACKWARD_FILTER: 1.5}, 576 * MiB, _GA100_SOURCE,
                              ConvBasis.SUM),
}


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
