"""docs/format.md is enough to read a checkpoint: an independent reader, checked against saves.

``read_checkpoint`` below follows only docs/format.md. It uses json, struct, torch.frombuffer,
xxhash and crc32c, and nothing from shardsafe's format, planning or engine modules. The tests save tensors
through shardsafe's public API (in one process, or on real gloo ranks) and require the reader to
rebuild every tensor bit for bit. They also check the byte layout that the document promises,
and that the reader and shardsafe refuse the same damaged checkpoints.

The ``test_regression_*`` tests at the end pin deviations from the spec that this reader found
in early code (reserved and colliding entry names, a key stored as tensor and value, flat chunks
beside boxes, version checked after the schema); all are fixed.
"""

from __future__ import annotations

import base64
import json
import math
import os
import pickle
import re
import shutil
import struct

import crc32c
import pytest
import torch
import xxhash
from safetensors import safe_open

import shardsafe
from shardsafe import ShardedTensor

from .distributed import run_ranks
from .sealing import seal

# ---------------------------------------------------------------------------------------------
# The independent reader: docs/format.md §2, §3, §4, §5, §6, §8.

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "complex64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4,
             "uint16": 2, "uint8": 1, "bool": 1}
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$")


class SpecError(Exception):
    """The directory is not a valid checkpoint according to docs/format.md."""


def _check_chunk(c: dict, raw: bytes, meta: dict, where: str) -> None:
    """§6: v1 one CRC32C per chunk; v2 one XXH3-64 per block of checksum.block_bytes."""
    if meta["format_version"] == 1:
        if crc32c.crc32c(raw) != c["crc32c"]:
            raise SpecError(f"{where}: checksum mismatch")
        return
    bb = meta["checksum"]["block_bytes"]
    digests = base64.b64decode(c["checksums"], validate=True)
    blocks = [raw[i : i + bb] for i in range(0, len(raw), bb)]
    if len(digests) != 8 * len(blocks):
        raise SpecError(f"{where}: {len(digests) // 8} checksums for {len(blocks)} blocks")
    for i, block in enumerate(blocks):
        if xxhash.xxh3_64_intdigest(block) != int.from_bytes(digests[8 * i : 8 * i + 8], "little"):
            raise SpecError(f"{where}: checksum mismatch in block {i}")


def _load_metadata(path: str) -> dict:
    """§3.5: metadata.json, its own checksum checked (v2)."""
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        raw = fh.read()
    meta = json.loads(raw)
    if meta["format_version"] not in (1, 2):
        raise SpecError(f"format_version {meta['format_version']} is not supported")
    if meta["format_version"] == 2:
        body, sep, tail = raw.rpartition(b',"metadata_checksum":"')
        if not sep or not re.fullmatch(rb'[0-9a-f]{16}"}', tail):
            raise SpecError("metadata.json does not end with its metadata_checksum")
        if f"{xxhash.xxh3_64_intdigest(body):016x}".encode() != tail[:16]:
            raise SpecError("metadata.json: checksum mismatch")
    return meta


def read_checkpoint(path: str, *, allow_pickle: bool = False) -> dict:
    """Every tensor whole, and every object, from the checkpoint at ``path``."""
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise SpecError(f"{path}: no metadata.json, not a committed checkpoint")
    meta = _load_metadata(path)
    files: dict[str, tuple[bytes, int, dict]] = {}
    out: dict = {}
    for key, t in meta["tensors"].items():
        shape, size = tuple(t["shape"]), _ITEMSIZE[t["dtype"]]
        numel = math.prod(shape)
        full = torch.empty((numel, size), dtype=torch.uint8)  # one row of bytes per element
        seen = torch.zeros(numel, dtype=torch.bool)
        index = torch.arange(numel).reshape(shape)  # global flat index of every element
        for file, chunks in t["shard_spec_per_file"].items():
            if not _PLAIN_NAME.match(file) or ".." in file:
                raise SpecError(f"{key}: data file name {file!r} is not a plain name")
            if file not in files:
                with open(os.path.join(path, file), "rb") as fh:
                    data = fh.read()
                (n,) = struct.unpack("<Q", data[:8])
                if meta["format_version"] == 2:  # §3.1: the file's size and its header's digest
                    info = meta["files"][file]
                    if len(data) != info["size"] or f"{xxhash.xxh3_64_intdigest(data[: 8 + n]):016x}" != info["header"]:
                        raise SpecError(f"{file}: size or header checksum mismatch")
                files[file] = (data, n, json.loads(data[8 : 8 + n]))
            data, n, header = files[file]
            for c in chunks:
                off, lens = c["global_offset"], c["local_shape"]
                if len(off) != len(shape) or len(lens) != len(shape):
                    raise SpecError(f"{key}: chunk {c['name']} has the wrong rank")
                if any(o < 0 or ln < 0 or o + ln > s for o, ln, s in zip(off, lens, shape)):
                    raise SpecError(f"{key}: chunk {c['name']} lies outside the tensor")
                box = index[tuple(slice(o, o + ln) for o, ln in zip(off, lens))].reshape(-1)
                lo, hi = c.get("flattened_range") or (0, box.numel())
                if not 0 <= lo <= hi <= box.numel():
                    raise SpecError(f"{key}: chunk {c['name']} has a bad flattened_range")
                dest = box[lo:hi]
                begin, end = c["byte_range"]
                entry = [8 + n + x for x in header[c["name"]]["data_offsets"]]
                if entry != [begin, end] or end > len(data) or end - begin != dest.numel() * size:
                    raise SpecError(f"{key}: chunk {c['name']}: byte range {[begin, end]} is inconsistent")
                raw = data[begin:end]
                _check_chunk(c, raw, meta, f"{key}: chunk {c['name']} in {file}")
                if bool(seen[dest].any()):
                    raise SpecError(f"{key}: chunks overlap")
                seen[dest] = True
                full[dest] = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(-1, size)
        if not bool(seen.all()):
            raise SpecError(f"{key}: the chunks leave a gap")
        out[key] = full.reshape(-1).view(getattr(torch, t["dtype"])).reshape(shape)
    out.update(meta.get("objects", {}))
    for key, b64 in meta.get("pickled_objects", {}).items():
        if not allow_pickle:
            raise SpecError(f"{key}: stored with pickle, and pickle was not allowed")
        out[key] = pickle.loads(base64.b64decode(b64))
    return out


# ---------------------------------------------------------------------------------------------
# Helpers and the tensors to save


def assert_bit_equal(got: torch.Tensor, want: torch.Tensor, key: str) -> None:
    assert got.dtype == want.dtype, f"{key}: dtype {got.dtype} != {want.dtype}"
    assert got.shape == want.shape, f"{key}: shape {tuple(got.shape)} != {tuple(want.shape)}"
    got_bytes = got.contiguous().reshape(-1).view(torch.uint8)
    want_bytes = want.contiguous().reshape(-1).view(torch.uint8)
    assert torch.equal(got_bytes, want_bytes), f"{key}: bytes differ"


def assert_state_equal(got: dict, want: dict) -> None:
    assert set(got) == set(want)
    for key, value in want.items():
        if isinstance(value, torch.Tensor):
            assert_bit_equal(got[key], value, key)
        else:
            assert got[key] == value and type(got[key]) is type(value), key


def _metadata(path: str) -> dict:
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        return json.load(fh)


def _write_metadata(path: str, meta: dict) -> None:
    with open(os.path.join(path, "metadata.json"), "wb") as fh:
        fh.write(seal(meta))  # an edit made on purpose keeps a valid metadata_checksum


def _chunks(meta: dict, key: str) -> list[dict]:
    return [c for cs in meta["tensors"][key]["shard_spec_per_file"].values() for c in cs]


def full_tensors() -> dict[str, torch.Tensor]:
    """Global tensors that the sharded saves below split up. Every rank builds the same ones."""
    g = torch.Generator().manual_seed(1234)
    w = torch.randn(4, 6, generator=g)
    w[0, :4] = torch.tensor([-0.0, float("inf"), float("nan"), 1e-45])  # bits that == would hide
    return {
        "w": w,
        "h": torch.randn(3, 4, generator=g).to(torch.bfloat16),
        "i": torch.randint(-(2**62), 2**62, (2, 4), generator=g, dtype=torch.int64),
        "m": torch.rand(4, 2, generator=g) > 0.5,
        "rep": torch.arange(5, dtype=torch.int64) * -7,
        "scalar": torch.tensor(2.75, dtype=torch.float64),
        "flat": torch.randn(4, 6, generator=g),
        "flat3d": torch.randn(2, 3, 4, generator=g).to(torch.bfloat16),
        "grid": torch.arange(24, dtype=torch.int32).reshape(4, 6),
    }


# ---------------------------------------------------------------------------------------------
# Functions that run on every rank (module level, so the rank processes can import them)


def _save_sharded(rank: int, ws: int, path: str) -> None:
    """Two ranks: boxes split along dim 0 or dim 1, plus replicas and a non-tensor value."""
    f = full_tensors()
    shardsafe.Checkpointer().save(path, {
        "w": ShardedTensor.from_rank_offsets("w", f["w"].chunk(ws, 0)[rank].clone(), (0, rank, ws)),
        "h": ShardedTensor.from_rank_offsets("h", f["h"].chunk(ws, 1)[rank].clone(), (1, rank, ws)),
        "i": ShardedTensor.from_rank_offsets("i", f["i"].chunk(ws, 1)[rank].clone(), (1, rank, ws)),
        "m": ShardedTensor.from_rank_offsets("m", f["m"].chunk(ws, 0)[rank].clone(), (0, rank, ws)),
        "rep": f["rep"].clone(),
        "scalar": f["scalar"].clone(),
        "step": 42,
    })


_FLAT3D_CUTS = (0, 7, 13, 22, 24)  # ranges of a (2, 3, 4) box that start and stop mid-row


def _save_flat(rank: int, ws: int, path: str) -> None:
    """Four ranks: flattened ranges of sub-boxes and of a whole box, and a 2x2 grid of boxes."""
    f = full_tensors()
    row, half = divmod(rank, 2)
    box = f["flat"].chunk(2, 0)[row]  # box of shape (2, 6): rank 2*row holds [0, 5), rank 2*row+1 holds [5, 12)
    lo, hi = (0, 5) if half == 0 else (5, 12)
    a, b = _FLAT3D_CUTS[rank], _FLAT3D_CUTS[rank + 1]
    grid = f["grid"].chunk(2, 0)[row].chunk(2, 1)[half].clone()
    shardsafe.Checkpointer().save(path, {
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", box.reshape(-1)[lo:hi].clone(), (2, 6), (0, row, 2), flattened_range=slice(lo, hi)
        ),
        "flat3d": ShardedTensor.from_rank_offsets_flat(
            "flat3d", f["flat3d"].reshape(-1)[a:b].clone(), (2, 3, 4), flattened_range=slice(a, b)
        ),
        "grid": ShardedTensor.from_rank_offsets("grid", grid, (0, row, 2), (1, half, 2)),
    })


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("sharded") / "ckpt")
    run_ranks(2, _save_sharded, path)
    return path


@pytest.fixture(scope="module")
def flat_ckpt(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("flat") / "ckpt")
    run_ranks(4, _save_flat, path)
    return path


def _copy(src: str, tmp_path) -> str:
    dst = str(tmp_path / "copy")
    shutil.copytree(src, dst)
    return dst


# ---------------------------------------------------------------------------------------------
# The reader rebuilds what shardsafe saved


def _both_refuse(path, spec_match, error, match=None, *, read="get_metadata"):
    """The independent reader refuses ``path`` (``spec_match``), and so does shardsafe (``error``)."""
    with pytest.raises(SpecError, match=spec_match):
        read_checkpoint(path)
    with pytest.raises(error, match=match):
        getattr(shardsafe.Checkpointer(), read)(path, no_dist=True)


def test_reader_single_process_every_dtype_0d_and_empty(tmp_path):
    f = full_tensors()
    state = {
        "f32": f["w"],
        "bf16": f["h"],
        "i64": f["i"],
        "bool": f["m"],
        "scalar": f["scalar"],
        "scalar_i8": torch.tensor(-3, dtype=torch.int8),
        "empty": torch.empty(0, 3),
        "f16": torch.tensor([1.0, -65504.0, 6e-8], dtype=torch.float16),
        "f8a": torch.tensor([0.5, -448.0, 3.0]).to(torch.float8_e4m3fn),
        "f8b": torch.tensor([0.5, -57344.0, 3.0]).to(torch.float8_e5m2),
        "c64": torch.tensor([1 + 2j, -0.5j]),
        "i32": torch.tensor([[-(2**31), 2**31 - 1]], dtype=torch.int32),
        "i16": torch.tensor([-(2**15), 7], dtype=torch.int16),
        "u8": torch.tensor([0, 255], dtype=torch.uint8),
        "u16": torch.tensor([0, 65535], dtype=torch.uint16),
        "u32": torch.tensor([0, 2**32 - 1], dtype=torch.uint32),
        "u64": torch.tensor([0, 2**63 + 5], dtype=torch.uint64),
        "step": 7,
        "config": {"lr": 0.5, "betas": [0.9, 0.95], "name": "adamw", "warm": None},
    }
    path = str(tmp_path / "ckpt")
    shardsafe.Checkpointer().save(path, state)

    assert_state_equal(read_checkpoint(path), state)
    meta = _metadata(path)
    assert meta["tensors"]["empty"] == {"shape": [0, 3], "dtype": "float32", "is_sharded": True, "shard_spec_per_file": {}}
    (scalar,) = _chunks(meta, "scalar")
    assert (scalar["global_offset"], scalar["local_shape"], scalar["name"]) == ([], [], "scalar")


def test_reader_two_ranks_sharded_boxes_and_replicas(sharded_ckpt):
    f = full_tensors()
    want = {k: f[k] for k in ("w", "h", "i", "m", "rep", "scalar")} | {"step": 42}
    assert_state_equal(read_checkpoint(sharded_ckpt), want)

    meta = _metadata(sharded_ckpt)
    files = sorted(n for n in os.listdir(sharded_ckpt) if n.endswith(".safetensors"))
    assert len(files) == 2 and all(re.fullmatch(r"shard-r0000[01]-[0-9a-f]{12}\.safetensors", n) for n in files)
    for key in ("w", "h", "i", "m"):
        assert len(_chunks(meta, key)) == 2 and meta["tensors"][key]["is_sharded"], key
    for key in ("rep", "scalar"):  # replicas are stored once
        assert len(_chunks(meta, key)) == 1 and not meta["tensors"][key]["is_sharded"], key
    assert {c["name"] for c in _chunks(meta, "h")} == {"h@0,0", "h@0,2"}


def test_reader_flattened_range_chunks(flat_ckpt):
    f = full_tensors()
    assert_state_equal(read_checkpoint(flat_ckpt), {k: f[k] for k in ("flat", "flat3d", "grid")})

    meta = _metadata(flat_ckpt)
    flat = sorted((c["global_offset"], c["flattened_range"], c["name"]) for c in _chunks(meta, "flat"))
    assert flat == [
        ([0, 0], [0, 5], "flat@0,0+0"), ([0, 0], [5, 12], "flat@0,0+5"),
        ([2, 0], [0, 5], "flat@2,0+0"), ([2, 0], [5, 12], "flat@2,0+5"),
    ]
    assert sorted(c["flattened_range"] for c in _chunks(meta, "flat3d")) == [[0, 7], [7, 13], [13, 22], [22, 24]]
    assert sorted(c["global_offset"] for c in _chunks(meta, "grid")) == [[0, 0], [0, 3], [2, 0], [2, 3]]
    assert len(os.listdir(flat_ckpt)) == 5  # metadata.json and one data file per rank


def test_reader_agrees_with_shardsafe_unshard(flat_ckpt, sharded_ckpt):
    for path in (flat_ckpt, sharded_ckpt):
        assert_state_equal(read_checkpoint(path), shardsafe.Checkpointer().unshard(path, no_dist=True))


def test_reader_pickled_objects_only_with_opt_in(tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"t": torch.ones(2), "rng": (1, 2, 3)}  # a tuple is not a JSON value
    shardsafe.Checkpointer(allow_pickle=True).save(path, state)
    assert set(_metadata(path)["pickled_objects"]) == {"rng"}
    with pytest.raises(SpecError, match="pickle"):
        read_checkpoint(path)
    assert_state_equal(read_checkpoint(path, allow_pickle=True), state)


# ---------------------------------------------------------------------------------------------
# The byte layout promised by docs/format.md §4 and §6


def test_data_files_are_the_documented_safetensors_layout(flat_ckpt, sharded_ckpt):
    for path in (flat_ckpt, sharded_ckpt):
        meta = _metadata(path)
        chunks_by_file: dict[str, dict[str, dict]] = {}
        for t in meta["tensors"].values():
            for file, cs in t["shard_spec_per_file"].items():
                chunks_by_file.setdefault(file, {}).update((c["name"], c) for c in cs)
        for file, chunks in chunks_by_file.items():
            with open(os.path.join(path, file), "rb") as fh:
                data = fh.read()
            (n,) = struct.unpack("<Q", data[:8])
            assert (8 + n) % 8 == 0
            text = data[8 : 8 + n].decode("ascii")
            assert text.startswith("{") and set(text[len(text.rstrip(" ")) :]) <= {" "}
            assert len(text) - len(text.rstrip(" ")) < 8
            header = json.loads(text)
            assert header.pop("__metadata__") == {"format": "pt", "shardsafe_format_version": "2"}
            assert meta["files"][file] == {"size": len(data), "header": f"{xxhash.xxh3_64_intdigest(data[: 8 + n]):016x}"}
            assert set(header) == set(chunks)
            pos = 0  # entries back to back, in header order, to the end of the file
            for name, entry in header.items():
                assert entry["data_offsets"][0] == pos
                pos = entry["data_offsets"][1]
                c = chunks[name]
                assert [8 + n + x for x in entry["data_offsets"]] == c["byte_range"]
                fr = c["flattened_range"]
                assert entry["shape"] == (c["local_shape"] if fr is None else [fr[1] - fr[0]])
                _check_chunk(c, data[slice(*c["byte_range"])], meta, name)
            assert 8 + n + pos == len(data)
            with safe_open(os.path.join(path, file), "pt") as st:  # any safetensors reader opens it
                assert set(st.keys()) == set(chunks)
                for name, c in chunks.items():
                    raw = data[slice(*c["byte_range"])]
                    got = st.get_tensor(name)
                    assert bytes(got.contiguous().reshape(-1).view(torch.uint8).numpy()) == raw, name


def test_crc32c_is_castagnoli():  # format v1's checksum
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    assert crc32c.crc32c(b"") == 0


def test_xxh3_64_is_the_documented_digest():  # format v2's: XXH3-64, seed 0
    assert xxhash.xxh3_64_intdigest(b"") == 0x2D06800538D394C2
    assert xxhash.xxh3_64_intdigest(bytes.fromhex("c03f00c0")) == 0xDDE8B3E1D8D0442D  # docs/format.md §10.2


# ---------------------------------------------------------------------------------------------
# What a reader must refuse (§8), refused by the spec reader and by shardsafe alike


def test_refuses_directory_without_metadata(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    os.remove(os.path.join(path, "metadata.json"))
    _both_refuse(path, "no metadata.json", shardsafe.IncompleteCheckpointError, read="unshard")


@pytest.mark.parametrize("bad", ["../outside.safetensors", "sub/x.safetensors", "/abs.safetensors", ".hidden.safetensors", "x.bin"])
def test_refuses_data_file_names_that_are_not_plain(sharded_ckpt, tmp_path, bad):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    spf = meta["tensors"]["w"]["shard_spec_per_file"]
    first = sorted(spf)[0]
    spf[bad] = spf.pop(first)
    _write_metadata(path, meta)
    _both_refuse(path, "is not a plain name", shardsafe.CorruptCheckpointError, "is not a plain file name")


def test_refuses_chunks_that_do_not_tile(flat_ckpt, tmp_path):
    path = _copy(flat_ckpt, tmp_path)
    meta = _metadata(path)
    spf = meta["tensors"]["flat3d"]["shard_spec_per_file"]
    del spf[sorted(spf)[1]]  # drop one flattened range: a gap
    _write_metadata(path, meta)
    _both_refuse(path, "leave a gap", shardsafe.CorruptCheckpointError, "a gap: some part")

    meta = _metadata(flat_ckpt)
    spf = meta["tensors"]["flat3d"]["shard_spec_per_file"]
    chunk = spf[sorted(spf)[1]][0]
    chunk["flattened_range"] = [6, 12]  # same byte count, now overlapping [0, 7)
    _write_metadata(path, meta)
    _both_refuse(path, "chunks overlap", shardsafe.CorruptCheckpointError, r"flattened ranges .* overlap")


def test_refuses_corrupt_chunk_bytes(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    (file, (chunk,)), *_ = meta["tensors"]["w"]["shard_spec_per_file"].items()
    with open(os.path.join(path, file), "r+b") as fh:
        fh.seek(chunk["byte_range"][0] + 5)
        byte = fh.read(1)
        fh.seek(-1, os.SEEK_CUR)
        fh.write(bytes([byte[0] ^ 0x10]))
    _both_refuse(path, "checksum mismatch", shardsafe.CorruptCheckpointError, "checksum mismatch", read="unshard")


def test_refuses_newer_format_version(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    meta["format_version"] = 3
    _write_metadata(path, meta)
    _both_refuse(path, "format_version 3 is not supported", shardsafe.CorruptCheckpointError, "is newer than this shardsafe reads")


def test_refuses_edited_metadata(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        raw = fh.read()
    with open(os.path.join(path, "metadata.json"), "wb") as fh:  # rename a key, leave the checksum
        fh.write(raw.replace(b'"w":{"shape"', b'"v":{"shape"'))
    _both_refuse(path, "metadata.json: checksum mismatch", shardsafe.CorruptCheckpointError, "checksum mismatch: metadata_checksum says")


def test_refuses_edited_header(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    file = sorted(_metadata(path)["files"])[0]
    with open(os.path.join(path, file), "r+b") as fh:  # a padding space becomes a tab: JSON stays valid
        (n,) = struct.unpack("<Q", fh.read(8))
        fh.seek(8 + n - 1)
        assert fh.read(1) in (b" ", b"}")
        fh.seek(8 + n - 1)
        fh.write(b"\t" if n else b" ")
    with pytest.raises(SpecError, match="header checksum mismatch"):
        read_checkpoint(path)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="header checksum mismatch"):
        shardsafe.verify(path)


# ---------------------------------------------------------------------------------------------
# Commit protocol (§7): overwrite replaces the checkpoint whole, and old files go


def test_overwrite_commits_new_files_and_removes_old_ones(tmp_path):
    path = str(tmp_path / "ckpt")
    ck = shardsafe.Checkpointer()
    ck.save(path, {"w": torch.arange(4.0)})
    old_files = {n for n in os.listdir(path) if n.endswith(".safetensors")}
    with open(os.path.join(path, "notes.txt"), "w") as fh:
        fh.write("not ours")
    with pytest.raises(shardsafe.CheckpointExistsError):
        ck.save(path, {"w": torch.zeros(4)})
    assert_state_equal(read_checkpoint(path), {"w": torch.arange(4.0)})

    ck.save(path, {"w": torch.full((4,), 9.0)}, save_overwrite=True)
    new_files = {n for n in os.listdir(path) if n.endswith(".safetensors")}
    assert not new_files & old_files and len(new_files) == 1
    assert set(os.listdir(path)) == new_files | {"metadata.json", "notes.txt"}
    assert_state_equal(read_checkpoint(path), {"w": torch.full((4,), 9.0)})


# ---------------------------------------------------------------------------------------------
# Known deviations of shardsafe 0.1 from the spec (docs/format.md §11)


def _save_name_collision(rank: int, ws: int, path: str) -> None:
    a = torch.arange(4.0)
    state = {"a": ShardedTensor.from_rank_offsets("a", a.chunk(ws)[rank].clone(), (0, rank, ws))}
    if rank == 0:
        state["a@0"] = torch.tensor([10.0, 20.0, 30.0])  # its entry name equals that of a's chunk at [0]
    shardsafe.Checkpointer().save(path, state)


def _save_tensor_and_object(rank: int, ws: int, path: str) -> None:
    shardsafe.Checkpointer().save(path, {"x": torch.ones(2)} if rank == 0 else {"x": 5})


def _save_flat_beside_box(rank: int, ws: int, path: str) -> None:
    t = torch.arange(4.0)
    if rank == 0:  # elements 0, 1 as a flattened range of the box [0, 4)
        st = ShardedTensor("t", t[:2].clone(), (4,), (0,), (4,), flattened_range=slice(0, 2))
    else:  # elements 2, 3 as the box [2, 4)
        st = ShardedTensor("t", t[2:].clone(), (4,), (2,), (2,))
    shardsafe.Checkpointer().save(path, {"t": st})


def _assert_safe_open_reads_every_file(path: str) -> None:
    for name in os.listdir(path):
        if name.endswith(".safetensors"):
            with safe_open(os.path.join(path, name), "pt") as st:
                for key in st.keys():
                    st.get_tensor(key)


def test_regression_key_named_metadata_gives_valid_safetensors(tmp_path):
    path = str(tmp_path / "ckpt")
    shardsafe.Checkpointer().save(path, {"__metadata__": torch.arange(3.0), "x": torch.ones(2)})
    _assert_safe_open_reads_every_file(path)


def test_regression_entry_names_unique_in_a_file(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_name_collision, path)
    assert_state_equal(read_checkpoint(path), {"a": torch.arange(4.0), "a@0": torch.tensor([10.0, 20.0, 30.0])})
    _assert_safe_open_reads_every_file(path)


def test_regression_key_both_tensor_and_object_is_refused(tmp_path):
    with pytest.raises(shardsafe.CheckpointError, match="key 'x' is a tensor on rank 0 and a non-tensor value on rank 1"):
        run_ranks(2, _save_tensor_and_object, str(tmp_path / "ckpt"))


def test_regression_flat_chunk_beside_intersecting_box(tmp_path):
    path = str(tmp_path / "ckpt")
    run_ranks(2, _save_flat_beside_box, path)
    assert_state_equal(read_checkpoint(path), {"t": torch.arange(4.0)})


def test_regression_newer_version_with_new_field_says_upgrade(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    meta["format_version"] = 3
    meta["new_field"] = {}
    _write_metadata(path, meta)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="is newer than this shardsafe reads"):
        shardsafe.Checkpointer().get_metadata(path, no_dist=True)
