"""Format v2 checkpoints (written by the last v2 writer, kept in tests/data) still load and verify."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from safetensors.torch import load_file

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, ShardedTensor

from .test_format_spec import assert_bit_equal, read_checkpoint

DATA = os.path.join(os.path.dirname(__file__), "data")
V2 = os.path.join(DATA, "v2_checkpoint")


@pytest.fixture(scope="module")
def truth() -> dict[str, torch.Tensor]:
    return load_file(os.path.join(DATA, "v2_checkpoint_truth.safetensors"))


def test_v2_metadata_is_version_2():
    meta = Checkpointer().get_metadata(V2, no_dist=True)
    assert meta.format_version == 2 and meta.checksum is not None and sorted(meta.files) == sorted(
        f for f in os.listdir(V2) if f.endswith(".safetensors")
    )


def test_v2_unshards_bit_exact(truth):
    got = Checkpointer().unshard(V2, no_dist=True)
    assert set(got) == set(truth)
    for key, want in truth.items():
        assert_bit_equal(got[key], want, key)
    for key, want in read_checkpoint(V2).items():  # the spec reader reads v2 too
        assert_bit_equal(want, truth[key], key)


def test_v2_loads_into_another_layout(truth):
    w1 = torch.zeros(6, 2)  # columns [3, 5): a strided part of both stored row chunks
    f_part = torch.zeros(10)  # flat elements [5, 15): parts of both flattened chunks
    targets = {
        "w": ShardedTensor("w", w1, (6, 5), (0, 3), (6, 2)),
        "f": ShardedTensor("f", f_part, (2, 3, 4), (0, 0, 0), (2, 3, 4), flattened_range=slice(5, 15)),
    }
    Checkpointer().load(V2, targets, no_dist=True)
    assert_bit_equal(w1, truth["w"][:, 3:], "w")
    assert_bit_equal(f_part, truth["f"].reshape(-1)[5:15], "f")


def test_v2_verifies(truth):
    report = shardsafe.verify(V2)
    assert report.ok and report.files == 2 and report.chunks == 5
    assert report.bytes == sum(t.numel() * t.element_size() for t in truth.values())


def test_v2_partial_read_of_a_damaged_block_is_caught(tmp_path):
    path = str(tmp_path / "v2")
    shutil.copytree(V2, path)
    meta = Checkpointer().get_metadata(path, no_dist=True)
    ((file, spec),) = [(f, s) for f, s in meta.tensors["w"].chunks() if s.global_offset == (3, 0)]
    with open(os.path.join(path, file), "r+b") as fh:  # the last element of row 5
        fh.seek(spec.byte_range[1] - 1)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x01]))
    row3 = torch.zeros(1, 5)  # reads only row 3: the block holding it is checked whole
    target = {"w": ShardedTensor("w", row3, (6, 5), (3, 0), (1, 5))}
    with pytest.raises(CorruptCheckpointError, match=rf"key 'w': checksum mismatch in chunk {file}:w@3,0"):
        Checkpointer().load(path, target, no_dist=True)
