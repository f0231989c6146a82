"""What cuDNN needs to know of each catalogue GPU to plan a convolution without the GPU.

cuDNN 9.11 and newer build execution plans "deviceless": instead of asking the CUDA driver, its
heuristics read a device description (``CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR``, set from JSON). The
fields are those of CUDA's ``cudaDeviceProp`` that a kernel's launch depends on: compute
capability, SM count, thread, register and shared-memory limits, L2 size, clocks, memory.

Two kinds of figure, each with its source:

- Limits of the architecture (one row per compute capability): NVIDIA's CUDA C++ Programming
  Guide, "Technical Specifications per Compute Capability" (Table 31 of the guide's appendix
  "Compute Capabilities", docs.nvidia.com/cuda/cuda-programming-guide/05-appendices/
  compute-capabilities.html; numbered Table 21/23 in older editions) and the per-architecture
  sections of the same appendix for shared-memory carve-outs and the 1 KB per block reserved
  for the system from compute capability 8.0 on.
- Figures of the product (SM count, L2 size, boost clock, memory bandwidth and bus width): the
  product's datasheet or the architecture whitepaper, named on each entry. The SM count is
  written down here from those documents on its own so that a test can hold it against the
  catalogue's ``multi_processor_count`` (which came from torch's device reprs); likewise the
  compute capability.

What moves cuDNN's answers: trying the heuristics of cuDNN 9.24 on an A100 description with one
field changed at a time (clocks halved, L2 cut to 6 MiB, SMs halved, opt-in shared memory cut to
99 KB, memory cut to 8 GiB) left the ranked workspaces of a 256-channel 3x3 convolution unchanged;
the compute capability changed them. The clocks are nominal figures for that reason, not
measurements: the driver reports the boost clock in ``clockRate`` and half the memory data rate
in ``memoryClockRate``, and that is what is written here.

``pci_device_id`` stays ``None`` (serialised as 0, as XLA's conversion from its own device
description does, openxla/xla ``BuildDeviceProperties``): no public source was checked for the
product ids here, and the heuristics do not need it.

Standard library only (the contract is part of the probe bundle).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, Optional, Protocol, Tuple

KiB = 1024  # the guide's "KB" is 1024 bytes (163 KB opt-in = 166912, cudaDevAttrMaxSharedMemoryPerBlockOptin)
MiB = 1024 * 1024

# --- Limits per compute capability ---------------------------------------------------------------

GUIDE_TABLE = (
    "CUDA C++ Programming Guide, 'Technical Specifications per Compute Capability' (appendix"
    " 'Compute Capabilities', Table 31)"
)
GUIDE_RESERVED = (
    "CUDA C++ Programming Guide, compute capability 8.x/9.0/10.0 sections: 'the 1 KB of shared"
    " memory not made available to a thread block is reserved for system use'; 7.x: the largest"
    " block may take the whole SM's shared memory, so none is reserved"
)


@dataclass(frozen=True)
class ArchitectureLimits:
    """The launch limits one compute capability sets, as the Programming Guide's table gives them."""

    compute_capability: Tuple[int, int]
    max_grid_size: Tuple[int, int, int]  # blocks per grid in x, y, z
    max_block_size: Tuple[int, int, int]  # threads per block in x, y, z
    max_threads_per_block: int
    warp_size: int
    max_ctas_per_sm: int  # "maximum number of resident blocks per SM"
    max_threads_per_sm: int  # "maximum number of resident threads per SM"
    registers_per_sm: int  # 32-bit registers
    registers_per_block: int
    shared_memory_per_block: int  # bytes a block gets without opting in (static limit)
    shared_memory_per_sm: int  # bytes, the largest carve-out
    shared_memory_per_block_optin: int  # bytes a block may opt in to
    reserved_shared_memory_per_block: int  # bytes the system keeps per block
    source: str


# Rows common to every compute capability from 7.0 to 10.0 in the guide's table: grid x up to
# 2^31 - 1 blocks, y and z up to 65535; block x and y up to 1024 threads, z up to 64; 1024
# threads per block; warp size 32; 64 K 32-bit registers per SM and per block; 48 KB of shared
# memory per block without opting in.
_GRID = (2**31 - 1, 65535, 65535)
_BLOCK = (1024, 1024, 64)
_THREADS_PER_BLOCK = 1024
_WARP = 32
_REGISTERS = 64 * 1024
_STATIC_SHARED = 48 * KiB


def _limits(cc: Tuple[int, int], ctas: int, threads: int, smem_sm_kb: int, optin_kb: int,
            reserved_kb: int) -> ArchitectureLimits:
    return ArchitectureLimits(
        compute_capability=cc,
        max_grid_size=_GRID,
        max_block_size=_BLOCK,
        max_threads_per_block=_THREADS_PER_BLOCK,
        warp_size=_WARP,
        max_ctas_per_sm=ctas,
        max_threads_per_sm=threads,
        registers_per_sm=_REGISTERS,
        registers_per_block=_REGISTERS,
        shared_memory_per_block=_STATIC_SHARED,
        shared_memory_per_sm=smem_sm_kb * KiB,
        shared_memory_per_block_optin=optin_kb * KiB,
        reserved_shared_memory_per_block=reserved_kb * KiB,
        source=f"{GUIDE_TABLE}, column {cc[0]}.{cc[1]}; reserved shared memory: {GUIDE_RESERVED}",
    )


# Columns of the guide's table: resident blocks per SM, resident threads per SM (resident warps
# x 32), shared memory per SM and per block (opt-in) in KB, and the reserved KB per block.
ARCHITECTURES: Dict[Tuple[int, int], ArchitectureLimits] = {
    # Volta: 32 blocks, 64 warps, 96 KB per SM, all of it to one block.
    (7, 0): _limits((7, 0), 32, 2048, 96, 96, 0),
    # Turing: 16 blocks, 32 warps, 64 KB per SM and per block.
    (7, 5): _limits((7, 5), 16, 1024, 64, 64, 0),
    # GA100: 32 blocks, 64 warps, 164 KB per SM, 163 KB per block.
    (8, 0): _limits((8, 0), 32, 2048, 164, 163, 1),
    # GA10x: 16 blocks, 48 warps, 100 KB per SM, 99 KB per block.
    (8, 6): _limits((8, 6), 16, 1536, 100, 99, 1),
    # Ada: 24 blocks, 48 warps, 100 KB per SM, 99 KB per block.
    (8, 9): _limits((8, 9), 24, 1536, 100, 99, 1),
    # Hopper: 32 blocks, 64 warps, 228 KB per SM, 227 KB per block.
    (9, 0): _limits((9, 0), 32, 2048, 228, 227, 1),
    # Blackwell B200: 32 blocks, 64 warps, 228 KB per SM, 227 KB per block.
    (10, 0): _limits((10, 0), 32, 2048, 228, 227, 1),
}


# --- Figures per product -------------------------------------------------------------------------

@dataclass(frozen=True)
class ProductFigures:
    """A model's own figures from its datasheet or architecture whitepaper."""

    compute_capability: Tuple[int, int]
    multi_processor_count: int
    l2_cache_bytes: int
    boost_clock_mhz: int
    memory_bandwidth_gbs: float  # GB/s (10**9 bytes per second), as the datasheet gives it
    memory_bus_bits: int
    source: str
    pci_device_id: Optional[int] = None

    @property
    def memory_clock_khz(self) -> int:
        """Half the data rate per pin (DDR), as ``cudaDeviceProp.memoryClockRate`` reports it.

        Data rate per pin = bandwidth x 8 / bus width; an A100 40GB's 1555 GB/s over 5120 bits
        gives 2.43 Gbit/s, 1215 MHz, the figure its deviceQuery prints.
        """
        return int(round(self.memory_bandwidth_gbs * 8 / self.memory_bus_bits / 2 * 1e6))


_GA10X_WP = "NVIDIA Ampere GA102 GPU Architecture whitepaper"
_ADA_WP = "NVIDIA Ada GPU Architecture whitepaper"
_A100_WP = "NVIDIA A100 Tensor Core GPU Architecture whitepaper"
_H100_WP = "NVIDIA H100 Tensor Core GPU Architecture whitepaper"
_V100_WP = "NVIDIA Tesla V100 GPU Architecture whitepaper"
_TURING_WP = "NVIDIA Turing GPU Architecture whitepaper"

# Both V100 memory sizes are the same GV100 board as far as launches go.
_V100 = ProductFigures(
    (7, 0), 80, 6 * MiB, 1530, 900, 4096,
    _V100_WP + " (Tesla V100 SXM2: 80 SMs, boost 1530 MHz, 900 GB/s HBM2 on 4096 bits, L2"
    " 6144 KB)")

PRODUCTS: Dict[str, ProductFigures] = {
    "RTX-3060": ProductFigures(
        (8, 6), 28, 3 * MiB, 1777, 360, 192,
        "NVIDIA GeForce RTX 3060 specifications (3584 CUDA cores = 28 SMs x 128, boost 1.78 GHz,"
        " 15 Gbps GDDR6 on 192 bits = 360 GB/s); L2 3 MB of GA106 (" + _GA10X_WP + ", GA10x"
        " appendix)"),
    "RTX-4060": ProductFigures(
        (8, 9), 24, 24 * MiB, 2460, 272, 128,
        "NVIDIA GeForce RTX 4060 specifications (3072 CUDA cores = 24 SMs x 128, boost 2.46 GHz,"
        " 17 Gbps GDDR6 on 128 bits = 272 GB/s, L2 24 MB)"),
    "RTX-3090": ProductFigures(
        (8, 6), 82, 6 * MiB, 1695, 936, 384,
        _GA10X_WP + " (RTX 3090: 82 SMs, boost 1695 MHz, 19.5 Gbps GDDR6X on 384 bits = 936"
        " GB/s, L2 6144 KB)"),
    "RTX-4090": ProductFigures(
        (8, 9), 128, 72 * MiB, 2520, 1008, 384,
        _ADA_WP + " (RTX 4090: 128 SMs, boost 2520 MHz, 21 Gbps GDDR6X on 384 bits = 1008 GB/s,"
        " L2 73728 KB)"),
    "A10": ProductFigures(
        (8, 6), 72, 6 * MiB, 1695, 600, 384,
        "NVIDIA A10 datasheet (9216 CUDA cores = 72 SMs x 128, 600 GB/s GDDR6 on 384 bits);"
        " boost 1695 MHz and L2 6144 KB of the GA102 board (" + _GA10X_WP + ")"),
    "A10G": ProductFigures(
        (8, 6), 80, 6 * MiB, 1695, 600, 384,
        "A10G is an AWS-only GA102 part without an NVIDIA datasheet: 80 SMs from torch's repr"
        " (multi_processor_count=80), L2 6144 KB of GA102 (" + _GA10X_WP + "); clocks and"
        " memory taken from the A10 datasheet as the nearest published GA102 board (they did not"
        " move cuDNN's answers, see the module docstring)"),
    "T4": ProductFigures(
        (7, 5), 40, 4 * MiB, 1590, 320, 256,
        "NVIDIA T4 datasheet (2560 CUDA cores = 40 SMs x 64, boost 1590 MHz, 320 GB/s GDDR6 on"
        " 256 bits); L2 4096 KB of TU104 (" + _TURING_WP + ")"),
    "L4": ProductFigures(
        (8, 9), 58, 48 * MiB, 2040, 300, 192,
        "NVIDIA L4 datasheet (7424 CUDA cores = 58 SMs x 128, 300 GB/s GDDR6 on 192 bits, boost"
        " 2040 MHz); L2 48 MB of AD104 (" + _ADA_WP + ")"),
    "L40S": ProductFigures(
        (8, 9), 142, 96 * MiB, 2520, 864, 384,
        "NVIDIA L40S datasheet (18176 CUDA cores = 142 SMs x 128, 864 GB/s GDDR6 on 384 bits,"
        " boost 2520 MHz); L2 96 MB of AD102 (" + _ADA_WP + ")"),
    "V100-16GB": _V100,
    "V100-32GB": _V100,
    "A30": ProductFigures(
        (8, 0), 56, 24 * MiB, 1440, 933, 3072,
        "NVIDIA A30 datasheet (3584 FP32 CUDA cores = 56 SMs x 64, 933 GB/s HBM2 on 3072 bits,"
        " boost 1440 MHz); L2 24 MB (half of GA100's 48 MB slices enabled, " + _A100_WP + ")"),
    "A100-40GB": ProductFigures(
        (8, 0), 108, 40 * MiB, 1410, 1555, 5120,
        _A100_WP + " (A100 SXM4 40GB: 108 SMs, boost 1410 MHz, 1555 GB/s HBM2 on 5120 bits,"
        " L2 40 MB); torch repr multi_processor_count=108, L2_cache_size=40MB in public notebooks"),
    "A100-80GB": ProductFigures(
        (8, 0), 108, 40 * MiB, 1410, 2039, 5120,
        "NVIDIA A100 80GB datasheet (SXM4: 2039 GB/s HBM2e on 5120 bits); 108 SMs, boost 1410"
        " MHz, L2 40 MB (" + _A100_WP + ")"),
    "H100-80GB": ProductFigures(
        (9, 0), 132, 50 * MiB, 1980, 3350, 5120,
        _H100_WP + " (H100 SXM5: 132 SMs, boost 1980 MHz, L2 50 MB, 5120-bit HBM3); 3.35 TB/s"
        " from the NVIDIA H100 datasheet"),
    "H100-PCIE": ProductFigures(
        (9, 0), 114, 50 * MiB, 1755, 2000, 5120,
        _H100_WP + " (H100 PCIe: 114 SMs, boost 1755 MHz, L2 50 MB, 5120-bit HBM2e); 2.0 TB/s"
        " from the NVIDIA H100 datasheet"),
    "H100-NVL": ProductFigures(
        (9, 0), 132, 50 * MiB, 1785, 3900, 6144,
        "NVIDIA H100 datasheet (H100 NVL: 94 GB HBM3 at 3.9 TB/s on the six-stack 6144-bit bus);"
        " 132 SMs (16896 cores / 128, as the catalogue's source), boost 1785 MHz and L2 50 MB of"
        " GH100 (" + _H100_WP + ")"),
    "H200": ProductFigures(
        (9, 0), 132, 50 * MiB, 1980, 4800, 6144,
        "NVIDIA H200 datasheet (141 GB HBM3e at 4.8 TB/s on the six-stack 6144-bit bus); 132"
        " SMs, boost 1980 MHz and L2 50 MB of the GH100 SXM board (" + _H100_WP + ")"),
    "B200": ProductFigures(
        (10, 0), 148, 126 * MiB, 1965, 8000, 8192,
        "torch repr of NVIDIA B200 (multi_processor_count=148, L2_cache_size=126MB) in public"
        " GitHub sources; 8 TB/s HBM3e on 8192 bits from the NVIDIA DGX B200 datasheet; boost"
        " 1965 MHz from NVIDIA's Blackwell architecture technical brief"),
}


# --- The description cuDNN reads -----------------------------------------------------------------

@dataclass(frozen=True)
class DeviceDescription:
    """Every field of cuDNN's deviceless device description for one catalogue GPU."""

    gpu_key: str
    device_name: str
    compute_capability: Tuple[int, int]
    multi_processor_count: int
    total_global_memory: int  # bytes: the catalogue's capacity (what total_memory reports)
    l2_cache_bytes: int
    sm_clock_khz: int
    memory_clock_khz: int
    pci_device_id: Optional[int]
    limits: ArchitectureLimits
    source: str

    def complete(self) -> bool:
        """True when every field cuDNN requires has a positive value."""
        numbers = (
            self.multi_processor_count, self.total_global_memory, self.l2_cache_bytes,
            self.sm_clock_khz, self.memory_clock_khz, self.limits.max_threads_per_block,
            self.limits.warp_size, self.limits.max_ctas_per_sm, self.limits.max_threads_per_sm,
            self.limits.registers_per_sm, self.limits.registers_per_block,
            self.limits.shared_memory_per_block, self.limits.shared_memory_per_sm,
            self.limits.shared_memory_per_block_optin,
        ) + self.limits.max_grid_size + self.limits.max_block_size
        return bool(self.device_name) and all(n > 0 for n in numbers)


class CatalogueGPU(Protocol):
    """What a description reads of a catalogue entry (``contract.gpus.GPU``). This module
    does not import the catalogue: the catalogue's GPU reads ``contract.overhead``, which reads
    this module's limits and datasheet figures."""

    @property
    def key(self) -> str: ...
    @property
    def cuda_name(self) -> str: ...
    @property
    def compute_capability(self) -> Tuple[int, int]: ...
    @property
    def multi_processor_count(self) -> int: ...
    @property
    def capacity_bytes(self) -> int: ...
    @property
    def capacity_source(self) -> str: ...


def device_description(gpu: CatalogueGPU) -> DeviceDescription:
    """The device description of a catalogue GPU.

    Raises ``KeyError`` naming the model when it has no product figures or its compute
    capability no row of limits (a test keeps every catalogue model covered).
    """
    product = PRODUCTS.get(gpu.key)
    if product is None:
        raise KeyError(f"no device figures for GPU model {gpu.key!r}")
    limits = ARCHITECTURES.get(gpu.compute_capability)
    if limits is None:
        raise KeyError(f"no architecture limits for compute capability {gpu.compute_capability}"
                       f" ({gpu.key})")
    return DeviceDescription(
        gpu_key=gpu.key,
        device_name=gpu.cuda_name,
        compute_capability=gpu.compute_capability,
        multi_processor_count=gpu.multi_processor_count,
        total_global_memory=gpu.capacity_bytes,
        l2_cache_bytes=product.l2_cache_bytes,
        sm_clock_khz=product.boost_clock_mhz * 1000,
        memory_clock_khz=product.memory_clock_khz,
        pci_device_id=product.pci_device_id,
        limits=limits,
        source=f"{product.source}; limits: {limits.source}; capacity: {gpu.capacity_source}",
    )
