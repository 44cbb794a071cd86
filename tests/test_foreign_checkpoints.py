"""Another library's checkpoint given to a shardsafe entry point is named as such: a
torch.distributed.checkpoint folder, a Hugging Face safetensors model (folder, sharded folder,
one file) or a Megatron checkpoint (``torch_dist`` or ``zarr`` iter folder, a run's root) raises
``ForeignCheckpointError`` naming the format and the function or command that converts or loads
it, from every entry point and from the command line; a save of ours that never committed is
still called interrupted. The folders are written for real (DCP's ``FileSystemWriter``,
``safetensors.torch.save_file``, megatron-core's zarr fixture, a torch_dist folder laid out as
megatron-core lays one out), and each named converter is run on its folder.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import save_file

import shardsafe
import shardsafe.lightning
from shardsafe import Checkpointer, ForeignCheckpointError, IncompleteCheckpointError
from shardsafe.megatron import CheckpointingConfig
from shardsafe.megatron.core import save_config

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}
ZARR_DIR = ROOT / "tests" / "data" / "megatron_zarr"


def _state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {"w": torch.randn(2, 3, generator=g), "b": torch.randn(2, generator=g).bfloat16()}


def _dcp_folder(path: Path) -> None:
    dcp.save(_state(), storage_writer=dcp.FileSystemWriter(str(path)), no_dist=True)


def _megatron_torch_dist(path: Path, *, config: bool = True) -> None:
    """What megatron-core's torch_dist backend leaves in an iter folder: DCP's files, ``common.pt``
    (the common state, torch.save'd) and its ``metadata.json`` config."""
    _dcp_folder(path)
    torch.save({"iteration": 7}, path / "common.pt")
    if config:
        save_config(CheckpointingConfig("torch_dist"), str(path))


def _build(base: Path) -> dict[str, tuple[str, list[str]]]:
    """format -> (location, the parts its error message must hold)."""
    out: dict[str, tuple[str, list[str]]] = {}

    p = base / "dcp"
    _dcp_folder(p)
    out["dcp"] = (str(p), [
        f"{p}: this is a torch.distributed.checkpoint (DCP) checkpoint (.metadata and 1 .distcp file(s)), not a shardsafe one "
        "(no metadata.json)",
        f"shardsafe.dcp.convert({str(p)!r}, dst)", f"`shardsafe convert {p} DST --from dcp`",
        f"dcp.load(state_dict, storage_reader=shardsafe.dcp.StorageReader({str(p)!r}))",
    ])

    p = base / "lightning"
    _dcp_folder(p)
    torch.save({"epoch": 1, "global_step": 4}, p / "meta.pt")
    out["lightning_dcp"] = (str(p), [
        f"{p}: this is a Lightning sharded checkpoint (a torch.distributed.checkpoint (DCP) checkpoint (.metadata and 1 .distcp "
        "file(s)) with Lightning's meta.pt)",
        f"shardsafe.dcp.convert({str(p)!r}, dst)", f"shardsafe.lightning.consolidate({str(p)!r}, out)",
    ])

    p = base / "hf"
    p.mkdir()
    save_file(_state(), str(p / "model.safetensors"))
    hf_advice = lambda loc: [  # noqa: E731
        f"shardsafe.load_hf_safetensors({loc!r}, model)", f"shardsafe.convert.convert_hf({loc!r}, dst)",
        f"`shardsafe convert {loc} DST --from hf`",
    ]
    out["hf_folder"] = (str(p), [f"{p}: this is a Hugging Face safetensors model (model.safetensors), not a shardsafe checkpoint", *hf_advice(str(p))])
    f = p / "model.safetensors"
    out["hf_file"] = (str(f), [f"{f}: this is a Hugging Face safetensors file, not a shardsafe checkpoint", *hf_advice(str(f))])

    p = base / "hf_sharded"
    p.mkdir()
    s = _state()
    save_file({"w": s["w"]}, str(p / "model-00001-of-00002.safetensors"))
    save_file({"b": s["b"]}, str(p / "model-00002-of-00002.safetensors"))
    index = '{"metadata": {}, "weight_map": {"w": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}}'
    (p / "model.safetensors.index.json").write_text(index)
    out["hf_sharded"] = (str(p), [
        f"{p}: this is a Hugging Face safetensors model (model-00001-of-00002.safetensors, model-00002-of-00002.safetensors, "
        "model.safetensors.index.json)", *hf_advice(str(p)),
    ])

    meg_advice = lambda loc: [  # noqa: E731
        f"shardsafe.megatron.convert_megatron({loc!r}, dst)", f"`shardsafe convert {loc} DST --from megatron`",
        f"shardsafe.megatron.load(sharded_state_dict, {loc!r})",
    ]
    p = base / "run" / "iter_0000007"
    _megatron_torch_dist(p)
    (base / "run" / "latest_checkpointed_iteration.txt").write_text("7")
    out["megatron_torch_dist"] = (str(p), [
        f"{p}/metadata.json: this is Megatron-Core's dist_checkpointing config (sharded_backend 'torch_dist')", *meg_advice(str(p)),
    ])
    r = base / "run"
    out["megatron_root"] = (str(r), [
        f"{r}: this is the root of a Megatron run, not a checkpoint: its newest checkpoint (latest_checkpointed_iteration.txt: 7) "
        f"is {p};", *meg_advice(str(p)),
    ])

    p = base / "iter_0000003"
    shutil.copytree(ZARR_DIR, p)
    out["megatron_zarr"] = (str(p), [f"{p}/metadata.json: this is Megatron-Core's dist_checkpointing config (sharded_backend 'zarr')", *meg_advice(str(p))])

    p = base / "iter_0000005"
    _megatron_torch_dist(p, config=False)
    out["megatron_no_config"] = (str(p), [
        f"{p}: this is a checkpoint Megatron-Core's dist_checkpointing wrote (common.pt; backend torch_dist), not a shardsafe one "
        "(no metadata.json)", *meg_advice(str(p)),
    ])
    return out


@pytest.fixture(scope="module")
def foreign(tmp_path_factory) -> dict[str, tuple[str, list[str]]]:
    return _build(tmp_path_factory.mktemp("foreign"))


def _load_model_and_optim(loc: str) -> None:
    model = torch.nn.Linear(3, 2)
    shardsafe.load_model_and_optim_state(loc, model, torch.optim.AdamW(model.parameters()))


ENTRY_POINTS: dict[str, Callable[[str], object]] = {
    "Checkpointer.load": lambda loc: Checkpointer().load(loc, {"w": torch.zeros(2, 3)}, no_dist=True),
    "Checkpointer.get_metadata": lambda loc: Checkpointer().get_metadata(loc, no_dist=True),
    "Checkpointer.unshard": lambda loc: Checkpointer().unshard(loc, no_dist=True),
    "unshard_model_state": lambda loc: shardsafe.unshard_model_state(loc, no_dist=True),
    "load_model_and_optim_state": _load_model_and_optim,
    "verify": lambda loc: shardsafe.verify(loc),
    "lightning.read_meta": lambda loc: shardsafe.lightning.read_meta(loc),
}
FORMATS = [
    "dcp", "lightning_dcp", "hf_folder", "hf_file", "hf_sharded", "megatron_torch_dist", "megatron_root", "megatron_zarr",
    "megatron_no_config",
]


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
@pytest.mark.parametrize("fmt", FORMATS)
def test_every_entry_point_names_a_foreign_checkpoint_and_its_way_in(foreign, fmt, entry):
    loc, parts = foreign[fmt]
    with pytest.raises(ForeignCheckpointError, match=re.escape(parts[0])) as e:
        ENTRY_POINTS[entry](loc)
    msg = str(e.value)
    assert [p for p in parts if p not in msg] == []
    assert "interrupted" not in msg and "does not read" not in msg


@pytest.mark.parametrize(
    ("command", "fmt"), [("inspect", fmt) for fmt in FORMATS] + [("verify", fmt) for fmt in ("dcp", "hf_file", "megatron_root")]
)  # a subprocess each (~2.5 s): every format once, and verify for one of each family
def test_the_command_line_names_a_foreign_checkpoint(foreign, fmt, command):
    loc, parts = foreign[fmt]
    done = subprocess.run([sys.executable, "-m", "shardsafe", command, loc], capture_output=True, text=True, env=ENV, timeout=120)
    assert done.returncode == 2 and done.stdout == ""
    assert done.stderr.startswith(f"shardsafe {command}: error: {parts[0]}")
    assert [p for p in parts if p not in done.stderr] == []


def test_dcp_load_through_our_reader_names_a_hugging_face_model_and_a_megatron_root(foreign):
    from torch.distributed.checkpoint.api import CheckpointException

    for fmt in ("hf_folder", "hf_file", "megatron_root"):
        loc, parts = foreign[fmt]
        with pytest.raises(ForeignCheckpointError, match=re.escape(parts[0])):
            shardsafe.dcp.StorageReader(loc).read_metadata()
        with pytest.raises(CheckpointException, match=re.escape(parts[0])):  # DCP wraps it (with its own text)
            dcp.load({"w": torch.zeros(2, 3)}, storage_reader=shardsafe.dcp.StorageReader(loc), no_dist=True)


def test_a_save_that_never_committed_is_still_called_interrupted(tmp_path):
    ours = tmp_path / "ours"
    Checkpointer().save(ours, _state())
    (ours / "metadata.json").unlink()
    assert [f.endswith(".safetensors") for f in os.listdir(ours)] == [True]
    for loc, msg in (
        (ours, "not a committed checkpoint: it holds 1 file(s) but has no metadata.json (was the save interrupted before it committed?)"),
        (tmp_path / "none", "no such checkpoint: the directory does not exist (is the path mistyped?)"),
    ):
        with pytest.raises(IncompleteCheckpointError, match=re.escape(f"{loc}: {msg}")):
            Checkpointer().load(loc, {"w": torch.zeros(2, 3)}, no_dist=True)


def test_the_named_converters_read_their_folders(foreign, tmp_path):
    """Each converter the messages name converts its folder into a checkpoint that loads bit-exact."""
    from shardsafe.convert import convert_hf
    from shardsafe.megatron import convert_megatron

    truth = _state()
    jobs = {
        "dcp": lambda src, dst: shardsafe.dcp.convert(src, dst, progress=False),
        "hf_folder": convert_hf, "hf_file": convert_hf, "hf_sharded": convert_hf,
        "megatron_torch_dist": lambda src, dst: convert_megatron(src, dst, progress=False),
    }
    for fmt, convert in jobs.items():
        dst = str(tmp_path / fmt)
        convert(foreign[fmt][0], dst)
        got = {k: torch.zeros_like(v) for k, v in truth.items()}
        Checkpointer().load(dst, got, no_dist=True)
        assert all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in truth.items()), fmt


def test_shardsafe_megatron_load_names_a_checkpoint_that_is_not_megatrons(foreign):
    from shardsafe.megatron import load
    from shardsafe.megatron.core import NotADistributedCheckpointError

    for fmt in ("dcp", "hf_folder", "megatron_root"):
        loc, parts = foreign[fmt]
        with pytest.raises(NotADistributedCheckpointError, match=re.escape(f"{loc} is not a distributed checkpoint: {parts[0]}")):
            load({}, loc)
