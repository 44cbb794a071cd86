"""Format v3: one tensor's chunks as columns of run-length coded integers.

A v2 ``metadata.json`` spends about 200 bytes per chunk (offsets, shape, name, byte range and
checksums of every chunk of every tensor), so at 4096 ranks x 1000 tensors it is hundreds of
megabytes that every loading rank parses whole. Most of it follows a rule: FSDP's chunk offsets
step by the same row count, rank after rank; the file of chunk ``i`` is file ``i``. A v3 table
stores each column (the file index of each chunk, its offset and length in every dimension, and
for flattened chunks the start and stop of its range) as *runs*: ``[first, step, count]`` stands
for ``first, first + step, ..., first + step * (count - 1)``. A regular layout is a handful of
runs per tensor, whatever the rank count; an irregular one degrades to about one run per chunk.
Where each chunk's bytes are in its file, and their checksums, are in that file's own header
(see ``docs/format.md`` §4), read only by the ranks that need the file.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from math import prod
from typing import Any

import numpy as np

from ..errors import CorruptCheckpointError

__all__ = ["ChunkTable", "decode_runs", "encode_runs"]

_LIMIT = 1 << 62  # every value in a table is below this (as MAX_SIZE in metadata.py)
_SMALL = 32  # up to this many chunks, overlap queries run in plain Python
_MAX_CORNER_DIMS = 12  # tiles_box_by_box: at most 4096 corners per box
_MAX_CORNER_VALUES = 1 << 25  # tiles_box_by_box: at most 256 MiB of corner coordinates


def encode_runs(values: Sequence[int] | np.ndarray) -> list[list[int]]:
    """``values`` as runs ``[first, step, count]``, greedily: each run is as long as it can be."""
    if len(values) <= _SMALL:  # most tensors have a chunk or a few: numpy's per-call cost dominates
        v = values.tolist() if isinstance(values, np.ndarray) else [int(x) for x in values]
        runs = []
        i, n = 0, len(v)
        while i < n:
            if i == n - 1:
                runs.append([v[i], 0, 1])
                break
            step, j = v[i + 1] - v[i], i + 1
            while j + 1 < n and v[j + 1] - v[j] == step:
                j += 1
            runs.append([v[i], step, j - i + 1])
            i = j + 1
        return runs
    a = np.asarray(values, dtype=np.int64)
    n = len(a)
    runs: list[list[int]] = []
    i = 0
    if n == 0:
        return runs
    d = np.diff(a)
    # where the step changes: a run from i covers i .. j where d[i:j] are all equal
    change = np.flatnonzero(d[1:] != d[:-1]) + 1 if n > 2 else np.empty(0, dtype=np.int64)
    bounds = change.tolist()
    k = 0
    while i < n:
        if i == n - 1:
            runs.append([int(a[i]), 0, 1])
            break
        while k < len(bounds) and bounds[k] <= i:
            k += 1
        j = bounds[k] if k < len(bounds) else n - 1  # d[i:j] equal: elements i .. j
        runs.append([int(a[i]), int(d[i]), j - i + 1])
        i = j + 1
    return runs


def decode_runs(runs: Any, n: int, *, what: str) -> np.ndarray:
    """The ``n`` values of ``runs``; ``CorruptCheckpointError`` (naming ``what``) unless they are
    well-formed runs of exactly ``n`` values, each in ``[0, 2**62)``."""
    if type(runs) is not list:
        raise CorruptCheckpointError(f"{what}: must be a list of [first, step, count] runs")
    total = 0
    parts = []
    for run in runs:
        if type(run) is not list or len(run) != 3 or any(type(x) is not int for x in run):
            raise CorruptCheckpointError(f"{what}: each run must be [first, step, count] (integers), found {str(run)[:40]}")
        first, step, count = run
        last = first + step * (count - 1)
        if count < 1 or not (0 <= first < _LIMIT and 0 <= last < _LIMIT) or abs(step) >= _LIMIT:
            raise CorruptCheckpointError(f"{what}: run {run} has values outside [0, 2**62) or a count below 1")
        total += count
        if total > n:
            raise CorruptCheckpointError(f"{what}: the runs hold more than the table's {n} values")
        parts.append(first + step * np.arange(count, dtype=np.int64) if count > 1 else np.array([first], dtype=np.int64))
    if total != n:
        raise CorruptCheckpointError(f"{what}: the runs hold {total} values, the table has {n}")
    return np.concatenate(parts) if parts else np.empty(0, dtype=np.int64)


class ChunkTable:
    """The chunks of one tensor: ``files[i]`` (index into the metadata's data file list),
    ``offsets[i]`` and ``lengths[i]`` (its box), and ``flat[i]`` (``[start, stop)`` of the box
    flattened, or no ``flat`` when no chunk is flattened; a box chunk then has ``[0, numel)``)."""

    __slots__ = ("_boxes", "files", "flat", "lengths", "offsets")

    def __init__(self, files: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, flat: np.ndarray | None) -> None:
        self.files = files
        self.offsets = offsets
        self.lengths = lengths
        self.flat = flat
        self._boxes: list[tuple[list[int], list[int]]] | None = None  # small tables: the boxes as lists

    def __len__(self) -> int:
        return len(self.files)

    @classmethod
    def from_chunks(cls, chunks: Sequence[tuple[int, Sequence[int], Sequence[int], tuple[int, int] | None]], ndim: int) -> ChunkTable:
        """From ``(file index, offsets, lengths, flattened range or None)`` per chunk."""
        n = len(chunks)
        files = np.fromiter((c[0] for c in chunks), dtype=np.int64, count=n)
        offsets = np.array([c[1] for c in chunks], dtype=np.int64).reshape(n, ndim)
        lengths = np.array([c[2] for c in chunks], dtype=np.int64).reshape(n, ndim)
        flat = None
        if any(c[3] is not None for c in chunks):
            flat = np.array([c[3] if c[3] is not None else (0, prod(c[2])) for c in chunks], dtype=np.int64).reshape(n, 2)
        return cls(files, offsets, lengths, flat)

    def to_json(self) -> dict[str, Any]:
        doc: dict[str, Any] = {
            "count": len(self),
            "file": encode_runs(self.files),
            "offset": [encode_runs(self.offsets[:, d]) for d in range(self.offsets.shape[1])],
            "length": [encode_runs(self.lengths[:, d]) for d in range(self.lengths.shape[1])],
        }
        if self.flat is not None:
            doc["flat"] = [encode_runs(self.flat[:, 0]), encode_runs(self.flat[:, 1])]
        return doc

    @classmethod
    def from_json(cls, doc: Any, *, shape: tuple[int, ...], nfiles: int, what: str, max_count: int = _LIMIT) -> ChunkTable:
        """Decode and check a table: every box inside ``shape``, non-empty, every flattened range
        inside its box, every file index below ``nfiles``, at most ``max_count`` chunks (checked
        before anything is decoded: a few runs can stand for any number of chunks). Whether the
        chunks tile the tensor is :meth:`check_tiling`'s."""
        if type(doc) is not dict or set(doc) - {"count", "file", "offset", "length", "flat"} or not {"count", "file", "offset", "length"} <= set(doc):
            raise CorruptCheckpointError(f"{what}: a chunk table has the members count, file, offset, length and, optionally, flat")
        n = doc["count"]
        if type(n) is not int or not 0 <= n < _LIMIT:
            raise CorruptCheckpointError(f"{what}: count must be an integer >= 0, found {str(n)[:40]}")
        if n > max_count:
            raise CorruptCheckpointError(
                f"{what}: count {n} is more chunks than the data files' headers can name ({max_count} left); the metadata is damaged"
            )
        ndim = len(shape)
        for name in ("offset", "length"):
            if type(doc[name]) is not list or len(doc[name]) != ndim:
                raise CorruptCheckpointError(f"{what}: {name} must have one list of runs per dimension ({ndim})")
        files = decode_runs(doc["file"], n, what=f"{what}: file")
        if n and int(files.max()) >= nfiles:
            raise CorruptCheckpointError(f"{what}: a chunk names data file {int(files.max())}; the checkpoint has {nfiles}")
        offsets = np.empty((n, ndim), dtype=np.int64)
        lengths = np.empty((n, ndim), dtype=np.int64)
        for d in range(ndim):
            offsets[:, d] = decode_runs(doc["offset"][d], n, what=f"{what}: offset[{d}]")
            lengths[:, d] = decode_runs(doc["length"][d], n, what=f"{what}: length[{d}]")
            if n and (int(lengths[:, d].min()) < 1 or int((offsets[:, d] + lengths[:, d]).max()) > shape[d]):
                raise CorruptCheckpointError(
                    f"{what}: a chunk's box leaves the tensor's shape {list(shape)} in dimension {d}, or is empty"
                )
        flat = None
        if "flat" in doc:
            if type(doc["flat"]) is not list or len(doc["flat"]) != 2:
                raise CorruptCheckpointError(f"{what}: flat must be two lists of runs (starts, stops)")
            flat = np.empty((n, 2), dtype=np.int64)
            flat[:, 0] = decode_runs(doc["flat"][0], n, what=f"{what}: flat starts")
            flat[:, 1] = decode_runs(doc["flat"][1], n, what=f"{what}: flat stops")
            numel = np.prod(lengths, axis=1) if ndim else np.ones(n, dtype=np.int64)
            if n and (bool((flat[:, 0] >= flat[:, 1]).any()) or bool((flat[:, 1] > numel).any())):
                raise CorruptCheckpointError(f"{what}: a flattened range is empty or leaves its box")
        return cls(files, offsets, lengths, flat)

    def numels(self) -> np.ndarray:
        """Elements stored per chunk."""
        if self.flat is not None:
            return self.flat[:, 1] - self.flat[:, 0]
        return np.prod(self.lengths, axis=1) if self.lengths.shape[1] else np.ones(len(self), dtype=np.int64)

    def chunk(self, i: int) -> tuple[int, tuple[int, ...], tuple[int, ...], tuple[int, int] | None]:
        """Chunk ``i``: its file index, offsets, lengths and flattened range (None for a whole box)."""
        off = tuple(self.offsets[i].tolist())
        lens = tuple(self.lengths[i].tolist())
        flat = None
        if self.flat is not None:
            lo, hi = self.flat[i].tolist()
            if not (lo == 0 and hi == prod(lens)):
                flat = (lo, hi)
        return int(self.files[i]), off, lens, flat

    def overlapping(self, off: Sequence[int], lens: Sequence[int]) -> list[int]:
        """Indices of the chunks whose box overlaps the box ``off``/``lens``, ascending."""
        n = len(self)
        if not n:
            return []
        if not len(off):
            return list(range(n))
        if n <= _SMALL:  # most tensors of a load: a few chunks, where numpy's per-call cost dominates
            boxes = self._boxes
            if boxes is None:
                boxes = self._boxes = list(zip(self.offsets.tolist(), self.lengths.tolist()))
            ends = [o + ln for o, ln in zip(off, lens)]
            return [
                i for i, (o, ln) in enumerate(boxes)
                if all(c < e and c + m > a for c, m, a, e in zip(o, ln, off, ends))
            ]
        a = np.asarray(off, dtype=np.int64)
        b = a + np.asarray(lens, dtype=np.int64)
        hit = ((self.offsets < b) & (self.offsets + self.lengths > a)).all(axis=1)
        return np.flatnonzero(hit).tolist()

    def tiles_box_by_box(self, shape: tuple[int, ...]) -> bool:
        """True when the chunks tile ``shape`` box by box: the flattened ranges of the chunks that
        share a box tile that box (a whole-box chunk is the range ``[0, numel)``), and the distinct
        boxes tile the tensor. Every layout shardsafe writes is of this form. False means either
        that the chunks do not tile the tensor, or that they tile it in another way (a flattened
        range that a chunk of another box completes); :func:`check_tiling` tells which.

        Vectorized, in time about ``n log n`` for ``n`` chunks: the boxes tile the tensor exactly
        when the signed corners of the boxes (``+1`` or ``-1`` by the number of upper bounds a
        corner takes) sum, point by point, to those of the tensor's own box, as the indicator
        function of a box is that signed sum of orthants and orthants of distinct corners are
        linearly independent. Dimensions that every box spans whole are left out; a table with
        boxes that differ in more than :data:`_MAX_CORNER_DIMS` dimensions is not tried (False)."""
        n = len(self)
        if n == 0:
            return math.prod(shape) == 0
        # the distinct boxes, and the flattened ranges of each
        boxes = np.concatenate([self.offsets, self.lengths], axis=1)
        numel = np.prod(self.lengths, axis=1) if len(shape) else np.ones(n, dtype=np.int64)  # of each chunk's box
        starts = self.flat[:, 0] if self.flat is not None else np.zeros(n, dtype=np.int64)
        stops = self.flat[:, 1] if self.flat is not None else numel
        # sorted by box, then by range start (lexsort of int64 columns: np.unique(axis=0) sorts
        # rows as opaque bytes, twenty times slower at a million chunks)
        order = np.lexsort((starts, *boxes.T[::-1])) if len(shape) else np.argsort(starts, kind="stable")
        sorted_boxes, lo, hi = boxes[order], starts[order], stops[order]
        first = np.ones(n, dtype=bool)
        first[1:] = (sorted_boxes[1:] != sorted_boxes[:-1]).any(axis=1)
        last = np.ones(n, dtype=bool)
        last[:-1] = first[1:]
        distinct = sorted_boxes[first]
        if bool((lo[first] != 0).any()) or bool((hi[last] != numel[order][last]).any()):
            return False
        if bool((lo[1:][~first[1:]] != hi[:-1][~first[1:]]).any()):  # within a box: each range starts where the last ended
            return False
        if not len(shape):
            return True  # one box, the scalar, which its ranges tile
        ndim = len(shape)
        off, lens = distinct[:, :ndim], distinct[:, ndim:]
        full = np.asarray(shape, dtype=np.int64)
        dims = [d for d in range(ndim) if not (bool((off[:, d] == 0).all()) and bool((lens[:, d] == full[d]).all()))]
        if not dims:
            return len(distinct) == 1
        if len(dims) > _MAX_CORNER_DIMS:
            return False
        lower, upper = off[:, dims], off[:, dims] + lens[:, dims]
        k = len(dims)
        if len(distinct) * (k << k) > _MAX_CORNER_VALUES:
            return False
        masks = np.arange(1 << k)
        bits = (masks[:, None] >> np.arange(k)) & 1  # (2**k, k): 1 where a corner takes the upper bound
        signs = np.where(bits.sum(axis=1) % 2 == 0, 1, -1)
        corners = np.where(bits[None, :, :] == 1, upper[:, None, :], lower[:, None, :]).reshape(-1, k)
        weights = np.tile(signs, len(distinct))
        tensor = np.where(bits == 1, full[dims][None, :], 0)  # the tensor's own corners and signs
        corners = np.concatenate([corners, tensor])
        weights = np.concatenate([weights, -signs])
        radix = full[dims] + 1
        if math.prod(radix.tolist()) < _LIMIT:  # one int64 per corner: a 1-d sort, several times faster
            keys = corners[:, 0]
            for d in range(1, k):
                keys = keys * radix[d] + corners[:, d]
            order = np.argsort(keys, kind="stable")
            same = keys[order][1:] == keys[order][:-1]
        else:
            order = np.lexsort(corners.T[::-1])
            same = (corners[order][1:] == corners[order][:-1]).all(axis=1)
        starts_at = np.flatnonzero(np.concatenate([[True], ~same]))
        total = np.add.reduceat(weights[order], starts_at)  # the signed count at each distinct corner
        return not bool(total.any())

    def grid_cells(self, shape: tuple[int, ...]) -> bool:
        """True when the chunks are whole boxes that are exactly the cells of a grid over
        ``shape``, each cell once: then they tile the tensor (no gap, no overlap)."""
        n = len(self)
        if self.flat is not None and bool(((self.flat[:, 0] != 0) | (self.flat[:, 1] != np.prod(self.lengths, axis=1))).any()):
            return False
        if not shape:
            return n == 1
        cells = 1
        index = np.zeros(n, dtype=np.int64)
        for d, size in enumerate(shape):
            cuts = np.unique(np.concatenate([self.offsets[:, d], self.offsets[:, d] + self.lengths[:, d], [0, size]]))
            lo = np.searchsorted(cuts, self.offsets[:, d])
            hi = np.searchsorted(cuts, self.offsets[:, d] + self.lengths[:, d])
            if bool((hi != lo + 1).any()):  # a box spans several cells of this dimension
                return False
            cells *= len(cuts) - 1
            if cells > n:
                return False
            index = index * (len(cuts) - 1) + lo
        return cells == n and len(np.unique(index)) == n
