"""What a save promises: commit last, no clobbering, clean failures, valid safetensors files,
JSON values (pickle only on request), and bit-exact round trips of every dtype and layout."""

from __future__ import annotations

import errno
import json
import math
import os
import re
import struct
from collections import OrderedDict
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import xxhash
from safetensors import safe_open
from torch import nn

import shardsafe
from shardsafe import (
    Checkpointer,
    CheckpointError,
    CheckpointExistsError,
    DtypeMismatchError,
    MissingKeyError,
    PickleNotAllowedError,
    ShapeMismatchError,
    ShardedTensor,
    StorageError,
)
from shardsafe.format.file_index import SUMS_ENTRY
from shardsafe.storage import local as local_storage
from shardsafe.storage.local import LocalStorage

from .helpers import run_ranks

META = "metadata.json"


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


def assert_bitexact(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype, (got.dtype, want.dtype)
    assert got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(_bytes(got), _bytes(want))


def _snapshot(d: Path) -> dict[str, bytes]:
    """Every plain file under ``d`` (relative path -> contents)."""
    out = {}
    for root, _dirs, files in os.walk(d):
        for f in files:
            p = Path(root) / f
            out[str(p.relative_to(d))] = p.read_bytes()
    return out


def _state_a() -> dict[str, Any]:
    g = torch.Generator().manual_seed(1)
    return {
        "w": torch.randn(6, 4, generator=g),
        "old_only": torch.randint(-100, 100, (5,), generator=g),
        "step": 1,
    }


def _state_b() -> dict[str, Any]:
    g = torch.Generator().manual_seed(2)
    return {"w": torch.randn(6, 4, generator=g), "new_only": torch.randn(3, generator=g).to(torch.bfloat16), "step": 2}


def _empty_like_state(state: dict[str, Any]) -> dict[str, Any]:
    return {k: torch.zeros_like(v) if isinstance(v, torch.Tensor) else None for k, v in state.items()}


def assert_loads(d: Path | str, state: dict[str, Any]) -> None:
    """``d`` loads into fresh targets, and unshards, to exactly ``state``."""
    target = _empty_like_state(state)
    Checkpointer().load(d, target)
    full = Checkpointer().unshard(d)
    assert set(full) == set(state)
    for k, want in state.items():
        if isinstance(want, torch.Tensor):
            assert_bitexact(target[k], want)
            assert_bitexact(full[k], want)
        else:
            assert target[k] == want and full[k] == want


# --- committed checkpoints are never clobbered -----------------------------------------------


def test_save_refuses_an_existing_checkpoint(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, _state_a())
    before = _snapshot(d)
    with pytest.raises(CheckpointExistsError, match=rf"(?s){re.escape(str(d))}.*save_overwrite=True") as info:
        Checkpointer().save(d, _state_b())
    assert isinstance(info.value, FileExistsError)
    with pytest.raises(CheckpointExistsError):
        Checkpointer().save(d, _state_b(), save_overwrite=False)
    assert _snapshot(d) == before
    assert_loads(d, _state_a())


def test_save_into_a_folder_without_metadata_is_allowed(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    d.mkdir()
    (d / "notes.txt").write_text("mine")
    meta, _ = Checkpointer().save(d, _state_a())
    assert sorted(os.listdir(d)) == sorted([META, "notes.txt", *meta.data_files()])
    assert_loads(d, _state_a())


def test_overwrite_replaces_and_removes_only_old_data_files(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    old_meta, _ = Checkpointer().save(d, _state_a())
    old_files = old_meta.data_files()
    user_files = {
        "notes.txt": b"my notes",
        "mine.safetensors": b"not ours",
        "shard-r00000-nothex.safetensors": b"looks like ours, is not",
        ".hidden": b"dot file",
    }
    for name, data in user_files.items():
        (d / name).write_bytes(data)
    (d / "sub").mkdir()
    (d / "sub" / "nested.bin").write_bytes(b"nested")

    new_meta, files = Checkpointer().save(d, _state_b(), save_overwrite=True)

    assert_loads(d, _state_b())
    assert set(Checkpointer().get_metadata(d).tensors) == {"w", "new_only"}
    new_files = new_meta.data_files()
    assert new_files.isdisjoint(old_files)
    assert files == [str(d / f) for f in sorted(new_files)]
    assert sorted(os.listdir(d)) == sorted([META, "sub", *new_files, *user_files])
    for name, data in user_files.items():
        assert (d / name).read_bytes() == data
    assert (d / "sub" / "nested.bin").read_bytes() == b"nested"
    assert shardsafe.verify(d).ok


def test_overwrite_twice_keeps_only_the_last(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, _state_a())
    Checkpointer().save(d, _state_b(), save_overwrite=True)
    meta, _ = Checkpointer().save(d, _state_a(), save_overwrite=True)
    assert sorted(os.listdir(d)) == sorted([META, *meta.data_files()])
    assert_loads(d, _state_a())


def test_overwrite_with_only_values_removes_all_data_files(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, _state_a())
    meta, files = Checkpointer().save(d, {"step": 3}, save_overwrite=True)
    assert meta.data_files() == set() and files == []
    assert os.listdir(d) == [META]
    assert Checkpointer().unshard(d) == {"step": 3}


# --- failed saves leave the committed checkpoint alone ---------------------------------------


def _fail_after(n: int, exc: BaseException):
    """A replacement for the local writer's ``write`` that raises from its ``n``-th call on."""
    real = local_storage._FileWriter.write
    calls = [0]

    def write(self, data) -> None:
        calls[0] += 1
        if calls[0] >= n:
            raise exc
        real(self, data)

    return write


def _broken_put_atomic(self, name, data, *, overwrite, if_match=None):
    raise StorageError(f"{self.root}/{name}: cannot write: Read-only file system")


_FAILURES: dict[str, tuple[Any, type[BaseException], str]] = {
    # name: (how to fail, expected error, pattern of its message)
    "complex-without-pickle": ({"bad": {1, 2j}}, PickleNotAllowedError, r"(?s)'bad\.<element>' is a complex.*allow_pickle=True"),
    "tensor-in-a-tuple": ({"bad": (1, torch.ones(1))}, PickleNotAllowedError, r"'bad\[1\]' is a torch.Tensor inside a list"),
    "unstorable-dtype": ({"bad": torch.zeros(2, dtype=torch.complex128)}, DtypeMismatchError, r"(?s)(?=.*'bad').*complex128"),
    "meta-tensor": ({"bad": torch.empty(2, device="meta")}, CheckpointError, r"(?s)'bad'.*meta"),
    "non-str-key": ({1: torch.zeros(2)}, CheckpointError, "keys must be non-empty strings"),
    "disk-full-after-header": ("write", StorageError, "No space left on device"),
    "disk-full-in-data": ("write-late", StorageError, "No space left on device"),
    "writer-bug": ("write-runtime", RuntimeError, "writer exploded"),
    "commit-fails": ("commit", StorageError, "Read-only file system"),
}


def _arrange_failure(how: Any, monkeypatch: pytest.MonkeyPatch, state: dict[str, Any]) -> None:
    if isinstance(how, dict):
        state.update(how)
    elif how == "write":
        monkeypatch.setattr(local_storage._FileWriter, "write", _fail_after(2, OSError(errno.ENOSPC, "No space left on device")))
    elif how == "write-late":
        monkeypatch.setattr(local_storage._FileWriter, "write", _fail_after(3, OSError(errno.ENOSPC, "No space left on device")))
    elif how == "write-runtime":
        monkeypatch.setattr(local_storage._FileWriter, "write", _fail_after(2, RuntimeError("writer exploded")))
    elif how == "commit":
        monkeypatch.setattr(LocalStorage, "put_atomic", _broken_put_atomic)


@pytest.mark.parametrize("case", list(_FAILURES))
def test_failed_overwrite_keeps_the_committed_checkpoint(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, _state_a())
    (d / "notes.txt").write_bytes(b"mine")
    before = _snapshot(d)

    how, error, pattern = _FAILURES[case]
    state = _state_b()
    _arrange_failure(how, monkeypatch, state)
    with pytest.raises(error, match=pattern):
        Checkpointer().save(d, state, save_overwrite=True)
    monkeypatch.undo()

    assert _snapshot(d) == before  # no new data file, nothing old touched
    assert_loads(d, _state_a())
    assert shardsafe.verify(d).ok


@pytest.mark.parametrize("case", list(_FAILURES))
def test_failed_save_into_a_fresh_folder_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    d = tmp_path / "ckpt"
    how, error, pattern = _FAILURES[case]
    state = _state_b()
    _arrange_failure(how, monkeypatch, state)
    with pytest.raises(error, match=pattern):
        Checkpointer().save(d, state)
    monkeypatch.undo()
    assert not d.exists() or _snapshot(d) == {}
    with pytest.raises(shardsafe.IncompleteCheckpointError):
        Checkpointer().get_metadata(d)


def test_save_is_committed_by_metadata_written_last(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """When ``metadata.json`` is written, every data file it names is already complete."""
    d = tmp_path / "ckpt"
    seen: dict[str, dict[str, bytes]] = {}
    real = LocalStorage.put_atomic

    def spy(self, name, data, *, overwrite, if_match=None):
        seen[name] = _snapshot(d)
        real(self, name, data, overwrite=overwrite, if_match=if_match)

    monkeypatch.setattr(LocalStorage, "put_atomic", spy)
    meta, _ = Checkpointer().save(d, _state_a())
    assert list(seen) == [META]
    assert set(seen[META]) == meta.data_files()
    for f in meta.data_files():
        assert seen[META][f] == (d / f).read_bytes()


# --- data files are plain safetensors files --------------------------------------------------


def _expected_chunk(source: torch.Tensor, spec) -> torch.Tensor:
    box = source[tuple(slice(o, o + n) for o, n in zip(spec.global_offset, spec.local_shape))]
    if spec.flattened_range is not None:
        return box.reshape(-1)[spec.flattened_range[0] : spec.flattened_range[1]]
    return box


def assert_data_files_match(d: Path, meta, sources: dict[str, torch.Tensor]) -> int:
    """Every data file opens with ``safe_open`` and holds exactly the chunks the metadata
    names, each bit-exact against its slice of the source. Returns the number of chunks."""
    by_file: dict[str, dict[str, torch.Tensor]] = {}
    for key, tm in meta.tensors.items():
        for file, spec in tm.chunks():
            by_file.setdefault(file, {})[spec.name] = _expected_chunk(sources[key], spec)
    assert set(by_file) == meta.data_files()
    n = 0
    block = meta.checksum.block_bytes
    for file, chunks in by_file.items():
        with safe_open(str(d / file), framework="pt") as f:
            assert set(f.keys()) == set(chunks) | {SUMS_ENTRY}  # and the digests of their blocks
            assert f.metadata()["format"] == "pt"
            for name, want in chunks.items():
                got = f.get_tensor(name)
                if got.shape != want.shape and got.dim() == 1 and got.numel() == want.numel():  # a flattened range over its whole box
                    got = got.reshape(want.shape)
                assert_bitexact(got, want.contiguous())
                n += 1
            sums = f.get_tensor(SUMS_ENTRY).numpy().tobytes()
        digests: list[int] = []
        for _name, want in _entries_in_file_order(d / file, chunks):
            raw = want.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if want.numel() else b""
            digests += [xxhash.xxh3_64_intdigest(raw[i : i + block]) for i in range(0, len(raw), block)]
        assert sums == struct.pack(f"<{len(digests)}Q", *digests), file
    return n


def _entries_in_file_order(path: Path, chunks: dict[str, torch.Tensor]) -> list[tuple[str, torch.Tensor]]:
    with open(path, "rb") as fh:
        (n,) = struct.unpack("<Q", fh.read(8))
        header = json.loads(fh.read(n))
    return sorted(chunks.items(), key=lambda kv: header[kv[0]]["data_offsets"][0])


def test_data_files_open_with_safetensors(tmp_path: Path) -> None:
    g = torch.Generator().manual_seed(3)
    w = torch.randn(4, 6, generator=g)
    sources = {
        "w": w,
        "ids": torch.randint(0, 1000, (9,), generator=g),
        "half": torch.randn(3, 2, 2, generator=g).to(torch.float16),
        "scalar": torch.tensor(2.5),
        "mask": torch.rand(5, generator=g) > 0.5,
        "flat": torch.arange(12, dtype=torch.float32).reshape(3, 4),
    }
    state: dict[str, Any] = dict(sources)
    # a flat piece covering the whole box, as FSDP1 with one rank keeps it
    state["flat"] = ShardedTensor("flat", sources["flat"].reshape(-1).clone(), (3, 4), (0, 0), (3, 4), flattened_range=slice(0, 12))
    meta, _ = Checkpointer().save(tmp_path / "ckpt", state)
    assert assert_data_files_match(tmp_path / "ckpt", meta, sources) == len(sources)
    (spec,) = [s for _, s in meta.tensors["flat"].chunks()]
    assert spec.flattened_range is None and spec.local_shape == (3, 4)  # a range over the whole box is the box


def _save_sharded_rank(rank: int, world_size: int, d: str):
    w = torch.arange(48, dtype=torch.float32).reshape(8, 6) * 1.5
    flat = torch.arange(15, dtype=torch.int32).reshape(3, 5) - 7
    rep = torch.linspace(-1, 1, 10, dtype=torch.float64)
    rows = 8 // world_size
    cut = [0, 6, 15]
    state = {
        "w": ShardedTensor.from_rank_offsets("w", w[rank * rows : (rank + 1) * rows].clone(), (0, rank, world_size)),
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", flat.reshape(-1)[cut[rank] : cut[rank + 1]].clone(), (3, 5), flattened_range=slice(cut[rank], cut[rank + 1])
        ),
        "rep": rep.clone(),
        "step": 5,
    }
    meta, files = Checkpointer().save(d, state)
    return meta.to_json(), files


def test_sharded_data_files_open_with_safetensors(tmp_path: Path) -> None:
    """Two ranks, each with its own file: row shards, flat shards and a replicated tensor."""
    d = tmp_path / "ckpt"
    results = run_ranks(2, _save_sharded_rank, str(d))
    assert results[0][0] == results[1][0]  # every rank returns the committed metadata
    meta = Checkpointer().get_metadata(d)
    assert len(meta.data_files()) == 2
    assert sorted(results[0][1] + results[1][1]) == sorted(str(d / f) for f in meta.data_files())
    sources = {
        "w": torch.arange(48, dtype=torch.float32).reshape(8, 6) * 1.5,
        "flat": torch.arange(15, dtype=torch.int32).reshape(3, 5) - 7,
        "rep": torch.linspace(-1, 1, 10, dtype=torch.float64),
    }
    assert len(list(meta.tensors["w"].chunks())) == 2
    assert len(list(meta.tensors["flat"].chunks())) == 2
    assert len(list(meta.tensors["rep"].chunks())) == 1  # written once
    assert assert_data_files_match(d, meta, sources) == 5
    full = Checkpointer().unshard(d)
    for k, want in sources.items():
        assert_bitexact(full[k], want)
    assert full["step"] == 5


# --- non-tensor values -----------------------------------------------------------------------

JSON_VALUES: dict[str, Any] = {
    "int": 7,
    "negative": -3,
    "big_int": 2**70,
    "float": 0.1,
    "whole_float": 1.0,
    "negative_zero": -0.0,
    "tiny": 5e-324,
    "str": "héllo ✓ \"quoted\" \n",
    "empty_str": "",
    "true": True,
    "false": False,
    "none": None,
    "list": [1, [2, 3.5], {"a": None}, "x", False],
    "dict": {"x": {"y": [1.5, "z"]}, "": 0},
    "empty_list": [],
    "empty_dict": {},
}


def assert_same_value(got: Any, want: Any) -> None:
    """Equal, with the same types all the way down (True is not 1, 1.0 is not 1, -0.0 is not 0.0)."""
    assert type(got) is type(want), (got, want)
    if isinstance(want, float):
        if math.isnan(want):
            assert math.isnan(got)
        else:
            assert got == want and math.copysign(1.0, got) == math.copysign(1.0, want), (got, want)
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want)
        for a, b in zip(got, want):
            assert_same_value(a, b)
    elif isinstance(want, dict):
        assert list(got) == list(want)
        for k in want:
            assert_same_value(got[k], want[k])
    else:
        assert got == want


def test_json_values_round_trip(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    w = torch.randn(3, 3)
    meta, _ = Checkpointer().save(d, {"w": w, **JSON_VALUES})
    assert set(meta.objects) == set(JSON_VALUES)
    assert meta.pickled_objects == {}

    target: dict[str, Any] = {"w": torch.zeros(3, 3), **{k: "placeholder" for k in JSON_VALUES}}
    Checkpointer().load(d, target)
    assert_bitexact(target["w"], w)
    for k, v in JSON_VALUES.items():
        assert_same_value(target[k], v)

    full = Checkpointer().unshard(d)
    assert set(full) == {"w", *JSON_VALUES}
    for k, v in JSON_VALUES.items():
        assert_same_value(full[k], v)


def test_load_only_some_values(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, dict(JSON_VALUES))
    target = {"int": None, "list": None}
    Checkpointer().load(d, target)
    assert target == {"int": 7, "list": JSON_VALUES["list"]}


TAGGED_VALUES: dict[str, Any] = {  # JSON lacks them: stored as tagged JSON (docs/format.md §13), no pickle
    "tuple": (1, 2),
    "nested_tuple": [1, (2, "x")],
    "set": {1, 2, 3},
    "frozenset": frozenset({"a"}),
    "nan": float("nan"),
    "inf": float("inf"),
    "minus_inf": float("-inf"),
    "nan_in_list": [1.0, float("nan")],
    "int_keys": {1: "a"},
    "bytes": b"\x00\x01",
    "dtype": torch.float16,
    "odict": OrderedDict([("b", 1), ("a", (2.5, None))]),
    "np_float32": np.float32(0.1),
    "np_int64": np.int64(-7),
}


@pytest.mark.parametrize("key", list(TAGGED_VALUES))
def test_values_json_lacks_round_trip_without_pickle(tmp_path: Path, key: str) -> None:
    d = tmp_path / "ckpt"
    value = TAGGED_VALUES[key]
    meta, _ = Checkpointer().save(d, {"w": torch.ones(2), "plain": 3, key: value})
    assert meta.pickled_objects == {}
    assert set(meta.objects) == {"plain", key} and meta.objects["plain"] == 3

    target: dict[str, Any] = {"w": torch.zeros(2), "plain": None, key: None}
    Checkpointer().load(d, target)
    assert_bitexact(target["w"], torch.ones(2))
    assert_same_value(target[key], value)
    assert_same_value(Checkpointer().unshard(d)[key], value)


PICKLE_VALUES: dict[str, tuple[Any, str]] = {  # value, the element named in the refusal
    "complex": (1 + 2j, "'complex' is a complex"),
    "fraction_in_tuple": ((1, Fraction(1, 3)), r"'fraction_in_tuple\[1\]' is a fractions.Fraction"),
    "in_odict": (OrderedDict(x={"y": [1j]}), r"'in_odict.x.y\[0\]' is a complex"),
}


@pytest.mark.parametrize("key", list(PICKLE_VALUES))
def test_values_needing_pickle_are_refused_by_default(tmp_path: Path, key: str) -> None:
    d = tmp_path / "ckpt"
    value, named = PICKLE_VALUES[key]
    with pytest.raises(PickleNotAllowedError, match=rf"(?s){named}, which has no JSON form.*allow_pickle=True to store '{key}'") as info:
        Checkpointer().save(d, {"w": torch.zeros(2), key: value})
    assert isinstance(info.value, TypeError)
    assert not (d / META).exists()
    assert not d.exists() or os.listdir(d) == []


@pytest.mark.parametrize("key", list(PICKLE_VALUES))
def test_values_needing_pickle_round_trip_when_allowed(tmp_path: Path, key: str) -> None:
    d = tmp_path / "ckpt"
    value = PICKLE_VALUES[key][0]
    meta, _ = Checkpointer(allow_pickle=True).save(d, {"w": torch.ones(2), "plain": 3, "t": (1, 2), key: value})
    assert set(meta.pickled_objects) == {key}
    assert meta.objects == {"plain": 3, "t": {"__shardsafe__": "tuple", "items": [1, 2]}}  # pickle only where the tags cannot hold the value

    target: dict[str, Any] = {"w": torch.zeros(2), "plain": None, key: None}
    Checkpointer(allow_pickle=True).load(d, target)
    assert_bitexact(target["w"], torch.ones(2))
    assert target["plain"] == 3
    assert_same_value(target[key], value)
    full = Checkpointer(allow_pickle=True).unshard(d)
    assert_same_value(full[key], value)

    # a default Checkpointer refuses to unpickle
    with pytest.raises(PickleNotAllowedError, match=rf"(?s){key}.*pickle.*allow_pickle=True"):
        Checkpointer().load(d, {key: None})
    with pytest.raises(PickleNotAllowedError, match=rf"(?s){key}.*allow_pickle=True"):
        Checkpointer().unshard(d)
    # ... but loads what needs no pickle
    target = {"w": torch.zeros(2), "plain": None}
    Checkpointer().load(d, target)
    assert_bitexact(target["w"], torch.ones(2))
    assert target["plain"] == 3


# --- load errors -----------------------------------------------------------------------------


@pytest.fixture
def saved(tmp_path: Path) -> Path:
    d = tmp_path / "ckpt"
    Checkpointer().save(d, {"w": torch.arange(12, dtype=torch.float32).reshape(4, 3), "step": 9})
    return d


def test_missing_tensor_key(saved: Path) -> None:
    target = {"w": torch.zeros(4, 3), "nope": torch.zeros(3)}
    with pytest.raises(MissingKeyError, match=r"(?s)'nope'.*not in the checkpoint") as info:
        Checkpointer().load(saved, target)
    assert isinstance(info.value, KeyError)
    assert str(info.value).count("'nope'") == 1  # not quoted again, as KeyError would


def test_missing_value_key(saved: Path) -> None:
    with pytest.raises(MissingKeyError, match=r"(?s)'epoch'.*not in the checkpoint"):
        Checkpointer().load(saved, {"epoch": 0})


def test_tensor_key_loaded_as_value(saved: Path) -> None:
    with pytest.raises(MissingKeyError, match=r"(?s)'w'.*a tensor"):
        Checkpointer().load(saved, {"w": None})


@pytest.mark.parametrize("shape", [(3, 4), (4,), (4, 3, 1), (12,), ()])
def test_wrong_global_shape(saved: Path, shape: tuple[int, ...]) -> None:
    target = torch.full(shape, -1.0)
    with pytest.raises(ShapeMismatchError, match=rf"(?s)'w'.*\[4, 3\].*{re_list(shape)}") as info:
        Checkpointer().load(saved, {"w": target})
    assert isinstance(info.value, ValueError)
    assert torch.equal(target, torch.full(shape, -1.0))  # untouched


def re_list(shape: tuple[int, ...]) -> str:
    return r"\[" + ", ".join(map(str, shape)) + r"\]"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.uint8])
def test_wrong_dtype(saved: Path, dtype: torch.dtype) -> None:
    name = str(dtype).removeprefix("torch.")
    target = torch.zeros(4, 3, dtype=dtype)
    with pytest.raises(DtypeMismatchError, match=rf"(?s)'w'.*float32.*{name}") as info:
        Checkpointer().load(saved, {"w": target})
    assert isinstance(info.value, TypeError)
    assert not target.any()


# --- dtypes and layouts ----------------------------------------------------------------------

DTYPES = [
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int64,
    torch.int32,
    torch.int16,
    torch.int8,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
    torch.float8_e5m2,
    torch.uint16,
    torch.uint32,
    torch.uint64,
    torch.complex64,
]


def _sample(dtype: torch.dtype, shape: tuple[int, ...] = (5, 7)) -> torch.Tensor:
    g = torch.Generator().manual_seed(4)
    if dtype == torch.bool:
        return torch.rand(shape, generator=g) > 0.5
    if dtype.is_complex:
        return torch.randn(shape, generator=g, dtype=dtype)
    if dtype.is_floating_point:
        t = (torch.randn(shape, generator=g) * 100).to(dtype)
        flat = t.view(-1)
        flat[:4] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0]).to(dtype)
        return t
    # integers: random bit patterns over the full range, with the extremes included
    n = math.prod(shape) * dtype.itemsize
    raw = torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8)
    raw[: dtype.itemsize] = 0xFF
    raw[dtype.itemsize : 2 * dtype.itemsize] = 0x7F
    return raw.view(dtype).reshape(shape)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
def test_every_dtype_round_trips_bit_exact(tmp_path: Path, dtype: torch.dtype) -> None:
    d = tmp_path / "ckpt"
    src = _sample(dtype)
    meta, _ = Checkpointer().save(d, {"x": src})
    assert meta.tensors["x"].dtype == str(dtype).removeprefix("torch.")
    target = torch.zeros(5, 7, dtype=dtype)
    Checkpointer().load(d, {"x": target})
    assert_bitexact(target, src)
    assert_bitexact(Checkpointer().unshard(d)["x"], src)
    assert_data_files_match(d, meta, {"x": src})
    assert shardsafe.verify(d).ok


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64, torch.bool, torch.bfloat16])
def test_zero_dim_tensors_round_trip(tmp_path: Path, dtype: torch.dtype) -> None:
    d = tmp_path / "ckpt"
    src = {
        torch.float32: torch.tensor(-2.75),
        torch.bfloat16: torch.tensor(-2.75, dtype=torch.bfloat16),
        torch.int64: torch.tensor(-(2**40) - 3),
        torch.bool: torch.tensor(True),
    }[dtype]
    meta, _ = Checkpointer().save(d, {"s": src})
    assert meta.tensors["s"].shape == ()
    target = torch.zeros((), dtype=dtype)
    Checkpointer().load(d, {"s": target})
    assert_bitexact(target, src)
    assert_bitexact(Checkpointer().unshard(d)["s"], src)
    assert_data_files_match(d, meta, {"s": src})


@pytest.mark.parametrize("shape", [(0,), (3, 0), (0, 4, 2), (2, 0, 5)])
def test_empty_tensors_round_trip(tmp_path: Path, shape: tuple[int, ...]) -> None:
    d = tmp_path / "ckpt"
    w = torch.randn(2, 2)
    Checkpointer().save(d, {"e": torch.empty(shape, dtype=torch.bfloat16), "w": w})
    meta = Checkpointer().get_metadata(d)
    assert meta.tensors["e"].shape == shape
    assert meta.tensors["e"].dtype == "bfloat16"
    target = {"e": torch.empty(shape, dtype=torch.bfloat16), "w": torch.zeros(2, 2)}
    Checkpointer().load(d, target)
    assert target["e"].shape == shape
    assert_bitexact(target["w"], w)
    full = Checkpointer().unshard(d)
    assert full["e"].shape == shape and full["e"].dtype == torch.bfloat16
    assert shardsafe.verify(d).ok


def test_only_empty_tensors(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    meta, files = Checkpointer().save(d, {"e": torch.empty(0, 3)})
    assert files == [] and meta.data_files() == set()
    assert os.listdir(d) == [META]
    out = Checkpointer().unshard(d)
    assert out["e"].shape == (0, 3) and out["e"].dtype == torch.float32


@pytest.mark.parametrize("view", ["transposed", "stepped", "expanded", "offset", "permuted"])
def test_non_contiguous_sources_round_trip(tmp_path: Path, view: str) -> None:
    d = tmp_path / "ckpt"
    base = torch.randn(6, 8)
    src = {
        "transposed": lambda: base.t(),
        "stepped": lambda: base[:, ::3],
        "expanded": lambda: base[:, :1].expand(6, 5),
        "offset": lambda: base[2:5, 3:],
        "permuted": lambda: base.reshape(2, 3, 8).permute(2, 0, 1),
    }[view]()
    assert not src.is_contiguous()
    meta, _ = Checkpointer().save(d, {"x": src})
    target = torch.zeros(src.shape)
    Checkpointer().load(d, {"x": target})
    assert_bitexact(target, src)
    assert_data_files_match(d, meta, {"x": src})


@pytest.mark.parametrize("view", ["transposed", "stepped", "permuted"])
def test_non_contiguous_targets_are_filled_exactly(tmp_path: Path, view: str) -> None:
    d = tmp_path / "ckpt"
    src = torch.randn(4, 6, 5) if view == "permuted" else torch.randn(4, 6)
    Checkpointer().save(d, {"x": src})
    if view == "transposed":
        buf = torch.full((6, 4), 7.0)
        target = buf.t()
    elif view == "stepped":
        buf = torch.full((4, 12), 7.0)
        target = buf[:, ::2]
    else:
        buf = torch.full((5, 4, 6), 7.0)
        target = buf.permute(1, 2, 0)
    assert not target.is_contiguous() and target.shape == src.shape
    ptr = target.data_ptr()
    Checkpointer().load(d, {"x": target})
    assert target.data_ptr() == ptr
    assert_bitexact(target, src)
    if view == "stepped":  # the elements between the target's are not written
        assert torch.equal(buf[:, 1::2], torch.full((4, 6), 7.0))


def test_parameters_are_filled_in_place(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    src = nn.Parameter(torch.randn(4, 3))
    Checkpointer().save(d, {"p": src, "q": torch.randn(3)})
    p = nn.Parameter(torch.zeros(4, 3))
    q = nn.Parameter(torch.zeros(3), requires_grad=False)
    ptr_p, ptr_q = p.data_ptr(), q.data_ptr()
    state = {"p": p, "q": q}
    Checkpointer().load(d, state)
    assert state["p"] is p and state["q"] is q
    assert p.data_ptr() == ptr_p and q.data_ptr() == ptr_q
    assert_bitexact(p.detach(), src.detach())
    assert isinstance(p, nn.Parameter) and p.requires_grad and p.grad is None
    assert not q.requires_grad


def test_module_state_dict_loads_into_the_module(tmp_path: Path) -> None:
    d = tmp_path / "ckpt"
    src = nn.Linear(5, 3)
    Checkpointer().save(d, src.state_dict())
    dst = nn.Linear(5, 3)
    weight_ptr = dst.weight.data_ptr()
    Checkpointer().load(d, dst.state_dict())
    assert dst.weight.data_ptr() == weight_ptr
    assert_bitexact(dst.weight.detach(), src.weight.detach())
    assert_bitexact(dst.bias.detach(), src.bias.detach())
