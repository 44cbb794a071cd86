"""The load side of the engine: read the committed metadata, check targets against it, fill
them in place (:func:`load_state`) or build full tensors (:func:`unshard_state`).

``read_metadata`` is the one reader of ``metadata.json`` for every public entry point and every
integration: it waits for a save in flight to the same location, reads once on the first rank
and broadcasts, tells another library's checkpoint from an uncommitted one, and gives back a
document whose data files' headers are readable from the storage.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable
from typing import Any

import torch

from .._gc import paused_gc
from .._progress import Progress, bytes_counter, targets_done
from ..adapters import LocalTensor, describe_state
from ..adapters.nested import Targets, load_targets
from ..adapters.subclasses import INNER_SEP, check_record, inner_keys, is_record
from ..dist import Comm
from ..errors import DtypeMismatchError, MissingKeyError, ShapeMismatchError, ShardingError
from ..format.metadata import METADATA_FILENAME, StorageMetadata, keys_under
from ..format.values import decode_objects
from ..knobs import Knobs
from ..storage import Storage
from .background import wait_for_location
from .bounds import check_files_hold, read_limited
from .file_index import bind_files
from .foreign import missing_metadata_error
from .reader import Reader
from .subclass_values import check_dequantized, load_whole

__all__ = ["StoredValues", "check_targets", "load_state", "read_metadata", "unshard_state"]

log = logging.getLogger("shardsafe.checkpointer")  # the logger these lines always had


def read_metadata(storage: Storage, comm: Comm) -> StorageMetadata:
    """The committed ``metadata.json`` at ``storage``: read by the first rank of ``comm`` and
    broadcast, parsed and checked on every rank, with its data files' headers readable from
    ``storage``. Waits first for a save in flight from this process to the same location. Raises
    ``IncompleteCheckpointError``, or ``ForeignCheckpointError`` naming the format and its
    converter when the location holds another library's checkpoint."""
    where = f"{storage.url.rstrip('/')}/{METADATA_FILENAME}"
    wait_for_location(storage.url)  # a save in flight from this process to it commits first

    def read() -> bytes:
        try:
            return read_limited(storage, METADATA_FILENAME)  # a file grown sparse is refused, not read whole
        except FileNotFoundError as e:  # another library's checkpoint, uncommitted, or nothing there
            raise missing_metadata_error(storage, METADATA_FILENAME, e) from None

    raw = comm.broadcast(read)
    with paused_gc():
        return bind_files(StorageMetadata.from_json(raw, where=where), storage)


class StoredValues:
    """The keys ``meta`` stores as values (``in`` only)."""

    def __init__(self, meta: StorageMetadata) -> None:
        self.meta = meta

    def __contains__(self, key: object) -> bool:
        return key in self.meta.objects or key in self.meta.pickled_objects


def check_targets(meta: Any, tensors: list[LocalTensor], objects: list[str], where: str) -> None:
    """Every target tensor is stored with its global shape and dtype, and every target value is
    stored as a value; ``meta`` needs ``tensors`` (and ``objects``, ``pickled_objects`` when
    ``objects`` is not empty). A target subclass's record agrees with the stored one."""
    records: set[str] = set()
    stored_values = getattr(meta, "objects", {})
    for t in tensors:
        if t.subclass is not None and t.subclass[0] not in records:
            outer = t.subclass[0]
            records.add(outer)
            stored_value = stored_values.get(outer)
            if stored_value is None and outer not in meta.tensors:
                raise MissingKeyError(f"{where}: key {outer!r} is not in the checkpoint ({len(meta.tensors)} tensors stored)")
            check_record(where, outer, stored_value, t.subclass[1])
        stored = meta.tensors.get(t.key)
        if stored is None:
            if t.subclass is None and is_record(record := stored_values.get(t.key)):
                raise ShardingError(
                    f"{where}: key {t.key!r} is stored as a {record.get('class')} (its inner tensors under "
                    f"{t.key + INNER_SEP!r}...), the target is a plain tensor: load it into a {record.get('class')}, or "
                    "pass dequantize=True to load its high-precision values"
                )
            raise MissingKeyError(f"{where}: key {t.key!r} is not in the checkpoint ({len(meta.tensors)} tensors stored)")
        if stored.shape != t.shape:
            raise ShapeMismatchError(
                f"{where}: key {t.key!r}: checkpoint has global shape {list(stored.shape)}, target has {list(t.shape)}"
            )
        if stored.dtype != t.dtype_name:
            raise DtypeMismatchError(f"{where}: key {t.key!r}: checkpoint has dtype {stored.dtype}, target has {t.dtype_name}")
    for key in objects:
        if key not in meta.objects and key not in meta.pickled_objects:
            kind = "a tensor" if key in meta.tensors else "not in the checkpoint"
            raise MissingKeyError(f"{where}: non-tensor key {key!r} is {kind}")


def load_state(
    storage: Storage, state_dict: dict[str, Any], comm: Comm, meta: StorageMetadata, *, allow_pickle: bool, knobs: Knobs,
    progress: Progress | None = None,
    fetch: Callable[[StorageMetadata, list[LocalTensor]], None] | None = None,
    dequantize: bool = False,
) -> None:
    """Fill the tensors of ``state_dict`` (nested as on save) in place from the checkpoint ``meta``
    describes, then replace its values and call each ``Stateful``'s ``load_state_dict``. Every rank
    of ``comm`` calls it together; a failure on any rank raises on every rank.

    ``dequantize``: a plain target tensor whose key holds a quantized subclass (NF4, 8-bit
    optimizer state) gets its high-precision values, built for the rows its pieces cover.

    ``fetch(meta, targets)``: called on every rank together, once every rank has described and
    checked its targets and before any reads, to bring the bytes those targets need into
    ``storage`` (a restore from peers' memory); it may run collectives of ``comm``'s ranks."""
    started = time.monotonic()
    nread = [0]
    deq: list[LocalTensor] = []  # plain targets of quantized subclasses, with ``dequantize``

    def described() -> tuple[Targets, list[LocalTensor], dict[str, Any]]:
        targets = load_targets(
            state_dict, StoredValues(meta), lambda: [*meta.tensors, *meta.objects, *meta.pickled_objects]
        )
        with paused_gc():  # a description and its views per tensor, as on save
            tensors, objects = describe_state(targets.flat, targets=True)
        if dequantize:
            whole = [t for t in tensors if t.subclass is None and t.key not in meta.tensors and is_record(meta.objects.get(t.key))]
            for t in whole:
                check_dequantized(storage.url, t.key, meta.objects[t.key], t.shape, t.dtype_name)
            tensors = [t for t in tensors if t not in whole]
            deq[:] = whole
        check_targets(meta, tensors, list(objects), storage.url)
        values = decode_objects(meta.objects, meta.pickled_objects, list(objects), allow_pickle=allow_pickle, where=storage.url)
        return targets, tensors, values

    first: list[Any] = []
    if fetch is not None:
        first.extend(comm.check(described))
        fetch(meta, first[1])

    def run() -> tuple[Targets, dict[str, Any]]:
        targets, tensors, values = first if first else described()
        with Reader(storage, knobs) as reader:
            reader.load_tensors(((meta.tensors[t.key], t) for t in tensors), targets_done(progress, tensors))
            for t in deq:  # the high-precision values of a quantized subclass, this rank's pieces of them
                _fill_dequantized(reader, meta, storage.url, t)
            nread[0] = reader.bytes_read
        log.debug(
            "load %s: rank %d of %d filled %d tensors and %d values, %d bytes read, %.2f s",
            storage.url, comm.rank, comm.world_size, len(tensors), len(values), nread[0], time.monotonic() - started,
        )
        return targets, values

    targets, values = comm.check(run)  # only success or failure travels; the values stay here
    targets.apply(values)  # the values in place, then each Stateful's load_state_dict
    if comm.is_coordinator:
        seconds = time.monotonic() - started
        log.debug(
            "load %s: %d targets, %d bytes read on the coordinator, %.2f s, %.2f GB/s",
            storage.url, len(state_dict), nread[0], seconds, nread[0] / max(seconds, 1e-9) / 1e9,
        )


def _fill_dequantized(reader: Reader, meta: StorageMetadata, where: str, t: LocalTensor) -> None:
    """Fill ``t``'s pieces with the high-precision values of the quantized subclass stored under
    its key, built for the rows its pieces cover (widened to whole blocks), not the whole tensor."""
    if not t.pieces:
        return
    shape = t.shape
    row = math.prod(shape[1:]) if shape else 1
    spans = [(f[0] // row, -(-f[1] // row)) if f is not None else (o[0], o[0] + n[0]) for o, n, f in t.pieces] if shape else [(0, 1)]
    part, first = load_whole(reader, meta, where, t.key, dequantize=True, rows=(min(a for a, _ in spans), max(b for _, b in spans)))
    for (offset, size, flat), view in zip(t.pieces, t.views):
        if flat is not None:
            base = first * row
            view.copy_(part.reshape(-1)[flat[0] - base : flat[1] - base])
        elif shape:
            view.copy_(part[(slice(offset[0] - first, offset[0] - first + size[0]), *(slice(o, o + n) for o, n in zip(offset[1:], size[1:])))])
        else:
            view.copy_(part)


def unshard_state(
    storage: Storage,
    comm: Comm,
    *,
    allow_pickle: bool,
    knobs: Knobs,
    device: torch.device | str | None,
    rank0_only: bool,
    num_threads: int | None = None,
    prefix: str | None,
    progress: Progress | None = None,
    dequantize: bool = False,
) -> dict[str, Any]:
    """The full tensors and the values of the checkpoint at ``storage`` (those under ``prefix``,
    without it), read by every rank of ``comm`` (only the first with ``rank0_only``). A tensor
    subclass comes back as the subclass (its class imported from the allow-list), or with
    ``dequantize`` as its high-precision tensor."""
    meta = read_metadata(storage, comm)
    if rank0_only and comm.rank != 0:
        if progress is not None:
            progress(0, 0)
        return {}
    device = torch.device(device) if device is not None else torch.device("cpu")
    out: dict[str, Any] = {}
    inner = inner_keys(meta.objects, storage.url)
    selected = keys_under([k for k in meta.tensors if k not in inner], prefix)
    wholes = keys_under([k for k, v in meta.objects.items() if is_record(v)], prefix)
    wanted = keys_under([*[k for k, v in meta.objects.items() if not is_record(v)], *meta.pickled_objects], prefix)
    if prefix is not None and not selected and not wanted and not wholes:
        stored = sorted([*meta.tensors, *meta.objects, *meta.pickled_objects])
        raise MissingKeyError(
            f"{storage.url}: no key starts with {prefix!r}; the checkpoint holds {len(stored)} key(s)"
            + (f", such as {stored[:5]}" if stored else "")
        )
    if meta.resolver is not None:  # format v3: the headers of every file holding these tensors, read at once
        holders: dict[int, str] = {}
        for key in selected.values():
            table = meta.tensors[key]._table
            for f in table.files.tolist() if table is not None else ():
                holders.setdefault(f, key)
        meta.resolver.prefetch(holders, knobs.io_threads)
    check_files_hold(storage, ((key, meta.tensors[key]) for key in selected.values()))  # before allocating
    started = time.monotonic()
    add = bytes_counter(progress, sum(math.prod(meta.tensors[k].shape) * meta.tensors[k].torch_dtype.itemsize for k in selected.values()))
    with Reader(storage, knobs, num_threads=num_threads) as reader:
        for name, key in selected.items():
            tm = meta.tensors[key]
            full = torch.empty(tm.shape, dtype=tm.torch_dtype)
            (target,), _ = describe_state({key: full})
            reader.load_tensor(tm, target)
            if add is not None:
                add(full.numel() * full.element_size())
            out[name] = full if device.type == "cpu" else full.to(device)
        for name, key in wholes.items():
            value, _ = load_whole(reader, meta, storage.url, key, dequantize=dequantize)
            out[name] = value if device.type == "cpu" else value.to(device)
        nread = reader.bytes_read
    values = decode_objects(meta.objects, meta.pickled_objects, list(wanted.values()), allow_pickle=allow_pickle, where=storage.url)
    out.update((name, values[key]) for name, key in wanted.items())
    if comm.is_coordinator:
        seconds = time.monotonic() - started
        log.debug(
            "unshard %s: %d tensors, %d bytes read, %.2f s, %.2f GB/s",
            storage.url, len(selected), nread, seconds, nread / max(seconds, 1e-9) / 1e9,
        )
    return out
