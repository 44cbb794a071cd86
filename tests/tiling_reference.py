"""The tiling check as it was before it became O(n log n): pure Python, quadratic when pieces
overlap partially on their first dimension (4000 staircase chunks took seconds). Kept as the
reference that ``shardsafe.format.geometry.check_tiling`` must agree with
(``tests/test_geometry.py``)."""

from __future__ import annotations

from math import prod

from shardsafe.errors import ShardingError
from shardsafe.format.geometry import Piece, Shape, flat_segments, intersect


def reference_check_tiling(key: str, shape: Shape, pieces: list[Piece]) -> None:
    """Raise ``ShardingError`` unless the distinct ``pieces`` tile ``shape`` exactly.

    ``pieces`` must already be deduplicated (replicas removed). Each piece lies inside the
    tensor, no two overlap, and together they cover every element.
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
    for (off, lens), flats in by_box.items():
        if len(flats) == 1:
            continue
        if any(f is None for f in flats):
            raise ShardingError(f"key {key!r}: box at {list(off)} shape {list(lens)} is stored twice (overlap)")
        ordered = sorted(flats)  # type: ignore[type-var]
        for a, b in zip(ordered, ordered[1:]):
            if b[0] < a[1]:  # type: ignore[index]
                raise ShardingError(f"key {key!r}: flattened ranges {list(a)} and {list(b)} of box at {list(off)} overlap")
    # flat pieces take part as their segments: the exact boxes of elements they hold
    boxes: list[tuple[Shape, Shape]] = []
    for (off, lens), flats in by_box.items():
        if flats == [None]:
            boxes.append((off, lens))
            continue
        for f in flats:
            for rel, seg, _ in flat_segments(lens, f[0], f[1]):  # type: ignore[index]
                boxes.append((tuple(o + r for o, r in zip(off, rel)), seg))
    clash = _find_overlap(boxes, 0, ndim)
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


def _find_overlap(boxes: list[tuple[Shape, Shape]], dim: int, ndim: int):
    """A pair of distinct boxes that overlap, or None.

    Sweeps one dimension at a time: boxes with the same interval on ``dim`` are recursed on the
    next dimension, so grid layouts (any mix of Shard placements) cost O(n log n); only
    partially overlapping intervals fall back to pairwise checks.
    """
    if len(boxes) < 2:
        return None
    if dim == ndim:
        return boxes[0], boxes[1]
    groups: dict[tuple[int, int], list[tuple[Shape, Shape]]] = {}
    for b in boxes:
        groups.setdefault((b[0][dim], b[0][dim] + b[1][dim]), []).append(b)
    if len(groups) == 1:
        return _find_overlap(boxes, dim + 1, ndim)
    active: list[tuple[int, list[tuple[Shape, Shape]]]] = []  # (stop, boxes) overlapping the sweep
    for (lo, hi), members in sorted(groups.items()):
        active = [(stop, m) for stop, m in active if stop > lo]
        for _, other in active:
            for a in members:
                for b in other:
                    if intersect(a[0], a[1], b[0], b[1]) is not None:
                        return a, b
        active.append((hi, members))
        found = _find_overlap(members, dim + 1, ndim)
        if found is not None:
            return found
    return None
