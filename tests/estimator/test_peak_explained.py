"""The peak explained: what holds the memory at each GPU's simulated peak, named by
module, category and op, checked against counts from the models' shapes; and what would change
it, simulated again."""

from __future__ import annotations

import os
import re

import pytest

from tests.support.torch_envs import require_module
from xmem_admission.contract import gpus as catalogue
from xmem_admission.estimator import peak
from xmem_admission.estimator.estimate import allocator_config, estimate_trace
from xmem_admission.estimator.trace import LOSS

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100 = catalogue.lookup("H100-80GB")
# GPT-2 small's shape (12 layers, 768 wide, 12 heads, GPT-2's vocabulary), 8 x 1024 tokens
BATCH, SEQ, VOCAB = 8, 1024, 50257
GPT = [os.path.join(ROOT, "examples", "train_gpt.py"), "--layers", "12", "--hidden", "768",
       "--heads", "12", "--vocab", str(VOCAB), "--seq-len", str(SEQ), "--batch-size",
       str(BATCH), "--optimizer", "adamw"]
DEVICE = {"name": H100.cuda_name, "total_memory": H100.capacity_bytes,
          "compute_capability": list(H100.compute_capability),
          "multi_processor_count": H100.multi_processor_count}


def _trace(argv, steps):
    from xmem_admission.estimator.probe import runner

    result = runner.run(argv, "fake", steps, DEVICE)
    assert result.status == "ok", result.reason
    return result.trace


@pytest.fixture(scope="module")
def gpt():
    trace = _trace(GPT, 2)
    config = allocator_config(None, trace.meta.get("torch"))
    return trace, config, peak.explain(trace, [H100], config)[0]


def test_the_gpt_peak_is_the_loss_gradients_over_the_vocabulary(gpt):
    _trace_, _config, found = gpt
    logits = BATCH * SEQ * VOCAB * 4  # fp32 logits: batch x sequence x vocabulary x 4 bytes
    top = found.largest
    assert top is not None
    # the gradient of the log-probabilities and of the logits, made by the loss's backward
    assert (top.module, top.category, top.blocks) == (LOSS, "temporary", 2)
    assert top.bytes == 2 * logits
    assert set(top.ops) == {"aten._log_softmax_backward_data", "aten.nll_loss_backward"}
    head = [g for g in found.groups if g.module == "GPT.lm_head" and g.category == "activation"]
    assert [(g.op, g.bytes) for g in head] == [("aten.mm", logits)]
    assert found.phase == "backward" and found.step == 1
    assert found.reserved_bytes == found.allocated_bytes + found.cached_free_bytes
    assert 0 <= found.fragmentation_bytes <= found.cached_free_bytes


def test_the_text_and_json_name_the_largest_group_and_bound_the_rest(gpt):
    trace, config, found = gpt
    [est] = estimate_trace(trace, [H100], config)
    explained = peak.Explained([found], peak.alternatives(trace, [est], config, 0.05, [found],
                                                          everywhere=False))
    text = "\n".join(explained.lines())
    assert re.search(r"\(loss\)\s+temporary\s+aten\._log_softmax_backward_data\s+3\.07 GiB", text)
    assert "more groups)" in text
    data = explained.into({"gpus": [est.to_dict()]})
    listed = data["gpus"][0]["peak"]
    assert len(listed["groups"]) == peak.TOP_GROUPS and listed["rest_groups"] > 0
    assert sum(g["bytes"] for g in listed["groups"]) + listed["rest_bytes"] == \
        listed["allocated_bytes"]


def test_what_would_change_it_is_simulated_again(gpt):
    trace, config, found = gpt
    [est] = estimate_trace(trace, [H100], config)
    alt = peak.alternatives(trace, [est], config, 0.05, [found])
    [expandable] = alt.expandable_segments
    assert 0 < expandable["total_bytes"] < est.total_bytes  # no cached pieces left unusable
    [request] = alt.requests
    assert request["recommended_request_bytes"] == est.recommended_request_bytes
    assert request["mig_slice_bytes"] >= est.recommended_request_bytes
    fits = {c["gpu"]: c["fits"] for c in alt.catalogue}
    assert set(fits) == {g.key for g in catalogue.all_gpus()}
    assert fits["H100-80GB"] and not fits["RTX-4060"]  # 8 GB cannot hold the 14 GiB peak
    assert all(c["total_bytes"] <= c["capacity_bytes"] for c in alt.catalogue if c["fits"])
    assert alt.dominant_activations["module"] == LOSS


def test_the_resnet50_peak_names_a_full_resolution_activation():
    require_module("torchvision")
    trace = _trace([os.path.join(ROOT, "examples", "train_cnn.py"), "--model", "resnet50",
                    "--batch-size", "32", "--image-size", "224", "--optimizer", "sgd"], 1)
    a100 = catalogue.lookup("A100-80GB")
    found = peak.explain(trace, [a100], allocator_config(None, trace.meta.get("torch")))[0]
    # the largest group of activations (on some GPUs a cuDNN workspace held from the first
    # convolution on is larger: it is listed as such, outside modules)
    top = next(g for g in found.groups if g.category == "activation")
    assert all(g.category == "workspace" and g.module == ""
               for g in found.groups[:found.groups.index(top)])
    # the largest feature maps: 32 x 64 x 112 x 112 (stem) = 32 x 256 x 56 x 56 (layer1), fp32;
    # a batch norm's group adds its saved mean and inverse std, one float per channel each
    # (64 or 256 channels: blocks of 512 or 1,024 bytes, the allocator's 512-byte rounding)
    feature_map = 32 * 64 * 112 * 112 * 4
    assert top.bytes in (feature_map, feature_map + 2 * 512, feature_map + 2 * 1024)
    assert re.fullmatch(r"ResNet\.(bn1|conv1|layer1\.\d\.(bn3|conv3|downsample\.\d))",
                        top.module), top.module


def test_a_gpu_whose_card_holds_the_job_but_not_its_margin_is_said_to_take_the_whole_card():
    gib = 2**30
    card = {"gpu": "T4", "capacity_bytes": int(14.55 * gib), "total_bytes": int(14.50 * gib),
            "recommended_request_bytes": int(15.23 * gib), "fits": True, "out_of_memory": False}
    roomy = dict(card, gpu="L4", capacity_bytes=int(22.35 * gib))
    alt = peak.Alternatives([], [], [card, roomy], None)
    [line] = [x for x in peak.Explained([], alt).lines() if x.startswith("  fits:")]
    assert line == ("  fits: T4 (the whole card: 14.50 GiB of 14.55 GiB, no room for the margin), "
                    "L4 (15.23 GiB)")


def test_the_html_reports_catalogue_table_never_offers_a_request_above_the_card():
    from xmem_admission.estimator import report
    from xmem_admission.estimator.estimate import Estimate, estimate_trace
    from xmem_admission.estimator.trace import Category, Trace

    gib = 2**30
    trace = Trace(meta={"torch": "2.11.0+cu130", "cuda": "13.0"})
    trace.alloc(1, 64 * 2**20, category=Category.PARAMETER)
    t4 = catalogue.lookup("T4")
    est = Estimate("fake", 1, 0.1, estimate_trace(trace, [t4]))
    card = {"gpu": "T4", "capacity_bytes": t4.capacity_bytes, "total_bytes": int(14.50 * gib),
            "recommended_request_bytes": int(15.23 * gib), "fits": True, "out_of_memory": False}
    explained = peak.Explained([], peak.Alternatives([], [], [card], None))
    html = report.page(trace, est, explained, allocator_config(None, "2.11.0"))
    table = html[html.index("<th>catalogue GPU</th>"):]
    row = table[table.index("<td>T4</td>"):]
    row = row[:row.index("</tr>")]
    assert "15.23 GiB" not in row
    assert "the whole card: 14.50 GiB of 14.55 GiB, no room for the margin" in row
