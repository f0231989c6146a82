"""Autograd sums a second gradient into the first in place when the first is non-overlapping and
dense (``can_accumulate_inplace`` in torch/csrc/autograd/input_buffer.cpp), not only when it is
contiguous: a transposed gradient (a rotary embedding's q and k) takes no new block on a GPU."""

from __future__ import annotations

import pytest
import torch

from xmem_admission.estimator.probe.autograd_nodes import dense as _dense


def _strided(shape, stride):
    return torch.empty(0).new_empty_strided(shape, stride)


@pytest.mark.parametrize("tensor, dense", [
    (torch.empty(4, 6), True),
    (torch.empty(4, 6).t(), True),                          # transposed: dense, not contiguous
    (torch.empty(2, 3, 4, 5).permute(0, 2, 1, 3), True),    # a head/sequence swap
    (torch.empty(2, 3, 8, 8).to(memory_format=torch.channels_last), True),
    (torch.empty(4, 6)[:, ::2], False),                     # gaps
    (torch.empty(4, 1).expand(4, 6), False),                # overlapping (stride 0)
    (torch.empty(1, 6).expand(1, 6), True),                 # size-1 dims constrain nothing
    (_strided((3, 1, 4), (4, 100, 1)), True),
    (_strided((5,), (2,)), False),
    (_strided((1,), (7,)), True),
    (torch.empty(2, 3, 4)[:, 1:, :], False),
])
def test_a_gradient_accumulates_in_place_exactly_when_it_is_non_overlapping_and_dense(tensor,
                                                                                      dense):
    assert _dense(tensor) is dense
