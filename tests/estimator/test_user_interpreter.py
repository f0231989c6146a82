"""`xmem estimate` with the user's own environment: another venv's interpreter and its torch.

The other environment is ``tests.support.torch_envs.NEWEST`` (a venv holding only a torch from
PyPI and its requirements, built by ``scripts/torch-venv.sh``); a test that needs it fails, never
skips, when it was not built. Every run goes through the probe bundle on ``PYTHONPATH``, as an
estimation pod does (``bundle.cached()``).
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import List

import torch

from tests.support.torch_envs import NEWEST
from xmem_admission import __version__, bundle
from xmem_admission.estimator.probe import runner

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]


def xmem(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmem_admission.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)


def executable(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    """The CLI's error: exit 2, one line, no traceback; returns the line."""
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("xmem estimate: error: ")
    return lines[0]


def traced_torch(trace: Path) -> str:
    return str(json.loads(trace.read_text())["meta"]["torch"])


# -- tracing with the other environment ----------------------------------------------------------

def test_an_interpreter_named_by_path_after_the_dashes_traces_with_its_own_torch(tmp_path):
    other = NEWEST.interpreter
    trace = tmp_path / "trace.json"
    proc = xmem("estimate", "--json", "--gpu", "A100-80GB", "--trace", str(trace), "--",
                other, "examples/train_gpt.py", *TINY_GPT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert traced_torch(trace).split("+")[0] == NEWEST.torch != torch.__version__.split("+")[0]
    assert data["torch"] == traced_torch(trace)
    assert data["python"].startswith(NEWEST.python + ".")
    assert data["interpreter"] == other
    assert data["steps"] == 3 and data["gpus"][0]["total_bytes"] > 0


def test_the_python_option_traces_with_that_interpreter_and_a_bare_python_stands_for_it(tmp_path):
    other = NEWEST.interpreter
    trace = tmp_path / "trace.json"
    proc = xmem("estimate", "--json", "--gpu", "A100-80GB", "--trace", str(trace),
                "--python", other, "--", "python", "examples/train_gpt.py", *TINY_GPT)
    assert proc.returncode == 0, proc.stderr
    assert traced_torch(trace).split("+")[0] == NEWEST.torch
    assert json.loads(proc.stdout)["python"].startswith(NEWEST.python + ".")


def test_a_bare_python_is_the_interpreter_xmem_runs_under(tmp_path):
    trace = tmp_path / "trace.json"
    proc = xmem("estimate", "--json", "--gpu", "A100-80GB", "--trace", str(trace), "--",
                "python", "examples/train_gpt.py", *TINY_GPT)
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["torch"] == traced_torch(trace) == torch.__version__
    assert data["interpreter"] == sys.executable
    assert data["python"] == ".".join(str(n) for n in sys.version_info[:3])


# -- interpreters the probe cannot run on: one line, exit 2 --------------------------------------

def test_an_interpreter_path_that_does_not_exist_is_a_one_line_error(tmp_path):
    missing = str(tmp_path / "venv" / "bin" / "python")
    line = one_line_error(xmem("estimate", "--", missing, "examples/train_gpt.py"))
    assert f"{missing} (the interpreter after --): no such file" in line


def test_a_python_option_that_is_not_an_executable_file_is_a_one_line_error(tmp_path):
    plain = tmp_path / "python"
    plain.write_text("not a program\n")
    line = one_line_error(xmem("estimate", "--python", str(plain), "--", "python",
                               "examples/train_gpt.py"))
    assert f"--python {plain}: not an executable file" in line
    line = one_line_error(xmem("estimate", "--python", str(tmp_path), "--", "python",
                               "examples/train_gpt.py"))
    assert "not an executable file" in line


def test_a_program_that_is_not_python_is_a_one_line_error(tmp_path):
    fake = executable(tmp_path / "bin" / "python", "#!/bin/sh\necho hello >&2\nexit 3\n")
    line = one_line_error(xmem("estimate", "--", fake, "examples/train_gpt.py"))
    assert f"({fake}) is not a Python interpreter (exit status 3: hello)" in line


def test_a_python_older_than_the_bundle_supports_is_a_one_line_error(tmp_path):
    old = executable(tmp_path / "bin" / "python3.8", "#!/bin/sh\necho 3.8.18\n")
    line = one_line_error(xmem("estimate", "--python", old, "--", "python",
                               "examples/train_gpt.py"))
    assert "is Python 3.8.18; the probe needs Python 3.9 or newer" in line


def test_an_interpreter_without_torch_is_a_one_line_error(tmp_path):
    # This interpreter without its site-packages (-S): the standard library and nothing else.
    bare = executable(tmp_path / "bin" / "python", f'#!/bin/sh\nexec "{sys.executable}" -S "$@"\n')
    line = one_line_error(xmem("estimate", "--", bare, "examples/train_gpt.py"))
    assert f"the interpreter after -- ({bare}, Python " in line
    assert "has no torch: install torch (2." in line


def test_a_torch_older_than_the_supported_range_is_a_one_line_error(tmp_path):
    old_torch = tmp_path / "site" / "torch"
    old_torch.mkdir(parents=True)
    (old_torch / "__init__.py").write_text("raise ImportError('never imported by the check')\n")
    (old_torch / "version.py").write_text("__version__ = '2.1.2+cu121'\n")
    python = executable(tmp_path / "bin" / "python",
                        f'#!/bin/sh\nexport PYTHONPATH="{tmp_path / "site"}:$PYTHONPATH"\n'
                        f'exec "{sys.executable}" -S "$@"\n')
    line = one_line_error(xmem("estimate", "--python", python, "--", "python",
                               "examples/train_gpt.py"))
    assert "has torch 2.1.2+cu121, older than the probe supports (torch 2.2 to" in line


def test_two_different_interpreters_are_a_one_line_error(tmp_path):
    other = executable(tmp_path / "bin" / "python", "#!/bin/sh\nexit 0\n")
    line = one_line_error(xmem("estimate", "--python", sys.executable, "--", other,
                               "examples/train_gpt.py"))
    assert f"two interpreters: --python {sys.executable} and {other} after --" in line


def test_a_launcher_named_by_path_is_traced_by_the_interpreter_on_its_first_line(tmp_path):
    gone = tmp_path / "gone" / "bin" / "python3.12"
    torchrun = executable(tmp_path / "bin" / "torchrun", f"#!{gone}\nimport sys\n")
    line = one_line_error(xmem("estimate", "--", torchrun, "--nproc-per-node", "2",
                               "examples/train_gpt.py"))
    assert f"{gone} (the interpreter of {torchrun}): no such file" in line
    env_line = executable(tmp_path / "env" / "torchrun", "#!/usr/bin/env python3\n")
    line = one_line_error(xmem("estimate", "--", env_line, "examples/train_gpt.py"))
    assert f"cannot tell which Python {env_line} runs under" in line and "--python" in line


# -- the pieces ----------------------------------------------------------------------------------

def test_the_cli_bundle_is_built_once_per_package_content(tmp_path):
    root = str(tmp_path / "cache")
    first = bundle.cached(root)
    marker = os.path.join(first, "xmem_admission", "__init__.py")
    built_at = os.stat(marker).st_mtime_ns
    assert bundle.cached(root) == first
    assert os.stat(marker).st_mtime_ns == built_at  # reused, not rebuilt
    assert sorted(os.listdir(root)) == [os.path.basename(first)]  # no staging left behind
    # the bundle `python -m xmem_admission.bundle DIR` writes: same files, same bytes
    reference = tmp_path / "reference"
    bundle.build(str(reference))
    files = sorted(p.relative_to(reference) for p in reference.rglob("*") if p.is_file())
    assert files == sorted(p.relative_to(first) for p in Path(first).rglob("*")
                           if p.is_file() and "__pycache__" not in p.parts)
    assert all((reference / f).read_bytes() == (Path(first) / f).read_bytes() for f in files)


def test_a_changed_package_gets_a_bundle_of_its_own(tmp_path):
    import shutil

    source = tmp_path / "pkg"
    shutil.copytree(bundle.package_dir(), source,
                    ignore=shutil.ignore_patterns("__pycache__"))
    before = bundle.content_key(str(source))
    estimate = source / "estimator" / "estimate.py"
    estimate.write_text(estimate.read_text() + "\n# changed\n")
    after = bundle.content_key(str(source))
    assert before != after and after.startswith(f"{__version__}-")
    root = str(tmp_path / "cache")
    assert bundle.cached(root, str(source)).endswith(after)
    assert bundle.content_key() != after


def test_split_command_drops_an_interpreter_by_any_path_but_keeps_a_script_named_python(
        tmp_path):
    split: List[str] = runner.split_command(["/venv/bin/python3.13", "-u", "train.py", "--x"])
    assert split == ["train.py", "--x"]
    assert runner.split_command(["python_train.py", "--x"]) == ["python_train.py", "--x"]


def test_the_convolutions_of_a_trace_made_by_another_torch_are_planned_with_that_torchs_cudnn(
        tmp_path):
    # The estimation pod plans beside the user's torch, with its cuDNN: `xmem estimate --python`
    # on the same machine answers the same, not with the cuDNN of xmem's own environment.
    trace = tmp_path / "trace.json"
    proc = xmem("estimate", "--json", "--gpu", "H200", "--trace", str(trace), "--python",
                NEWEST.interpreter, "--", "python", "tests/estimator/scripts/tiny_cnn.py")
    assert proc.returncode == 0, proc.stderr
    meta = json.loads(trace.read_text())["meta"]
    assert meta["cudnn_library"] and meta["cudnn_library"].startswith(str(NEWEST.folder))
    theirs = meta["cudnn"]
    assert theirs != torch.backends.cudnn.version()  # the two environments' cuDNNs differ
    planned = json.loads(proc.stdout)["gpus"][0]["conv_workspaces"]
    assert planned["source"] == "cudnn-heuristics"
    assert planned["cudnn_library"] == meta["cudnn_library"]
    major, minor, patch = theirs // 10000, theirs // 100 % 100, theirs % 100
    assert planned["cudnn"] == f"{major}.{minor}.{patch}"
