"""The checkpoints the campaigns damage, kill and race, and the ground truth they must load as.

Three kinds, each a function of a ``version`` (so a saver and a checker agree without talking):

- ``sharded``: saved by 2 gloo ranks: a DTensor ``Shard(0)`` (uneven), a bfloat16 DTensor
  ``Shard(1)``, a replicated plain tensor, a 0-d replicated tensor, a ``ShardedTensor`` held as
  two flattened ranges of one box that are not boxes themselves, and non-tensor values;
- ``single``: one process, plain tensors of several dtypes (0-d and empty included) and values;
- ``model``: ``save_model_and_optim_state`` of a small model and its Adam state (one process).

Each saver also writes the truth beside the checkpoint (``<dir>.truth.safetensors`` and
``<dir>.truth.json``, keys as stored), taken from the values it saved. :func:`layouts` gives the
layouts to load back: the saved one (per saving rank) and others, as ``ShardedTensor`` targets
(:func:`targets`) that any one process can load.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from math import prod
from typing import Any

import torch
from safetensors.torch import load_file, save_file

import shardsafe
from shardsafe import Checkpointer, ShardedTensor

from ..helpers import bits

__all__ = [
    "KINDS",
    "Case",
    "Piece",
    "build_cases",
    "compare",
    "expected_piece",
    "fresh_model_and_optim",
    "layouts",
    "read_truth",
    "save_case",
    "save_sharded_rank",
    "sharded_rank_state",
    "single_state",
    "targets",
    "truth_files",
    "write_state_truth",
    "write_truth",
]

KINDS = ("sharded", "single", "model")
Piece = tuple[tuple[int, ...], tuple[int, ...], "tuple[int, int] | None"]  # box offsets, lengths, flat range


@dataclass(frozen=True)
class Case:
    """A saved checkpoint: its kind, directory, the version saved, and where its truth is."""

    kind: str
    dir: str
    version: int = 1
    large: bool = False
    truth_at: str = ""  # where the truth lies (without suffix); default: beside the directory

    @property
    def truth(self) -> str:
        return self.truth_at or self.dir.rstrip("/") + ".truth"


def _full(key: str, shape: tuple[int, ...], dtype: torch.dtype, version: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(sum(map(ord, key)) * 1009 + version)
    if dtype.is_floating_point:
        return torch.randn(shape, generator=g).to(dtype)
    return torch.randint(-(2**31), 2**31 - 1, shape, generator=g, dtype=torch.int64).to(dtype)


def _sharded_shapes(large: bool) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
    if large:  # about 600 KiB: with 16 KiB write blocks a save makes dozens of write calls
        return {"dt0": ((513, 128), torch.float32), "dt1": ((128, 257), torch.bfloat16),
                "rep": ((16385,), torch.int64), "flat": ((64, 257), torch.float64), "scale": ((), torch.float32)}
    return {"dt0": ((11, 6), torch.float32), "dt1": ((4, 9), torch.bfloat16), "rep": ((7,), torch.int64),
            "flat": ((6, 8), torch.float64), "scale": ((), torch.float32)}


def _objects(version: int) -> dict[str, Any]:
    return {"step": version, "cfg": {"lr": 0.125, "names": ["a", "b"], "v": version, "flag": True}}


def _halves(n: int, parts: int) -> list[tuple[int, int]]:
    """torch.chunk bounds (DTensor ``Shard``): ceil-sized parts, the last ones shorter."""
    size = -(-n // parts)
    return [(min(i * size, n), min((i + 1) * size, n)) for i in range(parts)]


def _flat_split(n: int, rank: int) -> tuple[int, int]:
    cut = n * 2 // 5 + 1  # rank 0 holds a few whole rows and part of the next: not a box
    return (0, cut) if rank == 0 else (cut, n)


def sharded_rank_state(rank: int, version: int, *, large: bool = False, dtensor: bool = True) -> dict[str, Any]:
    """This rank's part of the ``sharded`` state on a 2-rank gloo group (collective: needs the group).

    With ``dtensor=False`` the two sharded tensors are ``ShardedTensor`` boxes of the same
    geometry instead (stored identically, and cheaper to build: no DTensor dispatch to warm up).
    """
    shapes = _sharded_shapes(large)
    full = {k: _full(k, s, d, version) for k, (s, d) in shapes.items()}
    flat_shape = shapes["flat"][0]
    lo, hi = _flat_split(prod(flat_shape), rank)
    state: dict[str, Any] = {
        "rep": full["rep"],
        "flat": ShardedTensor.from_rank_offsets_flat(
            "flat", full["flat"].reshape(-1)[lo:hi].clone(), flat_shape, flattened_range=slice(lo, hi)
        ),
        "scale": full["scale"],
        **_objects(version),
    }
    if dtensor:
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (2,))
        state["dt0"] = distribute_tensor(full["dt0"], mesh, [Shard(0)], src_data_rank=None)
        state["dt1"] = distribute_tensor(full["dt1"], mesh, [Shard(1)], src_data_rank=None)
        return state
    for key, dim in (("dt0", 0), ("dt1", 1)):
        off, lens, _ = _box_rows(shapes[key][0], dim, 2)[rank]
        box = full[key][tuple(slice(o, o + n) for o, n in zip(off, lens))].clone()
        state[key] = ShardedTensor(key, box, shapes[key][0], off, lens)
    return state


def _sharded_truth(version: int, large: bool) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return {k: _full(k, s, d, version) for k, (s, d) in _sharded_shapes(large).items()}, _objects(version)


def single_state(version: int, *, large: bool = False) -> dict[str, Any]:
    """The ``single`` state: plain tensors and values, saved by one process."""
    rows = 512 if large else 9
    return {
        "w": _full("w", (rows, 257 if large else 13), torch.float32, version),
        "i": _full("i", (5, 4, 3), torch.int32, version),
        "h": _full("h", (rows * 7 + 3,), torch.float16, version),
        "e": torch.empty(0, 3),
        "s": _full("s", (), torch.float64, version),
        **_objects(version),
    }


def _model_and_optim(version: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    g = torch.Generator().manual_seed(version)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=g))
    optim = torch.optim.Adam(model.parameters(), lr=0.01 * version)
    model(torch.randn(4, 6, generator=g)).square().sum().backward()
    optim.step()
    return model, optim


def fresh_model_and_optim() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A model of the ``model`` kind with other values and an optimizer without state."""
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.ReLU(), torch.nn.Linear(5, 3))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(-1.0)
    return model, torch.optim.Adam(model.parameters(), lr=0.5)


def write_truth(case: Case, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> None:
    save_file({k: v.detach().contiguous().clone() for k, v in tensors.items()}, case.truth + ".safetensors")
    with open(case.truth + ".json", "w") as f:
        json.dump(objects, f)


def truth_files(case: Case) -> list[str]:
    return [case.truth + ".safetensors", case.truth + ".json"]


def read_truth(case: Case) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    with open(case.truth + ".json") as f:
        objects = json.load(f)
    return load_file(case.truth + ".safetensors"), objects


def write_state_truth(case: Case) -> None:
    """Write the truth of a ``sharded`` or ``single`` case's version without saving a checkpoint."""
    if case.kind == "sharded":
        write_truth(case, *_sharded_truth(case.version, case.large))
        return
    state = single_state(case.version, large=case.large)
    write_truth(case, {k: v for k, v in state.items() if isinstance(v, torch.Tensor)},
                {k: v for k, v in state.items() if not isinstance(v, torch.Tensor)})


def save_sharded_rank(rank: int, world: int, case: Case) -> None:
    """For ``run_ranks(2, ...)``: save the ``sharded`` state of ``case.version`` (rank 0 writes the truth)."""
    Checkpointer().save(case.dir, sharded_rank_state(rank, case.version, large=case.large))
    if rank == 0:
        write_truth(case, *_sharded_truth(case.version, case.large))


def save_case(case: Case) -> None:
    """Save a ``single`` or ``model`` case in this process (``sharded`` needs 2 ranks: ``save_sharded_rank``)."""
    if case.kind == "single":
        Checkpointer().save(case.dir, single_state(case.version, large=case.large))
        write_state_truth(case)
    elif case.kind == "model":
        model, optim = _model_and_optim(case.version)
        shardsafe.save_model_and_optim_state(case.dir, model, optim)
        # the documented key convention: model.<name>, optim.state.<name>.<state>, optim.param_groups
        tensors = {f"model.{k}": v for k, v in model.state_dict().items()}
        names = [n for n, _ in model.named_parameters()]
        sd = optim.state_dict()
        for idx, per in sd["state"].items():
            for sname, value in per.items():
                tensors[f"optim.state.{names[idx]}.{sname}"] = value
        # values (param groups, the optimizer's class) as the library stores them: their JSON mapping
        # is its own business, and their round trip is tested elsewhere
        stored = Checkpointer().unshard(case.dir, no_dist=True)
        write_truth(case, tensors, {k: v for k, v in stored.items() if not isinstance(v, torch.Tensor)})
    else:
        raise ValueError(f"save_case cannot save a {case.kind!r} case in one process")


# --- layouts to load back ----------------------------------------------------------------------


def _box_rows(shape: tuple[int, ...], dim: int, parts: int) -> list[Piece]:
    if not shape:
        return [((), (), None)] * parts
    out = []
    for lo, hi in _halves(shape[dim], parts):
        off = [0] * len(shape)
        lens = list(shape)
        off[dim], lens[dim] = lo, hi - lo
        out.append((tuple(off), tuple(lens), None))
    return out


def _whole(shape: tuple[int, ...]) -> Piece:
    return ((0,) * len(shape), tuple(shape), None)


def layouts(case: Case, shapes: dict[str, tuple[int, ...]]) -> dict[str, list[dict[str, Piece]]]:
    """Target layouts of a ``sharded`` or ``single`` case by name; each is a list of "ranks", each
    a dict key -> one piece.

    ``same`` is the saved layout (for ``sharded``: the pieces each saving rank held); the others
    reshard. Keys absent from a rank's dict are not loaded by that rank.
    """
    if case.kind == "sharded":
        n = prod(shapes["flat"])
        same = []
        for r in range(2):
            same.append({
                "dt0": _box_rows(shapes["dt0"], 0, 2)[r],
                "dt1": _box_rows(shapes["dt1"], 1, 2)[r],
                "rep": _whole(shapes["rep"]),
                "flat": ((0, 0), tuple(shapes["flat"]), _flat_split(n, r)),
                "scale": _whole(shapes["scale"]),
            })
        cols = [{"dt0": a, "dt1": b, "rep": c, "flat": d, "scale": _whole(())}
                for a, b, c, d in zip(_box_rows(shapes["dt0"], 1, 2), _box_rows(shapes["dt1"], 0, 2),
                                      _box_rows(shapes["rep"], 0, 2), _box_rows(shapes["flat"], 0, 2))]
        three = [{"dt0": a, "dt1": b, "rep": c, "flat": ((0, 0), tuple(shapes["flat"]), fr)}
                 for a, b, c, fr in zip(_box_rows(shapes["dt0"], 0, 3), _box_rows(shapes["dt1"], 1, 3),
                                        _box_rows(shapes["rep"], 0, 3), [(0, 7), (7, n - 5), (n - 5, n)])]
        return {"same": same, "reshard-2": cols, "reshard-3": three}
    keys = list(shapes)
    same = [{k: _whole(shapes[k]) for k in keys}]
    halves = [dict(zip(keys, ps)) for ps in zip(*[_box_rows(shapes[k], 0, 2) if shapes[k] else [_whole(())] * 2 for k in keys])]
    return {"same": same, "reshard-2": halves}


def targets(pieces: dict[str, Piece], dtypes: dict[str, torch.dtype], shapes: dict[str, tuple[int, ...]]) -> dict[str, ShardedTensor]:
    """Empty ``ShardedTensor`` targets (filled with a sentinel) for one rank of a layout."""
    out = {}
    for key, (off, lens, flat) in pieces.items():
        n = prod(lens) if flat is None else flat[1] - flat[0]
        data = torch.empty(n * dtypes[key].itemsize, dtype=torch.uint8).fill_(0xA5).view(dtypes[key])
        if flat is None:
            data = data.reshape(lens)
        out[key] = ShardedTensor(key, data, shapes[key], off, lens, flattened_range=None if flat is None else slice(*flat))
    return out


def expected_piece(full: torch.Tensor, piece: Piece) -> torch.Tensor:
    off, lens, flat = piece
    box = full[tuple(slice(o, o + n) for o, n in zip(off, lens))] if lens else full
    return box.reshape(-1)[flat[0] : flat[1]] if flat is not None else box


def compare(got: Any, want: Any, where: str) -> str:
    """"" when ``got`` equals ``want`` bit for bit (tensors) or in value and type (JSON values);
    else a description of the first difference."""
    if isinstance(want, torch.Tensor):
        if not isinstance(got, torch.Tensor):
            return f"{where}: expected a tensor, got {type(got).__name__}"
        if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
            return f"{where}: expected {want.dtype} {list(want.shape)}, got {got.dtype} {list(got.shape)}"
        if not torch.equal(bits(got), bits(want)):
            diff = int((bits(got) != bits(want)).sum())
            return f"{where}: {diff} byte(s) differ from what was saved"
        return ""
    if isinstance(want, dict):
        if not isinstance(got, dict) or set(got) != set(want):
            return f"{where}: expected keys {sorted(want)[:8]}, got {sorted(got)[:8] if isinstance(got, dict) else type(got).__name__}"
        for k in want:
            d = compare(got[k], want[k], f"{where}.{k}")
            if d:
                return d
        return ""
    if isinstance(want, (list, tuple)):
        if not isinstance(got, (list, tuple)) or len(got) != len(want):
            return f"{where}: expected {want!r}, got {got!r}"
        for i, (g, w) in enumerate(zip(got, want)):
            d = compare(g, w, f"{where}[{i}]")
            if d:
                return d
        return ""
    if type(got) is not type(want) or got != want:
        return f"{where}: expected {want!r}, got {got!r}"
    return ""


def build_cases(root: str, *, large: bool = False, version: int = 1) -> list[Case]:
    """Save one checkpoint of every kind under ``root`` (the ``sharded`` one on 2 gloo ranks)."""
    from ..helpers import run_ranks

    cases = [Case(kind, os.path.join(root, kind), version, large) for kind in KINDS]
    for case in cases:
        if case.kind == "sharded":
            run_ranks(2, save_sharded_rank, case)
        else:
            save_case(case)
    return cases
