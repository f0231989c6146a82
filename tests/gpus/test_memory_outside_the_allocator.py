"""What a job holds outside the caching allocator: per GPU, CUDA major and library, with bases."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path
from typing import Any, Dict, List

import pytest

from xmem_admission import cli
from xmem_admission.contract import overhead
from xmem_admission.contract.gpus import all_gpus, lookup
from xmem_admission.contract.overhead import Basis, cuda_major_of, for_gpu
from xmem_admission.estimator.estimate import estimate_trace
from xmem_admission.estimator.trace import Category, Trace

ROOT = Path(__file__).resolve().parents[2]
H200_ROWS = ROOT / "bench" / "data" / "H200" / "measurements.jsonl"
MiB = 1 << 20


def _fit_outside() -> Any:
    spec = importlib.util.spec_from_file_location("fit_outside", ROOT / "bench" / "fits" / "fit_outside.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _h200_rows() -> List[Dict[str, Any]]:
    return [json.loads(line) for line in H200_ROWS.read_text().splitlines() if line.strip()]


def test_the_h200s_context_under_cuda_13_is_the_measured_one():
    figures = for_gpu("H200", 13)
    assert figures.context.basis is Basis.MEASURED
    assert figures.context.bytes == 552_402_944
    assert "bench/data/H200/measurements.jsonl" in figures.context.source
    assert figures.runtime.basis is Basis.FITTED


def test_the_catalogues_h200_figures_are_the_fit_on_the_committed_h200_rows():
    context, runtime, cudnn = _fit_outside().fit(_h200_rows())
    figures = for_gpu("H200", 13)
    assert (figures.context.bytes, figures.runtime.bytes, figures.cudnn.bytes) == (
        context, runtime, cudnn)


def test_a_gpu_never_measured_gets_the_h200s_context_resized_by_its_thread_stacks():
    inferred = for_gpu("A100-80GB", 13)
    measured = for_gpu("H200", 13)
    # A100: 108 SMs x 2048 threads x 1 KiB of stack; H200: 132 x 2048 x 1 KiB.
    assert overhead.local_memory_bytes("A100-80GB") == 108 * 2048 * 1024
    assert inferred.context.bytes == (measured.context.bytes - 132 * 2048 * 1024
                                      + 108 * 2048 * 1024)
    small = for_gpu("RTX-4060", 12).context  # 24 SMs x 1536 threads (Ada)
    assert small.bytes == measured.context.bytes - 132 * 2048 * 1024 + 24 * 1536 * 1024
    for figure in (inferred.context, inferred.runtime, inferred.cudnn, small):
        assert figure.basis is Basis.INFERRED and "H200" in figure.source
    assert inferred.runtime.bytes >= measured.runtime.bytes


def test_an_inferred_cudnn_figure_takes_the_widest_spread_known_for_its_cuda():
    # the paper GPUs' cuDNN figures are all 0 MiB (inside their runtime figure); their spreads
    # reach 472 MiB on the RTX 3060 and 52 on the RTX 4060: an A100-80GB under CUDA 12 gets 472
    widest = max(for_gpu(g, 12).cudnn.high_bytes for g in ("RTX-3060", "RTX-4060", "A100-40GB"))
    assert widest == 472 * MiB
    for gpu in ("A100-80GB", "H100-80GB"):
        cudnn = for_gpu(gpu, 12).cudnn
        assert cudnn.basis is Basis.INFERRED and cudnn.bytes == 0
        assert cudnn.high_bytes == widest, (gpu, cudnn.source)


def test_an_inferred_context_lets_a_job_that_ran_on_the_papers_rtx_4060_fit():
    # T5-small AdamW batch 39 ran on the paper's RTX 4060 (7.75 GiB as torch sees it) peaking
    # 7.38 GiB above the level after CUDA init: the card held that and its context.
    rtx4060 = lookup("RTX-4060")
    figures = for_gpu("RTX-4060", 12, uses_cudnn=False)
    assert figures.context.bytes + int(7.38 * 2**30) <= rtx4060.capacity_bytes


def test_the_paper_gpus_keep_their_cuda_12_runtime_fits_beside_an_inferred_context():
    a100 = for_gpu("A100-40GB", 12)
    assert a100.runtime.basis is Basis.FITTED and a100.runtime.bytes == 92 * MiB
    assert a100.context.basis is Basis.INFERRED
    assert a100.total_bytes == a100.context.bytes + 92 * MiB


def test_only_a_job_that_calls_cudnn_is_charged_cudnns_modules():
    with_convs = for_gpu("H200", 13, uses_cudnn=True)
    without = for_gpu("H200", 13, uses_cudnn=False)
    assert with_convs.total_bytes - without.total_bytes == with_convs.cudnn.bytes > 0


def test_an_unknown_cuda_is_read_as_the_newest_and_flagged():
    figures = for_gpu("H200", None)
    assert figures.cuda_major == overhead.NEWEST_CUDA_MAJOR
    assert figures.cuda_major_known is False
    assert for_gpu("H200", 13).cuda_major_known is True


@pytest.mark.parametrize("cuda, torch, major", [
    ("13.0", None, 13), ("12.8", "2.14.1+cu128", 12), (None, "2.11.0+cu130", 13),
    (None, "2.2.2+cu121", 12), (None, "2.6.0+cu118", 11), (None, "2.14.1+cpu", None),
    (None, "2.14.1", None), (None, None, None), ("", "", None),
])
def test_the_cuda_major_comes_from_torch_version_cuda_else_the_wheels_local_version(
        cuda, torch, major):
    assert cuda_major_of(cuda, torch) == major


def test_every_catalogue_gpu_has_figures_with_sources_for_every_cuda_major_it_lists():
    for gpu in all_gpus():
        for major in overhead.cuda_majors(gpu.key):
            figures = for_gpu(gpu.key, major)
            for figure in (figures.context, figures.runtime, figures.cudnn):
                assert figure.source and figure.bytes >= 0
        assert gpu.overhead_bytes == for_gpu(gpu.key).total_bytes


def _tiny_trace(cuda: str) -> Trace:
    trace = Trace(meta={"torch": "2.11.0+cu130", "cuda": cuda})
    trace.alloc(1, 64 * MiB, category=Category.PARAMETER)
    trace.alloc(2, 32 * MiB, category=Category.ACTIVATION)
    trace.free(2)
    return trace


def test_an_estimate_adds_the_figures_of_the_jobs_own_cuda_and_shows_them():
    h200 = lookup("H200")
    (under_13,) = estimate_trace(_tiny_trace("13.0"), [h200])
    expected = for_gpu("H200", 13, uses_cudnn=False)
    assert under_13.overhead_bytes == expected.total_bytes
    assert under_13.total_bytes == under_13.peak_reserved_bytes + expected.total_bytes
    assert under_13.overhead["context"]["basis"] == "measured"
    assert under_13.overhead["cuda_major"] == 13 and under_13.overhead["uses_cudnn"] is False
    a100 = lookup("A100-40GB")
    (under_12,) = estimate_trace(_tiny_trace("12.4"), [a100])
    assert under_12.overhead_bytes == for_gpu("A100-40GB", 12, uses_cudnn=False).total_bytes
    assert under_12.overhead["runtime"]["basis"] == "fitted"


def test_each_h200_row_is_scored_with_the_overhead_fitted_on_the_other_rows():
    fit = _fit_outside()
    rows = _h200_rows()
    loo = fit.leave_one_out(rows)
    target = next(r for r in rows if r["job"] == "gpt-134m-fp32-b8-adamw")
    planted = [dict(r, measured_total_bytes=r["measured_total_bytes"] + 512 * MiB)
               if r["job"] == target["job"] else r for r in rows]
    # The row's own measurement moves the full fit but never its own leave-one-out figure.
    assert fit.leave_one_out(planted)[target["job"]] == loo[target["job"]]
    assert fit.fit(planted)[1] == fit.fit(rows)[1] + 512 * MiB - 16 * MiB  # fp32 held 16 less


def test_a_row_whose_nvml_peak_missed_the_allocators_is_not_fitted_on():
    fit = _fit_outside()
    missed = next(r for r in _h200_rows() if r["job"] == "llama-6.7b-bf16-b1-s4096-adamw")
    assert fit.outside_bytes(missed) < missed["context_bytes"]
    assert not fit.usable(missed)


def test_xmem_gpus_shows_each_figures_basis_and_the_cuda_12_fits(capsys):
    assert cli.main(["gpus"]) == 0
    out = capsys.readouterr().out
    h200 = next(line for line in out.splitlines() if line.startswith("H200 "))
    assert "527 MiB m" in h200 and "240 MiB f" in h200
    assert "A100-40GB with CUDA 12: context 479 MiB i, runtime 92 MiB f" in out
    assert cli.main(["gpus", "--json"]) == 0
    record = next(g for g in json.loads(capsys.readouterr().out)["gpus"] if g["key"] == "H200")
    assert record["overhead_by_cuda_major"]["13"]["context"]["basis"] == "measured"
