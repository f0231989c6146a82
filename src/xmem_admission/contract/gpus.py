"""The catalogue of GPU models: capacity, memory outside the allocator, cuBLAS workspace, MIG.

Plain data and the standard library only, because both sides of the house read it: the estimator
(probe bundle, copied into users' images, Python >= 3.9) needs capacities and workspace sizes, and
the cluster side (policy, MIG backend) needs capacities and MIG slices. Every figure carries the
place it comes from; where only a nominal vendor figure exists, the source says so.

Capacities are what ``torch.cuda.get_device_properties(i).total_memory`` reports, because that is
the ceiling the caching allocator runs into. Three are exact measurements from the xMem paper's
public artifact (repository ``Stone-ResearchLife/xMem``, ``plot/data/``: the ``total_memory`` each
run recorded, the accuracy yardstick's ``gpu_total_bytes``); most others are torch's own
figures found in public sources: ``_CudaDeviceProperties`` reprs (whole MiB, rounded down),
deviceQuery output (bytes), or OOM messages ("GPU 0 has a total capacity of X GiB", 0.01 GiB,
read as the lowest value that rounds to X). The figure also moves a little with the driver, so
where several were found the smallest is kept: the catalogue should not promise memory a card
lacks. The exceptions (an NVML total, a nominal datasheet figure) say so in their source. MIG slice
sizes are the ``nvidia-smi mig -lgip`` figures (GiB, two decimals) read from below, or nominal.

Names are matched case-insensitively, with spaces, dashes and underscores treated alike and a
leading "NVIDIA", "GeForce" or "Tesla" ignored, so short names (``A100-40GB``), CUDA device names
(``NVIDIA A100-SXM4-40GB``) and GPU Feature Discovery labels (``NVIDIA-A100-SXM4-40GB``) all work.
An ambiguous short name (``a100``, ``v100``) means the smaller-memory variant: an estimate that
fits the smaller card fits the larger one, never the other way round.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Tuple

from xmem_admission.contract import overhead
from xmem_admission.contract.errors import UnknownGPUError

GiB = 1 << 30
MiB = 1 << 20

RUNS_JSONL = ("measured: xMem paper artifact (Stone-ResearchLife/xMem plot/data/), the runs'"
              " total_memory (the yardstick's gpu_total_bytes)")


def _reported_gib(value: float) -> int:
    """Lowest byte count that a two-decimal GiB display (OOM message, ``mig -lgip``) rounds to.

    Reading the rounded figure from below keeps every capacity on the safe side: the catalogue may
    understate a card by up to 0.005 GiB (about 5 MiB), never overstate it.
    """
    return int((value - 0.005) * GiB)


def _nominal_gb(value: float) -> int:
    """A datasheet "N GB" read as N * 10**9 bytes, the reading furthest below the real card.

    Usually an understatement (HBM cards report N GiB minus a little), but ECC GDDR cards can
    report less than N * 10**9: a nominal figure is a placeholder until measured.
    """
    return int(value * 10**9)


@dataclass(frozen=True)
class MigProfile:
    """One MIG GPU-instance profile of a GPU model, as the NVIDIA device plugin exposes it."""

    name: str  # nominal name, as in the resource name: "3g.40gb"
    memory_bytes: int  # real slice memory (a bit less than the name says), see memory_source
    max_instances: int  # how many of this profile fit on one GPU
    memory_source: str = ""

    @property
    def resource_name(self) -> str:
        """The extended resource a pod requests under the device plugin's mixed strategy."""
        return f"nvidia.com/mig-{self.name}"

    @property
    def compute_slices(self) -> int:
        """The "Ng" part of the name: used to prefer 1g.20gb over 2g.20gb at equal memory."""
        return int(self.name.split("g.", 1)[0])


@dataclass(frozen=True)
class GPU:
    """One GPU model as the estimator and the cluster side need to know it."""

    key: str
    cuda_name: str
    aliases: Tuple[str, ...]
    capacity_bytes: int
    capacity_source: str
    compute_capability: Tuple[int, int]
    multi_processor_count: int
    cublas_workspace_bytes: int
    cublas_workspace_source: str
    cublaslt_workspace_bytes: int
    cublaslt_workspace_source: str
    mig_profiles: Tuple[MigProfile, ...]
    hardware_source: str  # where compute capability and SM count come from

    @property
    def overhead_bytes(self) -> int:
        """Memory a process holds outside the caching allocator, for uses that have no trace (the
        cluster side's OOM retries): ``contract.overhead``'s figures for a job whose CUDA is not
        known and that calls cuDNN; estimates use the job's own (``overhead.for_gpu``)."""
        return overhead.for_gpu(self.key).total_bytes

    @property
    def context_bytes(self) -> int:
        return overhead.for_gpu(self.key).context.bytes

    @property
    def runtime_overhead_bytes(self) -> int:
        return overhead.for_gpu(self.key).runtime_bytes

    @property
    def overhead_source(self) -> str:
        figures = overhead.for_gpu(self.key)
        return "; ".join(f"{name} ({f.basis.value}): {f.source}" for name, f in (
            ("context", figures.context), ("runtime", figures.runtime), ("cuDNN", figures.cudnn)))


# --- Figures shared by every model -------------------------------------------------------------

# aten/src/ATen/cuda/CublasHandlePool.cpp, parseChosenWorkspaceSize(): default ":4096:2:16:8",
# i.e. 4096 KiB * 2 + 16 KiB * 8 per (handle, stream), allocated through the caching allocator.
CUBLAS_WORKSPACE_DEFAULT = 4096 * 1024 * 2 + 16 * 1024 * 8
# Same function: 4096 * 8 * 1024 = 32 MiB when properties->major == 9 (Hopper).
CUBLAS_WORKSPACE_32MIB = 4096 * 8 * 1024
_CUBLAS_SRC = "pytorch aten/src/ATen/cuda/CublasHandlePool.cpp parseChosenWorkspaceSize()"
CUBLAS_DEFAULT_SOURCE = f"{_CUBLAS_SRC}: default :4096:2:16:8 = 4096*1024*2 + 16*1024*8 bytes"
CUBLAS_HOPPER_SOURCE = f"{_CUBLAS_SRC}: 4096*8*1024 (32 MiB) for compute capability 9.x"
CUBLAS_BLACKWELL_SOURCE = (
    f"{_CUBLAS_SRC}: 32 MiB for major 9, 10 and 12 since pytorch PR 175344 (merged 2026-02; the"
    " revert PR 182669 was closed unmerged); releases before it use 4096*1024*2 + 16*1024*8"
)
# Same file, parseCUDABlasLtWorkspaceSize(): 1024 KiB default (CUBLASLT_WORKSPACE_SIZE), capped at
# the cuBLAS workspace; getCUDABlasLtWorkspace() allocates it separately per (handle, stream)
# through the caching allocator unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1.
CUBLASLT_WORKSPACE = 1024 * 1024
CUBLASLT_SOURCE = (
    "pytorch aten/src/ATen/cuda/CublasHandlePool.cpp parseCUDABlasLtWorkspaceSize(): 1024 KiB"
    " default, separate from the cuBLAS workspace unless TORCH_CUBLASLT_UNIFIED_WORKSPACE=1"
)

_CUDA_CC = "compute capability: NVIDIA CUDA GPUs list (developer.nvidia.com/cuda-gpus)"


def _cublas(cc: Tuple[int, int]) -> Tuple[int, str]:
    """Default cuBLAS workspace per (handle, stream) for a compute capability, with its source."""
    if cc[0] == 9:
        return CUBLAS_WORKSPACE_32MIB, CUBLAS_HOPPER_SOURCE
    if cc[0] in (10, 12):
        return CUBLAS_WORKSPACE_32MIB, CUBLAS_BLACKWELL_SOURCE
    return CUBLAS_WORKSPACE_DEFAULT, CUBLAS_DEFAULT_SOURCE


def _gpu(
    key: str,
    cuda_name: str,
    aliases: Tuple[str, ...],
    capacity_bytes: int,
    capacity_source: str,
    cc: Tuple[int, int],
    sms: int,
    hardware_source: str,
    mig: Tuple[MigProfile, ...] = (),
) -> GPU:
    """Build a catalogue entry; the figures shared by all models are filled in here.

    A slice can never give a process more than the whole card does, yet `mig -lgip` lists the
    full 7g slice a little above the card's non-MIG ``total_memory`` (H100: 79.25 GiB against
    79.11): such a slice is capped at the card's capacity, and its source says so.
    """
    workspace, workspace_source = _cublas(cc)
    mig = tuple(
        dataclasses.replace(
            p,
            memory_bytes=capacity_bytes,
            memory_source=p.memory_source + "; capped at the whole GPU's capacity_bytes",
        )
        if p.memory_bytes > capacity_bytes
        else p
        for p in mig
    )
    return GPU(
        key=key,
        cuda_name=cuda_name,
        aliases=aliases,
        capacity_bytes=capacity_bytes,
        capacity_source=capacity_source,
        compute_capability=cc,
        multi_processor_count=sms,
        cublas_workspace_bytes=workspace,
        cublas_workspace_source=workspace_source,
        cublaslt_workspace_bytes=CUBLASLT_WORKSPACE,
        cublaslt_workspace_source=CUBLASLT_SOURCE,
        mig_profiles=mig,
        hardware_source=hardware_source,
    )


def _oom(url: str, gib: float) -> str:
    """Source string for a capacity read from a public PyTorch OOM message."""
    return f"PyTorch OOM message 'total capacity of {gib:.2f} GiB' in {url}, read from below"


def _mig_lgip(url: str) -> str:
    return f"nvidia-smi mig -lgip output (GiB, read from below) in {url}"


def _mig_nominal(doc: str) -> str:
    return f"nominal: profile name read as decimal GB (lgip figure not found); profile list: {doc}"


MIG_DOC = "NVIDIA MIG user guide 'Supported MIG Profiles'"

# --- MIG profile tables ------------------------------------------------------------------------
# Profile names and instance counts: NVIDIA's MIG user guide, "Supported MIG Profiles".
# Memory: the driver's `nvidia-smi mig -lgip` figures where a public listing was found.

_H100_LGIP = _mig_lgip("jbarrow.ai/field_notes/nvidia-mig (H100 80GB)")
_H100_MIG = (
    MigProfile("1g.10gb", _reported_gib(9.75), 7, _H100_LGIP),
    MigProfile("1g.20gb", _reported_gib(19.62), 4, _H100_LGIP),
    MigProfile("2g.20gb", _reported_gib(19.62), 3, _H100_LGIP),
    MigProfile("3g.40gb", _reported_gib(39.50), 2, _H100_LGIP),
    MigProfile("4g.40gb", _reported_gib(39.50), 1, _H100_LGIP),
    MigProfile("7g.80gb", _reported_gib(79.25), 1, _H100_LGIP),
)

# A100 80GB: lgip transcript (driver 515.86.01) in a public MIG walkthrough found by code search;
# it predates 1g.20gb, which has the same memory fraction as 2g.20gb (2/8, MIG user guide table).
_A100_80_LGIP = _mig_lgip("an A100 80GB transcript (driver 515.86.01) found by GitHub code search")
_A100_80_MIG = (
    MigProfile("1g.10gb", _reported_gib(9.50), 7, _A100_80_LGIP),
    MigProfile("1g.20gb", _reported_gib(19.50), 4,
               _A100_80_LGIP + "; 1g.20gb taken from 2g.20gb, same 2/8 memory fraction"),
    MigProfile("2g.20gb", _reported_gib(19.50), 3, _A100_80_LGIP),
    MigProfile("3g.40gb", _reported_gib(39.25), 2, _A100_80_LGIP),
    MigProfile("4g.40gb", _reported_gib(39.25), 1, _A100_80_LGIP),
    MigProfile("7g.80gb", _reported_gib(79.00), 1, _A100_80_LGIP),
)

# A100 40GB: the A100-SXM4-40GB example of the MIG user guide's "Getting Started" section, as
# quoted in public notes (other drivers list up to 19.62 and 39.50 GiB: the smaller is kept).
_A100_40_LGIP = _mig_lgip("NVIDIA MIG user guide 'List GPU Instance Profiles' example (A100 40GB)")
_A100_40_MIG = (
    MigProfile("1g.5gb", _reported_gib(4.75), 7, _A100_40_LGIP),
    MigProfile("1g.10gb", _reported_gib(9.62), 4, _A100_40_LGIP),
    MigProfile("2g.10gb", _reported_gib(9.62), 3, _A100_40_LGIP),
    MigProfile("3g.20gb", _reported_gib(19.50), 2, _A100_40_LGIP),
    MigProfile("4g.20gb", _reported_gib(19.50), 1, _A100_40_LGIP),
    MigProfile("7g.40gb", _reported_gib(39.25), 1, _A100_40_LGIP),
)

# A30: the smallest of the lgip transcripts found by code search (5.75/11.62/23.37 GiB; others
# show 5.81/11.69/23.50).
_A30_LGIP = _mig_lgip("A30 transcripts found by GitHub code search, smallest figures")
_A30_MIG = (
    MigProfile("1g.6gb", _reported_gib(5.75), 4, _A30_LGIP),
    MigProfile("2g.12gb", _reported_gib(11.62), 2, _A30_LGIP),
    MigProfile("4g.24gb", _reported_gib(23.37), 1, _A30_LGIP),
)

# H100 NVL: OpenNebula's documentation ("H100 94GB") lists 10.62/21.50/46.12/92.62 GiB; NVIDIA's
# gpu-operator PR 903 lists 10.75/21.62/46.38 with another driver: the smaller are kept.
_NVL_LGIP = _mig_lgip("OpenNebula NVIDIA vGPU/MIG documentation (H100 94GB); cf. NVIDIA/gpu-operator"
                      " PR 903")
_H100_NVL_MIG = (
    MigProfile("1g.12gb", _reported_gib(10.62), 7, _NVL_LGIP),
    MigProfile("1g.24gb", _reported_gib(21.50), 4, _NVL_LGIP),
    MigProfile("2g.24gb", _reported_gib(21.50), 3, _NVL_LGIP),
    MigProfile("3g.47gb", _reported_gib(46.12), 2, _NVL_LGIP),
    MigProfile("4g.47gb", _reported_gib(46.12), 1, _NVL_LGIP),
    MigProfile("7g.94gb", _reported_gib(92.62), 1, _NVL_LGIP),
)

_H200_LGIP = _mig_lgip("github.com/NVIDIA/mig-parted/issues/120 (H200)")
_H200_MIG = (
    MigProfile("1g.18gb", _reported_gib(16.00), 7, _H200_LGIP),
    MigProfile("1g.35gb", _reported_gib(32.25), 4, _H200_LGIP),
    MigProfile("2g.35gb", _reported_gib(32.25), 3, _H200_LGIP),
    MigProfile("3g.71gb", _reported_gib(69.50), 2, _H200_LGIP),
    MigProfile("4g.71gb", _reported_gib(69.50), 1, _H200_LGIP),
    MigProfile("7g.141gb", _reported_gib(139.75), 1, _H200_LGIP),
)

# B200: mig-parted PR 187 (2025-03) lists 1g.23gb at 20.50 GiB, smaller than the 22.00 GiB of
# PR 166 two months earlier (driver change); the smaller one is kept.
_B200_LGIP = _mig_lgip("github.com/NVIDIA/mig-parted/pull/187 (B200)")
_B200_NOM = _mig_nominal(MIG_DOC + " (B200 180GB)")
_B200_MIG = (
    MigProfile("1g.23gb", _reported_gib(20.50), 7, _B200_LGIP),
    MigProfile("1g.45gb", _reported_gib(44.25), 4, _B200_LGIP),
    MigProfile("2g.45gb", _reported_gib(44.25), 3, _B200_LGIP),
    MigProfile("3g.90gb", _nominal_gb(90), 2, _B200_NOM),
    MigProfile("4g.90gb", _nominal_gb(90), 1, _B200_NOM),
    MigProfile("7g.180gb", _nominal_gb(180), 1, _B200_NOM),
)

# --- The catalogue -----------------------------------------------------------------------------
# SM counts: torch's own device repr where one was found, else CUDA cores from NVIDIA's datasheets
# or architecture whitepapers divided by the cores per SM of the architecture (Volta, Turing,
# GA100: 64; GA10x, Ada, Hopper: 128), or the SM column of the full 7g profile in `mig -lgip`.


def _repr(mib: int, name: str) -> str:
    """Source string for a capacity read from a public ``_CudaDeviceProperties`` repr.

    torch prints ``total_memory // 2**20`` as "NNNMB", so NNN MiB is a lower bound within 1 MiB.
    """
    return (
        f"torch repr _CudaDeviceProperties(name='{name}', ..., total_memory={mib}MB) in public"
        " GitHub sources (code search), the smallest such figure found"
    )


_CATALOGUE: Tuple[GPU, ...] = (
    _gpu(
        "RTX-3060", "NVIDIA GeForce RTX 3060", ("RTX3060", "RTX-3060-12GB"),
        12_622_168_064, RUNS_JSONL + " (62 rows)",
        (8, 6), 28, _CUDA_CC + "; 3584 CUDA cores / 128 per GA10x SM (NVIDIA RTX 3060 spec page)",
    ),
    _gpu(
        "RTX-4060", "NVIDIA GeForce RTX 4060", ("RTX4060", "RTX-4060-8GB"),
        8_318_222_336, RUNS_JSONL + " (23 rows)",
        (8, 9), 24, _CUDA_CC + "; 3072 CUDA cores / 128 per Ada SM (NVIDIA RTX 4060 spec page)",
    ),
    _gpu(
        "RTX-3090", "NVIDIA GeForce RTX 3090", ("RTX3090",),
        24_259 * MiB, _repr(24_259, "NVIDIA GeForce RTX 3090") + " (another shows 24575MB)",
        (8, 6), 82, _CUDA_CC + "; multi_processor_count=82 in the same repr",
    ),
    _gpu(
        "RTX-4090", "NVIDIA GeForce RTX 4090", ("RTX4090",),
        _reported_gib(23.64), _oom("github.com/3DTopia/Phidias-Diffusion/issues/8", 23.64),
        (8, 9), 128, _CUDA_CC + "; 16384 CUDA cores / 128 per Ada SM (NVIDIA Ada whitepaper)",
    ),
    _gpu(
        "A10", "NVIDIA A10", ("A10-24GB",),
        23_609_475_072,
        "deviceQuery 'Total amount of global memory: 23609475072 bytes' for NVIDIA A10 in"
        " github.com/aalanwyr/face2cuda step2cuda/README.md",
        (8, 6), 72, _CUDA_CC + "; 9216 CUDA cores / 128 per GA10x SM (NVIDIA A10 datasheet)",
    ),
    _gpu(
        "A10G", "NVIDIA A10G", ("A10G-24GB",),
        22_587 * MiB, _repr(22_587, "NVIDIA A10G"),
        (8, 6), 80, _CUDA_CC + "; multi_processor_count=80 in the same repr",
    ),
    _gpu(
        "T4", "Tesla T4", ("T4-16GB",),
        _reported_gib(14.56),
        _oom("github.com/Zheng-Chong/CatVTON/issues/133 (GCP Tesla T4)", 14.56)
        + "; older drivers report more (torch repr total_memory=15079MB to 15109MB)",
        (7, 5), 40, _CUDA_CC + "; multi_processor_count=40 in torch reprs of Tesla T4",
    ),
    _gpu(
        "L4", "NVIDIA L4", ("L4-24GB",),
        _nominal_gb(24),
        "nominal: 24 GB GDDR6, NVIDIA L4 datasheet, read as 10**9 bytes; no measurement found, and"
        " ECC GDDR6 cards report less than nominal (A10: 23,609,475,072 bytes), so measure it",
        (8, 9), 58, _CUDA_CC + "; 7424 CUDA cores / 128 per Ada SM (NVIDIA L4 datasheet)",
    ),
    _gpu(
        "L40S", "NVIDIA L40S", ("L40S-48GB",),
        _reported_gib(44.42),
        _oom("github.com/stepfun-ai/Step-Video-T2V/issues/8 (8x L40S)", 44.42)
        + "; a torch repr elsewhere shows total_memory=45589MB",
        (8, 9), 142, _CUDA_CC + "; multi_processor_count=142 in a torch repr of NVIDIA L40S",
    ),
    _gpu(
        "V100-16GB", "Tesla V100-SXM2-16GB", ("V100", "V100-PCIE-16GB", "V100-SXM2-16GB"),
        16_130 * MiB, _repr(16_130, "Tesla V100-SXM2-16GB") + " (others show 16160MB)",
        (7, 0), 80, _CUDA_CC + "; multi_processor_count=80 in the same repr",
    ),
    _gpu(
        "V100-32GB", "Tesla V100-SXM2-32GB", ("V100-PCIE-32GB", "V100S-PCIE-32GB"),
        32_510 * MiB, _repr(32_510, "Tesla V100-PCIE-32GB"),
        (7, 0), 80, _CUDA_CC + "; multi_processor_count=80 in the same repr",
    ),
    _gpu(
        "A30", "NVIDIA A30", ("A30-24GB",),
        _reported_gib(23.53), _oom("github.com/google/RB-Modulation/issues/5 (A30)", 23.53),
        (8, 0), 56, _CUDA_CC + "; 3584 CUDA cores / 64 per GA100 SM (NVIDIA A30 datasheet)",
        _A30_MIG,
    ),
    _gpu(
        "A100-40GB", "NVIDIA A100-SXM4-40GB",
        ("A100", "A100-SXM4-40GB", "A100-PCIE-40GB", "A100-40G"),
        42_474_471_424,
        RUNS_JSONL + " (9 rows, A100-SXM4-40GB); other drivers report 42,298,834,944 bytes"
        " (deviceQuery in github.com/bottlerocket-os/bottlerocket/pull/3873)",
        (8, 0), 108, _CUDA_CC + "; 108 SMs, NVIDIA A100 Tensor Core GPU architecture whitepaper",
        _A100_40_MIG,
    ),
    _gpu(
        "A100-80GB", "NVIDIA A100-SXM4-80GB", ("A100-SXM4-80GB", "A100-80GB-PCIE", "A100-80G"),
        _reported_gib(79.14), _oom("github.com/lianqi1008/Control-GIC/issues/6 (A100 80GB)", 79.14),
        (8, 0), 108, _CUDA_CC + "; 108 SMs, NVIDIA A100 Tensor Core GPU architecture whitepaper",
        _A100_80_MIG,
    ),
    _gpu(
        "H100-80GB", "NVIDIA H100 80GB HBM3", ("H100", "H100-SXM", "H100-SXM5-80GB"),
        _reported_gib(79.11), _oom("github.com/vllm-project/vllm/issues/27508 (H100)", 79.11),
        (9, 0), 132, _CUDA_CC + "; 132 SMs: SM column of 7g.80gb in `mig -lgip` (" + _H100_LGIP + ")",
        _H100_MIG,
    ),
    _gpu(
        "H100-PCIE", "NVIDIA H100 PCIe", ("H100-PCIE-80GB",),
        81_008 * MiB, _repr(81_008, "NVIDIA H100 PCIe"),
        (9, 0), 114, _CUDA_CC + "; multi_processor_count=114 in the same repr",
        _H100_MIG,
    ),
    _gpu(
        "H100-NVL", "NVIDIA H100 NVL", ("H100-NVL-94GB", "H100-94GB"),
        99_961_274_368,
        "NVML/DRM dedicated total 99,961,274,368 bytes for NVIDIA H100 NVL in"
        " github.com/fastfetch-cli/fastfetch/issues/1658; NVML totals run a few hundred MiB above"
        " torch total_memory (H100: nvidia-smi 81,559 MiB vs 79.11 GiB), so this may overstate"
        " slightly until measured",
        (9, 0), 132, _CUDA_CC + "; coreCount 16896 / 128 per Hopper SM in the same report",
        _H100_NVL_MIG,
    ),
    _gpu(
        "H200", "NVIDIA H200", ("H200-SXM", "H200-141GB", "H200-NVL"),
        143_156 * MiB,
        _repr(143_156, "NVIDIA H200") + "; nvidia-smi shows 143,771 MiB"
        ", the allocator sees the repr's figure",
        (9, 0), 132, _CUDA_CC + "; multi_processor_count=132 in the same repr",
        _H200_MIG,
    ),
    _gpu(
        "B200", "NVIDIA B200", ("B200-180GB",),
        182_631 * MiB, _repr(182_631, "NVIDIA B200") + " (another shows 182642MB)",
        (10, 0), 148, "major=10, minor=0, multi_processor_count=148 in the same repr (compute"
        " capability 10.0 also in NVIDIA MIG user guide 'Supported GPUs')",
        _B200_MIG,
    ),
)


def _normalise(name: str) -> str:
    """Canonical form for matching: lower case, one dash between words, no vendor prefix."""
    text = re.sub(r"[\s_\-]+", "-", name.strip().lower()).strip("-")
    for prefix in ("nvidia-", "geforce-", "tesla-"):
        if text.startswith(prefix):
            text = text[len(prefix):]
    return text


def _build_index(gpus: Tuple[GPU, ...]) -> Dict[str, GPU]:
    """Map every accepted name to its GPU; two models claiming one name is a catalogue bug."""
    index: Dict[str, GPU] = {}
    for gpu in gpus:
        for name in (gpu.key, gpu.cuda_name) + gpu.aliases:
            norm = _normalise(name)
            owner = index.get(norm)
            if owner is not None and owner is not gpu:
                raise AssertionError(f"GPU name {name!r} claimed by {owner.key} and {gpu.key}")
            index[norm] = gpu
    return index


_INDEX = _build_index(_CATALOGUE)


def all_gpus() -> List[GPU]:
    """Every GPU model in the catalogue, in catalogue order (consumer cards first)."""
    return list(_CATALOGUE)


def lookup(name: str) -> GPU:
    """Find a GPU by short name, alias, CUDA device name or GFD product label (any case).

    Raises ``UnknownGPUError`` naming the choices (and the nearest ones) when nothing matches.
    """
    gpu = _INDEX.get(_normalise(name))
    if gpu is not None:
        return gpu
    keys = [g.key for g in _CATALOGUE]
    near = difflib.get_close_matches(_normalise(name), [_normalise(k) for k in keys], n=3)
    hint = ""
    if near:
        hint = " (did you mean " + ", ".join(_INDEX[n].key for n in near) + "?)"
    raise UnknownGPUError(
        f"unknown GPU {name!r}{hint}; known GPUs: {', '.join(keys)}"
        " (CUDA device names such as 'NVIDIA A100-SXM4-40GB' are accepted too)"
    )


def smallest_mig_profile(gpu: GPU, request_bytes: int) -> Optional[MigProfile]:
    """The MIG profile with the least memory that still holds ``request_bytes``.

    At equal memory the profile with fewer compute slices wins (1g.20gb before 2g.20gb): it leaves
    more of the GPU to others. ``None`` when the model has no MIG or no slice is large enough.
    """
    if request_bytes < 0:
        raise ValueError(f"request_bytes must be >= 0, got {request_bytes}")
    fitting = [p for p in gpu.mig_profiles if p.memory_bytes >= request_bytes]
    if not fitting:
        return None
    return min(fitting, key=lambda p: (p.memory_bytes, p.compute_slices))
