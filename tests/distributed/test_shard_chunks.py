"""FSDP2's shards are made on demand in the probe (``distributed._ShardChunks``): every chunk
FSDP2 can ask for is the view ``torch.chunk`` padded with empty tensors would give (FSDP2's
``_chunk_with_empty``), for even and uneven sizes, along either dimension."""

from __future__ import annotations

import pytest
import torch

from xmem_admission.estimator.probe.distributed import _ShardChunks


def _padded_chunks(tensor, n, dim):
    chunks = list(torch.chunk(tensor, n, dim=dim))
    while len(chunks) < n:
        chunks.append(chunks[0].new_empty(0))
    return chunks


@pytest.mark.parametrize("shape, n, dim", [
    ((64, 8), 64, 0),   # one row per rank
    ((10, 3), 4, 0),    # uneven: 3, 3, 3, 1
    ((3, 5), 8, 0),     # fewer rows than ranks: 3 views, 5 empty tensors
    ((6, 7), 3, 1),     # along the second dimension, uneven
    ((1000,), 64, 0),   # a bias: 16 per rank, the last one 8, and ranks with nothing
])
def test_every_shard_is_the_view_torch_chunk_gives(shape, n, dim):
    tensor = torch.arange(torch.Size(shape).numel(), dtype=torch.float32).reshape(shape)
    ours, theirs = _ShardChunks(tensor, n, dim), _padded_chunks(tensor, n, dim)
    assert len(ours) == n
    for i in [*range(n), -1]:
        mine, real = ours[i], theirs[i]
        assert mine.shape == real.shape
        assert torch.equal(mine, real)
        if real.numel():
            assert mine.untyped_storage().data_ptr() == tensor.untyped_storage().data_ptr()
            assert (mine.storage_offset(), mine.stride()) == (real.storage_offset(), real.stride())
    assert [c.shape for c in ours] == [c.shape for c in theirs]


def test_a_shard_past_the_world_is_an_index_error():
    with pytest.raises(IndexError):
        _ShardChunks(torch.zeros(8), 4, 0)[4]
