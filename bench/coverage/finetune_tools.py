"""Axolotl and LLaMA-Factory as their users start them, estimated by ``xmem estimate`` in the
default mode: ``xmem estimate --python <the tool's environment> --json --gpu H100-80GB,H200 --
axolotl train cfg.yml`` (and ``llamafactory-cli train cfg.yaml``), one LoRA and one QLoRA (4-bit
nf4) config per tool, on a Llama-shaped checkpoint made here (``tests/finetune/conftest.py``:
``--shape tiny`` or ``bench``, the ~0.83B one). Printed per job (markdown, for
``bench/coverage/README.md``): the mode the estimate ended in, the probe's seconds and peak RSS,
trace events, the H200 total, or the failure's first line.

    .venv/bin/python bench/coverage/finetune_tools.py [--tools axolotl,llamafactory]
        [--shapes tiny,bench] [--jobs lora,qlora] [--timeout S]

Neither tool installs beside the torch 2.15 environment's pinned stack, so each has an
environment of its own under ``~/.cache/xmem-admission/tools/<tool>/venv`` (Python 3.12 from
pyenv), built here when missing with pip from PyPI: the tool's newest release, the torch it
resolves to, and bitsandbytes. A tool that does not install gets one row with pip's error. The
checkpoints (one per tool and shape, made with the tool's own transformers), the dataset (alpaca
JSON lines, long enough to fill every sequence) and the configs live beside the environment;
nothing is read from the Hub (``HF_HUB_OFFLINE=1``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Dict, List, Tuple

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from bench.coverage.finetune_matrix import failing_frame  # noqa: E402
from tests.finetune import conftest  # noqa: E402

TOOLS_HOME = Path.home() / ".cache" / "xmem-admission" / "tools"
GIB = 2**30
PYTHON = "3.12"  # both tools' wheels accept it (Axolotl 0.21 needs >= 3.12)
# what each tool installs from, and its console script
PACKAGES = {"axolotl": ["axolotl", "bitsandbytes"],
            "llamafactory": ["llamafactory", "bitsandbytes"]}
CONSOLE = {"axolotl": "axolotl", "llamafactory": "llamafactory-cli"}
JOBS = {"axolotl": ("lora", "qlora", "qlora-nokernels"), "llamafactory": ("lora", "qlora")}
# per shape: tokens per sequence and sequences per batch (the tiny checkpoint has 512 positions)
SEQUENCE = {"tiny": (256, 2), "bench": (1024, 4)}
RETRACED = re.compile(r"^xmem: fake mode needs real values \((?P<reason>.*)\); tracing again in "
                      r"profile mode$", re.M)


def base_python() -> str:
    found = subprocess.run(["pyenv", "prefix", PYTHON], capture_output=True, text=True)
    if found.returncode == 0:
        candidate = Path(found.stdout.strip()) / "bin" / f"python{PYTHON}"
        if candidate.is_file():
            return str(candidate)
    which = shutil.which(f"python{PYTHON}")
    if which is None:
        raise SystemExit(f"no Python {PYTHON} here (pyenv prefix {PYTHON}, python{PYTHON})")
    return which


def environment(tool: str) -> Tuple[Path, str]:
    """The tool's interpreter and "", building its environment when missing; pip's error lines
    in place of "" when the tool does not install."""
    home = TOOLS_HOME / tool
    python = home / "venv" / "bin" / "python"
    if (home / "venv" / ".complete").is_file():
        return python, ""
    home.mkdir(parents=True, exist_ok=True)
    if not python.is_file():
        subprocess.run([base_python(), "-m", "venv", str(home / "venv")], check=True)
    log = home / "pip.log"
    with open(log, "w", encoding="utf-8") as out:
        proc = subprocess.run([str(python), "-m", "pip", "install", *PACKAGES[tool]],
                              stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode == 0:  # tests/finetune/conftest.py, which makes the checkpoint, needs it
        with open(log, "a", encoding="utf-8") as out:
            proc = subprocess.run([str(python), "-m", "pip", "install", "pytest"],
                                  stdout=out, stderr=subprocess.STDOUT)
    if proc.returncode != 0:
        lines = log.read_text().splitlines()
        errors = [line for line in lines if line.startswith("ERROR")] or lines[-3:]
        return python, " ".join(errors)
    (home / "venv" / ".complete").touch()
    return python, ""


def checkpoint(tool: str, shape: str, python: Path) -> Path:
    folder = TOOLS_HOME / tool / f"llama-{shape}"
    if not (folder / "model.safetensors").is_file():
        conftest.make(folder, shape, str(python))
    return folder


def dataset(folder: Path) -> Path:
    """64 alpaca records whose answers are longer than any sequence here (truncated to it)."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "alpaca.jsonl"
    text = conftest.lines(64 * 81, seed=1)
    with open(path, "w", encoding="utf-8") as out:
        for i in range(64):
            record = {"instruction": text[81 * i], "input": "",
                      "output": " ".join(text[81 * i + 1:81 * (i + 1)])}
            out.write(json.dumps(record) + "\n")
    (folder / "dataset_info.json").write_text(json.dumps(
        {"xmem_alpaca": {"file_name": path.name}}))
    return path


def axolotl_config(model: Path, data: Path, work: Path, job: str, shape: str) -> Dict:
    """As Axolotl's examples write a LoRA / QLoRA config (examples/llama-3/lora-1b.yml,
    qlora-1b.yml). ``qlora-nokernels``: QLoRA without the LoRA kernels Axolotl turns on by
    default (``lora_mlp_kernel`` etc.: their NF4 dequantization calls bitsandbytes' C library
    through ctypes on the current raw CUDA stream, axolotl/kernels/quantize.py)."""
    seq, batch = SEQUENCE[shape]
    kernels_off = job == "qlora-nokernels"
    job = "qlora" if kernels_off else job
    config = {
        "base_model": str(model), "tokenizer_type": "AutoTokenizer",
        "load_in_8bit": False, "load_in_4bit": job == "qlora",
        "datasets": [{"path": str(data), "ds_type": "json", "type": "alpaca"}],
        "dataset_prepared_path": str(work / "prepared"), "val_set_size": 0,
        "output_dir": str(work / "out"),
        "adapter": job, "lora_r": 16, "lora_alpha": 32, "lora_dropout": 0.05,
        "lora_target_linear": True,
        "sequence_len": seq, "excess_length_strategy": "truncate", "sample_packing": False,
        "pad_to_sequence_len": True,
        "gradient_accumulation_steps": 1, "micro_batch_size": batch, "num_epochs": 1,
        "max_steps": 10, "optimizer": "paged_adamw_8bit" if job == "qlora" else "adamw_torch",
        "lr_scheduler": "cosine", "learning_rate": 0.0002, "warmup_steps": 1,
        "bf16": "auto", "tf32": False, "sdp_attention": True,
        "gradient_checkpointing": True, "logging_steps": 1, "save_strategy": "no",
        "special_tokens": {"pad_token": "<pad>"},
    }
    if kernels_off:
        config.update({"lora_mlp_kernel": False, "lora_qkv_kernel": False,
                       "lora_o_kernel": False})
    return config


def llamafactory_config(model: Path, data: Path, work: Path, job: str, shape: str) -> Dict:
    """As LLaMA-Factory's examples write one (examples/train_lora/llama3_lora_sft.yaml,
    examples/train_qlora/llama3_lora_sft_bnb_npu.yaml's quantization keys)."""
    seq, batch = SEQUENCE[shape]
    config = {
        "model_name_or_path": str(model),
        "stage": "sft", "do_train": True, "finetuning_type": "lora", "lora_rank": 8,
        "lora_target": "all",
        "dataset": "xmem_alpaca", "dataset_dir": str(data.parent), "template": "default",
        "cutoff_len": seq, "max_samples": 64, "overwrite_cache": True,
        "preprocessing_num_workers": 1, "dataloader_num_workers": 0,
        "output_dir": str(work / "out"), "logging_steps": 1, "save_strategy": "no",
        "plot_loss": False, "overwrite_output_dir": True, "report_to": "none",
        "per_device_train_batch_size": batch, "gradient_accumulation_steps": 1,
        "learning_rate": 1.0e-4, "num_train_epochs": 1.0, "max_steps": 10,
        "lr_scheduler_type": "cosine", "warmup_ratio": 0.1, "bf16": True,
    }
    if job == "qlora":
        config.update({"quantization_bit": 4, "quantization_method": "bnb",
                       "quantization_type": "nf4", "double_quantization": True})
    return config


CONFIGS = {"axolotl": (axolotl_config, "yml"), "llamafactory": (llamafactory_config, "yaml")}


def write_yaml(path: Path, config: Dict) -> None:
    """YAML by hand (the project's .venv may lack PyYAML): JSON scalars are YAML scalars."""
    def scalar(value: object) -> str:
        return json.dumps(value)

    out: List[str] = []
    for key, value in config.items():
        if isinstance(value, list):
            out.append(f"{key}:")
            for item in value:
                pairs = list(item.items())
                out.append(f"  - {pairs[0][0]}: {scalar(pairs[0][1])}")
                out.extend(f"    {k}: {scalar(v)}" for k, v in pairs[1:])
        elif isinstance(value, dict):
            out.append(f"{key}:")
            out.extend(f"  {k}: {scalar(v)}" for k, v in value.items())
        else:
            out.append(f"{key}: {scalar(value)}")
    path.write_text("\n".join(out) + "\n")


def run(tool: str, python: Path, shape: str, job: str, timeout: float) -> str:
    """One markdown row (or the failure) for one tool, shape and job."""
    model = checkpoint(tool, shape, python)
    work = TOOLS_HOME / tool / "runs" / f"{shape}-{job}"
    data = dataset(TOOLS_HOME / tool / "data")
    make, suffix = CONFIGS[tool]
    config = work / f"{job}.{suffix}"
    work.mkdir(parents=True, exist_ok=True)
    write_yaml(config, make(model, data, work, job, shape))
    argv = [CONSOLE[tool], "train", str(config)]
    command = [sys.executable, "-m", "xmem_admission.cli", "estimate", "--python", str(python),
               "--json", "--gpu", "H100-80GB,H200", "--timeout", str(timeout), "--", *argv]
    # the tool's environment activated: its bin/ first on PATH (Axolotl execs its launcher,
    # `accelerate`, by name)
    path = f"{python.parent}{os.pathsep}{os.environ.get('PATH', '')}"
    env = {**os.environ, "PATH": path, "VIRTUAL_ENV": str(python.parent.parent),
           "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TRANSFORMERS_OFFLINE": "1", "HF_HOME": str(work / "hf"), "WANDB_MODE": "disabled",
           "AXOLOTL_DO_NOT_TRACK": "1", "DO_NOT_TRACK": "1", "DISABLE_VERSION_CHECK": "1"}
    started = time.perf_counter()
    proc = subprocess.run(command, cwd=work, capture_output=True, text=True, env=env,
                          timeout=timeout + 600)
    wall = time.perf_counter() - started
    (work / "stderr.txt").write_text(proc.stderr)
    row = f"| {tool} | {job} | {shape} |"
    if proc.returncode not in (0, 3):
        lines = [line for line in proc.stderr.splitlines()
                 if line.startswith("xmem estimate: error:")]
        failure = lines[-1] if lines else (proc.stderr.strip().splitlines() or ["(nothing)"])[-1]
        failure = failure.replace("xmem estimate: error: ", "").replace("|", "/")
        failure += failing_frame(proc.stderr)
        retraced = RETRACED.search(proc.stderr)
        if retraced:
            failure = f"fake: needs real values ({retraced['reason']}); profile: {failure}"
        failure = re.sub(r"/\S*/site-packages/", "", failure)
        return f"{row} failed (exit {proc.returncode}, {wall:.0f} s) | | | | | {failure[:500]} |"
    data_out = json.loads(proc.stdout)
    (h200,) = [g for g in data_out["gpus"] if g["gpu"] == "H200"]
    note = data_out.get("fallback_reason", "")[:300].replace("|", "/")
    return (f"{row} {data_out['mode']} | {data_out['probe_seconds']:.1f} | "
            f"{data_out['probe_peak_rss_bytes'] / GIB:.2f} GiB | {data_out['trace_events']:,} | "
            f"{h200['total_bytes'] / GIB:.2f} GiB | {note} |")


def main(argv: List[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--tools", default="axolotl,llamafactory")
    parser.add_argument("--shapes", default="tiny,bench")
    parser.add_argument("--jobs", default="lora,qlora,qlora-nokernels",
                        help="of lora, qlora and (Axolotl's) qlora-nokernels")
    parser.add_argument("--timeout", type=float, default=300.0,
                        help="seconds each estimate may trace for (xmem estimate --timeout)")
    options = parser.parse_args(argv)
    tools = [t for t in options.tools.split(",") if t]
    unknown = set(tools) - set(PACKAGES)
    if unknown:
        parser.error(f"unknown tool(s): {', '.join(sorted(unknown))}")
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    print(f"{time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime())}, commit {commit}, "
          f"{os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}")
    print("| tool | job | shape | mode | probe s | probe peak RSS | trace events | H200 total | "
          "fallback / failure |")
    print("|---|---|---|---|---:|---:|---:|---:|---|")
    for tool in tools:
        python, error = environment(tool)
        if error:
            print(f"| {tool} | | | not installed | | | | | {error[:500]} |", flush=True)
            continue
        versions = subprocess.run(
            [str(python), "-c", "import importlib.metadata as m; print(', '.join(f'{p} '"
             "+ m.version(p) for p in ('torch', 'transformers', 'peft', 'trl', 'accelerate', "
             f"'bitsandbytes', {tool!r})))"], capture_output=True, text=True).stdout.strip()
        print(f"<!-- {tool}: {versions} -->", flush=True)
        for shape in [s for s in options.shapes.split(",") if s]:
            for job in [j for j in options.jobs.split(",") if j in JOBS[tool]]:
                print(run(tool, python, shape, job, options.timeout), flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
