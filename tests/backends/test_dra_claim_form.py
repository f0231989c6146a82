"""What ``kubectl get gme`` shows in its Claim column under the ``DRA`` backend: the
DeviceClass and what the claim asks, per driver convention (``status.claim``)."""

from __future__ import annotations

import pytest

from xmem_admission.cluster.backends.dra import claim_form
from xmem_admission.cluster.policy.model import Dra, DraDriver
from xmem_admission.contract import gpus

GiB, MiB = 1 << 30, 1 << 20
H200, A100 = gpus.lookup("H200"), gpus.lookup("A100-80GB")


@pytest.mark.parametrize("dra, gpu, asked, shown", [
    (Dra(), H200, 18 * GiB, "gpu.nvidia.com memory=18Gi"),
    # not a whole GiB: the MiB the template asks
    (Dra(), H200, 18 * GiB + 1, "gpu.nvidia.com memory=18433Mi"),
    (Dra(driver=DraDriver.HAMI, device_class="hami-core-gpu.project-hami.io", cores_percent=30),
     H200, 18 * GiB, "hami-core-gpu.project-hami.io memory=18Gi cores=30"),
    (Dra(driver=DraDriver.HAMI, device_class="hami-core-gpu.project-hami.io"),
     H200, 18 * GiB, "hami-core-gpu.project-hami.io memory=18Gi cores=0"),
    # MIG: the least memory the selector asks and the slice size it picks
    (Dra(driver=DraDriver.NVIDIA_MIG, device_class="mig.nvidia.com"), A100, 15 * GiB,
     "mig.nvidia.com memory>=15Gi (1g.20gb)"),
    (Dra(driver=DraDriver.NVIDIA_MIG, device_class="mig.nvidia.com"), A100, 90 * GiB,
     "mig.nvidia.com memory>=90Gi"),
])
def test_the_claim_column_names_the_class_and_what_the_claim_asks(
        dra: Dra, gpu: gpus.GPU, asked: int, shown: str) -> None:
    assert claim_form(dra, gpu, asked) == shown
