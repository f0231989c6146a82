"""PYTORCH_CUDA_ALLOC_CONF is parsed the way PyTorch 2.9+ parses it, and bad strings are named."""

from __future__ import annotations

import pytest

from xmem_admission.contract.errors import AllocConfError
from xmem_admission.estimator.allocator.alloc_conf import (
    UNLIMITED,
    AllocatorConfig,
    Backend,
    config_from_snapshot_settings,
    parse_alloc_conf,
    tokenize,
)

MiB = 1024 * 1024


def test_an_empty_string_gives_pytorch_defaults():
    conf = parse_alloc_conf("")
    assert conf.max_split_size == UNLIMITED and not conf.max_split_size_limited
    assert conf.max_non_split_rounding_size == 20 * MiB
    assert conf.large_segment_size == 20 * MiB
    assert conf.roundup_power2_divisions == (0,) * 16
    assert conf.garbage_collection_threshold == 0.0
    assert conf.expandable_segments is False
    assert conf.backend is Backend.NATIVE
    assert conf == AllocatorConfig(source="")


def test_the_tokenizer_splits_on_separators_and_drops_whitespace():
    assert tokenize(" a : 1 ,b:[ 2:3 , >:4 ]") == \
        ["a", ":", "1", ",", "b", ":", "[", "2", ":", "3", ",", ">", ":", "4", "]"]


def test_sizes_are_read_in_megabytes():
    conf = parse_alloc_conf("max_split_size_mb:128, max_non_split_rounding_mb:64")
    assert conf.max_split_size == 128 * MiB
    assert conf.max_non_split_rounding_size == 64 * MiB


def test_the_single_number_form_of_roundup_divisions_fills_every_interval():
    assert parse_alloc_conf("roundup_power2_divisions:4").roundup_power2_divisions == (4,) * 16


def test_the_list_form_fills_below_the_first_entry_and_after_the_last_from_pytorch_2_9():
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]")
    # 256 MB is interval 8: entries 0..8 get 1, 512 MB (interval 9) gets 2, '>' fills 10..15.
    assert conf.roundup_power2_divisions == (1,) * 9 + (2,) + (8,) * 6


def test_before_pytorch_2_9_the_greater_than_entry_also_overwrote_the_last_named_interval():
    conf = parse_alloc_conf("roundup_power2_divisions:[256:1,512:2,>:8]", version=(2, 8))
    assert conf.roundup_power2_divisions == (1,) * 9 + (8,) * 7


def test_boundaries_beyond_the_table_clamp_and_unnamed_middle_intervals_stay_unrounded():
    conf = parse_alloc_conf("roundup_power2_divisions:[1:4,65536:2]")
    # 1 MB is interval 0; 65536 MB (64 GB) clamps to interval 15; 1..14 are never named.
    assert conf.roundup_power2_divisions == (4,) + (0,) * 14 + (2,)


def test_expandable_segments_gc_threshold_and_memory_fraction_are_read():
    conf = parse_alloc_conf("expandable_segments:True,garbage_collection_threshold:0.6,"
                            "per_process_memory_fraction:0.5")
    assert conf.expandable_segments is True
    assert conf.garbage_collection_threshold == 0.6
    assert conf.per_process_memory_fraction == 0.5


def test_large_segment_size_exists_from_pytorch_2_11_and_raises_the_split_floor():
    conf = parse_alloc_conf("large_segment_size_mb:32,max_split_size_mb:32")
    assert conf.large_segment_size == 32 * MiB
    with pytest.raises(AllocConfError, match="max_split_size_mb 30 is too small, must be >= 32"):
        parse_alloc_conf("large_segment_size_mb:32,max_split_size_mb:30")
    with pytest.raises(AllocConfError, match="PyTorch 2.10 has no such key"):
        parse_alloc_conf("large_segment_size_mb:32", version=(2, 10))


def test_device_independent_and_host_keys_are_accepted_and_ignored():
    conf = parse_alloc_conf("backend:native,release_lock_on_cudamalloc:True,"
                            "pinned_use_cuda_host_register:False,pinned_num_register_threads:8,"
                            "pinned_use_background_threads:True,"
                            "expandable_segments_reserve_by_class:[a,b],")
    assert conf.to_dict() == AllocatorConfig().to_dict()


def test_the_async_backend_is_recorded_so_the_simulator_can_refuse_it():
    assert parse_alloc_conf("backend:cudaMallocAsync").backend is Backend.CUDA_MALLOC_ASYNC


@pytest.mark.parametrize("text, message", [
    ("max_split_size_mb:10", "max_split_size_mb 10 is too small, must be >= 20"),
    ("max_split_size_mb:abc", "expected a non-negative whole number, got 'abc'"),
    ("max_split_size_mb", "expected ':' after 'max_split_size_mb'"),
    ("max_split_size_mb:", "max_split_size_mb needs a value"),
    ("max_split_size_mb=100", "unrecognized option 'max_split_size_mb=100'"),
    ("expandable_segments,True", "expected ':' after 'expandable_segments', got ','"),
    ("expandable_segments:true", "expandable_segments: expected True or False, got 'true'"),
    ("garbage_collection_threshold:1.0", "must be in (0.0, 1.0), got 1.0"),
    ("garbage_collection_threshold:nan", "expected a finite number"),
    ("per_process_memory_fraction:1.5", "must be in [0.0, 1.0], got 1.5"),
    ("roundup_power2_divisions:3", "divisions must be a power of 2, got 3"),
    ("roundup_power2_divisions:0", "divisions must be a power of 2, got 0"),
    ("roundup_power2_divisions:[256:3]", "power of 2 or 0, got 3 for '256'"),
    ("roundup_power2_divisions:[300:2]", "interval boundaries are powers of 2 in MB or '>'"),
    ("roundup_power2_divisions:[256:2", "list has no closing ']'"),
    ("roundup_power2_divisions:[256:2;512:4]", "expected a non-negative whole number"),
    ("backend:magic", "unknown allocator backend 'magic'"),
    ("pinned_num_register_threads:3", "a power of 2 no larger than 128"),
    ("release_lock_on_cudamalloc:1", "expected True or False, got '1'"),
    ("expandable_segments:True max_split_size_mb:40", "expected True or False"),
    ("flux_capacitor:True", "unrecognized option 'flux_capacitor'"),
    (",expandable_segments:True", "expected an option name, got ','"),
    ("large_segment_size_mb:10", "large_segment_size_mb must be > 10, got 10"),
])
def test_malformed_strings_are_rejected_with_a_message_naming_the_problem(text, message):
    with pytest.raises(AllocConfError) as info:
        parse_alloc_conf(text)
    assert message in str(info.value)


def test_snapshot_settings_rebuild_the_effective_configuration():
    settings = {"PYTORCH_CUDA_ALLOC_CONF": "max_split_size_mb:64", "max_split_size": 64 * MiB,
                "garbage_collection_threshold": 0.0, "expandable_segments": False,
                "roundup_power2_divisions": {"1": 0, "2": 0, "256": 4, "32768": 8}}
    conf = config_from_snapshot_settings(settings)
    assert conf.max_split_size == 64 * MiB
    assert conf.roundup_power2_divisions[8] == 4 and conf.roundup_power2_divisions[15] == 8
    assert config_from_snapshot_settings({"max_split_size": -1}).max_split_size == UNLIMITED
