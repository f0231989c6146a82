"""bench/fits/fit_paper_conv_workspace.py: every rule of the grid is simulated on the kept traces, the
resident bytes count only for jobs that make a convolution, and each paper row is answered with
the runtime overhead fitted without it."""

from __future__ import annotations

from bench.fits import fit_conv_workspace as fcw
from bench.fits import fit_paper_conv_workspace as fit
from bench.fits.fit_overhead import fitted_overhead
from bench.yardsticks.paper.benchmark import Row
from tests.estimator.test_conv_workspaces import FWD as CONV
from tests.estimator.test_conv_workspaces import INPUT_BYTES, traced
from xmem_admission.contract import cudnn, gpus

MIB = 2**20
RTX3060 = gpus.lookup("RTX-3060")


def row(ident, measured_mib, oom=False, family="cnn"):
    return Row({"id": ident, "family": family, "model": "m", "optimizer": "SGD",
                "batch_size": 8, "gpu_name": RTX3060.cuda_name,
                "measured_peak_bytes": measured_mib * MIB, "measured_oom": oom})


def test_each_row_is_answered_with_the_overhead_fitted_on_the_other_rows_of_its_gpu():
    rows = [row("a", 1000), row("b", 1100), row("c", 1300), row("d", 900), row("e", 5000, True)]
    sims = {"a": (950 * MIB, False), "b": (1000 * MIB, False), "c": (1000 * MIB, False),
            "d": (880 * MIB, False), "e": (4000 * MIB, False)}
    answers = fit.leave_one_out(rows, RTX3060, sims, {})
    residuals = {"a": 50 * MIB, "b": 100 * MIB, "c": 300 * MIB, "d": 20 * MIB}
    for ident, (reserved, _) in sims.items():
        others = [v for k, v in residuals.items() if k != ident]
        assert answers[ident]["overhead_bytes"] == fitted_overhead(others)
        assert answers[ident]["estimate_bytes"] == reserved + fitted_overhead(others)
    # leaving out the largest residual lowers the overhead the row is answered with
    assert answers["c"]["overhead_bytes"] < answers["a"]["overhead_bytes"]


def test_a_row_whose_estimate_and_context_exceed_the_card_is_predicted_to_run_out():
    near = RTX3060.capacity_bytes - RTX3060.context_bytes - 10 * MIB
    rows = [row("fits", 1000), row("other", 1000), row("full", 12000, True)]
    sims = {"fits": (900 * MIB, False), "other": (900 * MIB, False), "full": (near, False)}
    answers = fit.leave_one_out(rows, RTX3060, sims, {})
    assert answers["fits"]["predicted_oom"] is False
    assert answers["full"]["overhead_bytes"] > 10 * MIB
    assert answers["full"]["predicted_oom"] is True


def test_the_grid_adds_the_resident_bytes_only_to_jobs_that_make_a_convolution():
    kept = {"cnn": (traced(CONV), RTX3060), "plain": (traced(), RTX3060)}
    grid = fcw.simulate_grid(kept, [(0.0, 0.0), (0.5, 0.5)])
    none = grid[(cudnn.ConvBasis.LARGEST, (0.0, 0.0), 0)]
    resident = grid[(cudnn.ConvBasis.LARGEST, (0.0, 0.0), 256)]
    assert resident["cnn"][0] == none["cnn"][0] + 256 * MIB
    assert resident["plain"] == none["plain"]
    # a fraction of the call's largest tensor becomes a cached workspace segment
    half = grid[(cudnn.ConvBasis.LARGEST, (0.5, 0.5), 0)]
    assert half["cnn"][0] >= none["cnn"][0] + INPUT_BYTES // 2
    assert half["plain"] == none["plain"]
