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


# --- issue 22 item 8: what a re-sealing fuzzer found ---------------------------------------------


@pytest.mark.parametrize("shape", [[0, 2**70], [2**62, 0], [0, 2**62, 3]])
def test_every_dimension_is_bounded_not_only_the_product(tmp_path, shape):
    # a zero dimension makes the product 0: each dimension must be below 2**62 by itself
    path = str(tmp_path / "ckpt")
    doc, _ = _save(path)
    doc["tensors"]["e"] = {"shape": shape, "dtype": "float32", "is_sharded": False,
                           "table": {"count": 0, "file": [], "offset": [[] for _ in shape], "length": [[] for _ in shape]}}
    _write_meta(path, doc)
    want = rf"tensor 'e' has shape \[{', '.join(map(str, shape))}\]: a dimension of 2\*\*62 or more; refusing it"
    for read in ("get_metadata", "unshard"):
        with pytest.raises(CorruptCheckpointError, match=want):
            getattr(Checkpointer(), read)(path, no_dist=True)


def test_an_empty_tensor_with_large_dimensions_below_the_bound_still_loads(tmp_path):
    path = str(tmp_path / "ckpt")
    doc, _ = _save(path)
    doc["tensors"]["e"] = {"shape": [0, 2**62 - 1], "dtype": "float32", "is_sharded": False,
                           "table": {"count": 0, "file": [], "offset": [[], []], "length": [[], []]}}
    _write_meta(path, doc)
    got = Checkpointer().unshard(path, no_dist=True)
    assert got["e"].shape == (0, 2**62 - 1) and got["e"].dtype == torch.float32
    assert torch.equal(got["x"], torch.arange(10.0))


@pytest.mark.parametrize("read", ["unshard", "unshard_to_safetensors", "load", "verify"])
def test_a_sealed_dtype_change_is_refused_by_every_read_path(tmp_path, read):
    # metadata.json says int32 (re-sealed), the data file's header says F32: the bytes must not
    # come back reinterpreted by any path
    from shardsafe import unshard_to_safetensors, verify

    path = str(tmp_path / "ckpt")
    doc, name = _save(path)
    doc["tensors"]["x"]["dtype"] = "int32"
    _write_meta(path, doc)
    if read == "unshard":
        call = lambda: Checkpointer().unshard(path, no_dist=True)  # noqa: E731
    elif read == "unshard_to_safetensors":
        call = lambda: unshard_to_safetensors(path, str(tmp_path / "out.safetensors"))  # noqa: E731
    elif read == "load":
        call = lambda: Checkpointer().load(path, {"x": torch.zeros(10, dtype=torch.int32)}, no_dist=True)  # noqa: E731
    else:
        call = lambda: verify(path)  # noqa: E731
    with pytest.raises(CorruptCheckpointError, match="entry 'x' holds dtype F32 by the file's header, metadata.json says I32"):
        call()
    assert not os.path.exists(tmp_path / "out.safetensors")


def _staircase(n: int, *, overlap: bool = False) -> dict:
    """A table of 2n chunks over shape [n, n + 1], no grid: row i is cut after column i (chunks
    (i, 0) of length i + 1 and (i, i + 1) of length n - i), a few runs whatever n. ``overlap``
    moves the second chunk of every row one column left, onto the first."""
    right = 1 if not overlap else 0
    return {
        "count": 2 * n,
        "file": [[0, 0, 2 * n]],
        "offset": [[[0, 1, n], [0, 1, n]], [[0, 0, n], [right, 1, n]]],
        "length": [[[1, 0, n], [1, 0, n]], [[1, 1, n], [n, -1, n]]],
    }


@pytest.mark.parametrize("overlap", [False, True])
def test_a_staircase_of_a_million_chunks_is_validated_without_checking_them_one_by_one(tmp_path, monkeypatch, overlap):
    # 10**6 chunks declared in a 0.7 KB metadata.json: a tiling is proved by the vectorized
    # box-by-box check; one that is not a tiling is refused, without a chunk-by-chunk check
    # (that took 49 s): the per-document bound of docs/format.md §8
    import shardsafe.format.metadata as metadata

    def one_by_one(key, shape, pieces):
        raise AssertionError(f"check_tiling called with {len(pieces)} pieces")

    monkeypatch.setattr(metadata, "check_tiling", one_by_one)
    path = str(tmp_path / "ckpt")
    doc, _ = _save(path)
    n = 500_000
    info = doc["file_table"][0]
    info["header_bytes"] = info["size"] = 26 * 2 * n + 26  # what 10**6 entries need (the file is not read here)
    doc["tensors"]["s"] = {"shape": [n, n + 1], "dtype": "uint8", "is_sharded": True, "table": _staircase(n, overlap=overlap)}
    raw = seal(doc)
    assert len(raw) < 800
    with open(os.path.join(path, "metadata.json"), "wb") as f:
        f.write(raw)
    if not overlap:
        meta = Checkpointer().get_metadata(path, no_dist=True)
        assert meta.tensors["s"].chunk_count() == 2 * n
        return
    with pytest.raises(CorruptCheckpointError, match=(
        rf"tensor 's': its {2 * n} chunks do not tile its shape \[{n}, {n + 1}\] box by box, and at most 65536 chunks of a "
        r"document \(65536 left\) are checked one by one \(docs/format.md, bounds\); the metadata is damaged"
    )):
        Checkpointer().get_metadata(path, no_dist=True)
