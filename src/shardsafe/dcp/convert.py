"""``shardsafe.dcp.convert``: a torch.distributed.checkpoint checkpoint into a shardsafe one, streamed.

Each DCP data file (``__<rank>_<n>.distcp``) becomes one safetensors data file holding the same
chunks, in the same order; each chunk is read once (exactly its byte range), loaded by
shardsafe's restricted unpickler, checked against the metadata, digested block by block and
written while the next one is read. Memory is bounded by the largest stored chunk (a small
multiple of it: the chunk being written, one queued, and the archive and tensor being loaded). ``metadata.json`` is committed last, by the same compare-and-swap as a save, so an
interrupted conversion leaves no checkpoint at ``dst`` (and a committed one there untouched).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from math import prod
from typing import Any

import torch

from .._args import check_bool
from .._progress import conversion_progress
from ..adapters.keys import LIGHTNING_META_KEY
from ..engine.commit import committed_version
from ..engine.rewrite import Chunk, write_checkpoint
from ..errors import CheckpointExistsError, CorruptCheckpointError, ShardingError
from ..format.dtypes import dtype_name
from ..format.geometry import check_tiling
from ..format.metadata import StorageMetadata
from ..format.values import encode_tagged
from ..knobs import KNOBS, Knobs
from ..storage import Location, open_storage
from . import distcp

__all__ = ["convert"]

log = logging.getLogger(__name__)


def convert(
    src: Location,
    dst: Location,
    *,
    overwrite: bool = False,
    allow_pickle: bool = False,
    knobs: Knobs | None = None,
    progress: bool | Callable[[int, int], None] | None = None,
) -> StorageMetadata:
    """Convert the DCP checkpoint at ``src`` (``.metadata`` and ``.distcp`` files, local or in an
    object store) into a shardsafe checkpoint at ``dst``; returns its metadata.

    Tensors keep DCP's chunks (any layout loads them back). Non-tensor values are stored as JSON,
    tuples and the like as tagged JSON (``docs/format.md`` §13); other objects need
    ``allow_pickle=True``, and values that
    shardsafe's restricted unpickler refuses are read at all only then. A Lightning sharded folder's ``meta.pt``
    (the rest of its checkpoint dict: epoch, loop, callback and scheduler state) is read with
    shardsafe's restricted unpickler (the full one only with ``allow_pickle``) and stored as
    one JSON value under ``"lightning.meta"``, where :func:`shardsafe.lightning.read_meta` finds it.
    ``overwrite`` replaces a checkpoint
    committed at ``dst``; otherwise one there raises ``CheckpointExistsError`` before anything is
    written. ``progress``: ``True`` prints progress to stderr, a callable is called with
    ``(bytes done, bytes in all)`` after each chunk; by default progress is printed when stderr
    is a terminal.
    """
    check_bool("shardsafe.dcp.convert", "overwrite", overwrite)
    check_bool("shardsafe.dcp.convert", "allow_pickle", allow_pickle)
    knobs = knobs or KNOBS
    source = open_storage(src)
    ckpt = distcp.read_dcp_checkpoint(source)
    out = open_storage(dst)
    listed = out.list()
    seen = committed_version(out)
    if seen is not None and not overwrite:
        raise CheckpointExistsError(f"{out.url}: a checkpoint is already committed there; pass overwrite=True to replace it")

    values = {key: distcp.load_value(distcp.read_item(source, it), it, ckpt.where, allow_pickle=allow_pickle) for key, it in ckpt.values.items()}
    as_json, pickled = encode_tagged(values, allow_pickle=allow_pickle, opt_in="or pass allow_pickle=True to shardsafe.dcp.convert")
    lightning = distcp.read_lightning_meta(
        source, allow_pickle=allow_pickle, opt_in="pass allow_pickle=True to shardsafe.dcp.convert only if you trust this checkpoint"
    )
    if lightning is not None:  # a Lightning sharded folder: its loop state kept as shardsafe.lightning keeps it
        as_json[_lightning_meta_key(values, ckpt.where)] = _encode_lightning_meta(lightning, source.url, allow_pickle)

    # every chunk's place in the new files, before anything is written: one file per .distcp file, in its order
    by_file: dict[str, list[Chunk]] = {}
    for key, (dtype, shape, chunks) in ckpt.tensors.items():
        dtype_name(dtype, key=key)
        try:
            check_tiling(key, shape, [(off, lens, None) for off, lens, _ in chunks if prod(lens)])
        except ShardingError as e:
            raise CorruptCheckpointError(f"{ckpt.where}: {e}") from None
        for off, lens, loc in chunks:
            if prod(lens):
                by_file.setdefault(loc.file, []).append(Chunk(key, tuple(off), tuple(lens), None, loc))
    files = [sorted(by_file[f], key=lambda c: c.source.offset) for f in sorted(by_file)]  # read each source file front to back
    total = sum(prod(c.lengths) * ckpt.tensors[c.key][0].itemsize for chunks in files for c in chunks)

    def load(c: Chunk) -> torch.Tensor:
        return distcp.load_tensor(distcp.read_item(source, c.source), c.source, ckpt.tensors[c.key][0], c.lengths, ckpt.where)

    try:
        meta = write_checkpoint(
            out, files, {key: (dtype, tuple(shape)) for key, (dtype, shape, _) in ckpt.tensors.items()}, load,
            objects=as_json, pickled=pickled, listed=listed, seen=seen, overwrite=overwrite, knobs=knobs,
            report=conversion_progress(progress, total, out.url), where=ckpt.where,
        )
    finally:
        source.close()
    out.close()
    tensors = meta.tensors
    log.debug("%s: converted %d tensors, %d values, %d bytes from %s", out.url, len(tensors), len(values), total, ckpt.where)
    return meta


def _lightning_meta_key(values: dict[str, Any], where: str) -> str:
    if LIGHTNING_META_KEY in values:
        raise CorruptCheckpointError(
            f"{where}: holds a value {LIGHTNING_META_KEY!r} and a Lightning {distcp.LIGHTNING_META_FILE} beside it, which would be "
            f"stored under the same key; remove one of them before converting"
        )
    return LIGHTNING_META_KEY


def _encode_lightning_meta(meta: dict[str, Any], url: str, allow_pickle: bool) -> Any:
    """Lightning's checkpoint dict as the JSON value ``shardsafe.lightning.read_meta`` decodes."""
    from ..format.values import encode_value, plain_mappings

    where = f"{url.rstrip('/')}/{distcp.LIGHTNING_META_FILE}"
    return encode_value(plain_mappings(meta), where=where, allow_pickle=allow_pickle, opt_in="or pass allow_pickle=True to shardsafe.dcp.convert")
