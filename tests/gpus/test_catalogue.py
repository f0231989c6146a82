"""The GPU catalogue: name matching, MIG profile choice, sources, and ``xmem gpus``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from xmem_admission import cli
from xmem_admission.contract.errors import UnknownGPUError, XmemError
from xmem_admission.contract.gpus import (
    CUBLAS_WORKSPACE_DEFAULT,
    GiB,
    MigProfile,
    all_gpus,
    lookup,
    smallest_mig_profile,
)

RUNS = Path(__file__).resolve().parents[3] / "shared" / "data" / "xmem-paper" / "runs.jsonl"

ALL_NAMES = [
    (gpu.key, name) for gpu in all_gpus() for name in (gpu.key, gpu.cuda_name) + gpu.aliases
]


@pytest.mark.parametrize(
    "name, key",
    [
        ("A100-40GB", "A100-40GB"),
        ("A100-80GB", "A100-80GB"),
        ("H100-80GB", "H100-80GB"),
        ("H200", "H200"),
        ("L40S", "L40S"),
        ("RTX-3060", "RTX-3060"),
        ("RTX-4060", "RTX-4060"),
        ("NVIDIA GeForce RTX 3060", "RTX-3060"),
        ("NVIDIA A100-SXM4-40GB", "A100-40GB"),
        ("NVIDIA H200", "H200"),
        ("Tesla T4", "T4"),
        ("NVIDIA H100 80GB HBM3", "H100-80GB"),
    ],
)
def test_names_from_the_issue_and_from_cuda_resolve_to_their_model(name, key):
    assert lookup(name).key == key


@pytest.mark.parametrize("key, name", ALL_NAMES)
def test_every_key_cuda_name_and_alias_resolves_to_its_own_model(key, name):
    assert lookup(name).key == key


@pytest.mark.parametrize("name", ["a100-40gb", "A100-40GB", "a100-40GB", "nvidia a100-sxm4-40gb"])
def test_lookup_ignores_case(name):
    assert lookup(name).key == "A100-40GB"


@pytest.mark.parametrize(
    "name, key",
    [
        ("NVIDIA-A100-SXM4-40GB", "A100-40GB"),  # GPU Feature Discovery's gpu.product label
        ("  rtx 3060 ", "RTX-3060"),
        ("rtx_4060", "RTX-4060"),
        ("GeForce RTX 3060", "RTX-3060"),
    ],
)
def test_spaces_dashes_underscores_and_vendor_prefixes_are_interchangeable(name, key):
    assert lookup(name).key == key


@pytest.mark.parametrize("short, larger", [("a100", "A100-80GB"), ("v100", "V100-32GB")])
def test_an_ambiguous_short_name_means_the_smaller_memory_variant(short, larger):
    assert lookup(short).capacity_bytes < lookup(larger).capacity_bytes


def test_an_unknown_name_raises_an_xmem_error_that_lists_every_choice():
    with pytest.raises(UnknownGPUError) as info:
        lookup("A100-41GB")
    assert isinstance(info.value, XmemError)
    message = str(info.value)
    assert "'A100-41GB'" in message
    for gpu in all_gpus():
        assert gpu.key in message
    assert "did you mean A100-40GB" in message


@pytest.mark.parametrize("name", ["", "   ", "NVIDIA", "A100-40GB-SXM9"])
def test_empty_or_partial_names_are_unknown(name):
    with pytest.raises(UnknownGPUError):
        lookup(name)


def test_keys_are_unique_and_names_never_collide_across_models():
    keys = [gpu.key for gpu in all_gpus()]
    assert len(keys) == len(set(keys))
    for key, name in ALL_NAMES:
        assert lookup(name).key == key


def test_the_required_models_are_all_in_the_catalogue():
    for name in ["RTX-3060", "RTX-4060", "RTX-3090", "RTX-4090", "A10", "A10G", "T4", "L4",
                 "L40S", "V100-16GB", "V100-32GB", "A30", "A100-40GB", "A100-80GB", "H100-80GB",
                 "H100-PCIe", "H100-NVL", "H200", "B200"]:
        assert lookup(name)


@pytest.mark.parametrize("gpu", all_gpus(), ids=lambda g: g.key)
def test_every_figure_of_every_gpu_has_a_source_and_a_sane_value(gpu):
    for source in (gpu.capacity_source, gpu.overhead_source, gpu.cublas_workspace_source,
                   gpu.cublaslt_workspace_source, gpu.hardware_source):
        assert len(source) > 20
    assert 4 * GiB < gpu.capacity_bytes < 256 * GiB
    assert gpu.context_bytes > 0 and gpu.runtime_overhead_bytes >= 0
    assert gpu.overhead_bytes == gpu.context_bytes + gpu.runtime_overhead_bytes
    assert gpu.multi_processor_count > 0
    for profile in gpu.mig_profiles:
        assert len(profile.memory_source) > 20
        assert 0 < profile.memory_bytes <= gpu.capacity_bytes
        nominal_gb = float(profile.name.split(".")[1].rstrip("gb"))
        assert profile.memory_bytes <= nominal_gb * GiB  # real slices are below their name


@pytest.mark.parametrize("gpu", all_gpus(), ids=lambda g: g.key)
def test_cublas_workspace_follows_pytorchs_rule_for_the_compute_capability(gpu):
    major = gpu.compute_capability[0]
    expected = 32 * 1024 * 1024 if major in (9, 10, 12) else 4096 * 1024 * 2 + 16 * 1024 * 8
    assert gpu.cublas_workspace_bytes == expected


def test_capacities_measured_in_the_paper_runs_match_the_catalogue():
    if not RUNS.exists():
        pytest.skip(f"{RUNS} is not present in this checkout")
    seen = {}
    for line in RUNS.read_text().splitlines():
        row = json.loads(line)
        seen[row["gpu_name"]] = row["gpu_total_bytes"]
    assert len(seen) == 3
    for cuda_name, total in seen.items():
        assert lookup(cuda_name).capacity_bytes == total


def test_mig_resource_name_is_the_device_plugins_extended_resource():
    assert MigProfile("3g.40gb", 1, 2).resource_name == "nvidia.com/mig-3g.40gb"


def test_the_smallest_profile_that_holds_the_request_is_chosen_at_its_exact_boundary():
    h100 = lookup("H100-80GB")
    by_name = {p.name: p for p in h100.mig_profiles}
    assert smallest_mig_profile(h100, 0).name == "1g.10gb"
    assert smallest_mig_profile(h100, by_name["1g.10gb"].memory_bytes).name == "1g.10gb"
    assert smallest_mig_profile(h100, by_name["1g.10gb"].memory_bytes + 1).name == "1g.20gb"
    assert smallest_mig_profile(h100, by_name["3g.40gb"].memory_bytes).name == "3g.40gb"
    assert smallest_mig_profile(h100, by_name["3g.40gb"].memory_bytes + 1).name == "7g.80gb"


def test_at_equal_memory_the_profile_with_fewer_compute_slices_wins():
    for gpu in all_gpus():
        by_name = {p.name: p for p in gpu.mig_profiles}
        if "1g.20gb" in by_name and "2g.20gb" in by_name:
            assert by_name["1g.20gb"].memory_bytes == by_name["2g.20gb"].memory_bytes
            assert smallest_mig_profile(gpu, by_name["2g.20gb"].memory_bytes).name == "1g.20gb"


def test_no_profile_is_returned_when_the_request_exceeds_every_slice_or_there_is_no_mig():
    h200 = lookup("H200")
    largest = max(p.memory_bytes for p in h200.mig_profiles)
    assert smallest_mig_profile(h200, largest + 1) is None
    assert lookup("RTX-3060").mig_profiles == ()
    assert smallest_mig_profile(lookup("RTX-3060"), 1) is None


def test_a_negative_request_is_refused():
    with pytest.raises(ValueError):
        smallest_mig_profile(lookup("A100-40GB"), -1)


def test_xmem_gpus_json_carries_every_field_and_source(capsys):
    assert cli.main(["gpus", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    assert [g["key"] for g in data["gpus"]] == [g.key for g in all_gpus()]
    h100 = next(g for g in data["gpus"] if g["key"] == "H100-80GB")
    gpu = lookup("H100-80GB")
    assert h100["capacity_bytes"] == gpu.capacity_bytes
    assert h100["overhead_bytes"] == gpu.overhead_bytes
    assert h100["cublas_workspace_bytes"] == 32 * 1024 * 1024
    assert h100["compute_capability"] == [9, 0]
    for field in ("capacity_source", "overhead_source", "cublas_workspace_source",
                  "hardware_source", "cuda_name", "aliases", "multi_processor_count"):
        assert h100[field]
    mig = {p["name"]: p for p in h100["mig_profiles"]}
    assert mig["3g.40gb"]["resource_name"] == "nvidia.com/mig-3g.40gb"
    assert mig["3g.40gb"]["max_instances"] == 2
    assert mig["3g.40gb"]["memory_source"]


def test_xmem_gpus_prints_a_table_with_one_line_per_model(capsys):
    assert cli.main(["gpus"]) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines[0].split()[:3] == ["GPU", "CUDA", "name"]
    for gpu in all_gpus():
        assert any(line.startswith(gpu.key + " ") for line in lines)
    rtx = next(line for line in lines if line.startswith("RTX-3060 "))
    assert "11.76 GiB" in rtx and f"{CUBLAS_WORKSPACE_DEFAULT / 2**20:.2f} MiB" in rtx
    assert "3g.40gb" in next(line for line in lines if line.startswith("H100-80GB "))
