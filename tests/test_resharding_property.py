"""Any save layout loads into any load layout, bit-exact (all ranks simulated in one process)."""

from __future__ import annotations

import uuid
from math import prod

import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardsafe import Checkpointer, ShardedTensor

from .layouts import layouts
from .simulate import simulate_save

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int8, torch.bool]


def random_tensor(shape, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-100, 100, shape, generator=g).to(dtype)


def piece_data(full, piece):
    off, lens, flat = piece
    box = full[tuple(slice(o, o + n) for o, n in zip(off, lens))] if lens else full
    if flat is None:
        return box.clone()
    return box.reshape(-1)[flat[0]:flat[1]].clone()


def as_sharded(key, full, piece, data):
    off, lens, flat = piece
    return ShardedTensor(key, data, tuple(full.shape), off, lens, flattened_range=None if flat is None else slice(*flat))


def garbage_like(t):
    if t.dtype == torch.bool:
        return ~t.clone()
    return (t.clone() + 1) if not t.dtype.is_floating_point else torch.full_like(t, float("nan"))


shapes = st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple)


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    shape=shapes,
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 2**31 - 1),
    data=st.data(),
)
def test_any_layout_to_any_layout(shape, dtype, seed, data):
    full = random_tensor(shape, dtype, seed)
    save_layout = data.draw(layouts(shape), label="save")
    load_layout = data.draw(layouts(shape), label="load")
    url = f"memory://prop-{uuid.uuid4().hex}"
    staged = data.draw(st.booleans(), label="staged")  # through the async path's staging buffer, or not
    simulate_save(url, [{"t": as_sharded("t", full, p, piece_data(full, p))} for p in save_layout], staged=staged)

    for p in load_layout:
        expected = piece_data(full, p)
        target = garbage_like(expected)
        Checkpointer().load(url, {"t": as_sharded("t", full, p, target)}, no_dist=True)
        assert torch.equal(target, expected), (p, target, expected)

    unsharded = Checkpointer().unshard(url, no_dist=True)
    assert torch.equal(unsharded["t"], full)


@settings(max_examples=60, deadline=None)
@given(seed=st.integers(0, 2**31 - 1), data=st.data())
def test_several_tensors_and_keys_on_some_ranks(seed, data):
    """Different keys on different ranks, and tensors of several dtypes in one checkpoint."""
    world = data.draw(st.integers(1, 4))
    tensors = {
        f"k{i}": random_tensor(data.draw(shapes.filter(lambda s: prod(s) > 0)), data.draw(st.sampled_from(DTYPES)), seed + i)
        for i in range(data.draw(st.integers(1, 4)))
    }
    per_rank: list[dict] = [{} for _ in range(world)]
    for key, full in tensors.items():
        layout = data.draw(layouts(tuple(full.shape)))
        for j, p in enumerate(layout):  # spread pieces over ranks; a rank may hold none of a key
            rank = j % world
            if key in per_rank[rank]:
                extra = {"_": None}
                per_rank.append(extra)
                rank = len(per_rank) - 1
            per_rank[rank][key] = as_sharded(key, full, p, piece_data(full, p))
    for sd in per_rank:
        sd.pop("_", None)
    url = f"memory://prop-{uuid.uuid4().hex}"
    simulate_save(url, per_rank)
    out = Checkpointer().unshard(url, no_dist=True)
    assert set(out) == set(tensors)
    for key, full in tensors.items():
        assert torch.equal(out[key], full), key
