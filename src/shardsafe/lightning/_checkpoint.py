"""Lightning checkpoints as shardsafe checkpoints, with no Lightning import.

A Lightning checkpoint is a model, its optimizer and everything else the ``Trainer`` (or a
Fabric user) puts in the checkpoint dict: epoch, global step, loop and callback state,
scheduler states, hyper-parameters. shardsafe stores it as one checkpoint, one atomic commit:

- ``model.<name>``: the module's parameters and persistent buffers, each rank its own shards
  (the keys :func:`shardsafe.save_model_and_optim_state` writes, so the checkpoint also loads
  with :func:`shardsafe.load_model_and_optim_state` and :func:`shardsafe.unshard_model_state`);
- ``optim.*``: the optimizer's state and param groups, by parameter name;
- ``lightning.meta``: everything else, one JSON value in ``metadata.json``, with tuples,
  tensors (inline, up to 1 MiB each), NaN and the like as tagged JSON (``docs/format.md`` §13).
  An object that has no JSON form is refused unless the caller opts in to pickle.
"""

from __future__ import annotations

import logging
import os
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping
from contextlib import nullcontext
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from .._progress import progress_callback
from ..adapters import describe_state
from ..adapters.keys import LIGHTNING_META_KEY, MODEL_PREFIX, OPTIM_PREFIX
from ..api import load_model_and_more, model_and_optim_values
from ..checkpointer import Checkpointer
from ..dist import get_comm
from ..engine.bounds import check_files_hold
from ..engine.outputs import OutputFile
from ..engine.reader import Reader
from ..engine.writer import save_state
from ..errors import CheckpointError, CorruptCheckpointError, MissingKeyError
from ..format.metadata import StorageMetadata, keys_under
from ..format.values import decode_objects, plain_mappings
from ..knobs import KNOBS, Knobs
from ..storage import Location, Storage, open_storage
from ..storage.base import DCP_METADATA
from ._torch_file import FileObject, LazyTensor, missing_api, save_streamed

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

__all__ = ["META_KEY", "is_lightning_dcp_folder", "is_shardsafe_checkpoint", "load_checkpoint", "read_meta", "save_checkpoint"]

META_KEY = LIGHTNING_META_KEY
LIGHTNING_META_FILE = "meta.pt"  # Lightning's loop state beside a DCP checkpoint (torch.save'd)
log = logging.getLogger(__name__)

_OPT_IN = "or pass allow_pickle=True to the shardsafe.lightning strategy to store it with pickle"


def is_shardsafe_checkpoint(path: Location) -> bool:
    """True when ``path`` is a local folder holding a committed shardsafe checkpoint."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, "metadata.json"))


def is_lightning_dcp_folder(path: Location) -> bool:
    """True when ``path`` is a folder Lightning's sharded save wrote (DCP files and ``meta.pt``)."""
    return isinstance(path, (str, os.PathLike)) and os.path.isfile(os.path.join(path, DCP_METADATA))


def _one_optimizer(optimizers: list[torch.optim.Optimizer], where: str) -> torch.optim.Optimizer | None:
    if len(optimizers) > 1:
        raise CheckpointError(
            f"{where}: shardsafe.lightning saves one optimizer per checkpoint, the module has {len(optimizers)}; "
            "combine their parameter groups into one optimizer, or save with Lightning's own strategy"
        )
    return optimizers[0] if optimizers else None


def save_checkpoint(
    path: Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    meta: dict[str, Any],
    *,
    allow_pickle: bool = False,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
) -> None:
    """Save ``module``, its optimizer and ``meta`` (the rest of the checkpoint dict) at ``path``;
    every rank calls it together. A checkpoint already there is replaced (Lightning's own
    behaviour for ``last.ckpt`` and the like): the old one stays loadable until the new one commits."""
    from ..format.values import encode_value

    optim = _one_optimizer(optimizers, str(path))
    if isinstance(path, (str, os.PathLike)) and os.path.isfile(path):
        os.unlink(path)  # a single-file checkpoint of an earlier run there (Lightning's own strategy does the same)
    knobs = knobs or KNOBS
    storage = open_storage(path)
    state = model_and_optim_values(module, optim)
    state[META_KEY] = encode_value(plain_mappings(meta), where=f"{storage.url}: the checkpoint's {META_KEY!r}", allow_pickle=allow_pickle, opt_in=_OPT_IN)
    comm = get_comm(process_group=process_group, call="shardsafe.lightning.save_checkpoint", timeout_s=knobs.collective_timeout_s)
    save_state(storage, state, save_overwrite=True, allow_pickle=False, comm=comm, knobs=knobs, want_meta=False)


def load_checkpoint(
    path: Location,
    module: nn.Module,
    optimizers: list[torch.optim.Optimizer],
    *,
    strict: bool = True,
    allow_pickle: bool = False,
    knobs: Knobs | None = None,
    process_group: ProcessGroup | None = None,
) -> dict[str, Any]:
    """Load a checkpoint of :func:`save_checkpoint` into ``module`` and its optimizer in place (any
    world size, any sharding) and return the rest of the checkpoint dict; every rank calls it
    together. ``strict``: refuse parameters the checkpoint holds and the module lacks."""
    optim = _one_optimizer(optimizers, str(path))
    knobs = knobs or KNOBS
    storage = open_storage(path)
    comm = get_comm(process_group=process_group, call="shardsafe.lightning.load_checkpoint", timeout_s=knobs.collective_timeout_s)
    out: dict[str, Any] = {}

    def meta_target(meta: StorageMetadata) -> dict[str, Any]:  # every rank, inside the load's first check
        out.update(_decode_meta(meta, storage.url, allow_pickle))
        return {}

    load_model_and_more(storage, comm, module, optim, knobs=knobs, validate=strict, more_targets=meta_target)
    return out


def read_meta(path: Location, *, allow_pickle: bool = False) -> dict[str, Any]:
    """The checkpoint dict without model and optimizer state (``lightning.meta``), decoded; needs no process group."""
    storage = open_storage(path)
    return _decode_meta(Checkpointer().get_metadata(storage, no_dist=True), storage.url, allow_pickle)


def _decode_meta(meta: StorageMetadata, where: str, allow_pickle: bool) -> dict[str, Any]:
    if META_KEY not in meta.objects:
        raise MissingKeyError(f"{where}: no {META_KEY!r} in the checkpoint; was it saved by shardsafe.lightning?")
    opt_in = "pass allow_pickle=True to the shardsafe.lightning strategy (or to read_meta, consolidate)"
    value = decode_objects(meta.objects, {}, [META_KEY], allow_pickle=allow_pickle, where=where, opt_in=opt_in)[META_KEY]
    if not isinstance(value, dict):
        raise CorruptCheckpointError(f"{where}: {META_KEY!r} must be a dict (the checkpoint dict), found a {type(value).__name__}")
    return value


def consolidate(
    dir: Location,
    out: str | os.PathLike | None = None,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    progress: bool | Callable[[int, int], None] | None = None,
    knobs: Knobs | None = None,
) -> dict[str, Any]:
    """The single-file checkpoint Lightning users load with ``torch.load(...)["state_dict"]``, from a
    checkpoint of :func:`save_checkpoint` (or of :func:`shardsafe.save_model_and_optim_state`):
    ``{**the rest of the checkpoint dict, "state_dict": {name: tensor}, "optimizer_states":
    [{"state": {name: {...}}, "param_groups": [...]}]}``, what ``python -m
    lightning.pytorch.utilities.consolidate_checkpoint`` writes (``optimizer_states`` only when
    an optimizer was saved). Needs no process group and no Lightning.

    With ``out``, the file is written there and counts are returned: ``tensors`` (tensors
    written), ``bytes`` (their data), ``file_bytes``. The file is the one ``torch.save``
    writes (byte for byte, to a file object; ``torch.load(out, weights_only=True)`` and
    ``torch.load(out, mmap=True, weights_only=True)`` read it), streamed: the tensors are read
    from the checkpoint and written one at a time through one buffer, so peak memory is about
    the largest tensor (plus the reader's bounded scratch, ``knobs.read_buffer_bytes``), not the
    checkpoint. Every chunk is checked against its checksums. ``out`` appears atomically (an
    fsynced temporary file renamed into place; an object-store URL is uploaded as it is written
    and appears once complete); an existing one is replaced only with ``overwrite=True``.
    ``progress``: ``True`` draws a bar on stderr; a callable gets ``(bytes written, bytes in
    all)`` of tensor data. On a torch that lacks the private serialization names the streaming
    relies on (:func:`shardsafe.lightning._torch_file.missing_api`; tested with torch 2.13),
    the file is built in memory and written with ``torch.save``, with a logged warning.

    Without ``out``, the checkpoint dict itself is returned, every tensor in memory.

    A folder Lightning's own sharded save wrote (DCP files and ``meta.pt``) consolidates too, in
    memory: its ``.metadata`` is read through :mod:`shardsafe.dcp`'s allowlist and ``meta.pt``
    with ``torch.load(weights_only=True)`` (Lightning's own tool unpickles both)."""
    from .._args import check_arg, check_bool

    check_arg("consolidate", "out", out, (str, os.PathLike), optional=True)
    check_bool("consolidate", "overwrite", overwrite)
    check_bool("consolidate", "allow_pickle", allow_pickle)
    check_arg("consolidate", "knobs", knobs, Knobs, optional=True)
    knobs = knobs or KNOBS
    show = progress_callback(progress, "consolidate")
    output = OutputFile(os.fspath(out), overwrite=overwrite, knobs=knobs) if out is not None else None  # refuses an existing one first
    storage: Storage | None = None
    meta: StorageMetadata | None = None
    if is_lightning_dcp_folder(dir):
        structure: dict[str, Any] = _consolidate_lightning_dcp_folder(str(dir), allow_pickle)
    else:
        storage = open_storage(dir)
        meta = Checkpointer().get_metadata(storage, no_dist=True)
        structure = _lightning_structure(storage, meta, allow_pickle)
        check_files_hold(storage, ((t.source, meta.tensors[t.source]) for t in _leaves(structure) if isinstance(t, LazyTensor)))

    def fill(t: LazyTensor, target: torch.Tensor) -> None:  # a stored tensor, unsharded into target
        (lt,), _ = describe_state({t.source: target})
        reader.load_tensor(meta.tensors[t.source], lt)  # type: ignore[union-attr]  # (placeholders only come with meta)

    reader_or_none = Reader(storage, knobs) if storage is not None else nullcontext()
    if output is None:
        with reader_or_none as reader:
            return _materialized(structure, fill)
    started = time.monotonic()
    tensors = [t for t in _leaves(structure) if isinstance(t, (LazyTensor, torch.Tensor))]
    total = sum(t.nbytes for t in tensors)
    written = [0]

    def done(nbytes: int) -> None:
        written[0] += nbytes
        if show is not None:
            show(written[0], total)

    if show is not None:
        show(0, total)
    reason = missing_api()
    ok = False
    try:
        with output.writer() as w, reader_or_none as reader:
            if reason is None:
                size = save_streamed(structure, w, fill, done=done)
            else:
                log.warning("shardsafe.lightning.consolidate: %s; the whole checkpoint is built in memory to be written", reason)
                sink = FileObject(w)
                torch.save(_materialized(structure, fill), sink)
                size = sink.size
        output.publish()
        ok = True
    finally:
        if not ok:
            output.discard()
    if show is not None and written[0] < total:
        show(total, total)  # tensors already in memory (a Lightning DCP folder, values) are written, too
    seconds = time.monotonic() - started
    log.debug("consolidate %s -> %s: %d tensors, %d bytes, %.2f s", dir, output.where, len(tensors), total, seconds)
    return {"tensors": len(tensors), "bytes": total, "file_bytes": size}


def _lightning_structure(storage: Storage, meta: StorageMetadata, allow_pickle: bool) -> dict[str, Any]:
    """The consolidated checkpoint dict of a shardsafe checkpoint, with :class:`LazyTensor`
    placeholders (``source``: the stored key) for the stored tensors: the rest of the checkpoint
    dict, then ``state_dict`` (as :func:`shardsafe.unshard_model_state` gives it) and
    ``optimizer_states`` (``[`` :func:`shardsafe.unshard_optim_state` ``]``, when an optimizer
    was saved), in that order."""
    from ..adapters.optim import stored_param_groups
    from ..api import optim_state_of

    result = _decode_meta(meta, storage.url, allow_pickle) if META_KEY in meta.objects else {}
    result["state_dict"] = _lazy_values(storage, meta, MODEL_PREFIX, allow_pickle)
    if not result["state_dict"]:
        stored = sorted([*meta.tensors, *meta.objects, *meta.pickled_objects])
        raise MissingKeyError(
            f"{storage.url}: no model state in the checkpoint (no key starts with {MODEL_PREFIX!r}; it holds "
            f"{len(stored)} key(s){f', such as {stored[:5]}' if stored else ''}); was it saved by shardsafe.lightning "
            "or shardsafe.save_model_and_optim_state?"
        )
    if stored_param_groups(meta, storage.url) is not None:
        result["optimizer_states"] = [optim_state_of(_lazy_values(storage, meta, OPTIM_PREFIX, allow_pickle), storage.url)]
    return result


def _lazy_values(storage: Storage, meta: StorageMetadata, prefix: str, allow_pickle: bool) -> dict[str, Any]:
    """The keys under ``prefix``, prefix removed, as the unshard gives them: the tensors (as
    placeholders) first, then the values."""
    out: dict[str, Any] = {
        name: LazyTensor(meta.tensors[key].torch_dtype, tuple(meta.tensors[key].shape), key)
        for name, key in keys_under(meta.tensors, prefix).items()
    }
    wanted = keys_under([*meta.objects, *meta.pickled_objects], prefix)
    opt_in = "pass allow_pickle=True to shardsafe.lightning.consolidate only if you trust this checkpoint"
    values = decode_objects(meta.objects, meta.pickled_objects, list(wanted.values()), allow_pickle=allow_pickle, where=storage.url, opt_in=opt_in)
    out.update((name, values[key]) for name, key in wanted.items())
    return out


def _leaves(value: Any) -> Iterator[Any]:
    if isinstance(value, Mapping):
        for v in value.values():
            yield from _leaves(v)
    elif isinstance(value, (list, tuple)):
        for v in value:
            yield from _leaves(v)
    else:
        yield value


def _materialized(value: Any, fill: Callable[[LazyTensor, torch.Tensor], None]) -> Any:
    """``value`` with every placeholder replaced by a tensor of its own, filled."""
    if isinstance(value, LazyTensor):
        full = torch.empty(value.shape, dtype=value.dtype)
        fill(value, full)
        return full
    if type(value) in (dict, OrderedDict):
        return type(value)((k, _materialized(v, fill)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(_materialized(v, fill) for v in value)
    return value


def _consolidate_lightning_dcp_folder(path: str, allow_pickle: bool) -> dict[str, Any]:
    import re

    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.format_utils import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    from ..dcp import StorageReader
    from ..dcp.distcp import checkpoint_error_of, read_lightning_meta

    state: dict[str, Any] = {}
    try:
        _load_state_dict(state, storage_reader=StorageReader(path, allow_pickle=allow_pickle), planner=_EmptyStateDictLoadPlanner(), no_dist=True)
    except CheckpointException as e:  # a BaseException: torch's wrapping of what a rank raised
        raise checkpoint_error_of(e, path) from None
    opt_in = "pass allow_pickle=True to shardsafe.lightning.consolidate only if you trust this checkpoint"
    state.update(read_lightning_meta(open_storage(path), allow_pickle=allow_pickle, opt_in=opt_in) or {})
    if "state_dict" not in state and "model" in state:  # FSDPStrategy's and Fabric's name for the model
        state["state_dict"] = state.pop("model")
    optims = sorted((k for k in state if re.fullmatch(r"optimizer_[0-9]+", k)), key=lambda k: int(k.split("_")[1]))
    if optims:
        state["optimizer_states"] = [state.pop(k) for k in optims]
    return state
