"""The reader moves only the checksum blocks a target needs, with bounded scratch, into any target view."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from shardsafe import Checkpointer, ShardedTensor
from shardsafe.adapters import describe_state
from shardsafe.engine.reader import Reader
from shardsafe.errors import CorruptCheckpointError
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


def test_strided_load_reads_the_blocks_it_touches(tmp_path):
    full = torch.randn(64, 1024)
    # 16 KiB checksum blocks: 4 rows of 4 KiB each
    simulate_save(str(tmp_path), _rows(full, 4), knobs=dataclasses.replace(KNOBS, checksum_block_bytes=16 << 10))
    target = torch.empty(64, 256)  # Shard(1) of 4: a strided quarter of every stored row
    n = _read(str(tmp_path), ShardedTensor.from_rank_offsets("m", target, (1, 2, 4)), coalesce_gap_bytes=0)
    assert torch.equal(target, full[:, 512:768])
    # a quarter of every row touches every block: every byte is read (and checked), even with no coalescing
    assert n == 64 * 1024 * 4


def test_partial_chunk_reads_whole_blocks_at_both_ends(tmp_path):
    full = torch.randn(64, 1024)
    simulate_save(str(tmp_path), _rows(full, 2), knobs=dataclasses.replace(KNOBS, checksum_block_bytes=16 << 10))
    target = torch.empty(12, 1024)  # rows [18, 30): blocks of rows [16, 20) ... [28, 32)
    n = _read(str(tmp_path), _rows_at(target, 18, 64), read_block_bytes=1 << 16)
    assert torch.equal(target, full[18:30])
    assert n == 16 * 1024 * 4  # rows [16, 32): the partial end blocks and the whole ones between


def _rows_at(target, start, total):
    return ShardedTensor(
        key="m", data=target, local_shape=tuple(target.shape), global_shape=(total, target.shape[1]), global_offset=(start, 0),
    )


def test_small_scratch_budget_splits_reads_and_stays_exact(tmp_path):
    full = torch.randn(256, 300)
    simulate_save(str(tmp_path), _rows(full, 2))
    target = torch.empty(300, 256).t()  # non-contiguous target: goes through scratch
    _read(str(tmp_path), target, read_buffer_bytes=1 << 10, io_threads=2)
    assert torch.equal(target, full)


def _load_in_child(path: str, want: torch.Tensor, out) -> None:
    got = {"w": torch.zeros_like(want)}
    Checkpointer().load(path, got, no_dist=True)
    out.put(bool(torch.equal(got["w"], want)))


def test_loads_share_their_threads_and_a_forked_child_starts_its_own(tmp_path):
    import multiprocessing as mp
    import threading

    from shardsafe.engine import reader

    if reader.reader_threads(open_storage(str(tmp_path)), KNOBS) < 2:
        pytest.skip("one CPU: local reads run on the loading thread, there is no pool to share")
    # large enough to be read by the pool: a read of at most _INLINE_BYTES runs on the loading
    # thread, and a process whose first load read only those would have no reader threads at all;
    # float64, so that it is fewer elements than torch's grain for parallel ops (32768): an op
    # that fans out to the intra-op pool in a forked child hangs (torch's pool does not survive
    # a fork either), and the child below fills and compares one
    want = torch.arange(16384.0, dtype=torch.float64).reshape(128, 128)
    assert want.numel() * want.element_size() > reader._INLINE_BYTES and want.numel() < 32768
    Checkpointer().save(tmp_path / "c", {"w": want})

    def readers() -> set[int]:
        return {t.ident for t in threading.enumerate() if t.name.startswith("shardsafe-read")}

    for _ in range(3):
        got = {"w": torch.zeros(128, 128, dtype=torch.float64)[:, :128]}
        Checkpointer().load(tmp_path / "c", got, no_dist=True)
        assert torch.equal(got["w"], want)
        if _ == 0:
            first = readers()
    assert first and readers() == first  # the same threads served every load

    # a child forked after the threads started gets threads of its own (none survive a fork): no hang
    ctx = mp.get_context("fork")
    out = ctx.Queue()
    child = ctx.Process(target=_load_in_child, args=(str(tmp_path / "c"), want, out))
    child.start()
    child.join(60)
    assert child.exitcode == 0 and out.get(timeout=5) is True


def test_reader_threads_from_local_storage_are_this_ranks_share_of_the_cpus(tmp_path, monkeypatch):
    """Reads from local storage are CPU work: no more threads than the CPUs this process may run
    on, over the ranks on this machine (``LOCAL_WORLD_SIZE``, as torchrun sets it); reads from
    an object store wait on the network and keep ``io_threads``."""
    from shardsafe.engine.reader import reader_threads

    cpus = len(os.sched_getaffinity(0))
    local = open_storage(str(tmp_path))
    knobs = dataclasses.replace(KNOBS, io_threads=64)
    for ranks_here, expected in ((None, min(64, cpus)), (1, min(64, cpus)), (cpus, 1), (4 * cpus, 1)):
        if ranks_here is None:
            monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
        else:
            monkeypatch.setenv("LOCAL_WORLD_SIZE", str(ranks_here))
        assert reader_threads(local, knobs) == expected, ranks_here
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert reader_threads(local, dataclasses.replace(KNOBS, io_threads=1)) == 1
    assert reader_threads(open_storage("memory://threads"), knobs) == 64


def test_in_place_reads_from_local_storage_check_each_step_as_it_is_read(tmp_path):
    """From local storage an in-place read goes in steps of whole blocks near 1 MiB, each checked
    right after its read (still in the cache); a damaged block is named by its number either way."""
    full = torch.randn(3 << 18)  # 3 MiB, one chunk
    block = 48 << 10  # 1 MiB is not a multiple: a step is the 21 whole blocks below it
    simulate_save(str(tmp_path), [{"m": full.clone()}], knobs=dataclasses.replace(KNOBS, checksum_block_bytes=block))
    meta = Checkpointer().get_metadata(str(tmp_path))
    ((file, spec),) = list(meta.tensors["m"].chunks())
    storage = open_storage(str(tmp_path))
    reads: list[tuple[int, int]] = []
    plain = storage.read_into

    def counted(name, offset, buffers):
        reads.append((offset - spec.byte_range[0], sum(memoryview(b).nbytes for b in buffers)))
        plain(name, offset, buffers)

    storage.read_into = counted
    target = torch.empty_like(full)
    (lt,), _ = describe_state({"m": target})
    with Reader(storage, KNOBS, num_threads=1) as reader:
        reader.load_tensor(meta.tensors["m"], lt)
    assert torch.equal(target, full)
    step = 21 * block
    assert reads == [(0, step), (step, step), (2 * step, step), (3 * step, (3 << 20) - 3 * step)]

    path = os.path.join(str(tmp_path), file)
    with open(path, "r+b") as f:  # one byte of block 40, in the second step
        f.seek(spec.byte_range[0] + 40 * block + 5)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x10]))
    with pytest.raises(CorruptCheckpointError, match=r"checksum mismatch in chunk .* bytes \[1966080, 2015232\) of the chunk \(block 40\)"):
        Checkpointer().load(str(tmp_path), {"m": torch.empty_like(full)}, no_dist=True)


@pytest.mark.parametrize(("rows", "cols", "block"), [(512, 1024, 1 << 20), (600, 1000, 48 << 10), (37, 9000, 16 << 10)])
def test_strided_box_is_copied_out_step_by_step_and_exact(tmp_path, rows, cols, block):
    """A strided box read through scratch goes to the target row by row as each step of about
    1 MiB is checked; rows that straddle two steps, and steps that end inside a row, come out whole."""
    full = torch.randn(rows, cols)
    simulate_save(str(tmp_path), [{"m": full.clone()}], knobs=dataclasses.replace(KNOBS, checksum_block_bytes=block))
    for part in range(3):  # Shard(1) of 3: a strided third of every stored row
        target = torch.empty(rows, cols // 3)
        _read(str(tmp_path), ShardedTensor.from_rank_offsets("m", target, (1, part, 3)))
        width = cols // 3
        assert torch.equal(target, full[:, part * width : (part + 1) * width])


def test_strided_box_from_a_damaged_step_is_refused(tmp_path):
    full = torch.randn(600, 1000)
    block = 48 << 10
    simulate_save(str(tmp_path), [{"m": full.clone()}], knobs=dataclasses.replace(KNOBS, checksum_block_bytes=block))
    meta = Checkpointer().get_metadata(str(tmp_path))
    ((file, spec),) = list(meta.tensors["m"].chunks())
    with open(os.path.join(str(tmp_path), file), "r+b") as f:  # block 30: in the second step
        f.seek(spec.byte_range[0] + 30 * block + 7)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    target = torch.empty(600, 500)
    with pytest.raises(CorruptCheckpointError, match=r"bytes \[1474560, 1523712\) of the chunk \(block 30\)"):
        _read(str(tmp_path), ShardedTensor.from_rank_offsets("m", target, (1, 1, 2)))


def test_a_load_leaves_the_collector_as_it_found_it(tmp_path):
    """Loads pause the cyclic collector while they describe and plan (thousands of small objects);
    afterwards it is enabled again, after a failed load too, and a collector the caller had
    disabled stays disabled."""
    import gc

    want = {f"t{i}": torch.full((4,), float(i)) for i in range(50)}
    Checkpointer().save(tmp_path / "c", want)
    got = {k: torch.zeros(4) for k in want}
    assert gc.isenabled()
    Checkpointer().load(tmp_path / "c", got, no_dist=True)
    assert gc.isenabled() and all(torch.equal(got[k], v) for k, v in want.items())

    ((file, spec),) = list(Checkpointer().get_metadata(str(tmp_path / "c")).tensors["t7"].chunks())
    with open(tmp_path / "c" / file, "r+b") as f:
        f.seek(spec.byte_range[0] + 1)
        b = f.read(1)
        f.seek(-1, os.SEEK_CUR)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(CorruptCheckpointError, match="key 't7'"):
        Checkpointer().load(tmp_path / "c", {k: torch.zeros(4) for k in want}, no_dist=True)
    assert gc.isenabled()

    gc.disable()
    try:
        with pytest.raises(CorruptCheckpointError, match="key 't7'"):
            Checkpointer().load(tmp_path / "c", {k: torch.zeros(4) for k in want}, no_dist=True)
        assert not gc.isenabled()
    finally:
        gc.enable()
