"""Hostile or damaged input is refused inside the exception hierarchy, before anything is allocated.

Metadata and data-file headers are parsed by one strict JSON reader (no NaN, no byte order mark,
no duplicate keys, bounded nesting), every integer is an integer (not ``"12"``, ``12.0`` or
``true``) and bounded below 2**62, shapes are checked before any tensor is allocated from them,
data files must hold the bytes the metadata claims before ``unshard`` allocates, and a malformed
``optim.param_groups`` is named by group and field. Each case once raised ``RecursionError``,
``OverflowError``, ``RuntimeError``, ``TypeError`` or ``KeyError``, or was silently accepted.
"""

from __future__ import annotations

import json
import re
import struct
import weakref
from pathlib import Path
from typing import Any

import pytest
import torch
import xxhash

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, PickleNotAllowedError, ShardedTensor, ShardingError
from shardsafe.engine.buffers import Scratch
from shardsafe.storage import open_storage

from .helpers import run_ranks
from .sealing import reseal, seal

META = "metadata.json"


def _save(path: Path) -> str:
    d = str(path / "ckpt")
    Checkpointer().save(d, {"w": torch.arange(8, dtype=torch.float32).reshape(2, 4), "step": 3})
    return d


def _raw(d: str) -> str:
    return open_storage(d).read(META).decode()


def _put(d: str, raw: str | bytes) -> None:
    """Write edited metadata text; a text edit keeps a valid metadata_checksum, so the check under test fires."""
    open_storage(d).put_atomic(META, reseal(raw.encode()) if isinstance(raw, str) else raw, overwrite=True)


def _table(m: dict[str, Any]) -> dict[str, Any]:
    """The chunk table of tensor ``w`` (format v3)."""
    return m["tensors"]["w"]["table"]


def _edit(fn):
    """A damage that edits the parsed metadata."""

    def damage(raw: str) -> str:
        m = json.loads(raw)
        fn(m)
        return json.dumps(m)

    return damage


def _text(old: str, new: str):
    """A damage that replaces text in the raw metadata."""

    def damage(raw: str) -> str:
        assert raw.count(old) == 1
        return raw.replace(old, new)

    return damage


def _shape(shape: list[int]):
    """``w`` of ``shape``, stored as one chunk of that shape (its table says so too)."""

    def fn(m: dict[str, Any]) -> None:
        m["tensors"]["w"]["shape"] = shape
        _table(m).update(offset=[[[0, 0, 1]] for _ in shape], length=[[[n, 0, 1]] for n in shape])

    return _edit(fn)


def _set_run(column: str, run: list[Any]):
    """Column ``column`` of ``w``'s table (``offset`` and ``length``: its dimension 0) as the single run ``run``."""

    def fn(m: dict[str, Any]) -> None:
        if column == "file":
            _table(m)["file"] = [run]
        else:
            _table(m)[column][0] = [run]

    return _edit(fn)


_DAMAGE = {
    # name: (damage to the metadata text, pattern of the message)
    "deeply-nested-value": (_text('"step":3', '"step":' + "[" * 100_000 + "]" * 100_000), r"nest too deep"),
    "value-nested-65-deep": (_text('"step":3', '"step":' + "[" * 65 + "]" * 65), r"value 'step' nests .* deeper than 64"),
    "table-value-past-2**63": (_set_run("offset", [2**63, 0, 1]), r"'w': offset\[0\]: run \[9223372036854775808, 0, 1\] has values outside \[0, 2\*\*62\)"),
    "table-step-past-2**62": (_set_run("offset", [0, 2**62, 1]), r"'w': offset\[0\]: run \[0, 4611686018427387904, 1\] has values outside \[0, 2\*\*62\)"),
    "table-run-strings": (_set_run("length", ["2", "0", "1"]), r"'w': length\[0\]: each run must be \[first, step, count\] \(integers\), found \['2', '0', '1'\]"),
    "offset-bools": (_set_run("offset", [False, 0, 1]), r"'w': offset\[0\]: each run must be \[first, step, count\] \(integers\), found \[False, 0, 1\]"),
    "file-index-float": (_set_run("file", [0.0, 0, 1]), r"'w': file: each run must be \[first, step, count\] \(integers\), found \[0\.0, 0, 1\]"),
    "count-true": (_edit(lambda m: _table(m).update(count=True)), r"'w': count must be an integer >= 0, found True"),
    "shape-floats": (_edit(lambda m: m["tensors"]["w"].update(shape=[2.0, 4.0])), r"(?s)shape.*must hold integers, found 2\.0"),
    "is-sharded-int": (_edit(lambda m: m["tensors"]["w"].update(is_sharded=1)), r"(?s)is_sharded.*must be true or false, found 1"),
    "negative-shape": (_shape([-2, -4]), r"tensor 'w' has shape \[-2, -4\]: a negative dimension"),
    "shape-of-2**62-bytes": (_shape([2**60, 4]), r"tensor 'w' of shape \[1152921504606846976, 4\] would hold 2\*\*62 bytes"),
    "65-dims": (_shape([1] * 65), r"tensor 'w' has 65 dimensions; at most 64"),
    "nan": (_text('"step":3', '"step":NaN'), r"NaN is not a JSON number"),
    "infinity": (_text('"step":3', '"step":-Infinity'), r"-Infinity is not a JSON number"),
    "float-overflow": (_text('"step":3', '"step":1e999'), r"1e999 does not fit a finite float"),
    "byte-order-mark": (lambda raw: "\ufeff" + raw, r"byte order mark"),
    "utf-16": (lambda raw: raw.encode("utf-16"), r"not UTF-8"),
    "duplicate-key": (_text('"step":3', '"step":3,"step":4'), r"key 'step' appears twice in one object"),
    "empty-tensor-key": (_edit(lambda m: m["tensors"].update({"": m["tensors"].pop("w")})), r"an empty key in 'tensors'"),
    "empty-value-key": (_text('"step":3', '"":3'), r"an empty key in 'objects'"),
    "file-name-with-newline": (lambda raw: raw.replace('.safetensors"', '.safetensors\\n"'), r"names data file '.*\.safetensors\\n', which is not a plain file name"),
}


@pytest.mark.parametrize("case", list(_DAMAGE))
def test_damaged_metadata_is_corrupt_everywhere(tmp_path: Path, case: str) -> None:
    d = _save(tmp_path)
    damage, pattern = _DAMAGE[case]
    _put(d, damage(_raw(d)))
    operations = {
        "get_metadata": lambda: Checkpointer().get_metadata(d, no_dist=True),
        "load": lambda: Checkpointer().load(d, {"w": torch.zeros(2, 4)}, no_dist=True),
        "unshard": lambda: Checkpointer().unshard(d, no_dist=True),
        "unshard_to_safetensors": lambda: shardsafe.unshard_to_safetensors(d, tmp_path / "out.safetensors"),
        "verify": lambda: shardsafe.verify(d),
    }
    for op, call in operations.items():
        with pytest.raises(CorruptCheckpointError, match=pattern) as info:
            call()
        assert f"{d}/{META}" in str(info.value), op


def _rewrite_data_file(d: str, header: bytes, data: bytes | None = None, *, size: int | None = None) -> str:
    """Replace the data file's JSON header by ``header`` (its data section kept, or ``data``),
    and make ``metadata.json``'s file table agree with the new file (size, or ``size``; header
    length and digest), as a crafted checkpoint would: what is under test is then what the
    header says, not its digest."""
    (file,) = Checkpointer().get_metadata(d, no_dist=True).data_files()
    store = open_storage(d)
    raw = store.read(file)
    (n,) = struct.unpack("<Q", raw[:8])
    damaged = struct.pack("<Q", len(header)) + header + (raw[8 + n :] if data is None else data)
    store.put_atomic(file, damaged, overwrite=True)
    m = json.loads(_raw(d))
    (entry,) = m["file_table"]
    assert entry["name"] == file
    entry.update(
        size=len(damaged) if size is None else size,
        header_bytes=8 + len(header),
        header=f"{xxhash.xxh3_64_intdigest(damaged[: 8 + len(header)]):016x}",
    )
    _put(d, seal(m))
    return file


def _header(d: str) -> dict[str, Any]:
    (file,) = Checkpointer().get_metadata(d, no_dist=True).data_files()
    raw = open_storage(d).read(file)
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n])


@pytest.mark.parametrize("op", ["unshard", "unshard_to_safetensors"])
def test_sizes_beyond_the_stored_bytes_are_refused_before_allocating(tmp_path: Path, op: str) -> None:
    """Valid-looking metadata and data-file header for a 16 TiB tensor (digests recomputed to
    match): the data file is 200 bytes long, so nothing of that size is allocated; the error
    names the key, the file and what it lacks."""
    d = _save(tmp_path)

    def big_blocks(m: dict[str, Any]) -> None:  # 16 blocks of 1 TiB
        m["checksum"]["block_bytes"] = 2**40

    _put(d, _edit(big_blocks)(_shape([2**40, 4])(_raw(d))))
    h = _header(d)
    h["w"].update(shape=[2**40, 4], data_offsets=[0, 2**44])
    h["__shardsafe_checksums__"].update(shape=[16], data_offsets=[2**44, 2**44 + 16 * 8])
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    file = _rewrite_data_file(d, text, size=8 + len(text) + 2**44 + 128)
    start, length = 8 + len(text) + 2**44, (tmp_path / "ckpt" / file).stat().st_size
    call = {
        "unshard": lambda: Checkpointer().unshard(d, no_dist=True),
        "unshard_to_safetensors": lambda: shardsafe.unshard_to_safetensors(d, tmp_path / "out.safetensors"),
    }[op]
    with pytest.raises(
        CorruptCheckpointError, match=rf"key 'w': .*{file}: truncated: needed bytes \[{start}, {start + 128}\) but the file has {length} bytes"
    ):
        call()
    assert not (tmp_path / "out.safetensors").exists()


def _two_rows(m: dict[str, Any]) -> None:
    """``w`` (2 x 4) as two chunks of one row each."""
    m["tensors"]["w"]["table"] = {"count": 2, "file": [[0, 0, 2]], "offset": [[[0, 1, 2]], [[0, 0, 2]]], "length": [[[1, 0, 2]], [[4, 0, 2]]]}


def _rows_header(first: list[int], second: list[int], sums: list[int]):
    def fn(h: dict[str, Any]) -> None:
        del h["w"]
        h["w@0,0"] = {"dtype": "F32", "shape": [1, 4], "data_offsets": first}
        h["w@1,0"] = {"dtype": "F32", "shape": [1, 4], "data_offsets": second}
        h["__shardsafe_checksums__"] = {"dtype": "U8", "shape": [sums[1] - sums[0]], "data_offsets": sums}

    return fn


_CRAFTED = {
    # name: (change to the metadata, change to the data file's header; pattern of the message)
    "chunks-share-bytes": (_two_rows, _rows_header([0, 16], [8, 24], [24, 40]), r"entry 'w@1,0' starts at byte \d+, expected \d+: entries must be back to back"),
    "gap-between-chunks": (_two_rows, _rows_header([0, 16], [24, 40], [40, 56]), r"entry 'w@1,0' starts at byte \d+, expected \d+: entries must be back to back"),
    "entries-end-before-the-file": (None, lambda h: h["__shardsafe_checksums__"].update(data_offsets=[32, 39], shape=[7]), r"the entries end at byte \d+, the file is \d+ bytes"),
    "no-checksum-entry": (None, lambda h: h.update(v=h.pop("__shardsafe_checksums__")), r"the last entry must be '__shardsafe_checksums__'"),
    "checksum-entry-too-short": (
        lambda m: m["checksum"].update(block_bytes=16),
        lambda h: None,
        r"'__shardsafe_checksums__' holds 8 bytes, expected 16 for 2 block\(s\)",
    ),
    "entry-without-offsets": (None, lambda h: h["w"].pop("data_offsets"), r"entry 'w' has no valid data_offsets"),
    "offsets-past-2**63": (None, lambda h: h["w"].update(data_offsets=[2**63, 2**63 + 32]), r"starts at byte \d+, expected \d+: entries must be back to back"),
    "entry-size-differs": (None, lambda h: h["w"].update(shape=[2, 2], data_offsets=[0, 16]) or h["__shardsafe_checksums__"].update(data_offsets=[16, 24]), r"tensor 'w': entry 'w' holds 16 bytes, the chunk needs 32"),
}


@pytest.mark.parametrize("case", list(_CRAFTED))
def test_crafted_data_file_header_is_corrupt(tmp_path: Path, case: str) -> None:
    """Format v3 reads each chunk's place in its file from the file's header: a header with
    matching digests (as a crafted checkpoint has) that places chunks on shared bytes, leaves
    gaps, or disagrees with the metadata is refused by every reader, naming the file."""
    d = _save(tmp_path)
    meta_change, header_change, pattern = _CRAFTED[case]
    if meta_change is not None:
        _put(d, _edit(meta_change)(_raw(d)))
    h = _header(d)
    header_change(h)
    text = json.dumps(h, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    data = None
    if case == "entry-size-differs":  # 16 bytes of w, then its (one) digest
        raw = open_storage(d).read(Checkpointer().get_metadata(d, no_dist=True).data_files().pop())
        body = raw[8 + struct.unpack("<Q", raw[:8])[0] :]
        data = body[:16] + body[32:]
    file = _rewrite_data_file(d, text, data)
    operations = {
        "load": lambda: Checkpointer().load(d, {"w": torch.zeros(2, 4)}, no_dist=True),
        "unshard": lambda: Checkpointer().unshard(d, no_dist=True),
        "unshard_to_safetensors": lambda: shardsafe.unshard_to_safetensors(d, tmp_path / "out.safetensors"),
        "verify": lambda: shardsafe.verify(d),
    }
    for op, call in operations.items():
        with pytest.raises(CorruptCheckpointError, match=rf"{file}.*{pattern}") as info:
            call()
        assert file in str(info.value), op
    report = shardsafe.verify(d, collect_all=True)
    assert len(report.errors) == 1 and file in report.errors[0] and re.search(pattern, report.errors[0])


def _replace_in_header(d: str, old: bytes, new: bytes) -> str:
    """Rewrite the data file with ``old`` replaced by ``new`` in its JSON header (the header
    length changes; the header is what is under test, so the data offsets are left as they were).
    The metadata's size, header length and header digest of the file are updated to match, as a
    crafted checkpoint would have them, so that the header parser is what refuses it."""
    (file,) = Checkpointer().get_metadata(d, no_dist=True).data_files()
    raw = open_storage(d).read(file)
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n]
    assert header.count(old) == 1
    return _rewrite_data_file(d, header.replace(old, new))


@pytest.mark.parametrize(
    "new, pattern",
    [
        (b'"format":' + b"[" * 100_000 + b"]" * 100_000, r"nest too deep"),
        (b'"format":' + b"[" * 65 + b"]" * 65, r"nests arrays and objects deeper than 64"),
        (b'"format":NaN', r"NaN is not a JSON number"),
        (b'"format":"pt","format":"pt"', r"key 'format' appears twice in one object"),
    ],
    ids=["deep", "65-deep", "nan", "duplicate-key"],
)
def test_damaged_data_file_header_is_corrupt(tmp_path: Path, new: bytes, pattern: str) -> None:
    d = _save(tmp_path)
    file = _replace_in_header(d, b'"format":"pt"', new)
    with pytest.raises(CorruptCheckpointError, match=rf"{file}: not a valid safetensors file: .*{pattern}"):
        shardsafe.verify(d)
    report = shardsafe.verify(d, collect_all=True)
    assert len(report.errors) == 1 and file in report.errors[0]


# --- values too deep to read back are refused at save ----------------------------------------


def test_value_nested_64_deep_round_trips_and_65_is_refused_at_save(tmp_path: Path) -> None:
    deep: Any = 1
    for _ in range(64):
        deep = [deep]
    Checkpointer().save(str(tmp_path / "ok"), {"v": deep})
    assert Checkpointer().unshard(str(tmp_path / "ok"), no_dist=True) == {"v": deep}
    with pytest.raises(PickleNotAllowedError, match=r"key 'v': .*nested at most 64 deep"):
        Checkpointer().save(str(tmp_path / "deep"), {"v": [deep]})
    cycle: list[Any] = []
    cycle.append(cycle)
    with pytest.raises(PickleNotAllowedError, match=r"key 'c'"):
        Checkpointer().save(str(tmp_path / "cycle"), {"c": cycle})


# --- optim.param_groups ----------------------------------------------------------------------


def _optim_checkpoint(tmp_path: Path) -> tuple[str, torch.nn.Module]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    optim = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": 0.5}], lr=0.1, momentum=0.9
    )
    model(torch.randn(2, 4)).sum().backward()
    optim.step()
    d = str(tmp_path / "ckpt")
    shardsafe.save_model_and_optim_state(d, model, optim)
    return d, model


def _set_groups(fn):
    def damage(m: dict[str, Any]) -> None:
        m["objects"]["optim.param_groups"] = fn(m["objects"]["optim.param_groups"])

    return _edit(damage)


def _with(gi: int, **fields):
    def fn(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
        groups[gi].update(fields)
        return groups

    return fn


def _without_params(groups: list[dict[str, Any]]) -> list[dict[str, Any]]:
    del groups[1]["params"]
    return groups


_GROUPS = {
    # name: (new param groups from the stored ones, pattern)
    "an-object": (lambda g: {"0": g[0]}, r"'optim.param_groups' must be a list of param groups, found a dict"),
    "group-a-number": (lambda g: [g[0], 3], r"'optim.param_groups' group 1 must be an object of hyper-parameters and 'params', found the number 3"),
    "no-params": (_without_params, r"'optim.param_groups' group 1, field 'params' must be a list of parameter names, found nothing"),
    "params-ints": (_with(0, params=[0, 1]), r"group 0, field 'params' must be a list of parameter names, found a list"),
    "param-in-two-groups": (lambda g: _with(1, params=[*g[1]["params"], g[0]["params"][0]])(g), r"group 1, field 'params' lists parameter '0.weight' and so does group 0"),
    "param-twice": (lambda g: _with(0, params=[*g[0]["params"], g[0]["params"][0]])(g), r"group 0, field 'params' lists parameter '0.weight' twice"),
}


@pytest.mark.parametrize("case", list(_GROUPS))
def test_malformed_param_groups_are_named_by_group_and_field(tmp_path: Path, case: str) -> None:
    d, model = _optim_checkpoint(tmp_path)
    fn, pattern = _GROUPS[case]
    _put(d, _set_groups(fn)(_raw(d)))
    with pytest.raises(CorruptCheckpointError, match=pattern) as info:
        shardsafe.unshard_optim_state(d)
    assert d in str(info.value)
    optim = torch.optim.SGD([{"params": model[0].parameters()}, {"params": model[1].parameters()}], lr=1.0, momentum=0.0)
    with pytest.raises(CorruptCheckpointError, match=pattern):
        shardsafe.load_model_and_optim_state(d, model, optim)


def test_hyper_parameter_kept_as_a_tensor_must_be_stored_as_a_number(tmp_path: Path) -> None:
    d, model = _optim_checkpoint(tmp_path)
    _put(d, _set_groups(_with(1, lr="fast"))(_raw(d)))
    before = [p.detach().clone() for p in model.parameters()]
    optim = torch.optim.SGD(
        [{"params": model[0].parameters()}, {"params": model[1].parameters(), "lr": torch.tensor(0.3)}], lr=1.0, momentum=0.9
    )
    with pytest.raises(CorruptCheckpointError, match=r"'optim.param_groups' group 1, field 'lr': the optimizer holds a tensor of 1 element\(s\) there, the checkpoint a str"):
        shardsafe.load_model_and_optim_state(d, model, optim)
    # refused before anything was loaded
    assert all(torch.equal(a, b) for a, b in zip(before, [p.detach() for p in model.parameters()]))
    assert float(optim.param_groups[1]["lr"]) == pytest.approx(0.3)



# --- load targets are the caller's memory ----------------------------------------------------


def test_sharded_tensor_target_that_needs_a_copy_is_refused(tmp_path: Path) -> None:
    """A ShardedTensor whose data cannot be viewed in its local_shape (a transposed buffer)
    was reshaped into a copy, which the load filled: the caller's tensor stayed zero."""
    d = str(tmp_path / "ckpt")
    transposed = torch.arange(8, dtype=torch.float32).reshape(2, 4).t()  # (4, 2): not viewable as (2, 4)
    w = transposed.reshape(2, 4)  # what the piece holds: its elements in order, in the local shape
    Checkpointer().save(d, {"w": ShardedTensor("w", transposed, (2, 4), (0, 0), (2, 4))})  # a save may copy
    target = torch.zeros(2, 4).t()
    with pytest.raises(ShardingError, match=r"key 'w': a tensor of shape \[4, 2\] and strides \[1, 4\] cannot be viewed as shape \[2, 4\]"):
        Checkpointer().load(d, {"w": ShardedTensor("w", target, (2, 4), (0, 0), (2, 4))})
    assert not target.any()
    flat = torch.zeros(8)
    Checkpointer().load(d, {"w": ShardedTensor("w", flat, (2, 4), (0, 0), (2, 4))})  # a view: filled in place
    assert torch.equal(flat.view(2, 4), w)
    assert torch.equal(Checkpointer().unshard(d, no_dist=True)["w"], w)


# --- tensor subclasses: known, carrying their own flat spec, or refused --------------------------


class Foreign(torch.Tensor):
    """A tensor subclass shardsafe knows nothing about."""


class ForeignParameter(torch.nn.Parameter):
    pass


def test_unknown_tensor_subclass_is_refused_naming_key_and_class(tmp_path: Path) -> None:
    d = str(tmp_path / "ckpt")
    foreign = torch.arange(4.0).as_subclass(Foreign)
    pattern = r"key 'w': a tests\.test_validation\.Foreign is a torch\.Tensor subclass shardsafe does not know"
    with pytest.raises(ShardingError, match=pattern):
        Checkpointer().save(d, {"w": foreign})
    Checkpointer().save(d, {"w": torch.arange(4.0), "p": torch.nn.Parameter(torch.ones(2))})  # known: saved
    with pytest.raises(ShardingError, match=pattern):
        Checkpointer().load(d, {"w": torch.zeros(4).as_subclass(Foreign)})
    model = torch.nn.Linear(2, 2)
    model.weight = ForeignParameter(model.weight.detach().clone())
    with pytest.raises(ShardingError, match=r"key 'model\.weight': a tests\.test_validation\.ForeignParameter is a torch\.Tensor subclass"):
        shardsafe.save_model_and_optim_state(str(tmp_path / "model"), model)


def _olmo_tensors() -> dict[str, tuple[torch.Tensor, Any]]:
    """Full tensors and their OLMo-core sharding specs on 2 ranks (None: OLMo-core's even split)."""
    from .olmo_flat import ShardingSpec

    return {
        "even": (torch.arange(30, dtype=torch.float32).reshape(5, 6) * 1.5, None),  # 15 + 15 elements
        "uneven": (torch.arange(21, dtype=torch.int64).reshape(7, 3) - 4, None),  # 11 + 10
        "two-ranges": (torch.arange(16, dtype=torch.bfloat16).reshape(4, 4), ShardingSpec((4, 4), (((0, 3), (9, 16)), ((3, 9),)))),
    }


def _olmo_save_and_load(rank: int, ws: int, path: str) -> None:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from .olmo_flat import ShardedFlatTensor

    tensors = _olmo_tensors()
    even, _ = tensors["even"]
    Checkpointer().save(path + "-even", {"even": ShardedFlatTensor.shard(even)})  # stored rank 0's half, silently
    Checkpointer().save(path, {k: ShardedFlatTensor.shard(full, spec) for k, (full, spec) in tensors.items()})
    # into the same layout, in place
    same = {k: ShardedFlatTensor.shard(torch.zeros_like(full), spec) for k, (full, spec) in tensors.items()}
    ptrs = {k: t.data_ptr() for k, t in same.items()}
    Checkpointer().load(path, same)
    for k, (full, spec) in tensors.items():
        want = ShardedFlatTensor.shard(full, spec).sharded_data
        assert same[k].data_ptr() == ptrs[k] and torch.equal(same[k].sharded_data.view(torch.uint8), want.view(torch.uint8)), k
    # into plain tensors, and into a DTensor sharded on dim 1
    plain = {k: torch.zeros_like(full) for k, (full, _) in tensors.items()}
    mesh = init_device_mesh("cpu", (ws,))
    cols = {k: distribute_tensor(torch.zeros_like(full), mesh, [Shard(1)]) for k, (full, _) in tensors.items()}
    Checkpointer().load(path, plain)
    Checkpointer().load(path, cols)
    for k, (full, _) in tensors.items():
        assert torch.equal(plain[k].view(torch.uint8), full.view(torch.uint8)), k
        assert torch.equal(cols[k].full_tensor().view(torch.uint8), full.view(torch.uint8)), k


def test_olmo_core_sharded_flat_tensors_round_trip_on_2_ranks(tmp_path: Path) -> None:
    path = str(tmp_path / "ckpt")
    run_ranks(2, _olmo_save_and_load, path)
    even = Checkpointer().unshard(path + "-even", no_dist=True)["even"]
    assert even.shape == (5, 6) and torch.equal(even, _olmo_tensors()["even"][0])
    full = Checkpointer().unshard(path, no_dist=True)
    for k, (want, _) in _olmo_tensors().items():
        assert full[k].dtype == want.dtype and torch.equal(full[k].view(torch.uint8), want.view(torch.uint8)), k
    meta = Checkpointer().get_metadata(path, no_dist=True)
    assert all(t.is_sharded and len(list(t.chunks())) == 3 - (k != "two-ranges") for k, t in meta.tensors.items())


def _olmo_model(seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))  # 15 + 3 + 6 + 2 elements


def _olmo_train_and_save(rank: int, ws: int, path: str) -> None:
    from .olmo_flat import shard_module_

    model = _olmo_model(0)
    shard_module_(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.25, momentum=0.9)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optim.step()
    shardsafe.save_model_and_optim_state(path, model, optim)
    # back into a differently initialised sharded model with a fresh optimizer, in place
    fresh = _olmo_model(1)
    shard_module_(fresh)
    fresh_optim = torch.optim.SGD(fresh.parameters(), lr=1.0, momentum=0.0)
    shardsafe.load_model_and_optim_state(path, fresh, fresh_optim)
    for p, q in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(p.sharded_data, q.sharded_data)
    assert fresh_optim.param_groups[0]["lr"] == 0.25 and fresh_optim.param_groups[0]["momentum"] == 0.9
    for q in fresh.parameters():
        assert torch.equal(fresh_optim.state[q]["momentum_buffer"], torch.ones(q.numel()))


def test_olmo_core_fsdp_model_and_optimizer_on_2_ranks_load_anywhere(tmp_path: Path) -> None:
    """Parameters of OLMo-core's FSDP were taken for replicated tensors: rank 0's half was stored."""
    path = str(tmp_path / "ckpt")
    run_ranks(2, _olmo_train_and_save, path)
    want = _olmo_model(0)
    with torch.no_grad():
        for p in want.parameters():
            p.add_(torch.ones_like(p), alpha=-0.25)  # what SGD did to every shard
    expected = dict(want.named_parameters())
    weights = shardsafe.unshard_model_state(path)
    assert weights.keys() == expected.keys()
    for name, p in expected.items():
        assert torch.equal(weights[name], p.detach()), name
    optim_state = shardsafe.unshard_optim_state(path)
    for name, p in expected.items():
        assert torch.equal(optim_state["state"][name]["momentum_buffer"], torch.ones_like(p)), name
    plain = _olmo_model(2)
    plain_optim = torch.optim.SGD(plain.parameters(), lr=1.0, momentum=0.0)
    shardsafe.load_model_and_optim_state(path, plain, plain_optim)
    for (name, p), q in zip(expected.items(), plain.parameters()):
        assert torch.equal(q.detach(), p.detach()), name
        assert torch.equal(plain_optim.state[q]["momentum_buffer"], torch.ones_like(p)), name


# --- scratch memory --------------------------------------------------------------------------


def test_scratch_drops_its_old_buffer_before_allocating_a_larger_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """Growing the per-thread scratch buffer held the old and the new one at once."""
    scratch = Scratch(min_bytes=1 << 10)
    first = scratch.get(1 << 10)
    old = weakref.ref(first._base)
    del first
    old_alive_when_allocating = []
    real_empty = torch.empty

    def empty(*args, **kwargs):
        old_alive_when_allocating.append(old() is not None)
        return real_empty(*args, **kwargs)

    monkeypatch.setattr(torch, "empty", empty)
    assert scratch.get(1 << 20).numel() == 1 << 20
    assert old_alive_when_allocating == [False]
