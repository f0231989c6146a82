"""Code that builds a model under ``torch.device("meta")`` reads that device back and skips what
it would do to real weights. With real values (profile mode) the probe leaves such tensors on
the meta device, as a GPU machine does: transformers 5 builds a pretrained model there, loads
the checkpoint's tensors, then materialises and initialises what the checkpoint lacks (a rotary
embedding's ``inv_freq``). Built on host memory instead, the model was initialised at
construction and marked so, and the buffers that replaced the meta ones kept uninitialised
memory: a GRPO job sampled from nan probabilities now and then.

``MALLOC_PERTURB_`` makes glibc fill memory it hands out with a set byte (mallopt(3),
M_PERTURB), so uninitialised memory never happens to read as the right values."""

from __future__ import annotations

from tests.finetune.test_checkpoints_are_never_read import estimate_and_log


def test_a_pretrained_models_buffers_hold_their_values_in_profile_mode(llama_checkpoint):
    result, log = estimate_and_log("pretrained_buffers.py", "--model", str(llama_checkpoint),
                                   mode="profile", env={"MALLOC_PERTURB_": "165"})
    assert result["mode"] == "profile" and result["steps"] == 3
    assert "equal to the model built from its config" in log
