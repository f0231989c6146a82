from __future__ import annotations

import os

import pytest

from tests.estimator.conftest import H200  # the virtual GPU

SCRIPTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "scripts")


def script(name: str) -> str:
    return os.path.join(SCRIPTS, name)


def live_at_last_step(trace):
    """Bytes of each category allocated when the last optimizer step ends."""
    last = max(i for i, e in enumerate(trace.events)
               if e.op == "mark" and e.label.startswith("step"))
    live = {}
    for event in trace.events[:last]:
        if event.op == "alloc":
            live[event.id] = event
        elif event.op == "free":
            live.pop(event.id)
    out = {}
    for event in live.values():
        out[event.category] = out.get(event.category, 0) + event.size
    return out


@pytest.fixture
def trace_launch(capfd, monkeypatch):
    """Trace a launcher's command line as ``xmem estimate`` does (rank 0's environment, the
    program the launcher would start), in this process: torch is imported once."""
    from xmem_admission.estimator.probe import runner

    def run(command, mode="fake", steps=3, env=None):
        for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR",
                     "MASTER_PORT"):
            monkeypatch.delenv(name, raising=False)
        environ = dict(os.environ, **(env or {}))
        runner.prepare_rank(command, environ)
        for name, value in environ.items():
            monkeypatch.setenv(name, value)
        result = runner.run(runner.split_command(command), mode, steps, H200)
        return result, capfd.readouterr()

    return run


@pytest.fixture
def fake_launch(trace_launch):
    """trace_launch in fake mode; in profile mode with torch 2.3 (see ON_2_3)."""
    def run(command, mode="fake", **kwargs):
        return trace_launch(command, mode="profile" if ON_2_3 else mode, **kwargs)
    return run


def peak_after_setup(trace):
    """The peak bytes of live blocks from the first forward pass on (the model built and
    sharded), unrounded: what torch's memory trackers count over the training steps."""
    live, current, peak, started = {}, 0, 0, False
    for event in trace.events:
        if event.op == "alloc":
            started = started or event.phase == "forward"
            live[event.id] = event.size
            current += event.size
        elif event.op == "free":
            current -= live.pop(event.id)
        if started:
            peak = max(peak, current)
    return peak


# What some tests' jobs need from torch, and since which release (the rest run with every
# release of the supported range: DDP, FSDP1, the launchers).
REQUIRES = {
    "test_fsdp2_sharding.py": ((2, 6), "FSDP2's fully_shard is public from torch 2.6"),
    "test_sharded_ops_run_once.py": ((2, 6), "FSDP2's fully_shard is public from torch 2.6"),
    "test_foreach_dedupe.py": ((2, 6), "FSDP2's DTensors (torch.distributed.tensor) from 2.6"),
    # torch.distributed.pipelining's PipelineStage arrived in 2.4 (input_args required up to 2.5)
    "test_pipeline_refused.py": ((2, 4), "torch.distributed.pipelining arrived in torch 2.4"),
}


def _release():
    import torch

    from xmem_admission.contract.torch_version import parse

    return parse(torch.__version__).release


# torch 2.3's fake mode loses storages torch's C++ holds (probe.distributed._refuse_fake_on_2_3):
# there DDP and FSDP1 jobs ask for real values, and the tests that trace one run in profile mode.
ON_2_3 = _release() == (2, 3)

# Modules that import at import time what only newer releases have.
collect_ignore = ["test_foreach_dedupe.py"] if _release() < REQUIRES["test_foreach_dedupe.py"][0] \
    else []


def pytest_collection_modifyitems(config, items):
    """Tests whose jobs need a newer torch than the one running say so (they run with the
    development pin, so nothing here is skipped in the main suite)."""
    import torch

    for item in items:
        needed = REQUIRES.get(os.path.basename(str(item.fspath)))
        if needed is not None and _release() < needed[0]:
            item.add_marker(pytest.mark.skip(reason=f"torch {torch.__version__}: {needed[1]}"))
