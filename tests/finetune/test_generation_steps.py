"""TRL's GRPO job with its own generation (``scripts/trl_grpo.py``) in fake mode: once the
sampling steps repeat, the probe writes the rest of them from the traced ones instead of running
the model on each token (``probe/generation_steps.py``). What a user sees must not change: the
trace is the one that tracing every step gives, event for event, and so are the peaks.

``XMEM_TRACE_EVERY_GENERATION_STEP=1`` traces every step (the same job, the old way). The job
runs three optimizer steps with 48-token completions. The first generation writes steps 20 to 35
(16 regular steps traced first; the rule's period is 8 on this checkpoint, as memory-efficient
attention copies its mask padded to a multiple of 8 keys: ``probe/attention.py``) and traces the
last 13 (at least a period, so every position of the period is checked after the written steps).
The second and third reuse its rule: their steps 4 to 12 are what it gives for their number of
keys, with other labels (the first generation runs before the first optimizer step, in other
phases and categories), so each writes steps 13 to 44 with its own labels and traces the last 4.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Dict, List, Tuple

from tests.controller.test_probe_bundle import _run, built  # noqa: F401 - the bundle fixture
from tests.support.torch_envs import NEWEST
from xmem_admission.estimator.trace import Trace

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = Path(__file__).resolve().parent / "scripts" / "trl_grpo.py"


def start(script: List[str], trace: Path, every_step: bool,
          gpus: str = "H100-80GB,H200") -> subprocess.Popen[str]:
    """``xmem estimate`` of ``python SCRIPT ARGS`` (``script``) in a subprocess, writing its
    trace; ``every_step``: with generation step writing turned off."""
    env = dict(os.environ)
    env.pop("XMEM_TRACE_EVERY_GENERATION_STEP", None)
    if every_step:
        env["XMEM_TRACE_EVERY_GENERATION_STEP"] = "1"
    command = [sys.executable, "-m", "xmem_admission.cli", "estimate", "--python",
               NEWEST.interpreter, "--json", "--gpu", gpus, "--steps", "3",
               "--trace", str(trace), "--", "python", *script]
    return subprocess.Popen(command, cwd=ROOT, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def grpo(checkpoint: Path) -> List[str]:
    return [str(SCRIPT), "--model", str(checkpoint), "--batch-size", "4", "--seq-len", "96"]


def finish(proc: subprocess.Popen[str]) -> Dict[str, Any]:
    out, err = proc.communicate(timeout=600)
    assert proc.returncode == 0, err[-4000:]
    result: Dict[str, Any] = json.loads(out)
    return result


def events(trace: Trace) -> List[Tuple[Any, ...]]:
    """The events with each id replaced by its allocation's rank: two traces of one program
    agree on everything else."""
    rank: Dict[int, int] = {}
    found: List[Tuple[Any, ...]] = []
    for event in trace.events:
        if event.op == "alloc":
            rank[event.id] = len(rank)
            found.append(tuple(event._replace(id=rank[event.id])))
        elif event.op == "free":
            found.append(("free", rank[event.id]))
        else:
            found.append(tuple(event))
    return found


def test_grpos_generation_written_from_its_traced_steps_traces_what_every_step_traces(
        llama_checkpoint: Path, tmp_path: Path) -> None:
    written_trace, traced_trace = tmp_path / "written.json", tmp_path / "traced.json"
    written_run = start(grpo(llama_checkpoint), written_trace, every_step=False)
    traced_run = start(grpo(llama_checkpoint), traced_trace, every_step=True)
    written, traced = finish(written_run), finish(traced_run)
    assert written["mode"] == traced["mode"] == "fake"
    notes = [note for note in Trace.load(str(written_trace)).notes()
             if note.get("key") == "generation-steps"]
    assert notes and notes[0]["message"].startswith(
        "text generation: sampling steps 20 to 35 of 48 written from the traced ones"), notes
    assert notes[0]["count"] == 1
    reused = [note for note in Trace.load(str(written_trace)).notes()
              if note.get("key") == "generation-steps-reused"]
    assert reused and reused[0]["message"].startswith(
        "text generation: sampling steps 13 to 44 of 48 written from an earlier generation's "
        "rule"), reused
    assert reused[0]["count"] == 2  # the later generations jumped on the first one's rule
    assert not [note for note in Trace.load(str(traced_trace)).notes()
                if str(note.get("key")).startswith("generation-steps")]
    assert events(Trace.load(str(written_trace))) == events(Trace.load(str(traced_trace)))
    peaks = ("gpu", "peak_allocated_bytes", "peak_reserved_bytes", "total_bytes")
    assert [{k: gpu[k] for k in peaks} for gpu in written["gpus"]] == \
        [{k: gpu[k] for k in peaks} for gpu in traced["gpus"]]


CHANGES = Path(__file__).resolve().parent / "scripts" / "generation_that_changes.py"


def changes(from_keys: int) -> List[str]:
    return [str(CHANGES), "--new-tokens", "48", "--from-keys", str(from_keys)]


def test_a_generation_whose_later_steps_break_the_rule_is_traced_again_step_by_step(
        tmp_path: Path) -> None:
    """From 56 cached keys (16 prompt tokens and 40 sampled) each step also makes a 4 MiB
    buffer: the rule read from steps 4 to 19 writes steps 20 to 35 without it, the traced steps
    after them do not match, and ``xmem estimate`` traces the job again with every step
    traced. Where the steps never change, the same script jumps (its position ids, known
    values that grow by one a step, grown with the ids) and traces what every step traces."""
    changing, steady, steady_every = (tmp_path / name for name in
                                      ("changing.json", "steady.json", "steady-every.json"))
    changing_run = start(changes(56), changing, every_step=False, gpus="H200")
    steady_run = start(changes(10_000), steady, every_step=False, gpus="H200")
    out, err = changing_run.communicate(timeout=600)
    assert changing_run.returncode == 0, err[-4000:]
    assert "xmem: text generation: sampling step 42 of 48 differs from the rule steps 4 to 19 " \
           "follow (period 8), from which steps 20 to 35 were written; tracing again with " \
           "XMEM_TRACE_EVERY_GENERATION_STEP=1" in err, err[-4000:]
    assert json.loads(out)["mode"] == "fake"
    traced = Trace.load(str(changing))
    assert not [n for n in traced.notes() if str(n.get("key")).startswith("generation-steps")]
    # steps 42 to 48 of each of the three generations
    assert sum(1 for e in traced.events if e.op == "alloc" and e.size == 4 << 20) == 21

    steady_every_run = start(changes(10_000), steady_every, every_step=True, gpus="H200")
    written, every = finish(steady_run), finish(steady_every_run)
    notes = [n for n in Trace.load(str(steady)).notes()
             if str(n.get("key")).startswith("generation-steps")]
    assert notes, "the steady generation did not jump"
    assert events(Trace.load(str(steady))) == events(Trace.load(str(steady_every)))
    assert written["gpus"][0]["peak_reserved_bytes"] == every["gpus"][0]["peak_reserved_bytes"]


def test_an_estimation_pod_traces_a_generation_that_breaks_the_rule_again_step_by_step(
        built: Path, tmp_path: Path) -> None:  # noqa: F811 - the bundle fixture
    """The same job as the training container's own command under the probe bundle, as an
    estimation pod runs it: the probe starts the program anew with every step traced and
    writes an estimate."""
    run = _run(built, [NEWEST.interpreter, *changes(56)], tmp_path)
    assert run["code"] == 0, run["output"][-4000:]
    assert "tracing again with XMEM_TRACE_EVERY_GENERATION_STEP=1" in run["output"]
    assert run["result"] is not None and run["result"].status == "ok", run["text"]


LONGER = Path(__file__).resolve().parent / "scripts" / "generation_with_longer_prompts.py"


def test_a_reused_rule_checks_every_position_where_a_longer_prompt_reaches_more_keys(
        tmp_path: Path) -> None:
    """The first generation (16-token prompt, up to 63 keys) gives the rule; the second and
    third start from 24 tokens and reach 71 keys, where one position of the period makes a
    256 MiB buffer (at 64 keys, step 42). Past the keys the rule was checked at, the reused
    rule leaves a period and more to trace, step 42 among them: the difference is seen and the
    job traced again, its two buffers in the trace. Leaving 1 to 8 steps (45 to 48) wrote step
    42 without its buffer: 72 MiB reserved instead of 328 MiB."""
    trace = tmp_path / "longer.json"
    out, err = start([str(LONGER)], trace, every_step=False, gpus="H200").communicate(
        timeout=600)
    assert "xmem: text generation: sampling step 42 of 48 differs from the rule" in err and \
        "tracing again with XMEM_TRACE_EVERY_GENERATION_STEP=1" in err, err[-4000:]
    assert sum(1 for e in Trace.load(str(trace)).events
               if e.op == "alloc" and e.size == 256 << 20) == 2
    assert json.loads(out)["gpus"][0]["peak_reserved_bytes"] > 256 << 20  # one at a time
