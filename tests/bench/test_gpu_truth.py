"""The ground-truth harness (bench/yardsticks/gpu_truth.py): dry run end to end, bad input, the matrix.

The dry run is the harness's only complete run without a GPU: the measuring half runs the tiny
jobs for real on the CPU (GPU fields zero), the estimating half runs the real ``xmem estimate``
on them. It runs once per module (tens of seconds) and the tests read what it wrote. The matrix
checks read the jobs the GPU run will measure without running them, except for the one job sized
to run out of memory, which the estimator itself must say does not fit.
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any, Dict, List

import pytest

from xmem_admission.contract.gpus import lookup

ROOT = Path(__file__).resolve().parents[2]
SNAPSHOTS = ROOT / "tests" / "data" / "snapshots"
FORWARD_SNAPSHOTS = ["memory_files_memory_ctx128_forward.pickle",
                     "cs336_systems_memory_logs_memory_ctx128_forward.pickle"]


def _load(path: Path, name: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


truth = _load(ROOT / "bench" / "yardsticks" / "gpu_truth.py", "gpu_truth")


def harness(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(ROOT / "bench" / "yardsticks" / "gpu_truth.py"), *args],
                          capture_output=True, text=True, cwd=ROOT, timeout=600)


def read_jsonl(path: Path) -> List[Dict[str, Any]]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("dry-run")
    result = harness("--dry-run", "--out", str(out))
    return out, result


# --- the dry run, end to end ---------------------------------------------------------------------


def test_the_dry_run_succeeds_and_writes_measurements_truth_summary_and_log(dry_run):
    out, result = dry_run
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert {p.name for p in out.iterdir()} == {"measurements.jsonl", "truth.jsonl",
                                               "summary.json", "jobs.log",
                                               "conv_workspaces.jsonl"}


def test_the_dry_run_measures_three_convolution_shapes_on_the_cpu_and_says_none_was_on_a_gpu(
        dry_run):
    out, result = dry_run
    rows = read_jsonl(out / "conv_workspaces.jsonl")
    assert len(rows) == 3
    for row in rows:
        assert row["dry_run"] is True and row["shape"]["x"][0] <= 2
        assert row["held_bytes"] == {"fwd": [None, None], "bwd_data": [None, None],
                                     "bwd_filter": [None, None]}
    assert "Convolution workspaces" in result.stdout
    assert "no shape was measured on a GPU" in result.stdout
    assert json.loads((out / "summary.json").read_text())["conv_workspaces"] == {
        "shapes": 3, "measured": 0}


def test_the_dry_run_trains_every_tiny_job_on_the_cpu_and_records_no_gpu_memory(dry_run):
    out, _ = dry_run
    rows = read_jsonl(out / "measurements.jsonl")
    assert [r["job"] for r in rows] == [j.name for j in truth.DRY_RUN_MATRIX]
    for row in rows:
        assert row["dry_run"] is True and row["device"] == "cpu" and row["gpu_name"] is None
        assert row["error"] is None and row["oom"] is False
        # The runner's optimizer hook saw every step the script made.
        assert row["optimizer_steps"] == truth.DRY_RUN_STEPS
        for key in ("measured_total_bytes", "max_memory_reserved_bytes",
                    "max_memory_allocated_bytes", "context_bytes", "nvml_peak_used_bytes"):
            assert row[key] == 0
        assert row["snapshot"] is None
        assert row["torch_version"] and row["wall_s"] > 0
    expandable = [r for r in rows if r["job"].endswith("-expandable")]
    assert expandable and expandable[0]["env"] == truth.EXPANDABLE


def test_the_dry_run_estimates_every_job_and_writes_the_truth_fields(dry_run):
    out, _ = dry_run
    rows = read_jsonl(out / "truth.jsonl")
    assert [r["job"] for r in rows] == [j.name for j in truth.DRY_RUN_MATRIX]
    capacity = lookup("H200").capacity_bytes
    for row in rows:
        assert row["dry_run"] is True
        assert row["gpu_name"] == "H200" and row["measured_device"] == "cpu"
        assert row["measured_total_bytes"] == row["measured_reserved_peak_bytes"] == 0
        assert row["measured_oom"] is False
        assert row["capacity_bytes"] == capacity
        assert row["estimate_mode"] in ("fake", "profile")
        # total = reserved peak + what lives outside the allocator; reserved holds allocated.
        assert row["estimated_total_bytes"] == (row["estimated_reserved_peak_bytes"]
                                                + row["estimated_overhead_bytes"])
        assert row["estimated_reserved_peak_bytes"] >= row["estimated_allocated_peak_bytes"] > 0
        assert row["estimated_fits"] is True and row["estimated_oom"] is False
        # the range around the point, and the request the default policy gives it covers it
        assert (row["estimated_low_bytes"] <= row["estimated_total_bytes"]
                <= row["estimated_high_bytes"] < row["request_bytes"])
        assert row["error_total"] is None and row["error_reserved_peak"] is None
    expandable = [r for r in rows if r["job"].endswith("-expandable")]
    assert expandable[0]["env"] == truth.EXPANDABLE


def test_the_dry_run_prints_each_job_in_the_table_and_says_why_errors_are_missing(dry_run):
    out, result = dry_run
    for job in truth.DRY_RUN_MATRIX:
        assert f"{job.name} [dry run]" in result.stdout
    assert ("total (NVML peak - level before CUDA): errors not computed (dry run: no GPU memory "
            "was measured)") in result.stdout
    assert "snapshot replay: 0 of 0 match" in result.stdout
    summary = json.loads((out / "summary.json").read_text())
    assert summary["jobs"] == len(truth.DRY_RUN_MATRIX)
    assert summary["total"] is None and summary["estimate_failures"] == 0


def test_a_dry_run_refuses_to_write_under_bench_data():
    target = ROOT / "bench" / "data" / "dry-run-test"
    result = harness("--dry-run", "--out", str(target))
    assert result.returncode == 2
    assert "a dry run never writes under" in result.stderr and "Traceback" not in result.stderr
    assert not target.exists()


def test_the_estimate_half_refuses_to_write_dry_run_rows_under_bench_data(dry_run):
    out, _ = dry_run
    target = ROOT / "bench" / "data" / "H200" / "dry-run-test.jsonl"
    result = harness("--estimate", "--measurements", str(out / "measurements.jsonl"),
                     "--gpu", "H200", "--truth", str(target))
    assert result.returncode == 2
    assert "dry-run rows are never written under" in result.stderr
    assert not target.exists()


# --- the fine-tuning matrix's dry run ------------------------------------------------------------


def test_the_fine_tuning_dry_run_trains_on_its_own_checkpoint_and_is_estimated_in_fake_mode(
        tmp_path):
    """``--matrix finetune`` with the torch environment that has the fine-tuning stack: the
    tests' tiny Llama checkpoint is built, the Trainer + LoRA job trains its steps on the CPU
    (told so by ``--cpu``, the dry run's own argument) and the real ``xmem estimate`` traces it
    in fake mode on a checkpoint built again; the rows name the checkpoint, never a folder of
    the machine that measured."""
    from tests.support.torch_envs import NEWEST

    result = harness("--dry-run", "--matrix", "finetune", "--python", NEWEST.interpreter,
                     "--out", str(tmp_path))
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "the tiny checkpoint built in" in result.stdout
    (measured,) = read_jsonl(tmp_path / "measurements.jsonl")
    (job,) = truth.DRY_RUN_FINETUNE_MATRIX
    assert measured["job"] == job.name and measured["error"] is None
    assert measured["optimizer_steps"] == truth.DRY_RUN_STEPS and measured["device"] == "cpu"
    assert measured["checkpoint"] == "tiny" and truth.CHECKPOINT in measured["args"]
    (row,) = read_jsonl(tmp_path / "truth.jsonl")
    assert row["estimate_mode"] == "fake" and row["estimated_total_bytes"] > 0, row
    assert row["command"][-4:] == ["--seq-len", "64", "--max-steps", str(truth.DRY_RUN_STEPS)]
    assert not [arg for arg in row["command"] if str(tmp_path) in arg or "llama-" in arg]


# --- malformed measurement files -----------------------------------------------------------------


def _good_row(dry_run) -> Dict[str, Any]:
    out, _ = dry_run
    return read_jsonl(out / "measurements.jsonl")[0]


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda row: "", "no measurements in the file"),
        (lambda row: json.dumps(row) + "\n{not json\n", "line 2: not JSON"),
        (lambda row: "[1, 2]\n", "line 1: expected a JSON object, got list"),
        (lambda row: json.dumps({k: v for k, v in row.items() if k != "oom"}),
         "line 1: missing field 'oom'"),
        (lambda row: json.dumps(dict(row, measured_total_bytes="12 GiB")),
         "field 'measured_total_bytes' must be an integer"),
        (lambda row: json.dumps(dict(row, measured_total_bytes=-1)),
         "field 'measured_total_bytes' must be an integer"),
        (lambda row: json.dumps(dict(row, schema="other/9")), "schema 'other/9' is not"),
        (lambda row: json.dumps(dict(row, expect="maybe")), "expect must be one of"),
        (lambda row: json.dumps(dict(row, dry_run=False)),
         "a GPU row needs the measured 'gpu_name'"),
        (lambda row: json.dumps(dict(row, script="../../etc/passwd")),
         "is not a file of this repository"),
        (lambda row: json.dumps(dict(row, snapshot={"archive": "a.tar"})),
         "'snapshot' must be null or name an archive and member"),
        (lambda row: json.dumps(dict(row, job="same")) + "\n" + json.dumps(dict(row, job="same")),
         "line 2: job 'same' already on line 1"),
        (lambda row: json.dumps(row) + "\n" + json.dumps(
            dict(row, job="other", dry_run=False, gpu_name="NVIDIA H200")),
         "mixes dry-run and GPU rows"),
        (lambda row: json.dumps(dict(row, dry_run=False, gpu_name="NVIDIA H200")) + "\n"
         + json.dumps(dict(row, job="b", dry_run=False, gpu_name="NVIDIA A100-SXM4-80GB")),
         "mixes rows of several GPUs"),
        (lambda row: json.dumps(dict(row, steps_flag=3)),
         "field 'steps_flag' must be a string or null"),
        (lambda row: json.dumps(dict(row, checkpoint="bench")),
         "a row with a 'checkpoint' names it in 'args' as {checkpoint}"),
    ],
    ids=["empty", "bad-json", "not-object", "missing-field", "wrong-type", "negative",
         "schema", "expect", "gpu-row-without-gpu", "script-outside-repo", "bad-snapshot",
         "duplicate-job", "mixed-dry-run", "mixed-gpus", "steps-flag", "checkpoint-not-named"],
)
def test_the_estimate_half_refuses_malformed_measurements_with_the_line_and_field(
        dry_run, tmp_path, capsys, make, message):
    bad = tmp_path / "measurements.jsonl"
    bad.write_text(make(_good_row(dry_run)))
    code = truth.main(["--estimate", "--measurements", str(bad),
                       "--truth", str(tmp_path / "truth.jsonl")])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith("gpu_truth: error: ") and message in err, err
    assert not (tmp_path / "truth.jsonl").exists()


def test_the_estimate_half_names_a_missing_file_and_an_unknown_gpu_without_a_traceback(
        dry_run, tmp_path):
    missing = harness("--estimate", "--measurements", str(tmp_path / "nope.jsonl"))
    assert missing.returncode == 2 and "nope.jsonl: no such file" in missing.stderr
    assert "Traceback" not in missing.stderr
    out, _ = dry_run
    unknown = harness("--estimate", "--measurements", str(out / "measurements.jsonl"),
                      "--gpu", "Voodoo-5", "--truth", str(tmp_path / "t.jsonl"))
    assert unknown.returncode == 2 and "'Voodoo-5' is not in the catalogue" in unknown.stderr
    assert "Traceback" not in unknown.stderr


# --- snapshots: packing and replay ---------------------------------------------------------------


def test_snapshots_are_split_into_archives_under_the_limit_and_read_back_intact(tmp_path):
    raws = [(SNAPSHOTS / name).read_bytes() for name in FORWARD_SNAPSHOTS]
    # The limit: the size of an archive holding the larger snapshot alone. Both cannot share one.
    solo = truth.SnapshotPacker(tmp_path / "solo")
    (tmp_path / "solo").mkdir()
    solo.add("solo", max(raws, key=len))
    solo.close()
    limit = solo.archives[0].stat().st_size
    packer = truth.SnapshotPacker(tmp_path, limit=limit, max_archives=2)
    entries = [packer.add(f"job{i}", raw) for i, raw in enumerate(raws)]
    packer.close()
    assert [e["archive"] for e in entries] == ["snapshots-1.tar", "snapshots-2.tar"]
    for path in packer.archives:
        assert path.stat().st_size <= limit
    for entry, raw in zip(entries, raws):
        assert entry["raw_bytes"] == len(raw) > entry["compressed_bytes"]
        assert truth.read_snapshot(tmp_path / entry["archive"], entry["member"]) == raw
    with pytest.raises(truth.HarnessError, match="all 2 archives are full"):
        packer.add("job2", raws[1])


def test_a_snapshot_larger_than_one_archive_is_refused_with_its_size(tmp_path):
    raw = (SNAPSHOTS / FORWARD_SNAPSHOTS[0]).read_bytes()
    with pytest.raises(truth.HarnessError, match="over the 2048-byte limit"):
        truth.SnapshotPacker(tmp_path, limit=2048).add("big", raw)


def test_the_estimate_half_replays_a_recorded_gpu_snapshot_and_records_the_match(
        dry_run, tmp_path):
    # A real GPU snapshot (tests/data/snapshots) packed as the measuring half packs its own,
    # attached to a dry-run row: the estimate half must find it, replay it with `xmem replay`
    # and record what the simulator reproduced.
    packer = truth.SnapshotPacker(tmp_path)
    row = _good_row(dry_run)
    row["snapshot"] = packer.add(row["job"], (SNAPSHOTS / FORWARD_SNAPSHOTS[0]).read_bytes())
    packer.close()
    (tmp_path / "measurements.jsonl").write_text(json.dumps(row) + "\n")
    result = harness("--estimate", "--measurements", str(tmp_path / "measurements.jsonl"),
                     "--gpu", "H200")
    assert result.returncode == 0, result.stderr[-3000:]
    replay = read_jsonl(tmp_path / "truth.jsonl")[0]["replay"]
    assert replay["match"] is True
    assert replay["segment_allocs_expected"] == replay["segment_allocs_matched"] == 289
    assert replay["reserved_expected_bytes"] == replay["reserved_simulated_bytes"]
    assert "snapshot replay: 1 of 1 match, 0 mismatch, 0 not replayed" in result.stdout


def test_an_estimate_that_fails_is_recorded_with_the_clis_reason_and_exits_one(
        dry_run, tmp_path):
    row = _good_row(dry_run)
    row["args"][row["args"].index("--layers") + 1] = "0"  # the script's own parser refuses it
    (tmp_path / "measurements.jsonl").write_text(json.dumps(row) + "\n")
    result = harness("--estimate", "--measurements", str(tmp_path / "measurements.jsonl"),
                     "--gpu", "H200")
    assert result.returncode == 1, result.stderr[-3000:]
    (out,) = read_jsonl(tmp_path / "truth.jsonl")
    assert out["estimate_error"].startswith("xmem estimate exited 2: ")
    assert "before its first optimizer step" in out["estimate_error"]
    assert out.get("estimated_total_bytes") is None and out["error_total"] is None
    assert "1 estimate(s) failed: see estimate_error" in result.stdout


# --- the error statistics ------------------------------------------------------------------------


def _row(job: str, measured: int, estimated: int, *, oom: bool = False, error=None,
         expect: str = "fits", estimated_oom: bool = False) -> Dict[str, Any]:
    row = {"job": job, "dry_run": False, "expect": expect, "measured_total_bytes": measured,
           "measured_reserved_peak_bytes": measured // 2, "measured_oom": oom,
           "measured_error": error, "estimated_total_bytes": estimated,
           "estimated_reserved_peak_bytes": estimated // 2, "estimated_oom": estimated_oom,
           "replay": None}
    truth._add_errors(row)
    return row


def test_error_statistics_cover_completed_jobs_and_name_the_worst_under_estimate():
    rows = [_row("a", 1000, 1010), _row("b", 1000, 980), _row("c", 1000, 1030),
            _row("d", 1000, 1100), _row("e", 1000, 950),
            _row("oom", 5000, 9000, oom=True, expect="oom", estimated_oom=True),
            _row("broken", 1000, 0, error="the script exited with status 1")]
    summary = truth.summarise(rows)
    total = summary["total"]
    assert total["jobs"] == 5
    assert total["median_abs_error"] == pytest.approx(0.03)
    # Nearest rank: ceil(0.9 * 5) = 5th of [.01, .02, .03, .05, .10].
    assert total["p90_abs_error"] == pytest.approx(0.10)
    assert total["worst_under_estimate"] == pytest.approx(-0.05)
    assert total["worst_under_estimate_job"] == "e" and total["under_estimates"] == 2
    assert summary["oom"] == [{"job": "oom", "measured_oom": True, "estimated_oom": True}]
    assert summary["measurement_failures"] == 1
    table = truth.error_table(rows, summary)
    assert "median |error| 3.0%, p90 |error| 10.0%, worst under-estimate -5.0% (e)" in table
    assert "OOM oom: measured OOM, estimate OOM: agree" in table


def test_no_under_estimate_is_reported_as_none():
    summary = truth.summarise([_row("a", 1000, 1010), _row("b", 1000, 1000)])
    assert summary["total"]["worst_under_estimate"] is None
    assert "worst under-estimate none" in truth.error_table(
        [_row("a", 1000, 1010), _row("b", 1000, 1000)], summary)


# --- the matrix ----------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def parsed():
    """Every matrix job's arguments as its example script parses them."""
    gpt = _load(ROOT / "examples" / "train_gpt.py", "example_train_gpt")
    cnn = _load(ROOT / "examples" / "train_cnn.py", "example_train_cnn")
    scripts = {truth.GPT_SCRIPT: gpt, truth.CNN_SCRIPT: cnn}
    return {job.name: (job, scripts[job.script].parse_args(list(job.args)))
            for job in truth.MATRIX}, gpt


def test_the_matrix_has_twenty_fitting_jobs_one_sized_to_oom_and_unique_names():
    expects = [j.expect for j in truth.MATRIX]
    assert expects.count("fits") >= 20
    assert expects.count("oom") == 1
    names = [j.name for j in truth.MATRIX]
    assert len(set(names)) == len(names)
    assert all(set(n) <= set("abcdefghijklmnopqrstuvwxyz0123456789-._") for n in names)


def test_the_matrix_covers_every_feature_the_issue_names(parsed):
    jobs, _ = parsed
    fitting = [(j, a) for j, a in jobs.values() if j.expect == "fits"]
    cnn = [(j, a) for j, a in fitting if j.script == truth.CNN_SCRIPT]
    gpt = [(j, a) for j, a in fitting if j.script == truth.GPT_SCRIPT]
    assert len({a.batch_size for _, a in cnn}) >= 3
    assert len({a.optimizer for _, a in cnn}) >= 3
    assert {a.amp for _, a in gpt} >= {None, "bf16"}
    assert any(a.grad_ckpt for _, a in gpt)
    assert any(a.grad_accum > 1 for _, a in gpt)
    assert any(a.kv_heads < a.heads for _, a in gpt)
    expandable = [j for j, _ in fitting if j.env.get("PYTORCH_CUDA_ALLOC_CONF")
                  == "expandable_segments:True"]
    assert {j.script for j in expandable} == {truth.CNN_SCRIPT, truth.GPT_SCRIPT}
    sizes = [j.parameters for j, _ in gpt]
    assert min(sizes) <= 140e6 and max(sizes) >= 6.5e9


def test_planned_parameter_counts_are_those_of_the_example_models(parsed):
    import torch

    jobs, gpt = parsed
    shapes = {}
    for job, args in jobs.values():
        if job.script == truth.GPT_SCRIPT:
            shapes[(args.layers, args.hidden, args.heads, args.kv_heads, args.intermediate,
                    args.vocab)] = (job.parameters, args)
    for planned, args in shapes.values():
        with torch.device("meta"):
            model = gpt.GPT(args)
        assert sum(p.numel() for p in model.parameters()) == planned


def test_cnn_planning_figures_are_torchvisions_published_ones():
    import torchvision

    for model, gflops in truth.CNN_GFLOPS.items():
        meta = torchvision.models.get_model_weights(model).DEFAULT.meta
        assert meta["_ops"] == pytest.approx(gflops) and meta["num_params"] == \
            truth.CNN_PARAMS[model]


def test_the_time_plan_fits_the_budget_without_the_edge_job():
    planned = sum(j.planned_seconds() for j in truth.MATRIX if j.expect != "edge")
    assert planned <= 420.0  # the default --budget-s
    result = harness("--plan")
    assert result.returncode == 0
    assert f"{len(truth.MATRIX)} jobs" in result.stdout and "planned total" in result.stdout


def test_fitting_jobs_persistent_state_fits_an_h200():
    # fp32 parameters and gradients, plus Adam's two moments: a floor under any estimate.
    capacity = lookup("H200").capacity_bytes
    for job in truth.MATRIX:
        if job.expect == "fits":
            states = 2 if "adam" in job.args[job.args.index("--optimizer") + 1] else 0
            assert job.parameters * 4 * (2 + states) < capacity, job.name


def test_the_job_sized_to_oom_does_not_fit_an_h200_by_the_estimator():
    (job,) = [j for j in truth.MATRIX if j.expect == "oom"]
    result = subprocess.run(
        [sys.executable, "-m", "xmem_admission.cli", "estimate", "--gpu", "H200", "--json",
         "--", *job.command(truth.STEPS)], capture_output=True, text=True, cwd=ROOT,
        timeout=300)
    assert result.returncode == 3, result.stderr[-2000:]
    (gpu,) = json.loads(result.stdout)["gpus"]
    assert gpu["fits"] is False and gpu["oom"] is not None


def test_snapshots_of_a_run_stopped_before_the_archive_was_closed_still_read_back(tmp_path):
    # The device tool returns what is under $OUT even when it kills a run at its time limit.
    raw = (SNAPSHOTS / FORWARD_SNAPSHOTS[0]).read_bytes()
    packer = truth.SnapshotPacker(tmp_path)
    entry = packer.add("cut-short", raw)  # no close(): no end-of-archive blocks
    assert truth.read_snapshot(tmp_path / entry["archive"], entry["member"]) == raw


# --- the runner's NVML sampler -------------------------------------------------------------------


class _Memory:
    def __init__(self, used: int) -> None:
        self.used = used


class _ScriptedNvml:
    """NVML's memory query answering from a list (no NVIDIA driver on the CI machines)."""

    def __init__(self, levels: List[int]) -> None:
        self.levels = levels
        self.calls = 0

    def nvmlDeviceGetMemoryInfo(self, handle: Any) -> _Memory:
        level = self.levels[min(self.calls, len(self.levels) - 1)]
        self.calls += 1
        return _Memory(level)


def test_the_nvml_sampler_keeps_the_peak_between_samples_and_takes_a_last_one():
    import time

    runner = _load(ROOT / "bench" / "yardsticks" / "gpu_truth_runner.py", "gpu_truth_runner")
    # Before CUDA, a rise to a peak, a fall (the allocator freed its cache), the level at the end.
    nvml = _ScriptedNvml([100, 400, 900, 300, 300])
    sampler = runner.NvmlSampler(nvml, handle=None, interval=0.001)
    assert sampler.read() == 100
    sampler.start()
    while nvml.calls < 5:
        time.sleep(0.001)
    result = sampler.stop()
    assert result["nvml_peak_used_bytes"] == 900
    assert result["nvml_final_used_bytes"] == 300
    assert result["nvml_samples"] == nvml.calls >= 6
    assert result["nvml_mean_interval_s"] > 0


# --- what the GPU machine needs ------------------------------------------------------------------


def _imports(path: Path) -> Dict[str, List[str]]:
    """Top-level module of every import in a file, by the function it sits in ("" = module)."""
    import ast

    found: Dict[str, List[str]] = {}

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.ClassDef)) else where
            if isinstance(child, ast.Import):
                found.setdefault(where, []).extend(a.name.split(".")[0] for a in child.names)
            elif isinstance(child, ast.ImportFrom) and child.level == 0:
                found.setdefault(where, []).append(child.module.split(".")[0])
            visit(child, name)

    visit(ast.parse(path.read_text()), "")
    return found


def test_the_measuring_half_imports_only_the_standard_library_torch_and_nvml():
    allowed = set(sys.stdlib_module_names) | {"__future__"}
    runner = _imports(ROOT / "bench" / "yardsticks" / "gpu_truth_runner.py")
    assert {m for ms in runner.values() for m in ms} - allowed == {"torch", "pynvml"}
    harness_imports = _imports(ROOT / "bench" / "yardsticks" / "gpu_truth.py")
    outside = {where: set(ms) - allowed for where, ms in harness_imports.items()}
    # pynvml for the pre-flight check; xmem only in the estimating half, which runs here.
    assert {w: ms for w, ms in outside.items() if ms} == {"_preflight": {"pynvml"},
                                                           "gpu_key": {"xmem_admission"}}
    # And the plan prints with nothing but the standard library (no site-packages at all).
    result = subprocess.run([sys.executable, "-S", str(ROOT / "bench" / "yardsticks" / "gpu_truth.py"),
                             "--plan"], capture_output=True, text=True, cwd=ROOT, timeout=60)
    assert result.returncode == 0, result.stderr
