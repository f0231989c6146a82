"""What the controller sees before it writes a claim: the DRA devices of the policy's class.

The ResourceSlices are the ones the drivers publish (``localkube/dra.py``: NVIDIA's ConsumableShares
``memory`` mode, its MIG devices, HAMi's memory and cores), fed to the controller's own informers.
"""

from __future__ import annotations

from typing import Any, Dict, List, cast

from localkube import dra as published
from xmem_admission.cluster.controller.dra_claims import (
    DEVICE_CLASS,
    RESOURCE_SLICE,
    DeviceView,
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
