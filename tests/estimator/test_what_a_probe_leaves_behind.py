"""A traced script's process ends as soon as its result is written: nothing the script left
for its exit runs (an ``atexit`` handler is a side effect the estimate must not have), its
helper processes end with it, and the probe's own temporary folders (its scratch folder, where the script's MLflow store
was) are gone. Run through
``xmem estimate``, as a user runs it, with ``TMPDIR`` a folder of the test's own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "tests" / "estimator" / "scripts" / "leaves_work_for_its_exit.py"


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def test_an_estimate_runs_no_exit_handler_and_leaves_no_worker_or_folder_behind(tmp_path):
    tmp, pids, marker = tmp_path / "tmp", tmp_path / "pids", tmp_path / "exit-handler-ran"
    tmp.mkdir()
    pids.mkdir()
    proc = subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--json", "--gpu", "H200",
         "--", "python", str(SCRIPT), "--marker", str(marker), "--pids", str(pids)],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "TMPDIR": str(tmp)})
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout)["steps"] == 3
    assert not marker.exists()
    deadline = time.monotonic() + 30  # the helpers write their ids as they start
    while len(os.listdir(pids)) < 2 and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(name) for name in os.listdir(pids)]
    assert len(workers) == 2
    deadline = time.monotonic() + 30
    while any(alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in workers if alive(pid)]
    # torch's own caches (torchinductor_<user>) stay, as they do after any torch program
    assert [p.name for p in tmp.iterdir() if p.name.startswith("xmem-")] == []
