"""Boxes, flat slices of boxes, and the overlap arithmetic that resharding reduces to.

A *box* is ``(offsets, lengths)`` in global coordinates. A stored or target piece is a box, or
the flat slice ``[start, stop)`` of a box's row-major flattening (FSDP1 flat parameters,
distributed optimizers). A flat slice splits into at most ``2 * ndim - 1`` *segments*: boxes
that are each contiguous in the flattening and whose own row-major order matches it. Once
everything is segments, loading is box intersection and nothing else.
"""

from __future__ import annotations

import bisect
import heapq
from math import prod

from ..errors import ShardingError

__all__ = [
    "Piece",
    "check_tiling",
    "chunk_bounds",
    "flat_segments",
    "intersect",
    "row_major_strides",
]

Shape = tuple[int, ...]
# (offsets, lengths, flat range or None): the geometry of one stored or held piece
Piece = tuple[Shape, Shape, "tuple[int, int] | None"]


def chunk_bounds(length: int, parts: int, index: int) -> tuple[int, int]:
    """(start, size) of part ``index`` when ``length`` is split like ``torch.chunk``."""
    full = -(-length // parts) if parts else 0
    start = min(length, full * index)
    return start, max(0, min(length, start + full) - start)


def row_major_strides(shape: Shape) -> tuple[int, ...]:
    strides, acc = [], 1
    for n in reversed(shape):
        strides.append(acc)
        acc *= n
    return tuple(reversed(strides))


def intersect(a_off: Shape, a_len: Shape, b_off: Shape, b_len: Shape) -> tuple[Shape, Shape] | None:
    """The overlap of two boxes, or None when they do not overlap (or it is empty)."""
    off, lens = [], []
    for ao, al, bo, bl in zip(a_off, a_len, b_off, b_len):
        lo = ao if ao > bo else bo
        hi = min(ao + al, bo + bl)
        if hi <= lo:
            return None
        off.append(lo)
        lens.append(hi - lo)
    return tuple(off), tuple(lens)


def flat_segments(shape: Shape, start: int, stop: int) -> list[tuple[Shape, Shape, int]]:
    """Split the flat slice ``[start, stop)`` of a box of ``shape`` into segments.

    Returns ``(offsets relative to the box, lengths, flat start)`` for each segment, in flat
    order. Each segment is contiguous in the flattening and spans whole trailing dimensions
    after its first non-unit one, so its row-major order is the flat order.
    """
    if start >= stop:
        return []
    if not shape:
        return [((), (), 0)]
    inner = prod(shape[1:])
    tail = shape[1:]
    out: list[tuple[Shape, Shape, int]] = []
    i0, r0 = divmod(start, inner)
    i1, r1 = divmod(stop, inner)
    if r0:
        row_stop = stop - i0 * inner if i1 == i0 else inner
        for o, ln, fs in flat_segments(tail, r0, row_stop):
            out.append(((i0, *o), (1, *ln), i0 * inner + fs))
        if i1 == i0:
            return out
        i0 += 1
    if i1 > i0:
        out.append(((i0, *(0,) * len(tail)), (i1 - i0, *tail), i0 * inner))
    if r1:
        for o, ln, fs in flat_segments(tail, 0, r1):
            out.append(((i1, *o), (1, *ln), i1 * inner + fs))
    return out


def check_tiling(key: str, shape: Shape, pieces: list[Piece]) -> None:
    """Raise ``ShardingError`` unless the distinct ``pieces`` tile ``shape`` exactly.

    ``pieces`` must already be deduplicated (replicas removed). Each piece lies inside the
    tensor, no two overlap, and together they cover every element. Costs O(n log n) in the
    number of pieces for tensors of up to two dimensions in which pieces overlap partially
    (a valid tiling of any rank is proved in O(n * 2^d)); see :func:`_covers_exactly`.
    """
    total = prod(shape)
    covered = 0
    by_box: dict[tuple[Shape, Shape], list[tuple[int, int] | None]] = {}
    ndim = len(shape)
    for off, lens, flat in pieces:
        if len(off) != ndim or len(lens) != ndim:
            raise ShardingError(f"key {key!r}: piece at {list(off)} of shape {list(lens)} has the wrong rank for global shape {list(shape)}")
        for d in range(ndim):
            if off[d] < 0 or lens[d] < 0 or off[d] + lens[d] > shape[d]:
                raise ShardingError(
                    f"key {key!r}: piece at offset {list(off)} with shape {list(lens)} lies outside the global shape {list(shape)}"
                )
        n = prod(lens)
        if flat is not None:
            if not 0 <= flat[0] <= flat[1] <= n:
                raise ShardingError(f"key {key!r}: flattened range {list(flat)} outside its box of {n} elements")
            n = flat[1] - flat[0]
        if n == 0:
            continue
        covered += n
        by_box.setdefault((off, lens), []).append(flat)

    if covered == total and _is_grid(list(by_box), by_box, shape):
        return
    # flat pieces take part as their segments: the exact boxes of elements they hold
    boxes: list[tuple[Shape, Shape]] = []
    for (off, lens), flats in by_box.items():
        for f in flats:
            if f is None:
                boxes.append((off, lens))
                continue
            for rel, seg, _ in flat_segments(lens, f[0], f[1]):
                boxes.append((tuple(o + r for o, r in zip(off, rel)), seg))
    if covered == total and _covers_exactly(boxes, shape):
        return
    for (off, lens), flats in by_box.items():
        if len(flats) == 1:
            continue
        if any(f is None for f in flats):
            raise ShardingError(f"key {key!r}: box at {list(off)} shape {list(lens)} is stored twice (overlap)")
        ordered = sorted(flats)  # type: ignore[type-var]
        for a, b in zip(ordered, ordered[1:]):
            if b[0] < a[1]:  # type: ignore[index]
                raise ShardingError(f"key {key!r}: flattened ranges {list(a)} and {list(b)} of box at {list(off)} overlap")
    clash = _find_overlap(boxes, list(range(ndim)))
    if clash is not None:
        (ao, al), (bo, bl) = sorted(clash)
        raise ShardingError(
            f"key {key!r}: pieces at {list(ao)} shape {list(al)} and at {list(bo)} shape {list(bl)} overlap"
        )
    if covered != total:
        raise ShardingError(
            f"key {key!r}: pieces cover {covered} of the {total} elements of global shape {list(shape)} "
            "(a gap: some part of the tensor is held by no rank)"
        )


def _is_grid(boxes: list[tuple[Shape, Shape]], by_box: dict, shape: Shape) -> bool:
    """O(n) proof of exact tiling for the common case: whole boxes on a grid.

    True when no piece is flat, every dimension's intervals are a partition of ``[0, size)``
    (each offset with one length, back to back), and there are as many distinct boxes as grid
    cells: distinct cells of a partition grid that are as many as the cells cover it exactly.
    False means "not proven"; the general check then runs and names the problem.
    """
    if any(f != [None] for f in by_box.values()):
        return False
    cells = 1
    for d, size in enumerate(shape):
        ends: dict[int, int] = {}
        for off, lens in boxes:
            end = off[d] + lens[d]
            if ends.setdefault(off[d], end) != end:
                return False
        pos = 0
        for start in sorted(ends):
            if start != pos:
                return False
            pos = ends[start]
        if pos != size:
            return False
        cells *= len(ends)
    return cells == len(boxes)


_MAX_CORNER_DIMS = 12  # 2^12 corners per box: beyond that, leave the proof to the overlap search


def _covers_exactly(boxes: list[tuple[Shape, Shape]], shape: Shape) -> bool:
    """Proof that non-empty ``boxes`` inside ``shape`` cover each of its elements exactly once.

    The indicator of a box ``[a, b)`` is the signed sum of the orthants ``{x >= v}`` at its
    ``2^d`` corners ``v`` (sign ``-1`` per coordinate taken from ``b``), and orthants at distinct
    corners are linearly independent. So the boxes' indicators sum to the tensor's exactly when
    their signed corner counts sum to the tensor's own corners. Dimensions in which every box
    spans the whole tensor are left out (a common factor). False means "not proven".
    """
    ndim = len(shape)
    dims = [d for d in range(ndim) if any(off[d] != 0 or lens[d] != shape[d] for off, lens in boxes)]
    if len(dims) > _MAX_CORNER_DIMS:
        return False
    counts: dict[tuple[int, ...], int] = {}
    for (off, lens), sign in [*((b, 1) for b in boxes), (((0,) * ndim, shape), -1)]:
        corners: list[tuple[tuple[int, ...], int]] = [((), sign)]
        for d in dims:
            lo, hi = off[d], off[d] + lens[d]
            corners = [(v + (lo,), s) for v, s in corners] + [(v + (hi,), -s) for v, s in corners]
        for v, s in corners:
            c = counts.get(v, 0) + s
            if c:
                counts[v] = c
            else:
                del counts[v]
    return not counts


def _find_overlap(boxes: list[tuple[Shape, Shape]], dims: list[int]):
    """A pair of distinct non-empty boxes that overlap, or None.

    Dimensions in which all boxes have the same interval cannot separate any two and are left
    out. One dimension left: sort and compare neighbours; two: sweep one dimension with the
    other's active intervals in a sorted list (both O(n log n)). More: sweep the first and
    compare each box with the active ones.
    """
    if len(boxes) < 2:
        return None
    dims = [d for d in dims if len({(off[d], lens[d]) for off, lens in boxes}) > 1]
    if not dims:
        return boxes[0], boxes[1]
    if len(dims) == 1:
        return _overlap_1d(boxes, dims[0])
    if len(dims) == 2:
        return _overlap_2d(boxes, dims[0], dims[1])
    d, rest = dims[0], dims[1:]
    active: list[tuple[Shape, Shape]] = []
    for box in sorted(boxes, key=lambda b: b[0][d]):
        lo = box[0][d]
        active = [a for a in active if a[0][d] + a[1][d] > lo]
        for other in active:
            if all(max(box[0][k], other[0][k]) < min(box[0][k] + box[1][k], other[0][k] + other[1][k]) for k in rest):
                return other, box
        active.append(box)
    return None


def _overlap_1d(boxes: list[tuple[Shape, Shape]], d: int):
    ordered = sorted(boxes, key=lambda b: (b[0][d], b[1][d]))
    reach, widest = -1, ordered[0]  # the box reaching furthest so far
    for box in ordered:
        if box[0][d] < reach:
            return widest, box
        if box[0][d] + box[1][d] > reach:
            reach, widest = box[0][d] + box[1][d], box
    return None


def _overlap_2d(boxes: list[tuple[Shape, Shape]], a: int, b: int):
    """Sweep dim ``a``; boxes that contain the sweep position have disjoint intervals on ``b``
    (else they overlap), kept sorted by start, so each new box is compared with two."""
    starts: list[int] = []  # b-starts of the active boxes, sorted
    active: dict[int, tuple[int, tuple[Shape, Shape]]] = {}  # b-start -> (b-stop, box)
    leaving: list[tuple[int, int]] = []  # heap of (a-stop, b-start)
    for box in sorted(boxes, key=lambda x: x[0][a]):
        pos = box[0][a]
        while leaving and leaving[0][0] <= pos:
            _, start = heapq.heappop(leaving)
            del starts[bisect.bisect_left(starts, start)]
            del active[start]
        lo, hi = box[0][b], box[0][b] + box[1][b]
        i = bisect.bisect_left(starts, lo)
        if i < len(starts) and starts[i] < hi:
            return active[starts[i]][1], box
        if i > 0 and active[starts[i - 1]][0] > lo:
            return active[starts[i - 1]][1], box
        starts.insert(i, lo)
        active[lo] = (hi, box)
        heapq.heappush(leaving, (pos + box[1][a], lo))
    return None
