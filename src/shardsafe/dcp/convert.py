"""``shardsafe.dcp.convert``: a torch.distributed.checkpoint checkpoint into a shardsafe one, streamed.

Each DCP data file (``__<rank>_<n>.distcp``) becomes one safetensors data file holding the same
chunks, in the same order; each chunk is read once (exactly its byte range), loaded with
``torch.load(weights_only=True)``, checked against the metadata, digested block by block and
written while the next one is read. Memory is bounded by the largest stored chunk (a small
multiple of it: the chunk being written, one queued, and the archive and tensor being loaded). ``metadata.json`` is committed last, by the same compare-and-swap as a save, so an
interrupted conversion leaves no checkpoint at ``dst`` (and a committed one there untouched).
"""

from __future__ import annotations

import logging
import sys
import time
import uuid
from collections.abc import Callable
from math import prod
from typing import Any

from .._args import check_bool
from ..engine.buffers import WriteBehind, byte_view
from ..engine.commit import CommitUnknownError, committed_version, put_metadata, sweep
from ..engine.objects import encode_tagged
from ..errors import CheckpointExistsError, CorruptCheckpointError, ShardingError, StorageError
from ..format.checksum import DEFAULT_ALGORITHM, digest_blocks, encode_digests, file_digest
from ..format.dtypes import SAFETENSORS_CODE, dtype_name
from ..format.metadata import ChecksumConfig, DataFileInfo, StorageMetadata, TensorShardSpec, TensorStorageMetadata
from ..format.safetensors_file import FileEntry, layout_file
from ..knobs import KNOBS, Knobs
from ..planning.geometry import check_tiling
from ..planning.save_plan import _entry_name, data_file_name
from ..storage import Location, open_storage
from . import dcp_format

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
    torch's safe loader refuses are read at all only then. A Lightning sharded folder's ``meta.pt``
    (the rest of its checkpoint dict: epoch, loop, callback and scheduler state) is read with
    ``torch.load(weights_only=True)`` (the full unpickler only with ``allow_pickle``) and stored as
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
    ckpt = dcp_format.read_dcp_checkpoint(source)
    out = open_storage(dst)
    listed = out.list()
    seen = committed_version(out)
    if seen is not None and not overwrite:
        raise CheckpointExistsError(f"{out.url}: a checkpoint is already committed there; pass overwrite=True to replace it")

    values = {key: dcp_format.load_value(dcp_format.read_item(source, it), it, ckpt.where, allow_pickle=allow_pickle) for key, it in ckpt.values.items()}
    as_json, pickled = encode_tagged(values, allow_pickle=allow_pickle, opt_in="or pass allow_pickle=True to shardsafe.dcp.convert")
    lightning = dcp_format.read_lightning_meta(
        source, allow_pickle=allow_pickle, opt_in="pass allow_pickle=True to shardsafe.dcp.convert only if you trust this checkpoint"
    )
    if lightning is not None:  # a Lightning sharded folder: its loop state kept as shardsafe.lightning keeps it
        as_json[_lightning_meta_key(values, ckpt.where)] = _encode_lightning_meta(lightning, source.url, allow_pickle)

    # every chunk's place in the new files, before anything is written
    save_id = uuid.uuid4().hex[:12]
    by_file: dict[str, list[tuple[str, tuple[int, ...], tuple[int, ...], dcp_format.DcpItem]]] = {}
    for key, (dtype, shape, chunks) in ckpt.tensors.items():
        dtype_name(dtype, key=key)
        try:
            check_tiling(key, shape, [(off, lens, None) for off, lens, _ in chunks if prod(lens)])
        except ShardingError as e:
            raise CorruptCheckpointError(f"{ckpt.where}: {e}") from None
        for off, lens, loc in chunks:
            if prod(lens):
                by_file.setdefault(loc.file, []).append((key, off, lens, loc))
    plans = []
    for i, source_file in enumerate(sorted(by_file)):
        chunks = sorted(by_file[source_file], key=lambda c: c[3].offset)  # read each source file front to back
        used: set[str] = set()
        entries = []
        for key, off, lens, _ in chunks:
            dtype, shape, _ = ckpt.tensors[key]
            entries.append(FileEntry(_entry_name(key, shape, off, lens, None, used), SAFETENSORS_CODE[dtype], lens, prod(lens) * dtype.itemsize))
        layout = layout_file(entries, {"format": "pt", "shardsafe_format_version": "2"})
        plans.append((data_file_name(i, save_id), chunks, entries, layout))

    total = sum(e.nbytes for _, _, entries, _ in plans for e in entries)
    report = _progress(progress, total, out.url)
    cblock = knobs.checksum_block_bytes
    specs: dict[str, dict[str, list[TensorShardSpec]]] = {key: {} for key in ckpt.tensors}
    files: dict[str, DataFileInfo] = {}
    written: list[str] = []
    done = 0
    try:
        for name, chunks, entries, layout in plans:
            written.append(name)
            with out.write_file(name) as raw_out, WriteBehind(raw_out, depth=1) as w:  # one chunk written while the next loads
                w.write(memoryview(layout.header))
                for (key, off, lens, loc), entry, byte_range in zip(chunks, entries, layout.byte_ranges):
                    dtype = ckpt.tensors[key][0]
                    t = dcp_format.load_tensor(dcp_format.read_item(source, loc), loc, dtype, lens, ckpt.where).contiguous()
                    view = byte_view(t)
                    digests: list[int] = []
                    digest_blocks(view, cblock, digests)
                    w.write(view)
                    del t, view
                    specs[key].setdefault(name, []).append(
                        TensorShardSpec(global_offset=off, local_shape=lens, name=entry.name, byte_range=byte_range, checksums=encode_digests(digests))
                    )
                    done += entry.nbytes
                    report(done)
            files[name] = DataFileInfo(size=layout.size, header=file_digest(layout.header))
        tensors = {}
        for key, (dtype, shape, chunks) in ckpt.tensors.items():
            whole = len(chunks) == 1 and chunks[0][1] == shape
            tensors[key] = TensorStorageMetadata(shape=shape, dtype=dtype_name(dtype), is_sharded=not whole, shard_spec_per_file=specs[key])
        meta = StorageMetadata(
            format_version=2,  # laid out as format v2: chunk places and checksums in metadata.json
            checksum=ChecksumConfig(algorithm=DEFAULT_ALGORITHM, block_bytes=cblock),
            files=files,
            tensors=tensors,
            objects=as_json,
            pickled_objects=pickled,
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
    finally:
        source.close()
    sweep(out, listed, keep=meta.data_files())
    out.close()
    log.info("%s: converted %d tensors, %d values, %d bytes from %s", out.url, len(tensors), len(values), total, ckpt.where)
    return meta


def _lightning_meta_key(values: dict[str, Any], where: str) -> str:
    from ..lightning._checkpoint import META_KEY

    if META_KEY in values:
        raise CorruptCheckpointError(
            f"{where}: holds a value {META_KEY!r} and a Lightning {dcp_format.LIGHTNING_META_FILE} beside it, which would be "
            f"stored under the same key; remove one of them before converting"
        )
    return META_KEY


def _encode_lightning_meta(meta: dict[str, Any], url: str, allow_pickle: bool) -> Any:
    """Lightning's checkpoint dict as the JSON value ``shardsafe.lightning.read_meta`` decodes."""
    from ..lightning._checkpoint import _plain
    from ..megatron._values import encode_value

    where = f"{url.rstrip('/')}/{dcp_format.LIGHTNING_META_FILE}"
    return encode_value(_plain(meta), where=where, allow_pickle=allow_pickle, opt_in="or pass allow_pickle=True to shardsafe.dcp.convert")


def _progress(progress: bool | Callable[[int, int], None] | None, total: int, url: str) -> Callable[[int], None]:
    if callable(progress):
        return lambda done: progress(done, total)
    if progress is None:
        progress = sys.stderr.isatty()
    if not progress:
        return lambda done: None
    state = {"last": 0.0}

    def show(done: int) -> None:
        now = time.monotonic()
        if done < total and now - state["last"] < 0.5:
            return
        state["last"] = now
        pct = 100.0 * done / total if total else 100.0
        end = "\n" if done >= total else "\r"
        print(f"converting to {url}: {done / 1e6:.1f} / {total / 1e6:.1f} MB ({pct:.0f}%)", end=end, file=sys.stderr, flush=True)

    return show

