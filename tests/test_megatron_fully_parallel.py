"""shardsafe.megatron fully parallel wrappers at DP=2 x TP=2 on 4 real gloo ranks.

Each rank loads through a Storage that counts the bytes it reads from the data files: with
``FullyParallelLoadStrategyWrapper`` every stored byte a DP group needs is read once per group
(the group exchanges it with collectives), without it once per replica. Values are bit-exact
against plain-torch ground truth, with both exchange algorithms, at the saved layout and at TP1.
"""

from __future__ import annotations

import dataclasses
import json
import os
import struct
import threading
from typing import Any

import torch
import torch.distributed as dist

from shardsafe.format.file_index import SUMS_ENTRY
from shardsafe.knobs import KNOBS
from shardsafe.megatron import ShardedTensor, load, save
from shardsafe.megatron.strategies import (
    FullyParallelLoadStrategyWrapper,
    FullyParallelSaveStrategyWrapper,
    ShardsafeLoadShardedStrategy,
    ShardsafeSaveShardedStrategy,
)
from shardsafe.storage import open_storage
from tests.distributed import run_ranks

# no coalescing over gaps: a rank reads exactly the bytes of the chunks it needs
_KNOBS = dataclasses.replace(KNOBS, coalesce_gap_bytes=0)


class CountingStorage:
    """A local checkpoint directory that counts the bytes read from its data files' chunks (not
    their headers and checksum entries, which a reader reads once per file it needs)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.inner = open_storage(path)
        self.data_bytes = 0
        self._lock = threading.Lock()
        self._chunks: dict[str, tuple[int, int]] = {}

    def _chunk_span(self, name: str) -> tuple[int, int]:
        """Where the file's chunks are: after the header, before the checksum entry (a file of
        another checkpoint format, such as DCP's .distcp: all of it)."""
        if name in (".metadata", "common.pt"):  # a torch_dist checkpoint's metadata and common state, streamed: not chunks
            return 0, 0
        if not name.endswith(".safetensors"):
            return 0, 1 << 62
        if name not in self._chunks:
            with open(os.path.join(self.path, name), "rb") as f:
                (n,) = struct.unpack("<Q", f.read(8))
                header = json.loads(f.read(n))
            sums = header.get(SUMS_ENTRY, {"data_offsets": [os.path.getsize(os.path.join(self.path, name)) - 8 - n] * 2})
            self._chunks[name] = (8 + n, 8 + n + sums["data_offsets"][0])
        return self._chunks[name]

    def read_into(self, name: str, offset: int, buffers: list) -> None:
        self.inner.read_into(name, offset, buffers)
        start, end = self._chunk_span(name)
        if start <= offset < end:
            with self._lock:
                self.data_bytes += sum(memoryview(b).nbytes for b in buffers)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "col": torch.randn(8, 6, generator=g),  # column-parallel: split along dim 0 by TP
        "row": torch.randn(6, 8, generator=g).bfloat16(),  # row-parallel: split along dim 1 by TP
        "ln": torch.randn(6, generator=g),  # replicated over TP and DP
        "opt.col": torch.randn(8, 6, generator=g),  # distributed optimizer: each DP rank a flattened range of the TP shard
    }


def _state(tp: int, dp: int, truth: dict[str, torch.Tensor] | None) -> dict:
    """The TP2 x DP2 state of rank (tp, dp); zeros to load into when ``truth`` is None."""
    def part(key: str, sl: Any, dtype: torch.dtype, shape: tuple) -> torch.Tensor:
        return truth[key][sl].clone() if truth is not None else torch.zeros(shape, dtype=dtype)

    flat = slice(12 * dp, 12 * dp + 12)
    opt = truth["opt.col"][4 * tp : 4 * tp + 4].flatten()[flat].clone() if truth is not None else torch.zeros(12)
    return {
        "col": ShardedTensor.from_rank_offsets("col", part("col", slice(4 * tp, 4 * tp + 4), torch.float32, (4, 6)), (0, tp, 2), replica_id=dp),
        "row": ShardedTensor.from_rank_offsets(
            "row", part("row", (slice(None), slice(4 * tp, 4 * tp + 4)), torch.bfloat16, (6, 4)), (1, tp, 2), replica_id=dp
        ),
        "ln": ShardedTensor.from_rank_offsets("ln", part("ln", slice(None), torch.float32, (6,)), replica_id=(tp, dp)),
        "opt.col": ShardedTensor.from_rank_offsets_flat("opt.col", opt, (4, 6), (0, tp, 2), flattened_range=flat),
    }


def _fully_parallel(rank: int, world: int, path: str) -> dict:
    tp, dp = rank % 2, rank // 2
    dp_groups = [dist.new_group([t, t + 2]) for t in range(2)]  # every rank creates every group, in order
    truth = _truth()
    save(_state(tp, dp, truth), path, sharded_strategy=FullyParallelSaveStrategyWrapper(ShardsafeSaveShardedStrategy(), dp_groups[tp]))
    out: dict[str, Any] = {}
    for name, strategy in [
        ("plain", ShardsafeLoadShardedStrategy(knobs=_KNOBS)),
        ("broadcast", FullyParallelLoadStrategyWrapper(ShardsafeLoadShardedStrategy(knobs=_KNOBS), dp_groups[tp], do_cache_distribution=True)),
    ]:
        for _ in range(2):  # the second load reuses the cached distribution
            storage = CountingStorage(path)
            got = load(_state(tp, dp, None), storage, sharded_strategy=strategy)
            want = _state(tp, dp, truth)
            exact = all(torch.equal(got[k], want[k].data) for k in want)
            out[name] = (storage.data_bytes, exact)
    # at TP1 every rank wants every whole tensor: read once by the whole job, exchanged by all_gather
    storage = CountingStorage(path)
    whole = {k: ShardedTensor.from_rank_offsets(k, torch.zeros_like(v), replica_id=rank) for k, v in truth.items()}
    got = load(whole, storage, sharded_strategy=FullyParallelLoadStrategyWrapper(ShardsafeLoadShardedStrategy(knobs=_KNOBS), exchange_algo="all_gather"))
    out["tp1"] = (storage.data_bytes, all(torch.equal(got[k], truth[k]) for k in truth))
    return out


def test_fully_parallel_load_reads_each_stored_byte_once_per_group_and_is_bit_exact(tmp_path):
    results = run_ranks(4, _fully_parallel, str(tmp_path / "c"))
    assert all(r[name][1] for r in results for name in ("plain", "broadcast", "tp1"))
    # what one TP rank's DP pair needs: its col and row shards (replicated), ln (replicated), its TP shard of opt.col (one half each)
    per_group = 4 * 6 * 4 + 6 * 4 * 2 + 6 * 4 + 4 * 6 * 4
    for tp in range(2):
        plain = results[tp][ "plain"][0] + results[tp + 2]["plain"][0]
        parallel = results[tp]["broadcast"][0] + results[tp + 2]["broadcast"][0]
        assert parallel == per_group
        assert plain == per_group + 4 * 6 * 4 + 6 * 4 * 2 + 6 * 4  # every replicated byte read twice
    assert sum(r["tp1"][0] for r in results) == 8 * 6 * 4 + 6 * 8 * 2 + 6 * 4 + 8 * 6 * 4  # once for the whole job


def _big_truth() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1)
    return {
        "big": torch.randn(512, 1024, generator=g),  # 2 MiB: broadcast on its own, from and into the tensors
        "big2": torch.randn(1024, 1024, generator=g).bfloat16(),
        "small": torch.randn(6, generator=g),  # shares one buffer with the reader's other small pieces
    }


def _zeros(shape: tuple[int, int], dtype: torch.dtype, contiguous: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype) if contiguous else torch.zeros(shape[::-1], dtype=dtype).t()


def _large_pieces(rank: int, world: int, path: str) -> dict:
    truth = _big_truth()
    save({k: ShardedTensor.from_rank_offsets(k, v.clone(), replica_id=rank) for k, v in truth.items()}, path)
    # rank 0: big (contiguous) and big2 (contiguous); rank 1: big into a transposed view; rank 2: big2 into a
    # transposed view. Each big piece has one rank that does not request it; rank 2 reads and sends big2 from
    # its transposed view.
    wanted = {0: {"big": True, "big2": True}, 1: {"big": False}, 2: {"big2": False}}[rank]
    request = {k: ShardedTensor.from_rank_offsets(k, _zeros(tuple(truth[k].shape), truth[k].dtype, c), replica_id=rank) for k, c in wanted.items()}
    request["small"] = ShardedTensor.from_rank_offsets("small", torch.zeros(6), replica_id=rank)
    storage = CountingStorage(path)
    got = load(request, storage, sharded_strategy=FullyParallelLoadStrategyWrapper(ShardsafeLoadShardedStrategy()))
    return {"keys": sorted(got), "exact": all(torch.equal(got[k], truth[k]) for k in got), "read": storage.data_bytes}


def test_fully_parallel_load_exchanges_large_pieces_into_any_tensor(tmp_path):
    results = run_ranks(3, _large_pieces, str(tmp_path / "c"))
    assert [r["keys"] for r in results] == [["big", "big2", "small"], ["big", "small"], ["big2", "small"]]
    assert all(r["exact"] for r in results)
    assert sum(r["read"] for r in results) == 512 * 1024 * 4 + 1024 * 1024 * 2 + 6 * 4  # each stored byte once


def _save_rows(rank: int, world: int, path: str) -> None:
    save({"a": ShardedTensor.from_rank_offsets("a", torch.full((1, 8), float(rank)), (0, rank, world))}, path)


def _load_rows(rank: int, world: int, path: str) -> tuple[str, str]:
    from shardsafe.errors import CorruptCheckpointError

    try:
        load({"a": ShardedTensor.from_rank_offsets("a", torch.zeros(1, 8), (0, rank, world))}, path)
    except CorruptCheckpointError as e:
        return type(e).__name__, str(e)
    return "loaded", ""


def test_a_damaged_chunk_one_rank_reads_raises_on_every_rank(tmp_path):
    from shardsafe import Checkpointer

    path = str(tmp_path / "c")
    run_ranks(2, _save_rows, path)
    meta = Checkpointer().get_metadata(path, no_dist=True)
    ((file, spec),) = [(f, s) for f, s in meta.tensors["a"].chunks() if s.global_offset == (1, 0)]
    with open(os.path.join(path, file), "r+b") as f:  # one byte of rank 1's row
        f.seek(spec.byte_range[0])
        byte = f.read(1)
        f.seek(spec.byte_range[0])
        f.write(bytes([byte[0] ^ 0xFF]))
    results = run_ranks(2, _load_rows, path)
    assert [r[0] for r in results] == ["CorruptCheckpointError", "CorruptCheckpointError"]
    assert all("key 'a'" in r[1] and file in r[1] for r in results), results
