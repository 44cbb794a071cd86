"""Model and optimizer checkpoints for any PyTorch parallelism, in one call each.

Stored keys: ``model.<name>`` for parameters and persistent buffers (names without wrapper
parts such as ``module.`` or ``_fsdp_wrapped_module.``), and the optimizer under ``optim.``
(see :mod:`shardsafe.adapters.optim`). So a checkpoint saved from DDP loads into FSDP2, FSDP1,
tensor parallel or a plain module, at any world size. No state_dict_type to set, no pickle.
"""

from __future__ import annotations

import logging
import os
import time
import warnings
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from ._args import check_arg, check_bool
from ._progress import Progress, progress_callback, rank_progress
from .adapters import LocalTensor
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
from .adapters.subclasses import stored_tensor_keys
from .dist import Comm, get_comm
from .engine.background import AsyncSave
from .engine.consolidate import export_tensors
from .engine.loader import load_state, read_metadata, unshard_state
from .engine.outputs import CONFIG_FILE, OutputFile, OutputFolder, config_json
from .engine.writer import async_save_state, save_state
from .errors import CheckpointError, DtypeMismatchError, MissingKeyError
from .format.dtypes import SAFETENSORS_CODE
from .format.metadata import StorageMetadata
from .knobs import KNOBS, Knobs
from .storage import Location, Storage, open_storage

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = [
    "async_save_model_and_optim_state",
    "load_model_and_optim_state",
    "save_model_and_optim_state",
    "unshard_model_state",
    "unshard_optim_state",
    "unshard_to_safetensors",
]

log = logging.getLogger("shardsafe.engine.consolidate")  # the export's lines keep their logger



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
    dequantize: bool = False,
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

    ``dequantize``: a plain parameter or state tensor whose key holds a quantized tensor subclass
    (an NF4 base weight, 8-bit optimizer state) gets its high-precision values.
    """
    _check_model_args("load_model_and_optim_state", model, optim, knobs)
    check_bool("load_model_and_optim_state", "validate", validate)
    check_bool("load_model_and_optim_state", "dequantize", dequantize)
    knobs = knobs or KNOBS
    storage = open_storage(dir)
    comm = get_comm(process_group=process_group, call="shardsafe.load_model_and_optim_state", timeout_s=knobs.collective_timeout_s)
    bar = rank_progress(progress, "load_model_and_optim_state", comm.is_coordinator)
    load_model_and_more(storage, comm, model, optim, knobs=knobs, validate=validate, progress=bar, dequantize=dequantize)


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
    fetch: Callable[[StorageMetadata, list[LocalTensor]], None] | None = None,
    dequantize: bool = False,
) -> None:
    """Load ``model`` and ``optim`` (either may be None; ``optim`` only with its ``model``) in
    place and, in the same pass, the targets ``more_targets(metadata)`` returns; then hand the
    optimizer its state and call ``more_apply`` with every loaded value. Every rank of ``comm``
    calls it together; a failure on any rank (in the callbacks too) raises on every rank.
    ``fetch``: see :func:`~shardsafe.engine.loader.load_state`."""
    meta = read_metadata(storage, comm)
    params, buffers = model_state(model) if model is not None else ([], [])
    holder: dict[str, Any] = {}

    def targets() -> None:
        state: dict[str, Any] = {}
        if model is not None:
            check_model_keys(
                stored_tensor_keys(meta.tensors, meta.objects, storage.url), [i.fqn for i in [*params, *buffers]], storage.url, strict=validate
            )
            state = _model_values(params, buffers)
        if optim is not None:
            opt_targets, holder["apply"] = optim_targets(optim, params, meta, storage.url, strict=validate, dequantize=dequantize)
            state.update(opt_targets)
        if more_targets is not None:
            state.update(more_targets(meta))
        holder["state"] = state

    comm.check(targets)
    state = holder["state"]
    load_state(storage, state, comm, meta, allow_pickle=False, knobs=knobs, progress=progress, fetch=fetch, dequantize=dequantize)  # the storage already opened: one client, not two

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


def unshard_to_safetensors(
    dir: str | os.PathLike[str],
    out_path: str | os.PathLike[str],
    *,
    prefix: str | None = None,
    overwrite: bool = False,
    max_shard_size: int | None = None,
    dtype: torch.dtype | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
    knobs: Knobs | None = None,
    config: Any = None,
    dequantize: bool = False,
) -> dict[str, int]:
    """Write every tensor of the checkpoint at ``dir`` into one safetensors file at ``out_path``
    or, with ``max_shard_size``, into a Hugging Face style folder at ``out_path``.

    With ``prefix``, only keys that start with it are written, with the prefix removed
    (``prefix="model."`` turns ``"model.layers.0.weight"`` into ``"layers.0.weight"``).
    Non-tensor values stored as JSON (under the prefix, if given) go into the file's
    ``__metadata__`` as JSON strings, under their (stripped) keys, next to ``"format": "pt"``;
    values stored with pickle are never unpickled and are left out (counted in the result).

    ``max_shard_size`` (bytes of tensor data per file): ``out_path`` is a folder, written as
    ``transformers``' ``save_pretrained`` writes one: ``model.safetensors`` when every tensor fits
    in one file, else ``model-00001-of-0000N.safetensors`` ... (tensors in name order, a file
    closed before it would pass the limit; a tensor larger than the limit gets a file of its
    own) and ``model.safetensors.index.json`` (``{"metadata": {"total_size": ...},
    "weight_map": {name: file}}``), written last. JSON values go into every file's
    ``__metadata__``. Files of an earlier export there (the other layout, other shard counts)
    are removed once the new one is complete, only with ``overwrite=True``.

    ``config`` (with ``max_shard_size`` only): the model's configuration, written to the folder as
    ``config.json`` so that ``transformers``' ``from_pretrained(out_path)`` builds the right model:
    a ``transformers.PretrainedConfig`` (written as its ``save_pretrained`` writes it), or the path
    of a ``config.json`` (or of a folder holding one), copied after checking it is a JSON object.
    Without it the folder holds the weights only, and a ``UserWarning`` says so and how to add
    the config (``from_pretrained`` on such a folder builds a default model of its own choosing).

    ``dtype``: cast every floating-point tensor to it (``torch.bfloat16``, ...); other tensors
    are written as stored. Checksums are checked on the stored bytes, before the cast.
    ``dequantize``: a quantized tensor subclass (an NF4 base weight of QLoRA, 8-bit optimizer
    state) is written as its high-precision tensor (built whole in memory); without it, such a
    key is refused (``ShardingError``) rather than written as its codes and scales.
    ``progress``: ``True`` draws a progress bar (tqdm) on stderr; a callable is called as
    ``progress(done, total)`` with the bytes of tensor data written so far.

    Peak memory is four blocks of ``knobs.write_block_bytes`` (64 MiB by default) when every
    chunk is a run of rows (as FSDP / ``Shard(0)`` saves them), plus as many cast blocks with
    ``dtype``; tensors saved in other layouts add the largest of them and
    ``knobs.read_buffer_bytes`` of scratch. Every chunk is checked against its checksums. Each
    file appears atomically and durably (fsynced temporary file, renamed); an existing
    ``out_path`` file (or an existing export in the ``out_path`` folder) is replaced only with
    ``overwrite=True``. ``out_path`` may also be an object-store or ``memory://`` URL
    (``s3://bucket/dir/model.safetensors``, configured by the environment): the object is
    uploaded as it is written and appears only once complete; without ``overwrite`` an
    existing object is refused (checked before writing). Needs no process group.

    Returns counts: ``tensors``, ``bytes`` (tensor data), ``file_bytes`` (all files written),
    with ``max_shard_size`` ``files`` (data files written) and ``config`` (1 if config.json was written, else 0), ``values`` (JSON values written to ``__metadata__``), ``skipped_values``
    (pickled values left out).
    """
    check_arg("unshard_to_safetensors", "out_path", out_path, (str, os.PathLike))
    check_arg("unshard_to_safetensors", "prefix", prefix, str, optional=True)
    check_bool("unshard_to_safetensors", "overwrite", overwrite)
    check_arg("unshard_to_safetensors", "max_shard_size", max_shard_size, int, optional=True)
    check_arg("unshard_to_safetensors", "dtype", dtype, torch.dtype, optional=True)
    check_arg("unshard_to_safetensors", "knobs", knobs, Knobs, optional=True)
    check_bool("unshard_to_safetensors", "dequantize", dequantize)
    if max_shard_size is not None and max_shard_size <= 0:
        raise CheckpointError(f"unshard_to_safetensors: max_shard_size must be a positive number of bytes, got {max_shard_size}")
    if dtype is not None and dtype not in SAFETENSORS_CODE:
        raise DtypeMismatchError(f"unshard_to_safetensors: dtype {dtype} cannot be stored in safetensors")
    if config is not None and max_shard_size is None:
        raise CheckpointError(
            "unshard_to_safetensors: config= writes config.json beside the weights, in a folder: pass max_shard_size "
            "as well (a folder as save_pretrained writes one; 5 * 10**9 is transformers' default)"
        )
    knobs = knobs or KNOBS
    started = time.monotonic()
    out = os.fspath(out_path)
    config_raw = config_json(config) if config is not None else None
    folder = OutputFolder(out, overwrite=overwrite, config=config_raw) if max_shard_size is not None else None
    single = None if folder is not None else OutputFile(out, overwrite=overwrite, knobs=knobs)
    storage = open_storage(dir)
    meta = read_metadata(storage, get_comm(no_dist=True))
    counts, groups, outputs = export_tensors(
        storage, meta, prefix=prefix, dtype=dtype, max_shard_size=max_shard_size,
        open_outputs=(lambda n: [single]) if folder is None else (lambda n: folder.outputs(n, knobs)),  # type: ignore[list-item,union-attr]
        progress=progress_callback(progress, "unshard_to_safetensors"), knobs=knobs, dequantize=dequantize,
    )
    total = counts["bytes"]
    if folder is not None:
        folder.finish(groups, outputs, total)
        if config_raw is None:
            warnings.warn(
                f"{folder.where}: the folder holds the weights only, no {CONFIG_FILE}: transformers' from_pretrained needs "
                f"the model's config and without it builds a default model of its own. Pass config= (a PretrainedConfig, or "
                f"the path of a config.json; --config on the command line), or copy the model's {CONFIG_FILE} into the folder",
                UserWarning,
                stacklevel=2,
            )
    seconds = time.monotonic() - started
    log.debug(
        "unshard %s -> %s: %d tensors, %d bytes in %d file(s), %.2f s, %.2f GB/s",
        storage.url, out, counts["tensors"], total, len(outputs), seconds, total / max(seconds, 1e-9) / 1e9,
    )
    if folder is not None:
        counts["files"] = len(outputs)
        counts["config"] = int(config_raw is not None)
    return counts
