"""A megatron-core ``torch_dist`` or ``zarr`` checkpoint on disk into a shardsafe checkpoint, streamed.

The result is what :func:`shardsafe.megatron.serialization.save` would have written for the same
state (``docs/format.md`` §13): tensors under their Megatron keys with Megatron's global shapes
(a distributed optimizer's "n-d reformulated" tensor becomes flattened ranges of the boxes of
its original shape), each ShardedObject one JSON value under its unique key, ``common.pt`` the
JSON value ``"megatron:common"`` and the config ``"megatron:config"``. So
:func:`shardsafe.megatron.serialization.load` of the converted checkpoint returns what it returns
for the original, into any layout, and :func:`shardsafe.verify` checks every byte.

Each stored chunk is read once (a torch_dist chunk: exactly its byte range, loaded with
``torch.load(weights_only=True)``; a Zarr chunk: its file, see
:mod:`shardsafe.megatron.strategies.zarr`), digested and written while the next one is read: memory is
bounded by a small multiple of the largest chunk. ``common.pt`` and the ShardedObjects are read by
torch's safe loader with :data:`~shardsafe.megatron.strategies.torch_dist.COMMON_ALLOWLIST` added
(``argparse.Namespace``): nothing else is unpickled unless ``allow_pickle``. ``metadata.json`` is
committed last, by the same compare-and-swap as a save.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from dataclasses import asdict
from math import prod
from typing import Any

from .._args import check_bool
from ..dcp import dcp_format
from ..dcp.convert import _progress
from ..engine.buffers import WriteBehind, byte_view
from ..engine.commit import CommitUnknownError, committed_version, put_metadata, sweep
from ..errors import CheckpointError, CheckpointExistsError, CorruptCheckpointError, ShardingError, StorageError
from ..format.checksum import DEFAULT_ALGORITHM, digest_blocks, encode_digests, file_digest
from ..format.dtypes import SAFETENSORS_CODE, dtype_name
from ..format.metadata import ChecksumConfig, DataFileInfo, StorageMetadata, TensorShardSpec, TensorStorageMetadata
from ..format.safetensors_file import FileEntry, layout_file
from ..knobs import KNOBS, Knobs
from ..planning.geometry import check_tiling
from ..planning.save_plan import _entry_name, data_file_name
from ..storage import Location, Storage, open_storage
from ._values import encode_value
from .core import CONFIG_KEY, SHARDSAFE_BACKEND, CheckpointingConfig, CheckpointingException, maybe_load_config
from .strategies.shardsafe import COMMON_KEY, FORMAT_VERSION
from .strategies.torch_dist import TorchDistLoadShardedStrategy, is_torch_dist_checkpoint, read_common_pt
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
    save_id = uuid.uuid4().hex[:12]
    by_file: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...], tuple[int, int] | None, Any]]] = {}
    for key, stored in view.tensors.items():
        dtype_name(stored.torch_dtype, key=key)
        pieces = view.pieces(key)
        try:
            check_tiling(key, stored.shape, [(off, lens, flat) for off, lens, flat, _ in pieces])
        except ShardingError as e:
            raise CorruptCheckpointError(f"{view.where}: {e}") from None
        for off, lens, flat, item in pieces:
            by_file.setdefault(getattr(item, "file", ""), []).append((key, off, lens, flat, item))
    plans = []
    for i, source_file in enumerate(sorted(by_file)):
        chunks = sorted(by_file[source_file], key=lambda c: getattr(c[4], "offset", 0))  # read each source file front to back
        used: set[str] = set()
        entries = []
        for key, off, lens, flat, _ in chunks:
            stored = view.tensors[key]
            in_file = lens if flat is None else (flat[1] - flat[0],)
            name = _entry_name(key, stored.shape, off, lens, flat, used)
            entries.append(FileEntry(name, SAFETENSORS_CODE[stored.torch_dtype], in_file, prod(in_file) * stored.torch_dtype.itemsize))
        layout = layout_file(entries, {"format": "pt", "shardsafe_format_version": "2"})
        plans.append((data_file_name(i, save_id), chunks, entries, layout))

    total = sum(e.nbytes for _, _, entries, _ in plans for e in entries)
    report = _progress(progress, total, out.url)
    cblock = knobs.checksum_block_bytes
    specs: dict[str, dict[str, list[TensorShardSpec]]] = {key: {} for key in view.tensors}
    files: dict[str, DataFileInfo] = {}
    written: list[str] = []
    done = 0
    try:
        for name, chunks, entries, layout in plans:
            written.append(name)
            with out.write_file(name) as raw_out, WriteBehind(raw_out, depth=1) as w:  # one chunk written while the next loads
                w.write(memoryview(layout.header))
                for (key, off, lens, flat, item), entry, byte_range in zip(chunks, entries, layout.byte_ranges):
                    t = view.load_chunk(source, key, item)
                    view_bytes = byte_view(t.contiguous())
                    digests: list[int] = []
                    digest_blocks(view_bytes, cblock, digests)
                    w.write(view_bytes)
                    del t, view_bytes
                    specs[key].setdefault(name, []).append(
                        TensorShardSpec(
                            global_offset=off, local_shape=lens, flattened_range=flat, name=entry.name, byte_range=byte_range,
                            checksums=encode_digests(digests),
                        )
                    )
                    done += entry.nbytes
                    report(done)
            files[name] = DataFileInfo(size=layout.size, header=file_digest(layout.header))
        tensors = {}
        for key, stored in view.tensors.items():
            pieces = [s for per_file in specs[key].values() for s in per_file]
            whole = len(pieces) == 1 and pieces[0].flattened_range is None and pieces[0].local_shape == stored.shape
            tensors[key] = TensorStorageMetadata(shape=stored.shape, dtype=dtype_name(stored.torch_dtype), is_sharded=not whole, shard_spec_per_file=specs[key])
        meta = StorageMetadata(
            format_version=2,  # laid out as format v2: chunk places and checksums in metadata.json
            checksum=ChecksumConfig(algorithm=DEFAULT_ALGORITHM, block_bytes=cblock), files=files, tensors=tensors, objects=objects,
        )
        put_metadata(out, meta.to_json(), seen=seen, save_overwrite=overwrite)
    except CommitUnknownError:
        raise
    except BaseException:
        for name in written:
            try:
                out.delete(name)
            except StorageError as e:
                log.warning("%s: removing a data file of a failed conversion failed: %s", out.url, e)
        raise
    sweep(out, listed, keep=meta.data_files())
    out.close()
    log.info("%s: converted %d tensors, %d ShardedObjects, %d bytes from %s", out.url, len(tensors), len(view.objects), total, source.url)
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
            f"{dcp_format.DCP_METADATA}{hint}"
        )
    if backend != "torch_dist":
        found = "no Megatron metadata.json" if config is None else f"a metadata.json with sharded_backend {backend!r}"
        raise CheckpointingException(
            f"{source.url}: not a megatron-core torch_dist checkpoint: it has DCP's {dcp_format.DCP_METADATA} but {found} (a plain "
            "torch.distributed.checkpoint folder converts with shardsafe.dcp.convert)"
        )
    return TorchDistLoadShardedStrategy()
