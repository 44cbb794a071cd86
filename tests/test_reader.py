"""The reader moves only the bytes a target needs, with bounded scratch, into any target view."""

from __future__ import annotations

import dataclasses

import torch

from shardsafe import Checkpointer, ShardedTensor
from shardsafe.adapters import describe_state
from shardsafe.engine.reader import Reader
from shardsafe.knobs import KNOBS
from shardsafe.storage import open_storage

from .simulate import simulate_save


def _rows(full, ws):
    return [{"m": ShardedTensor.from_rank_offsets("m", c.clone(), (0, r, ws))} for r, c in enumerate(full.chunk(ws))]


def _read(url, target, **knobs):
    meta = Checkpointer().get_metadata(url)
    (lt,), _ = describe_state({"m": target})
    with Reader(open_storage(url), dataclasses.replace(KNOBS, **knobs)) as reader:
        reader.load_tensor(meta.tensors["m"], lt)
        return reader.bytes_read


def test_same_layout_reads_exactly_the_chunk(tmp_path):
    full = torch.randn(64, 1024)
    simulate_save(str(tmp_path), _rows(full, 4))
    target = torch.empty(16, 1024)
    n = _read(str(tmp_path), ShardedTensor.from_rank_offsets("m", target, (0, 1, 4)))
    assert n == 16 * 1024 * 4
    assert torch.equal(target, full[16:32])


def test_resharded_load_reads_only_needed_bytes_without_coalescing(tmp_path):
    full = torch.randn(64, 1024)
    simulate_save(str(tmp_path), _rows(full, 4))
    target = torch.empty(64, 256)  # Shard(1) of 4: a strided quarter of every stored row
    n = _read(str(tmp_path), ShardedTensor.from_rank_offsets("m", target, (1, 2, 4)), coalesce_gap_bytes=0)
    assert n == 64 * 256 * 4
    assert torch.equal(target, full[:, 512:768])
    # with gaps under the threshold, the reader fetches the span instead (fewer, larger reads)
    target2 = torch.empty(64, 256)
    n2 = _read(str(tmp_path), ShardedTensor.from_rank_offsets("m", target2, (1, 2, 4)), coalesce_gap_bytes=4096)
    assert torch.equal(target2, full[:, 512:768])
    assert n2 == 4 * (15 * 1024 + 256) * 4  # per stored chunk: first needed element to last


def test_small_scratch_budget_splits_reads_and_stays_exact(tmp_path):
    full = torch.randn(256, 300)
    simulate_save(str(tmp_path), _rows(full, 2))
    target = torch.empty(300, 256).t()  # non-contiguous target: goes through scratch
    _read(str(tmp_path), target, read_buffer_bytes=1 << 10, io_threads=2)
    assert torch.equal(target, full)
