"""Where in its range a kind of job lands, learned from finished runs (``policy.range_position``):
it narrows what the request covers, within the learned overhead's window and bound, and never
widens a range past its high end."""

from __future__ import annotations

import json
from pathlib import Path
from typing import List

import pytest

from tests.support.estimates import record_dict
from tests.support.harness import make_policy
from xmem_admission.cluster.policy import range_position, sizing
from xmem_admission.cluster.policy.model import LearnedOverhead
from xmem_admission.cluster.policy.range_position import Landing, RangePosition, learn
from xmem_admission.cluster.policy.store import EstimateRecord

MiB, GiB = 1 << 20, 1 << 30
PAPER_ROWS = Path(__file__).resolve().parents[1] / "data" / "paper_cnn_landings.json"


def landings(positions: List[float], gpu: str = "H200", namespace: str = "ml",
             start: float = 1.0e9) -> List[Landing]:
    """Runs of 8 GiB estimates with 1000 MiB ranges, landing at the given positions."""
    point, width = 8 * GiB, 1000 * MiB
    return [Landing(gpu, namespace, point, point + width, point + round(p * width), start + i)
            for i, p in enumerate(positions)]


def ranged_record(total_gib: float, high_gib: float, gpu: str = "H200") -> EstimateRecord:
    raw = record_dict("f" * 64, {gpu: total_gib})
    raw["gpus"][0]["high_bytes"] = int(high_gib * GiB)
    raw["gpus"][0]["low_bytes"] = int(total_gib * GiB)
    return EstimateRecord.from_dict(raw)


def test_no_position_before_the_minimum_number_of_jobs_and_one_high_run_gives_the_range_back():
    settings = LearnedOverhead(min_jobs=5)
    assert learn(landings([0.1, 0.2, 0.1, 0.3]), settings) == ()
    [steady] = learn(landings([0.1, 0.2, 0.1, 0.3, 0.2]), settings)
    [wild] = learn(landings([0.1, 0.2, 0.1, 0.3, 0.2, 40.0]), settings)
    assert steady.percent == 30  # every job of the window fits
    assert wild.percent == 100
    assert wild.above == 1 and wild.jobs == 6 and wild.namespaces == 1


def test_a_position_stays_within_the_range_runs_above_it_are_counted_not_followed():
    settings = LearnedOverhead(min_jobs=3)
    [high] = learn(landings([1.5, 2.0, 3.0, 1.2]), settings)
    [low] = learn(landings([-0.5, -0.4, -0.3]), settings)
    assert high.percent == 100 and high.above == 4
    assert low.percent == 0 and low.above == 0
    assert "4 landed above it" in high.text()


def test_positions_are_per_gpu_model_within_the_window_and_learning_off_learns_nothing():
    settings = LearnedOverhead(min_jobs=2, recent_jobs=3, jobs_per_namespace=2)
    runs = (landings([0.9, 0.9], namespace="a", start=1.0e9)
            + landings([0.1, 0.1, 0.1], namespace="b", start=2.0e9)
            + landings([0.5, 0.5], gpu="A100-80GB"))
    found = {p.gpu: p for p in learn(runs, settings)}
    # the newest three on the H200, at most two from one namespace: b, b and a's newest
    assert found["H200"].jobs == 3 and found["H200"].percent == 90
    assert found["H200"].namespaces == 2
    assert found["A100-80GB"].percent == 50
    # a position between two whole percents is rounded up: never below a run of the window
    [between] = learn(landings([0.2501]), LearnedOverhead(min_jobs=1))
    assert between.percent == 26
    assert learn(runs, LearnedOverhead(enabled=False)) == ()


def test_a_learned_position_narrows_the_request_and_says_so():
    settings = make_policy(gpus=("H200",)).defaults
    record = ranged_record(8.0, 9.0)
    full = sizing.plan(record, settings, positions=())
    learned = (RangePosition("H200", 25, 20, 1),)
    narrowed = sizing.plan(record, settings, positions=learned)
    assert full is not None and narrowed is not None
    # the margin on the point, plus a quarter of the 1 GiB range instead of all of it
    assert full.request_bytes - narrowed.request_bytes == 768 * MiB
    assert "landed at most 25% of the way to its high end (20 job(s) in 1 namespace(s))" in narrowed.range_text()
    assert "bound" not in narrowed.range_text()
    assert narrowed.high_bytes == full.high_bytes == 9 * GiB
    other_gpu = sizing.plan(record, settings, positions=(RangePosition("A100-80GB", 0, 9, 1),))
    assert other_gpu is not None and other_gpu.request_bytes == full.request_bytes


def test_a_learned_position_moves_a_request_by_at_most_the_learned_overheads_bound():
    settings = make_policy(gpus=("H200",), learnedOverhead={"maxCorrection": "512Mi"}).defaults
    record = ranged_record(8.0, 10.0)
    full = sizing.plan(record, settings, positions=())
    narrowed = sizing.plan(record, settings, positions=(RangePosition("H200", 0, 20, 1),))
    assert full is not None and narrowed is not None
    assert full.request_bytes - narrowed.request_bytes == 512 * MiB
    assert "cut to the policy's bound" in narrowed.range_text()


def test_an_exact_estimate_is_not_touched():
    settings = make_policy(gpus=("H200",)).defaults
    record = EstimateRecord.from_dict(record_dict("f" * 64, {"H200": 8.0}))
    assert sizing.plan(record, settings, positions=(RangePosition("H200", 0, 20, 1),)) == \
        sizing.plan(record, settings, positions=())


def test_learned_on_half_the_papers_convolution_rows_the_position_narrows_the_others_safely():
    """The xMem paper's convolution jobs on the RTX 3060 and 4060 (tests/data/
    paper_cnn_landings.json: each one's estimate and range, and what NVML measured): learned on
    every other row, the narrowed requests of the rest still hold what they measured, and some
    of them are smaller than the whole range's."""
    from bench.yardsticks.paper.request_sizes import request_bytes

    rows = json.loads(PAPER_ROWS.read_text())["rows"]
    settings = LearnedOverhead(min_jobs=5, jobs_per_namespace=50)
    saved, scored = 0, 0
    for gpu in ("RTX-3060", "RTX-4060"):
        mine = [r for r in rows if r["gpu"] == gpu]
        for fit, score in ((mine[0::2], mine[1::2]), (mine[1::2], mine[0::2])):
            learned = learn([range_position.landing(gpu, "paper", r["estimate_bytes"],
                                                    r["high_bytes"], r["measured_bytes"],
                                                    float(i)) for i, r in enumerate(fit)
                             if r["high_bytes"] > r["estimate_bytes"]], settings)
            [position] = learned
            for r in score:
                point, high = r["estimate_bytes"], r["high_bytes"]
                narrowed, _ = range_position.narrowed_high(point, high, high, point, position,
                                                             GiB)
                request = request_bytes(point, narrowed, gpu)
                assert r["measured_bytes"] <= request, (r["id"], position)
                saved += request_bytes(point, high, gpu) - request
                scored += 1
    assert scored >= 30 and saved >= GiB


def test_the_controller_reads_where_each_recorded_run_landed_in_its_estimates_range(
        deviceless_cudnn):
    from tests.estimator.test_estimate_range import BACKWARD, MARK
    from tests.estimator.trace_counts import traced
    from xmem_admission.cluster.controller import learned_overhead, observed_peaks, records
    from xmem_admission.cluster.observations import ObservedPeak, Source
    from xmem_admission.contract import gpus, termination
    from xmem_admission.estimator.estimate import estimate_trace

    trace = traced(MARK, BACKWARD)
    trace.meta["cuda"] = "12.4"  # the paper GPUs' CUDA: a cuDNN job's range reaches +472 MiB
    [est] = estimate_trace(trace, [gpus.lookup("RTX-3060")])
    decoded = termination.decode(termination.encode_ok("fake", 3, 1.0, [est.to_dict()]))
    point, high = est.total_bytes, est.high_bytes
    assert high > point

    def run(uid: str, peak: int, completed: bool = True, estimate: int = point):
        job = {"metadata": {"name": uid, "uid": uid}}
        return observed_peaks.run_entry(job, "Job", completed, "RTX-3060", estimate, high, 1,
                                        ObservedPeak(peak, Source.HAMI, 1),
                                        "2026-12-06T20:00:00Z", est.peak_reserved_bytes)

    quarter = point + (high - point) // 4
    gme = {"metadata": {"namespace": "ml", "name": "g"},
           "status": {"estimates": records.estimates_from(decoded.gpus),
                      "runs": [run("a", quarter), run("b", high, completed=False),
                               run("c", high, estimate=point - 1)]}}
    # only the completed run sized from this estimate counts
    [landed] = learned_overhead.landings([gme])
    assert (landed.gpu, landed.namespace) == ("RTX-3060", "ml")
    assert landed.position == pytest.approx(0.25, abs=0.01)
