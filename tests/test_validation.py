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
import struct
from pathlib import Path
from typing import Any

import pytest
import torch

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, PickleNotAllowedError
from shardsafe.storage import open_storage

META = "metadata.json"


def _save(path: Path) -> str:
    d = str(path / "ckpt")
    Checkpointer().save(d, {"w": torch.arange(8, dtype=torch.float32).reshape(2, 4), "step": 3})
    return d


def _raw(d: str) -> str:
    return open_storage(d).read(META).decode()


def _put(d: str, raw: str | bytes) -> None:
    open_storage(d).put_atomic(META, raw.encode() if isinstance(raw, str) else raw, overwrite=True)


def _spec(m: dict[str, Any]) -> dict[str, Any]:
    (specs,) = m["tensors"]["w"]["shard_spec_per_file"].values()
    return specs[0]


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


def _shape(shape: list[int], local: list[int] | None = None, nbytes: int | None = None):
    def fn(m: dict[str, Any]) -> None:
        m["tensors"]["w"]["shape"] = shape
        spec = _spec(m)
        spec["local_shape"] = local if local is not None else shape
        spec["global_offset"] = [0] * len(shape)
        if nbytes is not None:
            spec["byte_range"] = [spec["byte_range"][0], spec["byte_range"][0] + nbytes]

    return _edit(fn)


def _second_chunk_on_the_same_bytes(m: dict[str, Any]) -> None:
    """``w`` as two row chunks whose byte ranges overlap (each of the right length)."""
    spec = _spec(m)
    begin = spec["byte_range"][0]
    first = {**spec, "name": "w@0,0", "local_shape": [1, 4], "byte_range": [begin, begin + 16]}
    second = {**spec, "name": "w@1,0", "global_offset": [1, 0], "local_shape": [1, 4], "byte_range": [begin + 8, begin + 24]}
    (file,) = m["tensors"]["w"]["shard_spec_per_file"]
    m["tensors"]["w"]["shard_spec_per_file"][file] = [first, second]


_DAMAGE = {
    # name: (damage to the metadata text, pattern of the message)
    "deeply-nested-value": (_text('"step":3', '"step":' + "[" * 100_000 + "]" * 100_000), r"nest too deep"),
    "value-nested-65-deep": (_text('"step":3', '"step":' + "[" * 65 + "]" * 65), r"value 'step' nests .* deeper than 64"),
    "byte-range-past-2**63": (_edit(lambda m: _spec(m).update(byte_range=[2**63, 2**63 + 32])), r"'w'.*ends past the largest offset"),
    "byte-range-strings": (_edit(lambda m: _spec(m).update(byte_range=[str(x) for x in _spec(m)["byte_range"]])), r"(?s)byte_range.*must hold integers, found '\d+'"),
    "offset-bools": (_edit(lambda m: _spec(m).update(global_offset=[False, False])), r"(?s)global_offset.*must hold integers, found False"),
    "shape-floats": (_edit(lambda m: m["tensors"]["w"].update(shape=[2.0, 4.0])), r"(?s)shape.*must hold integers, found 2\.0"),
    "is-sharded-int": (_edit(lambda m: m["tensors"]["w"].update(is_sharded=1)), r"(?s)is_sharded.*must be true or false, found 1"),
    "negative-shape": (_shape([-2, -4]), r"tensor 'w' has shape \[-2, -4\]: a negative dimension"),
    "shape-of-2**62-bytes": (_shape([2**60, 4], nbytes=2**64), r"tensor 'w' of shape \[1152921504606846976, 4\] would hold 2\*\*62 bytes"),
    "65-dims": (_shape([1] * 65, nbytes=4), r"tensor 'w' has 65 dimensions; at most 64"),
    "nan": (_text('"step":3', '"step":NaN'), r"NaN is not a JSON number"),
    "infinity": (_text('"step":3', '"step":-Infinity'), r"-Infinity is not a JSON number"),
    "float-overflow": (_text('"step":3', '"step":1e999'), r"1e999 does not fit a finite float"),
    "byte-order-mark": (lambda raw: "\ufeff" + raw, r"byte order mark"),
    "utf-16": (lambda raw: raw.encode("utf-16"), r"not UTF-8"),
    "duplicate-key": (_text('"step":3', '"step":3,"step":4'), r"key 'step' appears twice in one object"),
    "empty-tensor-key": (_edit(lambda m: m["tensors"].update({"": m["tensors"].pop("w")})), r"an empty key in 'tensors'"),
    "empty-value-key": (_text('"step":3', '"":3'), r"an empty key in 'objects'"),
    "file-name-with-newline": (_text('.safetensors"', '.safetensors\\n"'), r"names data file '.*\.safetensors\\n', which is not a plain file name"),
    "chunks-share-bytes": (_edit(_second_chunk_on_the_same_bytes), r"chunks 'w@0,0' \(tensor 'w'\) and 'w@1,0' \(tensor 'w'\) in '.*' share bytes"),
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


@pytest.mark.parametrize("op", ["unshard", "unshard_to_safetensors"])
def test_sizes_beyond_the_stored_bytes_are_refused_before_allocating(tmp_path: Path, op: str) -> None:
    """Valid-looking metadata for a 16 TiB tensor: the data file is 160 bytes long, so nothing of
    that size is allocated; the error names the key, the file and what it lacks."""
    d = _save(tmp_path)
    _put(d, _shape([2**40, 4], nbytes=2**44)(_raw(d)))
    (file,) = Checkpointer().get_metadata(d, no_dist=True).data_files()
    call = {
        "unshard": lambda: Checkpointer().unshard(d, no_dist=True),
        "unshard_to_safetensors": lambda: shardsafe.unshard_to_safetensors(d, tmp_path / "out.safetensors"),
    }[op]
    with pytest.raises(CorruptCheckpointError, match=rf"key 'w': .*{file}: truncated: .*the file has 160 bytes \(its chunks in that file end at byte {2**44 + 128}\)"):
        call()
    assert not (tmp_path / "out.safetensors").exists()


def _replace_in_header(d: str, old: bytes, new: bytes) -> str:
    """Rewrite the data file with ``old`` replaced by ``new`` in its JSON header (the header
    length changes; the header is what is under test, so the byte ranges are left as they were)."""
    (file,) = Checkpointer().get_metadata(d, no_dist=True).data_files()
    store = open_storage(d)
    raw = store.read(file)
    (n,) = struct.unpack("<Q", raw[:8])
    header = raw[8 : 8 + n]
    assert header.count(old) == 1
    header = header.replace(old, new)
    store.put_atomic(file, struct.pack("<Q", len(header)) + header + raw[8 + n :], overwrite=True)
    return file


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

