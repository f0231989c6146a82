"""`xmem bench paper`: reading runs files, the statistics, and one real row end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from bench.yardsticks.paper import benchmark as paperbench
from xmem_admission.contract.errors import RunsFileError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def row(**overrides):
    data = {"id": "MnasNet_SGD_8@NVIDIA-GeForce-RTX-3060", "family": "cnn", "model": "MnasNet",
            "optimizer": "SGD", "batch_size": 8, "gpu_name": "NVIDIA GeForce RTX 3060",
            "measured_peak_bytes": 1 << 30, "measured_oom": False, "zero_grad_mode": 0,
            "optimizer_steps": 4, "max_seq_len": None,
            "xmem": {"estimate_bytes": 1 << 30, "predicted_oom": False, "runtime_s": 3.0}}
    data.update(overrides)
    return data


def write(tmp_path, lines):
    path = tmp_path / "runs.jsonl"
    path.write_text("\n".join(line if isinstance(line, str) else json.dumps(line)
                              for line in lines) + "\n")
    return str(path)


@pytest.mark.parametrize("bad, message", [
    ("{not json", "runs.jsonl:2: not valid JSON"),
    ("[1, 2]", "runs.jsonl:2: expected a JSON object"),
    (json.dumps({k: v for k, v in row(id="x").items() if k != "model"}),
     "runs.jsonl:2: missing field 'model'"),
    (json.dumps(row(id="y", batch_size="8")), "runs.jsonl:2: field 'batch_size' must be int"),
    (json.dumps(row()), "runs.jsonl:2: duplicate id"),
    (json.dumps(row(id="z", xmem={"predicted_oom": True})), "'xmem' must be null or an object"),
])
def test_malformed_rows_are_rejected_with_line_number_and_reason(tmp_path, bad, message):
    with pytest.raises(RunsFileError, match=message):
        paperbench.load_runs(write(tmp_path, [row(), bad]))


def test_statistics_count_errors_on_rows_that_fit_and_oom_agreement_on_all():
    rows = [row(id="a", measured_peak_bytes=100), row(id="b", measured_peak_bytes=200),
            row(id="c", measured_peak_bytes=400), row(id="d", measured_peak_bytes=50,
                                                       measured_oom=True)]
    answers = {"a": {"estimate_bytes": 90, "predicted_oom": False, "seconds": 1.0},
               "b": {"estimate_bytes": 210, "predicted_oom": False, "seconds": 2.0},
               "c": {"estimate_bytes": 400, "predicted_oom": True, "seconds": 3.0},
               "d": {"estimate_bytes": 45, "predicted_oom": False, "seconds": 4.0}}
    s = paperbench.stats("x", ((r, answers[r["id"]]) for r in rows))
    assert s.n == 3
    assert s.median == pytest.approx(0.05)
    assert s.under == pytest.approx(1 / 3)
    assert s.missed_oom == 1
    assert s.oom_right == pytest.approx(2 / 4)
    assert s.seconds == pytest.approx(2.5)


def test_one_real_row_runs_through_the_estimator_writes_its_line_and_keeps_its_trace(tmp_path):
    runs = write(tmp_path, [row(id="MobeNetV3Small_SGD_8@NVIDIA-GeForce-RTX-3060",
                                model="MobeNetV3Small", measured_peak_bytes=200 << 20)])
    out = tmp_path / "out.jsonl"
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "bench", "paper",
                           "--runs", runs, "--out", str(out)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    line = json.loads(out.read_text())
    assert line["id"] == "MobeNetV3Small_SGD_8@NVIDIA-GeForce-RTX-3060"
    assert line["predicted_oom"] is False and line["seconds"] > 0
    assert line["estimate_bytes"] >= line["peak_reserved_bytes"] > 0
    assert "xmem-admission (ours)" in proc.stdout and "xmem " in proc.stdout
    # The row's trace is kept beside the output, and --resume simulates it again instead of
    # running the job (a job that could not run: its model does not exist).
    assert (tmp_path / "out.jsonl.traces" / f"{line['id']}.json").is_file()
    runs = write(tmp_path, [row(id=line["id"], model="NoSuchModel",
                                measured_peak_bytes=200 << 20)])
    again = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "bench", "paper",
                            "--runs", runs, "--out", str(out), "--resume"], cwd=ROOT,
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr
    resumed = json.loads(out.read_text())
    assert {k: resumed[k] for k in ("estimate_bytes", "peak_reserved_bytes", "seconds")} == \
        {k: line[k] for k in ("estimate_bytes", "peak_reserved_bytes", "seconds")}


def test_explain_prints_the_breakdown_next_to_the_measurement(tmp_path):
    runs = write(tmp_path, [row(id="MnasNet_SGD_4@NVIDIA-GeForce-RTX-4060", batch_size=4,
                                gpu_name="NVIDIA GeForce RTX 4060")])
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "bench", "paper",
                           "--runs", runs, "--out", str(tmp_path / "o.jsonl"), "--explain",
                           "MnasNet_SGD_4@NVIDIA-GeForce-RTX-4060"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    for word in ("measured", "peak reserved", "activations", "allocator_cache", "xMem"):
        assert word in proc.stdout


def test_an_unknown_row_id_for_explain_is_a_clear_error(tmp_path):
    runs = write(tmp_path, [row()])
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "bench", "paper",
                           "--runs", runs, "--out", str(tmp_path / "o.jsonl"), "--explain",
                           "nope"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "no row with id 'nope'" in proc.stderr
