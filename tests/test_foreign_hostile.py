"""Other projects' checkpoints under hostile input (issue 22, items 1-6): sizes in foreign
metadata are proven by the files before memory is allocated, no importer follows a symbolic
link, foreign JSON goes through the strict reader, silent results are refused, and the command
line keeps its contract (exit codes, one JSON error object under ``--json``).

Every folder is written for real (DCP's ``FileSystemWriter``, megatron-core's zarr fixture,
``safetensors.torch.save_file``) and then damaged as an attacker would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import os
import pickle
import shutil
import struct
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardsafe
import shardsafe.dcp
import shardsafe.lightning
from shardsafe import Checkpointer, CheckpointError, CorruptCheckpointError
from shardsafe.cli import main
from shardsafe.convert import convert_hf
from shardsafe.knobs import KNOBS
from shardsafe.megatron import (
    CheckpointingConfig,
    CheckpointingException,
    convert_megatron,
    load_common_state_dict,
    load_plain_tensors,
)
from shardsafe.megatron.core import save_config
from shardsafe.megatron.strategies import ZarrLoadShardedStrategy
from shardsafe.megatron.strategies.torch_dist import read_common_pt
from shardsafe.storage import open_storage

ZARR_DIR = Path(__file__).resolve().parent / "data" / "megatron_zarr"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(4, 6, generator=g), "b": torch.randn(5, generator=g).bfloat16()}


def _dcp(path: Path, state: dict | None = None) -> Path:
    dcp.save(state or _state(), storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)
    return path


def _torch_dist(path: Path) -> Path:
    """A folder laid out as megatron-core's torch_dist backend lays one out."""
    _dcp(path)
    torch.save({"iteration": 7}, path / "common.pt")
    save_config(CheckpointingConfig("torch_dist"), str(path))
    return path


def _edit_dcp_metadata(path: Path, edit) -> None:
    """Rewrite ``.metadata`` (our own file: the full unpickler is fine here) after ``edit(meta)``."""
    with open(path / ".metadata", "rb") as f:
        meta = pickle.load(f)
    edit(meta)
    with open(path / ".metadata", "wb") as f:
        pickle.dump(meta, f)


def _last_item(meta):
    """The storage_data index whose bytes come last in their file."""
    return max(meta.storage_data, key=lambda i: meta.storage_data[i].offset)


def _zarr(tmp_path: Path) -> Path:
    p = tmp_path / "zarr"
    shutil.copytree(ZARR_DIR, p)
    return p


def _zarray(p: Path, key: str, **fields) -> None:
    path = p / key / ".zarray"
    doc = json.loads(path.read_text())
    doc.update(fields)
    path.write_text(json.dumps(doc))


def _cli(*argv: str) -> tuple[int, str, str]:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


# ------------------------------------------------------------------ 1. sizes proven before allocating


def test_a_dcp_item_length_the_file_does_not_hold_is_refused_before_allocating(tmp_path):
    src = _dcp(tmp_path / "dcp")

    def huge(meta):
        idx = _last_item(meta)
        meta.storage_data[idx] = dataclasses.replace(meta.storage_data[idx], length=2**50)

    _edit_dcp_metadata(src, huge)
    size = os.path.getsize(src / "__0_0.distcp")
    with pytest.raises(CorruptCheckpointError, match=rf"truncated: needed bytes \[\d+, {2**50 - 1 + 1}\)|__0_0.distcp.*{size} bytes"):
        shardsafe.dcp.convert(str(src), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_dcp_items_that_share_bytes_or_are_shorter_than_their_chunk_are_refused(tmp_path):
    src = _dcp(tmp_path / "dcp")
    first = {}

    def overlap(meta):
        a, b = sorted(meta.storage_data, key=lambda i: meta.storage_data[i].offset)[:2]
        first["keys"] = (a.fqn, b.fqn)
        meta.storage_data[b] = dataclasses.replace(meta.storage_data[b], offset=meta.storage_data[a].offset + 1)

    _edit_dcp_metadata(src, overlap)
    with pytest.raises(CorruptCheckpointError, match=r"of __0_0.distcp overlap"):
        shardsafe.dcp.convert(str(src), str(tmp_path / "out"))

    src = _dcp(tmp_path / "dcp2")

    def short(meta):
        md = meta.state_dict_metadata["w"]
        md.size = torch.Size([2**40])
        md.chunks[0].offsets, md.chunks[0].sizes = torch.Size([0]), torch.Size([2**40])
        idx = next(i for i in meta.storage_data if i.fqn == "w")
        del meta.storage_data[idx]
        meta.storage_data[dataclasses.replace(idx, offset=torch.Size([0]))] = dcp.filesystem._StorageInfo("__0_0.distcp", 0, 100)

    _edit_dcp_metadata(src, short)
    with pytest.raises(CorruptCheckpointError, match=r"key 'w': the chunk at \[0\] of size \[1099511627776\] holds 4398046511104 bytes"):
        shardsafe.dcp.convert(str(src), str(tmp_path / "out2"))


def test_torch_dist_load_plain_tensors_of_a_shape_no_chunk_covers_raises_a_checkpoint_error(tmp_path):
    src = _torch_dist(tmp_path / "td")

    def grow(meta):  # the tensor says 2**40 elements; its one stored chunk holds 24
        meta.state_dict_metadata["w"].size = torch.Size([2**38, 6])

    _edit_dcp_metadata(src, grow)
    with pytest.raises(CheckpointingException, match=r"key 'w'.*(cover|gap)"):
        load_plain_tensors(str(src))


def test_a_sparse_zarr_chunk_file_is_refused_by_its_size_without_reading_it(tmp_path):
    p = _zarr(tmp_path)
    chunk = next(f for f in sorted(os.listdir(p / "w")) if not f.startswith("."))
    with open(p / "w" / chunk, "r+b") as f:
        f.truncate(2**40)  # sparse: 1 TiB that reading would have to allocate
    with pytest.raises(CheckpointingException, match=rf"chunk w/{chunk} holds {2**40} bytes, not the 48 bytes of a \[2, 6\] chunk of torch.float32"):
        load_plain_tensors(str(p))
    with pytest.raises(CheckpointingException, match=rf"chunk w/{chunk} holds {2**40} bytes, not the 48 bytes"):
        convert_megatron(str(p), str(tmp_path / "out"))


def test_a_zarray_declaring_more_chunks_than_its_directory_holds_is_refused_up_front(tmp_path):
    p = _zarr(tmp_path)
    _zarray(p, "b", shape=[10**12], chunks=[1])
    with pytest.raises(CheckpointingException, match=r"array 'b' \(b/.zarray\): shape \[1000000000000\] in chunks \[1\] is 1000000000000 chunks, but"):
        ZarrLoadShardedStrategy().view(str(p))


def test_zarr_load_plain_tensors_of_a_huge_shape_raises_a_checkpoint_error_not_torchs(tmp_path):
    p = _zarr(tmp_path)
    _zarray(p, "b", shape=[2**40], chunks=[2**40])  # one chunk, whose file holds 5 elements
    with pytest.raises(CheckpointingException, match=r"chunk b/0 holds 10 bytes, not the 2199023255552 bytes"):
        load_plain_tensors(str(p))


# ------------------------------------------------------------------ 2. no link followed


@pytest.mark.parametrize("what", ["chunk", ".zarray", "shard_*.pt"])
def test_the_zarr_backend_refuses_a_symlink_to_a_file_outside_the_folder(tmp_path, what):
    p = _zarr(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    if what == "chunk":
        name = p / "w" / next(f for f in sorted(os.listdir(p / "w")) if not f.startswith("."))
    elif what == ".zarray":
        name = p / "w" / ".zarray"
    else:
        name = p / "rng" / next(f for f in sorted(os.listdir(p / "rng")) if f.startswith("shard_"))
    shutil.copy(name, outside / "copy")  # the same bytes: only the link itself can be refused
    name.unlink()
    name.symlink_to(outside / "copy")
    with pytest.raises(CheckpointingException, match=rf"{name}: is a symbolic link"):
        convert_megatron(str(p), str(tmp_path / "out"))
    assert not (tmp_path / "out" / "metadata.json").exists()


def test_convert_hf_refuses_a_model_file_that_is_a_symlink(tmp_path):
    (tmp_path / "outside").mkdir()
    save_file(_state(), str(tmp_path / "outside" / "model.safetensors"))
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "model.safetensors").symlink_to(tmp_path / "outside" / "model.safetensors")
    with pytest.raises(CorruptCheckpointError, match="model.safetensors: is a symbolic link"):
        convert_hf(str(tmp_path / "hf"), str(tmp_path / "out"))


# ------------------------------------------------------------------ 3. only our hierarchy escapes

DEEP = b"[" * 100_000 + b"]" * 100_000


def test_deeply_nested_foreign_json_raises_checkpoint_errors_not_recursion_errors(tmp_path):
    td = _torch_dist(tmp_path / "td")
    (td / "metadata.json").write_bytes(b'{"sharded_backend": ' + DEEP + b"}")
    with pytest.raises(CheckpointError, match="not a megatron-core torch_dist checkpoint"):
        convert_megatron(str(td), str(tmp_path / "out"))

    z = _zarr(tmp_path)
    (z / "w" / ".zarray").write_bytes(DEEP)
    with pytest.raises(CheckpointingException, match=r"array 'w' \(w/.zarray\): not JSON: arrays and objects nest too deep"):
        load_plain_tensors(str(z))

    hf = tmp_path / "hf"
    hf.mkdir()
    save_file(_state(), str(hf / "model-00001-of-00001.safetensors"))
    (hf / "model.safetensors.index.json").write_bytes(b'{"weight_map": ' + DEEP + b"}")
    with pytest.raises(CorruptCheckpointError, match="the index is not valid JSON: arrays and objects nest too deep"):
        convert_hf(str(hf), str(tmp_path / "out2"))
    with pytest.raises(CorruptCheckpointError, match="the index is not valid JSON: arrays and objects nest too deep"):
        shardsafe.load_hf_safetensors(str(hf), torch.nn.Linear(6, 4))


def test_consolidate_of_a_crafted_dcp_folder_raises_our_error_and_the_cli_exits_2(tmp_path):
    p = _dcp(tmp_path / "lightning")
    torch.save({"epoch": 1}, p / "meta.pt")
    with open(p / "__0_0.distcp", "r+b") as f:
        f.truncate(100)
    with pytest.raises(CorruptCheckpointError, match=r"__0_0.distcp: truncated"):
        shardsafe.lightning.consolidate(str(p), str(tmp_path / "out.ckpt"))
    code, out, err = _cli("consolidate", str(p), str(tmp_path / "out.ckpt"))
    assert (code, out) == (2, "")
    assert err.startswith("shardsafe consolidate: error: ") and "__0_0.distcp: truncated" in err and "Traceback" not in err
    assert err.count("\n") == 1


# ------------------------------------------------------------------ 4. no silent result


def test_a_torch_dist_folder_whose_metadata_json_says_zarr_is_refused(tmp_path):
    src = _torch_dist(tmp_path / "td")
    save_config(CheckpointingConfig("zarr"), str(src))
    with pytest.raises(CheckpointingException, match=r"names the zarr backend, but no Zarr array .* and DCP's .metadata is"):
        convert_megatron(str(src), str(tmp_path / "out"))
    with pytest.raises(CheckpointingException, match="names the zarr backend"):
        load_plain_tensors(str(src))
    assert not (tmp_path / "out" / "metadata.json").exists()


def _overlapping_hf(path: Path) -> None:
    """A safetensors file whose tensor 'b' aliases bytes of 'a'."""
    header = {"a": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}, "b": {"dtype": "F32", "shape": [2], "data_offsets": [8, 16]}}
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    path.write_bytes(struct.pack("<Q", len(raw)) + raw + torch.arange(4, dtype=torch.float32).numpy().tobytes())


def test_a_hugging_face_file_whose_tensors_overlap_is_refused(tmp_path):
    _overlapping_hf(tmp_path / "model.safetensors")
    msg = r"model.safetensors: not a valid safetensors file: tensors 'a' \(bytes \[\d+, \d+\)\) and 'b' \(bytes \[\d+, \d+\)\) overlap"
    with pytest.raises(CorruptCheckpointError, match=msg):
        convert_hf(str(tmp_path / "model.safetensors"), str(tmp_path / "out"))

    class Two(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a, self.b = torch.nn.Parameter(torch.zeros(4)), torch.nn.Parameter(torch.zeros(2))

    with pytest.raises(CorruptCheckpointError, match=msg):
        shardsafe.load_hf_safetensors(str(tmp_path / "model.safetensors"), Two())


def test_diff_names_the_tensor_whose_stored_digests_differ_and_says_when_layouts_differ(tmp_path):
    state = {"x": torch.arange(64, dtype=torch.float32), "y": torch.ones(8)}
    Checkpointer().save(str(tmp_path / "a"), state)
    changed = {"x": state["x"].clone(), "y": state["y"]}
    changed["x"][17] = -1.0
    Checkpointer().save(str(tmp_path / "b"), changed)
    Checkpointer(knobs=dataclasses.replace(KNOBS, checksum_block_bytes=64)).save(str(tmp_path / "c"), state)

    code, out, _ = _cli("--json", "diff", str(tmp_path / "a"), str(tmp_path / "b"))
    doc = json.loads(out)
    assert (code, doc["same"], doc["contents_changed"], doc["layout_differs"]) == (1, False, ["x"], [])
    code, out, _ = _cli("diff", str(tmp_path / "a"), str(tmp_path / "b"))
    assert code == 1 and "contents       x  stored digests differ" in out and "  y  " not in out

    code, out, _ = _cli("--json", "diff", str(tmp_path / "a"), str(tmp_path / "c"))
    doc = json.loads(out)
    assert (code, doc["same"], doc["contents_changed"], doc["layout_differs"]) == (0, True, [], ["x", "y"])
    code, out, _ = _cli("diff", str(tmp_path / "a"), str(tmp_path / "c"))
    assert code == 0 and "2 stored in other layouts not compared: pass --values" in out
    code, out, _ = _cli("diff", "--values", str(tmp_path / "a"), str(tmp_path / "c"))
    assert code == 0 and "tensor values equal within atol 0" in out

    code, out, _ = _cli("--json", "diff", str(tmp_path / "a"), str(tmp_path / "a"))
    assert (code, json.loads(out)["contents_changed"]) == (0, [])


# ------------------------------------------------------------------ 5. the command line's contract


def test_json_mode_prints_one_error_object_for_every_failing_command(tmp_path):
    missing = str(tmp_path / "nothing")
    for argv in (["inspect", missing], ["verify", missing], ["diff", missing, missing], ["export", missing, str(tmp_path / "o")],
                 ["consolidate", missing, str(tmp_path / "o.ckpt")], ["convert", missing, str(tmp_path / "o"), "--from", "dcp"]):
        code, out, err = _cli("--json", *argv)
        doc = json.loads(out)
        assert code == 2 and list(doc) == ["error"], argv
        assert doc["error"]["type"] == "IncompleteCheckpointError" and doc["error"]["path"] == missing, argv
        assert doc["error"]["message"] in err, argv
    code, out, err = _cli("--json", "inspect")
    assert code == 2 and json.loads(out)["error"]["type"] == "UsageError" and json.loads(out)["error"]["path"] is None
    assert "the following arguments are required: dir" in json.loads(out)["error"]["message"]
    code, out, err = _cli("inspect", missing)
    assert (code, out) == (2, "")  # without --json nothing goes to stdout


def test_an_unsafe_common_pt_is_reported_with_its_location_when_given_a_storage(tmp_path):
    src = _torch_dist(tmp_path / "td")

    class Payload:
        def __reduce__(self):
            return (os.system, (f"touch {tmp_path / 'ran'}",))

    torch.save({"x": Payload()}, src / "common.pt")
    with pytest.raises(CheckpointingException) as e:
        read_common_pt(open_storage(str(src)), allow_pickle=False, strategy="S")
    assert str(e.value).startswith(f"{src}/common.pt: the pickle names posix.system, which is not one of the globals")
    with pytest.raises(CheckpointingException, match=rf"^{src}/common\.pt: the pickle names posix\.system"):
        load_common_state_dict(str(src))
    assert not (tmp_path / "ran").exists()


def test_a_dcp_data_file_name_holding_a_nul_byte_is_refused_as_corrupt(tmp_path):
    src = _dcp(tmp_path / "dcp")

    def nul(meta):
        idx = _last_item(meta)
        meta.storage_data[idx] = dataclasses.replace(meta.storage_data[idx], relative_path="x\x00")

    _edit_dcp_metadata(src, nul)
    with pytest.raises(CorruptCheckpointError, match=r"relative_path is 'x\\x00'"):
        shardsafe.dcp.convert(str(src), str(tmp_path / "out"))
