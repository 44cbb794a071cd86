"""The save plan: from every rank's description to who writes which chunk where.

Pure function of the gathered descriptions, run once on the coordinator:

1. check that every rank agrees on each key's dtype and global shape;
2. deduplicate: pieces with identical geometry are replicas and are written once;
3. check that the distinct pieces tile each tensor (no gap, no overlap);
4. assign writers: a piece held by one rank is written by it; replicated pieces go to the
   least-loaded holder, largest first, and large replicated boxes are first split along dim 0
   so that several replicas share the write;
5. lay out each rank's safetensors file, so the metadata's byte ranges are known up front.
"""

from __future__ import annotations

from dataclasses import dataclass
from math import prod
from typing import NamedTuple

from ..errors import DtypeMismatchError, ShapeMismatchError, ShardingError
from ..format.dtypes import SAFETENSORS_CODE, torch_dtype
from ..format.file_index import SUMS_ENTRY, entry_name
from ..format.safetensors_file import FileEntry, layout_file
from .geometry import Piece, Shape, check_tiling, chunk_bounds

__all__ = ["RankWritePlan", "SavePlan", "TensorDesc", "WriteItem", "data_file_name", "plan_save"]


@dataclass(frozen=True, slots=True)
class TensorDesc:
    """What one rank holds of one tensor: its global facts and its local pieces."""

    key: str
    dtype: str
    shape: Shape
    pieces: tuple[Piece, ...]


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

    @property
    def size(self) -> int:
        """The data file's length in bytes."""
        return self.sums_range[1] if self.items else len(self.header)


@dataclass(frozen=True, slots=True)
class TensorPlan:
    dtype: str
    shape: Shape
    is_sharded: bool
    chunks: tuple[tuple[int, int], ...]  # (rank, index into that rank's items)


@dataclass(frozen=True, slots=True)
class SavePlan:
    ranks: tuple[RankWritePlan, ...]
    tensors: dict[str, TensorPlan]


DIGEST_BYTES = 8  # XXH3-64, the only algorithm a v3 file's checksum entry holds


def data_file_name(rank: int, save_id: str) -> str:
    return f"shard-r{rank:05d}-{save_id}.safetensors"


def _entry_name(key: str, shape: Shape, offsets: Shape, lengths: Shape, flat: tuple[int, int] | None, used: set[str]) -> str:
    """The chunk's entry name in its file: the key itself for a whole tensor (so the file reads
    like any safetensors file), else key@offsets[+flat start]; made unique within the file, and
    never the safetensors header's reserved ``__metadata__``."""
    if flat is None and lengths == shape and not any(offsets) and key != "__metadata__":
        name = key
    else:
        name = f"{key}@{','.join(map(str, offsets))}"
        if flat is not None:
            name = f"{name}+{flat[0]}"
    base, n = name, 1
    while name in used:  # another key's chunk name, e.g. key "a@0" beside chunk "a" at offset 0
        name = f"{base}#{n}"
        n += 1
    used.add(name)
    return name


def plan_save(descs: list[list[TensorDesc]], *, save_id: str, split_bytes: int, block_bytes: int) -> SavePlan:
    """Plan a save from ``descs[rank]``, each rank's descriptions; each file ends with the
    checksums of its entries' blocks of ``block_bytes`` (format v3, ``docs/format.md`` §4).

    Raises ``DtypeMismatchError`` / ``ShapeMismatchError`` when ranks disagree on a key, and
    ``ShardingError`` when a tensor's pieces leave a gap or overlap.
    """
    world = len(descs)
    facts: dict[str, tuple[str, Shape, int]] = {}
    # key -> geometry -> [(rank, piece_index)]
    holders: dict[str, dict[Piece, list[tuple[int, int]]]] = {}
    for rank, tensors in enumerate(descs):
        for t in tensors:
            known = facts.get(t.key)
            if known is None:
                facts[t.key] = (t.dtype, t.shape, rank)
            elif known[0] != t.dtype:
                raise DtypeMismatchError(f"key {t.key!r}: rank {known[2]} holds dtype {known[0]}, rank {rank} holds {t.dtype}")
            elif known[1] != t.shape:
                raise ShapeMismatchError(
                    f"key {t.key!r}: rank {known[2]} has global shape {list(known[1])}, rank {rank} has {list(t.shape)}"
                )
            by_geom = holders.setdefault(t.key, {})
            for i, p in enumerate(t.pieces):
                by_geom.setdefault(p, []).append((rank, i))

    load = [0] * world
    assigned: list[list[tuple[str, int, Shape, Shape, tuple[int, int] | None]]] = [[] for _ in range(world)]
    replicated: list[tuple[int, str, Piece, list[tuple[int, int]]]] = []
    sharded: dict[str, bool] = {}
    for key, by_geom in holders.items():
        dtype, shape, _ = facts[key]
        check_tiling(key, shape, list(by_geom))
        item = torch_dtype(dtype).itemsize
        nonempty = [(g, h, n) for g, h in by_geom.items() if (n := _numel(g))]
        sharded[key] = not (len(nonempty) == 1 and nonempty[0][0][1] == shape and nonempty[0][0][2] is None)
        for geom, owners, numel in nonempty:
            nbytes = numel * item
            if len(owners) == 1:
                rank, idx = owners[0]
                assigned[rank].append((key, idx, geom[0], geom[1], geom[2]))
                load[rank] += nbytes
            else:
                replicated.append((nbytes, key, geom, owners))

    replicated.sort(key=lambda r: -r[0])
    for nbytes, key, (off, lens, flat), owners in replicated:
        parts = 1
        if flat is None and lens and nbytes > split_bytes:
            parts = min(len(owners), lens[0], -(-nbytes // split_bytes))
        for p in range(parts):
            start, size = chunk_bounds(lens[0], parts, p) if parts > 1 else (0, lens[0] if lens else 0)
            sub_off = (off[0] + start, *off[1:]) if parts > 1 else off
            sub_len = (size, *lens[1:]) if parts > 1 else lens
            rank, idx = min(owners, key=lambda o: (load[o[0]], o[0]))
            assigned[rank].append((key, idx, sub_off, sub_len, flat))
            load[rank] += nbytes * size // lens[0] if parts > 1 else nbytes

    chunks: dict[str, list[tuple[int, int]]] = {key: [] for key in holders}
    file_facts = {}
    for key, (dtype, shape, _) in facts.items():
        td = torch_dtype(dtype)
        file_facts[key] = (shape, SAFETENSORS_CODE[td], td.itemsize)
    ranks = []
    for rank, items in enumerate(assigned):
        if not items:
            ranks.append(RankWritePlan(None, b"", ()))
            continue
        layout = file_layout([(key, off, lens, flat) for key, _idx, off, lens, flat in items], file_facts, block_bytes, who=f"rank {rank}")
        plan_items = []
        for j, ((key, idx, off, lens, flat), name, br) in enumerate(zip(items, layout.names, layout.byte_ranges)):
            plan_items.append(WriteItem(key, idx, off, lens, flat, name, br))
            chunks[key].append((rank, j))
        ranks.append(RankWritePlan(data_file_name(rank, save_id), layout.header, tuple(plan_items), layout.sums_range))

    tensors = {
        key: TensorPlan(facts[key][0], facts[key][1], sharded[key], tuple(chunks[key])) for key in holders
    }
    return SavePlan(tuple(ranks), tensors)


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
