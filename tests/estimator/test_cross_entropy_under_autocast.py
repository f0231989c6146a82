"""Cross entropy under CUDA autocast: what the probe allocates and what it computes.

``cross_entropy_loss`` is on no CUDA autocast list: it decomposes (LossNLL.cpp) into a
log-softmax in the logits' own dtype and an ``nll_loss`` that autocast runs in fp32. The H200's
snapshot of GPT 134M bf16 (bench/data/H200) is the oracle for what that allocates.
"""

from __future__ import annotations

import lzma
import os
import pickle
import tarfile
import textwrap
from collections import Counter

import pytest
import torch
import torch.nn.functional as F

from tests.estimator.trace_counts import allocations_of_step
from xmem_admission.estimator.probe.autocast import CudaAutocastState
from xmem_admission.estimator.trace import ALLOC

ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..")
H200 = os.path.join(ROOT, "bench", "data", "H200")

# a classifier whose logits have a size no other tensor of the step has
BATCH, FEATURES, CLASSES = 24, 64, 1000
LOGITS_BF16, LOGITS_FP32 = BATCH * CLASSES * 2, BATCH * CLASSES * 4

CLASSIFIER = textwrap.dedent(f"""
    import sys
    import torch
    import torch.nn.functional as F

    amp = sys.argv[1] == "bf16"
    model = torch.nn.Linear({FEATURES}, {CLASSES}).cuda()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn({BATCH}, {FEATURES}, device="cuda")
        y = torch.randint(0, {CLASSES}, ({BATCH},), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=amp):
            loss = F.cross_entropy(model(x), y)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
""")


def second_step_sizes(trace):
    """Sizes of the blocks allocated in the second step."""
    return Counter(e.size for e in allocations_of_step(trace, 1))


@pytest.fixture
def classifier(tmp_path):
    path = tmp_path / "classifier.py"
    path.write_text(CLASSIFIER)
    return str(path)


def test_the_loss_of_bf16_logits_allocates_what_cuda_autocast_allocates(probe_run, classifier):
    result, _ = probe_run([classifier, "bf16"])
    assert result.status == "ok", result.reason
    sizes = second_step_sizes(result.trace)
    # bf16: the logits, their log-softmax (run in the logits' dtype), the gradient nll_loss's
    # fp32 copy hands back, and the log-softmax's gradient; fp32: nll_loss's copy of the
    # log-probabilities (kept for backward) and its gradient. The H200 ran GPT 134M so.
    assert (sizes[LOGITS_BF16], sizes[LOGITS_FP32]) == (4, 2)


def test_fp32_logits_allocate_the_same_with_autocast_on_or_off(probe_run, classifier):
    # with no cast to make, the decomposition is torch's own: nothing more, nothing less
    plain, _ = probe_run([classifier, "off"])
    assert plain.status == "ok", plain.reason
    sizes = second_step_sizes(plain.trace)
    assert (sizes[LOGITS_BF16], sizes[LOGITS_FP32]) == (0, 4)


CASES = [
    pytest.param({}, id="class indices"),
    pytest.param({"reduction": "sum"}, id="sum"),
    pytest.param({"reduction": "none"}, id="no reduction"),
    pytest.param({"ignore_index": 3}, id="ignore index"),
    pytest.param({"weight": True}, id="class weights"),
    pytest.param({"label_smoothing": 0.1}, id="label smoothing"),
    pytest.param({"label_smoothing": 0.1, "weight": True, "ignore_index": 3},
                 id="label smoothing, weights, ignore index"),
    pytest.param({"label_smoothing": 0.1, "reduction": "none"},
                 id="label smoothing, no reduction"),
    pytest.param({"soft": True}, id="class probabilities"),
    pytest.param({"soft": True, "weight": True, "label_smoothing": 0.2},
                 id="class probabilities, weights, label smoothing"),
    pytest.param({"soft": True, "reduction": "none"}, id="class probabilities, no reduction"),
    pytest.param({"shape": (4, 5, 3, 2)}, id="per pixel"),
    pytest.param({"shape": (4, 5, 7)}, id="per position"),
    pytest.param({"shape": (5,)}, id="one sample"),
    pytest.param({"size_average": False}, id="legacy size_average"),
]


@pytest.mark.parametrize("case", CASES)
def test_the_probes_cross_entropy_computes_the_loss_and_gradient_torch_computes(case):
    # The script's own values (a loss it prints or branches on) are unchanged by the probe.
    case = dict(case)
    torch.manual_seed(0)
    shape = case.pop("shape", (6, 5))
    logits = torch.randn(*shape, dtype=torch.float64, requires_grad=True)
    classes = shape[0] if len(shape) == 1 else shape[1]
    if case.pop("soft", False):
        target = torch.softmax(torch.randn(*shape, dtype=torch.float64), dim=0 if len(shape) == 1
                               else 1)
    else:
        target_shape = () if len(shape) == 1 else (shape[0],) + shape[2:]
        target = torch.randint(0, classes, target_shape)
    if case.pop("weight", False):
        case["weight"] = torch.rand(classes, dtype=torch.float64) + 0.5
    state = CudaAutocastState()
    state.enabled, state.dtype = True, torch.bfloat16
    ours = state.call(F.cross_entropy, (logits, target), case)
    (ours_grad,) = torch.autograd.grad(ours.sum(), logits)
    theirs = F.cross_entropy(logits, target, **case)
    (theirs_grad,) = torch.autograd.grad(theirs.sum(), logits)
    assert ours.shape == theirs.shape
    torch.testing.assert_close(ours, theirs)
    torch.testing.assert_close(ours_grad, theirs_grad)


def snapshot_sizes(job):
    with tarfile.open(os.path.join(H200, "snapshots-1.tar")) as archive:
        member = archive.extractfile(f"{job}.pickle.xz")
        assert member is not None
        snapshot = pickle.loads(lzma.decompress(member.read()))
    return Counter(e["size"] for e in snapshot["device_traces"][0] if e["action"] == "alloc")


def test_gpt_134m_bf16_allocates_the_large_blocks_the_h200_run_allocated(probe_run):
    # the oracle: torch.cuda.memory._dump_snapshot() of the job on the H200 (torch 2.11)
    example = os.path.join(ROOT, "examples", "train_gpt.py")
    result, _ = probe_run([example, "--layers", "12", "--hidden", "768", "--heads", "12",
                           "--vocab", "32000", "--seq-len", "1024", "--batch-size", "8",
                           "--optimizer", "adamw", "--amp", "bf16", "--steps", "3"])
    assert result.status == "ok", result.reason
    large = 100 * 2**20  # the logits (fp32 1,048,576,000 B; bf16 524,288,000), embeddings, head
    traced = Counter(e.size for e in result.trace.events if e.op == ALLOC and e.size >= large)
    measured = Counter({size: n for size, n in snapshot_sizes("gpt-134m-bf16-b8-adamw").items()
                        if size >= large})
    assert traced == measured
