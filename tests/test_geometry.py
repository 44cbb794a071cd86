"""Pure geometry: flat segments, tiling checks, and DTensor placements -> global intervals."""

from __future__ import annotations

from itertools import product
from math import prod

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.placement_types import _StridedShard

from shardsafe.adapters.describe import dtensor_intervals
from shardsafe.errors import ShardingError
from shardsafe.planning.geometry import check_tiling, chunk_bounds, flat_segments


@settings(max_examples=300, deadline=None)
@given(shape=st.lists(st.integers(1, 6), min_size=0, max_size=4).map(tuple), data=st.data())
def test_flat_segments_are_the_flat_slice_in_order(shape, data):
    n = prod(shape)
    start = data.draw(st.integers(0, n))
    stop = data.draw(st.integers(start, n))
    index = torch.arange(n).reshape(shape)
    got = []
    for rel, lens, fs in flat_segments(shape, start, stop):
        box = index[tuple(slice(o, o + k) for o, k in zip(rel, lens))] if shape else index
        values = box.reshape(-1).tolist()
        assert values == list(range(fs, fs + len(values)))  # contiguous, in row-major order
        got += values
    assert got == list(range(start, stop))


def test_chunk_bounds_match_torch_chunk():
    for length, parts in product(range(0, 12), range(1, 6)):
        expected = [c.numel() for c in torch.arange(length).chunk(parts)]
        sizes = [chunk_bounds(length, parts, i)[1] for i in range(parts)]
        assert sizes[: len(expected)] == expected and sum(sizes) == length


def test_tiling_errors_name_the_problem():
    with pytest.raises(ShardingError, match=r"key 'w': pieces cover 6 of the 8 elements of global shape \[2, 4\]"):
        check_tiling("w", (2, 4), [((0, 0), (2, 3), None)])
    with pytest.raises(ShardingError, match=r"key 'w': pieces at \[0, 0\] shape \[2, 3\] and at \[0, 2\] shape \[2, 2\] overlap"):
        check_tiling("w", (2, 4), [((0, 0), (2, 3), None), ((0, 2), (2, 2), None)])
    with pytest.raises(ShardingError, match=r"lies outside the global shape \[2, 4\]"):
        check_tiling("w", (2, 4), [((1, 0), (2, 4), None)])
    with pytest.raises(ShardingError, match=r"flattened ranges \[0, 5\] and \[4, 8\] of box at \[0, 0\] overlap"):
        check_tiling("w", (2, 4), [((0, 0), (2, 4), (0, 5)), ((0, 0), (2, 4), (4, 8))])
    # a 3x3 grid tiles exactly
    check_tiling("g", (6, 6), [((i * 2, j * 2), (2, 2), None) for i in range(3) for j in range(3)])


def _torch_local_indices(shape, mesh_shape, coord, placements):
    """The global flat indices of this coordinate's local tensor, by torch's own split code."""
    local = torch.arange(prod(shape)).reshape(shape)
    for mesh_dim, p in enumerate(placements):
        if isinstance(p, Replicate):
            continue
        shards, _ = p._split_tensor(local, mesh_shape[mesh_dim], with_padding=False)
        local = shards[coord[mesh_dim]]
    return local


PLACEMENTS = [Replicate(), Shard(0), Shard(1), _StridedShard(0, split_factor=2), _StridedShard(1, split_factor=3)]


@pytest.mark.parametrize("mesh_shape", [(2,), (3,), (2, 2), (2, 3), (3, 2)])
@pytest.mark.parametrize("shape", [(9, 7), (4, 5), (13, 2), (1, 6)])
def test_dtensor_intervals_match_torch_placements(mesh_shape, shape):
    for placements in product(PLACEMENTS, repeat=len(mesh_shape)):
        for coord in product(*[range(n) for n in mesh_shape]):
            expected = _torch_local_indices(shape, mesh_shape, coord, placements)
            dims = dtensor_intervals("k", shape, mesh_shape, coord, placements)
            rows = [g + i for g, n in dims[0] for i in range(n)]
            cols = [g + i for g, n in dims[1] for i in range(n)]
            got = torch.tensor([[r * shape[1] + c for c in cols] for r in rows], dtype=torch.long).reshape(len(rows), len(cols))
            assert torch.equal(got, expected), (placements, coord)
