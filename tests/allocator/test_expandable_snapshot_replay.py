"""Expandable-segment snapshots replay: the H200's three ``expandable_segments:True`` runs match
page for page, and recorded histories with empty_cache, release-and-retry and out-of-memory
errors replay exactly too."""

from __future__ import annotations

import json
import lzma
import os
import tarfile
from typing import Any, Dict

import pytest

from xmem_admission import cli
from xmem_admission.contract.errors import SnapshotError
from xmem_admission.estimator.allocator.alloc_conf import parse_alloc_conf
from xmem_admission.estimator.allocator.snapshot import loads_snapshot, replay_snapshot

from .helpers import MiB, Recorder
from .test_snapshot_replay import record_random_run

H200 = os.path.join(os.path.dirname(__file__), "..", "..", "bench", "data", "H200")

EXPANDABLE_ROWS = [
    # job (bench/data/H200/measurements.jsonl), segment_map events, bytes mapped at the dump
    ("cnn-resnet50-b64-sgd-expandable", 105, 5807013888),
    ("gpt-834m-bf16-b8-adamw-expandable", 698, 34305212416),
    ("llama-6.7b-bf16-b1-s4096-adamw-expandable", 1605, 137973727232),
]


def h200_snapshot(job: str) -> bytes:
    """The raw pickle of one H200 job, out of the archive measurements.jsonl names for it."""
    with open(os.path.join(H200, "measurements.jsonl"), encoding="utf-8") as fh:
        rows = [json.loads(line) for line in fh if line.strip()]
    snap = next(r["snapshot"] for r in rows if r["job"] == job)
    with tarfile.open(os.path.join(H200, snap["archive"])) as tar:
        member = tar.extractfile(snap["member"])
        assert member is not None
        return lzma.decompress(member.read())


@pytest.mark.parametrize("job, maps, mapped", EXPANDABLE_ROWS)
def test_the_h200_expandable_snapshots_replay_page_for_page(job, maps, mapped, tmp_path,
                                                            capsys):
    path = tmp_path / f"{job}.pickle"
    path.write_bytes(h200_snapshot(job))
    assert cli.main(["replay", str(path), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["match"] is True and result["expandable"] is True
    assert result["segment_allocs_expected"] == result["segment_allocs_matched"] == maps
    assert result["segment_allocs_extra"] == 0
    assert result["reserved_expected_bytes"] == result["reserved_simulated_bytes"] == mapped
    assert result["addresses_matched"] == result["allocs"] > 2000
    assert result["mismatches"] == []


def test_the_human_summary_of_an_expandable_snapshot_speaks_of_pages(tmp_path, capsys):
    path = tmp_path / "resnet.pickle"
    path.write_bytes(h200_snapshot(EXPANDABLE_ROWS[0][0]))
    assert cli.main(["replay", str(path)]) == 0
    out = capsys.readouterr().out
    assert "pages mapped (segment_map)" in out and "result: MATCH" in out


def test_a_wrong_page_size_is_caught_by_the_expandable_replay():
    data = loads_snapshot(h200_snapshot(EXPANDABLE_ROWS[0][0]))
    report = replay_snapshot(data, parse_alloc_conf("expandable_segments:True,"
                                                    "roundup_power2_divisions:4"))
    assert not report.match
    assert report.mismatches


class _ExpandableRecorder(Recorder):
    """The recorder, naming its page events as PyTorch does for expandable segments."""

    def _event(self, action: str, addr: int, size: int, stream: int) -> None:
        renamed = {"segment_alloc": "segment_map", "segment_free": "segment_unmap"}
        super()._event(renamed.get(action, action), addr, size, stream)

    def snapshot(self, keep_last: Any = None) -> Dict[str, Any]:
        data = super().snapshot(keep_last)
        for seg in data["segments"]:
            seg["is_expandable"] = True
        return data


# The recorded device's memory: its virtual ranges (1 1/8 of it) never fill up, as on a GPU,
# while its 400 MiB for the allocator run out often.
DEVICE_TOTAL = 4096 * MiB


def _expandable_history(seed: int) -> _ExpandableRecorder:
    rec = _ExpandableRecorder(parse_alloc_conf("expandable_segments:True"),
                              capacity_bytes=400 * MiB)
    rec.alloc.device_total_bytes = DEVICE_TOTAL
    record_random_run(rec, seed, requests=700)
    return rec


@pytest.mark.parametrize("seed", range(0, 40, 4))
def test_expandable_histories_with_unmaps_retries_and_ooms_replay_exactly(seed):
    rec = _expandable_history(seed)
    actions = {e["action"] for e in rec.events}
    assert {"segment_map", "segment_unmap", "oom"} <= actions
    report = replay_snapshot(rec.snapshot(), device_total_bytes=DEVICE_TOTAL)
    assert report.match, report.mismatches
    assert report.segment_frees_expected > 0 and report.ooms_expected > 0
    assert report.addresses_matched == report.allocs
    assert report.reserved_expected_bytes == rec.alloc.reserved_bytes


def test_an_expandable_snapshot_without_its_start_is_refused_with_the_reason():
    rec = _expandable_history(3)
    with pytest.raises(SnapshotError, match="does not start from an empty allocator"):
        replay_snapshot(rec.snapshot(keep_last=300))
