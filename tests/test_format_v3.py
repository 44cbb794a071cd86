"""Format v3 pieces on their own: the run coding of chunk tables, the grid rule against the
general tiling check, and layouts at the edges of the naming rule."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import shardsafe
from shardsafe import Checkpointer, CorruptCheckpointError, ShardedTensor, ShardingError
from shardsafe.engine.file_index import bind_files
from shardsafe.format.chunk_table import ChunkTable, decode_runs, encode_runs
from shardsafe.format.geometry import check_tiling

from .simulate import simulate_save


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=50), max_size=40))
def test_runs_decode_to_the_values_they_encode(values):
    runs = encode_runs(values)
    assert decode_runs(runs, len(values), what="t").tolist() == values
    assert all(count >= 1 for _, _, count in runs)


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(min_value=0, max_value=6), min_size=1, max_size=32), st.integers(min_value=33, max_value=40))
def test_short_and_long_columns_encode_alike(values, pad):
    """Up to 32 values are encoded in plain Python, longer ones with numpy: the same greedy runs."""
    long = values + [values[-1]] * pad  # the same start, then a constant tail: numpy's path
    short_runs, long_runs = encode_runs(values), encode_runs(long)
    assert all(type(x) is int for run in short_runs for x in run)
    assert decode_runs(short_runs, len(values), what="t").tolist() == values
    # the runs of the shared prefix agree, up to the run the tail extends
    assert long_runs[: len(short_runs) - 1] == short_runs[:-1]


def test_a_regular_column_is_one_run_whatever_its_length():
    assert encode_runs(range(0, 4096 * 3, 3)) == [[0, 3, 4096]]
    assert encode_runs([7] * 1000) == [[7, 0, 1000]]
    assert encode_runs([]) == []


@pytest.mark.parametrize(
    ("runs", "n", "message"),
    [
        ([[0, 1, 3]], 4, "the runs hold 3 values, the table has 4"),
        ([[0, 1, 5]], 4, "the runs hold more than the table's 4 values"),
        ([[5, -2, 4]], 4, r"run \[5, -2, 4\] has values outside \[0, 2\*\*62\)"),
        ([[0, 1, 0]], 0, "a count below 1"),
        ([[0, 1]], 2, "each run must be"),
        ([[0, 1, "2"]], 2, "each run must be"),
        ({"a": 1}, 2, "must be a list"),
    ],
)
def test_malformed_runs_are_refused(runs, n, message):
    with pytest.raises(CorruptCheckpointError, match=message):
        decode_runs(runs, n, what="t")


def _boxes(draw_cuts, shape):
    """The cells of a grid over ``shape`` cut at ``draw_cuts[d]``: (offsets, lengths) per cell."""
    axes = []
    for d, n in enumerate(shape):
        cuts = sorted({0, n, *[c for c in draw_cuts[d] if 0 < c < n]})
        axes.append(list(zip(cuts[:-1], np.diff(cuts).tolist())))
    cells = [((), ())]
    for axis in axes:
        cells = [(o + (a,), ln + (b,)) for o, ln in cells for a, b in axis]
    return cells


@settings(max_examples=200, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=6), min_size=1, max_size=3),
    st.lists(st.lists(st.integers(min_value=0, max_value=6), max_size=3), min_size=3, max_size=3),
    st.randoms(use_true_random=False),
    st.sampled_from(["grid", "drop", "dup", "merge"]),
)
def test_the_grid_rule_agrees_with_the_general_tiling_check(shape, cuts, rnd, change):
    """``grid_cells`` may say "not a grid" for a layout that tiles (then the general check runs),
    but never "tiles" for one that does not."""
    shape = tuple(shape)
    cells = _boxes(cuts, shape)
    rnd.shuffle(cells)
    if change == "drop" and len(cells) > 1:
        cells = cells[1:]
    elif change == "dup":
        cells = [*cells, cells[0]]
    elif change == "merge" and len(cells) > 1:  # one box over two cells: still a tiling if they were neighbours
        (o1, l1), (o2, l2) = cells[0], cells[1]
        lo = tuple(min(a, b) for a, b in zip(o1, o2))
        hi = tuple(max(a + x, b + y) for a, x, b, y in zip(o1, l1, o2, l2))
        cells = [(lo, tuple(h - a for h, a in zip(hi, lo))), *cells[2:]]
    table = ChunkTable.from_chunks([(0, o, ln, None) for o, ln in cells], len(shape))
    try:
        check_tiling("t", shape, [(o, ln, None) for o, ln in cells])
        tiles = True
    except ShardingError:
        tiles = False
    if table.grid_cells(shape):
        assert tiles, cells
    if change == "grid":
        assert table.grid_cells(shape) and tiles


def _guillotine(rnd, off: tuple, lens: tuple, depth: int) -> list:
    """A tiling of the box ``off``/``lens`` by recursive cuts (no grid in general)."""
    dims = [d for d, n in enumerate(lens) if n > 1]
    if depth == 0 or not dims or rnd.random() < 0.2:
        return [(off, lens)]
    d = rnd.choice(dims)
    cut = rnd.randint(1, lens[d] - 1)
    a_lens = tuple(cut if i == d else n for i, n in enumerate(lens))
    b_off = tuple(o + cut if i == d else o for i, o in enumerate(off))
    b_lens = tuple(n - cut if i == d else n for i, n in enumerate(lens))
    return _guillotine(rnd, off, a_lens, depth - 1) + _guillotine(rnd, b_off, b_lens, depth - 1)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.integers(min_value=1, max_value=7), min_size=1, max_size=4),
    st.randoms(use_true_random=False),
    st.sampled_from(["tiling", "drop", "dup", "shift", "gap"]),
    st.booleans(),
)
def test_the_box_by_box_rule_agrees_with_the_general_tiling_check(shape, rnd, change, flats):
    """``tiles_box_by_box`` (vectorized, signed corners) says "tiles" exactly when the general
    check does, for layouts of the box-by-box form: recursive cuts, some boxes split further
    into flattened ranges, then one piece dropped, doubled or moved, or a range cut short."""
    shape = tuple(shape)
    pieces = []
    for off, lens in _guillotine(rnd, (0,) * len(shape), shape, 6):
        n = int(np.prod(lens))
        if flats and n > 1 and rnd.random() < 0.5:
            cuts = sorted(rnd.sample(range(1, n), min(n - 1, rnd.randint(1, 3))))
            bounds = [0, *cuts, n]
            pieces += [(off, lens, (a, b)) for a, b in zip(bounds, bounds[1:])]
        else:
            pieces.append((off, lens, None))
    rnd.shuffle(pieces)
    i = rnd.randrange(len(pieces))
    off, lens, flat = pieces[i]
    if change == "drop" and len(pieces) > 1:
        pieces.pop(i)
    elif change == "dup":
        pieces.append(pieces[i])
    elif change == "shift":
        d = rnd.randrange(len(shape))
        if off[d] > 0:
            pieces[i] = (tuple(o - 1 if k == d else o for k, o in enumerate(off)), lens, flat)
    elif change == "gap" and flat is not None and flat[1] - flat[0] > 1:
        pieces[i] = (off, lens, (flat[0], flat[1] - 1))
    table = ChunkTable.from_chunks([(0, o, ln, f) for o, ln, f in pieces], len(shape))
    try:
        check_tiling("t", shape, [(o, ln, f) for o, ln, f in pieces])
        tiles = True
    except ShardingError:
        tiles = False
    assert table.tiles_box_by_box(shape) == tiles, pieces
    if change == "tiling":
        assert tiles


def test_two_flattened_boxes_that_would_share_a_name_are_refused_before_anything_is_written(tmp_path):
    t = torch.arange(16.0).reshape(4, 4)

    def flat(o, ln, a, b):
        box = t[o[0] : o[0] + ln[0], o[1] : o[1] + ln[1]].reshape(-1)[a:b].clone()
        return ShardedTensor("t", box, (4, 4), o, ln, flattened_range=slice(a, b))

    rank0 = {"a": flat((0, 0), (2, 4), 4, 5), "b": flat((0, 0), (4, 2), 4, 5)}
    rank1 = {"a": flat((0, 0), (4, 4), 0, 4), "b": flat((0, 0), (4, 4), 5, 8), "c": flat((0, 0), (4, 4), 9, 16)}
    with pytest.raises(ShardingError, match=r"key 't': rank 0 would write two chunks named 't@0,0\+4' \(box \[2, 4\] range \(4, 5\) and box \[4, 2\]"):
        simulate_save(str(tmp_path / "c"), [rank0, rank1])
    assert not os.path.exists(tmp_path / "c") or os.listdir(tmp_path / "c") == []


def test_a_flattened_range_over_its_whole_box_loads_and_verifies(tmp_path):
    t = torch.arange(12.0).reshape(4, 3)
    path = str(tmp_path / "c")
    r0 = {"t": ShardedTensor("t", t[:2].reshape(-1).clone(), (4, 3), (0, 0), (2, 3), flattened_range=slice(0, 6))}
    r1 = {"t": ShardedTensor("t", t[2:].clone(), (4, 3), (2, 0), (2, 3))}
    simulate_save(path, [r0, r1])
    report = shardsafe.verify(path)
    assert report.ok and report.chunks == 2 and report.bytes == 48
    assert torch.equal(Checkpointer().unshard(path)["t"], t)


def test_from_table_makes_what_model_construct_makes():
    from shardsafe.format.chunk_table import ChunkTable
    from shardsafe.format.metadata import DataFile, TensorStorageMetadata, built

    table = ChunkTable.from_chunks([(0, (0, 0), (2, 3), None), (1, (2, 0), (2, 3), (0, 6))], 2)
    fast = TensorStorageMetadata.from_table((4, 3), "float32", True, table)
    slow = TensorStorageMetadata.model_construct(shape=(4, 3), dtype="float32", is_sharded=True, table=table.to_json())
    assert fast.__dict__ == slow.__dict__ and list(fast.__dict__) == list(slow.__dict__)
    assert fast.__pydantic_fields_set__ == slow.__pydantic_fields_set__
    assert fast.__pydantic_extra__ == slow.__pydantic_extra__
    slow._table = table
    assert fast.__pydantic_private__ == slow.__pydantic_private__
    assert fast.model_dump_json() == slow.model_dump_json()
    fields = {"name": "a.safetensors", "size": 80, "header_bytes": 64, "header": "0" * 16, "sums": "1" * 16}
    fast_file, slow_file = built(DataFile, fields), DataFile.model_construct(**fields)
    assert fast_file.__dict__ == slow_file.__dict__ and fast_file.__pydantic_fields_set__ == slow_file.__pydantic_fields_set__
    assert fast_file.__pydantic_private__ == slow_file.__pydantic_private__ and fast_file == slow_file


def test_the_other_ranks_parse_of_their_coordinators_metadata_is_what_from_json_gives(tmp_path):
    """A save's other ranks take the committed document with ``from_own_json`` (no second
    validation): the same object as ``from_json``, tables decoded alike, the same bytes back."""
    from shardsafe.format.metadata import StorageMetadata

    t = torch.arange(24.0).reshape(4, 6)
    flat = t[:2].reshape(-1)
    r0 = {
        "box": ShardedTensor("box", t[:2].clone(), (4, 6), (0, 0), (2, 6)),
        "flat": ShardedTensor("flat", flat[:5].clone(), (4, 6), (0, 0), (2, 6), flattened_range=slice(0, 5)),
        "rep": torch.ones(3, dtype=torch.bfloat16), "scalar": torch.tensor(7, dtype=torch.int64), "empty": torch.zeros(0, 3),
    }
    r1 = {
        "box": ShardedTensor("box", t[2:].clone(), (4, 6), (2, 0), (2, 6)),
        "flat": ShardedTensor("flat", torch.cat([flat[5:], t[2:].reshape(-1)]), (4, 6), (0, 0), (4, 6), flattened_range=slice(5, 24)),
        "rep": torch.ones(3, dtype=torch.bfloat16), "scalar": torch.tensor(7, dtype=torch.int64), "empty": torch.zeros(0, 3),
    }
    sharded = str(tmp_path / "sharded")
    simulate_save(sharded, [r0, r1], split_bytes=16)
    values = str(tmp_path / "values")
    Checkpointer(allow_pickle=True).save(values, {"w": t, "step": 3, "betas": (0.9, 0.95), "nan": float("nan"), "odd": {1, 2}})
    for path in (sharded, values):
        with open(os.path.join(path, "metadata.json"), "rb") as f:
            raw = f.read()
        checked, own = StorageMetadata.from_json(raw, where="m"), StorageMetadata.from_own_json(raw, where="m")
        assert own == checked and own.to_json() == raw
        for key, tm in checked.tensors.items():
            a, b = tm._table, own.tensors[key]._table
            assert [x.tolist() for x in (a.files, a.offsets, a.lengths)] == [x.tolist() for x in (b.files, b.offsets, b.lengths)]
            assert (a.flat is None and b.flat is None) or a.flat.tolist() == b.flat.tolist()
            assert own.tensors[key]._doc is own and own.tensors[key]._key == key and own.tensors[key]._checksum == own.checksum
        storage = shardsafe.storage.open_storage(path)
        assert {k: list(t.chunks()) for k, t in bind_files(own, storage).tensors.items()} == {
            k: list(t.chunks()) for k, t in bind_files(checked, storage).tensors.items()
        }
    damaged = raw.replace(b'"step":3', b'"step":4')
    with pytest.raises(CorruptCheckpointError, match="checksum"):
        StorageMetadata.from_own_json(damaged, where="m")
