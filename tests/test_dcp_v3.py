"""``dcp.save`` through ``shardsafe.dcp.StorageWriter`` writes format v3, as every shardsafe save does.

Two real gloo ranks save DTensors (uneven rows, uneven columns), replicated plain tensors (DCP
writes each once), a 0-d and an empty tensor, keys ``a@b`` and ``__metadata__`` and values, with
64-byte checksum blocks so that chunks span several blocks. The checkpoint is then read by the
independent reader of ``tests/test_format_spec.py`` (written from docs/format.md alone), loaded
bit for bit by ``Checkpointer.load`` on 1 and 2 ranks in another layout, and damaged.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import struct

import pytest
import torch
from torch.distributed.checkpoint.api import CheckpointException

import shardsafe
import shardsafe.dcp
from shardsafe import Checkpointer, CorruptCheckpointError, DtypeMismatchError
from shardsafe.knobs import Knobs

from .helpers import assert_bits, built_once, dcp_failure, flip_byte, run_ranks
from .spec_reader import SpecError, read_checkpoint

pytestmark = pytest.mark.filterwarnings("ignore:torch.distributed is (disabled|unavailable):UserWarning")

_SMALL_BLOCKS = dataclasses.replace(Knobs.from_env(), checksum_block_bytes=64)


def _full() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(31)
    return {
        "rows": torch.randn(7, 10, generator=g),  # Shard(0) on 2 ranks: rows 0-3 and 4-6 (160 and 120 bytes)
        "cols": torch.randn(6, 9, generator=g).to(torch.bfloat16),  # Shard(1): columns 0-4 and 5-8
        "rep": torch.randn(5, 3, generator=g).double(),  # plain, on both ranks: written once
        "a@b": torch.randint(-1000, 1000, (4,), generator=g, dtype=torch.int32),  # Shard(0)
        "__metadata__": torch.randn(2, generator=g).half(),  # plain
        "s": torch.tensor(-3, dtype=torch.int64),  # 0-d
        "empty": torch.zeros(0, 3),
    }


_SAVED_AS = {"rows": 0, "cols": 1, "a@b": 0}  # the dimension each DTensor is sharded on when saved
_LOADED_AS = {"rows": 1, "cols": 0, "rep": 0, "__metadata__": 0}  # and when loaded on 2 ranks


def _dtensors(placed: dict[str, int], ws: int) -> dict[str, torch.Tensor]:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    mesh = init_device_mesh("cpu", (ws,))
    full = _full()
    return {k: distribute_tensor(full[k], mesh, [Shard(d)]) for k, d in placed.items()}


def _dcp_save(rank, ws, path):
    import torch.distributed.checkpoint as dcp

    state = {**_full(), **_dtensors(_SAVED_AS, ws), "step": 11, "cfg": {"name": "run", "betas": (0.9, 0.99)}}
    dcp.save(state, storage_writer=shardsafe.dcp.StorageWriter(path, knobs=_SMALL_BLOCKS))


@pytest.fixture(scope="module")
def dcp_ckpt(tmp_path_factory) -> str:
    """Built once per test run for every xdist worker (this module's tests spread over both): read it, never change it."""
    return built_once(tmp_path_factory, "dcp-v3/ckpt", lambda path: run_ranks(2, _dcp_save, path))


def _metadata(path: str) -> dict:
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        return json.load(fh)


def _header(path: str, name: str) -> tuple[int, dict]:
    with open(os.path.join(path, name), "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        return 8 + n, json.loads(fh.read(n))


def test_dcp_save_writes_format_v3_that_the_spec_reader_reads(dcp_ckpt):
    meta = _metadata(dcp_ckpt)
    assert list(meta) == ["format_version", "checksum", "file_table", "tensors", "objects", "pickled_objects", "metadata_checksum"]
    assert meta["format_version"] == 3 and meta["checksum"] == {"algorithm": "xxh3-64", "block_bytes": 64}
    table = meta["file_table"]
    assert [f["name"][:13] for f in table] == ["shard-r00000-", "shard-r00001-"]
    for f in table:  # §3.3: size, header length and digests match the file
        assert set(f) == {"name", "size", "header_bytes", "header", "sums"}
        header_bytes, header = _header(dcp_ckpt, f["name"])
        assert f["size"] == os.path.getsize(os.path.join(dcp_ckpt, f["name"])) and f["header_bytes"] == header_bytes
        assert header["__metadata__"] == {"format": "pt", "shardsafe_format_version": "3"}  # §4.2
        last = max(header.items(), key=lambda kv: kv[1]["data_offsets"][0] if kv[0] != "__metadata__" else -1)
        assert last[0] == "__shardsafe_checksums__" and header_bytes + last[1]["data_offsets"][1] == f["size"]
    for key, t in meta["tensors"].items():
        assert set(t) == {"shape", "dtype", "is_sharded", "table"}, key
    # §3.4: rank r's row chunk is in file r, runs coded greedily
    assert meta["tensors"]["rows"] == {
        "shape": [7, 10], "dtype": "float32", "is_sharded": True,
        "table": {"count": 2, "file": [[0, 1, 2]], "offset": [[[0, 4, 2]], [[0, 0, 2]]], "length": [[[4, -1, 2]], [[10, 0, 2]]]},
    }
    assert meta["tensors"]["rep"]["is_sharded"] is False and meta["tensors"]["rep"]["table"]["count"] == 1
    assert meta["tensors"]["empty"]["table"] == {"count": 0, "file": [], "offset": [[], []], "length": [[], []]}
    assert meta["tensors"]["s"]["table"]["offset"] == [] and meta["tensors"]["s"]["table"]["count"] == 1
    names = {n for f in table for n in _header(dcp_ckpt, f["name"])[1]}
    assert {"rows@0,0", "rows@4,0", "cols@0,0", "cols@0,5", "a@b@0", "a@b@2", "__metadata__@0", "rep", "s"} <= names  # §4.4

    got = read_checkpoint(dcp_ckpt)  # every digest checked: metadata, headers, checksum entries, blocks
    for key, want in _full().items():
        assert_bits(got[key], want, key)
    assert got["step"] == 11 and got["cfg.name"] == "run"
    assert got["cfg.betas"] == {"__shardsafe__": "tuple", "items": [0.9, 0.99]}  # tagged JSON (§13)
    ours = Checkpointer().unshard(dcp_ckpt)
    for key, want in _full().items():
        assert_bits(ours[key], want, key)
    assert ours["cfg.betas"] == (0.9, 0.99) and ours["step"] == 11
    assert not shardsafe.verify(dcp_ckpt).errors


def _checkpointer_load(rank, ws, path, out):
    target = {k: torch.full_like(v, 7) for k, v in _full().items()}
    if ws > 1:  # another layout than the save's: rows by columns, columns by rows, plain tensors sharded
        target.update({k: torch.full_like(v, 7) for k, v in _dtensors(_LOADED_AS, ws).items()})
    target.update({"step": 0, "cfg": {"name": "", "betas": None}})
    Checkpointer().load(path, target)
    got = {k: v.full_tensor() if hasattr(v, "full_tensor") else v for k, v in target.items()}  # full_tensor: a collective
    if rank == 0:
        torch.save(got, out)  # tensors do not travel back through run_ranks' queue
    return got["step"], got["cfg"]


@pytest.mark.parametrize("ws", [1, 2])
def test_checkpointer_loads_a_dcp_save_bit_exact_resharded(dcp_ckpt, tmp_path, ws):
    out = str(tmp_path / "got.pt")
    assert run_ranks(ws, _checkpointer_load, dcp_ckpt, out) == [(11, {"name": "run", "betas": (0.9, 0.99)})] * ws
    got = torch.load(out)
    for key, want in _full().items():
        assert_bits(got[key], want, key)


def test_damaged_dcp_save_is_refused_on_load(dcp_ckpt, tmp_path):
    def damaged(name_of_entry: str, offset: int) -> str:  # in the file rank 1 wrote, which holds rows@4,0
        path = str(tmp_path / f"{name_of_entry}-{offset}")
        shutil.copytree(dcp_ckpt, path)
        (file,) = [f for f in _metadata(path)["file_table"] if "rows@4,0" in _header(path, f["name"])[1]]
        header_bytes, header = _header(path, file["name"])
        flip_byte(path, file["name"], mask=0x10, pos=header_bytes + header[name_of_entry]["data_offsets"][0] + offset)
        return path

    def load(path: str) -> None:
        Checkpointer().load(path, {"rows": torch.zeros(7, 10)}, no_dist=True)

    path = damaged("rows@4,0", 64 + 5)  # rank 1's row chunk, its second block of 64 bytes
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in chunk .*rows@4,0, bytes \[64, 120\) of the chunk \(block 1\)"):
        load(path)
    with pytest.raises(SpecError, match="rows@4,0 in .*: checksum mismatch in block 1"):
        read_checkpoint(path)

    path = damaged("__shardsafe_checksums__", 9)  # §6: the block digests themselves, vouched for by file_table's sums
    with pytest.raises(CorruptCheckpointError, match="checksum mismatch in '__shardsafe_checksums__'"):
        load(path)
    with pytest.raises(SpecError, match="checksum entry checksum mismatch"):
        read_checkpoint(path)


def test_dtype_safetensors_cannot_hold_is_refused_before_any_write(tmp_path):
    import torch.distributed.checkpoint as dcp

    path = tmp_path / "ckpt"
    with pytest.raises(CheckpointException) as info:  # DCP wraps each rank's error
        dcp.save({"z": torch.ones(3, dtype=torch.complex128), "w": torch.ones(2)},
                 storage_writer=shardsafe.dcp.StorageWriter(str(path)), no_dist=True)
    cause = dcp_failure(info.value)
    assert isinstance(cause, DtypeMismatchError) and "'z'" in str(cause) and "complex128" in str(cause)
    assert not path.exists() or os.listdir(path) == []
