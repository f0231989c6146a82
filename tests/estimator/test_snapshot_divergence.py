"""``xmem replay SNAPSHOT --against TRACE``: a real trace of a tiny model, a snapshot recorded
from it by the allocator simulator the way PyTorch records one, and differences planted in
the snapshot: the tool finds each where it was planted, names the trace's module and op
there, and says nothing where nothing differs."""

from __future__ import annotations

import json
import os
import pickle
import random
from typing import Any, Callable, Dict, List, Optional

import pytest

from tests.allocator.helpers import Recorder
from tests.estimator.conftest import H200, SCRIPTS
from xmem_admission import cli
from xmem_admission.contract import gpus as catalogue
from xmem_admission.estimator import divergence
from xmem_admission.estimator.allocator.alloc_conf import AllocatorConfig
from xmem_admission.estimator.orchestrate import for_gpu
from xmem_admission.estimator.trace import ALLOC, EMPTY_CACHE, FREE, MARK, Alloc, Trace

ADDED = 7_340_032  # the planted allocation's size (7 MiB)


@pytest.fixture(scope="module")
def traced(tmp_path_factory) -> Dict[str, Any]:
    """tiny_mlp.py traced for 3 steps (fake mode), saved as xmem estimate --trace writes it."""
    from xmem_admission.estimator.probe import runner

    result = runner.run([os.path.join(SCRIPTS, "tiny_mlp.py"), "--batch", "16", "--hidden",
                         "64"], "fake", 3, H200)
    assert result.status == "ok", result.reason
    path = tmp_path_factory.mktemp("trace") / "tiny.json"
    result.trace.dump(str(path))
    return {"path": str(path), "stream": for_gpu(result.trace, catalogue.lookup("H200"))}


Plant = Callable[[int, int, Alloc], List[int]]  # (step, n-th alloc of the step, event) -> sizes


def snapshot_of(stream: Trace, plant: Optional[Plant] = None) -> Dict[str, Any]:
    """The snapshot a GPU running ``stream`` would dump: every request through the simulated
    allocator, each ``step N`` mark an Optimizer.step END annotation; ``plant`` may replace a
    request by other sizes (an extra block is freed right away)."""
    rec = Recorder(AllocatorConfig())
    live: Dict[int, Any] = {}
    annotations = []
    step, nth = 1, 0
    for event in stream.events:
        if event.op == ALLOC and event.size > 0:
            sizes = plant(step, nth, event) if plant else [event.size]
            nth += 1
            for n, size in enumerate(sizes):
                block = rec.malloc(size, event.stream)
                if n == 0:
                    live[event.id] = block
                else:
                    rec.free(block)
        elif event.op == FREE and event.id in live:
            rec.free(live.pop(event.id))
        elif event.op == EMPTY_CACHE:
            rec.empty_cache()
        elif event.op == MARK and event.label.startswith("step "):
            annotations.append({"stage": "END", "name": "Optimizer.step#AdamW.step",
                                "device": 0, "time_us": rec.events[-1]["time_us"]})
            step, nth = step + 1, 0
    data = rec.snapshot()
    data["external_annotations"] = annotations
    return data


def write(tmp_path, data: Any, name: str = "snap.pickle") -> str:
    path = tmp_path / name
    path.write_bytes(pickle.dumps(data))
    return str(path)


def test_a_snapshot_of_the_same_stream_is_the_same_in_every_step(traced, tmp_path, capsys):
    snap = write(tmp_path, snapshot_of(traced["stream"]))
    assert cli.main(["replay", snap, "--against", traced["path"]]) == 0
    out = capsys.readouterr().out
    assert "result: SAME" in out
    assert "(3 optimizer steps)" in out and "3 steps, rewritten for H200" in out


def _biggest_of_step(stream: Trace, step: int) -> int:
    """Position within its step of the step's largest allocation (a clear target)."""
    sizes = divergence.trace_steps(stream)[0][step - 1]
    return max(range(len(sizes)), key=lambda n: (sizes[n].size, -n))


def test_an_added_allocation_and_a_changed_size_are_found_where_they_were_planted(
        traced, tmp_path, capsys):
    stream = traced["stream"]
    changed_at = _biggest_of_step(stream, 3)
    changed: Dict[str, Any] = {}

    def plant(step: int, nth: int, event: Alloc) -> List[int]:
        if step == 2 and nth == 5:
            return [event.size, ADDED]  # one more block, right after the step's 6th
        if step == 3 and nth == changed_at:
            changed.update(size=event.size, module=event.module, op=event.source)
            return [event.size + (1 << 20)]
        return [event.size]

    snap = write(tmp_path, snapshot_of(stream, plant))
    assert cli.main(["replay", snap, "--against", traced["path"], "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    steps = {w["step"]: w for w in r["windows"]}
    assert steps["step 1"]["gpu_only"] == steps["step 1"]["trace_only"] == 0
    assert (steps["step 2"]["gpu_only"], steps["step 2"]["trace_only"]) == (1, 0)
    assert steps["step 2"]["gpu_only_bytes"] == ADDED
    assert (steps["step 3"]["gpu_only"], steps["step 3"]["trace_only"]) == (1, 1)
    assert steps["step 3"]["gpu_only_bytes"] - steps["step 3"]["trace_only_bytes"] == 1 << 20
    first = r["first_divergence"]
    sixth = divergence.trace_steps(stream)[0][1][5]
    assert first["step"] == "step 2" and first["gpu_sizes_after"][0] == ADDED
    assert first["trace_event"] == divergence.trace_steps(stream)[0][1][6].index
    assert (first["module"], first["op"]) != ("", "")
    # the added block sits at the trace's block before it; the changed one at its own
    groups = {(g["module"], g["op"]): g for g in r["groups"]}
    where_added = divergence._group(sixth)
    assert {"size": ADDED, "count": 1} in groups[where_added]["gpu_more"]
    where_changed = divergence._group(divergence.Request(0, 0, changed["module"], changed["op"]))
    assert {"size": changed["size"], "count": 1} in groups[where_changed]["trace_more"]
    assert {"size": changed["size"] + (1 << 20), "count": 1} in \
        groups[where_changed]["gpu_more"]
    # the human form says the same in words
    assert cli.main(["replay", snap, "--against", traced["path"]]) == 1
    out = capsys.readouterr().out
    assert f"GPU has 1 more block of {ADDED:,} B" in out
    assert f"trace has 1 more block of {changed['size']:,} B" in out
    assert "first parting: step 2" in out and "result: THEY PART" in out


def test_blocks_made_in_another_order_are_moved_not_missing(traced, tmp_path, capsys):
    stream = traced["stream"]
    events = list(stream.events)
    step2 = divergence.trace_steps(stream)[0][1]
    # two neighbouring allocations of step 2 of different sizes, nothing between them
    first, second = next((x, y) for x, y in zip(step2, step2[1:])
                         if y.index == x.index + 1 and x.key != y.key)
    events[first.index], events[second.index] = events[second.index], events[first.index]
    snap = write(tmp_path, snapshot_of(Trace(events, stream.meta)))
    assert cli.main(["replay", snap, "--against", traced["path"], "--json"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert r["moved"] == 1 and r["groups"] == []
    assert r["gpu_only_bytes"] == r["trace_only_bytes"] == 0


@pytest.mark.parametrize("seed", range(6))
def test_the_edit_script_is_a_longest_common_subsequence(seed):
    rng = random.Random(seed)
    a = [rng.choice([512, 1024, 4096, 1 << 20]) for _ in range(rng.randint(0, 60))]
    b = [rng.choice([512, 1024, 4096, 1 << 20]) for _ in range(rng.randint(0, 60))]
    pairs = divergence.edit_script(a, b, max_edits=10_000)
    assert pairs is not None
    assert all(a[i] == b[j] for i, j in pairs)
    assert all(i0 < i1 and j0 < j1 for (i0, j0), (i1, j1) in zip(pairs, pairs[1:]))
    lcs = [[0] * (len(b) + 1) for _ in range(len(a) + 1)]
    for i in range(len(a) - 1, -1, -1):
        for j in range(len(b) - 1, -1, -1):
            lcs[i][j] = lcs[i + 1][j + 1] + 1 if a[i] == b[j] else max(lcs[i + 1][j],
                                                                        lcs[i][j + 1])
    assert len(pairs) == lcs[0][0]


def test_a_step_too_different_to_align_is_matched_by_size_counts(traced, tmp_path, capsys):
    snap = write(tmp_path, snapshot_of(traced["stream"], lambda s, n, e: [e.size + 512 * n]))
    assert cli.main(["replay", snap, "--against", traced["path"], "--json",
                     "--max-edits", "3"]) == 1
    r = json.loads(capsys.readouterr().out)
    assert {w["method"] for w in r["windows"]} == {"size counts"}


# -- errors: exit 2 with a clear message -----------------------------------------------------
def test_a_missing_snapshot_is_a_clear_error(traced, tmp_path, capsys):
    assert cli.main(["replay", str(tmp_path / "nope.pickle"), "--against",
                     traced["path"]]) == 2
    assert "no such file" in capsys.readouterr().err


@pytest.mark.parametrize("device_traces", [[[]], []])
def test_a_snapshot_recorded_without_history_is_refused(traced, tmp_path, capsys,
                                                        device_traces):
    data = snapshot_of(traced["stream"])
    data["device_traces"] = device_traces
    assert cli.main(["replay", write(tmp_path, data), "--against", traced["path"]]) == 2
    assert "_record_memory_history" in capsys.readouterr().err


def test_a_file_that_is_no_snapshot_is_refused(traced, tmp_path, capsys):
    assert cli.main(["replay", traced["path"], "--against", traced["path"]]) == 2
    assert "not a readable pickle" in capsys.readouterr().err


@pytest.mark.parametrize("content, says", [
    (None, "a pickle (a memory snapshot?)"),
    (b'{"traceEvents": [], "displayTimeUnit": "ms"}', "Chrome/Kineto profiler trace"),
    (b'{"format": "something-else", "version": 1, "events": []}', "not an xmem trace"),
    (b'{"format": "xmem-trace", "vers', "not valid JSON"),
])
def test_a_trace_of_another_kind_is_refused(traced, tmp_path, capsys, content, says):
    snap = write(tmp_path, snapshot_of(traced["stream"]))
    other = tmp_path / "other.json"
    other.write_bytes(content if content is not None else open(snap, "rb").read())
    assert cli.main(["replay", snap, "--against", str(other)]) == 2
    assert says in capsys.readouterr().err


def test_a_missing_trace_is_a_clear_error(traced, tmp_path, capsys):
    snap = write(tmp_path, snapshot_of(traced["stream"]))
    assert cli.main(["replay", snap, "--against", str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
