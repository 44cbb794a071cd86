"""Streaming unshard: a whole checkpoint (or the keys under one prefix) into one safetensors file.

Every shape and dtype is known from ``metadata.json``, so the output's header and layout are
computed first and written before any tensor byte; then the tensors follow in file order.

- A tensor whose every stored chunk is one contiguous run of the output (row slabs, as FSDP and
  ``Shard(0)`` save them, and flat ranges of those) is copied chunk by chunk in blocks of
  ``write_block_bytes`` through a ring of four such buffers: read, checksum, and hand to a
  write-behind thread, so reading the next block overlaps writing the last.
- Any other tensor (``Shard(1)``, 2-D grids, ...) is loaded whole by the
  :class:`~shardsafe.engine.reader.Reader` into one buffer, reused for every such tensor, and
  written from there.

Peak memory is the ring (64 MiB at the default block size), plus the largest tensor of the
second kind and the reader's bounded scratch if there is one. Every chunk read whole is checked
against its checksums before it is written. The output is written to a temporary file beside ``out_path``, fsynced, and
renamed into place (then the directory is fsynced): a crash leaves no file or the complete one.
Needs no process group; call it from one process.
"""

from __future__ import annotations

import json
import logging
import os
import re
import time
import uuid
import warnings
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import torch

from .._args import check_arg, check_bool
from .._progress import progress_callback
from ..adapters import describe_state
from ..errors import (
    CheckpointError,
    CheckpointExistsError,
    CorruptCheckpointError,
    DtypeMismatchError,
    MissingKeyError,
    StorageError,
)
from ..format.checksum import ChunkSums
from ..format.dtypes import SAFETENSORS_CODE
from ..format.geometry import row_major_strides
from ..format.metadata import StorageMetadata, TensorStorageMetadata, keys_under
from ..format.safetensors_file import FileEntry, layout_file
from ..knobs import KNOBS, Knobs
from ..storage import Writer, open_storage
from ..storage.base import check_local_path, check_name, url_scheme
from ..storage.local import LocalStorage
from .bounds import check_files_hold
from .buffers import WriteBehind, byte_view
from .reader import Reader

__all__ = ["CONFIG_FILE", "INDEX_FILE", "SINGLE_FILE", "shard_file_name", "unshard_to_safetensors"]

CONFIG_FILE = "config.json"  # transformers' model config, beside the weights

log = logging.getLogger(__name__)

_RING = 4  # blocks of the direct copy: read, checksummed, queued, being written

# Written into every output's ``__metadata__``: transformers refuses a safetensors file whose
# metadata lacks a known "format".
FORMAT_TAG = ("format", "pt")


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
    from ..dist import get_comm
    from .loader import read_metadata  # the one metadata reader (incomplete-checkpoint errors)

    check_arg("unshard_to_safetensors", "out_path", out_path, (str, os.PathLike))
    check_arg("unshard_to_safetensors", "prefix", prefix, str, optional=True)
    check_bool("unshard_to_safetensors", "overwrite", overwrite)
    check_arg("unshard_to_safetensors", "max_shard_size", max_shard_size, int, optional=True)
    check_arg("unshard_to_safetensors", "dtype", dtype, torch.dtype, optional=True)
    check_arg("unshard_to_safetensors", "knobs", knobs, Knobs, optional=True)
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
    config_json = _config_json(config) if config is not None else None
    folder = _Folder(out, overwrite=overwrite, config=config_json) if max_shard_size is not None else None
    single = None if folder is not None else _Output(out, overwrite=overwrite, knobs=knobs)
    storage = open_storage(dir)
    meta = read_metadata(storage, get_comm(no_dist=True))
    tensors, values, skipped = _select(meta, prefix, storage.url)
    check_files_hold(storage, tensors.values())  # before allocating from their sizes
    file_meta = {FORMAT_TAG[0]: FORMAT_TAG[1], **{k: json.dumps(v, separators=(",", ":")) for k, v in values.items()}}
    cast = {name: _cast_to(tm.torch_dtype, dtype) for name, (_, tm) in tensors.items()}
    entries = {name: _entry(name, tm, cast[name]) for name, (_, tm) in tensors.items()}
    groups = [sorted(tensors)] if folder is None else _shards(sorted(tensors), entries, max_shard_size)  # type: ignore[arg-type]
    total = sum(e.nbytes for e in entries.values())
    counter = _Progress(progress_callback(progress, "unshard_to_safetensors"), total)
    outputs = [single] if folder is None else folder.outputs(len(groups), knobs)  # type: ignore[list-item]
    file_bytes = 0
    with Reader(storage, knobs) as reader:
        for names, output in zip(groups, outputs):
            file_bytes += _write_file(storage, reader, output, {n: tensors[n] for n in names}, entries, cast, file_meta, knobs, counter)
            log.debug("unshard %s: wrote %s (%d tensors)", storage.url, output.where, len(names))
    if folder is not None:
        folder.finish(groups, outputs, total)
        if config_json is None:
            warnings.warn(
                f"{folder.where}: the folder holds the weights only, no {CONFIG_FILE}: transformers' from_pretrained needs "
                f"the model's config and without it builds a default model of its own. Pass config= (a PretrainedConfig, or "
                f"the path of a config.json; --config on the command line), or copy the model's {CONFIG_FILE} into the folder",
                UserWarning,
                stacklevel=2,
            )
    seconds = time.monotonic() - started
    log.info(
        "unshard %s -> %s: %d tensors, %d bytes in %d file(s), %.2f s, %.2f GB/s",
        storage.url, out, len(entries), total, len(outputs), seconds, total / max(seconds, 1e-9) / 1e9,
    )
    counts = {"tensors": len(entries), "bytes": total, "file_bytes": file_bytes, "values": len(values), "skipped_values": skipped}
    if folder is not None:
        counts["files"] = len(outputs)
        counts["config"] = int(config_json is not None)
    return counts


def _config_json(config: Any) -> bytes:
    """The bytes of config.json for ``config``: a ``PretrainedConfig`` (anything with
    ``to_json_string``), or the path of a config.json or of a folder holding one."""
    if hasattr(config, "to_json_string") and not isinstance(config, (str, os.PathLike)):
        text = config.to_json_string()  # what PretrainedConfig.save_pretrained writes
        return text.encode() if isinstance(text, str) else bytes(text)
    if not isinstance(config, (str, os.PathLike)):
        raise TypeError(
            f"unshard_to_safetensors: argument 'config' must be a transformers PretrainedConfig or the path of a "
            f"config.json, got {type(config).__name__}"
        )
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, CONFIG_FILE)
    try:
        with open(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise CheckpointError(f"{path}: no such file: config= names the model's {CONFIG_FILE} (or a folder holding one)") from None
    except OSError as e:
        raise StorageError(f"{path}: cannot read the config: {e.strerror}") from e
    try:
        doc = json.loads(raw)
    except ValueError as e:
        raise CheckpointError(f"{path}: not a JSON file ({e}); config= names the model's {CONFIG_FILE}") from None
    if not isinstance(doc, dict):
        raise CheckpointError(f"{path}: holds a JSON {type(doc).__name__}, a {CONFIG_FILE} holds an object")
    return raw


def _write_file(
    storage: Any,
    reader: Reader,
    output: _Output,
    tensors: dict[str, tuple[str, TensorStorageMetadata]],
    all_entries: dict[str, FileEntry],
    cast: dict[str, torch.dtype | None],
    file_meta: dict[str, str],
    knobs: Knobs,
    counter: _Progress,
) -> int:
    """Stream ``tensors`` (output name -> (stored key, metadata)) into the one file ``output``;
    returns its size. On any error the partial file is discarded."""
    # the official writer's order: larger itemsize first, then by name, so that every tensor
    # starts at a multiple of its itemsize (the header is padded to 8)
    order = sorted(tensors, key=lambda name: (-_out_dtype(tensors[name][1], cast[name]).itemsize, name))
    entries = [all_entries[name] for name in order]
    layout = layout_file(entries, file_meta)
    directs = {name: _direct_runs(tensors[name][1]) for name in order}
    largest_other = max((tensors[name][1].torch_dtype.itemsize * _numel(tensors[name][1]) for name in order if directs[name] is None), default=0)
    largest_cast = max((e.nbytes for name, e in zip(order, entries) if directs[name] is None and cast[name] is not None), default=0)
    block = min(max(knobs.write_block_bytes, 1 << 16), max((r[2] for rs in directs.values() if rs for r in rs), default=0))
    # a cast block holds a block's elements in the output dtype: at most this many bytes
    ratio = max((cast[n].itemsize / tensors[n][1].torch_dtype.itemsize for n in order if cast[n] is not None and directs[n]), default=0)  # type: ignore[union-attr]

    done = False
    try:
        with output.writer() as w, WriteBehind(w, depth=_RING - 2) as behind:
            behind.write(memoryview(layout.header))
            ring = [torch.empty(block, dtype=torch.uint8) for _ in range(_RING if block else 0)]
            cring = [torch.empty(int(block * ratio) + 8, dtype=torch.uint8) for _ in range(_RING if block and ratio else 0)]
            slot = 0
            buf = torch.empty(largest_other, dtype=torch.uint8)  # reused for every tensor not copied directly
            cbuf = torch.empty(largest_cast, dtype=torch.uint8) if largest_cast else None  # the cast of such a tensor
            for name, entry in zip(order, entries):
                key, tm = tensors[name]
                runs = directs[name]
                to = cast[name]
                if runs is not None:
                    for file, start, nbytes, sums in runs:
                        check = sums.stream()
                        try:
                            for pos in range(0, nbytes, block):
                                view = byte_view(ring[slot][: min(block, nbytes - pos)])
                                storage.read_into(file, start + pos, [view])
                                check.update(view)  # before the bytes are handed on
                                if to is not None:
                                    src = ring[slot][: view.nbytes].view(tm.torch_dtype)
                                    dst = cring[slot][: src.numel() * to.itemsize].view(to)
                                    dst.copy_(src)
                                    view = byte_view(dst)
                                slot = (slot + 1) % _RING
                                behind.write(view)
                                counter.add(view.nbytes)
                            check.finish()
                        except CorruptCheckpointError as e:
                            raise CorruptCheckpointError(f"key {key!r}: {e}") from None
                    continue
                behind.flush()  # the buffer's last tensor is written: reuse it
                target = buf[: _numel(tm) * tm.torch_dtype.itemsize].view(tm.torch_dtype).view(tm.shape)
                (lt,), _ = describe_state({key: target})
                reader.load_tensor(tm, lt)
                if to is not None and entry.nbytes:
                    converted = cbuf[: entry.nbytes].view(to).view(tm.shape)  # type: ignore[index]
                    converted.copy_(target)
                    target = converted
                mv = byte_view(target) if entry.nbytes else memoryview(b"")
                step = max(block, 1 << 24)
                for pos in range(0, mv.nbytes, step):
                    behind.write(mv[pos : pos + step])
                counter.add(mv.nbytes)
        output.publish()
        done = True
    finally:
        if not done:
            output.discard()
    return layout.size


def _numel(tm: TensorStorageMetadata) -> int:
    numel = 1
    for n in tm.shape:
        numel *= n
    return numel


def _cast_to(stored: torch.dtype, dtype: torch.dtype | None) -> torch.dtype | None:
    """The dtype a tensor stored as ``stored`` is cast to on export, or None to copy it as is."""
    if dtype is None or dtype == stored or not stored.is_floating_point:
        return None
    return dtype


def _out_dtype(tm: TensorStorageMetadata, cast: torch.dtype | None) -> torch.dtype:
    return cast if cast is not None else tm.torch_dtype


def _shards(names: list[str], entries: dict[str, FileEntry], limit: int) -> list[list[str]]:
    """Names (sorted) split into files of at most ``limit`` bytes each, in order, as
    ``transformers`` splits a state dict; a tensor larger than the limit gets a file of its own."""
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        n = entries[name].nbytes
        if groups[-1] and size + n > limit:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += n
    return groups


class _Progress:
    def __init__(self, fn: Callable[[int, int], None] | None, total: int) -> None:
        self.fn, self.total, self.done = fn, total, 0

    def add(self, n: int) -> None:
        self.done += n
        if self.fn is not None:
            self.fn(self.done, self.total)


SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_FILE = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")


def shard_file_name(i: int, n: int) -> str:
    """The name ``transformers`` gives shard ``i`` (from 0) of ``n``."""
    return f"model-{i + 1:05d}-of-{n:05d}.safetensors"


class _Folder:
    """A Hugging Face style output folder: local or an object-store prefix."""

    def __init__(self, out: str, *, overwrite: bool, config: bytes | None = None) -> None:
        self.out, self.overwrite, self.config = out.rstrip("/") or out, overwrite, config
        scheme = url_scheme(out)
        if scheme not in (None, "file"):
            self.store = open_storage(self.out)
            self.where = self.store.url.rstrip("/")
            existing = self.store.list()
        else:
            self.where = os.path.abspath(out[len("file://") :] if scheme == "file" else check_local_path(out))
            if os.path.exists(self.where) and not os.path.isdir(self.where):
                raise CheckpointExistsError(f"{self.where}: a file is there; a sharded export writes a folder (name one that is not a file)")
            self.store = None
            existing = os.listdir(self.where) if os.path.isdir(self.where) else []
        self.existing = [f for f in existing if f in (SINGLE_FILE, INDEX_FILE) or _SHARD_FILE.match(f)]
        if self.existing and not overwrite:
            raise CheckpointExistsError(
                f"{self.where}: an export is already there ({sorted(self.existing)[0]}); pass overwrite=True to replace it"
            )
        if config is not None and CONFIG_FILE in existing and not overwrite:
            raise CheckpointExistsError(f"{self.where}: a {CONFIG_FILE} is already there; pass overwrite=True to replace it")

    def _path(self, name: str) -> str:
        return f"{self.out}/{name}" if self.store is not None else os.path.join(self.where, name)

    def outputs(self, n: int, knobs: Knobs) -> list[_Output]:
        names = [SINGLE_FILE] if n == 1 else [shard_file_name(i, n) for i in range(n)]
        return [_Output(self._path(name), overwrite=self.overwrite, knobs=knobs) for name in names]

    def finish(self, groups: list[list[str]], outputs: list[_Output], total: int) -> None:
        """Write the index (sharded exports), last; then remove what an earlier export left."""
        written = {os.path.basename(o.where) for o in outputs}
        if self.config is not None:
            self._write(CONFIG_FILE, self.config)
        if len(outputs) > 1:
            weight_map = {name: os.path.basename(o.where) for names, o in zip(groups, outputs) for name in names}
            doc = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
            self._write(INDEX_FILE, (json.dumps(doc, indent=2) + "\n").encode())
            written.add(INDEX_FILE)
        for name in self.existing:
            if name in written:
                continue
            try:
                if self.store is not None:
                    self.store.delete(name)
                else:
                    os.unlink(os.path.join(self.where, name))
            except (OSError, StorageError) as e:
                log.warning("%s: could not remove %s of an earlier export: %s", self.where, name, e)

    def _write(self, name: str, raw: bytes) -> None:
        """One small file of the folder, appearing whole (existing ones were checked in __init__)."""
        output = _Output(self._path(name), overwrite=True, knobs=KNOBS)
        done = False
        try:
            with output.writer() as w:
                w.write(memoryview(raw))
            output.publish()
            done = True
        finally:
            if not done:
                output.discard()


def _select(
    meta: StorageMetadata, prefix: str | None, where: str
) -> tuple[dict[str, tuple[str, TensorStorageMetadata]], dict[str, Any], int]:
    """Output name -> (stored key, metadata) for the selected tensors; selected JSON values; pickled count."""

    tensors = {name: (key, meta.tensors[key]) for name, key in keys_under(meta.tensors, prefix).items()}
    values = {name: meta.objects[key] for name, key in keys_under(meta.objects, prefix).items()}
    skipped = len(keys_under(meta.pickled_objects, prefix))
    if skipped:
        log.warning("%s: %d value(s) stored with pickle are not written to the safetensors file", where, skipped)
    if prefix is not None and not tensors and not values and not skipped:
        raise MissingKeyError(
            f"{where}: no key starts with prefix {prefix!r} ({len(meta.tensors)} tensors and "
            f"{len(meta.objects) + len(meta.pickled_objects)} values stored)"
        )
    for name in [*tensors, *values]:
        if name in ("", "__metadata__") or (name == FORMAT_TAG[0] and name in values):
            key = name if prefix is None else prefix + name
            what = "an empty name" if not name else f"the reserved name {name!r}"
            raise CheckpointError(
                f"{where}: key {key!r} would become {what} in the safetensors file; choose a different prefix"
            )
    return tensors, values, skipped


def _direct_runs(tm: TensorStorageMetadata) -> list[tuple[str, int, int, ChunkSums]] | None:
    """If every chunk of ``tm`` is one contiguous run of the row-major tensor: the chunks as
    (file, byte start, bytes, checksums) in output order. Else None."""
    shape = tuple(tm.shape)
    strides = row_major_strides(shape)
    itemsize = tm.torch_dtype.itemsize
    runs = []
    for file, spec in tm.chunks():
        n = spec.local_numel
        if n == 0:
            continue
        off, lens = spec.global_offset, spec.local_shape
        k = next((d for d, ln in enumerate(lens) if ln != 1), len(lens))
        if any(lens[d] != shape[d] for d in range(k + 1, len(lens))):
            return None  # the box skips part of a row: not one run
        first = sum(o * s for o, s in zip(off, strides)) + (spec.flattened_range[0] if spec.flattened_range else 0)
        runs.append((first, (file, spec.byte_range[0], n * itemsize, tm.chunk_sums(file, spec))))
    runs.sort(key=lambda r: r[0])
    return [r for _, r in runs]


def _entry(name: str, tm: TensorStorageMetadata, cast: torch.dtype | None = None) -> FileEntry:
    dtype = _out_dtype(tm, cast)
    return FileEntry(name, SAFETENSORS_CODE[dtype], tuple(tm.shape), _numel(tm) * dtype.itemsize)


class _Output:
    """Where the output goes, and how it appears whole or not at all: a local path through an
    fsynced temporary file beside it, renamed into place; a URL through its store's
    ``write_file``, whose object appears only once complete and is removed on error."""

    def __init__(self, out_path: str, *, overwrite: bool, knobs: Knobs) -> None:
        self.overwrite, self.knobs = overwrite, knobs
        scheme = url_scheme(out_path)
        self.store = None
        if scheme not in (None, "file"):
            parent, _, name = out_path.rpartition("/")
            if "://" not in parent or not name:
                raise StorageError(f"{out_path}: an output URL needs a file name after its bucket or prefix, e.g. s3://bucket/model.safetensors")
            self.store, self.name = open_storage(parent), check_name(name)
            self.where = f"{self.store.url.rstrip('/')}/{name}"
            if not overwrite and name in self.store.list():
                raise CheckpointExistsError(f"{self.where}: object exists; pass overwrite=True to replace it")
            return
        self.where = os.path.abspath(out_path[len("file://") :] if scheme == "file" else check_local_path(out_path))
        if not overwrite and os.path.lexists(self.where):
            raise CheckpointExistsError(f"{self.where}: file exists; pass overwrite=True to replace it")
        self.parent, base = os.path.split(self.where)
        self.name = f"tmp-{uuid.uuid4().hex[:12]}-{base}"

    def writer(self) -> AbstractContextManager[Writer]:
        if self.store is not None:
            return self.store.write_file(self.name)
        os.makedirs(self.parent, exist_ok=True)
        return LocalStorage(self.parent, knobs=self.knobs).write_file(self.name)

    def publish(self) -> None:
        if self.store is None:
            try:
                LocalStorage(self.parent, knobs=self.knobs).publish(self.name, os.path.basename(self.where), overwrite=self.overwrite)
            except FileExistsError:
                raise CheckpointExistsError(f"{self.where}: file exists; pass overwrite=True to replace it") from None

    def discard(self) -> None:
        if self.store is None:
            try:
                os.unlink(os.path.join(self.parent, self.name))
            except FileNotFoundError:
                pass

