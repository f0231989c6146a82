"""The virtual device's streams and events, shared by the patched ``torch.cuda`` API
(``torch_patches``) and the answers of its surface (``cuda_surface``)."""

from __future__ import annotations

from typing import Any

import torch


class Inert:
    """Streams and events of the virtual device: accept every call, do nothing."""

    # What torch.Stream's own attributes say of a stream on the GPU: FSDP2 passes them to its
    # record_grad_output_stream op (2.15, fsdp/_fully_shard/_fsdp_collectives.py); CUDA is
    # device type 1 (c10/core/DeviceType.h).
    stream_id = 0
    device_index = 0
    device_type = 1

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.cuda_stream = 0

    def __getattr__(self, name: str) -> Any:
        return lambda *a, **k: None

    def __enter__(self) -> Inert:
        return self

    def __exit__(self, *exc: Any) -> None:
        return None

    def query(self) -> bool:
        return True

    def is_capturing(self) -> bool:
        return False

    def elapsed_time(self, other: Any) -> float:
        return 0.0
