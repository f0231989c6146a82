"""What changed in PyTorch's CUDA caching allocator between torch 2.2 and 2.15.

The simulator has to behave like the traced torch, so this module records, release by release,
what the CUDA allocator's configuration accepts and what torch says when it does not.

Where the evidence comes from. The pytorch/pytorch repository could not be read tag by tag here
(its snapshot is over the size the research tools bring in), so each release was read from its
own PyPI wheel (``torch==2.2.2, 2.3.1, 2.4.1, 2.5.1, 2.6.0, 2.7.1, 2.8.0, 2.9.1, 2.10.0,
2.11.0, 2.12.1, 2.13.0, 2.14.1, 2.15.0``, the newest patch of each minor release at the time):

- the option names and error texts compiled into ``torch/lib/libc10_cuda.so`` (the CUDA
  allocator's own parser, ``c10/cuda/CUDAAllocatorConfig.cpp``) and ``torch/lib/libc10.so``
  (``c10/core/AllocatorConfig.cpp``, the device-independent parser of 2.9+), read with
  ``strings``;
- the headers shipped in ``torch/include``: ``c10/cuda/CUDAAllocatorConfig.h`` (which
  environment variables ``CUDAAllocatorConfig::instance()`` reads; from 2.10 its ``getKeys()``
  list) and ``c10/core/AllocatorConfig.h`` (2.10-2.12 ``getMutableKeys()``; the block-size
  constants ``kMinBlockSize`` .. ``kRoundLarge``, identical in 2.10 to 2.15);
- for code paths whose text is not in a binary, the source of ``CUDAAllocatorConfig.cpp`` and
  ``AllocatorConfig.cpp`` as the public code index holds it (cited where used).

Differences that change what the simulator does (each applied where it is used):

- **keys**: ``KEY_INTRODUCED`` (an option a release does not know is an error there);
- **the unknown-key error**: up to 2.9 the CUDA parser raises ``RuntimeError: Unrecognized
  CachingAllocator option: KEY`` (the string is in libc10_cuda.so of 2.2.2 .. 2.9.1); from 2.10
  CUDA's ``parseArgs`` raises ``ValueError: Unrecognized key 'KEY' in CUDA allocator config.``
  (libc10_cuda.so of 2.10.0 .. 2.15.0; ``TORCH_CHECK_VALUE`` in CUDAAllocatorConfig.cpp);
- **max_split_size_mb / max_non_split_rounding_mb floor**: "must be > 20" up to 2.9
  (``val1 > kLargeBuffer / mb`` in CUDAAllocatorConfig.cpp; the string "too small, must be > "
  in libc10_cuda.so 2.2.2 .. 2.9.1), "must be >= 20" from 2.10 (``val_env >=
  min_allowed_split_size_mb`` in c10/core/AllocatorConfig.cpp; libc10.so 2.10.0+), so
  ``max_split_size_mb:20`` is an error up to 2.9 and valid from 2.10;
- **roundup_power2_divisions list form, value 0**: rejected in 2.2 and 2.3 (their only message
  is "For roundups, the divisons has to be power of 2 "), allowed from 2.4 ("... power of 2 or 0
  to disable roundup", first in libc10_cuda.so of 2.4.1);
- **roundup_power2_divisions ``>``**: the CUDA parser up to 2.9 fills from ``last_index`` (it
  overwrites the last named interval: ``std::next(begin, last_index)`` in
  CUDAAllocatorConfig.cpp), c10/core's parser, used by CUDA from 2.10, from ``last_index + 1``
  (AllocatorConfig.cpp ``parseRoundUpPower2Divisions``). 2.9 still parses CUDA's settings with
  its own parser: its libc10_cuda.so has "Unrecognized CachingAllocator option: " and "must be
  > ", and its CUDAAllocatorConfig.h declares the vector-of-strings ``parseRoundUpPower2Divisions``;
- **garbage_collection_threshold errors**: "garbage_collect_threshold too small/too big, set it
  0.0~1.0" up to 2.9, "garbage_collect_threshold is invalid, set it in (0.0, 1.0)" from 2.10
  (same range);
- **environment variable**: up to 2.9 the CUDA allocator reads only ``PYTORCH_CUDA_ALLOC_CONF``
  (2.9.1 CUDAAllocatorConfig.h ``instance()``); from 2.10 it falls back to
  ``PYTORCH_ALLOC_CONF`` when ``PYTORCH_CUDA_ALLOC_CONF`` is unset (2.10.0
  CUDAAllocatorConfig.h ``instance()``). ``alloc_conf_text`` applies this.

Allocator behaviour (round_size, the 1 MiB small/large threshold, the 2 MiB / 20 MiB / 2 MiB
segment sizes, the oversize rules, should_split, the release-and-retry chain, garbage
collection, expandable segments' 2 MiB / 20 MiB pages): no difference that changes placement
under the same effective settings was found between 2.2 and 2.15. The constants are the same in
every release read (2.10-2.15 headers; the 2.2-2.9 ``.cpp`` constants as the reference notes
give them); ``max_non_split_rounding_mb`` (2.6) and ``large_segment_size_mb`` (2.11) made
existing constants (``kLargeBuffer`` in ``get_free_block`` and ``get_allocation_size``)
configurable with the old value as default, so a string that a release accepts places the same
everywhere it is accepted. Garbage collection's block age moved from a per-block counter
incremented on every ``get_free_block`` of its pool to a per-pool call count minus the count at
insertion (``gc_count_base``), which counts the same thing. One difference is known and NOT
modelled: before the ``per_process_memory_fraction`` key (2.10),
``setMemoryFraction(1.0)`` still set a limit of the whole device and so switched garbage
collection on (``set_fraction = true``), whereas the current source treats 1.0 as no limit
(``allowed_memory_maximum = std::nullopt`` unless ``fraction < 1.0``); which release made that
change was not pinned down, and a trace never carries a ``set_per_process_memory_fraction(1.0)``
call, so the simulator keeps the current rule. The ``.cpp`` bodies of 2.2-2.9 could not be
diffed function by function: this is the evidence there is, not a proof.

Standard library only (probe bundle, Python >= 3.9).
"""

from __future__ import annotations

from typing import Any, Dict, Mapping, Optional, Tuple

from xmem_admission.contract.errors import AllocConfError
from xmem_admission.contract.torch_version import TorchVersionError, parse

Release = Tuple[int, int]

# The releases whose rules are recorded here: contract/torch_version.py OLDEST .. NEWEST.
OLDEST: Release = (2, 2)
LATEST: Release = (2, 15)

# The first release whose CUDA allocator accepts each key. (2, 2) means "2.2 or earlier": the
# range starts there. Evidence: the key's name among the parser's strings of that release's
# wheel and not of the one before (libc10_cuda.so up to 2.9; from 2.10 also
# CUDAAllocatorConfig.h getKeys() and AllocatorConfig.h getMutableKeys(), whose keys CUDA's
# parser skips instead of rejecting).
KEY_INTRODUCED: Dict[str, Release] = {
    "max_split_size_mb": (2, 2),
    "garbage_collection_threshold": (2, 2),
    "roundup_power2_divisions": (2, 2),
    "backend": (2, 2),
    "expandable_segments": (2, 2),
    "release_lock_on_cudamalloc": (2, 2),
    "release_lock_on_hipmalloc": (2, 2),
    "pinned_use_cuda_host_register": (2, 2),
    "pinned_use_hip_host_register": (2, 2),
    "pinned_num_register_threads": (2, 2),
    "max_non_split_rounding_mb": (2, 6),  # absent from 2.5.1's libc10_cuda.so
    "pinned_use_background_threads": (2, 6),  # absent from 2.5.1's libc10_cuda.so
    "graph_capture_record_stream_reuse": (2, 9),  # parseGraphCaptureRecordStreamReuse, 2.9.1
    "pinned_reserve_segment_size_mb": (2, 10),  # 2.10.0 CUDAAllocatorConfig.h getKeys()
    "per_process_memory_fraction": (2, 10),  # 2.10.0 getKeys(); pytorch PR 161035
    "large_segment_size_mb": (2, 11),  # 2.11.0 AllocatorConfig.h getMutableKeys()
    "pinned_free_catch_all": (2, 12),  # 2.12.1 CUDAAllocatorConfig.h getKeys()
    "throw_on_cudamalloc_oom": (2, 12),  # 2.12.1 CUDAAllocatorConfig.h getKeys()
    "pinned_max_round_threshold_mb": (2, 13),  # 2.13.0 libc10.so accelerator key set
    "pinned_max_cached_size_mb": (2, 13),  # 2.13.0 libc10.so accelerator key set
    "expandable_segments_reserve": (2, 15),  # 2.15.0 CUDAAllocatorConfig.h getKeys()
    "expandable_segments_reserve_by_class": (2, 15),  # 2.15.0 getKeys()
}

# From this release CUDA's settings go through c10/core's AcceleratorAllocatorConfig and the
# ConfigTokenizer (2.10.0 CUDAAllocatorConfig.h includes c10/core/AllocatorConfig.h and
# forwards max_split_size() etc. to it; 2.9.1's does neither).
SHARED_PARSER: Release = (2, 10)
# From this release a 0 in the list form of roundup_power2_divisions disables rounding.
LIST_ZERO_DIVISIONS: Release = (2, 4)


def release_of(version: Any) -> Release:
    """(major, minor) of ``version``: a tuple/list, a ``TorchVersion`` or a torch version string.

    None means the newest recorded release. Vendor strings (``2.6.0a0+ecf3bae40a``,
    ``2.14.1+cu130``) are read by ``contract.torch_version.parse``.
    """
    if version is None:
        return LATEST
    if isinstance(version, str):
        try:
            return parse(version).release
        except TorchVersionError as exc:
            raise AllocConfError(str(exc)) from None
    try:
        major, minor = int(version[0]), int(version[1])
    except (TypeError, ValueError, IndexError):
        raise AllocConfError(f"torch version must be (major, minor) or a version string, "
                             f"got {version!r}") from None
    return (major, minor)


def text(release: Release) -> str:
    return f"{release[0]}.{release[1]}"


def has_key(release: Release, key: str) -> bool:
    """Whether that release's CUDA allocator accepts ``key``.

    Keys present in 2.2 are taken as present in any older release too (nothing before 2.2 was
    read; the probe refuses those releases).
    """
    first = KEY_INTRODUCED.get(key)
    return first is not None and (first <= OLDEST or release >= first)


def torch_unknown_key_error(release: Release, key: str) -> str:
    """The exception torch of that release raises for an option it does not know."""
    if release >= SHARED_PARSER:
        # CUDAAllocatorConfig::parseArgs, TORCH_CHECK_VALUE (a ValueError in Python).
        return f"ValueError: Unrecognized key '{key}' in CUDA allocator config."
    # CUDAAllocatorConfig::parseArgs, TORCH_CHECK (a RuntimeError in Python).
    return f"RuntimeError: Unrecognized CachingAllocator option: {key}"


def unknown_key_message(release: Release, key: str) -> str:
    """Our message for a key that release rejects: what torch says, and which release has it."""
    said = torch_unknown_key_error(release, key)
    first = KEY_INTRODUCED.get(key)
    if first is None:
        return (f"unrecognized option {key!r}: torch {text(release)} would raise {said} "
                f"(no torch release from {text(OLDEST)} to {text(LATEST)} has this key)")
    return (f"unrecognized option {key!r} (PyTorch {text(release)} has no such key; it first "
            f"appeared in torch {text(first)}): torch {text(release)} would raise {said}")


def alloc_conf_text(env: Mapping[str, str], version: Any = None) -> str:
    """The allocator settings string that torch of ``version`` reads from ``env``.

    Up to 2.9 only ``PYTORCH_CUDA_ALLOC_CONF`` (2.9.1 CUDAAllocatorConfig.h ``instance()``);
    from 2.10 ``PYTORCH_ALLOC_CONF`` when ``PYTORCH_CUDA_ALLOC_CONF`` is unset (2.10.0
    CUDAAllocatorConfig.h ``instance()``: CUDA's variable first, then the generic one).
    """
    release = release_of(version)
    cuda: Optional[str] = env.get("PYTORCH_CUDA_ALLOC_CONF")
    if cuda is not None:
        return cuda
    if release >= SHARED_PARSER:
        return env.get("PYTORCH_ALLOC_CONF", "")
    return ""
