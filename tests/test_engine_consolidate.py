"""Streaming unshard to one safetensors file: bit-exact, prefix selection, atomic, bounded memory."""

from __future__ import annotations

import dataclasses
import json
import os
import re
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import shardsafe
from shardsafe import (
    Checkpointer,
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingKeyError,
    ShardedTensor,
)
from shardsafe.engine import consolidate
from shardsafe.knobs import KNOBS

from .helpers import bits
from .simulate import simulate_save, two_rank_checkpoint


def _state(ws: int) -> list[dict]:
    """``ws`` ranks: model weights sharded on dim 0 and dim 1, flat optimizer state, replicas."""
    g = torch.Generator().manual_seed(7)
    w = torch.randn(12, 10, generator=g).to(torch.bfloat16)
    e = torch.randn(9, 6, generator=g)
    m = torch.randn(5, 8, generator=g)
    bias = torch.arange(7, dtype=torch.int64)
    ranks = []
    for r in range(ws):
        flat = m.reshape(-1).chunk(ws)[r]
        lo = sum(c.numel() for c in m.reshape(-1).chunk(ws)[:r])
        ranks.append(
            {
                "model.w": ShardedTensor.from_rank_offsets("model.w", w.chunk(ws)[r].clone(), (0, r, ws)),
                "model.e": ShardedTensor.from_rank_offsets("model.e", e.chunk(ws, dim=1)[r].clone(), (1, r, ws)),
                "model.bias": bias,  # replicated: written once
                "model.scalar": torch.tensor(2.5, dtype=torch.float64),
                "model.empty": torch.empty(0, 3),
                "optim.exp_avg": ShardedTensor.from_rank_offsets_flat(
                    "optim.exp_avg", flat.clone(), (5, 8), (0, 0, 1), flattened_range=slice(lo, lo + flat.numel())
                ),
            }
        )
    return ranks


@pytest.fixture
def ckpt(tmp_path):
    d = tmp_path / "ckpt"
    simulate_save(str(d), _state(3))
    return str(d)


def test_bitexact_against_unshard_and_valid_safetensors(ckpt, tmp_path):
    out = tmp_path / "all.safetensors"
    summary = shardsafe.unshard_to_safetensors(ckpt, out)
    full = Checkpointer().unshard(ckpt, no_dist=True)
    got = load_file(str(out))
    assert set(got) == set(full)
    for k, v in full.items():
        assert got[k].dtype == v.dtype and got[k].shape == v.shape, k
        assert torch.equal(bits(got[k]), bits(v)), k
    assert summary == {
        "tensors": 6,
        "bytes": sum(v.numel() * v.element_size() for v in full.values()),
        "file_bytes": os.path.getsize(out),
        "values": 0,
        "skipped_values": 0,
    }
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt"}
        assert set(f.keys()) == set(full)
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith("all")] == ["all.safetensors"]


def test_entries_are_aligned_to_their_itemsize(ckpt, tmp_path):
    out = tmp_path / "o.safetensors"
    shardsafe.unshard_to_safetensors(ckpt, out)
    raw = out.read_bytes()
    n = int.from_bytes(raw[:8], "little")
    assert (8 + n) % 8 == 0
    header = json.loads(raw[8 : 8 + n])
    size = {"F64": 8, "I64": 8, "F32": 4, "BF16": 2}
    for name, e in header.items():
        if name != "__metadata__":
            assert e["data_offsets"][0] % size[e["dtype"]] == 0, name


def test_prefix_selects_and_strips(ckpt, tmp_path):
    out = tmp_path / "model.safetensors"
    summary = shardsafe.unshard_to_safetensors(ckpt, str(out), prefix="model.")
    full = Checkpointer().unshard(ckpt, no_dist=True)
    got = load_file(str(out))
    assert sorted(got) == ["bias", "e", "empty", "scalar", "w"]
    for k, v in got.items():
        assert torch.equal(bits(v), bits(full["model." + k])), k
    assert summary["tensors"] == 5
    optim = tmp_path / "optim.safetensors"
    shardsafe.unshard_to_safetensors(ckpt, optim, prefix="optim.")
    assert torch.equal(load_file(str(optim))["exp_avg"], full["optim.exp_avg"])


def test_json_values_go_to_metadata_and_pickled_ones_are_skipped(tmp_path):
    d = str(tmp_path / "c")
    state = {"model.w": torch.ones(2, 2), "model.cfg": {"layers": 2, "act": "silu"}, "step": 5}
    Checkpointer().save(d, state)
    out = tmp_path / "m.safetensors"
    summary = shardsafe.unshard_to_safetensors(d, out, prefix="model.")
    with safe_open(str(out), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "cfg": '{"layers":2,"act":"silu"}'}
    assert (summary["values"], summary["skipped_values"]) == (1, 0)

    d2 = str(tmp_path / "p")
    Checkpointer(allow_pickle=True).save(d2, {"w": torch.ones(3), "t": 1 + 2j, "step": 3})
    out2 = tmp_path / "p.safetensors"
    summary = shardsafe.unshard_to_safetensors(d2, out2)
    with safe_open(str(out2), framework="pt") as f:
        assert f.metadata() == {"format": "pt", "step": "3"}
    assert (summary["values"], summary["skipped_values"]) == (1, 1)


def test_refuses_to_overwrite_unless_asked(ckpt, tmp_path):
    out = tmp_path / "x.safetensors"
    out.write_bytes(b"old")
    with pytest.raises(CheckpointExistsError, match=re.escape(f"{out}: file exists; pass overwrite=True to replace it")):
        shardsafe.unshard_to_safetensors(ckpt, out)
    assert out.read_bytes() == b"old"
    shardsafe.unshard_to_safetensors(ckpt, out, overwrite=True)
    assert len(load_file(str(out))) == 6


def test_unknown_prefix_is_a_missing_key(ckpt, tmp_path):
    with pytest.raises(
        MissingKeyError, match=re.escape(f"{ckpt}: no key starts with prefix 'opt.' (6 tensors and 0 values stored)")
    ):
        shardsafe.unshard_to_safetensors(ckpt, tmp_path / "o.safetensors", prefix="opt.")
    assert not (tmp_path / "o.safetensors").exists()


def test_a_key_equal_to_the_prefix_is_refused(tmp_path):
    d = str(tmp_path / "c")
    Checkpointer().save(d, {"model.": torch.ones(1), "model.w": torch.ones(1)})
    with pytest.raises(
        CheckpointError,
        match=re.escape(f"{d}: key 'model.' would become an empty name in the safetensors file; choose a different prefix"),
    ):
        shardsafe.unshard_to_safetensors(d, tmp_path / "o.safetensors", prefix="model.")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "nock").mkdir()
    with pytest.raises(IncompleteCheckpointError, match="nock: not a checkpoint: nothing is there .*a checkpoint holds metadata.json"):
        shardsafe.unshard_to_safetensors(tmp_path / "nock", tmp_path / "o.safetensors")
    assert list(tmp_path.iterdir()) == [tmp_path / "nock"]


def test_corrupt_chunk_fails_and_leaves_nothing(ckpt, tmp_path):
    meta = Checkpointer().get_metadata(ckpt, no_dist=True)
    file, spec = next(meta.tensors["model.w"].chunks())
    path = os.path.join(ckpt, file)
    with open(path, "r+b") as f:
        f.seek(spec.byte_range[0])
        b = f.read(1)
        f.seek(spec.byte_range[0])
        f.write(bytes([b[0] ^ 1]))
    with pytest.raises(CorruptCheckpointError, match=r"key 'model.w': checksum mismatch in chunk"):
        shardsafe.unshard_to_safetensors(ckpt, tmp_path / "o.safetensors")
    assert not [p for p in tmp_path.iterdir() if p.name.startswith("o.safetensors")]


def _spy_allocations(monkeypatch) -> list[int]:
    allocated: list[int] = []
    real_empty = torch.empty

    def spy_empty(*args, **kw):  # counts the buffers consolidate allocates (not the reader's scratch)
        t = real_empty(*args, **kw)
        if sys._getframe(1).f_code.co_filename == consolidate.__file__:
            allocated.append(t.numel() * t.element_size())
        return t

    monkeypatch.setattr(consolidate.torch, "empty", spy_empty)
    return allocated




_SMALL = dataclasses.replace(KNOBS, read_buffer_bytes=1 << 16, io_threads=2, write_block_bytes=1 << 16)


@pytest.mark.parametrize(
    "dims, want",
    [
        ([0, 0, 0, 0], [1 << 16] * 4 + [0]),  # row slabs: streamed through the ring of 4 blocks only
        ([1, 1, 1, 1], [1000 * 128 * 4]),  # column shards: one buffer, the largest tensor
        ([0, 1, 1, 0], [300 * 64 * 4 // 2] * 4 + [1000 * 128 * 4]),  # ring blocks no larger than a chunk
        ([1, 0, 0, 1], [1 << 16] * 4 + [300 * 64 * 4]),
    ],
    ids=["rows", "columns", "mixed-large-columns", "mixed-small-columns"],
)
def test_memory_is_a_ring_of_blocks_plus_the_largest_tensor_not_in_rows(tmp_path, monkeypatch, dims, want):
    d, full = two_rank_checkpoint(tmp_path, dims)
    allocated = _spy_allocations(monkeypatch)
    shardsafe.unshard_to_safetensors(d, tmp_path / "o.safetensors", knobs=_SMALL)
    assert allocated == want
    got = load_file(str(tmp_path / "o.safetensors"))
    for k, v in full.items():
        assert torch.equal(got[k], v), k


def test_damaged_row_chunk_is_caught_on_the_direct_path(tmp_path):
    d, _ = two_rank_checkpoint(tmp_path, [0, 0, 0, 0])
    meta = Checkpointer().get_metadata(d, no_dist=True)
    file, spec = sorted(meta.tensors["t1"].chunks(), key=lambda c: c[1].global_offset)[1]
    with open(os.path.join(d, file), "r+b") as f:
        f.seek(spec.byte_range[1] - 1)
        b = f.read(1)
        f.seek(spec.byte_range[1] - 1)
        f.write(bytes([b[0] ^ 0x80]))
    with pytest.raises(
        CorruptCheckpointError, match=rf"^key 't1': checksum mismatch in chunk {re.escape(file)}:{re.escape(spec.name)}, bytes \[0, "
    ):
        shardsafe.unshard_to_safetensors(d, tmp_path / "o.safetensors", knobs=_SMALL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["c"]


def test_flat_optimizer_ranges_take_the_direct_path(tmp_path, monkeypatch):
    m = torch.randn(64, 33)
    flat = m.reshape(-1)
    cuts = [0, 100, 1000, 1001, flat.numel()]
    ranks = [
        {"m": ShardedTensor.from_rank_offsets_flat("m", flat[a:b].clone(), (64, 33), (0, 0, 1), flattened_range=slice(a, b))}
        for a, b in zip(cuts, cuts[1:])
    ]
    d = str(tmp_path / "c")
    simulate_save(d, ranks)
    allocated = _spy_allocations(monkeypatch)
    shardsafe.unshard_to_safetensors(d, tmp_path / "o.safetensors", knobs=_SMALL)
    assert allocated[-1] == 0  # no whole-tensor buffer
    assert torch.equal(load_file(str(tmp_path / "o.safetensors"))["m"], m)


def test_empty_checkpoint_gives_a_valid_empty_file(tmp_path):
    d = str(tmp_path / "c")
    Checkpointer().save(d, {"step": 1})
    out = tmp_path / "o.safetensors"
    assert shardsafe.unshard_to_safetensors(d, out)["tensors"] == 0
    assert load_file(str(out)) == {}
