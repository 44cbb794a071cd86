"""The save plan: from every rank's description to who writes which chunk where.

Planning is split between the coordinator and each rank, so that no process does work that
grows with ranks x tensors:

- each rank describes its tensors compactly (:func:`describe_rank`): tensors of equal geometry
  (global shape and this rank's pieces) share one *class*, and a model's many layers have few
  shapes, so a rank sends its keys once and its pieces once per class;
- the coordinator (:func:`plan_global`) groups the ranks whose keys and classes are the same,
  works on *joint classes* (the tensors that have the same geometry on every rank), and, once
  per joint class: checks that every rank agrees on each key's dtype and global shape;
  deduplicates (pieces with identical geometry are replicas, written once); checks that the
  distinct pieces tile the tensor (no gap, no overlap); gives each piece held by one rank to that
  rank. Replicated pieces go to the least-loaded holder, largest first, tensor by tensor, and
  large replicated boxes are first split along dim 0 so that several replicas share the write.
  The chunk tables of ``metadata.json`` follow (one per joint class when no replica is split
  up), and each rank gets a short assignment;
- each rank lays out its own safetensors file from its assignment (:func:`plan_rank`), and
  reports the file's size and header digest with its checksums after writing.

At 4096 ranks x 1000 tensors of an FSDP model, the coordinator handles about ten classes per rank
instead of four million pieces (``benchmarks/bench_planner.py``).
"""

from __future__ import annotations

import heapq
import re
from dataclasses import dataclass
from math import prod
from typing import NamedTuple

import xxhash

from ..errors import DtypeMismatchError, ShapeMismatchError, ShardingError
from ..format.checksum import file_digest
from ..format.chunk_table import ChunkTable
from ..format.dtypes import SAFETENSORS_CODE, torch_dtype
from ..format.file_index import SUMS_ENTRY, entry_name
from ..format.geometry import Piece, Shape, check_tiling, chunk_bounds
from ..format.safetensors_file import FileEntry, layout_file

__all__ = [
    "GlobalPlan", "RankAssignment", "RankDescription", "RankWritePlan", "SavePlan", "TensorDesc", "TensorPlan",
    "WriteItem", "data_file_name", "data_file_rank", "describe_rank", "file_layout", "plan_global", "plan_rank", "plan_save",
]


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """What one rank holds of one tensor: its global facts and its local pieces."""

    key: str
    dtype: str
    shape: Shape
    pieces: tuple[Piece, ...]


class RankDescription(NamedTuple):
    """What one rank sends the coordinator at the start of a save (first save of a structure)."""

    tensors: tuple[tuple[str, str, Shape], ...]  # (key, dtype, global shape), in the rank's order
    classes: tuple[int, ...]  # per tensor: the index of its geometry in ``geometries``
    geometries: tuple[tuple[Piece, ...], ...]  # this rank's pieces of a tensor of each class
    structure: str  # digest of ``tensors`` and ``classes``: ranks with equal ones are planned as a group
    digest: str  # digest of all of it: equal digests, equal descriptions (the plan cache's test)


def describe_rank(descs: list[TensorDesc]) -> RankDescription:
    """One rank's compact description: each distinct (global shape, pieces) once."""
    index: dict[tuple[Shape, tuple[Piece, ...]], int] = {}
    classes = []
    for d in descs:
        classes.append(index.setdefault((d.shape, d.pieces), len(index)))
    tensors = tuple((d.key, d.dtype, d.shape) for d in descs)
    geometries = tuple(pieces for _shape, pieces in index)
    structure = xxhash.xxh3_128_hexdigest(repr((tensors, classes)).encode())
    digest = xxhash.xxh3_128_hexdigest(f"{structure}{geometries!r}".encode())
    return RankDescription(tensors, tuple(classes), geometries, structure, digest)


class RankAssignment(NamedTuple):
    """The coordinator's word to one rank: what it writes.

    ``whole``: (joint class, piece index): the rank writes that piece of each of its tensors of
    the joint class. ``joint``: the joint class of each of the rank's classes (``by_class``) or,
    when a class of the rank's spans several joint classes, of each of its tensors. ``parts``:
    (key, piece index, offsets, lengths, flattened range) of replicated pieces (or parts of
    them) given to this rank, in the order assigned."""

    whole: tuple[tuple[int, int], ...]
    joint: tuple[int, ...]
    by_class: bool
    parts: tuple[tuple[str, int, Shape, Shape, tuple[int, int] | None], ...]


@dataclass(frozen=True, slots=True)
class TensorPlan:
    dtype: str
    shape: Shape
    is_sharded: bool
    table: ChunkTable  # file indices into GlobalPlan.file_ranks
    table_json: dict  # ``table.to_json()``, shared by the tensors of a joint class


@dataclass(frozen=True, slots=True)
class GlobalPlan:
    """The coordinator's plan: every tensor's chunks, which ranks write a file (``file_table[i]``
    of the metadata is rank ``file_ranks[i]``'s file) and each rank's assignment."""

    tensors: dict[str, TensorPlan]
    file_ranks: tuple[int, ...]
    assignments: tuple[RankAssignment, ...]


@dataclass(frozen=True, slots=True)
class WriteItem:
    """One chunk a rank writes: a (sub-)box of one of its pieces, stored as one file entry."""

    key: str
    piece_index: int  # which of the rank's pieces of ``key`` holds the data
    offsets: Shape
    lengths: Shape
    flat: tuple[int, int] | None
    name: str
    byte_range: tuple[int, int]


@dataclass(frozen=True, slots=True)
class RankWritePlan:
    file: str | None  # None when the rank writes nothing
    header: bytes
    items: tuple[WriteItem, ...]
    sums_range: tuple[int, int] = (0, 0)  # the checksum entry, last in the file (format v3)
    header_digest: str = ""

    @property
    def size(self) -> int:
        """The data file's length in bytes."""
        return self.sums_range[1] if self.items else len(self.header)


@dataclass(frozen=True, slots=True)
class SavePlan:
    """A whole save planned in one process (tests and benchmarks): the coordinator's plan and
    every rank's file."""

    plan: GlobalPlan
    ranks: tuple[RankWritePlan, ...]


DIGEST_BYTES = 8  # XXH3-64, the only algorithm a v3 file's checksum entry holds


def data_file_name(rank: int, save_id: str) -> str:
    return f"shard-r{rank:05d}-{save_id}.safetensors"


_DATA_FILE = re.compile(r"shard-r(\d{5,})-[0-9a-f]+\.safetensors")


def data_file_rank(name: str) -> int | None:
    """The rank that wrote the data file ``name`` (a :func:`data_file_name`), or None for a name
    of another form."""
    m = _DATA_FILE.fullmatch(name)
    return int(m.group(1)) if m is not None else None


class _Joint:
    """A joint class: tensors with the same global shape, held by the same ranks with the same
    pieces. ``members``: (group, class in that group's ranks)."""

    __slots__ = ("keys", "members", "shape")

    def __init__(self, shape: Shape, members: tuple[tuple[int, int], ...]) -> None:
        self.shape = shape
        self.members = members
        self.keys: list[str] = []


def plan_global(descs: list[RankDescription], *, split_bytes: int) -> GlobalPlan:
    """Plan a save from ``descs[rank]``, each rank's compact description.

    Raises ``DtypeMismatchError`` / ``ShapeMismatchError`` when ranks disagree on a key, and
    ``ShardingError`` when a tensor's pieces leave a gap or overlap.
    """
    world = len(descs)
    by_structure: dict[str, list[int]] = {}
    for rank, d in enumerate(descs):
        by_structure.setdefault(d.structure, []).append(rank)
    groups = list(by_structure.values())

    facts: dict[str, tuple[str, Shape, int]] = {}  # key -> dtype, shape, first rank holding it
    signature: dict[str, list[tuple[int, int]]] = {}
    for g, ranks in enumerate(groups):
        rep = descs[ranks[0]]
        for (key, dtype, shape), c in zip(rep.tensors, rep.classes):
            known = facts.get(key)
            if known is None:
                facts[key] = (dtype, shape, ranks[0])
                signature[key] = [(g, c)]
                continue
            if known[0] != dtype:
                raise DtypeMismatchError(f"key {key!r}: rank {known[2]} holds dtype {known[0]}, rank {ranks[0]} holds {dtype}")
            if known[1] != shape:
                raise ShapeMismatchError(
                    f"key {key!r}: rank {known[2]} has global shape {list(known[1])}, rank {ranks[0]} has {list(shape)}"
                )
            signature[key].append((g, c))

    joints: list[_Joint] = []
    joint_of: dict[tuple[tuple[int, int], ...], int] = {}
    key_joint: dict[str, int] = {}
    for key, sig in signature.items():
        members = tuple(sig)
        j = joint_of.get(members)
        if j is None:
            j = joint_of[members] = len(joints)
            joints.append(_Joint(facts[key][1], members))
        joints[j].keys.append(key)
        key_joint[key] = j
    key_pos = {key: i for i, key in enumerate(facts)}

    load = [0] * world
    whole: list[list[tuple[int, int]]] = [[] for _ in range(world)]
    base_rows: list[list[tuple[int, int, Shape, Shape, tuple[int, int] | None]]] = []  # per joint class: (rank, idx, box)
    sharded: list[bool] = []
    replicated: list[tuple[int, int, int, str, Piece, list[tuple[int, int]]]] = []
    for j, jc in enumerate(joints):
        holders: dict[Piece, list[tuple[int, int]]] = {}
        for g, c in jc.members:
            for rank in groups[g]:
                for idx, piece in enumerate(descs[rank].geometries[c]):
                    holders.setdefault(piece, []).append((rank, idx))
        check_tiling(jc.keys[0], jc.shape, list(holders))
        nonempty = [(geom, owners, n) for geom, owners in holders.items() if (n := _numel(geom))]
        if len(nonempty) == 1:
            (_, lengths, flat), _, _ = nonempty[0]
            sharded.append(not (lengths == jc.shape and flat is None))
        else:
            sharded.append(True)
        itemsizes = [torch_dtype(facts[key][0]).itemsize for key in jc.keys]
        all_items = sum(itemsizes)
        rows = []
        for gpos, (geom, owners, numel) in enumerate(nonempty):
            if len(owners) == 1:
                rank, idx = owners[0]
                whole[rank].append((j, idx))
                load[rank] += numel * all_items
                rows.append((rank, idx, geom[0], geom[1], geom[2]))
            else:
                for key, item in zip(jc.keys, itemsizes):
                    replicated.append((-numel * item, key_pos[key], gpos, key, geom, owners))
        rows.sort(key=lambda r: (r[0], r[1]))
        base_rows.append(rows)

    replicated.sort(key=lambda r: r[:3])
    heaps: dict[int, list[tuple[int, int, int]]] = {}  # lazy: entries whose load is stale are refreshed when on top
    parts: list[list[tuple[str, int, Shape, Shape, tuple[int, int] | None]]] = [[] for _ in range(world)]
    part_rows: dict[str, list[tuple[int, int, Shape, Shape, tuple[int, int] | None]]] = {}
    for neg, _pos, _g, key, (off, lens, flat), owners in replicated:
        nbytes = -neg
        heap = heaps.get(id(owners))
        if heap is None:
            heap = heaps[id(owners)] = [(load[r], r, i) for r, i in owners]
            heapq.heapify(heap)
        n = 1
        if flat is None and lens and nbytes > split_bytes:
            n = min(len(owners), lens[0], -(-nbytes // split_bytes))
        for p in range(n):
            start, size = chunk_bounds(lens[0], n, p) if n > 1 else (0, lens[0] if lens else 0)
            sub_off = (off[0] + start, *off[1:]) if n > 1 else off
            sub_len = (size, *lens[1:]) if n > 1 else lens
            while heap[0][0] != load[heap[0][1]]:  # loads only grow: refresh the stale top
                _, r, i = heap[0]
                heapq.heapreplace(heap, (load[r], r, i))
            _, rank, idx = heap[0]
            load[rank] += nbytes * size // lens[0] if n > 1 else nbytes
            heapq.heapreplace(heap, (load[rank], rank, idx))
            parts[rank].append((key, idx, sub_off, sub_len, flat))
            part_rows.setdefault(key, []).append((rank, len(parts[rank]), sub_off, sub_len, flat))

    file_ranks = tuple(r for r in range(world) if whole[r] or parts[r])
    number = {r: i for i, r in enumerate(file_ranks)}
    tensors: dict[str, TensorPlan] = {}
    shared: dict[int, tuple[ChunkTable, dict]] = {}
    for key, (dtype, shape, _) in facts.items():
        j = key_joint[key]
        extra = part_rows.get(key)
        if extra is None:
            got = shared.get(j)
            if got is None:
                table = ChunkTable.from_chunks([(number[r], off, lens, flat) for r, _i, off, lens, flat in base_rows[j]], len(shape))
                got = shared[j] = (table, table.to_json())
            table, doc = got
        else:  # rows in file order, and in each file in entry order: whole pieces first, then parts
            rows = sorted([(r, -1, o, ln, f) for r, _i, o, ln, f in base_rows[j]] + extra, key=lambda x: (x[0], x[1]))
            table = ChunkTable.from_chunks([(number[r], off, lens, flat) for r, _s, off, lens, flat in rows], len(shape))
            doc = table.to_json()
        tensors[key] = TensorPlan(dtype, shape, sharded[j], table, doc)

    assignments = []
    for ranks in groups:
        rep = descs[ranks[0]]
        by_class: list[int] = [-1] * len(rep.geometries)
        per_tensor = [key_joint[key] for key, _dtype, _shape in rep.tensors]
        one = True
        for c, j in zip(rep.classes, per_tensor):
            if by_class[c] == -1:
                by_class[c] = j
            elif by_class[c] != j:
                one = False
        joint = tuple(by_class) if one else tuple(per_tensor)
        for rank in ranks:
            assignments.append((rank, RankAssignment(tuple(whole[rank]), joint, one, tuple(parts[rank]))))
    assignments.sort(key=lambda a: a[0])
    return GlobalPlan(tensors, file_ranks, tuple(a for _, a in assignments))


def plan_rank(desc: RankDescription, assignment: RankAssignment, *, rank: int, save_id: str, block_bytes: int) -> RankWritePlan:
    """This rank's file: the chunks ``assignment`` gives it, laid out as a v3 data file."""
    if not assignment.whole and not assignment.parts:
        return RankWritePlan(None, b"", ())
    mine: dict[int, list[int]] = {}
    for j, idx in assignment.whole:
        mine.setdefault(j, []).append(idx)
    chunks: list[tuple[str, int, Shape, Shape, tuple[int, int] | None]] = []
    index = {}
    for i, ((key, _dtype, _shape), c) in enumerate(zip(desc.tensors, desc.classes)):
        index[key] = i
        for idx in mine.get(assignment.joint[c] if assignment.by_class else assignment.joint[i], ()):
            off, lens, flat = desc.geometries[c][idx]
            chunks.append((key, idx, off, lens, flat))
    chunks.extend(assignment.parts)
    facts = {}
    for key, *_ in chunks:
        if key not in facts:
            _key, dtype, shape = desc.tensors[index[key]]
            td = torch_dtype(dtype)
            facts[key] = (shape, SAFETENSORS_CODE[td], td.itemsize)
    layout = file_layout([(key, off, lens, flat) for key, _idx, off, lens, flat in chunks], facts, block_bytes, who=f"rank {rank}")
    items = tuple(
        WriteItem(key, idx, off, lens, flat, name, br)
        for (key, idx, off, lens, flat), name, br in zip(chunks, layout.names, layout.byte_ranges)
    )
    return RankWritePlan(data_file_name(rank, save_id), layout.header, items, layout.sums_range, file_digest(layout.header))


def plan_save(descs: list[list[TensorDesc]], *, save_id: str, split_bytes: int, block_bytes: int) -> SavePlan:
    """Plan a whole save in one process: :func:`plan_global` over every rank's
    :func:`describe_rank`, then every rank's :func:`plan_rank` (what the ranks of a real save
    do, each its own part)."""
    compact = [describe_rank(d) for d in descs]
    plan = plan_global(compact, split_bytes=split_bytes)
    ranks = tuple(
        plan_rank(d, a, rank=r, save_id=save_id, block_bytes=block_bytes) for r, (d, a) in enumerate(zip(compact, plan.assignments))
    )
    return SavePlan(plan, ranks)
class V3Layout(NamedTuple):
    """One v3 data file's layout: its header, each chunk's entry name and absolute byte range
    (in the order given), and the checksum entry's byte range, last in the file."""

    header: bytes
    names: list[str]
    byte_ranges: tuple[tuple[int, int], ...]
    sums_range: tuple[int, int]

    @property
    def size(self) -> int:
        return self.sums_range[1]


def file_layout(
    chunks: list[tuple[str, Shape, Shape, tuple[int, int] | None]], facts: dict[str, tuple[Shape, str, int]], block_bytes: int, *, who: str
) -> V3Layout:
    """The layout of a v3 data file holding ``chunks`` (key, offsets, lengths, flattened range)
    in that order; ``facts[key]`` is the tensor's global shape, safetensors dtype code and item
    size. Raises ``ShardingError`` (naming ``who``) when two chunks would share an entry name."""
    entries = []
    blocks = 0
    names: dict[str, tuple[Shape, Shape, tuple[int, int] | None]] = {}
    for key, off, lens, flat in chunks:
        shape, code, itemsize = facts[key]
        name = entry_name(key, shape, off, lens, flat)
        if name in names:  # two flattened boxes of one key at one offset, with ranges starting alike
            raise ShardingError(
                f"key {key!r}: {who} would write two chunks named {name!r} (box {list(names[name][1])} range "
                f"{names[name][2]} and box {list(lens)} range {flat}, both at {list(off)}); a data file cannot hold "
                "flattened ranges of two different boxes at the same offset that start at the same element"
            )
        names[name] = (off, lens, flat)
        shape_in_file = lens if flat is None else (flat[1] - flat[0],)
        nbytes = prod(shape_in_file) * itemsize
        entries.append(FileEntry(name, code, shape_in_file, nbytes))
        blocks += -(-nbytes // block_bytes)
    entries.append(FileEntry(SUMS_ENTRY, "U8", (blocks * DIGEST_BYTES,), blocks * DIGEST_BYTES))
    layout = layout_file(entries, {"format": "pt", "shardsafe_format_version": "3"})
    return V3Layout(layout.header, list(names), layout.byte_ranges[:-1], layout.byte_ranges[-1])


def _numel(geom: Piece) -> int:
    flat = geom[2]
    return flat[1] - flat[0] if flat is not None else prod(geom[1])
