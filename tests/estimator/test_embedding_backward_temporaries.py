"""An embedding's backward on the GPU allocates the CUDA kernel's scratch tensors too.

``embedding_dense_backward_cuda`` (Embedding.cu) sorts the indices and
``embedding_backward_cuda_kernel`` (EmbeddingBackwardKernel.cu) sums the gradient rows per
partial segment in a float buffer of ``numel / 10 + min(numel, num_weights)`` rows before
scattering them; the fake kernel makes only the gradient. An H200 running GPT 834M bf16
(bench/data/H200, snapshot gpt-834m-bf16-b8-adamw-expandable; 8 x 1024 tokens taken as a slice
of 8 x 1025, a 1,536-wide embedding of 50,257 rows) allocated, per step, a contiguous copy of the
indices and the sort's tensors of 65,536 bytes, 72,088 bytes of partial-segment offsets and
55,363,584 bytes of per-segment sums around the 308,779,008-byte gradient."""

from __future__ import annotations

import os

from xmem_admission.estimator.probe.kernels import NROWS_PER_THREAD
from xmem_admission.estimator.trace import ALLOC, FREE

EXAMPLE = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_gpt.py")
BATCH, SEQ, HIDDEN, VOCAB, STEPS = 4, 1024, 64, 512, 2


def test_a_gpt_embedding_backward_holds_the_sort_and_the_per_segment_sums(probe_run):
    result, _ = probe_run([EXAMPLE, "--layers", "1", "--hidden", str(HIDDEN), "--heads", "2",
                           "--vocab", str(VOCAB), "--seq-len", str(SEQ), "--batch-size",
                           str(BATCH), "--optimizer", "sgd", "--steps", str(STEPS)], "fake", STEPS)
    assert result.status == "ok", result.reason
    made = [e for e in result.trace.events if e.op == ALLOC
            and e.source == "aten.embedding_dense_backward"]
    numel = BATCH * SEQ  # above 3,072: the sorting kernel, not the feature kernel
    segments = min(numel, VOCAB)
    partial = numel // NROWS_PER_THREAD + segments
    sizes = [e.size for e in made[:len(made) // STEPS]]
    # inputs[:, :-1] is not contiguous: copied; then sorted, orig, range; the gradient; the
    # segment offsets and count, unique_by_key's keys, partials and their offsets, the count,
    # the partial offsets and the float sums
    assert sizes == [numel * 8, numel * 8, numel * 8, numel * 8, VOCAB * HIDDEN * 4,
                     numel * 8, 8, numel * 8, segments * 8, segments * 8, 8, partial * 8,
                     partial * HIDDEN * 4]
    events = result.trace.events
    first = [i for i, e in enumerate(events) if e.op == ALLOC
             and e.source == "aten.embedding_dense_backward"][:len(sizes)]
    after = next(i for i in range(first[-1], len(events)) if events[i].op == ALLOC
                 and events[i].source != "aten.embedding_dense_backward")
    scratch = {events[i].id for i in first if events[i].size != VOCAB * HIDDEN * 4}
    freed = [e.id for e in events[first[0]:after] if e.op == FREE and e.id in scratch]
    # every scratch tensor is returned before the next op allocates; the range the sort
    # read goes first (before the gradient is made), unique_by_key's keys next, then the sums;
    # the gradient lives on
    assert sorted(freed) == sorted(scratch)
    assert freed[:3] == [events[first[3]].id, events[first[7]].id, events[first[-1]].id]


def test_few_indices_take_the_feature_kernel_which_makes_only_the_gradient(probe_run):
    result, _ = probe_run([EXAMPLE, "--layers", "1", "--hidden", str(HIDDEN), "--heads", "2",
                           "--vocab", str(VOCAB), "--seq-len", "64", "--batch-size", "2",
                           "--optimizer", "sgd", "--steps", "2"], "fake", 2)
    assert result.status == "ok", result.reason
    sizes = [e.size for e in result.trace.events if e.op == ALLOC
             and e.source == "aten.embedding_dense_backward"]
    # 128 indices (<= 3,072): the contiguous copy of the sliced indices and the gradient only
    assert sizes == [2 * 64 * 8, VOCAB * HIDDEN * 4] * 2


def test_sliced_token_ids_are_copied_flat_before_the_embedding_looks_them_up(probe_run):
    # Embedding.cpp: weight.index_select(0, indices.reshape(-1)); inputs = tokens[:, :-1] cannot
    # be viewed flat, so the GPU copies them (65,536 bytes for GPT 834M's 8 x 1024 on the H200)
    result, _ = probe_run([EXAMPLE, "--layers", "1", "--hidden", str(HIDDEN), "--heads", "2",
                           "--vocab", str(VOCAB), "--seq-len", "64", "--batch-size", "2",
                           "--optimizer", "sgd", "--steps", "1"], "fake", 1)
    assert result.status == "ok", result.reason
    events = result.trace.events
    made = [i for i, e in enumerate(events) if e.op == ALLOC and e.source == "aten.embedding"]
    assert [events[i].size for i in made] == [2 * 64 * 8, 2 * 64 * HIDDEN * 4]
    copy = events[made[0]].id
    freed_at = next(i for i, e in enumerate(events) if e.op == FREE and e.id == copy)
    assert made[1] < freed_at < made[1] + 3  # freed once the output is made
