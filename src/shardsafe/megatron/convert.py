"""A megatron-core ``torch_dist`` or ``zarr`` checkpoint on disk into a shardsafe checkpoint, streamed.

The result is what :func:`shardsafe.megatron.serialization.save` would have written for the same
state (``docs/format.md`` §13): tensors under their Megatron keys with Megatron's global shapes
(a distributed optimizer's "n-d reformulated" tensor becomes flattened ranges of the boxes of
its original shape), each ShardedObject one JSON value under its unique key, ``common.pt`` the
JSON value ``"megatron:common"`` and the config ``"megatron:config"``. So
:func:`shardsafe.megatron.serialization.load` of the converted checkpoint returns what it returns
for the original, into any layout, and :func:`shardsafe.verify` checks every byte.

Each stored chunk is read once (a torch_dist chunk: exactly its byte range, loaded with
shardsafe's restricted unpickler; a Zarr chunk: its file, see
:mod:`shardsafe.megatron.strategies.zarr`), digested and written while the next one is read: memory is
bounded by a small multiple of the largest chunk. ``common.pt`` and the ShardedObjects are read by
the same unpickler with what megatron-core's own safe globals admit
(:data:`shardsafe.format.safe_pickle.VALUES`: numpy arrays, ``argparse.Namespace``, Megatron's
enums): nothing else is unpickled unless ``allow_pickle``. ``metadata.json`` is
committed last, by the same compare-and-swap as a save.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import asdict
from math import prod
from typing import Any

from .._args import check_bool
from .._progress import conversion_progress
from ..dcp import distcp
from ..engine.commit import committed_version
from ..engine.rewrite import Chunk, write_checkpoint
from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, ShardingError
from ..format.dtypes import dtype_name
from ..format.geometry import check_tiling
from ..format.metadata import StorageMetadata
from ..knobs import KNOBS, Knobs
from ..storage import Location, Storage, open_storage
from ._values import encode_value
from .core import CONFIG_KEY, SHARDSAFE_BACKEND, CheckpointingConfig, CheckpointingException, maybe_load_config
from .strategies.common import is_torch_dist_checkpoint, read_common_pt
from .strategies.native import COMMON_KEY, FORMAT_VERSION
from .strategies.torch_dist import TorchDistLoadShardedStrategy
from .strategies.zarr import ZarrLoadShardedStrategy

__all__ = ["convert_megatron"]

log = logging.getLogger(__name__)
_CALL = "shardsafe.megatron.convert_megatron"
_OPT_IN = f"Pass allow_pickle=True to {_CALL} only if you trust this checkpoint"


def convert_megatron(
    src: Location,
    dst: Location,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    knobs: Knobs | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> StorageMetadata:
    """Convert the megatron-core checkpoint at ``src`` into a shardsafe checkpoint at ``dst``;
    returns its metadata. One process, no process group. ``src`` is a ``torch_dist`` checkpoint
    (DCP's ``.metadata`` and ``.distcp`` files, ``common.pt`` and Megatron's ``metadata.json``;
    local or in an object store) or a ``zarr`` one (a local directory).

    ``src`` that is neither raises ``CheckpointingException``; a checkpoint
    already committed at ``dst`` raises ``CheckpointExistsError`` unless ``overwrite``, before
    anything is written. Values in ``common.pt`` or ShardedObjects that torch's safe loader
    refuses (beyond ``argparse.Namespace``), or that have no JSON form, are read and stored with
    pickle only with ``allow_pickle``. ``progress``: ``True`` prints progress to stderr, a
    callable is called with ``(bytes done, bytes in all)`` after each chunk; by default progress
    is printed when stderr is a terminal.
    """
    check_bool(_CALL, "overwrite", overwrite)
    check_bool(_CALL, "allow_pickle", allow_pickle)
    knobs = knobs or KNOBS
    source = open_storage(src)
    try:
        return _convert(source, dst, overwrite=overwrite, allow_pickle=allow_pickle, knobs=knobs, progress=progress)
    finally:
        source.close()


def _convert(
    source: Storage, dst: Location, *, overwrite: bool, allow_pickle: bool, knobs: Knobs, progress: bool | Callable[[int, int], None] | None
) -> StorageMetadata:
    reader = _reader(source)
    out = open_storage(dst)
    if out.url.rstrip("/") == source.url.rstrip("/"):
        raise CheckpointError(f"{_CALL}: src and dst are both {source.url}; convert into another directory")
    listed = out.list()
    seen = committed_version(out)
    if seen is not None and not overwrite:
        raise CheckpointExistsError(f"{out.url}: a checkpoint is already committed there; pass overwrite=True to replace it")
    view = reader.view(source)

    # the values, as shardsafe.megatron's save stores them
    common = read_common_pt(source, allow_pickle=allow_pickle, strategy="", opt_in=_OPT_IN)
    opt_in = f"or pass allow_pickle=True to {_CALL}"
    objects: dict[str, Any] = {}
    for key in view.objects:
        value = view.read_object(source, key, allow_pickle=allow_pickle, strategy="", opt_in=_OPT_IN)
        objects[key] = encode_value(value, where=f"{view.where}: ShardedObject {key!r}", allow_pickle=allow_pickle, opt_in=opt_in)
    for key in (COMMON_KEY, CONFIG_KEY):
        if key in objects:
            raise CorruptCheckpointError(f"{view.where}: holds a ShardedObject {key!r}, the key shardsafe.megatron keeps its {key.split(':')[1]} under")
    objects[COMMON_KEY] = encode_value(common, where=f"{source.url.rstrip('/')}/common.pt", allow_pickle=allow_pickle, opt_in=opt_in)
    objects[CONFIG_KEY] = asdict(CheckpointingConfig(SHARDSAFE_BACKEND, FORMAT_VERSION, SHARDSAFE_BACKEND, FORMAT_VERSION))

    # every chunk's place in the new files, before anything is written: (key, offset, box, flat range, item).
    # A torch_dist chunk goes into the file for its .distcp file, in the order it is stored there; zarr's all go into one.
    by_file: dict[str, list[Chunk]] = {}
    for key, stored in view.tensors.items():
        dtype_name(stored.torch_dtype, key=key)
        pieces = view.pieces(key)
        try:
            check_tiling(key, stored.shape, [(off, lens, flat) for off, lens, flat, _ in pieces])
        except ShardingError as e:
            raise CorruptCheckpointError(f"{view.where}: {e}") from None
        for off, lens, flat, item in pieces:
            by_file.setdefault(getattr(item, "file", ""), []).append(Chunk(key, tuple(off), tuple(lens), flat, item))
    files = [sorted(by_file[f], key=lambda c: getattr(c.source, "offset", 0)) for f in sorted(by_file)]  # each source file front to back
    total = 0
    for c in (c for chunks in files for c in chunks):
        total += (c.flat[1] - c.flat[0] if c.flat is not None else prod(c.lengths)) * view.tensors[c.key].torch_dtype.itemsize

    meta = write_checkpoint(
        out, files, {key: (stored.torch_dtype, tuple(stored.shape)) for key, stored in view.tensors.items()},
        lambda c: view.load_chunk(source, c.key, c.source),
        objects=objects, pickled={}, listed=listed, seen=seen, overwrite=overwrite, knobs=knobs,
        report=conversion_progress(progress, total, out.url), where=view.where,
    )
    out.close()
    tensors = meta.tensors
    log.debug("%s: converted %d tensors, %d ShardedObjects, %d bytes from %s", out.url, len(tensors), len(view.objects), total, source.url)
    return meta


def _reader(source: Storage) -> TorchDistLoadShardedStrategy:
    """The strategy that reads ``source``, a megatron-core ``torch_dist`` or ``zarr`` checkpoint;
    ``CheckpointingException`` for anything else."""
    listed = source.list()
    config = maybe_load_config(source) if listed else None
    backend = config.sharded_backend if config is not None else None
    if backend == "zarr":
        return ZarrLoadShardedStrategy()
    if not is_torch_dist_checkpoint(source):
        hint = "; it is a shardsafe checkpoint already" if backend == SHARDSAFE_BACKEND else ""
        raise CheckpointingException(
            f"{source.url}: not a megatron-core torch_dist or zarr checkpoint: it holds {len(listed)} file(s) but no "
            f"{distcp.DCP_METADATA}{hint}"
        )
    if backend != "torch_dist":
        found = "no Megatron metadata.json" if config is None else f"a metadata.json with sharded_backend {backend!r}"
        raise CheckpointingException(
            f"{source.url}: not a megatron-core torch_dist checkpoint: it has DCP's {distcp.DCP_METADATA} but {found} (a plain "
            "torch.distributed.checkpoint folder converts with shardsafe.dcp.convert)"
        )
    return TorchDistLoadShardedStrategy()
