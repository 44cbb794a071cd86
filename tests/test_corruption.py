"""Damaged checkpoints: every kind of damage is refused with an error that names what is wrong.

Damage is done through the storage interface (``read`` / ``put_atomic`` / ``delete``), so the
same tests run on a local directory and on a ``memory://`` store.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
import struct
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, IncompleteCheckpointError, ShardedTensor
from shardsafe.knobs import Knobs
from shardsafe.storage import open_storage
from shardsafe.storage.local import LocalStorage

from .helpers import flip_byte
from .sealing import seal
from .simulate import simulate_save

META = "metadata.json"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitexact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype
    assert got.shape == want.shape
    assert torch.equal(_bytes(got), _bytes(want))


def _source() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(8, 5, generator=g), "b": torch.arange(7, dtype=torch.int64) * 3 - 5}


def _targets() -> dict[str, torch.Tensor]:
    return {"w": torch.zeros(8, 5), "b": torch.zeros(7, dtype=torch.int64)}


@pytest.fixture(params=["local", "memory"])
def location(request, tmp_path: Path):
    if request.param == "local":
        yield str(tmp_path / "ckpt")
        return
    url = f"memory://corruption-{uuid.uuid4().hex}"
    yield url
    store = open_storage(url)
    for name in store.list():
        store.delete(name)


@pytest.fixture
def saved(location: str) -> str:
    """A committed checkpoint of :func:`_source` (one data file, chunks ``w`` then ``b``)."""
    Checkpointer().save(location, _source())
    return location


V2 = Path(__file__).parent / "data" / "v2_checkpoint"


@pytest.fixture
def saved_v2(location: str) -> str:
    """A copy of the format-v2 checkpoint in ``tests/data`` (``w`` 6 x 5 float32 in two files,
    its first chunk ``w@0,0`` rows 0-2 in ``shard-r00000-5eed.safetensors``)."""
    store = open_storage(location)
    for f in sorted(V2.iterdir()):
        store.put_atomic(f.name, f.read_bytes(), overwrite=True)
    return location


def _chunk(location: str, key: str) -> tuple[str, Any]:
    meta = Checkpointer().get_metadata(location, no_dist=True)
    ((file, spec),) = list(meta.tensors[key].chunks())
    return file, spec


def _rewrite(location: str, name: str, data: bytes) -> None:
    open_storage(location).put_atomic(name, data, overwrite=True)


def _meta(location: str) -> dict[str, Any]:
    return json.loads(open_storage(location).read(META))


def _put_meta(location: str, meta: dict[str, Any] | bytes) -> None:
    """Replace metadata.json: raw bytes as given, a document re-sealed with its checksum."""
    raw = meta if isinstance(meta, bytes) else seal(meta)
    _rewrite(location, META, raw)


# --- damaged data files ----------------------------------------------------------------------


def test_clean_checkpoint_verifies_and_loads(saved: str) -> None:
    report = shardsafe.verify(saved)
    assert report.ok
    assert report.errors == []
    assert (report.files, report.chunks, report.bytes) == (1, 2, 8 * 5 * 4 + 7 * 8)
    targets = _targets()
    Checkpointer().load(saved, targets)
    for key, want in _source().items():
        assert_bitexact(targets[key], want)


def _assert_every_reader_refuses(saved: str, pattern: str) -> shardsafe.VerifyReport:
    """load, unshard and verify all raise CorruptCheckpointError matching ``pattern``; returns the
    collect-all report, which must not be ok."""
    with pytest.raises(CorruptCheckpointError, match=pattern):
        Checkpointer().load(saved, _targets())
    with pytest.raises(CorruptCheckpointError, match=pattern):
        Checkpointer().unshard(saved, no_dist=True)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        shardsafe.verify(saved)
    report = shardsafe.verify(saved, collect_all=True)
    assert not report.ok
    return report


@pytest.mark.parametrize("where", [0, 3, 8 * 5 * 4 - 1])
def test_flipped_byte_in_chunk_fails_load_naming_file_and_key(saved: str, where: int) -> None:
    file, spec = _chunk(saved, "w")
    flip_byte(saved, file, spec.byte_range[0] + where)

    pattern = rf"(?s)(?=.*'w')(?=.*{re.escape(file)}).*checksum"
    report = _assert_every_reader_refuses(saved, pattern)
    assert report.chunks == 2
    assert len(report.errors) == 1
    assert "'w'" in report.errors[0] and file in report.errors[0] and "checksum" in report.errors[0]

    # the undamaged key still loads, bit-exact
    b = torch.zeros(7, dtype=torch.int64)
    Checkpointer().load(saved, {"b": b})
    assert_bitexact(b, _source()["b"])


_SMALL_BUFFERS = Knobs(
    io_threads=1, read_buffer_bytes=1 << 20, coalesce_gap_bytes=4096, write_block_bytes=1 << 20, replica_split_bytes=1 << 24
)


@pytest.mark.parametrize("knobs", [None, _SMALL_BUFFERS], ids=["default-knobs", "small-read-buffer"])
@pytest.mark.parametrize("layout", ["contiguous", "transposed"])
def test_flipped_byte_in_large_chunk_is_detected_for_any_target_layout(tmp_path: Path, knobs, layout: str) -> None:
    """A chunk larger than the read buffer, loaded into a target that cannot be read into in
    place, is still checked against its checksum."""
    d = str(tmp_path / "ckpt")
    src = torch.randn(1024, 1024)  # 4 MiB: four times the small read buffer
    Checkpointer().save(d, {"w": src})
    file, spec = _chunk(d, "w")
    flip_byte(d, file, spec.byte_range[0] + 3 * (1 << 20) + 17)

    target = torch.zeros(1024, 1024) if layout == "contiguous" else torch.zeros(1024, 1024).t()
    with pytest.raises(CorruptCheckpointError, match=rf"(?s)(?=.*'w').*{re.escape(file)}"):
        Checkpointer(knobs=knobs).load(d, {"w": target})


_CUTS = {"last-10-bytes": lambda n: n - 10, "inside-length-field": lambda n: 4, "empty": lambda n: 0}


@pytest.mark.parametrize("cut", list(_CUTS))
def test_truncated_data_file_is_reported_as_truncated(saved: str, cut: str) -> None:
    file, _ = _chunk(saved, "w")
    raw = open_storage(saved).read(file)
    _rewrite(saved, file, raw[: _CUTS[cut](len(raw))])

    pattern = rf"(?s)(?=.*{re.escape(file)}).*truncated"
    report = _assert_every_reader_refuses(saved, pattern)
    assert any("truncated" in e and file in e for e in report.errors)


def test_deleted_data_file_is_named(saved: str) -> None:
    file, _ = _chunk(saved, "w")
    open_storage(saved).delete(file)

    pattern = rf"(?s)(?=.*{re.escape(file)}).*missing"
    report = _assert_every_reader_refuses(saved, pattern)
    assert len(report.errors) == 1 and file in report.errors[0]


# --- missing metadata: not a checkpoint ------------------------------------------------------

_OPERATIONS = {
    "load": lambda loc: Checkpointer().load(loc, _targets(), no_dist=True),
    "unshard": lambda loc: Checkpointer().unshard(loc, no_dist=True),
    "get_metadata": lambda loc: Checkpointer().get_metadata(loc, no_dist=True),
    "verify": lambda loc: shardsafe.verify(loc),
    "verify-collect-all": lambda loc: shardsafe.verify(loc, collect_all=True),
}


@pytest.mark.parametrize("op", list(_OPERATIONS))
def test_missing_metadata_is_incomplete(saved: str, op: str) -> None:
    open_storage(saved).delete(META)
    with pytest.raises(IncompleteCheckpointError, match=r"(?s)not a committed checkpoint.*1 file\(s\).*metadata\.json") as info:
        _OPERATIONS[op](saved)
    assert isinstance(info.value, FileNotFoundError)


@pytest.mark.parametrize("op", list(_OPERATIONS))
def test_nonexistent_location_is_incomplete(tmp_path: Path, op: str) -> None:
    for loc, what in (
        (str(tmp_path / "does" / "not" / "exist"), "no such checkpoint: the directory does not exist"),
        (f"memory://nothing-{uuid.uuid4().hex}", r"not a checkpoint: nothing is there \(an empty directory, or no object under this prefix\); a checkpoint holds metadata\.json"),
    ):
        with pytest.raises(IncompleteCheckpointError, match=what):
            _OPERATIONS[op](loc)


# --- metadata that points outside the checkpoint ---------------------------------------------


@pytest.mark.parametrize(
    "bad_name",
    [
        "../evil.safetensors",
        "/etc/passwd",
        "sub/x.safetensors",
        "sub/../shard.safetensors",
        "ABSOLUTE",  # replaced by the absolute path of a valid copy of the data file
        ".hidden.safetensors",
        "..",
    ],
)
@pytest.mark.parametrize("op", ["load", "unshard", "get_metadata", "verify", "verify-collect-all"])
@pytest.mark.parametrize("version", [3, 2])
def test_data_file_outside_checkpoint_is_refused_and_nothing_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, bad_name: str, op: str, version: int
) -> None:
    """v3: the name in ``file_table``; v2: the name in ``files`` and ``shard_spec_per_file``."""
    d = tmp_path / "ckpt"
    if version == 3:
        Checkpointer().save(str(d), _source())
    else:
        d.mkdir()
        for f in V2.iterdir():
            (d / f.name).write_bytes(f.read_bytes())
    meta = _meta(str(d))
    good = meta["file_table"][0]["name"] if version == 3 else sorted(meta["files"])[0]
    raw = (d / good).read_bytes()
    # valid copies wherever a bad name could lead, so that reading one would succeed
    (tmp_path / "evil.safetensors").write_bytes(raw)
    (d / "sub").mkdir()
    (d / "sub" / "x.safetensors").write_bytes(raw)
    (d / ".hidden.safetensors").write_bytes(raw)
    if bad_name == "ABSOLUTE":
        bad_name = str(tmp_path / "evil.safetensors")
    if version == 3:
        meta["file_table"][0]["name"] = bad_name
    else:
        meta["files"][bad_name] = meta["files"].pop(good)
        for t in meta["tensors"].values():
            t["shard_spec_per_file"] = {(bad_name if f == good else f): specs for f, specs in t["shard_spec_per_file"].items()}
    _put_meta(str(d), meta)

    reads: list[tuple[str, int]] = []
    real_read_into = LocalStorage.read_into

    def spy(self, name, offset, buffers):
        reads.append((name, offset))
        return real_read_into(self, name, offset, buffers)

    monkeypatch.setattr(LocalStorage, "read_into", spy)
    with pytest.raises(CorruptCheckpointError, match=r"(?s)metadata\.json.*refusing") as info:
        _OPERATIONS[op](str(d))
    assert bad_name in str(info.value)
    assert [r for r in reads if r[0] != "metadata.json"] == []  # metadata.json's own size probe aside, nothing is read


# --- invalid metadata ------------------------------------------------------------------------


SPEC = object()  # a path step (v2 fixture): the first chunk spec of tensor "w", w@0,0 in shard-r00000-5eed.safetensors
FILE = object()  # a path step (v3): the file table's only entry
_ONE_BLOCK = base64.b64encode(bytes(8)).decode()  # the checksums of a chunk of one block


def _spec_of(m: dict[str, Any], key: str = "w") -> dict[str, Any]:
    return m["tensors"][key]["shard_spec_per_file"]["shard-r00000-5eed.safetensors"][0]


def _table(m: dict[str, Any], key: str = "w") -> dict[str, Any]:
    return m["tensors"][key]["table"]


def _chunks_of_w(boxes: list[tuple[list[int], list[int]]], flat: list[tuple[int, int]] | None = None):
    """Store ``w`` (8 x 5 float32, format v3) as the chunks ``(offsets, lengths)``, all in file 0,
    each value a run of its own (and ``flat`` ranges, if given)."""

    def mutate(m: dict[str, Any]) -> None:
        n = len(boxes)
        table = {
            "count": n,
            "file": [[0, 0, n]],
            "offset": [[[off[d], 0, 1] for off, _ in boxes] for d in range(2)],
            "length": [[[lens[d], 0, 1] for _, lens in boxes] for d in range(2)],
        }
        if flat is not None:
            table["flat"] = [[[lo, 0, 1] for lo, _ in flat], [[hi, 0, 1] for _, hi in flat]]
        m["tensors"]["w"]["table"] = table

    return mutate


def _rows(first: tuple[int, int], second: tuple[int, int]):
    return _chunks_of_w([([lo, 0], [hi - lo, 5]) for lo, hi in (first, second)])


def _flats(first: tuple[int, int], second: tuple[int, int]):
    return _chunks_of_w([([0, 0], [8, 5])] * 2, flat=[first, second])


def _node(m: dict[str, Any], path: tuple) -> dict[str, Any]:
    node = m
    for step in path:
        node = _spec_of(m) if step is SPEC else m["file_table"][0] if step is FILE else node[step]
    return node


def _set(path: tuple, value: Any):
    def mutate(m: dict[str, Any]) -> None:
        _node(m, path[:-1])[path[-1]] = value

    return mutate


def _drop(path: tuple):
    def mutate(m: dict[str, Any]) -> None:
        del _node(m, path[:-1])[path[-1]]

    return mutate


def _shift_byte_range(delta_start: int, delta_end: int):
    def mutate(m: dict[str, Any]) -> None:
        spec = _spec_of(m)
        spec["byte_range"] = [spec["byte_range"][0] + delta_start, spec["byte_range"][1] + delta_end]

    return mutate


def _negative_byte_range(m: dict[str, Any]) -> None:
    _spec_of(m)["byte_range"] = [-60, 0]


_INVALID: dict[str, tuple[Any, str]] = {
    # any format: run on a checkpoint this shardsafe writes (format v3)
    # name: (raw bytes, or a mutation of the parsed metadata; pattern the message must match)
    "empty-file": (b"", "invalid checkpoint metadata"),
    "not-json": (b"{this is not json", "invalid checkpoint metadata"),
    "half-written": ("HALF", "invalid checkpoint metadata"),
    "not-utf8": (b"\xff\xfe\x00garbage", "invalid checkpoint metadata"),
    "json-list": (b"[1, 2, 3]", "invalid checkpoint metadata"),
    "no-tensors": (_drop(("tensors",)), "(?s)invalid checkpoint metadata.*tensors"),
    "no-shape": (_drop(("tensors", "w", "shape")), "(?s)invalid checkpoint metadata.*shape"),
    "no-dtype": (_drop(("tensors", "w", "dtype")), "(?s)invalid checkpoint metadata.*dtype"),
    "unknown-algorithm": (_set(("checksum", "algorithm"), "md5"), "(?s)invalid checkpoint metadata.*unknown checksum algorithm 'md5'"),
    "block-bytes-odd": (_set(("checksum", "block_bytes"), 1000), "(?s)invalid checkpoint metadata.*block_bytes"),
    "shape-not-ints": (_set(("tensors", "w", "shape"), ["a", "b"]), "(?s)invalid checkpoint metadata.*shape"),
    "unknown-dtype": (_set(("tensors", "w", "dtype"), "float128"), "(?s)metadata\\.json.*float128"),
    "only-part-stored": (lambda m: m["tensors"]["w"].update(shape=[9, 5]), r"(?s)'w'.*gap"),
    # format v3: the file table and the chunk tables
    "no-checksum-config": (_drop(("checksum",)), "(?s)invalid checkpoint metadata.*format_version 3 metadata lacks the 'checksum' field"),
    "no-file-table": (_drop(("file_table",)), "(?s)invalid checkpoint metadata.*format_version 3 metadata lacks the 'file_table' field"),
    "v2-files-in-v3": (lambda m: m.update(files={}), "(?s)invalid checkpoint metadata.*format_version 3 metadata has the 'files' field"),
    "file-twice": (lambda m: m["file_table"].append(dict(m["file_table"][0])), "(?s)invalid checkpoint metadata.*the file table names .*safetensors' twice"),
    "header-digest-not-hex": (_set((FILE, "header"), "XYZ"), "(?s)invalid checkpoint metadata.*file_table.0.header"),
    "sums-digest-not-hex": (_set((FILE, "sums"), "0" * 15), "(?s)invalid checkpoint metadata.*file_table.0.sums"),
    "no-header-bytes": (_drop((FILE, "header_bytes")), "(?s)invalid checkpoint metadata.*header_bytes"),
    "file-unknown-field": (_set((FILE, "surprise"), 1), "(?s)invalid checkpoint metadata.*surprise"),
    "no-table": (_drop(("tensors", "w", "table")), r"(?s)invalid checkpoint metadata.*'w'.*has a 'table' and no 'shard_spec_per_file'"),
    "v2-specs-in-v3": (_set(("tensors", "w", "shard_spec_per_file"), {}), r"(?s)invalid checkpoint metadata.*'w'.*has a 'table' and no 'shard_spec_per_file'"),
    "table-unknown-field": (_set(("tensors", "w", "table", "surprise"), 1), r"'w': a chunk table has the members count, file, offset, length"),
    "table-count-more-than-runs": (_set(("tensors", "w", "table", "count"), 2), r"'w': file: the runs hold 1 values, the table has 2"),
    "runs-hold-too-many": (lambda m: _table(m)["offset"][1].append([0, 0, 1]), r"'w': offset\[1\]: the runs hold more than the table's 1 values"),
    "runs-hold-too-few": (lambda m: _table(m)["length"][0].clear(), r"'w': length\[0\]: the runs hold 0 values, the table has 1"),
    "run-count-zero": (lambda m: _table(m).update(count=0, file=[[0, 0, 0]]), r"'w': file: run \[0, 0, 0\] has values outside \[0, 2\*\*62\) or a count below 1"),
    "one-dimension-missing": (lambda m: _table(m)["offset"].pop(), r"'w': offset must have one list of runs per dimension \(2\)"),
    "file-index-past-table": (_set(("tensors", "w", "table", "file"), [[1, 0, 1]]), r"'w': a chunk names data file 1; the checkpoint has 1"),
    "chunk-outside-tensor": (lambda m: _table(m)["offset"][0].__setitem__(0, [1, 0, 1]), r"'w': a chunk's box leaves the tensor's shape \[8, 5\] in dimension 0"),
    "chunk-empty": (lambda m: _table(m)["length"][1].__setitem__(0, [0, 0, 1]), r"'w': a chunk's box leaves the tensor's shape \[8, 5\] in dimension 1, or is empty"),
    "rows-overlap": (_rows((0, 4), (3, 8)), r"(?s)'w'.*overlap"),
    "rows-gap": (_rows((0, 4), (5, 8)), r"(?s)'w'.*gap"),
    "rows-duplicate": (_rows((0, 8), (0, 8)), r"(?s)'w'.*overlap"),
    "flat-overlap": (_flats((0, 25), (20, 40)), r"(?s)'w'.*overlap"),
    "flat-gap": (_flats((0, 20), (25, 40)), r"(?s)'w'.*gap"),
    "flat-past-box": (_flats((0, 20), (20, 41)), r"'w': a flattened range is empty or leaves its box"),
    "flat-empty": (_flats((0, 0), (0, 40)), r"'w': a flattened range is empty or leaves its box"),
}

_INVALID_V2: dict[str, tuple[Any, str]] = {
    # format v2 only (per-chunk byte ranges and checksums, the files table): run on tests/data/v2_checkpoint
    "no-checksums": (_drop((SPEC, "checksums")), "(?s)invalid checkpoint metadata.*'w'.*needs checksums"),
    "v1-crc-in-v2": (_set((SPEC, "crc32c"), 5), "(?s)invalid checkpoint metadata.*'w'.*needs checksums and no crc32c"),
    "checksums-short": (_set((SPEC, "checksums"), "AAAA"), "(?s)invalid checkpoint metadata.*'w'.*4 characters of checksums, expected 12"),
    "checksums-not-base64": (_set((SPEC, "checksums"), "!" * 12), "(?s)invalid checkpoint metadata.*checksums"),
    "no-checksum-config": (_drop(("checksum",)), "(?s)invalid checkpoint metadata.*lacks the 'checksum' field"),
    "no-files-table": (_drop(("files",)), "(?s)invalid checkpoint metadata.*lacks the 'files' field"),
    "files-table-differs": (lambda m: m["files"].update({"other.safetensors": {"size": 100, "header": "0" * 16}}), "(?s)invalid checkpoint metadata.*differ in \\['other.safetensors'\\]"),
    "header-digest-not-hex": (lambda m: next(iter(m["files"].values())).update(header="XYZ"), "(?s)invalid checkpoint metadata.*header"),
    "no-byte-range": (_drop((SPEC, "byte_range")), "(?s)invalid checkpoint metadata.*byte_range"),
    "unknown-field": (_set((SPEC, "surprise"), 1), "(?s)invalid checkpoint metadata.*surprise"),
    "v3-table-in-v2": (_set(("tensors", "w", "table"), {}), "(?s)invalid checkpoint metadata.*'shard_spec_per_file'.*no tensor a 'table'"),
    "byte-range-short": (_shift_byte_range(0, -4), r"(?s)'w'.*byte range.*does not hold 60 bytes"),
    "byte-range-long": (_shift_byte_range(0, 4), r"(?s)'w'.*byte range.*does not hold 60 bytes"),
    "byte-range-reversed": (_shift_byte_range(60, -60), r"(?s)'w'.*byte range.*does not hold 60 bytes"),
    "byte-range-negative": (_negative_byte_range, r"(?s)'w'.*byte range.*does not hold 60 bytes"),
    "byte-range-vs-local-shape": (_set((SPEC, "local_shape"), [3, 4]), r"(?s)'w'.*byte range.*does not hold 48 bytes"),
    "byte-range-vs-dtype": (_set(("tensors", "w", "dtype"), "float64"), r"(?s)'w'.*byte range.*does not hold 120 bytes"),
    "byte-ranges-share-bytes": (_shift_byte_range(8, 8), r"chunks 'w@0,0' \(tensor 'w'\) and 'f@0,0,0\+0' \(tensor 'f'\) in 'shard-r00000-5eed.safetensors' share bytes"),
    "chunk-outside-tensor": (_set((SPEC, "global_offset"), [4, 0]), r"(?s)'w'.*outside"),
}


def _damage_meta(location: str, damage: Any) -> None:
    if damage == "HALF":
        raw = open_storage(location).read(META)
        _put_meta(location, raw[: len(raw) // 2])
    elif isinstance(damage, bytes):
        _put_meta(location, damage)
    else:
        m = _meta(location)
        damage(m)
        _put_meta(location, m)


@pytest.mark.parametrize("case", list(_INVALID))
def test_invalid_metadata_is_corrupt(saved: str, case: str) -> None:
    damage, pattern = _INVALID[case]
    _damage_meta(saved, damage)
    for op in ("get_metadata", "load", "unshard", "verify"):
        with pytest.raises(CorruptCheckpointError, match=pattern) as info:
            _OPERATIONS[op](saved)
        assert META in str(info.value), op


@pytest.mark.parametrize("case", list(_INVALID_V2))
def test_invalid_v2_metadata_is_corrupt(saved_v2: str, case: str) -> None:
    """Format v2 stays readable, so its own fields stay checked."""
    damage, pattern = _INVALID_V2[case]
    _damage_meta(saved_v2, damage)
    ops = {
        "get_metadata": lambda: Checkpointer().get_metadata(saved_v2, no_dist=True),
        "load": lambda: Checkpointer().load(saved_v2, {"w": torch.zeros(6, 5)}, no_dist=True),
        "unshard": _OPERATIONS["unshard"],
        "verify": _OPERATIONS["verify"],
    }
    for op, call in ops.items():
        with pytest.raises(CorruptCheckpointError, match=pattern) as info:
            call() if op in ("get_metadata", "load") else call(saved_v2)
        assert META in str(info.value), op


@pytest.mark.parametrize("extra", [{}, {"new_top_level_field": {"x": 1}}], ids=["same-fields", "with-new-fields"])
def test_newer_format_version_asks_for_upgrade(saved: str, extra: dict[str, Any]) -> None:
    """A checkpoint from a newer shardsafe is refused with 'upgrade', even when the newer
    format added fields that this version does not know."""
    m = _meta(saved)
    m["format_version"] = 4
    m.update(extra)
    _put_meta(saved, m)
    for op in ("get_metadata", "load", "unshard", "verify"):
        with pytest.raises(CorruptCheckpointError, match=r"(?s)metadata\.json.*format_version 4 is newer than this shardsafe reads \(3\).*upgrade"):
            _OPERATIONS[op](saved)


# --- damaged safetensors header --------------------------------------------------------------


def _replace_in_header(old: bytes, new: bytes):
    assert len(old) == len(new)

    def damage(raw: bytes) -> bytes:
        (n,) = struct.unpack("<Q", raw[:8])
        header = raw[8 : 8 + n]
        assert header.count(old) == 1, header
        return raw[:8] + header.replace(old, new) + raw[8 + n :]

    return damage


def _set_header_length(n: int | str):
    def damage(raw: bytes) -> bytes:
        value = len(raw) * 2 if n == "past-end" else n
        return struct.pack("<Q", value) + raw[8:]

    return damage


def _header_as_list(raw: bytes) -> bytes:
    """The same header length, holding a valid JSON list instead of an object."""
    (n,) = struct.unpack("<Q", raw[:8])
    return raw[:8] + b"[" + b" " * (n - 2) + b"]" + raw[8 + n :]


_DIGEST = "not a valid safetensors file: header checksum mismatch: metadata says [0-9a-f]{16}, the header hashes to"
_HEADER_DAMAGE = {
    # every change to the header's bytes breaks its digest, recorded in metadata.json
    "json-garbled": (lambda raw: raw[:8] + b"X" + raw[9:], _DIGEST),
    "not-an-object": (_header_as_list, _DIGEST),
    "dtype-code-changed": (_replace_in_header(b'"F32"', b'"I32"'), _DIGEST),
    "entry-renamed": (_replace_in_header(b'"w":', b'"v":'), _DIGEST),
    "shape-changed": (_replace_in_header(b"[8,5]", b"[5,8]"), _DIGEST),
    "padding-changed": (lambda raw: raw[: 8 + struct.unpack("<Q", raw[:8])[0] - 1] + b"\t" + raw[8 + struct.unpack("<Q", raw[:8])[0] :], _DIGEST),
    "length-zero": (_set_header_length(0), _DIGEST),
    "length-past-end": (_set_header_length("past-end"), "not a valid safetensors file: header length .* runs past the file's size"),
    "length-huge": (_set_header_length(1 << 62), "not a valid safetensors file: header length .* exceeds"),
}


@pytest.mark.parametrize("case", list(_HEADER_DAMAGE))
def test_corrupt_safetensors_header_is_reported_by_verify(saved: str, case: str) -> None:
    damage, pattern = _HEADER_DAMAGE[case]
    file, _ = _chunk(saved, "w")
    store = open_storage(saved)
    raw = store.read(file)
    damaged = damage(raw)
    assert len(damaged) == len(raw)
    _rewrite(saved, file, damaged)

    with pytest.raises(CorruptCheckpointError, match=pattern) as info:
        shardsafe.verify(saved)
    assert file in str(info.value)
    report = shardsafe.verify(saved, collect_all=True)
    assert not report.ok
    assert report.errors and all(file in e for e in report.errors)
    assert any(re.search(pattern, e) for e in report.errors)


# --- format v3: what each data file's header and checksum entry say about its chunks --------


def _header_of(raw: bytes) -> tuple[int, dict[str, Any]]:
    (n,) = struct.unpack("<Q", raw[:8])
    return 8 + n, json.loads(raw[8 : 8 + n])


def test_damaged_checksum_entry_is_reported_by_every_reader(saved: str) -> None:
    """A flipped byte in a file's ``__shardsafe_checksums__`` entry: its digest in metadata.json
    no longer matches, so no digest of that file is trusted, and every reader names the file."""
    file, _ = _chunk(saved, "w")
    start, header = _header_of(open_storage(saved).read(file))
    begin, end = header["__shardsafe_checksums__"]["data_offsets"]
    assert end - begin == 2 * 8  # one digest per chunk (each one block)
    flip_byte(saved, file, start + begin + 11)

    pattern = rf"(?s)(?=.*{re.escape(file)}).*checksum mismatch in '__shardsafe_checksums__': metadata\.json says [0-9a-f]{{16}}, its bytes hash to [0-9a-f]{{16}}"
    report = _assert_every_reader_refuses(saved, pattern)
    assert len(report.errors) == 1 and file in report.errors[0]


def _rewrite_header(location: str, file: str, old: bytes, new: bytes, *, redigest: bool) -> None:
    """Replace ``old`` by ``new`` (as long) in the file's header; ``redigest``: record the new
    header's digest in metadata.json too (a crafted file), so the digest check passes."""
    assert len(old) == len(new)
    raw = open_storage(location).read(file)
    start, _ = _header_of(raw)
    assert raw[:start].count(old) == 1
    damaged = raw[:start].replace(old, new) + raw[start:]
    _rewrite(location, file, damaged)
    if redigest:
        m = _meta(location)
        (entry,) = m["file_table"]
        entry["header"] = f"{xxhash.xxh3_64_intdigest(damaged[:start]):016x}"
        _put_meta(location, m)


def test_damaged_byte_range_in_header_is_a_digest_mismatch_for_every_reader(saved: str) -> None:
    """v3 takes each chunk's byte range from its file's header: a changed range there is caught by
    the header's digest in metadata.json, by every reader, naming the file."""
    file, spec = _chunk(saved, "w")
    assert spec.byte_range[1] - spec.byte_range[0] == 160
    _rewrite_header(saved, file, b'"data_offsets":[0,160]', b'"data_offsets":[8,168]', redigest=False)

    pattern = rf"(?s)(?=.*{re.escape(file)}).*checksum mismatch.*metadata(\.json)? says [0-9a-f]{{16}}, the header hashes to [0-9a-f]{{16}}"
    report = _assert_every_reader_refuses(saved, pattern)
    assert len(report.errors) == 1 and file in report.errors[0]


def test_header_without_the_entry_of_a_chunk_is_reported_by_every_reader(saved: str) -> None:
    """A (crafted, digest-matching) header that lacks the entry metadata.json places a chunk in:
    the readers of that chunk name the file, the key and the entry; the other key loads."""
    file, _ = _chunk(saved, "w")
    _rewrite_header(saved, file, b'"w":{', b'"v":{', redigest=True)

    pattern = rf"(?s)(?=.*{re.escape(file)})(?=.*'w').*it has no entry 'w'"
    report = _assert_every_reader_refuses(saved, pattern)
    assert len(report.errors) == 1 and file in report.errors[0] and "no entry 'w'" in report.errors[0]
    b = torch.zeros(7, dtype=torch.int64)
    Checkpointer().load(saved, {"b": b})
    assert_bitexact(b, _source()["b"])


def test_entry_size_that_disagrees_with_the_metadata_is_reported(saved: str) -> None:
    """metadata.json says ``w`` is float64 (so 320 bytes), its file's entry holds 160: v2 caught
    this in the byte range; v3 when the entry is located."""
    file, _ = _chunk(saved, "w")
    m = _meta(saved)
    m["tensors"]["w"]["dtype"] = "float64"
    _put_meta(saved, m)
    pattern = rf"(?s){re.escape(file)}.*tensor 'w': entry 'w' holds 160 bytes, the chunk needs 320"
    with pytest.raises(CorruptCheckpointError, match=pattern):
        Checkpointer().load(saved, {"w": torch.zeros(8, 5, dtype=torch.float64)})
    with pytest.raises(CorruptCheckpointError, match=pattern):
        Checkpointer().unshard(saved, no_dist=True)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        shardsafe.verify(saved)
    report = shardsafe.verify(saved, collect_all=True)
    assert len(report.errors) == 1 and re.search(pattern, report.errors[0])


# --- every byte a load returns is verified, whatever the layout ---------------------------


_BLOCK_KNOBS = dataclasses.replace(Knobs.from_env(), checksum_block_bytes=4096, read_block_bytes=1 << 16)


def _resharding_targets(full: torch.Tensor) -> dict[str, Any]:
    """Target pieces that read parts of stored chunks: rows across chunk edges, columns,
    a flat range, a single element."""
    rows, cols = full.shape
    return {
        "rows-across-edge": ShardedTensor("m", torch.zeros(rows // 2, cols), full.shape, (rows // 4, 0), (rows // 2, cols)),
        "columns": ShardedTensor("m", torch.zeros(rows, 3), full.shape, (0, 5), (rows, 3)),
        "flat": ShardedTensor("m", torch.zeros(1000), full.shape, (0, 0), full.shape, flattened_range=slice(2000, 3000)),
        "one-element": ShardedTensor("m", torch.zeros(1, 1), full.shape, (rows - 1, cols - 1), (1, 1)),
    }


def _slice_of(full: torch.Tensor, st: ShardedTensor) -> torch.Tensor:
    box = full[tuple(slice(o, o + n) for o, n in zip(st.global_offset, st.local_shape))]
    if st.flattened_range is not None:
        return box.reshape(-1)[st.flattened_range]
    return box


@pytest.mark.parametrize("stored", ["rows", "flat-ranges"])
def test_every_partial_read_checks_the_blocks_it_returns(tmp_path: Path, stored: str) -> None:
    """Flip one byte per trial anywhere in a data section: each target that reads the damaged
    element fails naming file and key; each that does not is bit-exact."""
    full = torch.randn(96, 40, generator=torch.Generator().manual_seed(3))  # 15 KiB: 4 blocks of 4 KiB
    if stored == "rows":
        per_rank = [{"m": ShardedTensor.from_rank_offsets("m", c.clone(), (0, r, 2))} for r, c in enumerate(full.chunk(2))]
    else:  # flattened ranges that are not boxes (FSDP1, distributed optimizers)
        flat = full.reshape(-1)
        cuts = [(0, 1234), (1234, flat.numel())]
        per_rank = [{"m": ShardedTensor("m", flat[a:b].clone(), full.shape, (0, 0), full.shape, flattened_range=slice(a, b))} for a, b in cuts]
    d = str(tmp_path / "ckpt")
    meta = simulate_save(d, per_rank, knobs=_BLOCK_KNOBS)
    chunks = list(meta.tensors["m"].chunks())
    rng = torch.Generator().manual_seed(11)
    for _ in range(40):
        file, spec = chunks[int(torch.randint(len(chunks), (1,), generator=rng))]
        pos = int(torch.randint(spec.byte_range[1] - spec.byte_range[0], (1,), generator=rng))
        flip_byte(d, file, spec.byte_range[0] + pos)
        for name, st in _resharding_targets(full).items():
            try:
                Checkpointer(knobs=_BLOCK_KNOBS).load(d, {"m": st}, no_dist=True)
            except CorruptCheckpointError as e:
                assert "'m'" in str(e) and file in str(e), (name, str(e))
                continue
            # loaded: it must be exact, and it must not have read the damaged block
            assert torch.equal(st.data, _slice_of(full, st)), (name, pos)
        with pytest.raises(CorruptCheckpointError, match=rf"(?s){re.escape(file)}.*'m'"):
            shardsafe.verify(d)
        flip_byte(d, file, spec.byte_range[0] + pos)  # undo
