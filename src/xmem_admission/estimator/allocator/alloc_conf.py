"""``PYTORCH_CUDA_ALLOC_CONF``: the caching-allocator options that change where memory goes.

The simulator must be configured exactly like the job's PyTorch, so this module parses the
environment string the way PyTorch does (``c10/core/AllocatorConfig.{h,cpp}`` and
``c10/cuda/CUDAAllocatorConfig.cpp`` from 2.9 on): the same tokenizer (``,`` ``:`` ``[`` ``]`` are
tokens, whitespace is dropped), the same keys, the same range checks, the same two forms of
``roundup_power2_divisions``. Where PyTorch silently ignores a mistyped separator (its
``ConfigTokenizer::checkToken`` result is never checked) we reject the string instead: such a
string is a typo, and an admission decision should not rest on a guess about what it meant.

Keys that configure pinned host memory, locking or IPC are accepted and ignored, as PyTorch's
device allocator ignores them. Standard library only (probe bundle, Python >= 3.9).

The traced torch decides the rules (``parse_alloc_conf(text, version)``, ``version`` a
``(major, minor)`` tuple or a torch version string); ``torch_releases.py`` holds what each
release from 2.2 to 2.15 accepts, where the evidence for every difference comes from.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

from xmem_admission.contract.errors import AllocConfError
from xmem_admission.estimator.allocator import torch_releases
from xmem_admission.estimator.allocator.torch_releases import LATEST, Release, release_of

MiB = 1024 * 1024

# c10/core/AllocatorConfig.h (2.11): "large" allocations (1-10 MiB requests) are packed in
# blocks of this size; ``large_segment_size_mb`` overrides it (default 20 MiB = kLargeBuffer,
# c10/cuda/CUDACachingAllocator.cpp ``kLargeBuffer = 20971520``).
DEFAULT_LARGE_SEGMENT_SIZE = 20 * MiB
# c10/core/AllocatorConfig.cpp ``kRoundUpPowerOfTwoIntervals = 16``: one divisions entry per
# power-of-two interval from 1 MiB (kRoundUpPowerOfTwoStart) to 64 GiB (kRoundUpPowerOfTwoEnd).
ROUNDUP_INTERVALS = 16
# ``max_split_size`` defaults to std::numeric_limits<size_t>::max() (AllocatorConfig.h):
# "no limit"; PyTorch reports it as -1 in memory_stats() and snapshots.
UNLIMITED = (1 << 64) - 1
# parseLargeSegmentSize: the value must be > kMinLargeAlloc / kMB = 10 (MiB).
_MIN_LARGE_SEGMENT_MB = 10

# Keys PyTorch's CUDA config accepts that do not change device-memory placement
# (CUDAAllocatorConfig::getKeys and AcceleratorAllocatorConfig::getKeys, 2.11): pinned host
# memory, lock release around cudaMalloc, CUDA-graph stream reuse, IPC handle and reserve
# tuning, and the early-throw OOM policy (which changes how an OOM is reported, not when).
IGNORED_KEYS = frozenset({
    "pinned_use_background_threads",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "pinned_num_register_threads",
    "pinned_reserve_segment_size_mb",
    "pinned_free_catch_all",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "graph_capture_record_stream_reuse",
    "throw_on_cudamalloc_oom",
    "expandable_segments_reserve",
    "expandable_segments_reserve_by_class",
    # AcceleratorAllocatorConfig keys of 2.13+ for pinned host memory (2.13.0 wheel,
    # libc10.so: the key set after "large_segment_size_mb"); CUDA's parser skips them.
    "pinned_max_round_threshold_mb",
    "pinned_max_cached_size_mb",
})

# Of those, the ones PyTorch parses with ConfigTokenizer::toBool ("True"/"False" only).
_BOOL_IGNORED_KEYS = frozenset({
    "pinned_use_background_threads",
    "pinned_use_cuda_host_register",
    "pinned_use_hip_host_register",
    "release_lock_on_cudamalloc",
    "release_lock_on_hipmalloc",
    "graph_capture_record_stream_reuse",
})

_PLACEMENT_KEYS = (
    "max_split_size_mb",
    "max_non_split_rounding_mb",
    "garbage_collection_threshold",
    "roundup_power2_divisions",
    "expandable_segments",
    "large_segment_size_mb",
    "per_process_memory_fraction",
    "backend",
)


class Backend(str, enum.Enum):
    """Which device allocator PyTorch uses (``backend:`` key, CUDAAllocatorConfig.cpp)."""

    NATIVE = "native"
    CUDA_MALLOC_ASYNC = "cudaMallocAsync"


@dataclasses.dataclass(frozen=True)
class AllocatorConfig:
    """Every caching-allocator setting that changes placement, in bytes, PyTorch defaults.

    ``roundup_power2_divisions`` holds one entry per interval [2^(20+i), 2^(21+i)) bytes,
    i = 0..15 (sizes below 1 MiB use entry 0, above 32 GiB entry 15); 0 or 1 means no rounding.
    ``per_process_memory_fraction`` is None when the string does not set it (PyTorch: 1.0,
    no limit). ``backend`` is ``native`` or ``cudaMallocAsync`` (the latter is not a caching
    allocator at all and cannot be simulated).
    """

    max_split_size: int = UNLIMITED
    max_non_split_rounding_size: int = DEFAULT_LARGE_SEGMENT_SIZE
    roundup_power2_divisions: Tuple[int, ...] = (0,) * ROUNDUP_INTERVALS
    garbage_collection_threshold: float = 0.0
    expandable_segments: bool = False
    large_segment_size: int = DEFAULT_LARGE_SEGMENT_SIZE
    per_process_memory_fraction: Optional[float] = None
    backend: Backend = Backend.NATIVE
    source: str = ""
    # The torch release whose allocator this configures (major, minor); the rules that differ
    # between releases are listed in torch_releases.py.
    torch_release: Release = LATEST

    def __post_init__(self) -> None:
        if len(self.roundup_power2_divisions) != ROUNDUP_INTERVALS:
            raise AllocConfError(
                f"roundup_power2_divisions needs {ROUNDUP_INTERVALS} entries, "
                f"got {len(self.roundup_power2_divisions)}")

    @property
    def max_split_size_limited(self) -> bool:
        """True when ``max_split_size_mb`` was set (oversize rules and the first release step)."""
        return self.max_split_size != UNLIMITED

    def to_dict(self) -> Dict[str, Any]:
        """The settings as JSON-friendly data (sizes in bytes; unlimited split size as -1)."""
        return {
            "max_split_size": -1 if self.max_split_size == UNLIMITED else self.max_split_size,
            "max_non_split_rounding_size": self.max_non_split_rounding_size,
            "roundup_power2_divisions": list(self.roundup_power2_divisions),
            "garbage_collection_threshold": self.garbage_collection_threshold,
            "expandable_segments": self.expandable_segments,
            "large_segment_size": self.large_segment_size,
            "per_process_memory_fraction": self.per_process_memory_fraction,
            "backend": self.backend.value,
            "torch_release": f"{self.torch_release[0]}.{self.torch_release[1]}",
        }


def tokenize(text: str) -> List[str]:
    """Split like ``ConfigTokenizer``: ``, : [ ]`` are tokens of their own, whitespace vanishes."""
    tokens: List[str] = []
    buf: List[str] = []
    for ch in text:
        if ch in ",:[]":
            if buf:
                tokens.append("".join(buf))
                buf = []
            tokens.append(ch)
        elif not ch.isspace():
            buf.append(ch)
    if buf:
        tokens.append("".join(buf))
    return tokens


class _Parser:
    """One pass over the tokens, mirroring ``parseArgs`` of the 2.9+ config classes."""

    def __init__(self, text: str, version: Release):
        self.text = text
        self.version = version
        self.release_text = torch_releases.text(version)
        self.tokens = tokenize(text)
        self.values: Dict[str, Any] = {}

    # -- token helpers ------------------------------------------------------------------
    def token(self, i: int, what: str) -> str:
        if i >= len(self.tokens):
            raise AllocConfError(f"{what}: the string ends too early")
        return self.tokens[i]

    def expect(self, i: int, sep: str, key: str) -> None:
        tok = self.token(i, f"expected {sep!r} after {key!r}")
        if tok != sep:
            raise AllocConfError(f"expected {sep!r} after {key!r}, got {tok!r}")

    def whole(self, i: int, key: str) -> int:
        tok = self.token(i, f"{key} needs a value")
        if not tok.isdigit():
            raise AllocConfError(f"{key}: expected a non-negative whole number, got {tok!r}")
        return int(tok)

    def real(self, i: int, key: str) -> float:
        tok = self.token(i, f"{key} needs a value")
        try:
            value = float(tok)
        except ValueError:
            raise AllocConfError(f"{key}: expected a number, got {tok!r}") from None
        if not math.isfinite(value):
            raise AllocConfError(f"{key}: expected a finite number, got {tok!r}")
        return value

    def boolean(self, i: int, key: str) -> bool:
        # ConfigTokenizer::toBool: exactly "True" or "False".
        tok = self.token(i, f"{key} needs a value")
        if tok not in ("True", "False"):
            raise AllocConfError(f"{key}: expected True or False, got {tok!r}")
        return tok == "True"

    # -- keys ---------------------------------------------------------------------------
    def parse(self) -> Dict[str, Any]:
        tokens = self.tokens
        i = 0
        while i < len(tokens):
            key = tokens[i]
            if key in ",:[]":
                raise AllocConfError(f"expected an option name, got {key!r} "
                                     f"(token {i + 1} of {self.text!r})")
            if key not in _PLACEMENT_KEYS and key not in IGNORED_KEYS:
                known = ", ".join(sorted(set(_PLACEMENT_KEYS) | IGNORED_KEYS))
                raise AllocConfError(
                    f"{torch_releases.unknown_key_message(self.version, key)}; "
                    f"known: {known}")
            if not torch_releases.has_key(self.version, key):
                raise AllocConfError(torch_releases.unknown_key_message(self.version, key))
            # A repeated key is applied again (last one wins), as in PyTorch.
            self.expect(i + 1, ":", key)
            i = self.parse_value(key, i + 2)
            if i + 1 < len(tokens):
                self.expect(i + 1, ",", tokens[i])
                i += 2
            else:
                i += 1
        return self.values

    def parse_value(self, key: str, i: int) -> int:
        """Parse the value starting at token ``i``; returns the index of its last token."""
        if key in ("max_split_size_mb", "max_non_split_rounding_mb"):
            mb = self.whole(i, key)
            # parseMaxSplitSize / parseMaxNonSplitRoundingSize: >= large_segment_size / kMB
            # (kLargeBuffer / kMB = 20 before 2.11). The check uses the segment size parsed
            # so far, so order in the string matters, as in PyTorch.
            floor_mb = self.values.get("large_segment_size", DEFAULT_LARGE_SEGMENT_SIZE) // MiB
            if self.version < torch_releases.SHARED_PARSER:
                # Up to 2.9 CUDAAllocatorConfig.cpp checks ``val1 > kLargeBuffer / mb``: 20
                # itself is refused ("too small, must be > " in libc10_cuda.so 2.2.2-2.9.1).
                if mb <= floor_mb:
                    raise AllocConfError(
                        f"{key} {mb} is too small, must be > {floor_mb} in torch "
                        f"{self.release_text} (torch would raise RuntimeError: CachingAllocator "
                        f"option {key} too small, must be > {floor_mb}; from torch 2.10 "
                        f"{floor_mb} is allowed)")
            elif mb < floor_mb:
                raise AllocConfError(f"{key} {mb} is too small, must be >= {floor_mb}")
            target = "max_split_size" if key == "max_split_size_mb" else \
                "max_non_split_rounding_size"
            self.values[target] = min(mb, UNLIMITED // MiB) * MiB
        elif key == "large_segment_size_mb":
            mb = self.whole(i, key)
            if mb <= _MIN_LARGE_SEGMENT_MB:
                raise AllocConfError(f"{key} must be > {_MIN_LARGE_SEGMENT_MB}, got {mb}")
            self.values["large_segment_size"] = mb * MiB
        elif key == "garbage_collection_threshold":
            value = self.real(i, key)
            # parseGarbageCollectionThreshold: open interval (0.0, 1.0).
            if not 0.0 < value < 1.0:
                if self.version >= torch_releases.SHARED_PARSER:  # AllocatorConfig.cpp
                    said = "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"
                else:  # CUDAAllocatorConfig.cpp up to 2.9: two checks, two messages
                    said = "garbage_collect_threshold too " + \
                        ("small" if value <= 0.0 else "big") + ", set it 0.0~1.0"
                raise AllocConfError(f"{key} must be in (0.0, 1.0), got {value} (torch "
                                     f"{self.release_text} would raise RuntimeError: {said})")
            self.values["garbage_collection_threshold"] = value
        elif key == "per_process_memory_fraction":
            value = self.real(i, key)
            # CUDAAllocatorConfig::parsePerProcessMemoryFraction: closed interval [0.0, 1.0].
            if not 0.0 <= value <= 1.0:
                raise AllocConfError(f"{key} must be in [0.0, 1.0], got {value}")
            self.values["per_process_memory_fraction"] = value
        elif key == "expandable_segments":
            self.values["expandable_segments"] = self.boolean(i, key)
        elif key == "roundup_power2_divisions":
            return self.parse_roundup(i)
        elif key == "backend":
            tok = self.token(i, "backend needs a value")
            # CUDAAllocatorConfig::parseAllocatorConfig: native or cudaMallocAsync.
            if tok not in ("native", "cudaMallocAsync"):
                raise AllocConfError(f"unknown allocator backend {tok!r}, "
                                     f"options are native and cudaMallocAsync")
            self.values["backend"] = Backend(tok)
        elif key in _BOOL_IGNORED_KEYS:
            self.boolean(i, key)
        elif key == "pinned_num_register_threads":
            # parsePinnedNumRegisterThreads: a power of 2, at most
            # pinned_max_register_threads() = 128 (CUDAAllocatorConfig.h).
            value = self.whole(i, key)
            if not _is_power_of_two(value) or value > 128:
                raise AllocConfError(f"{key} must be a power of 2 no larger than 128, "
                                     f"got {value}")
        elif key == "pinned_reserve_segment_size_mb":
            if self.whole(i, key) <= 0:
                raise AllocConfError(f"{key} must be greater than 0")
        else:  # the other IGNORED_KEYS: any single value or bracketed list
            return self.skip_value(i, key)
        return i

    def skip_value(self, i: int, key: str) -> int:
        # ConfigTokenizer::skipKey: a single token, or everything up to the matching ']'.
        if self.token(i, f"{key} needs a value") != "[":
            return i
        while True:
            i += 1
            if self.token(i, f"{key}: list has no closing ']'") == "]":
                return i

    def parse_roundup(self, i: int) -> int:
        key = "roundup_power2_divisions"
        divisions = [0] * ROUNDUP_INTERVALS
        if self.token(i, f"{key} needs a value") != "[":
            # Old single-number form: every interval gets the same number of divisions,
            # which must be a power of two (parseRoundUpPower2Divisions "backwards
            # compatibility" branch; 0 is rejected there because isPowerOf2_64(0) is false).
            value = self.whole(i, key)
            if not _is_power_of_two(value):
                raise AllocConfError(f"{key}: divisions must be a power of 2, got {value}")
            self.values[key] = tuple([value] * ROUNDUP_INTERVALS)
            return i
        first = True
        last_index = 0
        i += 1
        while True:
            tok = self.token(i, f"{key}: list has no closing ']'")
            if tok == "]":
                break
            boundary_tok = tok
            self.expect(i + 1, ":", f"{key} entry {boundary_tok}")
            value = self.whole(i + 2, f"{key} entry {boundary_tok}")
            if value == 0 and self.version < torch_releases.LIST_ZERO_DIVISIONS:
                # 2.2 and 2.3 check isPowerOf2_64(val2) for list entries too; "or 0 to disable
                # roundup" first appears in 2.4.1's libc10_cuda.so.
                raise AllocConfError(
                    f"{key}: divisions must be a power of 2 in torch {self.release_text}, got "
                    f"0 for {boundary_tok!r} (torch would raise RuntimeError: For roundups, "
                    f"the divisons has to be power of 2; 0 disables rounding from torch 2.4)")
            if value != 0 and not _is_power_of_two(value):
                raise AllocConfError(f"{key}: divisions must be a power of 2 or 0, "
                                     f"got {value} for {boundary_tok!r}")
            if boundary_tok == ">":
                # '>' fills every interval after the last one named: from last_index + 1 in
                # c10/core/AllocatorConfig.cpp, which parses CUDA's settings from 2.10; from
                # last_index itself in CUDAAllocatorConfig.cpp, CUDA's own parser up to and
                # including 2.9, which overwrote the last named entry (torch_releases.py).
                start = last_index + 1 if self.version >= torch_releases.SHARED_PARSER \
                    else last_index
                for j in range(start, ROUNDUP_INTERVALS):
                    divisions[j] = value
            else:
                if not boundary_tok.isdigit() or not _is_power_of_two(int(boundary_tok)):
                    raise AllocConfError(f"{key}: interval boundaries are powers of 2 in MB "
                                         f"or '>', got {boundary_tok!r}")
                index = min(int(boundary_tok).bit_length() - 1, ROUNDUP_INTERVALS - 1)
                if first:
                    # The first entry also covers every interval below it.
                    for j in range(index):
                        divisions[j] = value
                    first = False
                divisions[index] = value
                last_index = index
            i += 3
            nxt = self.token(i, f"{key}: list has no closing ']'")
            if nxt == ",":
                i += 1
            elif nxt != "]":
                raise AllocConfError(f"{key}: expected ',' or ']' after entry "
                                     f"{boundary_tok}:{value}, got {nxt!r}")
        self.values[key] = tuple(divisions)
        return i


def _is_power_of_two(value: int) -> bool:
    return value > 0 and value & (value - 1) == 0


def parse_alloc_conf(text: str, version: Union[Sequence[int], str, None] = LATEST
                     ) -> AllocatorConfig:
    """Parse a ``PYTORCH_CUDA_ALLOC_CONF`` / ``PYTORCH_ALLOC_CONF`` string as that torch would.

    ``version`` is the traced torch: a ``(major, minor)`` tuple, a ``TorchVersion`` or a version
    string as torch reports it (``"2.6.0a0+ecf3bae40a"``); None or omitted means the newest
    release recorded (2.15). Where releases differ (torch_releases.py): which keys exist (a key
    the release does not have is reported with the error that torch raises and the release that
    introduced it), the ``max_split_size_mb`` floor (> 20 up to 2.9, >= 20 from 2.10), a 0 in
    the list form of ``roundup_power2_divisions`` (2.4+), and where ``>`` starts filling
    (2.10+: after the last named interval; before: at it). The result carries the release in
    ``torch_release``. Raises ``AllocConfError`` naming the offending key or token.
    """
    if not isinstance(text, str):
        raise AllocConfError(f"allocator settings must be a string, got {type(text).__name__}")
    release = release_of(version)
    values = _Parser(text, release).parse()
    return AllocatorConfig(source=text, torch_release=release, **values)


# The probe's record, in the trace's meta, of these variables in the job's own environment when
# its caching allocator started (probe.blocks, at the first GPU block): torch reads them once
# then (c10/cuda/CUDAAllocatorConfig.h, ``instance()``), and a program may set them itself
# (Axolotl's CLI sets PYTORCH_ALLOC_CONF=expandable_segments:True, axolotl/utils/__init__.py,
# ``set_pytorch_cuda_alloc_conf``).
ENV_META = "alloc_conf_env"
VARIABLES = ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")


def job_environment(meta: Mapping[str, Any], env: Mapping[str, str]) -> Mapping[str, str]:
    """The allocator variables the traced job ran with: the trace's record, else ``env`` (a
    trace without one: made before the record, or with no GPU block)."""
    recorded = meta.get(ENV_META)
    return recorded if isinstance(recorded, dict) else env


def config_from_env(env: Mapping[str, str], version: Union[Sequence[int], str, None] = LATEST
                    ) -> AllocatorConfig:
    """The settings torch of ``version`` takes from the environment ``env``.

    Reads the variable that release reads (``PYTORCH_CUDA_ALLOC_CONF``; from 2.10 also
    ``PYTORCH_ALLOC_CONF`` when the first is unset) and parses it by that release's rules.
    """
    return parse_alloc_conf(torch_releases.alloc_conf_text(env, version), version)


def config_from_snapshot_settings(settings: Any) -> AllocatorConfig:
    """Rebuild the settings a ``_dump_snapshot`` recorded under ``allocator_settings``.

    PyTorch writes the raw ``PYTORCH_CUDA_ALLOC_CONF`` string and the effective values of
    some options (``max_split_size`` -1 for unlimited, the divisions as a dict keyed by
    interval start in MB, the GC threshold, expandable segments), but not
    ``max_non_split_rounding`` or ``large_segment_size`` (torch/csrc/cuda/Module.cpp,
    ``_memorySnapshot``). So the string is parsed for everything, and the effective values,
    where present, win.
    """
    if not isinstance(settings, dict):
        return AllocatorConfig()
    text = settings.get("PYTORCH_CUDA_ALLOC_CONF")
    text = text if isinstance(text, str) else ""
    try:
        base = parse_alloc_conf(text)
    except AllocConfError:
        base = AllocatorConfig(source=text)
    values: Dict[str, Any] = {}
    mss = settings.get("max_split_size")
    if isinstance(mss, int) and not isinstance(mss, bool):
        values["max_split_size"] = mss if mss > 0 else UNLIMITED
    divs = settings.get("roundup_power2_divisions")
    if isinstance(divs, dict) and divs:
        table = list(base.roundup_power2_divisions)
        for boundary, value in divs.items():
            try:
                index = int(boundary).bit_length() - 1
            except (TypeError, ValueError):
                continue
            if 0 <= index < ROUNDUP_INTERVALS and isinstance(value, int):
                table[index] = value
        values["roundup_power2_divisions"] = tuple(table)
    gc = settings.get("garbage_collection_threshold")
    if isinstance(gc, (int, float)) and 0.0 <= gc < 1.0:
        values["garbage_collection_threshold"] = float(gc)
    if isinstance(settings.get("expandable_segments"), bool):
        values["expandable_segments"] = settings["expandable_segments"]
    return dataclasses.replace(base, **values)
