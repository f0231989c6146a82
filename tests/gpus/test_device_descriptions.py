"""Device descriptions for cuDNN's deviceless planning: one per catalogue GPU, with sources."""

from __future__ import annotations

import pytest

from xmem_admission.contract.gpu_devices import (
    ARCHITECTURES,
    GUIDE_TABLE,
    PRODUCTS,
    device_description,
)
from xmem_admission.contract.gpus import all_gpus, lookup

CATALOGUE = [gpu.key for gpu in all_gpus()]


@pytest.mark.parametrize("key", CATALOGUE)
def test_every_catalogue_model_has_a_complete_description(key):
    description = device_description(lookup(key))
    assert description.complete(), description


@pytest.mark.parametrize("key", CATALOGUE)
def test_the_datasheet_sm_count_agrees_with_the_catalogue(key):
    assert PRODUCTS[key].multi_processor_count == lookup(key).multi_processor_count


@pytest.mark.parametrize("key", CATALOGUE)
def test_the_datasheet_compute_capability_agrees_with_the_catalogue(key):
    assert PRODUCTS[key].compute_capability == lookup(key).compute_capability


@pytest.mark.parametrize("key", CATALOGUE)
def test_every_description_names_the_programming_guide_and_a_product_document(key):
    source = device_description(lookup(key)).source
    assert GUIDE_TABLE in source
    assert any(word in source for word in ("datasheet", "whitepaper", "specifications", "repr"))


def test_no_product_figures_are_kept_for_a_model_outside_the_catalogue():
    assert set(PRODUCTS) == set(CATALOGUE)


def test_no_architecture_row_is_kept_for_a_compute_capability_outside_the_catalogue():
    assert set(ARCHITECTURES) == {gpu.compute_capability for gpu in all_gpus()}


def test_the_description_carries_the_catalogue_capacity_as_global_memory():
    gpu = lookup("A100-40GB")
    assert device_description(gpu).total_global_memory == gpu.capacity_bytes


def test_the_memory_clock_is_half_the_data_rate_as_deviceQuery_prints_it():
    # A100 40GB: 1555 GB/s over 5120 bits = 2.43 Gbit/s per pin, 1215 MHz.
    assert device_description(lookup("A100-40GB")).memory_clock_khz // 1000 == 1214


@pytest.mark.parametrize(
    "cc, optin, reserved",
    [((7, 0), 96 * 1024, 0), ((8, 0), 163 * 1024, 1024), ((8, 6), 99 * 1024, 1024),
     ((9, 0), 227 * 1024, 1024)],
)
def test_opt_in_shared_memory_and_the_reserved_kilobyte_follow_the_guide(cc, optin, reserved):
    limits = ARCHITECTURES[cc]
    assert limits.shared_memory_per_block_optin == optin
    assert limits.reserved_shared_memory_per_block == reserved
    assert limits.shared_memory_per_block_optin + reserved == limits.shared_memory_per_sm


def test_an_unknown_model_has_no_description():
    gpu = lookup("A100-40GB")
    other = type(gpu)(**{**gpu.__dict__, "key": "NOT-A-GPU"})
    with pytest.raises(KeyError, match="NOT-A-GPU"):
        device_description(other)


def test_all_descriptions_cover_the_catalogue():
    assert [device_description(gpu).gpu_key for gpu in all_gpus()] == CATALOGUE
