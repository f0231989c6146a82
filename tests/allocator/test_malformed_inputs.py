"""Every malformed input to ``xmem replay`` / ``xmem simulate``: a clear message, non-zero exit,
no traceback, and nothing in a pickle ever gets executed."""

from __future__ import annotations

import json
import os
import pickle
import subprocess
import sys

import pytest

from xmem_admission import cli

from .helpers import SNAPSHOT_DIR


class _Evil:
    """Unpickling this with plain pickle.load would call os.system."""

    def __init__(self, marker: str):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _run(argv, capsys):
    code = cli.main(argv)
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err + captured.out
    return code, captured.err


def test_a_file_that_is_not_a_pickle_is_refused(tmp_path, capsys):
    path = tmp_path / "garbage.pickle"
    path.write_bytes(b"this is not a pickle at all\n")
    code, err = _run(["replay", str(path)], capsys)
    assert code == 2
    assert err.startswith("xmem replay: error: ") and "not a readable pickle" in err


def test_a_pickle_that_asks_for_a_class_is_refused_and_runs_nothing(tmp_path, capsys):
    marker = tmp_path / "pwned"
    path = tmp_path / "evil.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [], "x": _Evil(str(marker))}))
    code, err = _run(["replay", str(path)], capsys)
    assert code == 2
    assert "asks to load" in err and "system" in err
    assert not marker.exists()


def test_a_pickle_of_something_else_is_not_a_snapshot(tmp_path, capsys):
    for i, payload in enumerate(([1, 2, 3], {"segments": []}, {"segments": 1, "device_traces": []})):
        path = tmp_path / f"other{i}.pickle"
        path.write_bytes(pickle.dumps(payload))
        code, err = _run(["replay", str(path)], capsys)
        assert code == 2
        assert "not a CUDA memory snapshot" in err or "must be lists" in err


def test_a_truncated_snapshot_is_named_as_truncated(tmp_path, capsys):
    with open(os.path.join(SNAPSHOT_DIR, "memory_files_memory_ctx128_forward.pickle"), "rb") as fh:
        raw = fh.read()
    path = tmp_path / "cut.pickle"
    path.write_bytes(raw[: len(raw) // 2])
    code, err = _run(["replay", str(path)], capsys)
    assert code == 2 and "truncated" in err


def test_malformed_trace_entries_inside_a_snapshot_are_named(tmp_path, capsys):
    path = tmp_path / "bad_entry.pickle"
    path.write_bytes(pickle.dumps({"segments": [], "device_traces": [[{"action": "alloc",
                                                                       "addr": "zero"}]]}))
    code, err = _run(["replay", str(path)], capsys)
    assert code == 2 and "device 0 trace entry 0 is malformed" in err


def test_missing_files_are_named(tmp_path, capsys):
    code, err = _run(["replay", str(tmp_path / "nope.pickle")], capsys)
    assert code == 2 and "no such file" in err
    code, err = _run(["simulate", str(tmp_path / "nope.json")], capsys)
    assert code == 2 and "no such file" in err


def test_a_truncated_trace_is_refused(tmp_path, capsys):
    path = tmp_path / "cut.json"
    path.write_text('{"format": "xmem-trace", "version": 1, "events": [["alloc", 1, 51')
    code, err = _run(["simulate", str(path)], capsys)
    assert code == 2 and "not valid JSON (truncated?)" in err


def test_a_free_of_an_unknown_id_is_refused(tmp_path, capsys):
    path = tmp_path / "free.json"
    path.write_text(json.dumps({"format": "xmem-trace", "version": 1,
                                "events": [["alloc", 1, 512], ["free", 2]]}))
    code, err = _run(["simulate", str(path)], capsys)
    assert code == 2 and "free of id 2, which is not a live allocation" in err


@pytest.mark.parametrize("conf, message", [
    ("roundup_power2_divisions:3", "divisions must be a power of 2"),
    ("max_split_size_mb:1", "max_split_size_mb 1 is too small"),
    ("backend:cudaMallocAsync", "simulates only the native caching allocator"),
    ("per_process_memory_fraction:0.5", "needs the device's capacity"),
])
def test_a_bad_alloc_conf_is_refused_with_what_is_wrong(tmp_path, capsys, conf, message):
    path = tmp_path / "ok.json"
    path.write_text(json.dumps({"format": "xmem-trace", "version": 1, "events": []}))
    code, err = _run(["simulate", str(path), "--alloc-conf", conf], capsys)
    assert code == 2 and err.startswith("xmem simulate: error: ") and message in err


def test_a_bad_capacity_is_an_argument_error(tmp_path, capsys):
    with pytest.raises(SystemExit) as info:
        cli.main(["simulate", "t.json", "--capacity-bytes", "-5"])
    assert info.value.code == 2
    assert "capacity must be positive" in capsys.readouterr().err


def test_the_installed_command_reports_errors_without_a_traceback(tmp_path):
    path = tmp_path / "garbage.pickle"
    path.write_bytes(b"\x80\x04\x95garbage")
    proc = subprocess.run([sys.executable, "-m", "xmem_admission.cli", "replay", str(path)],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    assert "xmem replay: error:" in proc.stderr and "Traceback" not in proc.stderr


def test_simulate_reports_an_out_of_memory_with_exit_code_1(tmp_path, capsys):
    path = tmp_path / "big.json"
    path.write_text(json.dumps({"format": "xmem-trace", "version": 1,
                                "events": [["alloc", 1, 30 << 20]]}))
    assert cli.main(["simulate", str(path), "--capacity-bytes", str(20 << 20)]) == 1
    assert "OUT OF MEMORY at event 0" in capsys.readouterr().out
    assert cli.main(["simulate", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["peak_reserved_bytes"] == 30 << 20 and result["oom"] is None
    assert result["stats"]["segment.large_pool.current"] == 1
