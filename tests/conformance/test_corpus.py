"""The conformance corpus: one script per real-world training idiom, in its framework's style
(timm, nanoGPT, accelerate, Lightning, Hugging Face Trainer, torchvision ImageFolder,
word_language_model, a checkpoint resumed onto the GPU), traced unmodified in fake mode. Each is
checked against the parameter, gradient and optimizer-state bytes counted from the model itself
(``counts.expected``), at the second step's end, when all three are live."""

from __future__ import annotations

import inspect

import pytest

from tests.conformance.counts import expected, load
from tests.estimator.trace_counts import live_by_category_at
from tests.support.torch_envs import require_module, require_torch_save

# script, extra arguments, optimizer kind, step counters on the GPU
CORPUS = [
    ("timm_train.py", [], "adamw", False),
    ("nanogpt_train.py", [], "adamw", True),  # fused AdamW
    ("accelerate_train.py", [], "adamw", False),
    ("lightning_train.py", [], "adamw", False),
    ("hf_trainer_train.py", [], "adamw", False),
    ("imagefolder_train.py", [], "sgd_momentum", False),
    ("word_lm_train.py", [], "sgd", False),
    ("checkpoint_resume.py", ["--resume", "{checkpoint}"], "adam", True),  # step loaded to cuda
]


# The framework each script is written for (imagefolder_train.py: torchvision's ImageFolder).
FRAMEWORKS = {"timm_train.py": "timm", "accelerate_train.py": "accelerate",
              "lightning_train.py": "lightning", "hf_trainer_train.py": "transformers",
              "imagefolder_train.py": "torchvision"}


def require_framework(name):
    """The script's framework, where one is named (tests/support/torch_envs.require_module), and
    a working torch.save for the script that resumes from a checkpoint."""
    if name in FRAMEWORKS:
        require_module(FRAMEWORKS[name])
    if name == "checkpoint_resume.py":
        require_torch_save()


def trainer_default_is_fused():
    """Does the Trainer's default optimizer run fused AdamW (``adamw_torch_fused``, the default
    of transformers releases since torch 2.8: training_args.py, ``default_optim``)? Fused
    AdamW keeps each parameter's step counter on the GPU."""
    from transformers import TrainingArguments

    optim = TrainingArguments(output_dir="unused", report_to=[]).optim
    return "fused" in str(getattr(optim, "value", optim))


def training_state(name, kind, step_on_gpu):
    """What the GPU must hold for this script's model, from its own construction code."""
    if name == "hf_trainer_train.py":
        step_on_gpu = trainer_default_is_fused()
    module = load(name)
    args = module.parse([])
    counts = expected(module.build_model(args), kind, step_on_gpu)
    # built on the host here: a script that picks its optimizer by device gets the host's
    # (nanoGPT's fused AdamW has no host kernel before torch 2.4)
    on_host = {"device_type": "cpu"} if "device_type" in inspect.signature(
        module.build_optimizer).parameters else {}
    if module.build_optimizer(args, module.build_model(args), **on_host) is None:
        assert kind in ("sgd", "adamw")  # hand-written SGD, or a Trainer's own AdamW
    return counts


@pytest.mark.parametrize("name,extra,kind,step_on_gpu", CORPUS, ids=[c[0][:-3] for c in CORPUS])
def test_a_corpus_script_traces_in_fake_mode_with_its_model_state_on_the_gpu(
        trace_script, tmp_path, name, extra, kind, step_on_gpu):
    require_framework(name)
    checkpoint = tmp_path / "checkpoint.pth.tar"
    if name == "checkpoint_resume.py":
        load(name).write_checkpoint(load(name).parse([]), str(checkpoint))
    args = [a.format(checkpoint=checkpoint) for a in extra]
    result, output = trace_script(name, *args)
    assert (result.status, result.mode, result.steps) == ("ok", "fake", 3), \
        result.reason + result.traceback
    live = live_by_category_at(result.trace, "step 2")
    want = training_state(name, kind, step_on_gpu)
    assert {k: live.get(k, 0) for k in want} == want
    assert "Warning" not in output.err
