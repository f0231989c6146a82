"""A distributed job traced with a torch below the distributed range is refused with the range,
never traced wrong or failed with a traceback from inside torch's DDP or FSDP."""

from __future__ import annotations

import pytest
import torch

from tests.distributed.conftest import script
from tests.estimator.conftest import H200


@pytest.mark.parametrize("version", ["2.5.1", "2.3.0a0+ebedce2"])
def test_a_ddp_job_with_a_torch_below_the_distributed_range_is_unsupported_with_the_range(
        monkeypatch, version):
    from xmem_admission.estimator.probe import runner

    monkeypatch.setattr(torch, "__version__", version)
    for name, value in {"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "0",
                        "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29500"}.items():
        monkeypatch.setenv(name, value)
    result = runner.run([script("ddp_train.py")], "fake", 2, H200)
    assert result.status == "unsupported"
    assert version in result.reason and "2.6 to 2.15" in result.reason
