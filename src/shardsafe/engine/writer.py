"""Save execution: each rank streams its chunks into its own safetensors file; then commit.

Call order (every rank calls :func:`save_state` together):
  describe (local, compact: :func:`~shardsafe.planning.save_plan.describe_rank`) -> gather to
  coordinator -> plan (coordinator; reused when the structure is the previous save's, see
  :mod:`.plan_cache`) -> scatter each rank's assignment -> lay out its file (every rank)
  -> write + fsync (every rank) -> gather each file's size and digests -> commit
  ``metadata.json`` (coordinator, atomic, last) -> broadcast the result. A failure on any rank at any step makes every rank
  raise, and the coordinator removes the files this save wrote; a committed checkpoint at the
  same location stays loadable until the new ``metadata.json`` replaces it.

The commit is a compare-and-swap: it replaces ``metadata.json`` only if it is still the version
the coordinator read when planning (or creates it only if there was none), so of two saves
racing to one location at most one commits. After committing, the coordinator removes the
earlier saves' files that were listed before the commit and that the new metadata does not name
(see :func:`.commit.sweep` for why none of them can be named by a committed checkpoint).
"""

from __future__ import annotations

import contextlib
import logging
import struct
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, Protocol

from .._gc import paused_gc
from .._progress import Progress
from ..adapters import LocalTensor, describe_state
from ..adapters.describe import DescribeCache
from ..adapters.nested import flatten_state
from ..dist import Comm, background_comm
from ..errors import CheckpointError, CheckpointExistsError, CollectiveError, RankMismatchError, StorageError
from ..format.checksum import DEFAULT_ALGORITHM, digest_blocks, file_digest
from ..format.metadata import METADATA_FILENAME, ChecksumConfig, DataFile, StorageMetadata, TensorStorageMetadata, built
from ..format.values import encode_objects, merge_rank_objects
from ..knobs import Knobs
from ..planning.save_plan import (
    GlobalPlan,
    RankAssignment,
    RankDescription,
    RankWritePlan,
    TensorDesc,
    data_file_name,
    describe_rank,
    plan_global,
    plan_rank,
)
from ..storage import Storage
from . import plan_cache
from .background import AsyncSave, after_in_flight, before_save, run_in_background
from .buffers import WriteBehind
from .commit import CommitUnknownError, committed_version, put_metadata, sweep
from .file_index import bind_files
from .staging import RINGS, RingAborted, StagingRing, Unit, UnitQueue, aligned, live_units, stage, stage_pieces

__all__ = ["FileTee", "abandon_save", "async_save_state", "save_state"]

log = logging.getLogger(__name__)
_DESCRIBED = DescribeCache()  # async saves' caller waits for describing: the same tensors are not described again


def save_state(
    storage: Storage, state_dict: dict[str, Any], *, save_overwrite: bool, allow_pickle: bool, comm: Comm, knobs: Knobs,
    want_meta: bool = True, progress: Progress | None = None,
) -> tuple[StorageMetadata | None, list[str]]:
    """A synchronous save: the async path with no staging copy (this rank's bytes are read from
    the caller's tensors while it waits) and the last phase in the caller's thread. Device
    tensors go to the host through a bounded pinned ring instead (:func:`_finish_from_device`).
    ``progress``: see :func:`_write_file`."""
    p = _prepare(
        storage, state_dict, save_overwrite=save_overwrite, allow_pickle=allow_pickle, comm=comm, knobs=knobs,
        first=lambda: before_save(storage.url, max_in_flight=None),  # its error reaches every rank in the first gather
    )
    devices = {d for it in p.mine.items if (d := p.local[it.key].views[it.piece_index].device).type == "cuda"}
    if devices:
        return _finish_from_device(p, comm, devices, want_meta=want_meta, progress=progress)
    return _finish(p, comm, live_units(p.mine.items, p.local, _unit_bytes(knobs, None)), want_meta=want_meta, progress=progress)


SYNC_DEVICE_RING_BYTES = 256 << 20  # the pinned ring a synchronous save of device tensors copies through (kept for the next save, as async rings are)


def _finish_from_device(
    p: _Prepared, comm: Comm, devices: set[Any], *, want_meta: bool, progress: Progress | None
) -> tuple[StorageMetadata | None, list[str]]:
    """A synchronous save of a rank holding CUDA tensors: a helper thread copies them, block by
    block, into a pinned ring (non-blocking, on a side stream) while this thread checksums and
    writes what is already on the host: the async save's staging with a bounded ring, so no host
    copy of the whole state is made (a ``.to("cpu")`` per tensor was pageable, allocated afresh
    each time and not overlapped with the write: 1.2 GB/s on an H100 against 48 for the copy)."""
    import torch

    for device in devices:  # the helper's side stream cannot wait on this thread's stream: finish its work first
        torch.cuda.current_stream(device).synchronize()
    ring, _ = _bounded_ring(p, min(p.knobs.async_staging_bytes, SYNC_DEVICE_RING_BYTES), pinned=True)
    units = UnitQueue()
    units.start()  # the writer runs beside the copies

    def produce() -> None:
        with contextlib.suppress(BaseException):  # a staging error reaches the writer (this save's thread) through units
            _stage_into(p, ring, units)

    copier = threading.Thread(target=produce, name=f"shardsafe-stage-{p.save_id}", daemon=True)
    copier.start()
    try:
        return _finish(p, comm, units, after_write=ring.abort, want_meta=want_meta, progress=progress)
    finally:
        ring.abort()
        copier.join()
        RINGS.release(ring)


def async_save_state(
    storage: Storage, state_dict: dict[str, Any], *, save_overwrite: bool, allow_pickle: bool, comm: Comm, knobs: Knobs,
    result: Callable[[tuple[StorageMetadata, list[str]]], Any] | None = None, want_meta: bool = True,
    progress: Progress | None = None, first: Callable[[], None] | None = None, agree: Agreement | None = None,
    tee: FileTee | None = None,
) -> AsyncSave[Any]:
    """Stage this rank's state into a reused buffer and return; the planning, the write and the
    commit go on in the background (see :mod:`.background`). The save's outcome is what
    :func:`save_state` returns, passed through ``result`` if given. ``progress`` is called by
    the background thread that writes (see :func:`_write_file`). ``first`` and ``agree``: what
    the caller would otherwise check with a collective of its own before saving, done inside
    the save's first gather instead (see :func:`_prepare`). ``tee`` follows this rank's data
    file as it is written (see :class:`FileTee`).

    ``comm`` has not checked in yet (see :func:`~shardsafe.dist.get_comm`): when the rank's
    tensors fit ``knobs.async_staging_bytes``, the caller is blocked only for describing them and
    copying them (every byte the rank holds, replicas included: the plan that would say which
    replica writes what needs the other ranks), and the ranks meet in the background, on a group
    of their own. Otherwise the plan is made first, in the caller's thread, and only this rank's
    share is staged, in parts.
    """
    side = background_comm(comm, timeout_s=knobs.collective_timeout_s)
    try:
        before_save(storage.url, max_in_flight=knobs.async_max_in_flight)
        state_dict = flatten_state(state_dict)  # Stateful objects' state_dict() called here, once, in the caller's thread
        with paused_gc():
            tensors, objects = describe_state(state_dict, cache=_DESCRIBED)
        total, pinned = 0, False
        for t in tensors:
            for v in t.views:
                total += aligned(v.numel() * v.element_size())
                pinned = pinned or v.device.type == "cuda"
        if total <= knobs.async_staging_bytes:
            encoded = encode_objects(objects, allow_pickle=allow_pickle)  # a snapshot of the values, too
    except Exception as e:
        abandon_save(comm, knobs, e)
        raise
    if total > knobs.async_staging_bytes:
        comm.arrive(knobs.collective_timeout_s)
        return _async_save_in_parts(
            storage, state_dict, save_overwrite, allow_pickle, comm, side, knobs, result, want_meta, progress, first, agree, tee
        )
    ring = RINGS.acquire(total, pinned=pinned)
    staged: list[Any] = []

    def produce() -> None:
        try:
            with paused_gc():  # thousands of small objects: no collector pass while the caller waits
                staged.append(stage_pieces(tensors, ring))
        except BaseException as e:
            staged.append(e)
            raise
        finally:
            ready.set()

    def described() -> tuple[list[LocalTensor], tuple[dict[str, Any], dict[str, str]]]:
        ready.wait()
        if isinstance(staged[0], BaseException):
            raise CheckpointError(
                f"staging this rank's state failed ({type(staged[0]).__name__}: {staged[0]}), so the save was abandoned"
            ) from staged[0]
        return staged[0], encoded

    def consume() -> Any:
        try:
            side.arrive(knobs.collective_timeout_s)
            p = _prepare(
                storage, {}, save_overwrite=save_overwrite, allow_pickle=allow_pickle, comm=side, knobs=knobs, described=described,
                first=first, agree=agree,
            )
            out = _finish(
                p, side, live_units(p.mine.items, p.local, _unit_bytes(knobs, None)), want_meta=want_meta, progress=progress, tee=tee
            )
        finally:
            ready.wait()  # the staging copies are done (or failed): the buffer may be reused
            RINGS.release(ring)
        return result(out) if result is not None else out

    ready = threading.Event()
    return run_in_background(storage.url, produce, consume, name="shardsafe-save")


def abandon_save(comm: Comm, knobs: Knobs, e: BaseException) -> None:
    """This rank gives up an async save before its background part started (``e``: why): the
    other ranks check in on the background group, so tell them this rank will not, and they fail
    now rather than after the timeout (once this rank's saves in flight have checked in there:
    its check-ins keep their order)."""
    side = background_comm(comm, timeout_s=knobs.collective_timeout_s)
    reason = f"{type(e).__name__}: {e}"
    after_in_flight(lambda: side.abandon(reason), name="shardsafe-save-gave-up")


def _async_save_in_parts(
    storage: Storage, state_dict: dict[str, Any], save_overwrite: bool, allow_pickle: bool, comm: Comm, side: Comm,
    knobs: Knobs, result: Callable[[tuple[StorageMetadata, list[str]]], Any] | None, want_meta: bool, progress: Progress | None,
    first: Callable[[], None] | None = None, agree: Agreement | None = None, tee: FileTee | None = None,
) -> AsyncSave[Any]:
    """An async save of a rank whose state exceeds the staging budget: plan first (in the caller's
    thread, with ``comm``), then stage only this rank's share through the buffer as the writer
    frees it."""
    p = _prepare(
        storage, state_dict, save_overwrite=save_overwrite, allow_pickle=allow_pickle, comm=comm, knobs=knobs, first=first, agree=agree
    )
    pinned = any(p.local[it.key].views[it.piece_index].device.type == "cuda" for it in p.mine.items)
    ring, total = _bounded_ring(p, knobs.async_staging_bytes, pinned=pinned)
    units = UnitQueue()
    ring.on_wait = units.start  # the buffer is full: the writer must run for the staging to go on

    def produce() -> None:
        if _stage_into(p, ring, units) and ring.waited:
            log.debug(
                "%s: rank %d staged %d bytes in parts through a %d-byte buffer (knobs.async_staging_bytes): "
                "async_save returned once the last part was copied", storage.url, comm.global_rank, total, ring.capacity,
            )

    def consume() -> Any:
        def done_writing() -> None:
            ring.abort()  # a producer still waiting for room stops: the save failed
            RINGS.release(ring)

        out = _finish(p, side, units, after_write=done_writing, want_meta=want_meta, progress=progress, tee=tee)
        return result(out) if result is not None else out

    return run_in_background(storage.url, produce, consume, name=f"shardsafe-save-{p.save_id}")


def _bounded_ring(p: _Prepared, budget: int, *, pinned: bool) -> tuple[StagingRing, int]:
    """A ring to stage this rank's items through in at most ``budget`` bytes (but at least two
    checksum blocks: a unit is whole blocks, but the last of an item), and the items' staged size."""
    total = sum(aligned(it.byte_range[1] - it.byte_range[0]) for it in p.mine.items)
    return RINGS.acquire(min(total, max(budget, 2 * p.knobs.checksum_block_bytes)), pinned=pinned), total


def _stage_into(p: _Prepared, ring: StagingRing, units: UnitQueue) -> bool:
    """Stage this rank's items through ``ring`` into ``units``, then close them: with the error
    when staging failed (raised here too), so the writer raises it. False when the writer
    aborted the ring: its own error is the save's."""
    try:
        stage(p.mine.items, p.local, ring, _unit_bytes(p.knobs, ring.capacity), units.put)
    except RingAborted:
        return False
    except BaseException as e:
        units.close(e)
        raise
    units.close(None)
    return True


class _Prepared(NamedTuple):
    """A save after planning: what the write and the commit need."""

    storage: Storage
    save_overwrite: bool
    mine: RankWritePlan
    local: dict[str, LocalTensor]
    save_id: str
    state: _CoordinatorState
    knobs: Knobs
    error: BaseException | None = None  # laying out this rank's file failed: its write raises it, so every rank does


@dataclass(slots=True)
class _CoordinatorState:
    """What a save's coordinator learns in its phases: planning fills the first five, the commit
    the last (every rank holds one; the others' stay empty but for ``started``)."""

    started: float
    listed: list[str] | None = None  # the location's files before this save wrote any (see commit.sweep)
    seen: str | None = None  # the committed version this save found, for the conditional commit
    objects: tuple[dict[str, Any], dict[str, str]] | None = None  # every rank's values, merged
    plan: GlobalPlan | None = None
    meta: StorageMetadata | None = None  # set once committed: from then on the save has succeeded


def _unit_bytes(knobs: Knobs, capacity: int | None) -> int:
    """Bytes per write unit: whole checksum blocks, at most ``write_block_bytes`` and, when
    staging, at most half the staging buffer (so copying one unit overlaps writing another)."""
    cblock = knobs.checksum_block_bytes
    block = max(cblock, knobs.write_block_bytes - knobs.write_block_bytes % cblock)
    if capacity is not None:
        block = min(block, max(cblock, capacity // 2 - (capacity // 2) % cblock))
    return block


def _prepare(
    storage: Storage, state_dict: dict[str, Any], *, save_overwrite: bool, allow_pickle: bool, comm: Comm, knobs: Knobs,
    described: Callable[[], tuple[list[LocalTensor], tuple[dict[str, Any], dict[str, str]]]] | None = None,
    first: Callable[[], None] | None = None, agree: Agreement | None = None,
) -> _Prepared:
    """Describe (or take ``described()``: the tensors and the encoded values), gather, plan and
    scatter: every rank gets its share of the plan. ``first`` runs before describing, inside
    the first gather: its error, like a describing error, is raised on every rank, and no rank
    writes before every rank's ``first`` has run. ``agree``: this rank's value, travelling in
    that gather, and a check the coordinator runs over every rank's (in rank order) before
    planning; its error is raised on every rank."""
    local: dict[str, LocalTensor] = {}
    key = (tuple(comm.global_ranks), knobs.replica_split_bytes, knobs.checksum_block_bytes)
    cached = plan_cache.lookup(key)
    mine_desc: dict[str, Any] = {}

    def describe(full: bool) -> _RankDescription:
        if first is not None and not mine_desc:
            first()
        if not mine_desc:
            if described is None:
                tensors, objects = describe_state(flatten_state(state_dict))
                encoded = encode_objects(objects, allow_pickle=allow_pickle)
            else:
                tensors, encoded = described()
            local.update((t.key, t) for t in tensors)
            compact = describe_rank([TensorDesc(t.key, t.dtype_name, t.shape, tuple(t.pieces)) for t in tensors])
            mine_desc.update(desc=compact, digest=compact.digest, objects=encoded)
        same = not full and cached.digest == mine_desc["digest"]  # the coordinator has it from last time
        desc = None if same else mine_desc["desc"]
        return _RankDescription(
            desc, mine_desc["digest"], cached.rank_plan_id, mine_desc["objects"], storage.url, agree[0] if agree is not None else None
        )

    state = _CoordinatorState(started=time.monotonic())

    def plan(gathered: list[_RankDescription]) -> list[tuple[RankAssignment | None, str, str] | None]:
        """Each rank's assignment, the save id and the plan's id; ``None`` as the assignment:
        reuse the cached file layout. ``[None] * n`` asks every rank for its full description (the
        coordinator lost one it needs)."""
        comm.raise_failures(gathered)
        _check_same_location(gathered, comm)
        if agree is not None:
            agree[1]([g.agree for g in gathered])
        digests = tuple(g.digest for g in gathered)
        hit = (
            cached.plan is not None
            and cached.digests == digests
            and all(g.desc is None and g.plan_id == cached.plan_id for g in gathered)
        )
        if not hit and any(g.desc is None for g in gathered):
            if cached.descs is None or cached.digests is None or any(
                g.desc is None and (len(cached.digests) <= r or cached.digests[r] != g.digest) for r, g in enumerate(gathered)
            ):
                plan_cache.count("resend")
                return [None] * comm.world_size
        descs = [g.desc if g.desc is not None else cached.descs[r] for r, g in enumerate(gathered)]  # type: ignore[index]
        state.listed = storage.list()  # before this save writes anything: see commit.sweep
        state.seen = committed_version(storage)
        if not save_overwrite and state.seen is not None:
            raise CheckpointExistsError(
                f"{storage.url}: a checkpoint is already committed there; pass save_overwrite=True to replace it"
            )
        save_id = uuid.uuid4().hex[:12]
        state.objects = merge_rank_objects([g.objects for g in gathered])
        _check_tensor_or_value(descs, gathered)
        if hit:
            plan_cache.count("hit")
            state.plan = cached.plan
            return [(None, save_id, cached.plan_id)] * comm.world_size  # type: ignore[list-item]
        plan_cache.count("miss")
        with paused_gc():
            state.plan = plan_global(descs, split_bytes=knobs.replica_split_bytes)
        plan_id = plan_cache.store_coordinator(key, digests, descs, state.plan)
        return [(a, save_id, plan_id) for a in state.plan.assignments]

    gathered = comm.gather(lambda: describe(False))
    got = comm.scatter(lambda: plan(gathered))  # type: ignore[arg-type]
    if got is None:  # the coordinator asked for the full descriptions: once
        gathered = comm.gather(lambda: describe(True))
        got = comm.scatter(lambda: plan(gathered))  # type: ignore[arg-type]
    assignment, save_id, plan_id = got
    error = None
    if assignment is None:  # the coordinator reuses the plan this rank's cached file layout is from
        mine = plan_cache.renamed(cached.rank_plan, comm.rank, save_id)  # type: ignore[arg-type]
    else:
        try:
            mine = plan_rank(mine_desc["desc"], assignment, rank=comm.rank, save_id=save_id, block_bytes=knobs.checksum_block_bytes)
        except CheckpointError as e:  # raised by this rank's write, inside a collective: every rank raises it
            error, mine = e, RankWritePlan(None, b"", ())
    if error is None:
        plan_cache.store_rank(key, mine_desc["digest"], mine, plan_id)
    if log.isEnabledFor(logging.DEBUG):
        log.debug(
            "save %s: rank %d of %d, plan %s (%s): writes %d chunks of %d tensors, %d bytes, to %s",
            storage.url, comm.rank, comm.world_size, plan_id, "reused" if assignment is None else "new part",
            len(mine.items), len({it.key for it in mine.items}), mine.size, mine.file or "no file",
        )
    return _Prepared(storage, save_overwrite, mine, local, save_id, state, knobs, error)


class FileTee(Protocol):
    """Follows this rank's data file while a save writes it (the memory tier sends it to other
    nodes meanwhile). Called by the save's background threads, in this order: ``begin`` on every
    rank once the save is planned (the file's name and size; None: this rank writes none),
    ``written(n)`` each time the file's first ``n`` bytes are written (from the writing thread),
    ``end(ok)`` once the write finished (``ok``) or failed; and ``failed()`` if the save then
    fails on any rank (the save's outcome otherwise goes to its ``result``)."""

    def begin(self, name: str | None, size: int) -> None: ...
    def written(self, upto: int) -> None: ...
    def end(self, ok: bool) -> None: ...
    def failed(self) -> None: ...


def _finish(
    p: _Prepared, comm: Comm, units: Iterable[Unit], *, after_write: Callable[[], None] | None = None, want_meta: bool = True,
    progress: Progress | None = None, tee: FileTee | None = None,
) -> tuple[StorageMetadata | None, list[str]]:
    """Write this rank's file from ``units``, then commit (the coordinator) with ``comm``'s ranks.

    Returns the committed metadata and this rank's files; without ``want_meta`` the other ranks
    get None for the metadata, and the coordinator broadcasts only that the save committed (at
    thousands of ranks the metadata is tens of megabytes to send and seconds to parse).
    """
    if tee is None:
        return _write_and_commit(p, comm, units, after_write, want_meta, progress, None)
    try:
        return _write_and_commit(p, comm, units, after_write, want_meta, progress, tee)
    except BaseException:
        tee.failed()
        raise


def _write_and_commit(
    p: _Prepared, comm: Comm, units: Iterable[Unit], after_write: Callable[[], None] | None, want_meta: bool,
    progress: Progress | None, tee: FileTee | None,
) -> tuple[StorageMetadata | None, list[str]]:
    storage, save_overwrite, mine, save_id, state, knobs = p.storage, p.save_overwrite, p.mine, p.save_id, p.state, p.knobs

    def write() -> tuple[int, int, str, str] | None:
        ok = False
        try:
            if tee is not None:
                tee.begin(mine.file if p.error is None else None, mine.size)
            if p.error is not None:
                raise p.error
            row = _file_row(mine, _write_file(storage, mine, units, knobs, progress, tee.written if tee is not None else None))
            ok = True
            return row
        finally:
            if tee is not None:
                tee.end(ok)
            if after_write is not None:
                after_write()

    try:
        written = comm.gather(write)
    except CollectiveError:  # a rank died or lost its connection: nothing will commit
        if comm.is_coordinator:
            _remove_save_files(storage, save_id, comm.world_size)
        raise

    def commit() -> bytes:
        try:
            comm.raise_failures(written)
            with paused_gc():
                meta = _build_metadata(state.plan, written, state.objects, knobs.checksum_block_bytes, save_id)  # type: ignore[arg-type]
            raw = meta.to_json()
            put_metadata(storage, raw, seen=state.seen, save_overwrite=save_overwrite)
        except CommitUnknownError:
            raise  # the data files stay: a metadata.json naming them may have been committed
        except BaseException:
            _remove_save_files(storage, save_id, comm.world_size)  # leave nothing of a failed save behind
            raise
        state.meta = meta  # committed: from here on the save has succeeded, whatever else fails
        _log_commit(storage.url, meta, comm.world_size, time.monotonic() - state.started)
        sweep(storage, state.listed, keep=meta.data_files())
        return raw if want_meta else b""

    try:
        raw = comm.broadcast(commit)
    except CollectiveError as e:
        if state.meta is not None:  # the coordinator committed: the save succeeded, whoever did not hear of it
            log.warning("%s: checkpoint committed, but telling the other ranks failed: %s", storage.url, e)
            raw = b""
        elif comm.is_coordinator:
            raise
        else:
            raise CollectiveError(
                f"{comm.call}: the coordinator (rank {comm.global_ranks[0]}) did not report the outcome of the commit "
                f"({str(e.__cause__ or e).strip()}). "
                f"Whether this save committed is unknown to rank {comm.global_rank}: it did if and only if "
                f"{storage.url.rstrip('/')}/{METADATA_FILENAME} exists and names data files ending in -{save_id}.safetensors "
                "(it is written last, atomically); otherwise nothing of this save was committed"
            ) from e
    meta = state.meta
    if meta is None and want_meta:
        meta = bind_files(StorageMetadata.from_own_json(raw, where=f"{storage.url}/{METADATA_FILENAME}"), storage)
    elif meta is not None:
        bind_files(meta, storage)
    files = [f"{storage.url.rstrip('/')}/{mine.file}"] if mine.file else []
    return meta, files


def _log_commit(url: str, meta: StorageMetadata, ranks: int, seconds: float) -> None:
    nbytes = sum(f.size for f in meta.file_table or ())
    log.debug(
        "save %s: %d tensors, %d values, %d bytes from %d rank(s), %.2f s, %.2f GB/s",
        url, len(meta.tensors), len(meta.objects) + len(meta.pickled_objects), nbytes, ranks, seconds, nbytes / max(seconds, 1e-9) / 1e9,
    )
    log.debug("save %s: files %s", url, sorted(meta.data_files()))


class _RankDescription(NamedTuple):
    """What each rank sends the coordinator at the start of a save."""

    desc: RankDescription | None  # None: the same as last time (its digest says so)
    digest: str
    plan_id: str | None  # the plan this rank's cached part is from
    objects: tuple[dict[str, Any], dict[str, str]]  # encoded non-tensor values
    url: str
    agree: Any = None  # the caller's value to check against the other ranks' (see _prepare)


Agreement = tuple[Any, Callable[[list[Any]], None]]
"""This rank's value and the check the save's coordinator runs over every rank's (see :func:`_prepare`)."""


def _check_same_location(gathered: list[_RankDescription], comm: Comm) -> None:
    """Every rank saves to the same location (files named in the commit live there)."""
    ranks_by_url: dict[str, list[int]] = {}
    for rank, g in enumerate(gathered):
        ranks_by_url.setdefault(g.url, []).append(comm.global_ranks[rank])
    if len(ranks_by_url) > 1:
        where = "; ".join(f"rank(s) {ranks}: {url}" for url, ranks in ranks_by_url.items())
        raise RankMismatchError(
            f"{comm.call}: the ranks passed different locations to one save ({where}); every rank must pass the same "
            "directory (each rank's data file is named in the one metadata.json that commits the checkpoint)"
        )


def _remove_save_files(storage: Storage, save_id: str, world_size: int) -> None:
    """Remove the data files of save ``save_id`` (best effort: those a rank never wrote are missing)."""
    for r in range(world_size):
        try:
            storage.delete(data_file_name(r, save_id))
        except StorageError as e:
            log.warning("%s: removing a data file of a failed save failed: %s", storage.url, e)


def _check_tensor_or_value(descs: list[RankDescription], gathered: list[_RankDescription]) -> None:
    """A key is a tensor on every rank that has it, or a value on every rank: never both."""
    tensor_rank: dict[str, int] = {}
    value_rank: dict[str, int] = {}
    seen: set[str] = set()
    for rank, (desc, g) in enumerate(zip(descs, gathered)):
        if desc.structure not in seen:  # ranks with the same structure hold the same keys
            seen.add(desc.structure)
            for key, _dtype, _shape in desc.tensors:
                tensor_rank.setdefault(key, rank)
        for key in [*g.objects[0], *g.objects[1]]:
            value_rank.setdefault(key, rank)
    for key in sorted(tensor_rank.keys() & value_rank.keys()):
        raise CheckpointError(
            f"key {key!r} is a tensor on rank {tensor_rank[key]} and a non-tensor value on rank {value_rank[key]}"
        )


def _write_file(
    storage: Storage, plan: RankWritePlan, units: Iterable[Unit], knobs: Knobs, progress: Progress | None = None,
    written: Callable[[int], None] | None = None,
) -> str:
    """Write this rank's data file from ``units`` (each item's bytes, in order), then the
    checksum entry (every block's digest, item after item); returns the digest of that entry
    (empty when the rank writes no file).

    Each unit is checksummed, then handed to a write-behind thread, so the checksums of one unit
    (and the copy or device-to-host transfer of the next) overlap the write of the one before.
    ``progress(done, total)`` (in this thread): the bytes of the items handed to the writer so
    far out of all of them; ``(total, total)`` only once the file is complete. ``written(n)``
    (in the write-behind thread): the file's first ``n`` bytes are written.
    """
    total = sum(it.byte_range[1] - it.byte_range[0] for it in plan.items) if progress is not None else 0
    if progress is not None:
        progress(0, total)
    if plan.file is None:
        for _ in units:  # nothing to write: the units (none are expected) are drained all the same
            pass
        return ""
    done = 0
    cblock = knobs.checksum_block_bytes
    digests: list[list[int]] = [[] for _ in plan.items]
    with storage.write_file(plan.file) as out, WriteBehind(out, written=written) as behind:
        behind.write(memoryview(plan.header))
        for u in units:
            if u.ready is not None:
                u.ready.synchronize()
            data = u.data if isinstance(u.data, memoryview) else memoryview(u.data.numpy())
            digest_blocks(data, cblock, digests[u.index])  # before the unit can be released
            behind.write(data, u.release)
            if progress is not None:
                done += data.nbytes
                if done < total:  # the last report waits for the file to be complete
                    progress(done, total)
        sums = struct.pack(f"<{sum(map(len, digests))}Q", *(x for d in digests for x in d))
        if len(sums) != plan.sums_range[1] - plan.sums_range[0]:
            raise CheckpointError(
                f"{storage.url}/{plan.file}: {len(sums)} bytes of checksums, the file's layout has room for "
                f"{plan.sums_range[1] - plan.sums_range[0]}; a unit was lost between staging and writing"
            )
        behind.write(memoryview(sums))
    if progress is not None and total:
        progress(total, total)
    return file_digest(sums)


def _file_row(plan: RankWritePlan, sums: str) -> tuple[int, int, str, str] | None:
    """What a rank reports after writing its file: size, header length, header digest and the
    digest of its checksum entry (None when it writes no file)."""
    return (plan.size, len(plan.header), plan.header_digest, sums) if plan.file is not None else None


def _build_metadata(
    plan: GlobalPlan, files: list[tuple[int, int, str, str] | None], objects: tuple[dict[str, Any], dict[str, str]],
    block_bytes: int, save_id: str,
) -> StorageMetadata:
    """The v3 document: the data files (as each rank reported its own, see :func:`_file_row`)
    and each tensor's chunks as the plan's run-length coded table of file indices, offsets and
    lengths."""
    wrote = {r: f for r, f in enumerate(files) if f is not None}
    if list(wrote) != list(plan.file_ranks):
        raise CheckpointError(
            f"the plan has ranks {list(plan.file_ranks)} write a data file, but ranks {list(wrote)} wrote one; nothing is committed"
        )
    # our own values: no validation (one model per rank)
    table = [
        built(DataFile, {"name": data_file_name(rank, save_id), "size": size, "header_bytes": header_bytes, "header": header, "sums": sums})
        for rank, (size, header_bytes, header, sums) in wrote.items()
    ]
    tensors = {
        key: TensorStorageMetadata.from_table(tp.shape, tp.dtype, tp.is_sharded, tp.table, table_json=tp.table_json)
        for key, tp in plan.tensors.items()
    }
    return StorageMetadata(
        checksum=ChecksumConfig(algorithm=DEFAULT_ALGORITHM, block_bytes=block_bytes),
        file_table=table,
        tensors=tensors,
        objects=objects[0],
        pickled_objects=objects[1],
    )
