"""Every public read path, run on a (possibly damaged) checkpoint and compared with the truth.

:func:`run_path` is what the sandbox worker runs: it returns ``""`` when every value the path
returned equals what was saved (bit for bit), a description of the first difference otherwise,
and lets the library's exceptions through. Shapes and dtypes of targets come from the truth,
never from the checkpoint being read.
"""

from __future__ import annotations

import json
import os
import uuid
from functools import lru_cache
from typing import Any

import torch
from safetensors import safe_open

import shardsafe
from shardsafe import Checkpointer

from .states import Case, compare, expected_piece, fresh_model_and_optim, layouts, read_truth, targets

__all__ = ["PATHS", "run_path"]

PATHS = {
    "sharded": ("same", "reshard-2", "reshard-3", "unshard", "export", "verify"),
    "single": ("same", "reshard-2", "unshard", "export", "verify"),
    "model": ("load-model-optim", "unshard-model", "unshard-optim", "unshard", "export", "verify"),
}


@lru_cache(maxsize=16)
def _truth(case: Case) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    return read_truth(case)


def run_path(case: Case, path: str, out_dir: str, directory: str | None = None) -> str:
    """Run read path ``path`` on ``directory`` (default ``case.dir``), holding ``case``'s checkpoint."""
    where = directory or case.dir
    tensors, objects = _truth(case)
    if path in ("same", "reshard-2", "reshard-3"):
        return _load_layout(case, where, path, tensors, objects)
    if path == "unshard":
        return compare(Checkpointer().unshard(where, no_dist=True), {**tensors, **objects}, "unshard")
    if path == "export":
        out = os.path.join(out_dir, f"export-{uuid.uuid4().hex[:8]}.safetensors")
        shardsafe.unshard_to_safetensors(where, out)
        with safe_open(out, framework="pt") as f:
            got: dict[str, Any] = {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118 - safe_open has no iterator
            got.update((k, json.loads(v)) for k, v in (f.metadata() or {}).items() if k != "format")
        os.unlink(out)
        return compare(got, {**tensors, **objects}, "export")
    if path == "verify":
        shardsafe.verify(where)
        return ""
    if path == "metadata":
        Checkpointer().get_metadata(where, no_dist=True)
        return ""
    if path == "load-model-optim":
        return _load_model(where, tensors, objects)
    if path == "unshard-model":
        want = {k.removeprefix("model."): v for k, v in tensors.items() if k.startswith("model.")}
        return compare(shardsafe.unshard_model_state(where, no_dist=True), want, "unshard_model_state")
    if path == "unshard-optim":
        got = shardsafe.unshard_optim_state(where, no_dist=True)
        state: dict[str, dict[str, Any]] = {}
        for key, value in tensors.items():
            if key.startswith("optim.state."):
                name, sname = key.removeprefix("optim.state.").rsplit(".", 1)
                state.setdefault(name, {})[sname] = value
        return compare(got, {"state": state, "param_groups": objects["optim.param_groups"]}, "unshard_optim_state")
    raise ValueError(f"unknown read path {path!r}")


def _load_layout(case: Case, where: str, path: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> str:
    shapes = {k: tuple(v.shape) for k, v in tensors.items()}
    dtypes = {k: v.dtype for k, v in tensors.items()}
    for rank, pieces in enumerate(layouts(case, shapes)[path]):
        sd: dict[str, Any] = dict(targets(pieces, dtypes, shapes))
        if rank == 0:
            sd.update((k, None) for k in objects)
        Checkpointer().load(where, sd, no_dist=True)
        for key, piece in pieces.items():
            want = expected_piece(tensors[key], piece)
            diff = compare(sd[key].data.reshape(want.shape), want, f"{path} rank {rank} {key}")
            if diff:
                return diff
        if rank == 0:
            diff = compare({k: sd[k] for k in objects}, objects, f"{path} values")
            if diff:
                return diff
    return ""


def _load_model(where: str, tensors: dict[str, torch.Tensor], objects: dict[str, Any]) -> str:
    model, optim = fresh_model_and_optim()
    shardsafe.load_model_and_optim_state(where, model, optim)
    names = [n for n, _ in model.named_parameters()]
    got: dict[str, Any] = {f"model.{k}": v for k, v in model.state_dict().items()}
    sd = optim.state_dict()
    for idx, per in sd["state"].items():
        got.update((f"optim.state.{names[idx]}.{s}", v) for s, v in per.items())
    diff = compare(got, tensors, "load_model_and_optim_state")
    if diff:
        return diff
    for i, group in enumerate(objects["optim.param_groups"]):
        for hp in ("lr", "eps", "weight_decay"):
            if optim.param_groups[i][hp] != group[hp]:
                return f"load_model_and_optim_state: param group {i} {hp}: expected {group[hp]!r}, got {optim.param_groups[i][hp]!r}"
    return ""
