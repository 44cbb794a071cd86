"""An independent reader of checkpoints, written from docs/format.md alone (formats 3, 2 and 1).

``read_checkpoint`` uses json, struct, torch.frombuffer, xxhash and crc32c, and nothing from
shardsafe's format, planning or engine modules. It checks every digest the document defines:
metadata_checksum, each data file's header and checksum entry against the file table, every
block of every chunk against the checksum entry. ``SpecError``: what it raises on a checkpoint
the document does not allow. ``tests/test_format_spec.py`` checks it against shardsafe's saves.
"""

from __future__ import annotations

import base64
import collections
import itertools
import json
import math
import os
import pickle
import re
import struct

import crc32c
import torch
import xxhash

# ---------------------------------------------------------------------------------------------
# The independent reader: docs/format.md §2, §3, §4, §5, §6, §8, §9 (§14: subclass_parts, at the end).

_ITEMSIZE = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1, "float8_e5m2": 1, "float8_e8m0fnu": 1,
             "complex64": 8, "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4,
             "uint16": 2, "uint8": 1, "bool": 1}
_CODE = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3",
         "float8_e5m2": "F8_E5M2", "float8_e8m0fnu": "F8_E8M0", "complex64": "C64", "int64": "I64", "int32": "I32", "int16": "I16", "int8": "I8",
         "uint64": "U64", "uint32": "U32", "uint16": "U16", "uint8": "U8", "bool": "BOOL"}
_PLAIN_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*\.safetensors$")
_SUMS = "__shardsafe_checksums__"  # §4.2: the last entry of every v3 data file
_LIMIT = 2**62
MIN_ENTRY = 26  # §8 bounds: the shortest header entry, '"a":{"data_offsets":[0,0]}'
_CHECKED_ONE_BY_ONE = 2**16  # §8 bounds: chunks of tables that do not tile box by box, per document


class SpecError(Exception):
    """The directory is not a valid checkpoint according to docs/format.md."""


def digest(data: bytes) -> str:
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
        if digest(body).encode() != tail[:16]:
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
    if digest(data[:hb]) != info["header"]:
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
    if digest(data[s_begin:s_end]) != info["sums"]:
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
                if len(data) != info["size"] or digest(data[: 8 + n]) != info["header"]:
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
    budget = sum(f["header_bytes"] for f in meta["file_table"]) // MIN_ENTRY
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
# docs/format.md §14: a tensor subclass's record and its inner tensors.


def subclass_parts(out: dict, key: str) -> dict:
    """The inner tensors of the subclass stored under ``key`` (``out``: what ``read_checkpoint``
    returned), each in the form its class holds it for the whole tensor: ``outer`` shaped as the
    tensor, ``flat`` 1-D, ``grid`` as the grid of blocks, a shared one as stored."""
    rec = out.get(key)
    if not isinstance(rec, dict) or rec.get("__shardsafe__") != "tensor_subclass":
        raise SpecError(f"{key}: not a tensor subclass record")
    shape = rec["shape"]
    parts = {}
    for name, doc in rec["inner"].items():
        if doc["key"] != f"{key}#{name}":
            raise SpecError(f"{key}: inner tensor {name} stored under {doc['key']!r}, not {key}#{name}")
        t = out[doc["key"]]
        if str(t.dtype).removeprefix("torch.") != doc["dtype"]:
            raise SpecError(f"{key}#{name}: dtype {t.dtype}, the record says {doc['dtype']}")
        if doc.get("shared"):
            if list(t.shape) != doc["shape"]:
                raise SpecError(f"{key}#{name}: shape {list(t.shape)}, the record says {doc['shape']}")
            parts[name] = t
            continue
        block = doc["block"]
        if len(block) != len(shape) or any(s % b for s, b in zip(shape, block)):
            raise SpecError(f"{key}#{name}: blocks {block} do not tile {shape}")
        if list(t.shape) != [s // b for s, b in zip(shape, block)]:
            raise SpecError(f"{key}#{name}: shape {list(t.shape)} is not the grid of blocks {block} of {shape}")
        if doc["form"] == "outer":
            if any(b != 1 for b in block):
                raise SpecError(f"{key}#{name}: form outer with blocks {block}")
            parts[name] = t.reshape(shape)
        elif doc["form"] == "flat":
            parts[name] = t.reshape(-1)
        elif doc["form"] == "grid":
            parts[name] = t
        else:
            raise SpecError(f"{key}#{name}: unknown form {doc['form']!r}")
    return parts
