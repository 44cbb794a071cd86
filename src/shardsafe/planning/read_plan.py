"""Read plans: intersect a rank's target pieces with the stored chunks of a tensor.

Each :class:`ReadItem` is a box copy: a box of one stored segment (a run of bytes in a file)
goes to a box of one target segment. Which bytes of the file that means, and how to coalesce
them, is decided when the item runs (``engine.reader``), where the storage's costs are known.
"""

from __future__ import annotations

from bisect import bisect_left, bisect_right
from dataclasses import dataclass
from math import prod

from ..format.checksum import ChunkSums
from ..format.geometry import Piece, Shape, flat_segments, intersect
from ..format.metadata import TensorStorageMetadata

__all__ = ["ReadItem", "StoredIndex", "plan_reads"]


@dataclass(frozen=True, slots=True)
class ReadItem:
    file: str
    src_start: int  # absolute byte offset of the source segment's first element
    src_shape: Shape  # the source segment's box lengths
    src_rel: Shape  # the copied box's offset inside the source segment
    dst_piece: int  # which target piece receives it
    dst_flat: int  # element offset of the target segment inside the piece's data (flat)
    dst_shape: Shape  # the target segment's box lengths
    dst_rel: Shape  # the copied box's offset inside the target segment
    lengths: Shape  # the copied box
    chunk_start: int  # absolute byte offset of the stored chunk's first byte
    sums: ChunkSums  # the checksums of the chunk's blocks
    chunk: str  # "file:entry", to name in errors


class StoredIndex:
    """The stored segments of one tensor, sorted for overlap queries on dimension 0.

    A segment is ``(offsets, lengths, file, absolute start byte, spec)``. Checksums are
    decoded only for the chunks a read touches (:meth:`sums`).
    """

    def __init__(self, meta: TensorStorageMetadata, targets: list[Piece] | None = None, *, indices: list[int] | None = None) -> None:
        """With ``targets``, the index may hold only the chunks that overlap their boxes (format
        v3 then reads the headers of only the files that hold those); ``indices``: those chunks'
        table indices (:meth:`TensorStorageMetadata.overlapping`), if the caller has them."""
        self.meta = meta
        self.itemsize = meta.torch_dtype.itemsize
        self._sums: dict[int, ChunkSums] = {}
        segs = []
        if targets is None:
            chunks = meta.chunks()
        else:
            chunks = meta.chunks_overlapping([(off, lens) for off, lens, _ in targets], indices=indices)
        for file, spec in chunks:
            if spec.flattened_range is None:  # a box is its own single segment
                segs.append((spec.global_offset, spec.local_shape, file, spec.byte_range[0], spec))
                continue
            lo, hi = spec.flattened_range
            parts = flat_segments(spec.local_shape, lo, hi)
            for rel, lens, fs in parts:
                off = tuple(o + r for o, r in zip(spec.global_offset, rel))
                start = spec.byte_range[0] + (fs - lo) * self.itemsize
                segs.append((off, lens, file, start, spec))
        segs.sort(key=lambda s: s[0][:1])
        self.segments = segs
        self.starts = [s[0][0] if s[0] else 0 for s in segs]
        self.max_len0 = max((s[1][0] if s[1] else 1 for s in segs), default=0)

    def sums(self, file: str, spec) -> ChunkSums:
        got = self._sums.get(id(spec))
        if got is None:
            got = self._sums[id(spec)] = self.meta.chunk_sums(file, spec)
        return got

    def overlapping(self, off: Shape, lens: Shape):
        if not off:
            return self.segments
        a, b = off[0], off[0] + lens[0]
        lo = bisect_right(self.starts, a - self.max_len0)
        hi = bisect_left(self.starts, b)
        return self.segments[lo:hi]


def plan_reads(index: StoredIndex, targets: list[Piece]) -> tuple[list[ReadItem], list[int]]:
    """Read items that fill ``targets`` (this rank's pieces of one tensor) from ``index``.

    Also returns, per target piece, how many of its elements the items cover; stored chunks
    are disjoint (checked when the metadata is read), so a piece is fully loaded exactly when
    that count equals its size.
    """
    items: list[ReadItem] = []
    covered = [0] * len(targets)
    for p, (t_off, t_lens, t_flat) in enumerate(targets):
        if t_flat is None:
            t_segs = [((0,) * len(t_lens), t_lens, 0)]
            base = 0
        else:
            t_segs = flat_segments(t_lens, t_flat[0], t_flat[1])
            base = t_flat[0]
        for rel, lens, fs in t_segs:
            g_off = tuple(o + r for o, r in zip(t_off, rel))
            for s_off, s_lens, file, s_start, spec in index.overlapping(g_off, lens):
                hit = intersect(g_off, lens, s_off, s_lens)
                if hit is None:
                    continue
                h_off, h_lens = hit
                items.append(
                    ReadItem(
                        file=file,
                        src_start=s_start,
                        src_shape=s_lens,
                        src_rel=tuple(h - s for h, s in zip(h_off, s_off)),
                        dst_piece=p,
                        dst_flat=fs - base,
                        dst_shape=lens,
                        dst_rel=tuple(h - g for h, g in zip(h_off, g_off)),
                        lengths=h_lens,
                        chunk_start=spec.byte_range[0],
                        sums=index.sums(file, spec),
                        chunk=f"{file}:{spec.name}",
                    )
                )
                covered[p] += prod(h_lens)
    return items, covered
