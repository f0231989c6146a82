"""NCCL's own GPU memory: buffers NCCL allocates with cudaMalloc, outside PyTorch's caching allocator.

Every NCCL communicator of a process connects each of its channels to the peers its algorithms
talk to, and every connection has a buffer per protocol (LL, LL128, Simple) on the GPU. The
allocator simulation never sees these: they are added to the estimate per communicator the traced
rank creates (the default group, and each ``new_group`` / device-mesh dimension it uses).

The model, per communicator of n > 1 ranks::

    channels x peers x (LL + LL128 + Simple buffer)

- Simple buffer: ``NCCL_BUFFSIZE``, default 4 MiB (NCCL user guide, Environment Variables,
  NCCL_BUFFSIZE: "default is 4194304 (4 MB)"; src/include/device.h ``DEFAULT_BUFFSIZE (1 << 22)``).
- LL buffer: ``NCCL_LL_LINES_PER_THREAD (8) * NCCL_LL_MAX_NTHREADS (512) * NCCL_STEPS (8) *
  sizeof(union ncclLLFifoLine) (16)`` = 512 KiB (src/include/device.h, ``DEFAULT_LL_BUFFSIZE``).
- LL128 buffer: ``NCCL_LL128_ELEMS_PER_THREAD (120) * NCCL_LL128_MAX_NTHREADS (640) *
  NCCL_STEPS (8) * sizeof(uint64_t)`` = 4,915,200 bytes (src/include/device.h,
  ``DEFAULT_LL128_BUFFSIZE``).
- peers: a ring channel receives from its previous rank and sends to its next (src/graph/rings.cc;
  src/transport/p2p.cc gives each side of a connection its buffers): 2 connections per channel
  when n > 2, 1 when n == 2.
- channels: NCCL runs one CUDA block per channel (src/enqueue.cc, the kernel's grid is the
  channel count), bounded by ``NCCL_MAX_NCHANNELS``, by the SM count and by ``MAXCHANNELS``:
  the model takes the smaller of 32 (MAXCHANNELS of the NCCL releases up to 2.18, src/include/
  device.h), ``NCCL_MAX_NCHANNELS`` and the GPU's SM count. Later releases raise MAXCHANNELS;
  how many channels 2.30 picks on a given topology is not measured in this repo. On the other
  side, NCCL picks fewer channels on PCIe or few-NVLink systems, and since NCCL 2.22 connects
  lazily (``NCCL_RUNTIME_CONNECT=1`` by default: only the algorithms and protocols a collective
  uses get buffers), so counting every protocol of every channel is the conservative end of
  what the sources allow. PyTorch 2.14's CUDA 13 wheels depend on nvidia-nccl-cu13 2.30.7 (the
  venv's dist-info).

Standard library only (contract package, probe bundle).
"""

from __future__ import annotations

from typing import Mapping, Optional, Sequence

# src/include/device.h, DEFAULT_BUFFSIZE; NCCL user guide, NCCL_BUFFSIZE default 4194304.
SIMPLE_BUFFER_BYTES = 4 * 1024 * 1024
# src/include/device.h, DEFAULT_LL_BUFFSIZE = 8 lines * 512 threads * 8 steps * 16 bytes.
LL_BUFFER_BYTES = 8 * 512 * 8 * 16
# src/include/device.h, DEFAULT_LL128_BUFFSIZE = 120 elements * 640 threads * 8 steps * 8 bytes.
LL128_BUFFER_BYTES = 120 * 640 * 8 * 8
# src/include/device.h MAXCHANNELS of NCCL <= 2.18 (see the module docstring).
MAX_CHANNELS = 32
# The NCCL release PyTorch 2.14's CUDA 13 wheels depend on (nvidia-nccl-cu13, see above).
NCCL_VERSION = "2.30.7"


def _positive(env: Mapping[str, str], name: str) -> Optional[int]:
    value = env.get(name, "").strip()
    return int(value) if value.isdigit() and int(value) > 0 else None


def channels(sm_count: int, env: Mapping[str, str]) -> int:
    """The channel count the model assumes on a GPU with ``sm_count`` SMs."""
    limit = _positive(env, "NCCL_MAX_NCHANNELS") or MAX_CHANNELS
    return max(1, min(MAX_CHANNELS, limit, sm_count))


def connection_bytes(env: Mapping[str, str]) -> int:
    """One connection's buffers: every protocol's, unless ``NCCL_PROTO`` names fewer."""
    simple = _positive(env, "NCCL_BUFFSIZE") or SIMPLE_BUFFER_BYTES
    sizes = {"ll": LL_BUFFER_BYTES, "ll128": LL128_BUFFER_BYTES, "simple": simple}
    proto = env.get("NCCL_PROTO", "").strip().lower()
    if proto and not proto.startswith("^"):
        chosen = {p.strip() for p in proto.split(",")} & set(sizes)
        if chosen:
            return sum(sizes[p] for p in chosen)
    return sum(sizes.values())


def communicator_bytes(ranks: int, sm_count: int, env: Mapping[str, str]) -> int:
    """NCCL's buffers for one communicator of ``ranks`` ranks on this GPU (0 for one rank)."""
    if ranks <= 1:
        return 0
    peers = 1 if ranks == 2 else 2
    return channels(sm_count, env) * peers * connection_bytes(env)


def process_bytes(groups: Sequence[int], sm_count: int, env: Mapping[str, str]) -> int:
    """All communicators of one process: ``groups`` lists each one's rank count."""
    return sum(communicator_bytes(n, sm_count, env) for n in groups)
