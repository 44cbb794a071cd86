"""Model and optimizer checkpoints for any PyTorch parallelism, in one call each.

Stored keys: ``model.<name>`` for parameters and persistent buffers (names without wrapper
parts such as ``module.`` or ``_fsdp_wrapped_module.``), and the optimizer under ``optim.``
(see :mod:`shardsafe.adapters.optim`). So a checkpoint saved from DDP loads into FSDP2, FSDP1,
tensor parallel or a plain module, at any world size. No state_dict_type to set, no pickle.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._args import check_arg, check_bool
from ._progress import Progress, rank_progress
from .adapters.keys import MODEL_PREFIX, OPTIM_PREFIX
from .adapters.modules import ParamInfo, model_state
from .adapters.optim import (
    GROUPS_KEY,
    STATE_PREFIX,
    check_param_groups,
    dotted_param_groups,
    optim_state,
    optim_targets,
    split_state_key,
)
from .dist import Comm, get_comm
from .engine.background import AsyncSave
from .engine.loader import load_state, read_metadata, unshard_state
from .engine.writer import async_save_state, save_state
from .errors import CheckpointError, MissingKeyError
from .format.metadata import StorageMetadata
from .knobs import KNOBS, Knobs
from .storage import Location, Storage, open_storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["async_save_model_and_optim_state", "load_model_and_optim_state", "save_model_and_optim_state", "unshard_model_state", "unshard_optim_state"]



def _model_values(params: list[ParamInfo], buffers: list[ParamInfo]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for info in [*params, *buffers]:
        if info.holds_nothing:
            continue  # FSDP1: none of this parameter lives on this rank
        key = MODEL_PREFIX + info.fqn
        out[key] = info.sharded(key, info.tensor)
    return out


def save_model_and_optim_state(
    dir: Location,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    save_overwrite: bool = False,
    *,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> list[str]:
    """Save the model's parameters and persistent buffers and the optimizer's state.

    Every rank calls this together, outside forward/backward. Works for plain modules, DDP,
    FSDP2 (``fully_shard``, HSDP), tensor parallel, FSDP2 + TP and FSDP1 with
    ``use_orig_params=True``; the result loads into any of them at any world size with
    :func:`load_model_and_optim_state`. Returns the files this rank wrote. ``process_group``:
    the ranks that take part (default: all).

    ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
    callable is called on every rank as ``progress(done, total)`` with the bytes of this rank's
    data file written so far, out of its tensor bytes (known once the save is planned), from the
    thread that writes; ``(total, total)`` once the file is complete.
    """
    return _save_model_and_optim(
        "save_model_and_optim_state", dir, model, optim, save_overwrite, knobs, process_group, False, progress
    )


def async_save_model_and_optim_state(
    dir: Location,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    save_overwrite: bool = False,
    *,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> AsyncSave[list[str]]:
    """:func:`save_model_and_optim_state` in the background: returns once the state is staged
    (training may go on and change every parameter); ``wait()`` on the result returns the files
    this rank wrote once the checkpoint is committed, or raises the save's error.

    ``progress``: as for :func:`save_model_and_optim_state`; the bar is drawn, and a callable
    called, by the background thread that writes, after this call has returned (the last call,
    with ``(total, total)``, comes before the save commits)."""
    return _save_model_and_optim(
        "async_save_model_and_optim_state", dir, model, optim, save_overwrite, knobs, process_group, True, progress
    )


def model_and_optim_values(model: nn.Module, optim: torch.optim.Optimizer | None) -> dict[str, Any]:
    """The flat state dict :func:`save_model_and_optim_state` stores: ``model.*`` and ``optim.*`` keys."""
    params, buffers = model_state(model)
    state = _model_values(params, buffers)
    if optim is not None:
        state.update(optim_state(optim, params))
    return state


def _save_model_and_optim(
    func: str, dir: Location, model: Any, optim: Any, save_overwrite: Any, knobs: Any, process_group: ProcessGroup | None,
    background: bool, progress: bool | Progress | None,
) -> Any:
    _check_model_args(func, model, optim, knobs)
    check_bool(func, "save_overwrite", save_overwrite)
    knobs = knobs or KNOBS
    storage = open_storage(dir)
    state = model_and_optim_values(model, optim)
    # an async save's ranks meet in the background (see async_save_state)
    comm = get_comm(process_group=process_group, call=f"shardsafe.{func}", timeout_s=knobs.collective_timeout_s, arrive=not background)
    bar = rank_progress(progress, func, comm.is_coordinator)
    common = dict(save_overwrite=save_overwrite, allow_pickle=False, comm=comm, knobs=knobs, want_meta=False, progress=bar)
    if not background:
        return save_state(storage, state, **common)[1]  # only the files are returned
    return async_save_state(storage, state, result=lambda out: out[1], **common)


def load_model_and_optim_state(
    dir: Location,
    model: nn.Module,
    optim: torch.optim.Optimizer | None = None,
    validate: bool = True,
    *,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> None:
    """Load a checkpoint of :func:`save_model_and_optim_state` into ``model`` (and ``optim``) in place.

    Every rank calls this together. Parameters and buffers are filled in their own memory, each
    rank reading only its part; optimizer state is filled in place too (allocated once, like the
    parameter, if the optimizer has none yet: no dummy step needed) and handed to the optimizer's
    ``load_state_dict``, which also restores each param group's hyper-parameters.

    Every element of every target is overwritten or an error is raised, always. ``validate``
    additionally refuses a checkpoint that holds model or optimizer keys the targets lack
    (``MissingKeyError`` is raised either way for keys the targets need and the checkpoint lacks).

    ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
    callable is called on every rank as ``progress(done, total)`` with the bytes of this rank's
    targets filled so far (from the thread that loads).
    """
    _check_model_args("load_model_and_optim_state", model, optim, knobs)
    check_bool("load_model_and_optim_state", "validate", validate)
    knobs = knobs or KNOBS
    storage = open_storage(dir)
    comm = get_comm(process_group=process_group, call="shardsafe.load_model_and_optim_state", timeout_s=knobs.collective_timeout_s)
    bar = rank_progress(progress, "load_model_and_optim_state", comm.is_coordinator)
    load_model_and_more(storage, comm, model, optim, knobs=knobs, validate=validate, progress=bar)


def load_model_and_more(
    storage: Storage,
    comm: Comm,
    model: nn.Module | None,
    optim: torch.optim.Optimizer | None,
    *,
    knobs: Knobs,
    validate: bool,
    more_targets: Callable[[StorageMetadata], dict[str, Any]] | None = None,
    more_apply: Callable[[dict[str, Any]], None] | None = None,
    progress: Progress | None = None,
) -> None:
    """Load ``model`` and ``optim`` (either may be None; ``optim`` only with its ``model``) in
    place and, in the same pass, the targets ``more_targets(metadata)`` returns; then hand the
    optimizer its state and call ``more_apply`` with every loaded value. Every rank of ``comm``
    calls it together; a failure on any rank (in the callbacks too) raises on every rank."""
    meta = read_metadata(storage, comm)
    params, buffers = model_state(model) if model is not None else ([], [])
    holder: dict[str, Any] = {}

    def targets() -> None:
        state: dict[str, Any] = {}
        if model is not None:
            check_model_keys(meta.tensors, [i.fqn for i in [*params, *buffers]], storage.url, strict=validate)
            state = _model_values(params, buffers)
        if optim is not None:
            opt_targets, holder["apply"] = optim_targets(optim, params, meta, storage.url, strict=validate)
            state.update(opt_targets)
        if more_targets is not None:
            state.update(more_targets(meta))
        holder["state"] = state

    comm.check(targets)
    state = holder["state"]
    load_state(storage, state, comm, meta, allow_pickle=False, knobs=knobs, progress=progress)  # the storage already opened: one client, not two

    def apply() -> None:
        if optim is not None:
            holder["apply"](state)
        if more_apply is not None:
            more_apply(state)

    if optim is not None or more_apply is not None:
        comm.check(apply)


def _check_model_args(func: str, model: Any, optim: Any, knobs: Any) -> None:
    check_arg(func, "model", model, nn.Module)
    check_arg(func, "optim", optim, torch.optim.Optimizer, optional=True)
    check_arg(func, "knobs", knobs, Knobs, optional=True)


def _unshard_prefix(
    func: str, dir: Location, prefix: str, what: str, device: Any, rank0_only: Any, no_dist: Any, knobs: Any,
    process_group: ProcessGroup | None, progress: bool | Progress | None,
) -> tuple[dict[str, Any], Comm]:
    """The keys under ``prefix``, unsharded, for the public function ``func``; ``what`` says
    what is missing when no key has the prefix."""
    check_arg(func, "device", device, (torch.device, str), optional=True)
    check_bool(func, "rank0_only", rank0_only)
    check_bool(func, "no_dist", no_dist)
    check_arg(func, "knobs", knobs, Knobs, optional=True)
    knobs = knobs or KNOBS
    storage = open_storage(dir)
    comm = get_comm(no_dist, process_group, call=f"shardsafe.{func}", timeout_s=knobs.collective_timeout_s)
    bar = rank_progress(progress, func, comm.is_coordinator)
    try:
        out = unshard_state(
            storage, comm, allow_pickle=False, knobs=knobs, device=device, rank0_only=rank0_only, prefix=prefix, progress=bar
        )
        return out, comm
    except MissingKeyError as e:
        raise MissingKeyError(f"{storage.url}: {what}: {e}") from None  # the URL: ``dir`` may be a Storage


def _where(dir: Location) -> str:
    """``dir`` for messages: its URL when it is an opened Storage, else as given."""
    return str(getattr(dir, "url", dir))


def check_model_keys(stored: dict[str, Any], fqns: list[str], where: str, *, strict: bool, flag: str = "validate") -> None:
    stored_model = {k[len(MODEL_PREFIX) :] for k in stored if k.startswith(MODEL_PREFIX)}
    missing = [f for f in fqns if f not in stored_model]
    if missing:
        raise MissingKeyError(
            f"{where}: the checkpoint lacks {len(missing)} model key(s) the model has: {missing[:5]}"
            f"{'...' if len(missing) > 5 else ''} ({len(stored_model)} model tensors stored)"
        )
    if strict:
        extra = sorted(stored_model - set(fqns))
        if extra:
            raise CheckpointError(
                f"{where}: the checkpoint holds {len(extra)} model key(s) the model lacks: {extra[:5]}"
                f"{'...' if len(extra) > 5 else ''}; pass {flag}=False to load the rest"
            )


def unshard_model_state(
    dir: Location,
    device: torch.device | str | None = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    *,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> dict[str, torch.Tensor]:
    """The full model state dict (parameter name -> whole tensor) of a model/optimizer checkpoint.

    Needs no process group. In a distributed context every rank of ``process_group`` (default:
    all) calls it together; with ``rank0_only`` the other ranks get ``{}``; ``no_dist`` uses no
    collective at all (any rank may call it alone). Only model tensors are read; a checkpoint
    without any raises ``MissingKeyError``.

    ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
    callable is called on every rank as ``progress(done, total)`` with the bytes of the tensors
    this rank has filled so far (from the thread that unshards).
    """
    what = "no model state in the checkpoint (was it saved by save_model_and_optim_state?)"
    flat, _ = _unshard_prefix(
        "unshard_model_state", dir, MODEL_PREFIX, what, device, rank0_only, no_dist, knobs, process_group, progress
    )
    return flat


def unshard_optim_state(
    dir: Location,
    device: torch.device | str | None = None,
    rank0_only: bool = False,
    no_dist: bool = False,
    *,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> dict[str, Any]:
    """The full optimizer state, keyed by parameter name: ``{"state": {name: {state name: value}},
    "param_groups": [{..hyper-parameters.., "params": [name, ...]}]}``.

    Needs no process group. In a distributed context every rank of ``process_group`` (default:
    all) calls it together; with ``rank0_only`` the other ranks get ``{}``; ``no_dist`` uses no
    collective at all (any rank may call it alone). Only optimizer state is read.

    ``progress``: ``True`` draws a progress bar (tqdm, on stderr) on the coordinator only; a
    callable is called on every rank as ``progress(done, total)`` with the bytes of the tensors
    this rank has filled so far (from the thread that unshards).
    """
    what = f"no optimizer state in the checkpoint (no {GROUPS_KEY!r})"
    flat, comm = _unshard_prefix(
        "unshard_optim_state", dir, OPTIM_PREFIX, what, device, rank0_only, no_dist, knobs, process_group, progress
    )
    if not flat and rank0_only and comm.rank != 0:
        return {}  # not rank 0 (an empty result on rank 0 means no optimizer was saved: refused below)
    return optim_state_of(flat, _where(dir))


def optim_state_of(flat: dict[str, Any], where: str) -> dict[str, Any]:
    """:func:`unshard_optim_state`'s result from the values stored under ``optim.`` (prefix
    removed, tensors first as the unshard gives them); the tensors may be any objects standing in
    for them (``shardsafe.lightning.consolidate`` passes placeholders). Consumes ``flat``."""
    name = GROUPS_KEY[len(OPTIM_PREFIX) :]
    groups = flat.pop(name, None)
    if groups is None:  # written by DCP (get_state_dict): param_groups.<i>.<field>
        dotted = {k: flat.pop(k) for k in [k for k in flat if k.startswith(name + ".")]}
        groups = dotted_param_groups(dotted, name + ".", where)
    if groups is None:
        raise CheckpointError(f"{where}: no optimizer state in the checkpoint (no {GROUPS_KEY!r})")
    groups = check_param_groups(groups, where)
    fqns = {f for g in groups for f in g["params"]}
    state: dict[str, dict[str, Any]] = {}
    for key, value in flat.items():
        if not key.startswith(STATE_PREFIX[len(OPTIM_PREFIX) :]):
            continue
        fqn, name = split_state_key(OPTIM_PREFIX + key, fqns)
        state.setdefault(fqn, {})[name] = value
    return {"state": state, "param_groups": groups}
