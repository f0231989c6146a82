"""Trials of one program share what they can (``controller.trials``), on the real control plane:
a sweep of Jobs that differ in ``--lr`` and ``--batch-size`` is released with fewer estimation
pods than trials: each batch size is traced, ``--lr`` is judged memory-neutral from two traces
that differ in it alone and allocate identically, and the other trials are sized from a traced
estimate with an Event saying which one and why. ``--batch-size`` changes memory, so it is never
judged neutral, and a trial with a batch size never seen is traced.

The decisions themselves (what a pair of traces proves, which waiting trial is traced to learn)
are shown as arithmetic at the end, on the pure functions.
"""

from __future__ import annotations

from typing import Any, Dict, List

from tests.controller.support import Harness, template_annotations, training_job, wait
from xmem_admission.cluster.controller import records, trials
from xmem_admission.cluster.controller.trials import Member, decide, learn, source_for
from xmem_admission.cluster.controller.workloads import ESTIMATE_NAME
from xmem_admission.cluster.policy.fingerprint import split_argv

BASE = ["--layers", "1", "--hidden", "64", "--heads", "4", "--vocab", "100", "--seq-len", "32",
        "--steps", "2"]
BATCH_SIZES = ("2", "4", "8")
LRS = [f"{0.0001 * (i + 1):.4f}" for i in range(12)]


def _trial(name: str, lr: str, batch_size: str) -> Dict[str, Any]:
    return training_job(name, args=BASE + ["--batch-size", batch_size, "--lr", lr])


def _traced(gmes: List[Dict[str, Any]]) -> List[Dict[str, Any]]:
    return [g for g in gmes if "sharedFrom" not in (g.get("status") or {})]


def test_a_sweep_traces_each_batch_size_and_shares_the_learning_rate(harness: Harness) -> None:
    controller = harness.controller()
    jobs = {}
    for i, lr in enumerate(LRS):
        name = f"trial-{i:02d}"
        jobs[name] = harness.submit(_trial(name, lr, BATCH_SIZES[i % len(BATCH_SIZES)]))
    for name in jobs:
        harness.wait_released(name, timeout=300)
    gmes = {g["metadata"]["name"]: g for g in harness.gmes()}
    assert len(gmes) == len(LRS)  # one estimate per trial, each usable by its copies
    assert all(records.phase(g) == records.SUCCEEDED for g in gmes.values())
    traced = _traced(list(gmes.values()))
    # Fewer estimation pods than trials: one per batch size, and one more to learn --lr.
    assert len(traced) == len(BATCH_SIZES) + 1, [g["spec"]["trial"] for g in traced]
    assert all(g["status"].get("allocationDigest") for g in traced)
    assert {g["spec"]["trial"]["options"]["--batch-size"] for g in traced} == set(BATCH_SIZES)
    for name in jobs:
        released = harness.job(name)
        gme = gmes[released["metadata"]["annotations"][ESTIMATE_NAME]]
        assert int(template_annotations(released)["xmem.io/request-bytes"]) == \
            gme["status"]["requestBytes"]
        shared = gme["status"].get("sharedFrom")
        if shared is None:
            continue
        source = gmes[shared["estimate"]]
        assert shared["options"] == ["--lr"], shared  # never over --batch-size
        [estimated] = [c for c in gme["status"]["conditions"] if c["type"] == "Estimated"]
        assert (estimated["status"], estimated["reason"]) == ("True", "SharedFromTrial")
        assert f"shared from {shared['estimate']}" in estimated["message"]
        assert source["spec"]["trial"]["options"]["--batch-size"] == \
            gme["spec"]["trial"]["options"]["--batch-size"]
        assert gme["status"]["estimates"] == source["status"]["estimates"]
        [event] = [e for e in harness.events(name) if e["reason"] == trials.SHARED_EVENT]
        assert f"sized from estimate {shared['estimate']}" in event["message"]
        assert "differs only in --lr" in event["message"]
        assert "judged memory-neutral" in event["message"]

    # A batch size never traced is traced, not shared, even with a learning rate seen before.
    harness.submit(_trial("new-batch", LRS[0], "16"))
    released = harness.wait_released("new-batch", timeout=180)
    gme = harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate",
                      released["metadata"]["annotations"][ESTIMATE_NAME])
    assert gme is not None and "sharedFrom" not in gme["status"]
    assert gme["status"]["allocationDigest"] not in {g["status"]["allocationDigest"]
                                                     for g in traced}
    assert trials.SHARED_EVENT not in {e["reason"] for e in harness.events("new-batch")}
    # A restarted controller knows what its predecessor learned (it is read from the
    # estimates): a new learning rate with a traced batch size is shared.
    controller.stop()
    controller = harness.controller()
    harness.submit(_trial("new-lr", "0.0500", "4"))
    released = harness.wait_released("new-lr", timeout=120)
    gme = harness.get("xmem.io/v1alpha1", "GPUMemoryEstimate",
                      released["metadata"]["annotations"][ESTIMATE_NAME])
    assert gme is not None and gme["status"]["sharedFrom"]["options"] == ["--lr"]
    wait(lambda: not [p for p in harness.estimation_pods()
                      if p["status"].get("phase") not in ("Succeeded", "Failed")],
         60, "no estimation pod left running")
    controller.stop()


# --- the arithmetic ------------------------------------------------------------------------

def _sweep(count: int, sizes: int) -> List[Dict[str, str]]:
    return [{"--lr": str(i), "--batch-size": str(2 ** (i % sizes))} for i in range(count)]


def test_options_are_read_from_the_command_line_as_written() -> None:
    shape, found = split_argv(["python", "-u", "/app/train.py", "--lr", "0.1",
                               "--batch-size=8", "--grad-ckpt", "--out", "/tmp/run",
                               "--offset", "-3", "-m", "mod"])
    assert found == [("--lr", "0.1"), ("--batch-size", "8"), ("--offset", "-3")]
    # paths, flags, short options and positional words stay part of the program
    assert shape == ["python", "-u", "/app/train.py", "--lr", "\x00", "--batch-size=\x00",
                     "--grad-ckpt", "--out", "/tmp/run", "--offset", "\x00", "-m", "mod"]


def test_two_traces_that_differ_in_one_option_and_allocate_alike_make_it_neutral() -> None:
    trace = _sweep(5, 4)
    members = [Member(f"g{i}", t, f"d{t['--batch-size']}", True) for i, t in enumerate(trace)]
    known = learn(members, set())
    assert set(known.neutral) == {"--lr"} and known.neutral["--lr"] == ("g0", "g4")
    assert set(known.not_neutral) == {"--batch-size"}
    found = source_for(known, {"--lr": "77", "--batch-size": "4"})
    assert found is not None and found[0].options["--batch-size"] == "4"
    assert source_for(known, {"--lr": "77", "--batch-size": "64"}) is None


def test_an_option_whose_values_allocate_differently_is_never_neutral() -> None:
    trace = _sweep(5, 4)
    members = [Member(f"g{i}", t, f"d{i}", True) for i, t in enumerate(trace)]
    known = learn(members, set())
    assert known.neutral == {}
    assert set(known.not_neutral) == {"--lr"}
    assert decide(known, [], _sweep(8, 4)[5:]) == ["trace"] * 3


def test_an_option_refuted_by_an_out_of_memory_is_not_neutral_whatever_the_traces_say() -> None:
    trace = _sweep(5, 4)
    members = [Member(f"g{i}", t, f"d{t['--batch-size']}", True) for i, t in enumerate(trace)]
    known = learn(members, {"--lr"})
    assert known.neutral == {} and "--lr" in known.not_neutral
    assert source_for(known, {"--lr": "77", "--batch-size": "4"}) is None


def test_the_line_traces_what_teaches_and_holds_the_rest_for_it() -> None:
    sweep = _sweep(120, 4)
    nothing = learn([], set())
    answers = decide(nothing, [], sweep)
    # each batch size once, and the first trial that differs from a traced one in --lr alone,
    # to learn it
    assert [i for i, a in enumerate(answers) if a == "trace"] == [0, 1, 2, 3]
    assert [i for i, a in enumerate(answers) if a == "learn"] == [4]
    assert answers.count("wait") == 115
    # once those five are read, every other trial is shared
    members = [Member(f"g{i}", t, f"d{t['--batch-size']}", True) for i, t in enumerate(sweep[:5])]
    assert decide(learn(members, set()), [], sweep[5:]) == ["share"] * 115


def test_once_a_trial_waits_for_what_the_traces_teach_the_later_ones_of_its_family_wait_too() -> None:
    # --batch-size 64 is new (it would be traced), but a trial before it waits on --lr: the
    # family's pods start in line order.
    waiting = _sweep(6, 4) + [{"--lr": "99", "--batch-size": "64"}]
    answers = decide(learn([], set()), [], waiting)
    assert answers == ["trace", "trace", "trace", "trace", "learn", "wait", "wait"]


def test_a_family_whose_traces_fail_is_traced_as_it_comes() -> None:
    waiting = [{"--shard": str(i)} for i in range(6)]
    assert decide(learn([], set()), [], waiting)[:3] == ["trace", "learn", "wait"]
    assert decide(learn([], set()), [], waiting, learning=False) == ["trace"] * 6
