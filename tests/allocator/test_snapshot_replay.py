"""Snapshot replays: the three real GPU snapshots match exactly, and a wrong rule would not.

Recorded histories (``helpers.Recorder``) add what the real snapshots lack: empty_cache
releases, cudaMalloc failures with their release-and-retry chain, out-of-memory errors, and
ring buffers that start in the middle of a run.
"""

from __future__ import annotations

import json
import random

import pytest

from xmem_admission import cli
from xmem_admission.estimator.allocator.alloc_conf import parse_alloc_conf
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.allocator.snapshot import (
    load_snapshot,
    replay_snapshot,
    trace_from_snapshot,
)

from .helpers import MiB, Recorder

REAL = [
    # file, segment_alloc events in the trace, reserved bytes at the dump (README table)
    ("memory_files_memory_ctx128_forward.pickle", 289, 19667091456),
    ("memory_files_memory_ctx128_fullstep.pickle", 783, 61111009280),
    ("cs336_systems_memory_logs_memory_ctx128_forward.pickle", 178, 17878220800),
]


@pytest.mark.parametrize("name, segment_allocs, reserved", REAL)
def test_xmem_replay_reproduces_every_cudamalloc_of_a_real_gpu(name, segment_allocs, reserved,
                                                              snapshot_path, capsys):
    assert cli.main(["replay", snapshot_path(name), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["match"] is True
    assert result["segment_allocs_expected"] == result["segment_allocs_matched"] == \
        segment_allocs
    assert result["segment_allocs_extra"] == 0
    assert result["reserved_expected_bytes"] == result["reserved_simulated_bytes"] == reserved
    assert result["addresses_matched"] == result["allocs"]  # every block at the GPU's address
    assert result["mismatches"] == []


def test_the_human_summary_says_match(snapshot_path, capsys):
    assert cli.main(["replay", snapshot_path(REAL[0][0])]) == 0
    out = capsys.readouterr().out
    assert "result: MATCH" in out and "19667091456" in out


def test_a_wrong_allocator_rule_is_caught_by_the_replay(snapshot_path):
    data = load_snapshot(snapshot_path(REAL[0][0]))
    report = replay_snapshot(data, parse_alloc_conf("large_segment_size_mb:22"))
    assert not report.match
    assert report.segment_allocs_matched < report.segment_allocs_expected
    assert report.mismatches


def test_a_snapshot_s_alloc_free_stream_replays_from_empty(snapshot_path):
    trace = trace_from_snapshot(load_snapshot(snapshot_path(REAL[0][0])))
    result = simulate(trace)
    assert result.num_events == len(trace.events) > 3000
    assert 0 < result.peak_allocated_bytes <= result.peak_reserved_bytes


def _recorded_history(conf: str, capacity: int, seed: int) -> Recorder:
    """A random training-like run under memory pressure, with empty_cache now and then."""
    return record_random_run(Recorder(parse_alloc_conf(conf), capacity_bytes=capacity), seed)


def record_random_run(rec: Recorder, seed: int, requests: int = 600) -> Recorder:
    """Drive ``rec`` through a random run: small and large requests on two streams, frees,
    empty_cache now and then."""
    rng = random.Random(seed)
    live = []
    for _ in range(requests):
        roll = rng.random()
        if live and roll < 0.42:
            rec.free(live.pop(rng.randrange(len(live))))
        elif roll < 0.44:
            rec.empty_cache()
        else:
            size = rng.choice([rng.randint(1, 64 * 1024), rng.randint(MiB, 9 * MiB),
                               rng.randint(10 * MiB, 90 * MiB)])
            block = rec.malloc(size, rng.choice([0, 0, 0, 5]))
            if block is not None:
                live.append(block)
    return rec


@pytest.mark.parametrize("conf", ["", "max_split_size_mb:48", "roundup_power2_divisions:4"])
def test_recorded_histories_with_releases_retries_and_ooms_replay_exactly(conf):
    rec = _recorded_history(conf, capacity=600 * MiB, seed=7)
    actions = {e["action"] for e in rec.events}
    assert {"segment_free", "oom"} <= actions  # the history exercises the release paths
    assert rec.alloc.stats()["num_alloc_retries"] > 0
    report = replay_snapshot(rec.snapshot())
    assert report.match, report.mismatches
    assert report.ooms_expected > 0 and report.segment_frees_expected > 0
    assert report.addresses_matched == report.allocs


@pytest.mark.parametrize("keep_last", [1, 250, 901, 1777])
def test_a_ring_buffer_that_starts_mid_run_is_rebuilt_before_replaying(keep_last):
    rec = _recorded_history("", capacity=600 * MiB, seed=11)
    report = replay_snapshot(rec.snapshot(keep_last=keep_last))
    assert report.match, report.mismatches
    assert report.reserved_expected_bytes == rec.alloc.reserved_bytes
