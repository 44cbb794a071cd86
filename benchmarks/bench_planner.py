"""Micro-benchmark of the checkpoint control plane at scale, ours beside torch DCP's, every rank
simulated in one process.

Times what the coordinator and each rank do between the all-gather of descriptions and the
first byte of I/O (and, on load, between reading the metadata file and the first read), with no
process group, on four simulated layouts of the same Llama-like model:

- ``fsdp``: every tensor ``Shard(0)`` over all ranks (torch.chunk semantics, so trailing ranks
  may hold nothing);
- ``ddp``: every tensor replicated on every rank (dedup + balancing);
- ``2d``: FSDP x TP, ranks on a (dp, tp=8) mesh, 2-D tensors ``[Shard(0), Shard(1)]``, 1-D
  tensors ``[Shard(0), Replicate()]``;
- ``hsdp``: ranks on a (replicate, shard=8) mesh, every tensor ``[Replicate(), Shard(0)]``.

Measured, per layout (wall seconds, cyclic GC paused as the engine does; every step is the
coordinator's unless it says "one rank"):

ours
  ``first_save_s``: the coordinator's part of a first save: ``plan_global`` over every rank's
  compact description (``describe_rank``), + building ``StorageMetadata`` from what the ranks
  report after writing (:func:`metadata_from_plan`, what ``engine.writer`` commits, block
  digests 0) + ``to_json``.
  ``rank_s`` (one rank, in parallel on every rank of a save): ``describe_rank`` of a rank's
  tensors + ``plan_rank``, laying out the busiest rank's file from its assignment.
  ``cached_save_s``: a save whose structure matches the previous one (``engine.plan_cache``):
  the coordinator reuses the plan instead of planning, then still builds and serializes the
  metadata.
  ``load_parse_s`` (one rank): ``StorageMetadata.from_json`` + ``StoredIndex`` for every tensor +
  ``plan_reads`` for that rank's targets, which are always rank ``w/2`` of an FSDP layout of half
  the world ``w`` (a resharding load).
  ``metadata_mb``: size of ``metadata.json``.
DCP (torch.distributed.checkpoint, the installed torch)
  Each rank's local ``SavePlan`` is what ``create_default_local_save_plan`` gives for that
  rank's DTensors (``fsdp``, ``2d``, ``hsdp``: one ``SHARD`` item per tensor, an empty local
  shard included) or plain tensors (``ddp``: ``TENSOR`` items), built directly from the same
  shard geometry as ``WriteItem``/``TensorWriteData``/``ChunkStorageMetadata`` with fresh objects
  per rank (as unpickling the gather gives); building them is not timed.
  ``dcp_first_save_s``: ``DefaultSavePlanner(enable_plan_caching=True).create_global_plan`` on a
  cold cache (``dedup_save_plans`` + ``create_default_global_save_plan``, which builds the global
  ``Metadata``, + ``_validate_global_plan``) + ``FileSystemWriter.prepare_global_plan`` + what
  ``FileSystemWriter.finish`` does before I/O: the ``storage_data`` dict from every rank's
  ``WriteResult`` (one ``_StorageInfo`` per item, one ``.distcp`` file per rank), and
  ``pickle.dumps`` of the ``Metadata``.
  ``dcp_cached_save_s``: the same with a warm cache and every local plan unchanged: each rank
  sends ``SavePlan([], usable=False)``, ``create_global_plan`` reuses the cached global plan and
  ``Metadata`` (case 2.1 in torch's ``_create_global_plan_with_caching``), but ``finish`` still
  rebuilds ``storage_data`` from the new write results and pickles the whole ``Metadata``. The
  per-rank ``create_local_plan`` + ``_compare_save_plans`` that decides "unchanged" is per-rank
  work and not in this number (as ours leaves out each rank's description digest).
  ``dcp_load_s`` (one rank): ``pickle.loads`` of ``.metadata`` + ``create_read_items_for_chunk_list``
  for each target tensor (the body of ``create_default_local_load_plan`` for DTensors, without its
  size check) for the same targets as ours.
  ``dcp_metadata_mb``: size of the pickled ``Metadata``.

Every run ends with one line per layout and point::

    PLAN <layout> <ranks>x<tensors> first_save_s=... cached_save_s=... load_parse_s=...
         metadata_mb=... dcp_first_save_s=... dcp_cached_save_s=... dcp_load_s=... dcp_metadata_mb=...

(one line each) and a markdown table of ours vs DCP with ratios (DCP / ours).

Usage::

    python benchmarks/bench_planner.py [--ranks R] [--tensors T] [--quick]
        [--only fsdp,ddp,2d,hsdp] [--no-dcp] [--profile fsdp] [--gc-off]

The default run measures 256, 512 and 1024 ranks x 200 tensors and prints 4096x1000 and
16384x1000 as extrapolations, marked ``~`` (point and values): for each layout and metric, a
least-squares line through log(value) vs log(ranks) of the measured points (at 200 tensors),
evaluated at the target rank count, then scaled linearly in the tensor count (x 1000/200). The
tensor axis is not measured; per-tensor work is independent, but heap growth can make real costs
somewhat superlinear. ``--ranks R [--tensors T]`` measures one point directly (no extrapolation);
``--quick`` measures 32 and 64 ranks x 20 tensors (seconds; used by the test). The default run
takes about 2 minutes and 1.4 GiB peak RSS on two cores. At 16384 ranks a
Shard(0) of a 4096-row tensor leaves most ranks empty, which the fit does not know.

The model is a Llama-7B-like mix (embedding, attention and MLP projections, norms, output head),
repeated layer by layer until ``--tensors`` keys exist. Descriptions are rebuilt with fresh tuples
per rank, as unpickling an all-gather would give. ``desc MiB`` is the Python memory of all
ranks' descriptions (tracemalloc over a sample of ranks, scaled to the world size).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import io
import math
import pickle
import pstats
import resource
import sys
import tempfile
import time
import tracemalloc
from collections.abc import Callable
from functools import partial
from math import prod

from shardsafe._gc import paused_gc
from shardsafe.engine.file_index import bind_files
from shardsafe.engine.writer import _build_metadata, _file_row
from shardsafe.format.checksum import file_digest
from shardsafe.format.geometry import Piece, chunk_bounds
from shardsafe.format.metadata import StorageMetadata
from shardsafe.knobs import KNOBS
from shardsafe.planning.read_plan import StoredIndex, plan_reads
from shardsafe.planning.save_plan import SavePlan, TensorDesc, describe_rank, plan_global, plan_rank, plan_save

Shape = tuple[int, ...]
SPLIT_BYTES = 16 << 20
TP = 8
SCENARIOS = ("fsdp", "ddp", "2d", "hsdp")
HSDP_SHARD = 8  # HSDP: shard within groups of 8 (a node), replicate across groups
EXTRAPOLATE = ((4096, 1000), (16384, 1000))

# (name, shape) of one transformer block, Llama-7B sizes
_HIDDEN, _FFN, _VOCAB = 4096, 11008, 32000
_BLOCK: tuple[tuple[str, Shape], ...] = (
    ("attention.wq.weight", (_HIDDEN, _HIDDEN)),
    ("attention.wk.weight", (_HIDDEN, _HIDDEN)),
    ("attention.wv.weight", (_HIDDEN, _HIDDEN)),
    ("attention.wo.weight", (_HIDDEN, _HIDDEN)),
    ("feed_forward.w1.weight", (_FFN, _HIDDEN)),
    ("feed_forward.w2.weight", (_HIDDEN, _FFN)),
    ("feed_forward.w3.weight", (_FFN, _HIDDEN)),
    ("attention_norm.weight", (_HIDDEN,)),
    ("ffn_norm.weight", (_HIDDEN,)),
)


def model_tensors(n: int) -> list[tuple[str, str, Shape]]:
    """``n`` (key, dtype, global shape) of a Llama-like model: embedding, blocks, norm, head."""
    body: list[tuple[str, str, Shape]] = []
    layer = 0
    while len(body) < n - 3:
        body += [(f"layers.{layer}.{name}", "bfloat16", shape) for name, shape in _BLOCK]
        layer += 1
    return [
        ("tok_embeddings.weight", "bfloat16", (_VOCAB, _HIDDEN)),
        *body[: n - 3],
        ("norm.weight", "bfloat16", (_HIDDEN,)),
        ("output.weight", "bfloat16", (_VOCAB, _HIDDEN)),
    ]


# --- per-rank descriptions -------------------------------------------------------------------


def _fresh(t: Shape) -> Shape:
    return (*t,)  # a new tuple object, as each rank's unpickled description has


def fsdp_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    out = []
    for key, dtype, shape in model:
        start, size = chunk_bounds(shape[0], world, rank)
        pieces: tuple[Piece, ...] = ()
        if size:
            pieces = (((start, *(0,) * (len(shape) - 1)), (size, *shape[1:]), None),)
        out.append(TensorDesc(key, dtype, _fresh(shape), pieces))
    return out


def ddp_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    return [
        TensorDesc(key, dtype, _fresh(shape), (((0,) * len(shape), _fresh(shape), None),))
        for key, dtype, shape in model
    ]


def grid_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    dp = world // TP
    dp_i, tp_i = divmod(rank, TP)  # mesh (dp, tp), tp innermost
    out = []
    for key, dtype, shape in model:
        s0, n0 = chunk_bounds(shape[0], dp, dp_i)
        if len(shape) == 1:  # [Shard(0), Replicate()]
            off, lens = (s0,), (n0,)
        else:  # [Shard(0), Shard(1)]
            s1, n1 = chunk_bounds(shape[1], TP, tp_i)
            off, lens = (s0, s1, *(0,) * (len(shape) - 2)), (n0, n1, *shape[2:])
        pieces: tuple[Piece, ...] = ((off, lens, None),) if prod(lens) else ()
        out.append(TensorDesc(key, dtype, _fresh(shape), pieces))
    return out


Builder = Callable[[list[tuple[str, str, Shape]], int, int], list[TensorDesc]]


def build_all(builder: Builder, model, world: int) -> tuple[list[list[TensorDesc]], float]:
    """Every rank's descriptions, and their Python memory in MiB (a few ranks measured, scaled)."""
    sample = sorted({world * i // 8 for i in range(8)} | {world - 1})
    gc.collect()  # also empties the tuple free lists, whose reuse tracemalloc would not see
    tracemalloc.start()
    kept = [builder(model, world, r) for r in sample]
    mib = tracemalloc.get_traced_memory()[0] * world / len(sample) / (1 << 20)
    tracemalloc.stop()
    del kept
    enabled = gc.isenabled()
    gc.disable()  # building is not timed; do not let the collector walk the growing heap
    try:
        descs = [builder(model, world, r) for r in range(world)]
    finally:
        if enabled:
            gc.enable()
    return descs, mib


# --- metadata from a plan --------------------------------------------------------------------


def rank_sums(plan: SavePlan) -> list[str]:
    """What each rank sends the coordinator after writing: its checksum entry's digest (every
    block digest 0 here: no bytes are written)."""
    return [file_digest(bytes(r.sums_range[1] - r.sums_range[0])) if r.file is not None else "" for r in plan.ranks]


def metadata_from_plan(plan: SavePlan, sums: list[str] | None = None, save_id: str = "x") -> StorageMetadata:
    """What ``engine.writer`` commits, from what each rank reports after writing (``save_id``:
    the save's, naming the files)."""
    sums = rank_sums(plan) if sums is None else sums
    return _build_metadata(plan.plan, [_file_row(r, s) for r, s in zip(plan.ranks, sums)], ({}, {}), KNOBS.checksum_block_bytes, save_id)


class HeaderStore:
    """Serves what a v3 loading rank reads before any data: each data file's header (from the
    plan) and its checksum entry (zeros, as :func:`metadata_from_plan` digests them)."""

    url = "bench://"
    local_root = None
    coalesce_gap_bytes = None

    def __init__(self, plan: SavePlan) -> None:
        self.files = {r.file: r for r in plan.ranks if r.file is not None}

    def read_into(self, name: str, offset: int, buffers: list) -> None:
        r = self.files[name]
        (buf,) = buffers
        if offset == 0:
            buf[:] = r.header[: len(buf)]
        elif offset == r.sums_range[0]:
            buf[:] = bytes(len(buf))
        else:
            raise AssertionError(f"{name}: a load's planning read data at {offset}")


def fsdp_targets(meta: StorageMetadata, world: int, rank: int) -> dict[str, list[Piece]]:
    out = {}
    for key, t in meta.tensors.items():
        start, size = chunk_bounds(t.shape[0], world, rank)
        out[key] = [((start, *(0,) * (len(t.shape) - 1)), (size, *t.shape[1:]), None)] if size else []
    return out


# --- running ---------------------------------------------------------------------------------


class Table:
    def __init__(self) -> None:
        self.rows: list[tuple[str, str, str, str]] = []

    def add(self, step: str, seconds: float, size: str, note: str = "") -> None:
        row = (step, f"{seconds:9.3f}", size, note)
        self.rows.append(row)
        print(f"  {row[0]:<44} {row[1]} s  {row[2]:<26} {row[3]}", flush=True)

    def render(self) -> str:
        head = ("step", "seconds", "size", "notes")
        widths = [max(len(r[i]) for r in [head, *self.rows]) for i in range(4)]
        fmt = " | ".join(f"{{:<{w}}}" if i != 1 else f"{{:>{w}}}" for i, w in enumerate(widths))
        lines = [fmt.format(*head), "-+-".join("-" * w for w in widths)]
        lines += [fmt.format(*r) for r in self.rows]
        return "\n".join(lines)


def timed(fn, profiler: cProfile.Profile | None = None):
    """Time ``fn`` as the engine runs it: with the cyclic GC paused (``shardsafe._gc``)."""
    t0 = time.perf_counter()
    if profiler is not None:
        profiler.enable()
    try:
        with paused_gc():
            out = fn()
    finally:
        if profiler is not None:
            profiler.disable()
    return out, time.perf_counter() - t0


def hsdp_rank(model: list[tuple[str, str, Shape]], world: int, rank: int) -> list[TensorDesc]:
    """``[Replicate(), Shard(0)]`` on a (world // HSDP_SHARD, HSDP_SHARD) mesh."""
    shard_i = rank % HSDP_SHARD
    out = []
    for key, dtype, shape in model:
        start, size = chunk_bounds(shape[0], HSDP_SHARD, shard_i)
        pieces: tuple[Piece, ...] = ()
        if size:
            pieces = (((start, *(0,) * (len(shape) - 1)), (size, *shape[1:]), None),)
        out.append(TensorDesc(key, dtype, _fresh(shape), pieces))
    return out


LAYOUTS: dict[str, Builder] = {"fsdp": fsdp_rank, "ddp": ddp_rank, "2d": grid_rank, "hsdp": hsdp_rank}


def _plan_stats(plan: SavePlan) -> str:
    items = sum(len(r.items) for r in plan.ranks)
    writers = sum(1 for r in plan.ranks if r.items)
    return f"{items} chunks, {writers} writers"


# --- ours ------------------------------------------------------------------------------------


def measure_ours(
    layout: str, descs: list[list[TensorDesc]], mib: float, world: int, table: Table, prof
) -> dict[str, float]:
    """First save, cached save and one rank's load of ``descs``; adds rows to ``table``."""
    tag = f"[{layout} {world}] ours"
    pieces = sum(len(d.pieces) for rank in descs for d in rank)
    probe = max(range(world), key=lambda r: len(descs[r]))  # a rank timed for the work each rank does itself
    compact = [describe_rank(d) for d in descs]  # each rank's own work, in parallel in a save
    _, dt_describe = timed(partial(describe_rank, descs[probe]), prof)
    classes = sum(len(c.geometries) for c in compact)
    gplan, dt_plan = timed(partial(plan_global, compact, split_bytes=SPLIT_BYTES), prof)
    ranks = [plan_rank(c, a, rank=r, save_id="x", block_bytes=KNOBS.checksum_block_bytes) for r, (c, a) in enumerate(zip(compact, gplan.assignments))]
    plan = SavePlan(gplan, tuple(ranks))
    sizes = [len(r.items) for r in ranks]
    busiest = sizes.index(max(sizes))
    _, dt_rank = timed(
        partial(plan_rank, compact[busiest], gplan.assignments[busiest], rank=busiest, save_id="x", block_bytes=KNOBS.checksum_block_bytes), prof
    )
    table.add(f"{tag} describe_rank (one rank)", dt_describe, f"{len(descs[probe])} tensors", f"{len(compact[probe].geometries)} classes")
    table.add(f"{tag} plan_global", dt_plan, f"{pieces} pieces", f"desc {mib:.0f} MiB, {classes} classes; {_plan_stats(plan)}")
    table.add(f"{tag} plan_rank (rank {busiest}, the busiest)", dt_rank, f"{len(ranks[busiest].items)} chunks", "its file's header")
    del compact, ranks
    headers = HeaderStore(plan)
    meta, dt_meta = timed(partial(metadata_from_plan, plan), prof)
    chunks = sum(t.chunk_count() for t in meta.tensors.values())
    table.add(f"{tag} build StorageMetadata", dt_meta, f"{chunks} chunks")
    raw, dt_json = timed(meta.to_json, prof)
    mb = len(raw) / 1e6
    table.add(f"{tag} to_json", dt_json, f"{mb:.1f} MB JSON")
    del meta

    sums = rank_sums(plan)  # the ranks' (gathered in a save, not the coordinator's work)

    def cached(plan: SavePlan) -> str:
        return metadata_from_plan(plan, sums, save_id="y").to_json()  # the writer's cache hit: the plan as it is

    raw2, dt_cached = timed(partial(cached, plan), prof)
    if len(raw2) != len(raw) or b'"shard-r00000-y.safetensors"' not in raw2:
        raise AssertionError("a cached save must give metadata of the same size, naming its own files")
    del raw2, plan
    table.add(f"{tag} cached: metadata + json", dt_cached, f"{mb:.1f} MB JSON")

    parsed, dt_parse = timed(partial(StorageMetadata.from_json, raw, where="bench"), prof)
    table.add(f"{tag} from_json (one rank)", dt_parse, f"{mb:.1f} MB JSON", "incl. _check")
    del raw
    target_world = max(1, world // 2)
    rank = target_world // 2
    targets = fsdp_targets(parsed, target_world, rank)

    def indexes():
        bind_files(parsed, headers)
        return {key: StoredIndex(t, targets[key]) for key, t in parsed.tensors.items()}

    idx, dt_idx = timed(indexes, prof)
    segs = sum(len(i.segments) for i in idx.values())
    read = len(parsed.resolver._files) if parsed.resolver is not None else 0
    table.add(f"{tag} StoredIndex x{len(idx)} (one rank)", dt_idx, f"{segs} segments", f"{read} file headers read")

    def reads():
        n = 0
        for key, pieces in targets.items():
            items, covered = plan_reads(idx[key], pieces)
            if covered != [prod(p[1]) for p in pieces]:
                raise AssertionError(f"key {key!r}: target not fully covered: {covered}")
            n += len(items)
        return n

    n_items, dt_read = timed(reads, prof)
    table.add(f"{tag} plan_reads x{len(targets)} (rank {rank} of {target_world})", dt_read, f"{n_items} read items")
    return {
        "first_save_s": dt_plan + dt_meta + dt_json,
        "rank_s": dt_describe + dt_rank,
        "cached_save_s": dt_cached,
        "load_parse_s": dt_parse + dt_idx + dt_read,
        "metadata_mb": mb,
    }


# --- torch.distributed.checkpoint ------------------------------------------------------------


def dcp_local_plans(layout: str, descs: list[list[TensorDesc]]):
    """Each rank's DCP local ``SavePlan`` for the same geometry (fresh objects per rank)."""
    import torch
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata, MetadataIndex, TensorProperties
    from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan
    from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

    dtypes = {"bfloat16": torch.bfloat16, "float32": torch.float32, "float16": torch.float16}
    kind = WriteItemType.TENSOR if layout == "ddp" else WriteItemType.SHARD
    plans = []
    for rank in descs:
        items = []
        for d in rank:
            if d.pieces:
                ((off, lens, _),) = d.pieces
            else:  # an empty local DTensor shard: DCP still writes an item, at the end of dim 0
                off, lens = (d.shape[0], *(0,) * (len(d.shape) - 1)), (0, *d.shape[1:])
            offsets, sizes = torch.Size(off), torch.Size(lens)
            items.append(
                WriteItem(
                    index=MetadataIndex(d.key, offsets),
                    type=kind,
                    tensor_data=TensorWriteData(
                        chunk=ChunkStorageMetadata(offsets=offsets, sizes=sizes),
                        properties=TensorProperties(dtype=dtypes[d.dtype]),
                        size=torch.Size(d.shape),
                    ),
                )
            )
        plans.append(DcpSavePlan(items))
    return plans


def dcp_write_results(global_plan) -> list:
    """What each rank's ``FileSystemWriter.write_data`` returns: one file per rank, items back to back."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.storage import WriteResult

    out = []
    for r, plan in enumerate(global_plan):
        name, offset, res = f"__{r}_0.distcp", 0, []
        for item in plan.items:
            length = item.tensor_storage_size()
            res.append(
                WriteResult(index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length))
            )
            offset += length
        out.append(res)
    return out


def dcp_finish(writer, metadata, results) -> bytes:
    """``FileSystemWriter.finish`` up to the file write: storage_data, version, storage_meta, pickle."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION

    metadata.version = CURRENT_DCP_VERSION
    storage_md = {}
    for wr_list in results:
        storage_md.update({wr.index: wr.storage_data for wr in wr_list})
    metadata.storage_data = storage_md
    metadata.storage_meta = writer.storage_meta()
    return pickle.dumps(metadata)


def _dcp_reset_cache() -> None:
    from torch.distributed.checkpoint.planner import SavePlanner

    for name in (
        "_cached_save_plan",
        "_cached_all_plans",
        "_cached_global_plan",
        "_cached_metadata",
        "_cached_final_save_plan",
    ):
        getattr(SavePlanner, name).clear()


def measure_dcp(
    layout: str, descs: list[list[TensorDesc]], world: int, targets_meta: StorageMetadata | None, table: Table
) -> dict[str, float]:
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
    from torch.distributed.checkpoint.filesystem import FileSystemWriter
    from torch.distributed.checkpoint.metadata import ChunkStorageMetadata
    from torch.distributed.checkpoint.planner import SavePlan as DcpSavePlan
    from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list

    tag = f"[{layout} {world}] DCP"
    local = dcp_local_plans(layout, descs)
    writer = FileSystemWriter(tempfile.gettempdir())
    _dcp_reset_cache()

    def global_plan(plans):
        planner = DefaultSavePlanner(flatten_state_dict=False, enable_plan_caching=True)
        delta, metadata = planner.create_global_plan(plans)
        return writer.prepare_global_plan(delta), planner.global_plan, metadata

    (_, gplan, metadata), dt_plan = timed(partial(global_plan, local))
    n_items = sum(len(p.items) for p in gplan)
    table.add(
        f"{tag} create_global_plan (cold cache)",
        dt_plan,
        f"{sum(len(p.items) for p in local)} items",
        f"{n_items} after dedup",
    )
    del local
    results = dcp_write_results(gplan)
    raw, dt_fin = timed(partial(dcp_finish, writer, metadata, results))
    mb = len(raw) / 1e6
    table.add(f"{tag} finish: storage_data + pickle", dt_fin, f"{mb:.1f} MB pickle")

    # cached save: every rank's local plan unchanged
    results = dcp_write_results(gplan)
    empty = [DcpSavePlan([], usable=False) for _ in range(world)]

    def cached(empty, results):
        _, _, md = global_plan(empty)
        return dcp_finish(writer, md, results)

    raw2, dt_cached = timed(partial(cached, empty, results))
    if len(raw2) != len(raw) or not all(not p.usable for p in empty):
        raise AssertionError("DCP cached save must reuse the same metadata")
    del raw2, results, gplan, metadata, empty
    table.add(f"{tag} cached: create_global_plan + finish", dt_cached, f"{mb:.1f} MB pickle")
    _dcp_reset_cache()

    # load: one rank of an FSDP layout of half the world
    target_world = max(1, world // 2)
    rank = target_world // 2
    chunks = {}
    if targets_meta is not None:
        for key, pieces in fsdp_targets(targets_meta, target_world, rank).items():
            chunks[key] = [ChunkStorageMetadata(offsets=torch.Size(o), sizes=torch.Size(n)) for o, n, _ in pieces]

    def load():
        md = pickle.loads(raw)
        n = 0
        for key, local_chunks in chunks.items():
            n += len(create_read_items_for_chunk_list(key, md.state_dict_metadata[key], local_chunks))
        return n

    n_reads, dt_load = timed(load)
    table.add(
        f"{tag} unpickle + read items (one rank)", dt_load, f"{n_reads} read items", f"rank {rank} of {target_world}"
    )
    return {
        "dcp_first_save_s": dt_plan + dt_fin,
        "dcp_cached_save_s": dt_cached,
        "dcp_load_s": dt_load,
        "dcp_metadata_mb": mb,
    }


# --- reporting -------------------------------------------------------------------------------

OURS = ("first_save_s", "cached_save_s", "load_parse_s", "metadata_mb")
DCP = ("dcp_first_save_s", "dcp_cached_save_s", "dcp_load_s", "dcp_metadata_mb")


def _fmt(v: float) -> str:
    return f"{v:.3g}" if v >= 0.001 else f"{v:.2e}"


def extrapolate(points: dict[int, dict[str, float]], n_tensors: int, ranks: int, tensors: int) -> dict[str, float]:
    """Log-log least squares in ranks over ``points`` (measured at ``n_tensors``), linear in tensors."""
    xs = sorted(points)
    out = {}
    for metric in points[xs[0]]:
        pts = [(math.log(x), math.log(points[x][metric])) for x in xs if points[x][metric] > 0]
        if len(pts) < 2:
            out[metric] = float("nan")
            continue
        mx = sum(p[0] for p in pts) / len(pts)
        my = sum(p[1] for p in pts) / len(pts)
        sxx = sum((p[0] - mx) ** 2 for p in pts)
        slope = sum((p[0] - mx) * (p[1] - my) for p in pts) / sxx if sxx else 0.0
        out[metric] = math.exp(my + slope * (math.log(ranks) - mx)) * tensors / n_tensors
    return out


def plan_line(layout: str, point: str, m: dict[str, float], approx: bool) -> str:
    t = "~" if approx else ""
    vals = " ".join(f"{k}={t}{_fmt(m[k])}" for k in (*OURS, "rank_s", *DCP) if k in m)
    return f"PLAN {layout} {t}{point} {vals}"


def markdown(rows: list[tuple[str, str, dict[str, float], bool]]) -> str:
    head = "| layout | ranks x tensors | first save ours / DCP | x | cached save ours / DCP | x | load ours / DCP | x | metadata MB ours / DCP | x |"
    lines = [head, "|" + "---|" * 10]
    for layout, point, m, approx in rows:
        t = "~" if approx else ""
        cells = [layout, t + point]
        for a, b in zip(OURS, DCP):
            if b not in m:
                cells += [f"{t}{_fmt(m[a])} / -", "-"]
                continue
            cells += [f"{t}{_fmt(m[a])} / {t}{_fmt(m[b])}", f"{m[b] / m[a]:.1f}" if m[a] else "-"]
        lines.append("| " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ranks", type=int, default=None, help="measure this world size only (default: 256, 512, 1024)")
    ap.add_argument("--tensors", type=int, default=None, help="tensors in the model (default 200)")
    ap.add_argument("--quick", action="store_true", help="32 and 64 ranks x 20 tensors")
    ap.add_argument("--only", default=",".join(SCENARIOS), help=f"comma-separated subset of {','.join(SCENARIOS)}")
    ap.add_argument("--no-dcp", action="store_true", help="measure ours only")
    ap.add_argument(
        "--profile", default="", help="cProfile our steps of these layouts (comma-separated) and print the top entries"
    )
    ap.add_argument("--top", type=int, default=30, help="profile entries to print")
    ap.add_argument(
        "--gc-off",
        action="store_true",
        help="disable the cyclic GC for the whole run (timed steps always pause it, as the engine does)",
    )
    args = ap.parse_args(argv)

    n_tensors = args.tensors if args.tensors is not None else (20 if args.quick else 200)
    if args.ranks is not None:
        worlds = [args.ranks]
    else:
        worlds = [32, 64] if args.quick else [256, 512, 1024]
    only = [s for s in args.only.split(",") if s]
    profile = [s for s in args.profile.split(",") if s]
    for s in [*only, *profile]:
        if s not in SCENARIOS:
            ap.error(f"unknown layout {s!r}; choose from {', '.join(SCENARIOS)}")
    if min(worlds) < 1:
        ap.error(f"--ranks must be >= 1, got {min(worlds)}")
    if n_tensors < 3:
        ap.error(f"--tensors must be >= 3 (embedding, final norm, output head), got {n_tensors}")
    for s, div in (("2d", TP), ("hsdp", HSDP_SHARD)):
        if s in only and any(w % div for w in worlds):
            ap.error(f"layout {s} needs --ranks divisible by {div}, got {worlds}")
    if args.gc_off:
        gc.disable()

    model = model_tensors(n_tensors)
    nbytes = sum(prod(s) * 2 for _, _, s in model)
    print(
        f"bench_planner: {','.join(map(str, worlds))} ranks x {n_tensors} tensors ({nbytes / 1e9:.1f} GB bf16), "
        f"layouts {','.join(only)}, split_bytes={SPLIT_BYTES >> 20} MiB, python {sys.version.split()[0]}, "
        f"gc {'off' if args.gc_off else 'on'}",
        flush=True,
    )
    profs = {s: cProfile.Profile() for s in profile}
    table = Table()
    t_start = time.perf_counter()
    results: dict[str, dict[int, dict[str, float]]] = {s: {} for s in only}

    for world in worlds:
        # the load targets (FSDP at half the world) need only the tensors' shapes
        targets_meta = None
        for layout in only:
            descs, mib = build_all(LAYOUTS[layout], model, world)
            m = measure_ours(layout, descs, mib, world, table, profs.get(layout))
            if not args.no_dcp:
                if targets_meta is None:
                    targets_meta = metadata_from_plan(plan_save(descs, save_id="t", split_bytes=SPLIT_BYTES, block_bytes=KNOBS.checksum_block_bytes))
                m.update(measure_dcp(layout, descs, world, targets_meta, table))
            results[layout][world] = m
            del descs
            gc.collect()

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux
    print(f"\ntotal {time.perf_counter() - t_start:.1f} s wall, peak RSS {peak:.0f} MiB\n")
    print(table.render())
    for name, prof in profs.items():
        for order in ("cumulative", "tottime"):
            buf = io.StringIO()
            pstats.Stats(prof, stream=buf).sort_stats(order).print_stats(args.top)
            print(f"\n=== profile: {name}, by {order} ===\n{buf.getvalue()}")

    rows: list[tuple[str, str, dict[str, float], bool]] = []
    for layout in only:
        for world in worlds:
            rows.append((layout, f"{world}x{n_tensors}", results[layout][world], False))
        if len(worlds) >= 2:
            for ranks, tensors in EXTRAPOLATE:
                rows.append(
                    (layout, f"{ranks}x{tensors}", extrapolate(results[layout], n_tensors, ranks, tensors), True)
                )
    print("\n" + markdown(rows) + "\n")
    if len(worlds) >= 2:
        print(f"~: extrapolated (log-log fit in ranks at {n_tensors} tensors, linear in tensors); x = DCP / ours\n")
    for layout, point, m, approx in rows:
        print(plan_line(layout, point, m, approx))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
