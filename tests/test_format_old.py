"""Checkpoints of earlier format versions (kept in tests/data: v1 written by shardsafe 0.1, v2 by
the last v2 writer, from the same state) still load, reshard and verify, and a damaged byte is
caught."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, ShardedTensor

from .helpers import assert_bits
from .spec_reader import read_checkpoint

DATA = os.path.join(os.path.dirname(__file__), "data")
VERSIONS = [1, 2]


def _dir(version: int) -> str:
    return os.path.join(DATA, f"v{version}_checkpoint")


@pytest.fixture(scope="module", params=VERSIONS, ids=[f"v{v}" for v in VERSIONS])
def old(request) -> tuple[int, str, dict[str, torch.Tensor]]:
    v = request.param
    return v, _dir(v), load_file(_dir(v) + "_truth.safetensors")


def test_old_metadata_keeps_its_version(old):
    version, path, _ = old
    meta = Checkpointer().get_metadata(path, no_dist=True)
    assert meta.format_version == version and meta.file_table is None
    if version == 1:
        assert meta.checksum is None and meta.files is None
    else:
        assert meta.checksum is not None and sorted(meta.files) == sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))


def test_old_checkpoint_unshards_bit_exact(old):
    _, path, truth = old
    got = Checkpointer().unshard(path, no_dist=True)
    assert set(got) == set(truth)
    for key, want in truth.items():
        assert_bits(got[key], want, key)
    for key, want in read_checkpoint(path).items():  # the spec reader reads it too
        assert_bits(want, truth[key], key)


def test_old_checkpoint_loads_into_another_layout(old):
    _, path, truth = old
    w1 = torch.zeros(6, 2)  # columns [3, 5): a strided part of both stored row chunks
    f_part = torch.zeros(10)  # flat elements [5, 15): parts of both flattened chunks
    targets = {
        "w": ShardedTensor("w", w1, (6, 5), (0, 3), (6, 2)),
        "f": ShardedTensor("f", f_part, (2, 3, 4), (0, 0, 0), (2, 3, 4), flattened_range=slice(5, 15)),
    }
    Checkpointer().load(path, targets, no_dist=True)
    assert_bits(w1, truth["w"][:, 3:], "w")
    assert_bits(f_part, truth["f"].reshape(-1)[5:15], "f")


def test_old_checkpoint_verifies(old):
    _, path, truth = old
    report = shardsafe.verify(path)
    assert report.ok and report.files == 2 and report.chunks == 5
    assert report.bytes == sum(t.numel() * t.element_size() for t in truth.values())  # b, replicated, is stored once


@pytest.mark.parametrize(
    ("version", "caught"),
    [(1, r", .*stored crc32c"), (2, r", bytes \[0, 60\) of the chunk \(block 0\): stored xxh3-64")],  # v1: the whole chunk; v2: its block
)
def test_a_partial_read_of_a_damaged_old_chunk_is_caught(tmp_path, version, caught):
    path = str(tmp_path / "old")
    shutil.copytree(_dir(version), path)
    meta = Checkpointer().get_metadata(path, no_dist=True)
    ((file, spec),) = [(f, s) for f, s in meta.tensors["w"].chunks() if s.global_offset == (3, 0)]
    with open(os.path.join(path, file), "r+b") as fh:  # the last element of row 5
        fh.seek(spec.byte_range[1] - 1)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))
    row3 = torch.zeros(1, 5)  # reads only row 3 of the damaged chunk
    target = {"w": ShardedTensor("w", row3, (6, 5), (3, 0), (1, 5))}
    with pytest.raises(CorruptCheckpointError, match=rf"key 'w': checksum mismatch in chunk {file}:w@3,0{caught}"):
        Checkpointer().load(path, target, no_dist=True)
