"""cuDNN's own convolution workspaces, asked of cuDNN on the CPU: deviceless execution plans.

A cuDNN convolution takes a workspace from the caching allocator whose size depends on the engine
cuDNN's heuristics rank first for the shape on the GPU's architecture (``contract/cudnn.py``).
cuDNN 9.11 and newer answer that question without a GPU: the heuristics and the execution plans
take a device description (``CUDNN_BACKEND_DEVICEPROP_DESCRIPTOR``, set from a JSON text) instead
of a device. This module is a small client of cuDNN's backend C API through ``ctypes``:

1. load ``libcudnn`` (the one this process's torch uses, else the ``nvidia-cudnn-cu*`` wheel's
   next to torch, else torch's own ``lib`` folder, else the system's), and check its version;
2. build the device description from the catalogue's ``contract.gpu_devices`` figures;
3. build the operation graph of one convolution call (forward, gradient of the input, gradient
   of the weight) with its tensors' shapes, strides (NCHW or channels-last) and data type;
4. ask the heuristics for engine configurations, mode A then the fallback list, and finalize an
   execution plan for each, without a cuDNN handle: the plan's workspace size is cuDNN's answer.

The plans come back in the heuristics' order, duplicates (same engine and knob choices, offered
by both modes) kept at their first place. That is the order in which a caller tries them; which
of them PyTorch keeps, in which order (its heuristics mode, its TF32, determinism and
down-conversion filters, its errata) is ``torch_plans`` / ``torch_workspaces`` below; each plan
carries its engine's numerical notes for that.

Names and numbers of the C API (attribute names, descriptor and attribute types, enums) are those
of cuDNN 9's public headers, ``cudnn_graph_v9.h`` (shipped in the ``nvidia-cudnn-cu*`` wheels'
``include`` folder); the keys of the device description's JSON are those cuDNN's parser asks for
(cuDNN names the first one missing; the same keys as openxla/xla's ``BuildDeviceProperties``).

Older cuDNN (tried with torch 2.4.1's cuDNN 9.1.0 on a machine without a GPU or driver): the
operation graph and the heuristics finalize without a handle, but answer for no particular
device (25 forward configurations for a ResNet block, none of them a tensor-core engine), and an
execution plan, hence its workspace size, needs a handle: ``cudnnBackendFinalize`` says
CUDNN_STATUS_NOT_SUPPORTED. A handle needs the CUDA runtime to see a device (``cudnnCreate``:
"cudaGetDeviceCount(&count) != cudaSuccess"). A stand-in ``libcuda.so.1`` answering the
documented driver API (cuInit, cuDriverGetVersion, cuDeviceGet*, cuGetProcAddress) does not get
there: the CUDA runtime linked into cuDNN asks the driver for a private export table
(``cuGetExportTable``) right after ``cuInit`` and reports no device when refused; those tables
are undocumented and were not emulated. So releases before 9.11 get the fitted rule
(``contract/cudnn.py``) where one exists, and no workspace elsewhere.

Cost in an estimation pod (cuDNN 9.24, this venv, median of three fresh processes): loading
libcudnn 0.03 s and 53 MiB of resident memory, the first convolution's plans 0.1 s and another
154 MiB (cuDNN's engine libraries paged in, file-backed), each further call's plans about 8 ms.

Standard library and torch only, Python 3.9 syntax: this module is part of the probe bundle.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import enum
import functools
import json
import os
import sys
from dataclasses import dataclass
from typing import Callable, Dict, List, Mapping, Optional, Sequence, Tuple

from xmem_admission.contract.cudnn import ConvCall
from xmem_admission.contract.errors import XmemError
from xmem_admission.contract.gpu_devices import DeviceDescription, device_description
from xmem_admission.contract.gpus import GPU
from xmem_admission.estimator.conv_marks import ConvMark

# Deviceless plans: the device description's JSON representation and plans finalized from it
# need cuDNN 9.11.0 (cudnn-frontend's deviceless ahead-of-time compilation sample skips below
# CUDNN_VERSION 91100; the descriptor itself exists from 9.8.0, cudnn_graph_v9.h "@since").
DEVICELESS_MIN_VERSION = 91100

# --- cuDNN backend C API constants (cudnn_graph_v9.h, cuDNN 9) ---------------------------------
# cudnnBackendDescriptorType_t
_CONVOLUTION = 1
_ENGINE = 2
_ENGINECFG = 3
_ENGINEHEUR = 4
_EXECUTION_PLAN = 5
_KNOB_CHOICE = 7
_OP_CONV_FORWARD = 10
_OP_CONV_BWD_FILTER = 11
_OP_CONV_BWD_DATA = 12
_OPERATIONGRAPH = 15
_TENSOR = 17
_DEVICEPROP = 38
# cudnnBackendAttributeType_t
_T_DATA_TYPE = 1
_T_INT64 = 3
_T_FLOAT = 4
_T_DOUBLE = 5
_T_CONVOLUTION_MODE = 7
_T_HEUR_MODE = 8
_T_KNOB_TYPE = 9
_T_NUMERICAL_NOTE = 11
_T_BACKEND_DESCRIPTOR = 15
_T_CHAR = 24
# cudnnBackendAttributeName_t
_A_CONV_COMP_TYPE = 100
_A_CONV_MODE = 101
_A_CONV_DILATIONS = 102
_A_CONV_STRIDES = 103
_A_CONV_POST_PADDINGS = 104
_A_CONV_PRE_PADDINGS = 105
_A_CONV_SPATIAL_DIMS = 106
_A_HEUR_MODE = 200
_A_HEUR_GRAPH = 201
_A_HEUR_RESULTS = 202
_A_HEUR_DEVICEPROP = 204
_A_CFG_ENGINE = 300
_A_CFG_KNOBS = 302
_A_PLAN_CONFIG = 401
_A_PLAN_WORKSPACE = 402
_A_PLAN_DEVICEPROP = 407
_A_KNOB_TYPE = 600
_A_KNOB_VALUE = 601
_A_GRAPH_OPS = 801
_A_TENSOR_ALIGNMENT = 900
_A_TENSOR_DATA_TYPE = 901
_A_TENSOR_DIMS = 902
_A_TENSOR_STRIDES = 903
_A_TENSOR_UID = 906
_A_ENGINE_GLOBAL_INDEX = 1301
_A_ENGINE_NUMERICAL_NOTE = 1303
_A_DEVICEPROP_JSON = 2702
# The operation attributes, per call: alpha, beta, convolution descriptor, then the x, w, y
# tensors under the names each operation gives them (FORWARD_X/W/Y = 704/703/705, BWD_DATA
# DX/W/DY = 710/709/711, BWD_FILTER X/DW/DY = 716/715/717).
_OPERATION: Dict[ConvCall, Tuple[int, int, Tuple[int, int, int]]] = {
    ConvCall.FORWARD: (_OP_CONV_FORWARD, 700, (704, 703, 705)),
    ConvCall.BACKWARD_DATA: (_OP_CONV_BWD_DATA, 706, (710, 709, 711)),
    ConvCall.BACKWARD_FILTER: (_OP_CONV_BWD_FILTER, 712, (716, 715, 717)),
}
_CROSS_CORRELATION = 1  # cudnnConvolutionMode_t: what torch's convolutions compute
# Room for every knob type of a config: CUDNN_KNOB_TYPE_COUNTS is 46 in cuDNN 9.24; newer releases
# may add types, so twice that (asking with no room answers 0, hence a fixed bound).
_KNOB_TYPE_COUNTS = 92
_NUMERICAL_NOTE_COUNT = 10  # CUDNN_NUMERICAL_NOTE_TYPE_COUNT
# cudnnDataType_t and the compute type torch's Conv_v8.cpp pairs with each (float accumulation
# for half and bfloat16, double for double).
_DATA_TYPES: Dict[str, Tuple[int, int, int]] = {
    # dtype: (cudnnDataType_t, element size, compute cudnnDataType_t)
    "float32": (0, 4, 0),
    "float64": (1, 8, 1),
    "float16": (2, 2, 0),
    "bfloat16": (9, 2, 0),
}
_ALIGNMENT = 16  # bytes: the alignment of the caching allocator's blocks (512), capped at 16


class HeuristicMode(str, enum.Enum):
    """cudnnBackendHeurMode_t (cudnn_graph_v9.h): the heuristic modes a caller may ask."""

    A = "A"  # CUDNN_HEUR_MODE_A = 3 ("an alias for INSTANT", cudnn_graph_v9.h)
    FALLBACK = "fallback"  # CUDNN_HEUR_MODE_FALLBACK = 2
    INSTANT = "instant"  # CUDNN_HEUR_MODE_INSTANT = 0: what PyTorch asks (Conv_v8.cpp)
    B = "B"  # CUDNN_HEUR_MODE_B = 1: PyTorch's with TORCH_CUDNN_USE_HEURISTIC_MODE_B set


_MODE_VALUE = {HeuristicMode.A: 3, HeuristicMode.FALLBACK: 2, HeuristicMode.INSTANT: 0,
               HeuristicMode.B: 1}
# The modes ``plans`` asks by default, in order: the ranked list, then the fallback list.
DEFAULT_MODES = (HeuristicMode.A, HeuristicMode.FALLBACK)


class NumericalNote(enum.IntEnum):
    """cudnnBackendNumericalNote_t: what an engine does to the numbers (torch filters on them)."""

    TENSOR_CORE = 0
    DOWN_CONVERT_INPUTS = 1
    REDUCED_PRECISION_REDUCTION = 2
    FFT = 3
    NONDETERMINISTIC = 4
    WINOGRAD = 5
    WINOGRAD_TILE_4x4 = 6
    WINOGRAD_TILE_6x6 = 7
    WINOGRAD_TILE_13x13 = 8
    STRICT_NAN_PROP = 9


class CudnnPlanningUnavailable(XmemError):
    """Raised when cuDNN cannot plan a convolution here: no libcudnn, one older than 9.11
    (no deviceless plans; the message names the version), or cuDNN rejects the description."""


class CudnnCallError(XmemError):
    """Raised when a cuDNN backend call fails where it should not (the message has cuDNN's)."""


@dataclass(frozen=True)
class Convolution:
    """A 2-D convolution as torch runs it: ``x`` (N, C, H, W) * ``w`` (K, C/groups, R, S)."""

    batch: int
    in_channels: int
    height: int
    width: int
    out_channels: int
    kernel: Tuple[int, int]
    stride: Tuple[int, int] = (1, 1)
    padding: Tuple[int, int] = (0, 0)
    dilation: Tuple[int, int] = (1, 1)
    groups: int = 1
    dtype: str = "float32"
    channels_last: bool = False

    def __post_init__(self) -> None:
        if self.dtype not in _DATA_TYPES:
            raise ValueError(f"dtype {self.dtype!r} not one of {sorted(_DATA_TYPES)}")
        if self.groups < 1 or self.in_channels % self.groups or self.out_channels % self.groups:
            raise ValueError(f"groups={self.groups} must divide in_channels={self.in_channels}"
                             f" and out_channels={self.out_channels}")
        if min(self.output_size()) < 1:
            raise ValueError(f"convolution {self} has an empty output")

    def output_size(self) -> Tuple[int, int]:
        """(P, Q): torch's output height and width for this input, kernel and geometry."""
        sizes = []
        for size, k, s, p, d in zip((self.height, self.width), self.kernel, self.stride,
                                    self.padding, self.dilation):
            sizes.append((size + 2 * p - d * (k - 1) - 1) // s + 1)
        return sizes[0], sizes[1]

    def shapes(self) -> Tuple[List[int], List[int], List[int]]:
        """Dimensions (NCHW order, as cuDNN takes them) of x, w and y."""
        p, q = self.output_size()
        return ([self.batch, self.in_channels, self.height, self.width],
                [self.out_channels, self.in_channels // self.groups, *self.kernel],
                [self.batch, self.out_channels, p, q])

    def strides(self, dims: Sequence[int]) -> List[int]:
        """Element strides of a packed tensor: NCHW, or NHWC when channels-last."""
        n, c, h, w = dims
        if self.channels_last:
            return [h * w * c, 1, w * c, c]
        return [c * h * w, h * w, w, 1]


@dataclass(frozen=True)
class Plan:
    """One engine configuration cuDNN finalized a plan for, in the heuristics' order."""

    engine: int  # CUDNN_ATTR_ENGINE_GLOBAL_INDEX
    knobs: Tuple[Tuple[int, int], ...]  # (knob type, value), sorted
    workspace_bytes: int
    mode: HeuristicMode
    notes: Tuple[NumericalNote, ...]

    @property
    def tag(self) -> str:
        """Engine and knob choices, as cuDNN names a plan ("eng38_k2=4_k13=0")."""
        return f"eng{self.engine}" + "".join(f"_k{k}={v}" for k, v in self.knobs)


def find_libcudnn() -> Optional[str]:
    """Path of the libcudnn this environment's torch runs with, or None.

    In order: one already loaded in this process (torch loads it with its CUDA libraries), the
    ``nvidia-cudnn-cu*`` wheel's ``nvidia/cudnn/lib`` on ``sys.path`` (where pip puts it next to
    torch), torch's own ``lib`` folder (wheels that bundle it), then the system's.
    """
    loaded = _loaded_libcudnn()
    if loaded:
        return loaded
    for entry in sys.path:
        for folder in (os.path.join(entry, "nvidia", "cudnn", "lib"),
                       os.path.join(entry, "torch", "lib")):
            found = _libcudnn_in(folder)
            if found:
                return found
    name = ctypes.util.find_library("cudnn")
    return name or None


def _loaded_libcudnn() -> Optional[str]:
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            for line in maps:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if os.path.basename(path).startswith("libcudnn.so"):
                    return path
    except OSError:
        return None
    return None


def _preload_cublaslt(libcudnn: str) -> None:
    """Load cuBLASLt process-wide when this process has none, from the NVIDIA wheels beside
    ``libcudnn`` or on ``sys.path`` (``nvidia/cu13/lib``, ``nvidia/cublas/lib``): cuDNN 9.19
    opens it by name when it first plans ("Cannot load symbol cublasLtGetVersion" and no plan
    otherwise, seen with the nvidia-cudnn-cu13 9.19.0 wheel outside torch's own environment);
    a wheel's RUNPATH does not reach a sibling wheel's folder. Nothing found: nothing done."""
    try:
        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            if "libcublasLt.so" in maps.read():
                return
    except OSError:
        pass
    roots = [os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(libcudnn))))]
    roots += [os.path.join(entry, "nvidia") for entry in sys.path if entry]
    for root in roots:
        for folder in (os.path.join(root, "cu13", "lib"), os.path.join(root, "cublas", "lib")):
            if not os.path.isdir(folder):
                continue
            names = sorted(n for n in os.listdir(folder) if n.startswith("libcublasLt.so"))
            if names:
                try:
                    ctypes.CDLL(os.path.join(folder, names[-1]), mode=ctypes.RTLD_GLOBAL)
                    return
                except OSError:
                    continue


def _libcudnn_in(folder: str) -> Optional[str]:
    if not os.path.isdir(folder):
        return None
    names = sorted(n for n in os.listdir(folder) if n.startswith("libcudnn.so"))
    return os.path.join(folder, names[-1]) if names else None


class _Descriptors:
    """The backend descriptors of one query, destroyed together when it ends."""

    def __init__(self, lib: CudnnLibrary) -> None:
        self._lib = lib
        self._made: List[ctypes.c_void_p] = []

    def new(self, kind: int) -> ctypes.c_void_p:
        desc = ctypes.c_void_p()
        self._lib.check(self._lib.raw.cudnnBackendCreateDescriptor(kind, ctypes.byref(desc)),
                        f"create descriptor type {kind}")
        self._made.append(desc)
        return desc

    def close(self) -> None:
        for desc in reversed(self._made):
            self._lib.raw.cudnnBackendDestroyDescriptor(desc)
        self._made.clear()


def version_text(version: int) -> str:
    """"9.24.0" for 92400, "8.9.2" for 8902: cudnn_version.h defines CUDNN_VERSION as
    major * 10000 + minor * 100 + patch from cuDNN 9, major * 1000 + minor * 100 + patch before
    (cuDNN 8's cudnn_version.h; torch 2.2-2.3 bring 8.9.2)."""
    major, rest = divmod(version, 10000 if version >= 90000 else 1000)
    minor, patch = divmod(rest, 100)
    return f"{major}.{minor}.{patch}"


class CudnnLibrary:
    """A loaded libcudnn: its version, and deviceless planning of convolutions."""

    def __init__(self, path: str) -> None:
        self.path = path
        loaded = _loaded_libcudnn()
        if loaded and os.path.realpath(loaded) != os.path.realpath(path):
            # Its engine libraries (libcudnn_graph.so.9, ...) are opened by soname: a second
            # release would bind to the first one's and fail or answer for it.
            raise CudnnPlanningUnavailable(
                f"cannot load cuDNN from {path}: this process already runs {loaded}, and two"
                " cuDNN releases cannot be loaded side by side (plan in a fresh process)")
        _preload_cublaslt(path)
        try:
            raw = ctypes.CDLL(path)
        except OSError as err:
            raise CudnnPlanningUnavailable(f"cannot load cuDNN from {path}: {err}") from None
        self.raw = raw
        raw.cudnnGetVersion.restype = ctypes.c_size_t
        self.version = int(raw.cudnnGetVersion())
        if not hasattr(raw, "cudnnBackendCreateDescriptor"):
            raise CudnnPlanningUnavailable(f"{path} (cuDNN {self.version_text}) has no backend API")
        void = ctypes.c_void_p
        raw.cudnnBackendCreateDescriptor.argtypes = [ctypes.c_int, ctypes.POINTER(void)]
        raw.cudnnBackendDestroyDescriptor.argtypes = [void]
        raw.cudnnBackendSetAttribute.argtypes = [void, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                                 void]
        raw.cudnnBackendGetAttribute.argtypes = [void, ctypes.c_int, ctypes.c_int, ctypes.c_int64,
                                                 ctypes.POINTER(ctypes.c_int64), void]
        raw.cudnnBackendFinalize.argtypes = [void]
        raw.cudnnGetErrorString.restype = ctypes.c_char_p
        raw.cudnnGetErrorString.argtypes = [ctypes.c_int]
        self._last_error: Optional[Callable[..., int]] = None
        if hasattr(raw, "cudnnGetLastErrorString"):  # cuDNN 9.0 and newer
            raw.cudnnGetLastErrorString.argtypes = [ctypes.c_char_p, ctypes.c_size_t]
            self._last_error = raw.cudnnGetLastErrorString

    @property
    def version_text(self) -> str:
        return version_text(self.version)

    @property
    def deviceless(self) -> bool:
        """Whether this cuDNN can plan from a device description (9.11 and newer)."""
        return self.version >= DEVICELESS_MIN_VERSION

    # --- calls ---------------------------------------------------------------------------------

    def message(self, status: int) -> str:
        text = self.raw.cudnnGetErrorString(status)
        words = text.decode(errors="replace") if text else f"status {status}"
        if self._last_error is not None:
            buffer = ctypes.create_string_buffer(2048)
            self._last_error(buffer, len(buffer))
            if buffer.value:
                words += ": " + buffer.value.decode(errors="replace").strip()
        return words

    def check(self, status: int, what: str) -> None:
        if status != 0:
            raise CudnnCallError(f"cuDNN {self.version_text} {what}: {self.message(status)}")

    def _set(self, desc: ctypes.c_void_p, name: int, kind: int, values: ctypes.Array,  # type: ignore[type-arg]
             what: str) -> None:
        self.check(self.raw.cudnnBackendSetAttribute(desc, name, kind, len(values),
                                                     ctypes.cast(values, ctypes.c_void_p)),
                   f"set {what}")

    def _set_ints(self, desc: ctypes.c_void_p, name: int, values: Sequence[int],
                  what: str) -> None:
        self._set(desc, name, _T_INT64, (ctypes.c_int64 * len(values))(*values), what)

    def _set_enum(self, desc: ctypes.c_void_p, name: int, kind: int, value: int,
                  what: str) -> None:
        self._set(desc, name, kind, (ctypes.c_int * 1)(value), what)

    def _set_descs(self, desc: ctypes.c_void_p, name: int, values: Sequence[ctypes.c_void_p],
                   what: str) -> None:
        self._set(desc, name, _T_BACKEND_DESCRIPTOR, (ctypes.c_void_p * len(values))(*values),
                  what)

    def _finalize(self, desc: ctypes.c_void_p, what: str) -> None:
        self.check(self.raw.cudnnBackendFinalize(desc), f"finalize {what}")

    def _get_int(self, desc: ctypes.c_void_p, name: int, what: str) -> int:
        value, count = ctypes.c_int64(0), ctypes.c_int64(0)
        self.check(self.raw.cudnnBackendGetAttribute(desc, name, _T_INT64, 1, ctypes.byref(count),
                                                     ctypes.cast(ctypes.byref(value),
                                                                 ctypes.c_void_p)),
                   f"get {what}")
        return int(value.value)

    def _get_descs(self, desc: ctypes.c_void_p, name: int, made: List[ctypes.c_void_p],
                   what: str) -> List[ctypes.c_void_p]:
        array = (ctypes.c_void_p * len(made))(*made)
        count = ctypes.c_int64(0)
        self.check(self.raw.cudnnBackendGetAttribute(desc, name, _T_BACKEND_DESCRIPTOR, len(made),
                                                     ctypes.byref(count),
                                                     ctypes.cast(array, ctypes.c_void_p)),
                   f"get {what}")
        return made[:count.value]

    def _count(self, desc: ctypes.c_void_p, name: int, kind: int, what: str) -> int:
        count = ctypes.c_int64(0)
        self.check(self.raw.cudnnBackendGetAttribute(desc, name, kind, 0, ctypes.byref(count),
                                                     None), f"count {what}")
        return int(count.value)

    # --- planning ------------------------------------------------------------------------------

    def _device(self, descs: _Descriptors, description_json: str) -> ctypes.c_void_p:
        device = descs.new(_DEVICEPROP)
        text = description_json.encode()
        buffer = ctypes.create_string_buffer(text)  # NUL-terminated: the count includes it
        status = self.raw.cudnnBackendSetAttribute(device, _A_DEVICEPROP_JSON, _T_CHAR,
                                                   len(text) + 1,
                                                   ctypes.cast(buffer, ctypes.c_void_p))
        if status == 0:
            status = self.raw.cudnnBackendFinalize(device)
        if status != 0:
            raise CudnnPlanningUnavailable(
                f"cuDNN {self.version_text} rejects the device description: {self.message(status)}")
        return device

    def _tensor(self, descs: _Descriptors, uid: int, dims: Sequence[int], strides: Sequence[int],
                data_type: int) -> ctypes.c_void_p:
        tensor = descs.new(_TENSOR)
        self._set_enum(tensor, _A_TENSOR_DATA_TYPE, _T_DATA_TYPE, data_type, "tensor data type")
        self._set_ints(tensor, _A_TENSOR_DIMS, dims, "tensor dims")
        self._set_ints(tensor, _A_TENSOR_STRIDES, strides, "tensor strides")
        self._set_ints(tensor, _A_TENSOR_UID, [uid], "tensor uid")
        self._set_ints(tensor, _A_TENSOR_ALIGNMENT, [_ALIGNMENT], "tensor alignment")
        self._finalize(tensor, "tensor")
        return tensor

    def _graph(self, descs: _Descriptors, conv: Convolution, call: ConvCall) -> ctypes.c_void_p:
        data_type, _, compute_type = _DATA_TYPES[conv.dtype]
        x_dims, w_dims, y_dims = conv.shapes()
        tensors = [self._tensor(descs, uid, dims, conv.strides(dims), data_type)
                   for uid, dims in ((1, x_dims), (2, w_dims), (3, y_dims))]
        geometry = descs.new(_CONVOLUTION)
        self._set_enum(geometry, _A_CONV_COMP_TYPE, _T_DATA_TYPE, compute_type, "compute type")
        self._set_enum(geometry, _A_CONV_MODE, _T_CONVOLUTION_MODE, _CROSS_CORRELATION, "mode")
        self._set_ints(geometry, _A_CONV_SPATIAL_DIMS, [2], "spatial dims")
        self._set_ints(geometry, _A_CONV_DILATIONS, conv.dilation, "dilations")
        self._set_ints(geometry, _A_CONV_STRIDES, conv.stride, "strides")
        self._set_ints(geometry, _A_CONV_PRE_PADDINGS, conv.padding, "pre paddings")
        self._set_ints(geometry, _A_CONV_POST_PADDINGS, conv.padding, "post paddings")
        self._finalize(geometry, "convolution")
        kind, alpha_name, tensor_names = _OPERATION[call]
        operation = descs.new(kind)
        scalar_type, scalar = ((_T_DOUBLE, ctypes.c_double) if compute_type == 1
                               else (_T_FLOAT, ctypes.c_float))
        self._set(operation, alpha_name, scalar_type, (scalar * 1)(1.0), "alpha")
        self._set(operation, alpha_name + 1, scalar_type, (scalar * 1)(0.0), "beta")
        self._set_descs(operation, alpha_name + 2, [geometry], "convolution descriptor")
        for name, tensor in zip(tensor_names, tensors):
            self._set_descs(operation, name, [tensor], "operation tensor")
        self._finalize(operation, f"{call.value} operation")
        graph = descs.new(_OPERATIONGRAPH)
        self._set_descs(graph, _A_GRAPH_OPS, [operation], "graph operations")
        self._finalize(graph, "operation graph")
        return graph

    def _configs(self, descs: _Descriptors, graph: ctypes.c_void_p, device: ctypes.c_void_p,
                 mode: HeuristicMode) -> List[ctypes.c_void_p]:
        heuristics = descs.new(_ENGINEHEUR)
        self._set_descs(heuristics, _A_HEUR_GRAPH, [graph], "heuristics graph")
        self._set_enum(heuristics, _A_HEUR_MODE, _T_HEUR_MODE, _MODE_VALUE[mode], "heur mode")
        self._set_descs(heuristics, _A_HEUR_DEVICEPROP, [device], "heuristics device")
        if self.raw.cudnnBackendFinalize(heuristics) != 0:
            return []  # this mode has nothing for the graph; the next mode may
        count = self._count(heuristics, _A_HEUR_RESULTS, _T_BACKEND_DESCRIPTOR, "results")
        made = [descs.new(_ENGINECFG) for _ in range(count)]
        return self._get_descs(heuristics, _A_HEUR_RESULTS, made, "heuristics results")

    def _describe(self, descs: _Descriptors, config: ctypes.c_void_p
                  ) -> Tuple[int, Tuple[Tuple[int, int], ...], Tuple[NumericalNote, ...]]:
        engine = self._get_descs(config, _A_CFG_ENGINE, [descs.new(_ENGINE)], "engine")[0]
        index = self._get_int(engine, _A_ENGINE_GLOBAL_INDEX, "engine index")
        notes_array = (ctypes.c_int * _NUMERICAL_NOTE_COUNT)()
        count = ctypes.c_int64(0)
        self.check(self.raw.cudnnBackendGetAttribute(
            engine, _A_ENGINE_NUMERICAL_NOTE, _T_NUMERICAL_NOTE, _NUMERICAL_NOTE_COUNT,
            ctypes.byref(count), ctypes.cast(notes_array, ctypes.c_void_p)), "get notes")
        notes = tuple(NumericalNote(n) for n in notes_array[:count.value]
                      if n in NumericalNote._value2member_map_)
        made = [descs.new(_KNOB_CHOICE) for _ in range(_KNOB_TYPE_COUNTS)]
        knobs = []
        for choice in self._get_descs(config, _A_CFG_KNOBS, made, "knob choices"):
            knob_type = (ctypes.c_int * 1)()
            self.check(self.raw.cudnnBackendGetAttribute(
                choice, _A_KNOB_TYPE, _T_KNOB_TYPE, 1, ctypes.byref(count),
                ctypes.cast(knob_type, ctypes.c_void_p)), "get knob type")
            knobs.append((int(knob_type[0]), self._get_int(choice, _A_KNOB_VALUE, "knob value")))
        return index, tuple(sorted(knobs)), notes

    def plans(self, description_json: str, conv: Convolution, call: ConvCall,
              modes: Sequence[HeuristicMode] = DEFAULT_MODES,
              stop: Optional[Callable[[Plan], bool]] = None) -> List[Plan]:
        """The plans cuDNN finalizes for one call, in the heuristics' order (see the module doc):
        each mode of ``modes`` in turn, a plan offered by two modes kept at its first place;
        with ``stop``, none after the first plan for which it is true (finalizing a plan is
        most of a query's cost).

        Raises ``CudnnPlanningUnavailable`` when this cuDNN is older than 9.11 or rejects the
        description; an empty list means no engine supports the convolution.
        """
        if not self.deviceless:
            raise CudnnPlanningUnavailable(
                f"cuDNN {self.version_text} ({self.path}) cannot plan without a GPU: deviceless"
                " execution plans need cuDNN 9.11 or newer")
        descs = _Descriptors(self)
        try:
            device = self._device(descs, description_json)
            graph = self._graph(descs, conv, call)
            found: List[Plan] = []
            seen = set()
            for mode in modes:
                for config in self._configs(descs, graph, device, mode):
                    plan = descs.new(_EXECUTION_PLAN)
                    self._set_descs(plan, _A_PLAN_CONFIG, [config], "plan config")
                    self._set_descs(plan, _A_PLAN_DEVICEPROP, [device], "plan device")
                    if self.raw.cudnnBackendFinalize(plan) != 0:
                        continue  # the engine cannot run this graph on this device
                    engine, knobs, notes = self._describe(descs, config)
                    if (engine, knobs) in seen:
                        continue
                    seen.add((engine, knobs))
                    found.append(Plan(engine, knobs,
                                      self._get_int(plan, _A_PLAN_WORKSPACE, "workspace size"),
                                      mode, notes))
                    if stop is not None and stop(found[-1]):
                        return found
            return found
        finally:
            descs.close()


def description_json(description: DeviceDescription) -> str:
    """The JSON text of a device description, with the keys cuDNN's parser reads."""
    limits = description.limits
    major, minor = description.compute_capability
    return json.dumps({
        "deviceName": description.device_name,
        "deviceVer": major * 100 + minor * 10,  # 800 for 8.0, as CUDNN_SM_80 in cudnn_version.h
        "multiProcessorCount": description.multi_processor_count,
        "smCountOrigin": 0,  # the whole device (not a green context's share)
        "warpSize": limits.warp_size,
        "maxGridSize": list(limits.max_grid_size),
        "maxBlockSize": list(limits.max_block_size),
        "maxThreadsPerBlock": limits.max_threads_per_block,
        "maxThreadsPerSM": limits.max_threads_per_sm,
        "maxCtasPerSM": limits.max_ctas_per_sm,
        "regsPerBlock": limits.registers_per_block,
        "maxRegistersPerSM": limits.registers_per_sm,
        "maxSharedMemoryPerBlock": limits.shared_memory_per_block,
        "maxSharedMemoryPerBlockOptin": limits.shared_memory_per_block_optin,
        "reservedSharedMemoryPerBlock": limits.reserved_shared_memory_per_block,
        "l2CacheSize": description.l2_cache_bytes,
        "totalGlobalMem": description.total_global_memory,
        "smClockRateKHz": description.sm_clock_khz,
        "memClockRateKHz": description.memory_clock_khz,
        "pciDeviceId": description.pci_device_id or 0,
        "isTccDriver": 0,  # Linux
        "supportCoopLaunch": 1,  # every compute capability >= 6.0
        "cudaDeviceId": 0,
        # The CUDA driver API version the description claims (cuDNN 9.24's cu13 build asks for
        # one; 13.0 as CUDA encodes it, 1000 * major + 10 * minor).
        "driverVer": 13000,
    }, sort_keys=True)


@functools.cache
def load_cudnn(path: Optional[str] = None) -> CudnnLibrary:
    """The libcudnn at ``path``, or the one this environment's torch uses (``find_libcudnn``).

    Raises ``CudnnPlanningUnavailable`` when there is none.
    """
    found = path or find_libcudnn()
    if not found:
        raise CudnnPlanningUnavailable(
            "no libcudnn found (not loaded by torch, no nvidia-cudnn wheel on sys.path, none in"
            " torch/lib or on the library path): cuDNN's heuristics cannot size convolution"
            " workspaces here")
    return CudnnLibrary(found)


def conv_plans(gpu: GPU, conv: Convolution, call: ConvCall,
               library: Optional[CudnnLibrary] = None,
               modes: Sequence[HeuristicMode] = DEFAULT_MODES,
               stop: Optional[Callable[[Plan], bool]] = None) -> List[Plan]:
    """cuDNN's plans for one convolution call on a catalogue GPU, in the order a caller tries them
    (``stop``: see ``CudnnLibrary.plans``).

    Raises ``CudnnPlanningUnavailable`` (naming the cuDNN version) where this environment's
    cuDNN cannot plan without the GPU.
    """
    lib = library or load_cudnn()
    return lib.plans(description_json(device_description(gpu)), conv, call, modes, stop)


def conv_workspaces(gpu: GPU, conv: Convolution, call: ConvCall,
                    library: Optional[CudnnLibrary] = None) -> List[int]:
    """The ordered workspace sizes (bytes) of ``conv_plans``."""
    return [plan.workspace_bytes for plan in conv_plans(gpu, conv, call, library)]


# --- PyTorch's order and filters (cudnn.benchmark off) -----------------------------------------
#
# What PyTorch's cuDNN convolutions do with the heuristics, read from
# aten/src/ATen/native/cudnn/Conv_v8.cpp (pytorch main as of the 2.14 release; the function
# names below are that file's, the quoted conditions its own):
#
# - ``raw_cudnn_convolution_{forward,backward_input,backward_weight}_out`` go to
#   ``run_single_conv`` (the v8 API) unless ``TORCH_CUDNN_V8_API_DISABLED`` is set
#   (``cudnnv8_enabled_check_debug``, ConvUtils.h); the v7 path is not modelled here.
# - ``run_single_conv`` first looks the call up in its per-thread plan cache (``find(key)``:
#   shapes, strides, dtype, memory format, padding, stride, dilation, groups, deterministic,
#   allow_tf32, alignment); a cached plan runs again with the same workspace.
# - Without ``benchmark``: ``get_configs_from_heuristics`` with ``heuristic_mode =
#   cudnnv8_use_heur_mode_b() ? CUDNN_HEUR_MODE_B : CUDNN_HEUR_MODE_INSTANT``: the top
#   heuristics config, then every heuristics config after it (``get_all_heuristic_configs``),
#   then the fallback list (``EngineFallbackListBuilder``, which asks CUDNN_HEUR_MODE_FALLBACK,
#   cudnn_frontend_EngineFallbackList.h). Each list goes through ``filterEngineConfigs`` first.
# - ``filterEngineConfigs`` drops a config when
#     ``deterministic`` and it has CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC;
#     it has CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS (any dtype);
#     ``scalar_type == kFloat`` and ``!allow_tf32`` and it has CUDNN_NUMERICAL_NOTE_TENSOR_CORE.
# - ``try_configs`` builds each config's plan (a config cuDNN cannot build is skipped: a
#   ``cudnnException``), skips it when ``plan_errata_exception`` says so, and runs it:
#   ``run_conv_plan`` allocates the plan's workspace from the caching allocator; an
#   ``OutOfMemoryError`` there is caught and the next config is tried. The first that runs wins
#   (and is cached). None left: "GET was unable to find an engine to execute this computation".
# - ``plan_errata_exception`` blocks a plan whose tag (operation, "_eng", engine index) matches a
#   rule, the version range being the cuDNN torch was compiled with (``CUDNN_VERSION`` in
#   cudnn_frontend_Errata.h ``check_rule``; start inclusive, end exclusive, -1 open): the rules
#   in ``TORCH_ERRATA`` below, those of a JSON file named by ``CUDNN_ERRATA_JSON_FILE``
#   (``load_from_config``), and a 3-D rule for 5-D tensors only (not modelled: 2-D here).
#
# The list here keeps a plan at its first place when both the heuristics and the fallback list
# offer it (torch would try it twice; the second try allocates the same workspace and fails the
# same way), so the workspaces it gives are the ones torch tries, in order.

_ERRATA_OPERATION = {ConvCall.FORWARD: "ConvFwd", ConvCall.BACKWARD_DATA: "ConvBwdData",
                     ConvCall.BACKWARD_FILTER: "ConvBwdFilter"}  # cudnn_frontend_Operation.h tags


@dataclass(frozen=True)
class ErrataRule:
    """A cuDNN frontend errata rule as ``plan_errata_exception`` applies it."""

    rule_id: str
    operation: str  # "ConvFwd", "ConvBwdData", "ConvBwdFilter"
    engine: int
    cudnn_start: int = 0  # inclusive
    cudnn_end: Optional[int] = None  # exclusive; None (-1 in the JSON) for no end
    knobs: Tuple[str, ...] = ()  # substrings of the plan tag ("k2=4"), every one must occur
    sm_version: Optional[int] = None  # only on this architecture (1200 for sm_120)

    def blocks(self, call: ConvCall, plan: Plan, compiled_cudnn: int,
               compute_capability: Tuple[int, int]) -> bool:
        if self.operation != _ERRATA_OPERATION[call] or self.engine != plan.engine:
            return False
        if compiled_cudnn < self.cudnn_start:
            return False
        if self.cudnn_end is not None and compiled_cudnn >= self.cudnn_end:
            return False
        if self.sm_version is not None:
            major, minor = compute_capability
            if major * 100 + minor * 10 != self.sm_version:
                return False
        return all(knob in plan.tag for knob in self.knobs)


# The rules compiled into Conv_v8.cpp's ``plan_errata_exception`` (all three JSON texts are in
# torch 2.14.1's libtorch_cuda.so: ``strings`` shows them). "188288": forward engine 5 with
# cuDNN 9.23.1 up to 9.24.0. The sm_120 rules (forward engine 58, data and weight gradient
# engine 63, cuDNN >= 9.23.0) apply only where the plan's engine targets sm_120 (the source
# checks the plan JSON's ``smVersion == 1200``; here the GPU's compute capability 12.0) and are
# compiled in only with cuBLAS older than 13.6.1 (``#if CUBLAS_VERSION < 130601``).
TORCH_ERRATA: Tuple[ErrataRule, ...] = (
    ErrataRule("188288", "ConvFwd", 5, 92301, 92400),
    ErrataRule("sm120_conv_fwd_engine_58", "ConvFwd", 58, 92300, None, sm_version=1200),
    ErrataRule("sm120_conv_bwd_data_engine_63", "ConvBwdData", 63, 92300, None, sm_version=1200),
    ErrataRule("sm120_conv_bwd_filter_engine_63", "ConvBwdFilter", 63, 92300, None,
               sm_version=1200),
)
_ERRATA_FILE_LIMIT = 1 << 20  # bytes of a CUDNN_ERRATA_JSON_FILE read (a bound, not cuDNN's)


def errata_rules_from_json(text: str) -> Tuple[ErrataRule, ...]:
    """The rules of a cuDNN errata JSON text (``{"version": 1, "rules": [...]}``, the format of
    cudnn_frontend_Errata.h: operation, engine, cudnn_version_start/_end, knob). Rules with
    shape filters apply only in the frontend's opGraph overload, which torch does not call:
    they are kept without their shapes, as torch applies them. ValueError when malformed."""
    try:
        rules = json.loads(text)["rules"]
        out = []
        for rule in rules:
            end = rule.get("cudnn_version_end")
            out.append(ErrataRule(str(rule.get("rule_id", "")), str(rule["operation"]),
                                  int(rule["engine"]), int(rule.get("cudnn_version_start", 0)),
                                  None if end is None or int(end) < 0 else int(end),
                                  tuple(str(k) for k in rule.get("knob", ()))))
        return tuple(out)
    except (ValueError, KeyError, TypeError) as err:
        raise ValueError(f"malformed cuDNN errata JSON: {err}") from None


def errata_from_env(env: Optional[Mapping[str, str]] = None) -> Tuple[ErrataRule, ...]:
    """The rules of the file ``CUDNN_ERRATA_JSON_FILE`` names; none when unset or unreadable
    (``load_from_config`` then answers false and only the compiled-in rules apply)."""
    env = os.environ if env is None else env
    path = env.get("CUDNN_ERRATA_JSON_FILE")
    if not path:
        return ()
    try:
        with open(path, encoding="utf-8") as handle:
            text = handle.read(_ERRATA_FILE_LIMIT)
    except OSError:
        return ()
    return errata_rules_from_json(text)


@dataclass(frozen=True)
class TorchVerdict:
    """One plan of the heuristics and whether PyTorch tries it (``dropped`` None) or why not."""

    plan: Plan
    dropped: Optional[str]


def torch_verdicts(gpu: GPU, conv: Convolution, call: ConvCall, allow_tf32: bool = True,
                   deterministic: bool = False, *, heuristic_mode_b: bool = False,
                   benchmark: bool = False, compiled_cudnn: Optional[int] = None,
                   extra_errata: Sequence[ErrataRule] = (),
                   library: Optional[CudnnLibrary] = None,
                   until_no_workspace: bool = False) -> List[TorchVerdict]:
    """Every plan of the heuristics PyTorch asks (see above), in order, with the reason it is
    dropped or None. ``allow_tf32`` and ``deterministic`` are torch.backends.cudnn's flags (the
    defaults are torch's); ``heuristic_mode_b`` is TORCH_CUDNN_USE_HEURISTIC_MODE_B, which
    ``benchmark`` (cudnn.benchmark: the plans ``get_plans_from_find`` times) ignores, as
    torch's find path always asks ``CUDNN_HEUR_MODE_INSTANT``; ``compiled_cudnn`` the cuDNN
    version torch was built with (``torch._C._cudnn.getCompileVersion()``; default the loaded
    library's, as a torch wheel pins the cuDNN it was built with); ``extra_errata`` the rules of
    a CUDNN_ERRATA_JSON_FILE (``errata_from_env``); ``until_no_workspace``: no plan after the
    first one torch tries that needs no workspace (it always runs: try_plans never goes past
    it), which spares finalizing the rest."""
    lib = library or load_cudnn()
    first = HeuristicMode.B if heuristic_mode_b and not benchmark else HeuristicMode.INSTANT
    version = lib.version if compiled_cudnn is None else compiled_cudnn
    rules = tuple(TORCH_ERRATA) + tuple(extra_errata)

    def dropped(plan: Plan) -> Optional[str]:
        return _torch_drops(plan, conv, call, allow_tf32, deterministic, rules, version,
                            gpu.compute_capability)

    def runs_without_workspace(plan: Plan) -> bool:
        return plan.workspace_bytes == 0 and dropped(plan) is None

    plans = conv_plans(gpu, conv, call, lib, (first, HeuristicMode.FALLBACK),
                       runs_without_workspace if until_no_workspace else None)
    return [TorchVerdict(plan, dropped(plan)) for plan in plans]


def _torch_drops(plan: Plan, conv: Convolution, call: ConvCall, allow_tf32: bool,
                 deterministic: bool, rules: Sequence[ErrataRule], compiled_cudnn: int,
                 compute_capability: Tuple[int, int]) -> Optional[str]:
    # filterEngineConfigs: "if (deterministic) { if (hasNumericalNote<
    # CUDNN_NUMERICAL_NOTE_NONDETERMINISTIC>(c)) return true; }"
    if deterministic and NumericalNote.NONDETERMINISTIC in plan.notes:
        return "nondeterministic (torch.backends.cudnn.deterministic)"
    # filterEngineConfigs: "if (hasNumericalNote<CUDNN_NUMERICAL_NOTE_DOWN_CONVERT_INPUTS>(c))
    # return true;" for every dtype
    if NumericalNote.DOWN_CONVERT_INPUTS in plan.notes:
        return "down-converts its inputs"
    # filterEngineConfigs: "if (scalar_type == kFloat) { if (!allow_tf32 && hasNumericalNote<
    # CUDNN_NUMERICAL_NOTE_TENSOR_CORE>(c)) return true; }"
    if conv.dtype == "float32" and not allow_tf32 and NumericalNote.TENSOR_CORE in plan.notes:
        return "TF32 tensor cores (torch.backends.cudnn.allow_tf32 off)"
    # try_configs: "if (plan_errata_exception(handle, plan, x)) { continue; }"
    for rule in rules:
        if rule.blocks(call, plan, compiled_cudnn, compute_capability):
            return f"errata rule {rule.rule_id}"
    return None


def torch_plans(gpu: GPU, conv: Convolution, call: ConvCall, allow_tf32: bool = True,
                deterministic: bool = False, **options: object) -> List[Plan]:
    """The plans PyTorch tries for one convolution call, in its order (``torch_verdicts``)."""
    return [v.plan for v in torch_verdicts(gpu, conv, call, allow_tf32, deterministic,
                                           **options)  # type: ignore[arg-type]
            if v.dropped is None]


def torch_workspaces(gpu: GPU, conv: Convolution, call: ConvCall, allow_tf32: bool = True,
                     deterministic: bool = False, **options: object) -> List[int]:
    """The workspaces (bytes) PyTorch asks the caching allocator for, in the order it tries them:
    the first one the allocator can give runs (``try_configs`` catches the OutOfMemoryError of
    the others), so a simulator offers them in this order (``first_fitting``)."""
    return [p.workspace_bytes for p in torch_plans(gpu, conv, call, allow_tf32, deterministic,
                                                   **options)]


def first_fitting(workspaces: Sequence[int], available: int) -> Optional[int]:
    """The workspace torch ends up with when the allocator can give at most ``available`` bytes
    at once: the first of ``workspaces`` that fits, None when none does (torch then raises
    "GET was unable to find an engine to execute this computation")."""
    return next((size for size in workspaces if size <= available), None)


# --- cudnn.benchmark: the workspace the search itself holds -----------------------------------
#
# With ``benchmark`` on, ``run_single_conv`` calls ``get_plans_from_find`` (Conv_v8.cpp) the
# first time it meets a call: the same sources (``CUDNN_HEUR_MODE_INSTANT`` with every
# heuristics config, then the fallback list, ``filterEngineConfigs``), every plan built with the
# errata as its predicate, then ``generate_and_filter_plans``:
#   ``max_block_size = get_available_workspace()`` (``CUDACachingAllocator::cacheInfo``: the
#   device's free memory, ``cudaMemGetInfo``, or the largest cached free block if larger);
#   plans whose workspace exceeds it are dropped, and ``max_workspace_size`` is the largest left;
#   "while (max_workspace_size) { try { allocate(max_workspace_size); break; } catch
#   (OutOfMemoryError) { max_workspace_size /= 2; ... remove_invalid = true; } }": one block,
#   halved until the allocator gives it, and the plans above it dropped;
#   the plans are timed with that block as their shared workspace (``time_sorted_plan``, at most
#   ``cudnn.benchmark_limit`` of them, 10000 when 0), fastest first.
# The block is freed when ``get_plans_from_find`` returns; then, when
# ``_cudnn_get_conv_benchmark_empty_cache()`` (on unless turned off), "Replicate v7 behavior:
# clear cached blocks": ``emptyCache()``; then ``try_plans`` runs the fastest plan that fits.
# Which plan is fastest is a measurement on the GPU: the workspace it then takes is one of the
# plans left, at most the search's block.


def benchmark_search_block(workspaces: Sequence[int], available: int,
                           fits: Optional[Callable[[int], bool]] = None) -> int:
    """The workspace block ``generate_and_filter_plans`` allocates while it times the plans
    whose workspaces are ``workspaces`` (``torch_workspaces(..., benchmark=True)``):
    ``available`` is ``get_available_workspace()`` (free device memory, or the largest cached
    free block if larger), ``fits(size)`` whether the caching allocator can give ``size`` bytes
    now (default: whenever ``size <= available``); 0 when no plan needs a workspace."""
    fits = fits if fits is not None else (lambda size: size <= available)
    size = max((w for w in workspaces if w <= available), default=0)
    while size and not fits(size):
        size //= 2  # "max_workspace_size /= 2"
    return size


# --- From a probe mark to the calls cuDNN runs ----------------------------------------------------

def mark_calls(mark: ConvMark) -> List[Tuple[Convolution, ConvCall]]:
    """The cuDNN calls of one ``cudnn:`` mark, each as the convolution cuDNN is asked for.

    A convolution's calls are its own. A transposed convolution runs through cuDNN as the
    gradient of a convolution from the mark's output to its input (ConvShared.cpp
    ``cudnn_convolution_transpose``: the forward is ``raw_cudnn_convolution_backward_input_out``,
    the input's gradient ``raw_cudnn_convolution_forward_out``, the weight's
    ``raw_cudnn_convolution_backward_weight_out`` with input and output gradient swapped).
    ValueError for a mark of an older trace (no geometry, dtype or layout: those keep the
    fitted rule) or one that is not a 2-D convolution.
    """
    if mark.stride is None or mark.padding is None or mark.dilation is None or not mark.dtype:
        raise ValueError("a cudnn: mark without geometry and dtype (an older trace)")
    if len(mark.x) != 4 or len(mark.w) != 4 or len(mark.y) != 4:
        raise ValueError(f"not a 2-D convolution: x={mark.x} w={mark.w}")
    source, target = (mark.y, mark.x) if mark.transposed else (mark.x, mark.y)
    conv = Convolution(batch=source[0], in_channels=source[1], height=source[2],
                       width=source[3], out_channels=mark.w[0],
                       kernel=(mark.w[2], mark.w[3]),
                       stride=(mark.stride[0], mark.stride[1]),
                       padding=(mark.padding[0], mark.padding[1]),
                       dilation=(mark.dilation[0], mark.dilation[1]), groups=mark.groups,
                       dtype=mark.dtype, channels_last=bool(mark.channels_last))
    if tuple(conv.shapes()[2]) != tuple(target):
        raise ValueError(f"the mark's geometry does not turn {source} into {target}")
    if mark.transposed:
        calls = {"fwd": ConvCall.BACKWARD_DATA, "bwd_data": ConvCall.FORWARD,
                 "bwd_filter": ConvCall.BACKWARD_FILTER}
    else:
        calls = {c.value: c for c in ConvCall}
    return [(conv, calls[name]) for name in mark.calls]
