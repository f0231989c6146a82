"""The yardsticks' request scoring (bench/yardsticks/paper/request_sizes.py): a job that ran is over
its request when its measured peak passes what the default policy grants it; a line written
before the range existed is sized from its estimate alone; OOM calls are counted by what was said.
No module beside the paper's job script takes the name of a package its jobs import."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from bench.yardsticks.gpumemnet import Row as GPUMemNetRow
from bench.yardsticks.paper.benchmark import JOBS_SCRIPT, Row
from bench.yardsticks.paper.request_sizes import request_bytes, tally

GiB = 1 << 30


def test_a_job_over_its_request_and_the_cost_are_counted_per_family():
    rows = [Row({"id": "a", "family": "cnn", "gpu_name": "NVIDIA A100-SXM4-40GB",
                 "measured_peak_bytes": 10 * GiB, "measured_oom": False}),
            # GPUMemNet's rows name their GPU and OOM otherwise
            GPUMemNetRow({"id": "b", "family": "large-transformer",
                          "gpu": "NVIDIA A100-SXM4-40GB", "measured_peak_bytes": 4 * GiB,
                          "status": "ok"}),
            Row({"id": "c", "family": "cnn", "gpu_name": "NVIDIA A100-SXM4-40GB",
                 "measured_peak_bytes": 41 * GiB, "measured_oom": True})]
    answers = {"a": {"estimate_bytes": 9 * GiB, "high_bytes": 9 * GiB},  # granted ~9.5 GiB
               "b": {"estimate_bytes": 4 * GiB},  # an older line: no range
               "c": {"estimate_bytes": 39 * GiB, "predicted_oom": False, "fit": "may not fit"}}
    out = tally(rows, answers)
    assert out["CNN"].ran == 1 and out["CNN"].over == 1
    assert out["CNN"].oom_rows == 1 and out["CNN"].oom_warned == 1 and out["CNN"].oom_called == 0
    assert out["transformer"].over == 0
    assert out["transformer"].median_over_measured == request_bytes(
        4 * GiB, None, "A100-40GB") / (4 * GiB) - 1
    assert out["all"].ran == 2


def test_the_high_end_adds_its_excess_to_the_request():
    # 9 GiB x 1.05 = 9.45 GiB, in 256 MiB steps 9.5 GiB; with a 1 GiB excess 10.45, so 10.5
    assert request_bytes(9 * GiB, None, "A100-40GB") == 9.5 * GiB
    assert request_bytes(9 * GiB, 10 * GiB, "A100-40GB") == 10.5 * GiB


def test_no_module_beside_the_paper_job_script_shadows_a_package_the_jobs_import():
    # python puts the script's folder first on sys.path: a requests.py there made
    # transformers' `import requests` fail in every transformer row
    folder = Path(JOBS_SCRIPT).parent
    for path in folder.glob("*.py"):
        found = importlib.util.find_spec(path.stem)
        assert found is None or Path(str(found.origin)).parent == folder, (path.name, found)


def test_held_out_a_cnns_high_end_covers_what_the_other_convolution_rows_needed_beyond_theirs():
    from bench.yardsticks.paper.benchmark import held_out

    MiB = 1 << 20
    gpu = "NVIDIA GeForce RTX 3060"
    # three CNN rows measured 100, 300 and 600 MiB over their convolutions' high end
    rows = [Row({"id": ident, "family": "cnn", "gpu_name": gpu, "measured_oom": False,
                 "measured_peak_bytes": 4 * GiB + over * MiB})
            for ident, over in (("a", 100), ("b", 300), ("c", 600))]
    answers = [{"id": r.id, "estimate_bytes": 4 * GiB, "high_bytes": 4 * GiB,
                "peak_reserved_bytes": 4 * GiB, "high_reserved_bytes": 4 * GiB,
                "convolutions": True} for r in rows]
    out = held_out(rows, answers)
    # "c" is held out: its high end covers what "b" needed (300 MiB), not its own 600
    assert out["c"]["high_bytes"] == 4 * GiB + 300 * MiB
    assert out["a"]["high_bytes"] == out["b"]["high_bytes"] == 4 * GiB + 600 * MiB
    assert all(out[k]["request_bytes"] >= out[k]["high_bytes"] for k in "abc")
