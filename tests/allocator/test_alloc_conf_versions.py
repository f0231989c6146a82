"""The simulator follows the traced torch: what each release from 2.2 to 2.15 accepts in
``PYTORCH_CUDA_ALLOC_CONF``, what it says otherwise, and what a difference does to placement.

The expected tables below are written out from the release wheels (see torch_releases.py), not
derived from the module's own table, so a wrong edit there fails here.
"""

from __future__ import annotations

import json

import pytest

from xmem_admission import cli
from xmem_admission.contract.errors import AllocConfError
from xmem_admission.contract.torch_version import parse as parse_torch
from xmem_admission.estimator.allocator.alloc_conf import (
    config_from_env,
    parse_alloc_conf,
)
from xmem_admission.estimator.allocator.simulate import simulate
from xmem_admission.estimator.allocator.torch_releases import alloc_conf_text
from xmem_admission.estimator.trace import Trace

MiB = 1024 * 1024

RELEASES = [(2, minor) for minor in range(2, 16)]

# One valid setting per key, and the first release whose wheel has the key.
KEYS = [
    ("max_split_size_mb:64", (2, 2)),
    ("garbage_collection_threshold:0.5", (2, 2)),
    ("roundup_power2_divisions:4", (2, 2)),
    ("backend:native", (2, 2)),
    ("expandable_segments:True", (2, 2)),
    ("release_lock_on_cudamalloc:True", (2, 2)),
    ("release_lock_on_hipmalloc:False", (2, 2)),
    ("pinned_use_cuda_host_register:True", (2, 2)),
    ("pinned_use_hip_host_register:False", (2, 2)),
    ("pinned_num_register_threads:8", (2, 2)),
    ("max_non_split_rounding_mb:64", (2, 6)),
    ("pinned_use_background_threads:True", (2, 6)),
    ("graph_capture_record_stream_reuse:True", (2, 9)),
    ("pinned_reserve_segment_size_mb:16", (2, 10)),
    ("per_process_memory_fraction:0.5", (2, 10)),
    ("large_segment_size_mb:32", (2, 11)),
    ("pinned_free_catch_all:True", (2, 12)),
    ("throw_on_cudamalloc_oom:True", (2, 12)),
    ("pinned_max_round_threshold_mb:64", (2, 13)),
    ("pinned_max_cached_size_mb:1024", (2, 13)),
    ("expandable_segments_reserve:0.5", (2, 15)),
    ("expandable_segments_reserve_by_class:[a,b]", (2, 15)),
]


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
@pytest.mark.parametrize("setting, first", KEYS, ids=[k.split(":")[0] for k, _ in KEYS])
def test_each_release_accepts_exactly_the_keys_it_has(setting, first, release):
    key = setting.split(":")[0]
    if release >= first:
        assert parse_alloc_conf(setting, release).torch_release == release
        return
    with pytest.raises(AllocConfError) as info:
        parse_alloc_conf(setting, release)
    message = str(info.value)
    assert f"PyTorch {release[0]}.{release[1]} has no such key" in message
    assert f"first appeared in torch {first[0]}.{first[1]}" in message
    if release <= (2, 9):
        assert f"RuntimeError: Unrecognized CachingAllocator option: {key}" in message
    else:
        assert f"ValueError: Unrecognized key '{key}' in CUDA allocator config." in message


def test_the_number_of_keys_per_release():
    counts = {r: sum(1 for s, _ in KEYS if _accepts(s, r)) for r in RELEASES}
    assert counts == {(2, 2): 10, (2, 3): 10, (2, 4): 10, (2, 5): 10, (2, 6): 12, (2, 7): 12,
                      (2, 8): 12, (2, 9): 13, (2, 10): 15, (2, 11): 16, (2, 12): 18,
                      (2, 13): 20, (2, 14): 20, (2, 15): 22}


def _accepts(setting, release):
    try:
        parse_alloc_conf(setting, release)
    except AllocConfError:
        return False
    return True


@pytest.mark.parametrize("release, said", [
    ((2, 2), "RuntimeError: Unrecognized CachingAllocator option: flux_capacitor"),
    ((2, 9), "RuntimeError: Unrecognized CachingAllocator option: flux_capacitor"),
    ((2, 10), "ValueError: Unrecognized key 'flux_capacitor' in CUDA allocator config."),
    ((2, 15), "ValueError: Unrecognized key 'flux_capacitor' in CUDA allocator config."),
])
def test_a_key_no_release_has_gets_that_releases_words(release, said):
    with pytest.raises(AllocConfError) as info:
        parse_alloc_conf("flux_capacitor:1", release)
    assert said in str(info.value)
    assert "no torch release from 2.2 to 2.15 has this key" in str(info.value)


@pytest.mark.parametrize("version, release", [
    ("2.6.0a0+ecf3bae40a", (2, 6)),
    ("2.6.0a0+ecf3bae40a.nv25.01", (2, 6)),
    ("2.14.1+cu130", (2, 14)),
    ("2.16.0.dev20261201+cpu", (2, 16)),
    (parse_torch("2.9.1"), (2, 9)),
    ([2, 3], (2, 3)),
    (None, (2, 15)),
])
def test_versions_come_as_tuples_torch_versions_or_vendor_strings(version, release):
    assert parse_alloc_conf("", version).torch_release == release


def test_a_vendor_string_selects_that_releases_rules():
    with pytest.raises(AllocConfError, match="first appeared in torch 2.6"):
        parse_alloc_conf("max_non_split_rounding_mb:64", "2.5.1+rocm6.2")
    assert parse_alloc_conf("max_non_split_rounding_mb:64", "2.6.0a0+ecf3bae40a") \
        .max_non_split_rounding_size == 64 * MiB


def test_an_unreadable_version_is_an_allocator_settings_error():
    with pytest.raises(AllocConfError, match="names no MAJOR.MINOR release"):
        parse_alloc_conf("", "nightly")
    with pytest.raises(AllocConfError, match="torch version must be"):
        parse_alloc_conf("", (2,))


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_max_split_size_of_exactly_20_mb_is_refused_up_to_2_9(release):
    if release <= (2, 9):
        with pytest.raises(AllocConfError, match=r"must be > 20 .*RuntimeError: CachingAllocator "
                                                 r"option max_split_size_mb too small"):
            parse_alloc_conf("max_split_size_mb:20", release)
        assert parse_alloc_conf("max_split_size_mb:21", release).max_split_size == 21 * MiB
    else:
        assert parse_alloc_conf("max_split_size_mb:20", release).max_split_size == 20 * MiB


def test_max_non_split_rounding_has_the_same_floor_rule():
    with pytest.raises(AllocConfError, match="must be > 20"):
        parse_alloc_conf("max_non_split_rounding_mb:20", (2, 8))
    assert parse_alloc_conf("max_non_split_rounding_mb:20", (2, 10)) \
        .max_non_split_rounding_size == 20 * MiB


@pytest.mark.parametrize("release", RELEASES, ids=lambda r: f"{r[0]}.{r[1]}")
def test_a_zero_in_the_division_list_disables_rounding_from_2_4(release):
    text = "roundup_power2_divisions:[256:0,1024:4]"
    if release < (2, 4):
        with pytest.raises(AllocConfError, match="0 disables rounding from torch 2.4"):
            parse_alloc_conf(text, release)
    else:
        assert parse_alloc_conf(text, release).roundup_power2_divisions == \
            (0,) * 10 + (4,) + (0,) * 5


@pytest.mark.parametrize("release, expected", [
    ((2, 2), (1,) * 9 + (8,) * 7),
    ((2, 8), (1,) * 9 + (8,) * 7),
    ((2, 9), (1,) * 9 + (8,) * 7),  # 2.9 still parses CUDA's settings with its own parser
    ((2, 10), (1,) * 9 + (2,) + (8,) * 6),
    ((2, 15), (1,) * 9 + (2,) + (8,) * 6),
])
def test_where_the_greater_than_entry_starts_filling(release, expected):
    text = "roundup_power2_divisions:[256:1,512:2,>:8]"
    assert parse_alloc_conf(text, release).roundup_power2_divisions == expected


@pytest.mark.parametrize("release, said", [
    ((2, 4), "garbage_collect_threshold too big, set it 0.0~1.0"),
    ((2, 9), "garbage_collect_threshold too big, set it 0.0~1.0"),
    ((2, 10), "garbage_collect_threshold is invalid, set it in (0.0, 1.0)"),
])
def test_the_gc_threshold_error_is_worded_as_that_torch_words_it(release, said):
    with pytest.raises(AllocConfError) as info:
        parse_alloc_conf("garbage_collection_threshold:1.5", release)
    assert said in str(info.value)


@pytest.mark.parametrize("env, release, text", [
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, (2, 9), ""),
    ({"PYTORCH_ALLOC_CONF": "expandable_segments:True"}, (2, 10), "expandable_segments:True"),
    ({"PYTORCH_ALLOC_CONF": "a:1", "PYTORCH_CUDA_ALLOC_CONF": "b:2"}, (2, 15), "b:2"),
    ({"PYTORCH_CUDA_ALLOC_CONF": "b:2"}, (2, 2), "b:2"),
    ({}, (2, 15), ""),
])
def test_which_environment_variable_the_release_reads(env, release, text):
    assert alloc_conf_text(env, release) == text


def _trace(sizes, meta=None):
    trace = Trace(meta=meta or {})
    for ident, size in enumerate(sizes):
        trace.alloc(ident, size)
    for ident in range(len(sizes)):
        trace.free(ident)
    return trace


def test_the_generic_variable_changes_placement_only_where_the_release_reads_it():
    # expandable_segments maps 20 MiB pages: a 30 MiB request reserves 40 MiB; without it the
    # segment is the request rounded to 2 MiB, 30 MiB. torch 2.9 never sees PYTORCH_ALLOC_CONF.
    env = {"PYTORCH_ALLOC_CONF": "expandable_segments:True"}
    trace = _trace([30 * MiB])
    old = simulate(trace, config_from_env(env, "2.9.1"))
    new = simulate(trace, config_from_env(env, "2.10.0"))
    assert old.peak_reserved_bytes == 30 * MiB
    assert new.peak_reserved_bytes == 40 * MiB


def test_the_greater_than_fill_changes_how_much_a_600_mb_tensor_reserves():
    # 600 MiB lies in the 512 MiB-1 GiB interval: 2.9 gives it 8 divisions (64 MiB steps ->
    # 640 MiB), 2.10 the 2 named for it (256 MiB steps -> 768 MiB).
    text = "roundup_power2_divisions:[256:1,512:2,>:8]"
    trace = _trace([600 * MiB])
    assert simulate(trace, parse_alloc_conf(text, (2, 9))).peak_allocated_bytes == 640 * MiB
    assert simulate(trace, parse_alloc_conf(text, (2, 10))).peak_allocated_bytes == 768 * MiB


def test_with_the_same_settings_every_release_places_the_same():
    # torch_releases.py: no placement rule differs between 2.2 and 2.15 under the same
    # effective settings. A mixed sequence (small pool, the 1-10 MiB band, oversize, reuse,
    # splits) replays identically under every release.
    sizes = [512, 700 * 1024, 3 * MiB, 12 * MiB + 5, 64 * MiB, 1500, 9 * MiB]
    trace = Trace()
    for ident, size in enumerate(sizes):
        trace.alloc(ident, size)
    trace.free(2)
    trace.free(4)
    trace.alloc(100, 5 * MiB)
    trace.alloc(101, 40 * MiB)
    for text in ("", "max_split_size_mb:40", "expandable_segments:True",
                 "roundup_power2_divisions:4,garbage_collection_threshold:0.5"):
        results = {r: simulate(trace, parse_alloc_conf(text, r)).stats for r in RELEASES}
        assert all(stats == results[(2, 15)] for stats in results.values()), text


# -- xmem simulate: the trace's torch -------------------------------------------------------
def _run(argv, capsys):
    code = cli.main(argv)
    out, err = capsys.readouterr()
    return code, out, err


def test_simulate_uses_the_traces_torch_for_the_settings(tmp_path, capsys):
    path = tmp_path / "t.json"
    _trace([4 * MiB], {"torch": "2.9.1+cu128"}).dump(str(path))
    code, out, err = _run(["simulate", str(path), "--alloc-conf",
                           "per_process_memory_fraction:0.5"], capsys)
    assert code == 2
    assert "RuntimeError: Unrecognized CachingAllocator option: per_process_memory_fraction" in err
    code, out, err = _run(["simulate", str(path), "--alloc-conf", "max_split_size_mb:64"],
                          capsys)
    assert code == 0 and "allocator of torch 2.9 (traced with torch 2.9.1+cu128)" in out


def test_simulate_torch_option_overrides_the_trace_and_the_default_is_the_newest(tmp_path,
                                                                                 capsys):
    path = tmp_path / "t.json"
    _trace([4 * MiB], {"torch": "2.9.1"}).dump(str(path))
    code, out, _ = _run(["simulate", str(path), "--torch", "2.12.0", "--json", "--alloc-conf",
                         "per_process_memory_fraction:0.9", "--capacity-bytes", str(80 << 30)],
                        capsys)
    assert code == 0 and json.loads(out)["allocator_config"]["torch_release"] == "2.12"
    bare = tmp_path / "bare.json"
    _trace([4 * MiB]).dump(str(bare))
    code, out, _ = _run(["simulate", str(bare), "--json"], capsys)
    assert code == 0 and json.loads(out)["allocator_config"]["torch_release"] == "2.15"


def test_simulate_refuses_a_trace_whose_torch_is_not_a_version_string(tmp_path, capsys):
    path = tmp_path / "t.json"
    _trace([4 * MiB], {"torch": 2.9}).dump(str(path))
    code, _, err = _run(["simulate", str(path)], capsys)
    assert code == 2 and "meta.torch must be a version string" in err
