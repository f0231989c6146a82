"""FSDP1 with every Linear its own unit and activation checkpointing: allocations name
the model's own modules (wrapper levels left out), FSDP's unshard storage is labelled as the
all-gather, checkpoint recomputation as such, and the compact result of the job's peak fits a
termination message with every catalogue GPU as target."""

from __future__ import annotations

from tests.distributed.conftest import script
from xmem_admission.contract import gpus as catalogue
from xmem_admission.contract import termination
from xmem_admission.estimator import peak
from xmem_admission.estimator.estimate import allocator_config, estimate_trace
from xmem_admission.estimator.trace import ALL_GATHER, ALLOC, RECOMPUTED


def test_fsdp_allocations_name_the_models_modules_and_the_all_gathers(fake_launch):
    result, _ = fake_launch(["torchrun", "--nproc-per-node", "8", script("fsdp1_train.py"),
                              "--wrap-layers", "--checkpoint"], steps=2)
    assert result.status == "ok", result.reason
    allocs = [e for e in result.trace.events if e.op == ALLOC]
    modules = {e.module for e in allocs}
    assert not any("_fsdp_wrapped_module" in m or "_checkpoint_wrapped_module" in m
                   for m in modules), sorted(modules)
    forward = {e.module for e in allocs if e.phase == "forward"}
    assert {f"Sequential.{i}.linear" for i in range(6)} <= forward, sorted(forward)
    gathered = {e.module for e in allocs if e.source == ALL_GATHER}
    assert {f"Sequential.{i}.linear" for i in range(6)} <= gathered, sorted(gathered)
    assert any(e.module.endswith(RECOMPUTED) for e in allocs if e.phase == "backward")

    gpus = catalogue.all_gpus()
    config = allocator_config(None, result.trace.meta.get("torch"))
    rows = [g.to_dict() for g in estimate_trace(result.trace, gpus, config)]
    found = peak.explain(result.trace, gpus[:1], config)[0]
    text = termination.encode_ok("fake", result.steps, result.seconds, rows, "", {
        "gpu": found.gpu, "groups": peak.compact(found), "cached": found.cached_free_bytes,
        "fragmentation": found.fragmentation_bytes})
    assert len(text.encode()) <= termination.LIMIT_BYTES
    decoded = termination.decode(text)
    assert len(decoded.peak_groups) == min(3, len(found.groups))
    assert decoded.peak_groups[0]["bytes"] == found.groups[0].bytes
