"""`xmem estimate -- NAME ARGS` for a training program that pip installed as a console script.

Fine-tuning tools start from their own command (``axolotl train cfg.yml``, ``llamafactory-cli
train cfg.yaml``): a console script pip writes beside its environment's interpreter, a small
Python file whose ``#!`` line names that interpreter. Here a console script of the same form
starts ``examples/train_gpt.py``'s ``main`` in the torch environment ``NEWEST``; no fine-tuning
tool is needed.
"""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path
from typing import Dict, Optional

from tests.support.torch_envs import NEWEST

ROOT = Path(__file__).resolve().parents[2]
TINY_GPT = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100",
            "--seq-len", "32", "--batch-size", "2"]


def xmem(*args: str, env: Optional[Dict[str, str]] = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmem_admission.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600,
                          env={**os.environ, **(env or {})})


def executable(path: Path, text: str) -> str:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    path.chmod(path.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    return str(path)


def console_script(path: Path, interpreter: str) -> str:
    """A console script as pip writes one for ``train-gpt = train_gpt:main``."""
    return executable(path, f"#!{interpreter}\nimport sys\nfrom train_gpt import main\n"
                            f"if __name__ == '__main__':\n    sys.exit(main())\n")


def one_line_error(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("xmem estimate: error: "), proc.stderr
    return lines[0]


def test_a_console_script_named_by_its_name_is_found_beside_the_python_option(tmp_path):
    # the environment's folder: its interpreter (here one that runs NEWEST's) and the script
    python = executable(tmp_path / "env" / "bin" / "python",
                        f'#!/bin/sh\nexec "{NEWEST.interpreter}" "$@"\n')
    console_script(tmp_path / "env" / "bin" / "train-gpt", NEWEST.interpreter)
    trace = tmp_path / "trace.json"
    proc = xmem("estimate", "--json", "--gpu", "A100-80GB", "--trace", str(trace),
                "--python", python, "--", "train-gpt", *TINY_GPT,
                env={"PYTHONPATH": os.pathsep.join(
                    [str(ROOT / "examples"), *filter(None, [os.environ.get("PYTHONPATH")])])})
    assert proc.returncode == 0, proc.stderr
    data = json.loads(proc.stdout)
    assert data["mode"] == "fake" and data["steps"] == 3 and data["gpus"][0]["total_bytes"] > 0
    meta = json.loads(trace.read_text())["meta"]
    assert meta["torch"].split("+")[0] == NEWEST.torch
    assert meta["command"][0] == str(tmp_path / "env" / "bin" / "train-gpt")


def test_a_console_script_is_traced_by_the_interpreter_on_its_first_line(tmp_path):
    # found by its path and by its name on PATH alike; that interpreter does not exist here
    gone = tmp_path / "gone" / "bin" / "python3.12"
    script = console_script(tmp_path / "bin" / "train-gpt", str(gone))
    line = one_line_error(xmem("estimate", "--", script, *TINY_GPT))
    assert f"{gone} (the interpreter of {script}): no such file" in line
    on_path = {"PATH": f"{tmp_path / 'bin'}{os.pathsep}{os.environ.get('PATH', '')}"}
    line = one_line_error(xmem("estimate", "--", "train-gpt", *TINY_GPT, env=on_path))
    assert f"{gone} (the interpreter of {script}): no such file" in line


def test_a_program_found_nowhere_is_a_one_line_error(tmp_path):
    python = executable(tmp_path / "env" / "bin" / "python", "#!/bin/sh\nexit 0\n")
    line = one_line_error(xmem("estimate", "--python", python, "--", "no-such-trainer", "a.yml"))
    assert (f"script not found: no-such-trainer (not a file in {ROOT}, not beside --python "
            f"{python}, not on PATH)") in line


def test_an_installed_program_that_is_not_python_is_a_one_line_error(tmp_path):
    shell = executable(tmp_path / "bin" / "train.sh", "#!/bin/bash\npython train.py\n")
    line = one_line_error(xmem("estimate", "--", shell))
    assert f"{shell} is not a Python program (its first line is '#!/bin/bash')" in line
