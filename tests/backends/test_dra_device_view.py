"""What the controller sees before it writes a claim: the DRA devices of the policy's class.

The ResourceSlices are the ones the drivers publish (``localkube/dra.py``: NVIDIA's ConsumableShares
``memory`` mode, its MIG devices, HAMi's memory and cores, the example driver's memory and
compute), fed to the controller's own informers.
"""

from __future__ import annotations

from typing import Any, Dict, List, Optional, cast

import pytest

from localkube import dra as published
from localkube import dra_plugin
from xmem_admission.cluster.backends import dra
from xmem_admission.cluster.controller.dra_claims import (
    DEVICE_CLASS,
    RESOURCE_SLICE,
    DeviceView,
    Whole,
    devices_of,
)
from xmem_admission.cluster.kube.client import Kube
from xmem_admission.cluster.kube.informer import Informer
from xmem_admission.cluster.policy.model import Dra, DraDriver
from xmem_admission.contract import gpus

MiB, GiB = 1 << 20, 1 << 30
H200, A100 = gpus.lookup("H200"), gpus.lookup("A100-80GB")
NVIDIA = Dra()
MIG = Dra(driver=DraDriver.NVIDIA_MIG, device_class="mig.nvidia.com")
HAMI = Dra(driver=DraDriver.HAMI, device_class="hami-core-gpu.project-hami.io")
EXAMPLE = Dra(device_class=dra_plugin.DRIVER, pin_product=False)  # as on the real node


def view(slices: List[Dict[str, Any]], classes: Any = None) -> DeviceView:
    found = DeviceView(Informer(cast(Kube, None), RESOURCE_SLICE),
                       Informer(cast(Kube, None), DEVICE_CLASS))
    for obj in slices:
        found.slices.put(obj)
    for obj in published.device_classes() if classes is None else classes:
        found.classes.put(obj)
    found.slices.synced.set()
    found.classes.synced.set()
    assert found.ready()
    return found


def test_an_h200_is_published_with_its_whole_memory_shareable_in_1mi_steps() -> None:
    (device,) = devices_of(published.nvidia_slice("gpu-a", [published.nvidia_gpu(H200)]))
    assert device.shared and device.memory == 143_771 * MiB
    assert device.policy == {"min": MiB, "max": 143_771 * MiB, "step": MiB}
    assert device.attributes["productName"] == "NVIDIA H200"


def test_a_shared_gpu_of_the_class_takes_the_request_rounded_to_its_step() -> None:
    seen = view([published.nvidia_slice("gpu-a", [published.nvidia_gpu(H200)])])
    assert seen.capacity(NVIDIA, H200, 18 * GiB + 1) == (18 * GiB + MiB, "")
    assert seen.capacity(HAMI, H200, 18 * GiB)[0] is None  # no HAMi device on this cluster


def test_a_class_without_a_shareable_device_says_why() -> None:
    whole = published.nvidia_gpu(H200, shared=False)
    asked, why = view([published.nvidia_slice("gpu-a", [whole])]).capacity(NVIDIA, H200, 18 * GiB)
    assert asked is None
    assert "DeviceClass gpu.nvidia.com has no shareable device" in why and "1 devices" in why


def test_a_pinned_model_that_no_device_is_has_nothing_to_offer() -> None:
    seen = view([published.nvidia_slice("gpu-a", [published.nvidia_gpu(A100)])])
    asked, why = seen.capacity(NVIDIA, H200, 18 * GiB)
    assert asked is None and "of model 'NVIDIA H200'" in why
    assert seen.capacity(Dra(pin_product=False), H200, 18 * GiB)[0] == 18 * GiB


def test_a_missing_device_class_is_named() -> None:
    seen = view([published.nvidia_slice("gpu-a", [published.nvidia_gpu(H200)])], classes=[])
    assert seen.capacity(NVIDIA, H200, GiB) == (None, "DeviceClass gpu.nvidia.com does not exist")


def test_a_mig_claim_finds_a_device_of_the_smallest_fitting_slice_only() -> None:
    seen = view([published.nvidia_slice("gpu-b", [
        published.nvidia_mig(A100, "1g.20gb", start=0, slices=2),
        published.nvidia_mig(A100, "3g.40gb", start=4, slices=4)])])
    assert seen.capacity(MIG, A100, 15 * GiB) == (None, "")
    only_big = view([published.nvidia_slice("gpu-b", [
        published.nvidia_mig(A100, "3g.40gb", start=4, slices=4)])])
    assert "no MIG device" in only_big.capacity(MIG, A100, 15 * GiB)[1]
    assert only_big.capacity(MIG, A100, 30 * GiB) == (None, "")


def test_hamis_class_shares_its_gpus_by_memory() -> None:
    seen = view([published.hami_slice("gpu-c", [published.hami_gpu(H200)])])
    assert seen.capacity(HAMI, H200, 18 * GiB) == (18 * GiB, "")
    assert seen.capacity(NVIDIA, H200, 18 * GiB)[0] is None


def _example(compute: Optional[Dict[str, Any]], index: int = 0) -> Dict[str, Any]:
    """The example driver's shared GPU with its ``compute`` capacity as given (None: none)."""
    device = published.example_gpu(index)
    if compute is None:
        del device["capacity"]["compute"]
    else:
        device["capacity"]["compute"] = compute
    return device


def _example_view(*devices: Dict[str, Any]) -> DeviceView:
    return view([published.example_slice("gpu-e", list(devices))],
                classes=published.device_classes() + [dra_plugin.device_class()])


@pytest.mark.parametrize("compute, whole, by_default", [
    ({"value": "100", "requestPolicy": {"default": "100", "validRange": {
        "min": "1", "max": "100", "step": "1"}}}, True, True),  # the example driver's
    ({"value": "100"}, True, False),  # no request policy: the whole capacity
    ({"value": "100", "requestPolicy": {"default": "10", "validRange": {
        "min": "1", "max": "100", "step": "1"}}}, False, False),  # ten claims share it
    ({"value": "0"}, False, False),  # nothing to take
])
def test_a_capacity_is_taken_whole_when_a_claim_that_asks_none_of_it_consumes_all_of_it(
        compute: Dict[str, Any], whole: bool, by_default: bool) -> None:
    (device,) = devices_of(published.example_slice("gpu-e", [_example(compute)]))
    expected = [Whole("compute", compute["value"], by_default)] if whole else []
    assert [w for w in device.whole if w.name == "compute"] == expected


def test_a_device_that_is_not_shared_records_nothing_taken_whole() -> None:
    unshared = published.example_gpu()
    del unshared["allowMultipleAllocations"]
    (device,) = devices_of(published.example_slice("gpu-e", [unshared]))
    assert device.whole == () and not device.shared


def test_example_driver_claims_take_a_whole_device_by_its_compute_default() -> None:
    seen = _example_view(published.example_gpu(0), published.example_gpu(1))
    assert seen.capacity(EXAMPLE, H200, 18 * GiB) == (18 * GiB, "")  # satisfiable
    assert seen.takes_whole(EXAMPLE, H200, 18 * GiB) == (
        "claims of DeviceClass gpu.example.com take the whole `compute` (100) of a device: its "
        "request policy's default, which a claim that asks none of it consumes; one claim per "
        "device, no sharing")


def test_a_capacity_without_a_request_policy_is_said_to_have_no_default() -> None:
    seen = _example_view(_example({"value": "100"}))
    assert "the whole `compute` (100) of a device: no default in its request policy" in \
        seen.takes_whole(EXAMPLE, H200, 18 * GiB)


@pytest.mark.parametrize("devices", [
    [_example({"value": "100", "requestPolicy": {"default": "10", "validRange": {
        "min": "1", "max": "100", "step": "1"}}})],  # a small default: ten share it
    [_example(None)],  # memory only
    [published.example_gpu(0), _example(None, index=1)],  # one device of the class shares
])
def test_claims_that_can_share_a_device_take_nothing_whole(devices: List[Dict[str, Any]]) -> None:
    assert _example_view(*devices).takes_whole(EXAMPLE, H200, 18 * GiB) == ""


def test_a_device_too_small_for_the_request_is_not_judged() -> None:
    small = published.example_gpu(0)
    small["capacity"]["memory"] = {"value": "8Gi", "requestPolicy": {
        "default": "8Gi", "validRange": {"min": "1Gi", "max": "8Gi", "step": "1Gi"}}}
    seen = _example_view(small, _example(None, index=1))
    assert seen.takes_whole(EXAMPLE, H200, 18 * GiB) == ""  # only gpu-1 holds it, and shares


def test_hamis_cores_are_asked_so_its_claims_share_a_gpu() -> None:
    (device,) = devices_of(published.hami_slice("gpu-c", [published.hami_gpu(H200)]))
    assert {w.name for w in device.whole} == {"cores", "memory"}  # both default to the whole
    seen = view([published.hami_slice("gpu-c", [published.hami_gpu(H200)])])
    assert seen.takes_whole(HAMI, H200, 18 * GiB) == ""
    # The same device under the nvidia convention, which asks no cores, is taken whole.
    as_nvidia = Dra(device_class=HAMI.device_class, pin_product=False)
    assert "the whole `cores` (100) of a device" in seen.takes_whole(as_nvidia, H200, 18 * GiB)


def test_nvidias_shared_gpus_and_mig_devices_take_nothing_whole() -> None:
    seen = view([published.nvidia_slice("gpu-a", [published.nvidia_gpu(H200)]),
                 published.nvidia_slice("gpu-b", [
                     published.nvidia_mig(A100, "1g.20gb", start=0, slices=2)])])
    assert seen.takes_whole(NVIDIA, H200, 18 * GiB) == ""
    assert seen.takes_whole(MIG, A100, 15 * GiB) == ""


@pytest.mark.parametrize("settings", [NVIDIA, HAMI, MIG])
def test_the_capacities_a_claim_asks_are_the_ones_its_template_writes(settings: Dra) -> None:
    body = dra.claim_template("ns", {"metadata": {"name": "job", "uid": "u"}}, 18 * GiB, 1,
                              A100 if settings is MIG else H200, settings)
    exactly = body["spec"]["spec"]["devices"]["requests"][0]["exactly"]
    assert tuple(exactly.get("capacity", {}).get("requests", {})) == dra.ASKS[settings.driver]
