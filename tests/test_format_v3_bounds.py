"""Format v3 read paths against hostile lengths: metadata.json and headers that declare more
bytes than a data file has must fail with ``CorruptCheckpointError`` before the reader allocates
memory for them (docs/format.md §4: header, ``__shardsafe_checksums__``)."""

from __future__ import annotations

import json
import os
import struct

import pytest
import torch
import xxhash

from shardsafe import Checkpointer, CorruptCheckpointError
from shardsafe.format.file_index import SUMS_ENTRY

from .sealing import seal


def _save(path: str) -> tuple[dict, str]:
    Checkpointer().save(path, {"x": torch.arange(10.0)})
    with open(os.path.join(path, "metadata.json")) as f:
        doc = json.load(f)
    return doc, doc["file_table"][0]["name"]


def _write_meta(path: str, doc: dict) -> None:
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(seal(doc))


@pytest.mark.parametrize("header_bytes", [2**40, 2**61])
def test_header_length_beyond_the_file_is_refused_before_it_is_read(tmp_path, header_bytes):
    path = str(tmp_path / "ckpt")
    doc, name = _save(path)
    doc["file_table"][0]["header_bytes"] = header_bytes  # metadata re-sealed: only the length is wrong
    _write_meta(path, doc)
    with pytest.raises(CorruptCheckpointError, match=f"{name}: metadata.json says the header is {header_bytes} bytes"):
        Checkpointer().unshard(path, no_dist=True)


def test_checksum_entry_longer_than_the_file_fails_as_truncated_before_allocating(tmp_path):
    # a crafted file whose header (digest matching the metadata) declares a 2**40-byte chunk and,
    # with 16-byte blocks, a 2**39-byte checksum entry; the file really is a few hundred bytes
    path = str(tmp_path / "ckpt")
    doc, name = _save(path)
    full = os.path.join(path, name)
    with open(full, "rb") as f:
        data = f.read()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    big = 2**40
    sums = 8 * (big // 16)
    header["x"]["data_offsets"] = [0, big]
    header[SUMS_ENTRY]["data_offsets"] = [big, big + sums]
    header[SUMS_ENTRY]["shape"] = [sums]
    body = json.dumps(header, separators=(",", ":")).encode()
    body += b" " * (-len(body) % 8)
    head = struct.pack("<Q", len(body)) + body
    with open(full, "wb") as f:
        f.write(head + data[8 + n :])
    doc["checksum"]["block_bytes"] = 16
    doc["file_table"][0].update(size=len(head) + big + sums, header_bytes=len(head),
                                header=f"{xxhash.xxh3_64_intdigest(head):016x}")
    _write_meta(path, doc)
    with pytest.raises(CorruptCheckpointError, match=f"{name}: truncated"):
        Checkpointer().unshard(path, no_dist=True)


def test_chunk_count_beyond_what_the_headers_can_name_is_refused_before_decoding(tmp_path):
    # a few runs can stand for any number of chunks; each chunk is an entry of a data file's
    # header, so a table of 2**36 one-element chunks in a file with a 300-byte header is damage
    path = str(tmp_path / "ckpt")
    doc, _ = _save(path)
    n = 2**36
    doc["tensors"]["x"]["shape"] = [n]
    doc["tensors"]["x"]["table"] = {"count": n, "file": [[0, 0, n]], "offset": [[[0, 1, n]]], "length": [[[1, 0, n]]]}
    _write_meta(path, doc)
    with pytest.raises(CorruptCheckpointError, match=f"tensor 'x': count {n} is more chunks than the data files' headers"):
        Checkpointer().get_metadata(path, no_dist=True)


def test_tensors_sharing_one_table_count_against_the_same_budget(tmp_path):
    # identical tables are decoded once; each tensor that uses one still spends its chunks
    path = str(tmp_path / "ckpt")
    doc, _ = _save(path)
    info = doc["file_table"][0]
    n = info["header_bytes"] // 26 // 2 + 1  # one such table fits what the header can name, two do not
    table = {"count": n, "file": [[0, 0, n]], "offset": [[[0, 1, n]]], "length": [[[1, 0, n]]]}
    for key in ("x", "y"):
        doc["tensors"][key] = {"shape": [n], "dtype": "float32", "is_sharded": True, "table": table}
    _write_meta(path, doc)
    with pytest.raises(CorruptCheckpointError, match=rf"tensor 'y': count {n} is more chunks than the data files' headers can name \(\d+ left\)"):
        Checkpointer().get_metadata(path, no_dist=True)
