"""docs/format.md is enough to read a checkpoint: an independent reader, checked against saves.

``read_checkpoint`` below follows only docs/format.md (formats 3, 2 and 1). It uses json, struct,
torch.frombuffer, xxhash and crc32c, and nothing from shardsafe's format, planning or engine
modules. It checks every digest the document defines: metadata_checksum, each data file's header
and checksum entry against the file table, every block of every chunk against the checksum entry.
The tests save tensors through shardsafe's public API (in one process, on real gloo ranks, or on
simulated ranks with ``tests/simulate.py``) and require the reader to rebuild every tensor bit for
bit, as ``Checkpointer().unshard`` does. They also check the byte layout that the document
promises, and that the reader and shardsafe refuse the same damaged checkpoints.

The ``test_regression_*`` tests pin deviations from the spec that this reader found in early code
(reserved and colliding entry names, a key stored as tensor and value, flat chunks beside boxes,
version checked after the schema); all are fixed.
"""

from __future__ import annotations

import base64
import collections
import dataclasses
import itertools
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
from shardsafe.knobs import Knobs

from .distributed import run_ranks
from .sealing import seal
from .simulate import simulate_save

# ---------------------------------------------------------------------------------------------
# The independent reader: docs/format.md §2, §3, §4, §5, §6, §8, §9.

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1,
             "complex64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4,
             "uint16": 2, "uint8": 1, "bool": 1}
_CODE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
         "float8_e5m2": "F8_E5M2", "complex64": "C64", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
         "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$")
_SUMS = "__shardsafe_checksums__"  # §4.2: the last entry of every v3 data file
_LIMIT = 2**62
_MIN_ENTRY = 26  # §8 bounds: the shortest header entry, '"a":{"data_offsets":[0,0]}'
_CHECKED_ONE_BY_ONE = 2**16  # §8 bounds: chunks of tables that do not tile box by box, per document


class SpecError(Exception):
    """The directory is not a valid checkpoint according to docs/format.md."""


def _digest(data: bytes) -> str:
    """§6: XXH3-64 (seed 0) as 16 lowercase hex digits."""
    return f"{xxhash.xxh3_64_intdigest(data):016x}"


def _check_chunk(c: dict, raw: bytes, meta: dict, where: str) -> None:
    """§9.2, §9.3: v1 one CRC32C per chunk; v2 one XXH3-64 per block of checksum.block_bytes."""
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
    """§3.5: metadata.json, its own checksum checked (v2, v3) before any other field is used."""
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        raw = fh.read()
    try:
        meta = json.loads(raw)
    except ValueError as e:
        raise SpecError(f"metadata.json: not JSON: {e}") from None
    if meta["format_version"] not in (1, 2, 3):
        raise SpecError(f"format_version {meta['format_version']} is not supported")
    if meta["format_version"] >= 2:
        body, sep, tail = raw.rpartition(b',"metadata_checksum":"')
        if not sep or not re.fullmatch(rb'[0-9a-f]{16}"}', tail):
            raise SpecError("metadata.json does not end with its metadata_checksum")
        if _digest(body).encode() != tail[:16]:
            raise SpecError("metadata.json: checksum mismatch")
    return meta


def decode_runs(runs: list, n: int, what: str) -> list[int]:
    """§3.4: the ``n`` values of a column coded as runs ``[first, step, count]``."""
    out: list[int] = []
    if not isinstance(runs, list):
        raise SpecError(f"{what}: not a list of runs")
    for run in runs:
        if not (isinstance(run, list) and len(run) == 3 and all(type(x) is int for x in run)):
            raise SpecError(f"{what}: {run!r} is not a run [first, step, count]")
        first, step, count = run
        if count < 1 or len(out) + count > n or abs(step) >= _LIMIT:
            raise SpecError(f"{what}: run {run} has a bad count or step")
        if not (0 <= first < _LIMIT and 0 <= first + step * (count - 1) < _LIMIT):
            raise SpecError(f"{what}: run {run} leaves [0, 2**62)")
        out.extend(first + step * k for k in range(count))
    if len(out) != n:
        raise SpecError(f"{what}: the runs hold {len(out)} values, count is {n}")
    return out


def table_chunks(t: dict, nfiles: int, key: str) -> list[tuple[int, list[int], list[int], tuple[int, int] | None]]:
    """§3.4: a v3 chunk table as ``(file index, offsets, lengths, flattened range or None)`` per
    chunk; a flattened range that covers its whole box is the box (None)."""
    table, ndim = t["table"], len(t["shape"])
    if set(table) - {"flat"} != {"count", "file", "offset", "length"}:
        raise SpecError(f"{key}: the chunk table has members {sorted(table)}")
    n = table["count"]
    if type(n) is not int or not 0 <= n < _LIMIT:
        raise SpecError(f"{key}: bad chunk count {n!r}")
    if len(table["offset"]) != ndim or len(table["length"]) != ndim:
        raise SpecError(f"{key}: the table needs one offset and one length column per dimension")
    files = decode_runs(table["file"], n, f"{key}: file")
    offs = [decode_runs(table["offset"][d], n, f"{key}: offset[{d}]") for d in range(ndim)]
    lens = [decode_runs(table["length"][d], n, f"{key}: length[{d}]") for d in range(ndim)]
    flat = [decode_runs(col, n, f"{key}: flat") for col in table["flat"]] if "flat" in table else None
    if flat is not None and len(flat) != 2:
        raise SpecError(f"{key}: flat must be two columns")
    out = []
    for i in range(n):
        off, ln = [offs[d][i] for d in range(ndim)], [lens[d][i] for d in range(ndim)]
        if files[i] >= nfiles:
            raise SpecError(f"{key}: chunk {i} names data file {files[i]}, the file table has {nfiles}")
        if any(x < 1 or o + x > s for o, x, s in zip(off, ln, t["shape"])):
            raise SpecError(f"{key}: chunk {i} lies outside the tensor or is empty")
        rng = None
        if flat is not None:
            lo, hi = flat[0][i], flat[1][i]
            if not lo < hi <= math.prod(ln):
                raise SpecError(f"{key}: chunk {i} has a bad flattened range [{lo}, {hi})")
            rng = None if (lo, hi) == (0, math.prod(ln)) else (lo, hi)
        out.append((files[i], off, ln, rng))
    return out


def entry_name(key: str, shape: list[int], off: list[int], lens: list[int], flat: tuple[int, int] | None) -> str:
    """§4.4: the name of a chunk's entry in its data file."""
    if flat is None and lens == list(shape) and not any(off) and "@" not in key and key not in ("__metadata__", _SUMS):
        return key
    name = f"{key}@{','.join(map(str, off))}"
    return name if flat is None else f"{name}+{flat[0]}"


def _read_v3_file(path: str, info: dict, block_bytes: int) -> tuple[bytes, dict[str, tuple]]:
    """§4, §6, §8 step 3: a v3 data file whose header and checksum entry match ``info`` (its
    file_table row). Returns its bytes and ``entry name -> (begin, end, first block, dtype, shape)``."""
    name = info["name"]
    with open(os.path.join(path, name), "rb") as fh:
        data = fh.read()
    if len(data) != info["size"]:
        raise SpecError(f"{name}: {len(data)} bytes, the file table says {info['size']}")
    hb = info["header_bytes"]
    if _digest(data[:hb]) != info["header"]:
        raise SpecError(f"{name}: header checksum mismatch")
    (n,) = struct.unpack("<Q", data[:8])
    if 8 + n != hb:
        raise SpecError(f"{name}: the header is {8 + n} bytes, the file table says {hb}")
    try:
        header = json.loads(data[8:hb])
    except ValueError as e:
        raise SpecError(f"{name}: the header is not JSON: {e}") from None
    spans = sorted((e["data_offsets"][0] + hb, e["data_offsets"][1] + hb, k, e["dtype"], e["shape"])
                   for k, e in header.items() if k != "__metadata__")
    pos = hb
    for begin, end, entry, _, _ in spans:
        if begin != pos or end < begin:
            raise SpecError(f"{name}: entry {entry!r} is not right after the one before")
        pos = end
    if pos != len(data) or not spans or spans[-1][2] != _SUMS:
        raise SpecError(f"{name}: the entries do not end with {_SUMS!r} at the end of the file")
    entries, blocks = {}, 0
    for begin, end, entry, dtype, shape in spans[:-1]:
        entries[entry] = (begin, end, blocks, dtype, shape)
        blocks += -(-(end - begin) // block_bytes)
    s_begin, s_end, _, s_dtype, s_shape = spans[-1]
    if (s_dtype, s_shape, s_end - s_begin) != ("U8", [8 * blocks], 8 * blocks):
        raise SpecError(f"{name}: {_SUMS!r} must hold 8 bytes for each of {blocks} blocks")
    if _digest(data[s_begin:s_end]) != info["sums"]:
        raise SpecError(f"{name}: checksum entry checksum mismatch")
    sums = struct.unpack(f"<{blocks}Q", data[s_begin:s_end])
    return data, {k: v + (sums,) for k, v in entries.items()}


def _v3_chunks(path: str, meta: dict, key: str, t: dict, files: dict) -> list[tuple[dict, bytes, str]]:
    """Every chunk of v3 tensor ``key``, as a v2-like dict, its checked bytes and where it is."""
    table = meta["file_table"]
    names = [f["name"] for f in table]
    for name in names:
        if not _PLAIN_NAME.match(name) or ".." in name:
            raise SpecError(f"data file name {name!r} is not a plain name")
    if len(set(names)) != len(names):
        raise SpecError("the file table names a file twice")
    bb, size = meta["checksum"]["block_bytes"], _ITEMSIZE[t["dtype"]]
    out = []
    for f, off, lens, flat in table_chunks(t, len(table), key):
        if f not in files:
            files[f] = _read_v3_file(path, table[f], bb)
        data, entries = files[f]
        name = entry_name(key, t["shape"], off, lens, flat)
        where = f"{key}: chunk {name} in {names[f]}"
        if name not in entries:
            raise SpecError(f"{where}: no such entry in the file")
        begin, end, first, dtype, shape, sums = entries[name]
        numel = flat[1] - flat[0] if flat is not None else math.prod(lens)
        if end - begin != numel * size or dtype != _CODE[t["dtype"]] or math.prod(shape) != numel:
            raise SpecError(f"{where}: the entry is {dtype} {shape} in {end - begin} bytes, the chunk needs {numel} elements")
        for i, pos in enumerate(range(begin, end, bb)):  # §6: every block, against its digest
            if xxhash.xxh3_64_intdigest(data[pos : min(pos + bb, end)]) != sums[first + i]:
                raise SpecError(f"{where}: checksum mismatch in block {i}")
        c = {"global_offset": off, "local_shape": lens, "flattened_range": list(flat) if flat else None, "name": name}
        out.append((c, data[begin:end], where))
    return out


def _v12_chunks(path: str, meta: dict, key: str, t: dict, files: dict) -> list[tuple[dict, bytes, str]]:
    """Every chunk of v1/v2 tensor ``key`` (§9.2), its checked bytes and where it is."""
    size, out = _ITEMSIZE[t["dtype"]], []
    for file, chunks in t["shard_spec_per_file"].items():
        if not _PLAIN_NAME.match(file) or ".." in file:
            raise SpecError(f"{key}: data file name {file!r} is not a plain name")
        if file not in files:
            with open(os.path.join(path, file), "rb") as fh:
                data = fh.read()
            (n,) = struct.unpack("<Q", data[:8])
            if meta["format_version"] == 2:  # the file's size and its header's digest
                info = meta["files"][file]
                if len(data) != info["size"] or _digest(data[: 8 + n]) != info["header"]:
                    raise SpecError(f"{file}: size or header checksum mismatch")
            files[file] = (data, n, json.loads(data[8 : 8 + n]))
        data, n, header = files[file]
        for c in chunks:
            begin, end = c["byte_range"]
            numel = math.prod(c["local_shape"]) if not c.get("flattened_range") else c["flattened_range"][1] - c["flattened_range"][0]
            entry = [8 + n + x for x in header[c["name"]]["data_offsets"]]
            if entry != [begin, end] or end > len(data) or end - begin != numel * size:
                raise SpecError(f"{key}: chunk {c['name']}: byte range {[begin, end]} is inconsistent")
            where = f"{key}: chunk {c['name']} in {file}"
            _check_chunk(c, data[begin:end], meta, where)
            out.append((c, data[begin:end], where))
    return out


def _tiles_box_by_box(chunks: list, shape: list[int]) -> bool:
    """§8 bounds: the flattened ranges of the chunks sharing a box tile that box, and the
    distinct boxes tile the tensor (counted element by element here)."""
    by_box: dict = {}
    for _, off, lens, flat in chunks:
        by_box.setdefault((tuple(off), tuple(lens)), []).append(flat or (0, math.prod(lens)))
    for (_, lens), ranges in by_box.items():
        pos = 0
        for lo, hi in sorted(ranges):
            if lo != pos:
                return False
            pos = hi
        if pos != math.prod(lens):
            return False
    # the boxes tile the tensor iff the indicator functions of the boxes sum to the tensor's; an
    # indicator is a signed sum over the box's corners of orthants, linearly independent by corner
    corners: collections.Counter = collections.Counter()
    for box, sign in [*((b, 1) for b in by_box), (((0,) * len(shape), tuple(shape)), -1)]:
        for pick in itertools.product((0, 1), repeat=len(shape)):
            corner = tuple(o + n if p else o for o, n, p in zip(*box, pick))
            corners[corner] += sign * (-1) ** sum(pick)
    return not any(corners.values())


def _check_bounds(meta: dict) -> None:
    """§8 step 2.6 and the bounds on the work a document can ask for, before any data file is read."""
    for key, t in meta["tensors"].items():
        shape = t["shape"]
        if len(shape) > 64 or any(not 0 <= n < _LIMIT for n in shape):
            raise SpecError(f"{key}: shape {shape} has more than 64 dimensions or a dimension outside [0, 2**62)")
        if math.prod(shape) * _ITEMSIZE[t["dtype"]] >= _LIMIT:
            raise SpecError(f"{key}: shape {shape} holds 2**62 bytes or more")
    if meta["format_version"] != 3:
        return
    budget = sum(f["header_bytes"] for f in meta["file_table"]) // _MIN_ENTRY
    one_by_one = _CHECKED_ONE_BY_ONE
    for key, t in meta["tensors"].items():
        count = t["table"]["count"]
        if type(count) is not int or count > budget:
            raise SpecError(f"{key}: {count} chunks, more than the data files' headers can name ({budget} left)")
        budget -= count
        chunks = table_chunks(t, len(meta["file_table"]), key)
        if not _tiles_box_by_box(chunks, t["shape"]):
            if len(chunks) > one_by_one:
                raise SpecError(f"{key}: {len(chunks)} chunks that do not tile box by box, more than are checked one by one")
            one_by_one -= len(chunks)


def read_checkpoint(path: str, *, allow_pickle: bool = False) -> dict:
    """Every tensor whole, and every object, from the checkpoint at ``path`` (formats 1 to 3)."""
    if not os.path.isfile(os.path.join(path, "metadata.json")):
        raise SpecError(f"{path}: no metadata.json, not a committed checkpoint")
    meta = _load_metadata(path)
    _check_bounds(meta)
    files: dict = {}
    out: dict = {}
    for key, t in meta["tensors"].items():
        shape, size = tuple(t["shape"]), _ITEMSIZE[t["dtype"]]
        numel = math.prod(shape)
        full = torch.empty((numel, size), dtype=torch.uint8)  # one row of bytes per element
        seen = torch.zeros(numel, dtype=torch.bool)
        index = torch.arange(numel).reshape(shape)  # global flat index of every element (§5)
        read = _v3_chunks if meta["format_version"] == 3 else _v12_chunks
        for c, raw, where in read(path, meta, key, t, files):
            off, lens = c["global_offset"], c["local_shape"]
            if len(off) != len(shape) or len(lens) != len(shape):
                raise SpecError(f"{where}: the wrong number of dimensions")
            if any(o < 0 or ln < 0 or o + ln > s for o, ln, s in zip(off, lens, shape)):
                raise SpecError(f"{where}: lies outside the tensor")
            box = index[tuple(slice(o, o + ln) for o, ln in zip(off, lens))].reshape(-1)
            lo, hi = c.get("flattened_range") or (0, box.numel())
            if not 0 <= lo <= hi <= box.numel() or len(raw) != (hi - lo) * size:
                raise SpecError(f"{where}: bad flattened_range or byte count")
            dest = box[lo:hi]
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
    """The chunks of v3 tensor ``key``, decoded from its table (§3.4), with their file and entry name."""
    t, out = meta["tensors"][key], []
    for f, off, lens, flat in table_chunks(t, len(meta["file_table"]), key):
        name = entry_name(key, t["shape"], off, lens, flat)
        out.append({"file": meta["file_table"][f]["name"], "global_offset": off, "local_shape": lens,
                    "flattened_range": list(flat) if flat else None, "name": name})
    return out


def _set_chunks(meta: dict, key: str, chunks: list[dict]) -> None:
    """Replace the table of ``key`` by ``chunks``, each value its own run ``[v, 0, 1]`` (§3.4 allows any coding)."""
    t = meta["tensors"][key]
    files = [f["name"] for f in meta["file_table"]]
    col = lambda values: [[v, 0, 1] for v in values]  # noqa: E731
    t["table"] = {
        "count": len(chunks),
        "file": col(files.index(c["file"]) for c in chunks),
        "offset": [col(c["global_offset"][d] for c in chunks) for d in range(len(t["shape"]))],
        "length": [col(c["local_shape"][d] for c in chunks) for d in range(len(t["shape"]))],
    }
    if any(c["flattened_range"] for c in chunks):
        ranges = [c["flattened_range"] or [0, math.prod(c["local_shape"])] for c in chunks]
        t["table"]["flat"] = [col(r[0] for r in ranges), col(r[1] for r in ranges)]


def _entry_range(path: str, file: str, name: str) -> tuple[int, int]:
    """Absolute ``[begin, end)`` of entry ``name`` in data file ``file`` (§4.1)."""
    with open(os.path.join(path, file), "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    a, b = header[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _flip(path: str, file: str, pos: int) -> None:
    with open(os.path.join(path, file), "r+b") as fh:
        fh.seek(pos)
        byte = fh.read(1)
        fh.seek(pos)
        fh.write(bytes([byte[0] ^ 0x10]))


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
    assert meta["tensors"]["empty"] == {
        "shape": [0, 3], "dtype": "float32", "is_sharded": True,
        "table": {"count": 0, "file": [], "offset": [[], []], "length": [[], []]},
    }
    assert meta["tensors"]["scalar"]["table"] == {"count": 1, "file": [[0, 0, 1]], "offset": [], "length": []}
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
    assert meta["tensors"]["grid"]["table"]["file"] == [[0, 1, 4]]  # chunk i is in file i
    assert len(os.listdir(flat_ckpt)) == 5  # metadata.json and one data file per rank


def test_reader_agrees_with_shardsafe_unshard(flat_ckpt, sharded_ckpt):
    for path in (flat_ckpt, sharded_ckpt):
        assert_state_equal(read_checkpoint(path), shardsafe.Checkpointer().unshard(path, no_dist=True))


def test_reader_pickled_objects_only_with_opt_in(tmp_path):
    path = str(tmp_path / "ckpt")
    state = {"t": torch.ones(2), "rng": 1 + 2j}  # no JSON form, tagged or not
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
        bb = meta["checksum"]["block_bytes"]
        chunks_by_file: dict[str, dict[str, dict]] = {}
        for key in meta["tensors"]:
            for c in _chunks(meta, key):
                chunks_by_file.setdefault(c["file"], {})[c["name"]] = c
        assert sorted(chunks_by_file) == sorted(f["name"] for f in meta["file_table"])
        for info in meta["file_table"]:
            file, chunks = info["name"], chunks_by_file[info["name"]]
            with open(os.path.join(path, file), "rb") as fh:
                data = fh.read()
            (n,) = struct.unpack("<Q", data[:8])
            assert (8 + n) % 8 == 0
            text = data[8 : 8 + n].decode("ascii")
            assert text.startswith("{") and set(text[len(text.rstrip(" ")) :]) <= {" "}
            assert len(text) - len(text.rstrip(" ")) < 8
            header = json.loads(text)
            assert header.pop("__metadata__") == {"format": "pt", "shardsafe_format_version": "3"}
            assert list(header)[-1] == "__shardsafe_checksums__" and set(header) == set(chunks) | {"__shardsafe_checksums__"}
            pos, digests = 0, []  # entries back to back, in header order, to the end of the file
            for name, entry in header.items():
                assert entry["data_offsets"][0] == pos
                pos = entry["data_offsets"][1]
                raw = data[8 + n + entry["data_offsets"][0] : 8 + n + pos]
                if name == "__shardsafe_checksums__":
                    assert entry["dtype"] == "U8" and entry["shape"] == [len(raw)]
                    assert raw == struct.pack(f"<{len(digests)}Q", *digests)
                    sums = _digest(raw)
                    continue
                c = chunks[name]
                fr = c["flattened_range"]
                assert entry["shape"] == (c["local_shape"] if fr is None else [fr[1] - fr[0]])
                digests += [xxhash.xxh3_64_intdigest(raw[i : i + bb]) for i in range(0, len(raw), bb)]
            assert 8 + n + pos == len(data)
            assert info == {"name": file, "size": len(data), "header_bytes": 8 + n, "header": _digest(data[: 8 + n]), "sums": sums}
            with safe_open(os.path.join(path, file), "pt") as st:  # any safetensors reader opens it
                assert set(st.keys()) == set(chunks) | {"__shardsafe_checksums__"}
                for name in chunks:
                    raw = data[slice(*_entry_range(path, file, name))]
                    got = st.get_tensor(name)
                    assert bytes(got.contiguous().reshape(-1).view(torch.uint8).numpy()) == raw, name


def test_crc32c_is_castagnoli():  # format v1's checksum
    assert crc32c.crc32c(b"123456789") == 0xE3069283
    assert crc32c.crc32c(b"") == 0


def test_xxh3_64_is_the_documented_digest():  # formats v2 and v3: XXH3-64, seed 0
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
    meta["file_table"][0]["name"] = bad
    _write_metadata(path, meta)
    _both_refuse(path, "is not a plain name", shardsafe.CorruptCheckpointError, "is not a plain file name")


def test_refuses_chunks_that_do_not_tile(flat_ckpt, tmp_path):
    path = _copy(flat_ckpt, tmp_path)
    meta = _metadata(path)
    chunks = sorted(_chunks(meta, "flat3d"), key=lambda c: c["flattened_range"])
    _set_chunks(meta, "flat3d", chunks[:1] + chunks[2:])  # drop one flattened range: a gap
    _write_metadata(path, meta)
    _both_refuse(path, "leave a gap", shardsafe.CorruptCheckpointError, "a gap: some part")

    meta = _metadata(flat_ckpt)
    chunks = _chunks(meta, "grid")
    (first,) = [c for c in chunks if c["global_offset"] == [0, 0]]
    first["local_shape"] = [3, 2]  # same name and byte count, now overlapping the box at [2, 0]
    _set_chunks(meta, "grid", chunks)
    _write_metadata(path, meta)
    _both_refuse(path, "chunks overlap", shardsafe.CorruptCheckpointError, r"pieces at \[0, 0\] shape \[3, 2\] and at .* overlap")


def test_refuses_corrupt_chunk_bytes(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    chunk = _chunks(_metadata(path), "w")[0]
    _flip(path, chunk["file"], _entry_range(path, chunk["file"], chunk["name"])[0] + 5)
    _both_refuse(path, "checksum mismatch", shardsafe.CorruptCheckpointError, "checksum mismatch", read="unshard")


def test_refuses_newer_format_version(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    meta["format_version"] = 4
    _write_metadata(path, meta)
    _both_refuse(path, "format_version 4 is not supported", shardsafe.CorruptCheckpointError, "is newer than this shardsafe reads")


def test_refuses_edited_metadata(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        raw = fh.read()
    with open(os.path.join(path, "metadata.json"), "wb") as fh:  # rename a key, leave the checksum
        fh.write(raw.replace(b'"w":{"shape"', b'"v":{"shape"'))
    _both_refuse(path, "metadata.json: checksum mismatch", shardsafe.CorruptCheckpointError, "checksum mismatch: metadata_checksum says")


def test_refuses_edited_header(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    file = _metadata(path)["file_table"][0]["name"]
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
    meta["format_version"] = 4
    meta["new_field"] = {}
    _write_metadata(path, meta)
    with pytest.raises(shardsafe.CorruptCheckpointError, match="is newer than this shardsafe reads"):
        shardsafe.Checkpointer().get_metadata(path, no_dist=True)


# ---------------------------------------------------------------------------------------------
# Format v3 (docs/format.md §3.4, §4, §6): the spec reader against Checkpointer().unshard, on
# simulated multi-rank layouts, and every digest of the chain checked


_SMALL_BLOCKS = dataclasses.replace(Knobs.from_env(), checksum_block_bytes=64)  # chunks of several blocks


def _rows(key: str, full: torch.Tensor, ranks: int) -> list[ShardedTensor]:
    """FSDP-like: rank r holds the r-th ``torch.chunk`` of the rows (the last ones may be shorter)."""
    out, row = [], 0
    for part in full.chunk(ranks):
        out.append(ShardedTensor(key, part.clone(), tuple(full.shape), (row,) + (0,) * (full.dim() - 1), tuple(part.shape)))
        row += part.shape[0]
    return out


def _flat_pieces(key: str, full: torch.Tensor, cuts: tuple[int, ...]) -> list[ShardedTensor]:
    """Flattened ranges ``[cuts[r], cuts[r+1])`` of the whole tensor as one box."""
    flat, shape = full.reshape(-1), tuple(full.shape)
    return [ShardedTensor(key, flat[a:b].clone(), shape, (0,) * len(shape), shape, flattened_range=slice(a, b))
            for a, b in zip(cuts, cuts[1:])]


def _agrees_with_unshard(path: str, want: dict) -> dict:
    got = read_checkpoint(path)
    assert_state_equal(got, shardsafe.Checkpointer().unshard(path, no_dist=True))
    assert_state_equal(got, want)
    return _metadata(path)


def test_v3_fsdp_row_shards_on_4_ranks(tmp_path):
    g = torch.Generator().manual_seed(5)
    full = {"a": torch.randn(16, 5, generator=g), "b": torch.randn(10, 3, generator=g).to(torch.bfloat16)}
    bias = torch.arange(7, dtype=torch.int32)
    pieces = {k: _rows(k, v, 4) for k, v in full.items()}
    per_rank = [{"a": pieces["a"][r], "b": pieces["b"][r], "bias": bias.clone()} for r in range(4)]
    path = str(tmp_path / "ckpt")
    simulate_save(path, per_rank, knobs=_SMALL_BLOCKS)
    meta = _agrees_with_unshard(path, full | {"bias": bias})
    assert meta["format_version"] == 3 and len(meta["file_table"]) == 4
    assert meta["tensors"]["a"]["table"] == {  # §3.4: one run per column, whatever the rank count
        "count": 4, "file": [[0, 1, 4]], "offset": [[[0, 4, 4]], [[0, 0, 4]]], "length": [[[4, 0, 4]], [[5, 0, 4]]],
    }
    b = meta["tensors"]["b"]["table"]  # rows 3, 3, 3, 1
    assert decode_runs(b["offset"][0], 4, "b") == [0, 3, 6, 9] and decode_runs(b["length"][0], 4, "b") == [3, 3, 3, 1]
    assert [c["name"] for c in _chunks(meta, "a")] == ["a@0,0", "a@4,0", "a@8,0", "a@12,0"]
    assert [c["name"] for c in _chunks(meta, "bias")] == ["bias"]  # the replica, stored once


def test_v3_flattened_ranges_that_are_not_boxes(tmp_path):
    g = torch.Generator().manual_seed(6)
    cube = torch.randn(5, 7, 3, generator=g)
    rows = torch.randn(4, 9, generator=g).to(torch.float16)
    cube_pieces = _flat_pieces("cube", cube, (0, 17, 40, 41, 105))  # mid-row cuts, one of one element
    row_pieces = []  # flattened ranges of each rank's (2, 9) row box: [0, 5) and [5, 18)
    for box, off in ((rows[:2], 0), (rows[2:], 2)):
        for a, b in ((0, 5), (5, 18)):
            row_pieces.append(ShardedTensor("rows", box.reshape(-1)[a:b].clone(), (4, 9), (off, 0), (2, 9), flattened_range=slice(a, b)))
    per_rank = [{"cube": cube_pieces[r], "rows": row_pieces[r]} for r in range(4)]
    path = str(tmp_path / "ckpt")
    simulate_save(path, per_rank, knobs=_SMALL_BLOCKS)
    meta = _agrees_with_unshard(path, {"cube": cube, "rows": rows})
    assert sorted((c["flattened_range"], c["name"]) for c in _chunks(meta, "cube")) == [
        ([0, 17], "cube@0,0,0+0"), ([17, 40], "cube@0,0,0+17"), ([40, 41], "cube@0,0,0+40"), ([41, 105], "cube@0,0,0+41"),
    ]
    assert meta["tensors"]["cube"]["table"]["flat"] == [[[0, 17, 2], [40, 1, 2]], [[17, 23, 2], [41, 64, 2]]]
    assert sorted(c["name"] for c in _chunks(meta, "rows")) == ["rows@0,0+0", "rows@0,0+5", "rows@2,0+0", "rows@2,0+5"]


def test_v3_keys_with_at_and_reserved_names(tmp_path):
    g = torch.Generator().manual_seed(7)
    full = {
        "a": torch.randn(4, 2, generator=g),
        "a@0": torch.randn(3, generator=g),  # whole, but its name needs the @ form: a@0@0
        "x@1,2+3": torch.randn(2, 2, generator=g),
        "__metadata__": torch.arange(6, dtype=torch.int16),  # reserved by safetensors
        "__shardsafe_checksums__": torch.randn(4, 1, generator=g),  # reserved by format v3
        "s@": torch.tensor(1.25),  # 0-d, named with an empty offset list: s@@
    }
    per_rank = [
        {"a": _rows("a", full["a"], 2)[r], "__shardsafe_checksums__": _rows("__shardsafe_checksums__", full["__shardsafe_checksums__"], 2)[r]}
        | {k: full[k].clone() for k in ("a@0", "x@1,2+3", "__metadata__", "s@")}
        for r in range(2)
    ]
    path = str(tmp_path / "ckpt")
    simulate_save(path, per_rank)
    meta = _agrees_with_unshard(path, full)
    names = {c["name"] for key in full for c in _chunks(meta, key)}
    assert names == {"a@0,0", "a@2,0", "a@0@0", "x@1,2+3@0,0", "__metadata__@0", "__shardsafe_checksums__@0,0",
                     "__shardsafe_checksums__@2,0", "s@@"}
    _assert_safe_open_reads_every_file(path)


def test_v3_0d_and_empty_tensors(tmp_path):
    full = {
        "s": torch.tensor(-0.0, dtype=torch.float64),
        "flag": torch.tensor(True),
        "e": torch.empty(0, 3),
        "e3": torch.empty(2, 0, 4, dtype=torch.int64),
        "w": torch.arange(6, dtype=torch.uint8),
    }
    path = str(tmp_path / "ckpt")
    simulate_save(path, [{k: v.clone() for k, v in full.items()} for _ in range(2)])
    meta = _agrees_with_unshard(path, full)
    assert meta["tensors"]["e3"]["table"] == {"count": 0, "file": [], "offset": [[], [], []], "length": [[], [], []]}
    assert meta["tensors"]["s"]["table"]["offset"] == [] and [c["name"] for c in _chunks(meta, "s")] == ["s"]


@pytest.fixture(scope="module")
def blocks_ckpt(tmp_path_factory) -> str:
    """Two ranks, 64-byte blocks: each rank's chunk of 'w' has 3 blocks; the replica 'step_t' is in file 0."""
    full = torch.randn(10, 8, generator=torch.Generator().manual_seed(8))  # 160 bytes per rank: 3 blocks (64, 64, 32)
    path = str(tmp_path_factory.mktemp("blocks") / "ckpt")
    simulate_save(path, [{"w": p, "step_t": torch.tensor(3)} for p in _rows("w", full, 2)], knobs=_SMALL_BLOCKS)
    return path


def test_v3_flipped_byte_in_a_data_block(blocks_ckpt, tmp_path):
    path = _copy(blocks_ckpt, tmp_path)
    (chunk,) = [c for c in _chunks(_metadata(path), "w") if c["global_offset"] == [5, 0]]
    begin, end = _entry_range(path, chunk["file"], chunk["name"])
    assert end - begin == 160
    _flip(path, chunk["file"], begin + 64 * 2 + 7)  # in the third, shorter, block
    _both_refuse(path, "w@5,0 in .*: checksum mismatch in block 2", shardsafe.CorruptCheckpointError,
                 r"checksum mismatch in chunk .*w@5,0, bytes \[128, 160\) of the chunk \(block 2\)", read="unshard")


def test_v3_flipped_byte_in_the_checksum_entry(blocks_ckpt, tmp_path):
    path = _copy(blocks_ckpt, tmp_path)
    file = _metadata(path)["file_table"][1]["name"]
    begin, end = _entry_range(path, file, "__shardsafe_checksums__")
    assert end == os.path.getsize(os.path.join(path, file)) and end - begin == 8 * 3  # w@5,0's 3 blocks (step_t is in file 0)
    _flip(path, file, begin + 9)
    _both_refuse(path, "checksum entry checksum mismatch", shardsafe.CorruptCheckpointError,
                 "checksum mismatch in '__shardsafe_checksums__'", read="unshard")


def test_v3_flipped_byte_in_the_header(blocks_ckpt, tmp_path):
    path = _copy(blocks_ckpt, tmp_path)
    info = _metadata(path)["file_table"][0]
    with open(os.path.join(path, info["name"]), "rb") as fh:
        head = fh.read(info["header_bytes"])
    _flip(path, info["name"], head.index(b'"data_offsets":[0,') + len(b'"data_offsets":[0,'))  # a digit: JSON stays valid
    _both_refuse(path, "header checksum mismatch", shardsafe.CorruptCheckpointError,
                 "checksum mismatch in the safetensors header", read="unshard")


def test_v3_flipped_byte_in_metadata_json(blocks_ckpt, tmp_path):
    path = _copy(blocks_ckpt, tmp_path)
    with open(os.path.join(path, "metadata.json"), "rb") as fh:
        raw = fh.read()
    pos = raw.index(b'"dtype":"float32"') + len(b'"dtype":"')  # "float32" -> "vloat32": still JSON
    with open(os.path.join(path, "metadata.json"), "wb") as fh:
        fh.write(raw[:pos] + bytes([raw[pos] ^ 0x10]) + raw[pos + 1 :])
    _both_refuse(path, "metadata.json: checksum mismatch", shardsafe.CorruptCheckpointError, "checksum mismatch: metadata_checksum says")


# --- issue 22 item 8: the bounds of §8, followed by this reader and by shardsafe alike -------------


def test_both_refuse_a_dimension_of_2_62_or_more_beside_a_zero(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    meta["tensors"]["e"] = {"shape": [0, 2**70], "dtype": "float32", "is_sharded": False,
                            "table": {"count": 0, "file": [], "offset": [[], []], "length": [[], []]}}
    _write_metadata(path, meta)
    _both_refuse(path, r"e: shape \[0, 1180591620717411303424\] has more than 64 dimensions or a dimension outside",
                 shardsafe.CorruptCheckpointError, r"a dimension of 2\*\*62 or more", read="unshard")


def test_both_refuse_a_sealed_dtype_change(sharded_ckpt, tmp_path):
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    key = next(k for k, t in meta["tensors"].items() if t["dtype"] == "float32")
    meta["tensors"][key]["dtype"] = "int32"
    _write_metadata(path, meta)
    _both_refuse(path, "the entry is F32", shardsafe.CorruptCheckpointError, "holds dtype F32 by the file's header, metadata.json says I32",
                 read="unshard")


def test_both_refuse_more_chunks_checked_one_by_one_than_the_bound(sharded_ckpt, tmp_path):
    # 80000 chunks in a staircase whose second chunk of each row overlaps the first: not box by box
    path = _copy(sharded_ckpt, tmp_path)
    meta = _metadata(path)
    n = 40_000
    meta["file_table"][0]["header_bytes"] = meta["file_table"][0]["size"] = _MIN_ENTRY * (2 * n + 100)
    meta["tensors"]["s"] = {"shape": [n, n + 1], "dtype": "uint8", "is_sharded": True, "table": {
        "count": 2 * n, "file": [[0, 0, 2 * n]],
        "offset": [[[0, 1, n], [0, 1, n]], [[0, 0, n], [0, 1, n]]],
        "length": [[[1, 0, n], [1, 0, n]], [[1, 1, n], [n, -1, n]]],
    }}
    _write_metadata(path, meta)
    _both_refuse(path, "80000 chunks that do not tile box by box, more than are checked one by one",
                 shardsafe.CorruptCheckpointError, r"its 80000 chunks do not tile its shape \[40000, 40001\] box by box")
