"""Random sharding layouts of one global tensor, as pieces ``(offsets, lengths, flat)``.

A layout is a list of ranks, each holding exactly one piece (replicas are repeated pieces).
"""

from __future__ import annotations

from math import prod

from hypothesis import strategies as st

from shardsafe.format.geometry import chunk_bounds


def whole(shape):
    return [((0,) * len(shape), tuple(shape), None)]


def shard(shape, dim, parts):
    out = []
    for i in range(parts):
        s, n = chunk_bounds(shape[dim], parts, i)
        off = [0] * len(shape)
        lens = list(shape)
        off[dim], lens[dim] = s, n
        out.append((tuple(off), tuple(lens), None))
    return out


def grid(shape, d0, p0, d1, p1):
    out = []
    for off, lens, _ in shard(shape, d0, p0):
        for o2, l2, _ in shard(lens, d1, p1):
            out.append((tuple(a + b for a, b in zip(off, o2)), l2, None))
    return out


def flat_split(pieces, parts):
    """Each box piece split into ``parts`` flat ranges (FSDP1 / distributed-optimizer style)."""
    out = []
    for off, lens, _ in pieces:
        n = prod(lens)
        for i in range(parts):
            s, k = chunk_bounds(n, parts, i)
            out.append((off, lens, (s, s + k)))
    return out


@st.composite
def guillotine(draw, shape, max_pieces=6):
    """Random uneven boxes from recursive axis-aligned cuts."""
    boxes = [((0,) * len(shape), tuple(shape))]
    for _ in range(draw(st.integers(0, max_pieces - 1))):
        i = draw(st.integers(0, len(boxes) - 1))
        off, lens = boxes[i]
        dims = [d for d, n in enumerate(lens) if n >= 2]
        if not dims:
            continue
        d = draw(st.sampled_from(dims))
        cut = draw(st.integers(1, lens[d] - 1))
        a_l, b_o, b_l = list(lens), list(off), list(lens)
        a_l[d], b_o[d], b_l[d] = cut, off[d] + cut, lens[d] - cut
        boxes[i:i + 1] = [(off, tuple(a_l)), (tuple(b_o), tuple(b_l))]
    return [(o, n, None) for o, n in boxes]


@st.composite
def layouts(draw, shape):
    """A random layout: a mix of the above, sometimes flattened, sometimes replicated."""
    nd = len(shape)
    kind = draw(st.sampled_from(["whole", "shard", "grid", "guillotine"] if nd else ["whole"]))
    if kind == "whole":
        pieces = whole(shape)
    elif kind == "shard":
        pieces = shard(shape, draw(st.integers(0, nd - 1)), draw(st.integers(1, 5)))
    elif kind == "grid" and nd >= 2:
        d0, d1 = draw(st.permutations(range(nd)))[:2]
        pieces = grid(shape, d0, draw(st.integers(1, 3)), d1, draw(st.integers(1, 3)))
    else:
        pieces = draw(guillotine(shape))
    if draw(st.booleans()):
        pieces = flat_split(pieces, draw(st.integers(1, 3)))
    replicas = draw(st.integers(1, 2))
    return [p for p in pieces for _ in range(replicas)]
