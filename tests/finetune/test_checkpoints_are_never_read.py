"""A fine-tune's checkpoint is read for its safetensors headers only, never for its weights.

``xmem estimate`` in fake mode traces ``from_pretrained`` on a checkpoint folder or a Hub id
with the torch environment that has the fine-tuning stack (``NEWEST``). What was read is checked
where it cannot be hidden:

- a local file: the kernel's page cache. The checkpoint's pages are dropped from it before the
  estimate (``posix_fadvise(DONTNEED)``) and counted after (``mincore``): any read of the data,
  by ``read`` or through a memory map, brings its pages back. The same count after a profile-mode
  estimate (which loads the weights for real) shows the check sees a read;
- a Hub id: a local Hub (``hub_server``, at ``HF_ENDPOINT``) counts every body byte it sends.

Checkpoints of 8B parameters are sparse files: their headers are written, their data are holes
(16 GB logical, no disk).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
import shutil
import subprocess
from pathlib import Path
from typing import Dict, List, Sequence, Tuple

import pytest

from tests.finetune.hub_server import HubServer
from tests.support.torch_envs import NEWEST

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = Path(__file__).resolve().parent / "scripts"
GiB = 1 << 30

# safetensors' dtype names and their sizes in bytes (safetensors/src/tensor.rs, Dtype::size)
ITEMSIZE = {"BF16": 2, "F16": 2, "F32": 4}

# Llama-3-8B's shapes (its published config.json): 32 layers, hidden 4096, 32 query and 8
# key/value heads of 128, SwiGLU MLP of 14336, vocabulary 128256, untied output layer.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
             "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
             "num_key_value_heads": 8, "vocab_size": 128256, "max_position_embeddings": 8192,
             "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "tie_word_embeddings": False,
             "bos_token_id": 1, "eos_token_id": 2, "torch_dtype": "bfloat16"}


# -- checkpoints --------------------------------------------------------------------------------
def llama_tensors(config: Dict) -> Dict[str, Tuple[str, List[int]]]:
    """The bf16 tensors of a Llama checkpoint with ``config``'s shapes, in the order
    ``save_pretrained`` writes them."""
    h, inter, vocab = config["hidden_size"], config["intermediate_size"], config["vocab_size"]
    kv = config["num_key_value_heads"] * h // config["num_attention_heads"]
    out = {"model.embed_tokens.weight": ("BF16", [vocab, h])}
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out.update({p + "self_attn.q_proj.weight": ("BF16", [h, h]),
                    p + "self_attn.k_proj.weight": ("BF16", [kv, h]),
                    p + "self_attn.v_proj.weight": ("BF16", [kv, h]),
                    p + "self_attn.o_proj.weight": ("BF16", [h, h]),
                    p + "mlp.gate_proj.weight": ("BF16", [inter, h]),
                    p + "mlp.up_proj.weight": ("BF16", [inter, h]),
                    p + "mlp.down_proj.weight": ("BF16", [h, inter]),
                    p + "input_layernorm.weight": ("BF16", [h]),
                    p + "post_attention_layernorm.weight": ("BF16", [h])})
    out["model.norm.weight"] = ("BF16", [h])
    out["lm_head.weight"] = ("BF16", [vocab, h])
    return out


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    return math.prod(shape) * ITEMSIZE[dtype]


def write_sparse_safetensors(path: Path, tensors: Dict[str, Tuple[str, List[int]]]) -> int:
    """A safetensors file whose header is written and whose data is a hole of the right size
    (the format: 8-byte little-endian header length, the JSON header, the data); returns the
    data's size."""
    header: Dict[str, object] = {"__metadata__": {"format": "pt"}}
    offset = 0
    for name, (dtype, shape) in tensors.items():
        size = nbytes(dtype, shape)
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors pads the header to 8 bytes with spaces
    with open(path, "wb") as fh:
        fh.write(len(raw).to_bytes(8, "little") + raw)
        fh.truncate(8 + len(raw) + offset)
    return offset


def sparse_llama(folder: Path, config: Dict, tokenizer_from: Path, shards: int) -> int:
    """A sharded Llama checkpoint folder as ``save_pretrained`` lays it out (config, shards,
    ``model.safetensors.index.json``, tokenizer), its data sparse; returns the weights' bytes."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_from / name, folder / name)
    tensors = list(llama_tensors(config).items())
    per_shard = math.ceil(len(tensors) / shards)
    weight_map, total = {}, 0
    for index in range(shards):
        name = f"model-{index + 1:05d}-of-{shards:05d}.safetensors"
        part = dict(tensors[index * per_shard:(index + 1) * per_shard])
        total += write_sparse_safetensors(folder / name, part)
        weight_map.update({key: name for key in part})
    (folder / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": total}, "weight_map": weight_map}))
    return total


def header_of(path: Path) -> Tuple[int, Dict]:
    """A checkpoint's header length and header, read without readahead (which would bring the
    data after the header into the page cache with it)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_RANDOM)
        length = int.from_bytes(os.pread(fd, 8, 0), "little")
        return length, json.loads(os.pread(fd, length, 8))
    finally:
        os.close(fd)


def weight_bytes(path: Path) -> int:
    _, header = header_of(path)
    return sum(nbytes(v["dtype"], v["shape"]) for k, v in header.items() if k != "__metadata__")


# -- the page cache -----------------------------------------------------------------------------
def drop_from_page_cache(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def resident_pages(path: Path) -> List[int]:
    """The page numbers of ``path`` that are in the page cache (``mincore`` on a mapping, which
    itself reads nothing)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                          ctypes.c_int, ctypes.c_long]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    size, page = path.stat().st_size, os.sysconf("SC_PAGE_SIZE")
    count = (size + page - 1) // page
    vec = (ctypes.c_ubyte * count)()
    fd = os.open(path, os.O_RDONLY)
    try:
        addr = libc.mmap(None, size, 1, 1, fd, 0)  # PROT_READ, MAP_SHARED
        assert addr not in (None, ctypes.c_void_p(-1).value), os.strerror(ctypes.get_errno())
        try:
            assert libc.mincore(addr, size, vec) == 0, os.strerror(ctypes.get_errno())
        finally:
            libc.munmap(addr, size)
    finally:
        os.close(fd)
    return [i for i in range(count) if vec[i] & 1]


def data_pages_read(path: Path) -> List[int]:
    """Pages of ``path``'s data region (past the page the header ends in) in the page cache,
    other than the pages of tensors small enough to be read for their values
    (``checkpoints.SMALL_VALUE_BYTES``: norms, quantization state, never a weight matrix)."""
    from xmem_admission.estimator.probe.checkpoints import SMALL_VALUE_BYTES

    length, header = header_of(path)  # read by the test itself: that page is allowed
    page = os.sysconf("SC_PAGE_SIZE")
    last_header_page = (8 + length - 1) // page
    base = 8 + length
    small = set()  # pages a small tensor's bytes lie on (a weight may share them)
    for name, entry in header.items():
        if name == "__metadata__":
            continue
        begin, end = entry["data_offsets"]
        if 0 < end - begin <= SMALL_VALUE_BYTES:
            small.update(range((base + begin) // page, (base + end - 1) // page + 1))
    return [p for p in resident_pages(path) if p > last_header_page and p not in small]


# -- running the estimate -----------------------------------------------------------------------
def estimate(script: str, *args: str, mode: str = "fake", env: Dict[str, str] | None = None,
             timeout: float = 600) -> Dict:
    return estimate_and_log(script, *args, mode=mode, env=env, timeout=timeout)[0]


def estimate_and_log(script: str, *args: str, mode: str = "fake",
                     env: Dict[str, str] | None = None, timeout: float = 600) -> Tuple[Dict, str]:
    """``xmem estimate --json`` of a script with ``NEWEST``: the result and what went to stderr
    (the script's own output)."""
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "xmem"), "estimate", "--mode", mode, "--python",
         NEWEST.interpreter, "--json", "--gpu", "H100-80GB", "--", "python",
         str(SCRIPTS / script), *args],
        cwd=ROOT, capture_output=True, text=True, timeout=timeout,
        env={**os.environ, "HF_HUB_DISABLE_TELEMETRY": "1", **(env or {})})
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout), proc.stderr


def parameter_bytes(result: Dict) -> int:
    return int(result["gpus"][0]["breakdown"]["parameters"])


@pytest.fixture(scope="module")
def small(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The session's tiny Llama (real weights), copied so this module alone touches its pages."""
    folder = tmp_path_factory.mktemp("small") / "tiny-llama"
    shutil.copytree(llama_checkpoint, folder)
    return folder


@pytest.fixture(scope="module")
def llama3_8b(llama_checkpoint: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A Llama-3-8B-shaped checkpoint in four sparse shards, with the tiny Llama's tokenizer."""
    folder = tmp_path_factory.mktemp("llama3") / "llama-3-8b"
    sparse_llama(folder, LLAMA3_8B, llama_checkpoint, shards=4)
    return folder


def shards(folder: Path) -> List[Path]:
    return sorted(folder.glob("*.safetensors"))


# -- local checkpoints --------------------------------------------------------------------------
def test_a_full_fine_tune_reads_its_checkpoint_for_the_header_only(small):
    checkpoint = small / "model.safetensors"
    drop_from_page_cache(checkpoint)
    result = estimate("checkpoint_full.py", "--model", str(small), "--steps", "3")
    assert result["mode"] == "fake"
    assert data_pages_read(checkpoint) == []
    # the parameters on the GPU are the checkpoint's, each block rounded to the allocator's
    # 512 bytes (CUDACachingAllocator.cpp, kMinBlockSize)
    _, header = header_of(checkpoint)
    assert 0 <= parameter_bytes(result) - weight_bytes(checkpoint) <= 512 * len(header)


def test_a_checkpoint_loaded_straight_onto_the_gpu_is_traced_there(small):
    """``device_map="cuda"``: transformers copies each tensor to the GPU as it loads it (on its
    loader's worker threads in a real run); every parameter is still on the traced GPU."""
    checkpoint = small / "model.safetensors"
    drop_from_page_cache(checkpoint)
    result = estimate("checkpoint_lora.py", "--model", str(small), "--steps", "2",
                      "--device-map", "cuda")
    assert result["mode"] == "fake"
    assert data_pages_read(checkpoint) == []
    assert parameter_bytes(result) >= weight_bytes(checkpoint)


@pytest.mark.parametrize("load_device", ["cpu", "cuda"])
def test_a_state_dict_loaded_with_load_file_is_read_for_its_header_only(tmp_path, load_device):
    checkpoint = tmp_path / "mlp.safetensors"
    width, depth = 2048, 4
    write_sparse_safetensors(checkpoint, {
        f"layers.{i}.{kind}": ("F32", [width, width] if kind == "weight" else [width])
        for i in range(depth) for kind in ("weight", "bias")})
    drop_from_page_cache(checkpoint)
    result = estimate("checkpoint_state_dict.py", "--checkpoint", str(checkpoint), "--width",
                      str(width), "--depth", str(depth), "--load-device", load_device)
    assert result["mode"] == "fake"
    assert data_pages_read(checkpoint) == []
    # each tensor a multiple of 512 bytes: the parameters on the GPU are exactly the file's
    assert parameter_bytes(result) == weight_bytes(checkpoint)


def test_the_page_cache_check_sees_a_checkpoint_read_for_real(small):
    """Profile mode loads the weights for real: the same check finds their pages."""
    checkpoint = small / "model.safetensors"
    drop_from_page_cache(checkpoint)
    result = estimate("checkpoint_full.py", "--model", str(small), "--steps", "1",
                      mode="profile")
    assert result["mode"] == "profile"
    data = checkpoint.stat().st_size - 8 - header_of(checkpoint)[0]
    assert len(data_pages_read(checkpoint)) * os.sysconf("SC_PAGE_SIZE") >= data // 2


def test_an_8b_sharded_checkpoint_is_estimated_from_its_headers(llama3_8b):
    for shard in shards(llama3_8b):
        drop_from_page_cache(shard)
    total = sum(weight_bytes(s) for s in shards(llama3_8b))
    assert total > 16 * 10**9  # 8.03B parameters in bf16
    result = estimate("checkpoint_lora.py", "--model", str(llama3_8b), "--steps", "2",
                      "--seq-len", "64")
    assert result["mode"] == "fake"
    assert {s.name: data_pages_read(s) for s in shards(llama3_8b)} == {
        s.name: [] for s in shards(llama3_8b)}
    # the frozen bf16 base plus LoRA's adapters (r=8 on four projections of 32 layers: 6.8M
    # fp32 parameters, 27 MB)
    assert total <= parameter_bytes(result) <= total + 40 * 10**6
    # a 16 GB checkpoint never held in the probe's memory (its time and memory are
    # bench/speed/checkpoint_headers.py's figures, not a test's)
    assert result["probe_peak_rss_bytes"] < 2 * GiB


# -- checkpoints on the Hub ---------------------------------------------------------------------
def hub_env(hub: HubServer, home: Path) -> Dict[str, str]:
    return {"HF_ENDPOINT": hub.endpoint, "HF_HOME": str(home), "HF_HUB_OFFLINE": "0",
            "TRANSFORMERS_OFFLINE": "0"}


def cached_weights(home: Path) -> List[Path]:
    return [p for p in home.rglob("*.safetensors")]


def test_a_hub_model_downloads_config_and_tokenizer_but_not_its_weights(small, tmp_path):
    repo = "tiny-org/tiny-llama"
    with HubServer({repo: small}) as hub:
        result = estimate("checkpoint_full.py", "--model", repo, "--steps", "3",
                          env=hub_env(hub, tmp_path / "hf"))
        length, _ = header_of(small / "model.safetensors")
        assert hub.bytes_served(repo, "model.safetensors") == 8 + length
        for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
            assert hub.bytes_served(repo, name) == (small / name).stat().st_size
    assert result["mode"] == "fake"
    assert parameter_bytes(result) >= weight_bytes(small / "model.safetensors")
    assert cached_weights(tmp_path / "hf") == []  # nothing left in the user's Hub cache


def test_a_sharded_8b_hub_model_is_fetched_as_headers(llama3_8b, tmp_path):
    repo = "meta-shaped/llama-3-8b"
    with HubServer({repo: llama3_8b}) as hub:
        result = estimate("checkpoint_lora.py", "--model", repo, "--steps", "2",
                          "--seq-len", "64", env=hub_env(hub, tmp_path / "hf"))
        served = {s.name: hub.bytes_served(repo, s.name) for s in shards(llama3_8b)}
    assert served == {s.name: 8 + header_of(s)[0] for s in shards(llama3_8b)}
    assert result["mode"] == "fake"
    assert parameter_bytes(result) >= sum(weight_bytes(s) for s in shards(llama3_8b))
    assert cached_weights(tmp_path / "hf") == []


def test_the_hub_server_counts_a_real_download(small, tmp_path):
    """Without the probe, ``from_pretrained`` downloads the weights: the same count sees it."""
    repo = "tiny-org/tiny-llama"
    with HubServer({repo: small}) as hub:
        subprocess.run([NEWEST.interpreter, "-c",
                        "import sys; from transformers import AutoModelForCausalLM; "
                        "AutoModelForCausalLM.from_pretrained(sys.argv[1])", repo],
                       check=True, capture_output=True, timeout=300,
                       env={**os.environ, **hub_env(hub, tmp_path / "hf")})
        assert hub.bytes_served(repo, "model.safetensors") == \
            (small / "model.safetensors").stat().st_size


# -- bad checkpoints ----------------------------------------------------------------------------
def test_a_truncated_checkpoint_is_a_clear_error(small, tmp_path):
    folder = tmp_path / "truncated"
    shutil.copytree(small, folder)
    checkpoint = folder / "model.safetensors"
    length, _ = header_of(checkpoint)
    with open(checkpoint, "r+b") as fh:
        fh.truncate(8 + length + 100)  # the header survives, the data does not
    proc = subprocess.run(
        [str(ROOT / ".venv" / "bin" / "xmem"), "estimate", "--mode", "fake", "--python",
         NEWEST.interpreter, "--json", "--gpu", "H100-80GB", "--", "python",
         str(SCRIPTS / "checkpoint_full.py"), "--model", str(folder), "--steps", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 2
    assert "lie outside the file's 100 bytes of data" in proc.stderr


@pytest.mark.parametrize("content, message", [
    (b"\x05\x00", "not a safetensors file (2 bytes"),
    ((1 << 40).to_bytes(8, "little") + b"{}", "over safetensors' limit"),
    ((50).to_bytes(8, "little") + b"{}", "says 50 bytes, but the file has 10 bytes"),
    ((2).to_bytes(8, "little") + b"[]", "the header is not a JSON object"),
    ((4).to_bytes(8, "little") + b"{x:1", "the header is not JSON"),
])
def test_a_malformed_header_says_what_is_wrong(tmp_path, content, message):
    from xmem_admission.estimator.probe import checkpoints

    path = tmp_path / "bad.safetensors"
    path.write_bytes(content)
    with pytest.raises(Exception, match="bad.safetensors: .*" + _escape(message)):
        checkpoints.read_header(path)


def test_a_header_entry_that_disagrees_with_its_data_is_refused(tmp_path):
    from xmem_admission.estimator.probe import checkpoints

    path = tmp_path / "w.safetensors"
    write_sparse_safetensors(path, {"w": ("F32", [4, 4])})
    length, header = header_of(path)
    header["w"]["shape"] = [4, 5]  # 80 bytes said, 64 stored
    raw = json.dumps(header).encode().ljust(length)
    path.write_bytes(length.to_bytes(8, "little") + raw + b"\0" * 64)
    with pytest.raises(Exception, match=r"tensor 'w': F32 \[4, 5\] takes 80 bytes, its "
                                        r"data_offsets span 64"):
        checkpoints.read_header(path)
    header["w"]["shape"], header["w"]["dtype"] = [4, 4], "Q3"
    path.write_bytes(length.to_bytes(8, "little") + json.dumps(header).encode().ljust(length)
                     + b"\0" * 64)
    with pytest.raises(Exception, match="dtype 'Q3' is not one"):
        checkpoints.read_header(path)


def _escape(text: str) -> str:
    import re

    return re.escape(text)

