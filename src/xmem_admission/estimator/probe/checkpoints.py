"""Checkpoints in fake mode: a safetensors file is read for its header, never for its weights.

A fine-tune starts with ``from_pretrained``, which opens every safetensors shard with
``safetensors.safe_open`` and slices each tensor out of it (transformers 5.x: ``get_slice`` then
``[...]``; 4.x: ``get_tensor``), or calls ``safetensors.torch.load_file``. In fake mode the probe
answers those calls from the file's header alone (the safetensors format: an 8-byte
little-endian length, then a JSON object naming each tensor's dtype, shape and data offsets):
every tensor comes back as a host fake tensor of that shape and dtype without a value, so a
checkpoint of any size costs the same time and host memory, and none of its data pages is read.

A model named by its Hub id downloads its config and tokenizer as usual; its safetensors files
are fetched as their headers only (two HTTP range requests each) into a private folder of this
process, as sparse files of the full size (never into the Hugging Face cache, where a real run
would later find zeros for weights).

Everything is hooked lazily: safetensors, huggingface_hub and transformers are patched when the
script imports them (or at once if already imported), never imported by the probe itself, and
only in fake mode. ``torch.load`` of a pickled checkpoint stays in ``torch_patches``.
"""

from __future__ import annotations

import functools
import json
import os
import sys
from concurrent.futures import Future
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

import torch
from torch.utils._python_dispatch import _disable_current_modes

from xmem_admission.estimator.probe.distributed import _AfterImport
from xmem_admission.estimator.probe.leave import remove_at_exit

# safetensors' limit on the JSON header (safetensors/src/tensor.rs, MAX_HEADER_SIZE): a longer
# one is refused by the library itself, so it is refused here too, before it is read.
MAX_HEADER_BYTES = 100_000_000

# The dtype names of the safetensors format (safetensors/src/tensor.rs, ``enum Dtype``) and the
# torch dtype each stands for (safetensors/torch.py, ``_TYPES``); a torch without one of them
# (float8 before 2.1, unsigned 16-64 bits before 2.3) cannot hold such a tensor.
_DTYPE_NAMES = {
    "BOOL": "bool", "U8": "uint8", "I8": "int8", "I16": "int16", "U16": "uint16",
    "I32": "int32", "U32": "uint32", "I64": "int64", "U64": "uint64",
    "F16": "float16", "BF16": "bfloat16", "F32": "float32", "F64": "float64",
    "C64": "complex64", "F8_E4M3": "float8_e4m3fn", "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2": "float8_e5m2", "F8_E5M2FNUZ": "float8_e5m2fnuz", "F8_E8M0": "float8_e8m0fnu",
}


class _Run:
    """What the current probe run lends the hooks (set through the run's patches, so restoring
    them leaves every hook answering as the library would)."""

    tracker: Any = None
    workdir: Optional[str] = None
    # local stand-ins of Hub files that hold their header only (``header_file``): no value
    headers_only: Set[str] = set()


RUN = _Run()

# Tensors of at most this many bytes are read for their values: what a library decides on, not
# weights. bitsandbytes' pre-quantized checkpoints store each layer's quantization state as a
# packed JSON uint8 tensor of a few hundred bytes, 256-entry float32 code maps (1,024 bytes) and a
# one-byte ``weight_format`` (bitsandbytes/functional.py, QuantState.as_dict(packed=True) and
# from_dict; nn/modules.py, Int8Params / _load_from_state_dict), which it parses when loading.
SMALL_VALUE_BYTES = 4096

_SAFETENSORS = _AfterImport("safetensors")
_SAFETENSORS_TORCH = _AfterImport("safetensors.torch")
_HUB_DOWNLOAD = _AfterImport("huggingface_hub.file_download")
_TRANSFORMERS_HUB = _AfterImport("transformers.utils.hub")
_TRANSFORMERS_LOADING = _AfterImport("transformers.core_model_loading")


def install(patches: Any, tracker: Any, fake: bool) -> None:
    """Hook safetensors, huggingface_hub and transformers for this run (the headers: fake mode
    only; transformers' loader threads run inline in both modes, so that what they copy onto
    the GPU is traced: in profile mode a copy from a thread of its own reaches the CUDA
    runtime, which the probe's virtual GPU only answers on the script's thread)."""
    hooks: Tuple[Tuple[Any, Callable[[Any, Any, bool], None]], ...] = (
        (_TRANSFORMERS_LOADING, _patch_transformers_loading),)
    if fake:
        patches.set(RUN, "tracker", tracker)
        hooks += ((_SAFETENSORS, _patch_safetensors),
                  (_SAFETENSORS_TORCH, _patch_safetensors_torch),
                  (_HUB_DOWNLOAD, _patch_hub_download),
                  (_TRANSFORMERS_HUB, _patch_transformers_hub))
    for hook, patch in hooks:
        module = sys.modules.get(hook.name)
        if module is not None:
            patch(patches, module, True)
        else:
            hook.arm(patches, _after_import(patches, patch))


def _after_import(patches: Any, patch: Callable[[Any, Any, bool], None]
                  ) -> Callable[[Any], None]:
    def then(module: Any) -> None:
        patch(patches, module, False)

    return then


def _replace(patches: Any, module: Any, name: str, replacement: Any, loaded_before: bool) -> None:
    """``module.name = replacement``; for a module imported before the run, also wherever
    another module took the original by name (``from safetensors import safe_open``)."""
    original = getattr(module, name, None)
    if original is None:
        return
    patches.set(module, name, replacement)
    if not loaded_before:
        return
    for other in list(sys.modules.values()):
        held = getattr(other, "__dict__", None)
        if other is module or not isinstance(held, dict):
            continue
        for key, value in list(held.items()):
            if value is original:
                patches.set(other, key, replacement)


# -- the header ---------------------------------------------------------------------------------
class Header:
    """A safetensors file's header: ``tensors`` maps each name to (dtype name, shape, begin,
    end), offsets counted from the end of the header; ``size`` is the whole file's."""

    def __init__(self, tensors: Dict[str, Tuple[str, Tuple[int, ...], int, int]],
                 metadata: Optional[Dict[str, str]], size: int) -> None:
        self.tensors = tensors
        self.metadata = metadata
        self.size = size


def _error(message: str) -> Exception:
    """The error safetensors itself raises for a bad file, where it is loaded."""
    module = sys.modules.get("safetensors")
    kind = getattr(module, "SafetensorError", None)
    return kind(message) if isinstance(kind, type) else ValueError(message)


def header_length(prefix: bytes, total: int, origin: str) -> int:
    """The JSON header's length from a file's first 8 bytes, checked against the file's size."""
    if len(prefix) < 8:
        raise _error(f"{origin}: not a safetensors file ({len(prefix)} bytes, the header's "
                     f"length alone takes 8)")
    length = int.from_bytes(prefix[:8], "little")
    if length > MAX_HEADER_BYTES:
        raise _error(f"{origin}: the header's length field says {length} bytes, over "
                     f"safetensors' limit of {MAX_HEADER_BYTES}")
    if 8 + length > total:
        raise _error(f"{origin}: the header's length field says {length} bytes, but the file "
                     f"has {total} bytes in all")
    return length


def parse_header(raw: bytes, total: int, origin: str) -> Header:
    """Check and read a JSON header of ``len(raw)`` bytes in a file of ``total`` bytes."""
    try:
        doc = json.loads(bytes(raw).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise _error(f"{origin}: the header is not JSON ({exc})") from None
    if not isinstance(doc, dict):
        raise _error(f"{origin}: the header is not a JSON object")
    data_bytes = total - 8 - len(raw)
    metadata = doc.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in metadata.items())):
        raise _error(f"{origin}: __metadata__ must map strings to strings")
    tensors: Dict[str, Tuple[str, Tuple[int, ...], int, int]] = {}
    for name, info in doc.items():
        where = f"{origin}: tensor {name!r}"
        if not isinstance(info, dict):
            raise _error(f"{where} is not an object")
        dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(
                isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape):
            raise _error(f"{where}: shape {shape!r} is not a list of sizes")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(
                isinstance(o, int) and not isinstance(o, bool) for o in offsets)):
            raise _error(f"{where}: data_offsets {offsets!r} is not [begin, end]")
        begin, end = offsets
        torch_dtype = dtype_of(dtype, where)
        numel = 1
        for d in shape:
            numel *= d
        if not 0 <= begin <= end <= data_bytes:
            raise _error(f"{where}: data_offsets [{begin}, {end}] lie outside the file's "
                         f"{data_bytes} bytes of data")
        if numel * torch_dtype.itemsize != end - begin:
            raise _error(f"{where}: {dtype} {shape} takes {numel * torch_dtype.itemsize} bytes, "
                         f"its data_offsets span {end - begin}")
        tensors[name] = (str(dtype), tuple(shape), begin, end)
    return Header(tensors, metadata, total)


def dtype_of(name: Any, where: str) -> torch.dtype:
    torch_name = _DTYPE_NAMES.get(name) if isinstance(name, str) else None
    dtype = getattr(torch, torch_name, None) if torch_name is not None else None
    if not isinstance(dtype, torch.dtype):
        raise _error(f"{where}: dtype {name!r} is not one this torch ({torch.__version__}) "
                     f"can load from safetensors")
    return dtype


def read_header(path: Any) -> Header:
    """The header of a safetensors file on disk: its first 8 + n bytes, nothing after them."""
    origin = os.fspath(path)
    with open(origin, "rb") as fh:
        fd = fh.fileno()
        if hasattr(os, "posix_fadvise"):
            # No readahead: the kernel would otherwise read the data after the header into the
            # page cache along with it.
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        total = os.fstat(fd).st_size
        length = header_length(fh.read(8), total, origin)
        raw = fh.read(length)
    if len(raw) != length:
        raise _error(f"{origin}: the file ends inside its header")
    return parse_header(raw, total, origin)


# -- fake tensors -------------------------------------------------------------------------------
def _fake(shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
    """A host fake tensor of ``shape`` and ``dtype`` without a value (as a weight adopted as a
    parameter is: ``tracker.adopt_parameter``), made by the run's fake mode on any thread."""
    with torch._C.DisableTorchFunction(), _disable_current_modes():
        with RUN.tracker.fake_mode:
            made: torch.Tensor = torch.empty(tuple(shape), dtype=dtype)
    return made


def _device(device: Any) -> Optional[str]:
    """Where safetensors' ``device`` argument puts tensors (None: the host)."""
    if device is None:
        return None
    if isinstance(device, int) and not isinstance(device, bool):
        return f"cuda:{device}"
    text = str(device)
    return None if text == "cpu" else text


def _placed(tensor: torch.Tensor, device: Optional[str]) -> torch.Tensor:
    """``tensor`` moved where the caller asked, through the virtual device (so it is traced)."""
    if device is None:
        return tensor
    stack = getattr(torch._C, "_len_torch_function_stack", None)
    if stack is not None and stack() == 0:
        from xmem_admission.estimator.probe.outcomes import Refused

        # A thread of the script's own runs without the probe's modes: the copy would be
        # GPU memory nothing records.
        raise Refused(f"a safetensors checkpoint is loaded onto {device} from a thread the "
                      f"probe does not trace; its GPU memory would go unrecorded")
    return tensor.to(device)


class _Slice:
    """``safe_open(...).get_slice(name)``: its shape and dtype; slicing it makes a fake tensor,
    or a real one for a tensor of at most SMALL_VALUE_BYTES whose bytes are at hand (``value``)."""

    def __init__(self, name: str, dtype: str, shape: Tuple[int, ...], device: Optional[str],
                 origin: str, value: Optional[Callable[[], bytes]] = None) -> None:
        self._name, self._dtype, self._shape = name, dtype, shape
        self._device, self._origin = device, origin
        self._value = value

    def get_shape(self) -> List[int]:
        return list(self._shape)

    def get_dtype(self) -> str:
        return self._dtype

    def __getitem__(self, index: Any) -> torch.Tensor:
        dtype = dtype_of(self._dtype, f"{self._origin}: tensor {self._name!r}")
        with torch._C.DisableTorchFunction(), _disable_current_modes():
            if self._value is not None:
                raw = bytearray(self._value())
                flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
                real: torch.Tensor = flat.reshape(self._shape)[index].clone()
                return _placed(real, self._device)
            shape = tuple(torch.empty(self._shape, dtype=dtype, device="meta")[index].shape)
        return _placed(_fake(shape, dtype), self._device)


class HeaderOnlyFile:
    """What ``safetensors.safe_open`` returns in fake mode: every answer from the header."""

    def __init__(self, filename: Any, device: Any) -> None:
        self._origin = os.fspath(filename)
        self._header = read_header(filename)
        self._device = _device(device)

    def __enter__(self) -> HeaderOnlyFile:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def keys(self) -> List[str]:
        return sorted(self._header.tensors)

    def offset_keys(self) -> List[str]:
        return sorted(self._header.tensors, key=lambda k: self._header.tensors[k][2])

    def metadata(self) -> Optional[Dict[str, str]]:
        return self._header.metadata

    def get_slice(self, name: str) -> _Slice:
        dtype, shape, begin, end = self._entry(name)
        value = None
        if end - begin <= SMALL_VALUE_BYTES and self._origin not in RUN.headers_only:
            value = functools.partial(self._read, begin, end)
        return _Slice(name, dtype, shape, self._device, self._origin, value)

    def _read(self, begin: int, end: int) -> bytes:
        """The bytes of one small tensor (offsets from the end of the header)."""
        fd = os.open(self._origin, os.O_RDONLY)
        try:  # without readahead, as the header: the weights around it stay unread
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
            length = header_length(os.pread(fd, 8, 0), self._header.size, self._origin)
            raw = os.pread(fd, end - begin, 8 + length + begin)
        finally:
            os.close(fd)
        if len(raw) != end - begin:
            raise _error(f"{self._origin}: the file ends inside a tensor's data")
        return raw

    def get_tensor(self, name: str) -> torch.Tensor:
        return self.get_slice(name)[...]

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        return {name: self.get_tensor(name) for name in self.offset_keys()}

    def _entry(self, name: str) -> Tuple[str, Tuple[int, ...], int, int]:
        entry = self._header.tensors.get(name)
        if entry is None:
            raise _error(f"File does not contain tensor {name}")
        return entry


def _patch_safetensors(patches: Any, module: Any, loaded_before: bool) -> None:
    real = getattr(module, "safe_open", None)
    if real is None:
        return

    def safe_open(filename: Any, framework: Any, *args: Any, **kwargs: Any) -> Any:
        if RUN.tracker is None or str(framework) not in ("pt", "torch"):
            return real(filename, framework, *args, **kwargs)
        device = args[0] if args else kwargs.get("device", "cpu")
        return HeaderOnlyFile(filename, device)

    _replace(patches, module, "safe_open", safe_open, loaded_before)


def _patch_safetensors_torch(patches: Any, module: Any, loaded_before: bool) -> None:
    real = getattr(module, "load", None)
    if real is None:
        return

    def load(data: Any) -> Dict[str, torch.Tensor]:
        """``safetensors.torch.load(bytes)``: fake tensors from the header in the bytes."""
        if RUN.tracker is None:
            return dict(real(data))
        view = memoryview(data)
        length = header_length(bytes(view[:8]), len(view), "safetensors bytes")
        header = parse_header(bytes(view[8:8 + length]), len(view), "safetensors bytes")
        order = sorted(header.tensors, key=lambda k: header.tensors[k][2])
        base = 8 + length

        def tensor(name: str) -> torch.Tensor:
            dtype, shape, begin, end = header.tensors[name]
            value = None
            if end - begin <= SMALL_VALUE_BYTES:
                value = functools.partial(bytes, view[base + begin:base + end])
            return _Slice(name, dtype, shape, None, "safetensors bytes", value)[...]

        return {name: tensor(name) for name in order}

    _replace(patches, module, "load", load, loaded_before)
    wrapped = getattr(sys.modules.get("safetensors"), "safe_open", None)
    if wrapped is not None and getattr(module, "safe_open", None) is not wrapped:
        patches.set(module, "safe_open", wrapped)  # imported before the probe hooked it


# -- the Hub ------------------------------------------------------------------------------------
def _offline(kwargs: Dict[str, Any]) -> bool:
    if kwargs.get("local_files_only"):
        return True
    constants = sys.modules.get("huggingface_hub.constants")
    is_offline = getattr(constants, "is_offline_mode", None)
    if callable(is_offline):
        return bool(is_offline())
    return bool(getattr(constants, "HF_HUB_OFFLINE", False))


def _hub(module: str) -> Any:
    """A module of huggingface_hub, which the script has imported (the probe never names it in
    an import statement: the bundle carries only what the standard library and torch have)."""
    import importlib

    return importlib.import_module(f"huggingface_hub.{module}")


def _ranged(url: str, headers: Dict[str, str], first: int, last: int) -> Tuple[bytes, int]:
    """Bytes ``first..last`` of a file on the Hub, and the file's size when the answer says it.
    The response is streamed and closed once those bytes are in, so a server that ignores the
    range sends no more than that before the connection is dropped."""
    hub = _hub("utils")
    get_session, hf_raise_for_status = hub.get_session, hub.hf_raise_for_status
    want = last - first + 1
    asked = dict(headers, Range=f"bytes={first}-{last}")
    session = get_session()
    body = bytearray()
    stream = getattr(session, "stream", None)
    if stream is not None and not hasattr(session, "mount"):  # httpx (huggingface_hub 1.x)
        with stream("GET", url, headers=asked) as response:
            if response.status_code >= 400:
                response.read()
                hf_raise_for_status(response)
            status, reply = response.status_code, response.headers
            for chunk in response.iter_bytes():
                body += chunk
                if len(body) >= want + (first if status == 200 else 0):
                    break
    else:  # requests (huggingface_hub 0.x)
        response = session.get(url, headers=asked, stream=True)
        try:
            hf_raise_for_status(response)
            status, reply = response.status_code, response.headers
            for chunk in response.iter_content(chunk_size=1 << 16):
                body += chunk
                if len(body) >= want + (first if status == 200 else 0):
                    break
        finally:
            response.close()
    if status == 200:  # the range was ignored: the file from its start
        body = body[first:]
    total = -1
    content_range = reply.get("Content-Range") or ""
    if "/" in content_range and content_range.rsplit("/", 1)[1].strip().isdigit():
        total = int(content_range.rsplit("/", 1)[1])
    elif status == 200 and str(reply.get("Content-Length", "")).isdigit():
        total = int(reply["Content-Length"])
    if len(body) < want:
        raise _error(f"{url}: asked for bytes {first}-{last}, the server sent {len(body)}")
    return bytes(body[:want]), total


def header_file(repo_id: str, filename: str, *, subfolder: Optional[str] = None,
                repo_type: Optional[str] = None, revision: Optional[str] = None,
                token: Any = None, endpoint: Optional[str] = None,
                headers: Optional[Dict[str, str]] = None, **_ignored: Any) -> str:
    """A safetensors file of a Hub repository as a local sparse file of its full size holding
    its header only (read through the Hub client's own session, endpoint and credentials)."""
    import tempfile

    url = _hub("file_download").hf_hub_url(repo_id, filename, subfolder=subfolder or None, repo_type=repo_type,
                     revision=revision, endpoint=endpoint)
    sent = dict(_hub("utils").build_hf_headers(token=token, headers=headers))
    prefix, total = _ranged(url, sent, 0, 7)
    length = header_length(prefix, total if total >= 0 else 8 + MAX_HEADER_BYTES, url)
    raw, _ = _ranged(url, sent, 8, 7 + length)
    if total < 0:  # no size in the answers: as much data as the header describes
        described = parse_header(raw, 8 + length + (1 << 62), url).tensors.values()
        total = 8 + length + max((entry[3] for entry in described), default=0)
    parse_header(raw, total, url)
    if RUN.workdir is None:
        RUN.workdir = tempfile.mkdtemp(prefix="xmem-checkpoint-headers-")
        remove_at_exit(RUN.workdir)
    parts = [repo_type or "model", *repo_id.split("/"), revision or "main"]
    if subfolder:
        parts.append(subfolder)
    path = os.path.join(RUN.workdir, *parts, *filename.split("/"))
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "wb") as fh:
        fh.write(prefix + raw)
        fh.truncate(total)  # sparse: the data is never written, never on disk
    RUN.headers_only.add(path)
    return path


def _is_weights(filename: Any) -> bool:
    return isinstance(filename, str) and filename.endswith(".safetensors")


def _patch_hub_download(patches: Any, module: Any, loaded_before: bool) -> None:
    real = getattr(module, "hf_hub_download", None)
    if real is None:
        return

    def hf_hub_download(repo_id: str, filename: str, **kwargs: Any) -> Any:
        if (RUN.tracker is None or not _is_weights(filename) or kwargs.get("dry_run")
                or _offline(kwargs)):
            return real(repo_id, filename, **kwargs)
        try:
            return header_file(repo_id, filename, **kwargs)
        except Exception:  # noqa: BLE001 - see _patch_transformers_hub
            return real(repo_id, filename, **kwargs)

    _replace(patches, module, "hf_hub_download", hf_hub_download, loaded_before)


def _patch_transformers_hub(patches: Any, module: Any, loaded_before: bool) -> None:
    """transformers' ``cached_files`` (behind ``cached_file`` and the shard lookup) downloads a
    file, then finds it in the Hugging Face cache: weights are answered with header files."""
    real = getattr(module, "cached_files", None)
    if real is None:
        return

    def cached_files(path_or_repo_id: Any, filenames: List[str], **kwargs: Any) -> Any:
        weights = [f for f in filenames if _is_weights(f)]
        if (RUN.tracker is None or not weights or os.path.isdir(str(path_or_repo_id))
                or _offline(kwargs) or kwargs.get("repo_type") not in (None, "model")):
            return real(path_or_repo_id, filenames, **kwargs)
        revision = kwargs.get("_commit_hash") or kwargs.get("revision")
        try:
            found = {f: header_file(str(path_or_repo_id), f, subfolder=kwargs.get("subfolder"),
                                    revision=revision, token=kwargs.get("token"))
                     for f in weights}
        except Exception:  # noqa: BLE001 - the library's own lookup says why, its way
            # Missing, gated, unauthorised: its HEAD request fails the same, never downloading.
            # Unreachable: it finds the file in its cache or says it is offline.
            return real(path_or_repo_id, filenames, **kwargs)
        others = [f for f in filenames if not _is_weights(f)]
        rest = real(path_or_repo_id, others, **kwargs) if others else []
        resolved = dict(zip(others, rest or [None] * len(others)))
        return [found[f] if f in found else resolved[f] for f in filenames]

    _replace(patches, module, "cached_files", cached_files, loaded_before)


class _InlineExecutor:
    """A thread pool that runs each job at once on the calling thread: transformers' loader
    materialises checkpoint tensors on worker threads (``core_model_loading``,
    ``spawn_materialize``), where the probe's modes are not active and a copy to the GPU would
    go unrecorded."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def submit(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Future:  # type: ignore[type-arg]
        future: Future = Future()  # type: ignore[type-arg]
        try:
            future.set_result(fn(*args, **kwargs))
        except Exception as exc:  # noqa: BLE001 - delivered where the caller asks for it
            future.set_exception(exc)
        return future

    def map(self, fn: Callable[..., Any], *iterables: Any, **_kwargs: Any) -> Any:
        return map(fn, *iterables)

    def shutdown(self, *_args: Any, **_kwargs: Any) -> None:
        return None

    def __enter__(self) -> _InlineExecutor:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None


def _patch_transformers_loading(patches: Any, module: Any, loaded_before: bool) -> None:
    if getattr(module, "ThreadPoolExecutor", None) is not None:
        patches.set(module, "ThreadPoolExecutor", _InlineExecutor)
