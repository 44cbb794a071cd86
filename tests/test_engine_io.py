"""The engine's I/O pipelines: write-behind saves, block-parallel in-place loads, early writeback.

Small blocks and buffers make every path run many times on small tensors; the results must be
bit-exact, and every failure (a checksum, a short file, a failing write) must surface once, named.
"""

from __future__ import annotations

import dataclasses
import errno
import os
import re

import pytest
import torch

from shardsafe import Checkpointer, CorruptCheckpointError, ShardedTensor, StorageError
from shardsafe.adapters import describe_state
from shardsafe.engine.reader import Reader
from shardsafe.knobs import KNOBS
from shardsafe.storage import local as local_storage
from shardsafe.storage import open_storage

from .helpers import assert_bits, bits

_KiB = 1 << 10
TINY = dataclasses.replace(KNOBS, write_block_bytes=64 * _KiB, read_block_bytes=64 * _KiB, io_threads=4, writeback_bytes=128 * _KiB)


def _state(n: int = 40) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    out: dict[str, torch.Tensor] = {}
    for i in range(n):
        rows = 1 + (i * 37) % 300
        dtype = (torch.float32, torch.bfloat16, torch.int64, torch.float16)[i % 4]
        out[f"t{i}"] = torch.randn(rows, 129, generator=g).mul(100).to(dtype)
    out["big"] = torch.randn(700, 1000, generator=g)  # 2.7 MB: about 43 blocks of 64 KiB
    return out


@pytest.mark.parametrize("knobs", [TINY, dataclasses.replace(TINY, io_threads=1)], ids=["4-threads", "no-pool"])
def test_many_blocks_round_trip_bit_exact(tmp_path, knobs):
    src = _state()
    d = str(tmp_path / "c")
    Checkpointer(knobs=knobs).save(d, src)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    Checkpointer(knobs=knobs).load(d, dst)
    for k in src:
        assert torch.equal(bits(dst[k]), bits(src[k])), k


def test_in_place_blocks_read_each_byte_once(tmp_path):
    src = torch.randn(256, 1024)  # 1 MiB: 16 blocks of 64 KiB
    d = str(tmp_path / "c")
    Checkpointer().save(d, {"w": src})
    meta = Checkpointer().get_metadata(d)
    target = torch.zeros(256, 1024)
    (lt,), _ = describe_state({"w": target})
    with Reader(open_storage(d), TINY) as reader:
        reader.load_tensor(meta.tensors["w"], lt)
        assert reader.bytes_read == src.numel() * 4
    assert torch.equal(target, src)


def _flip(path: str, at: int) -> None:
    with open(path, "r+b") as f:
        f.seek(at)
        b = f.read(1)
        f.seek(at)
        f.write(bytes([b[0] ^ 0x10]))


def test_damaged_block_in_the_middle_of_a_chunk_is_caught(tmp_path):
    d = str(tmp_path / "c")
    src = _state(10)
    Checkpointer().save(d, src)
    file, spec = next(Checkpointer().get_metadata(d).tensors["big"].chunks())
    _flip(os.path.join(d, file), spec.byte_range[0] + 20 * 64 * _KiB + 5)
    dst = {k: torch.zeros_like(v) for k, v in src.items()}
    with pytest.raises(CorruptCheckpointError, match=rf"^key 'big': checksum mismatch in chunk {re.escape(file)}:"):
        Checkpointer(knobs=TINY).load(d, dst)
    del dst["big"]  # the other tensors still load
    Checkpointer(knobs=TINY).load(d, dst)
    assert all(torch.equal(bits(dst[k]), bits(src[k])) for k in dst)


def test_truncated_file_under_block_reads_names_the_key(tmp_path):
    d = str(tmp_path / "c")
    Checkpointer().save(d, {"big": torch.randn(700, 1000)})
    file, spec = next(Checkpointer().get_metadata(d).tensors["big"].chunks())
    path = os.path.join(d, file)
    os.truncate(path, spec.byte_range[0] + 10 * 64 * _KiB + 3)
    with pytest.raises(CorruptCheckpointError, match=rf"^key 'big': {re.escape(path)}: truncated: needed bytes \["):
        Checkpointer(knobs=TINY).load(d, {"big": torch.zeros(700, 1000)})


def test_resharded_load_through_blocks_and_scratch(tmp_path):
    full = torch.randn(96, 512)
    d = str(tmp_path / "c")
    # saved as 3 row blocks by 3 simulated ranks, loaded as column shards (scratch) and row shards (in place)
    from .simulate import simulate_save

    simulate_save(d, [{"m": ShardedTensor.from_rank_offsets("m", c.clone(), (0, r, 3))} for r, c in enumerate(full.chunk(3))])
    for dim in (0, 1):
        for r in range(2):
            part = torch.zeros(full.chunk(2, dim=dim)[r].shape)
            Checkpointer(knobs=TINY).load(d, {"m": ShardedTensor.from_rank_offsets("m", part, (dim, r, 2))})
            assert torch.equal(part, full.chunk(2, dim=dim)[r])


def test_a_failing_write_surfaces_once_and_leaves_no_file(tmp_path, monkeypatch):
    real = local_storage._FileWriter.write
    calls = []

    def failing(self, data):
        calls.append(data.nbytes)
        if len(calls) == 5:
            raise OSError(errno.ENOSPC, "No space left on device")
        real(self, data)

    monkeypatch.setattr(local_storage._FileWriter, "write", failing)
    d = tmp_path / "c"
    with pytest.raises(StorageError, match=r"write failed: No space left on device"):
        Checkpointer(knobs=TINY).save(str(d), _state(3))
    assert not d.exists() or os.listdir(d) == []


def test_writeback_is_started_over_consecutive_ranges(tmp_path, monkeypatch):
    ranges = []
    monkeypatch.setattr(local_storage, "_sync_file_range", lambda fd, off, n: ranges.append((off, n)))
    d = str(tmp_path / "c")
    Checkpointer(knobs=TINY).save(local_storage.LocalStorage(d, knobs=TINY), {"big": torch.randn(700, 1000)})
    size = os.path.getsize(os.path.join(d, next(iter(Checkpointer().get_metadata(d).data_files()))))
    assert ranges and all(n >= 128 * _KiB for _, n in ranges)
    assert [off for off, _ in ranges] == [0] + [sum(n for _, n in ranges[:i]) for i in range(1, len(ranges))]
    assert sum(n for _, n in ranges) <= size


def test_writeback_off(tmp_path, monkeypatch):
    ranges = []
    monkeypatch.setattr(local_storage, "_sync_file_range", lambda fd, off, n: ranges.append((off, n)))
    off = dataclasses.replace(TINY, writeback_bytes=0)
    Checkpointer(knobs=off).save(local_storage.LocalStorage(str(tmp_path / "c"), knobs=off), {"big": torch.randn(700, 1000)})
    assert ranges == []


def test_coalesced_strided_reads_keep_scratch_within_budget(tmp_path, monkeypatch):
    """Reading half of every row coalesces the gaps: the scratch holds whole source rows, and
    the parts are cut so that they still fit the per-thread budget."""
    from shardsafe.engine import buffers

    from .simulate import simulate_save

    full = torch.randn(2048, 1024)  # 8 MiB; rows of 4 KiB
    d = str(tmp_path / "c")
    simulate_save(d, [{"m": ShardedTensor.from_rank_offsets("m", c.clone(), (0, r, 2))} for r, c in enumerate(full.chunk(2))])
    sizes = []
    real_get = buffers.Scratch.get
    monkeypatch.setattr(buffers.Scratch, "get", lambda self, n: sizes.append(n) or real_get(self, n))
    knobs = dataclasses.replace(KNOBS, read_buffer_bytes=2 << 20, io_threads=2)  # 1 MiB per thread
    part = torch.zeros(2048, 512)
    Checkpointer(knobs=knobs).load(d, {"m": ShardedTensor.from_rank_offsets("m", part, (1, 1, 2))})
    assert torch.equal(part, full[:, 512:])
    assert sizes and max(sizes) <= 1 << 20


def test_byte_view_is_the_tensors_own_bytes_and_keeps_it_alive():
    """byte_view writes through to the tensor with no torch op (each op would give the GIL up
    to the reading threads), keeps the tensor alive, and refuses what is not one run of bytes."""
    import gc

    from shardsafe.engine.buffers import byte_view

    t = torch.arange(12, dtype=torch.float32).view(3, 4)
    mv = byte_view(t[1:2])  # a contiguous slice: bytes 16..32 of the storage
    assert (mv.nbytes, mv.format, mv.readonly) == (16, "B", False)
    mv[:4] = torch.tensor([-1.0]).numpy().tobytes()
    assert t[1, 0].item() == -1.0 and t[0, 3].item() == 3.0 and t[1, 1].item() == 5.0

    odd = torch.zeros(2, 1, 3).as_strided((2, 1, 3), (3, 99, 1))  # a size-1 dim with any stride is still one run
    assert byte_view(odd).nbytes == 24

    held = byte_view(torch.full((1000,), 7, dtype=torch.int64))  # no other reference to the tensor
    gc.collect()
    assert bytes(held[:8]) == (7).to_bytes(8, "little")

    assert byte_view(torch.empty(0)).nbytes == 0
    with pytest.raises(ValueError, match=r"byte_view needs a contiguous CPU tensor, got one on cpu with strides \(1, 4\)"):
        byte_view(t.t())
    conj = torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64).conj()  # contiguous, but its bytes are the unconjugated values
    with pytest.raises(ValueError, match=re.escape("byte_view needs a tensor whose bytes are its values; resolve_conj()")):
        byte_view(conj)
    assert bytes(byte_view(conj.resolve_conj())) == conj.resolve_conj().numpy().tobytes()


def test_is_lazy_view_agrees_with_is_conj_and_is_neg():
    """``is_lazy_view`` reads the dispatch keys (keeping the GIL) where the reader used to call
    ``is_conj()`` / ``is_neg()``: it must answer exactly as they do, views of views included."""
    from shardsafe.engine.buffers import can_read_into, is_lazy_view

    z = torch.tensor([1 + 2j, 3 - 1j, 0.5j], dtype=torch.complex64)
    cases = {
        "float": torch.arange(4.0), "complex": z, "conj": z.conj(), "imag of conj (negative)": z.conj().imag,
        "real of conj": z.conj().real, "neg view": torch._neg_view(torch.arange(4.0)), "slice of conj": z.conj()[1:],
        "resolved conj": z.conj().resolve_conj(), "resolved neg": torch._neg_view(torch.arange(4.0)).resolve_neg(),
        "conj of a real tensor": torch.arange(3.0).conj(), "parameter": torch.nn.Parameter(torch.ones(2)),
    }
    expected = {k: t.is_conj() or t.is_neg() for k, t in cases.items()}
    assert expected == {k: k in ("conj", "imag of conj (negative)", "neg view", "slice of conj") for k in cases}
    assert {k: is_lazy_view(t) for k, t in cases.items()} == expected
    assert {k: can_read_into(t) for k, t in cases.items()} == {k: not v and cases[k].is_contiguous() for k, v in expected.items()}


def test_conjugate_and_negative_views_save_and_load_their_values(tmp_path):
    """A lazy conjugate (or negative) view's memory holds the unconjugated values: the save
    writes the values, and a load into such a view leaves the view reading the stored values."""
    z = torch.tensor([1 + 2j, 3 - 1j, -2 + 0.5j], dtype=torch.complex64)
    state = {"conj": z.conj(), "neg": torch._neg_view(torch.arange(4.0))}
    assert state["conj"].is_conj() and state["neg"].is_neg()
    for mode in ("save", "async_save", "dcp.save through shardsafe's writer"):
        path = str(tmp_path / mode.split()[0])
        if mode == "save":
            Checkpointer().save(path, state)
        elif mode == "async_save":
            Checkpointer().async_save(path, state).wait()
        else:
            import torch.distributed.checkpoint as dcp

            import shardsafe.dcp

            dcp.save(state, storage_writer=shardsafe.dcp.StorageWriter(path), no_dist=True)
        out = Checkpointer().unshard(path)
        assert_bits(out["conj"], z.conj().resolve_conj(), f"{mode}: conj")
        assert_bits(out["neg"], -torch.arange(4.0), f"{mode}: neg")
    target = {"conj": torch.zeros(3, dtype=torch.complex64).conj(), "neg": torch._neg_view(torch.zeros(4))}
    Checkpointer().load(str(tmp_path / "save"), target)
    assert target["conj"].is_conj() and target["neg"].is_neg()
    assert_bits(target["conj"].resolve_conj(), z.conj().resolve_conj(), "loaded into a conjugate view")
    assert_bits(target["neg"].resolve_neg(), -torch.arange(4.0), "loaded into a negative view")
