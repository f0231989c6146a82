"""A training command that replaces itself (``os.exec*``) with the program that trains, as
``axolotl train cfg.yml`` execs ``accelerate launch -m axolotl.cli.train cfg.yml``: the probe
traces the new program in its own process, with the environment the exec gave it. Run through
``xmem estimate`` (its own process: an exec the probe missed would replace it, not pytest)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPTS = ROOT / "tests" / "estimator" / "scripts"


def xmem(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "xmem_admission.cli", *args], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)


def test_a_launcher_a_program_execs_is_traced_as_its_rank_0(tmp_path):
    # torchrun is found on the PATH the exec gives (the one it adds), as execvpe finds it
    trace = tmp_path / "trace.json"
    proc = xmem("estimate", "--json", "--gpu", "H100-80GB", "--trace", str(trace), "--",
                "python", str(SCRIPTS / "execs_launcher.py"))
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 3
    assert json.loads(trace.read_text())["meta"]["distributed"]["world_size"] == 2


def test_a_program_that_execs_a_program_not_in_python_is_refused():
    proc = xmem("estimate", "--gpu", "H100-80GB", "--", "python",
                str(SCRIPTS / "execs_a_binary.py"))
    assert proc.returncode == 2
    assert ("not estimated: the program replaces itself (os.exec) with /bin/true, which is not "
            "a Python program") in proc.stderr
