"""CUDA reductions that split each output's values across thread blocks stage partial results in
global memory: a buffer and semaphores from the caching allocator around the kernel (Reduce.cuh,
``gpu_reduce_kernel``). The probe marks each reduction (``reduce:``), the rewrite for a GPU sizes
the blocks with that GPU's SM count.

Every expected size below is worked through Reduce.cuh's ``setReduceConfig`` (torch 2.11) by
hand, in the comments; the H200 figures are also the blocks its snapshots hold
(bench/data/H200/snapshots-1.tar)."""

from __future__ import annotations

import pytest

from xmem_admission.contract import gpus
from xmem_admission.estimator import reductions
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.reductions import ReductionMark, geometry, staging_blocks
from xmem_admission.estimator.trace import Trace

H200 = gpus.lookup("H200")
A100 = gpus.lookup("A100-80GB")


def _h200() -> reductions.Device:
    device = reductions.device_of(H200)
    assert device is not None
    return device


def _bias_grad(rows: int, features: int, itemsize: int = 4) -> ReductionMark:
    """``grad.sum(0)`` of a Linear's [rows, features] output gradient (addmm's bias gradient)."""
    return ReductionMark("sum", (rows, features), (features, 1), (0,), 0, itemsize, itemsize, 4)


def test_the_h200_is_read_as_132_sms_of_2048_resident_threads_and_32_lanes():
    assert _h200() == reductions.Device(132, 2048, 32)


def test_the_rmsnorm_weight_gradient_of_gpt_134m_stages_48_mib_on_an_h200():
    # sum over (8, 1024) of [8, 1024, 768] float: the iterator coalesces the batch and sequence
    # dims into one reduced dim of 8192 (stride 3072 B) before the 768 outputs (stride 4 B).
    mark = ReductionMark("sum", (8, 1024, 768), (1024 * 768, 768, 1), (0, 1), 0, 4, 4, 4)
    g = geometry(mark)
    assert (g.shape, g.out_strides, g.in_strides) == ((8192, 768), (0, 4), (3072, 4))
    # not reducing along the fastest dim: vectorised along the output, 4 wide -> dim0 = 192;
    # 128 threads: block 32 x 4; grid.x = 768 / 4 / 32 = 6; 8192 / 4 = 2048 values per thread
    # >= 256, so ctas_per_output = max(min(ceil(132 * 16 / 6), ceil(2048 / 16)),
    # ceil(2048 / 256)) = 128; buffer = 4 B * 768 * 128 * (32 * 4) and 4 B per grid.x column
    assert staging_blocks(mark, _h200()) == [reductions.Staging(4 * 768 * 128 * 32 * 4, 4 * 6)]
    assert staging_blocks(mark, _h200())[0].buffer == 50_331_648


@pytest.mark.parametrize("features, buffer, semaphores", [
    # fc1's bias, 3072 outputs: grid.x = 3072 / 4 / 32 = 24; 6304 / 4 = 1576 values per thread;
    # ctas = max(min(ceil(2112 / 24), ceil(1576 / 16)), ceil(1576 / 256)) = min(88, 99) = 88
    (3072, 4 * 3072 * 88 * 128, 4 * 24),
    # the attention's packed in_proj bias, 2304 outputs: grid.x = 18; ctas = min(118, 99) = 99
    (2304, 4 * 2304 * 99 * 128, 4 * 18),
])
def test_the_vit_b16_bias_gradients_stage_what_the_h200_snapshot_holds(features, buffer,
                                                                       semaphores):
    # ViT-B/16 at batch 32: 32 x 197 tokens = 6304 rows
    assert staging_blocks(_bias_grad(6304, features), _h200()) == [
        reductions.Staging(buffer, semaphores)]
    assert buffer in (138_412_032, 116_785_152)


def test_a_reduction_with_enough_outputs_stages_nothing():
    # RMSNorm's mean over the last dim: 8192 outputs of 768 values, reduced along the fastest
    # dim: 32 lanes x 16 warps, 768 / 32 = 24 values per thread, under the 256 that would split
    # the input across warps, so no block shares an output
    mark = ReductionMark("mean", (8, 1024, 768), (1024 * 768, 768, 1), (2,), 0, 4, 4, 4)
    assert staging_blocks(mark, _h200()) == []


def test_the_staging_buffer_follows_the_gpu_s_sm_count():
    # the A100 has 108 SMs: fc1's bias takes min(ceil(108 * 16 / 24), 99) = 72 CTAs per output
    device = reductions.device_of(A100)
    assert device is not None and device.multi_processor_count == 108
    assert staging_blocks(_bias_grad(6304, 3072), device) == [
        reductions.Staging(4 * 3072 * 72 * 128, 96)]


def test_a_full_reduction_of_a_large_tensor_stages_one_partial_per_block():
    # loss-style .sum() over 6,291,456 floats: one output, reduced along the fastest dim,
    # vectorised along the input (dim0 / 4); block 32 x 16; 6291456 / 512 = 12288 values per
    # thread; ctas = max(min(ceil(132 * 4 / 1), ceil(12288 / 16)), ceil(12288 / 256)) = 528;
    # block_x reduces, so 4 B * 1 output * 528 CTAs, and one semaphore
    mark = ReductionMark("sum", (8, 1024, 768), (1024 * 768, 768, 1), (0, 1, 2), 0, 4, 4, 4)
    assert staging_blocks(mark, _h200()) == [reductions.Staging(4 * 528, 4)]


def test_an_input_too_large_for_32_bit_indexing_runs_as_halves_each_with_its_staging():
    # [2**20, 1024] float is 4 GiB: with_32bit_indexing halves the reduced dim until each part
    # fits (two parts of 2**19 rows); each launch stages for its own half
    mark = _bias_grad(2**20, 1024)
    blocks = staging_blocks(mark, _h200())
    half = staging_blocks(_bias_grad(2**19, 1024), _h200())
    assert len(blocks) == 2 and blocks == half * 2


def test_a_mark_reads_back_the_same_and_a_bad_one_is_refused():
    mark = _bias_grad(6304, 3072)
    assert ReductionMark.parse(mark.label()) == mark
    for bad in ("reduce: x=1", "reduce:sum x=4,4 s=4 d=0 o=0 b=4 ob=4 acc=4",
                "reduce:sum x=4 s=1 d=0 o=0 b=4 ob=4", "cudnn:fwd x=1"):
        with pytest.raises(ValueError):
            ReductionMark.parse(bad)


def _traced(*labels: str) -> Trace:
    trace = Trace()
    trace.alloc(1, 12288, category="gradient", phase="backward")  # the reduction's output
    for label in labels:
        trace.mark(label)
    trace.free(1)
    return trace


def test_the_rewrite_for_a_gpu_holds_buffer_and_semaphores_around_the_kernel_only():
    out = for_gpu(_traced(_bias_grad(6304, 3072).label()), H200, env={})
    staged = [(e.op, getattr(e, "size", None)) for e in out.events if e.op in ("alloc", "free")]
    assert staged == [("alloc", 12288), ("alloc", 138_412_032), ("alloc", 96), ("free", None),
                      ("free", None), ("free", None)]
    frees = [e.id for e in out.events if e.op == "free"]
    allocs = [e.id for e in out.events if e.op == "alloc"]
    assert frees[:2] == [allocs[2], allocs[1]]  # semaphores first, then the buffer
    assert out.meta["reduction_staging"] == {"marks": 1, "staged_launches": 1,
                                             "largest_buffer_bytes": 138_412_032}
    out.validate()


def test_the_probe_marks_a_linear_bias_gradient_and_the_h200_rewrite_stages_it(probe_run,
                                                                              script):
    # tiny_mlp: Linear(768, 3072) on a batch of 6304: its bias gradient is ViT-B/16's fc1 one
    result, _ = probe_run([script("tiny_mlp.py"), "--batch", "6304", "--hidden", "768"],
                          mode="fake", steps=1)
    assert result.status == "ok", result.reason
    marks = [e.label for e in result.trace.events
             if e.op == "mark" and e.label.startswith(reductions.PREFIX)]
    assert _bias_grad(6304, 3072).label() in marks
    out = for_gpu(result.trace, H200, env={})
    sizes = [e.size for e in out.events if e.op == "alloc" and e.phase == "reduce:sum"]
    assert 138_412_032 in sizes and 96 in sizes


def test_a_sum_into_another_dtype_reads_a_converted_copy_held_around_the_kernel():
    import torch

    flags = torch.empty((8192,), dtype=torch.bool, device="meta")
    count = torch.empty((), dtype=torch.int64, device="meta")
    # make_reduction_from_out_ty: a bool input summed into int64 is reduced as self.to(int64)
    mark = reductions.mark_for("aten.sum.default", (flags,), {}, count)
    assert mark is not None and mark.converted and mark.copy_bytes == 8192 * 8
    assert ReductionMark.parse(mark.label()) == mark
    trace = Trace()
    trace.alloc(1, 8, phase="forward")
    trace.mark(mark.label())
    out = for_gpu(trace, H200, env={})
    stream = [(e.op, e.size if e.op == "alloc" else e.id) for e in out.events
              if e.op in ("alloc", "free")]
    copy = [e.id for e in out.events if e.op == "alloc" and e.size == 8192 * 8]
    assert stream[0] == ("alloc", 8) and stream[1] == ("alloc", 8192 * 8)
    assert stream[-1] == ("free", copy[0])  # freed when the reduction returns, last
    assert out.meta["reduction_staging"]["converted_inputs"] == 1


def test_a_bfloat16_sum_into_float_needs_no_copy_and_accumulates_in_float():
    import torch

    x = torch.empty((8, 1024, 768), dtype=torch.bfloat16, device="meta")
    y = torch.empty((768,), dtype=torch.float32, device="meta")
    # reduce_dispatch: "type promotion that does cast and reduction in a single kernel"
    mark = reductions.mark_for("aten.sum.dim_IntList", (x, [0, 1]), {"dtype": torch.float32}, y)
    assert mark is not None and not mark.converted
    assert (mark.itemsize, mark.out_itemsize, mark.acc_bytes, mark.dims) == (2, 4, 4, (0, 1))
    # float partials, as for a float input: the same 48 MiB on an H200
    assert staging_blocks(mark, _h200())[0].buffer == 50_331_648


def test_a_bfloat16_sum_too_large_for_32_bit_indexing_accumulates_in_a_float_buffer():
    # [2**21, 1024] bfloat16 is 4 GiB: split in two launches; bfloat16 into bfloat16 cannot
    # accumulate in its output, so a float per output element is held across both
    mark = ReductionMark("sum", (2**21, 1024), (1024, 1), (0,), 0, 2, 2, 4)
    assert reductions.accumulation_buffer(mark) == 1024 * 4
    assert reductions.accumulation_buffer(_bias_grad(2**21, 1024)) == 0  # float into float
    assert len(staging_blocks(mark, _h200())) == 2


def test_the_staging_is_taken_on_the_stream_the_reduction_runs_on():
    trace = Trace()
    trace.alloc(1, 12288, stream=3, phase="backward")  # the output, made on a side stream
    trace.mark(_bias_grad(6304, 3072).label())
    out = for_gpu(trace, H200, env={})
    assert {e.stream for e in out.events if e.op == "alloc"} == {3}
