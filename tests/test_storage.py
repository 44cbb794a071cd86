"""Storage backends (local directory, ``memory://``, S3, GCS, Azure) behind ``shardsafe.storage.open_storage``.

The object stores are real servers on 127.0.0.1 (``tests/servers.py``): every backend passes the
same contract."""

from __future__ import annotations

import os
import re
import uuid
from pathlib import Path

import pytest
import torch

from shardsafe import Checkpointer, CorruptCheckpointError, StorageError, verify
from shardsafe.storage import open_storage
from shardsafe.storage.local import LocalStorage
from shardsafe.storage.memory import MemoryStorage

from . import servers
from .racing import race_puts

PAYLOAD = bytes(range(256)) * 4  # 1024 bytes, every position distinct within 256


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().reshape(-1).view(torch.uint8)


@pytest.fixture(params=["local", "memory", *servers.CLOUDS])
def storage(request, tmp_path: Path):
    if request.param == "local":
        s = open_storage(str(tmp_path / "root"))
    elif request.param == "memory":
        s = open_storage(f"memory://storage-test-{uuid.uuid4().hex}")
    else:
        cloud = servers.cloud(request.param)
        s = open_storage(cloud.url(), **cloud.options)
    yield s
    s.close()


def _write(storage, name: str, *parts: bytes) -> None:
    with storage.write_file(name) as w:
        for p in parts:
            w.write(memoryview(p))


def _on_disk(storage) -> list[str] | None:
    """Everything in a local root (dot files and folders included); None for other backends."""
    if isinstance(storage, LocalStorage):
        return sorted(os.listdir(storage.root)) if os.path.isdir(storage.root) else []
    return None


# --- choosing a backend ----------------------------------------------------------------------


def test_open_storage_picks_backend_by_url(tmp_path: Path) -> None:
    plain = open_storage(str(tmp_path / "a"))
    assert isinstance(plain, LocalStorage) and plain.root == str(tmp_path / "a")
    as_path = open_storage(tmp_path / "b")
    assert isinstance(as_path, LocalStorage) and as_path.root == str(tmp_path / "b")
    file_url = open_storage(f"file://{tmp_path}/c")
    assert isinstance(file_url, LocalStorage) and file_url.root == str(tmp_path / "c")
    upper = open_storage(f"FILE://{tmp_path}/d")
    assert isinstance(upper, LocalStorage) and upper.root == str(tmp_path / "d")
    mem = open_storage("memory://somewhere")
    assert isinstance(mem, MemoryStorage) and mem.url == "memory://somewhere"


def test_relative_local_path_is_made_absolute(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    s = open_storage("rel/ckpt")
    assert isinstance(s, LocalStorage)
    assert s.root == str(tmp_path / "rel" / "ckpt")


@pytest.mark.parametrize("url", ["http://host/ckpt", "hdfs://nn/x", "ftp://h/p"])
def test_unknown_scheme_is_a_storage_error(url: str) -> None:
    scheme = url.split("://")[0]
    with pytest.raises(StorageError, match=rf"(?s){url}.*scheme '{scheme}'") as info:
        open_storage(url)
    assert isinstance(info.value, OSError)


def test_memory_stores_are_shared_by_url() -> None:
    url = f"memory://shared-{uuid.uuid4().hex}"
    a, b, c = open_storage(url), open_storage(url + "/"), open_storage(url + "-other")
    a.put_atomic("x.json", b"hello", overwrite=False)
    assert b.read("x.json") == b"hello"
    assert b.list() == ["x.json"]
    assert c.list() == []
    with pytest.raises(FileNotFoundError):
        c.read("x.json")


# --- names -----------------------------------------------------------------------------------

BAD_NAMES = ["a/b", "../x", "..", ".", "/etc/passwd", ".hidden", ".tmp-123", "", "a\\b", "sub/../x"]


def _operations(storage, name: str):
    def write_file() -> None:
        _write(storage, name, b"data")

    return {
        "write_file": write_file,
        "put_atomic": lambda: storage.put_atomic(name, b"data", overwrite=True),
        "put_atomic-no-overwrite": lambda: storage.put_atomic(name, b"data", overwrite=False),
        "read_into": lambda: storage.read_into(name, 0, [memoryview(bytearray(1))]),
        "read": lambda: storage.read(name),
        "delete": lambda: storage.delete(name),
    }


@pytest.mark.parametrize("op", list(_operations(None, "x")))
@pytest.mark.parametrize("name", BAD_NAMES)
def test_names_outside_the_root_are_refused(storage, tmp_path: Path, name: str, op: str) -> None:
    _write(storage, "keep.bin", b"keep")
    (tmp_path / "x").write_bytes(b"outside")  # what "../x" would reach from a local root

    with pytest.raises(StorageError, match=rf"refusing file name {re.escape(repr(name))}"):
        _operations(storage, name)[op]()

    assert (tmp_path / "x").read_bytes() == b"outside"
    assert storage.list() == ["keep.bin"]
    assert storage.read("keep.bin") == b"keep"
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == ["keep.bin"]
        assert sorted(os.listdir(tmp_path)) == ["root", "x"]


# --- put_atomic ------------------------------------------------------------------------------


def test_put_atomic_creates_and_overwrites(storage) -> None:
    storage.put_atomic("m.json", b"first", overwrite=False)
    assert storage.read("m.json") == b"first"
    storage.put_atomic("m.json", b"second, longer", overwrite=True)
    assert storage.read("m.json") == b"second, longer"
    storage.put_atomic("m.json", b"3", overwrite=True)
    assert storage.read("m.json") == b"3"
    assert storage.list() == ["m.json"]
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == ["m.json"]


def test_put_atomic_without_overwrite_refuses_an_existing_file(storage) -> None:
    storage.put_atomic("m.json", b"old contents", overwrite=False)
    with pytest.raises(FileExistsError):
        storage.put_atomic("m.json", b"new", overwrite=False)
    assert storage.read("m.json") == b"old contents"
    assert storage.list() == ["m.json"]
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == ["m.json"]


def test_put_atomic_without_overwrite_refuses_a_streamed_file(storage) -> None:
    _write(storage, "d.bin", b"streamed")
    with pytest.raises(FileExistsError):
        storage.put_atomic("d.bin", b"new", overwrite=False)
    assert storage.read("d.bin") == b"streamed"


def test_put_atomic_leaves_no_temp_files(storage) -> None:
    for i in range(5):
        storage.put_atomic(f"f{i}.json", b"x" * i, overwrite=False)
        storage.put_atomic(f"f{i}.json", b"y" * (i + 1), overwrite=True)
        with pytest.raises(FileExistsError):
            storage.put_atomic(f"f{i}.json", b"z", overwrite=False)
    names = [f"f{i}.json" for i in range(5)]
    assert storage.list() == names
    assert [storage.read(n) for n in names] == [b"y" * (i + 1) for i in range(5)]
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == names


def test_local_put_atomic_failure_leaves_no_temp_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    storage = open_storage(str(tmp_path / "root"))
    storage.put_atomic("m.json", b"old", overwrite=True)

    def broken_replace(src, dst):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "replace", broken_replace)
    with pytest.raises(StorageError, match=r"(?s)m\.json.*No space left on device"):
        storage.put_atomic("m.json", b"new", overwrite=True)
    monkeypatch.undo()
    assert storage.read("m.json") == b"old"
    assert sorted(os.listdir(tmp_path / "root")) == ["m.json"]


# --- put_atomic(if_match=): the compare-and-swap of a commit ------------------------------------


def test_put_atomic_if_match_replaces_only_the_version_it_read(storage) -> None:
    storage.put_atomic("m.json", b"first", overwrite=False)
    data, v1 = storage.read_versioned("m.json")
    assert data == b"first"
    storage.put_atomic("m.json", b"second", overwrite=True, if_match=v1)
    data, v2 = storage.read_versioned("m.json")
    assert data == b"second" and v2 != v1

    with pytest.raises(FileExistsError):  # v1 was replaced: a writer that read it must not commit
        storage.put_atomic("m.json", b"stale", overwrite=True, if_match=v1)
    assert storage.read_versioned("m.json") == (b"second", v2)

    storage.delete("m.json")
    with pytest.raises(FileExistsError):  # removed: nothing is created in its place
        storage.put_atomic("m.json", b"stale", overwrite=True, if_match=v2)
    with pytest.raises(FileNotFoundError):
        storage.read_versioned("m.json")
    assert storage.list() == []
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == []


def test_concurrent_conditional_replacements_one_wins(storage) -> None:
    storage.put_atomic("m.json", b"start", overwrite=False)
    _, seen = storage.read_versioned("m.json")
    race_puts(storage, "m.json", overwrite=True, if_match=seen)
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == ["m.json"]


def test_local_versions_differ_for_the_same_bytes_written_again(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    storage.put_atomic("m.json", b"same", overwrite=False)
    _, v1 = storage.read_versioned("m.json")
    storage.put_atomic("m.json", b"same", overwrite=True, if_match=v1)
    _, v2 = storage.read_versioned("m.json")
    assert v2 != v1
    with pytest.raises(FileExistsError):
        storage.put_atomic("m.json", b"same", overwrite=True, if_match=v1)


# --- local files are never symbolic links ---------------------------------------------------


def _plant_link(root: Path, name: str, target: Path) -> None:
    root.mkdir(parents=True, exist_ok=True)
    os.symlink(target, root / name)


def test_local_reads_refuse_a_symlinked_file(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(PAYLOAD)
    _plant_link(tmp_path / "root", "d.bin", outside)
    storage = open_storage(str(tmp_path / "root"))
    symlink = rf"{re.escape(str(tmp_path / 'root' / 'd.bin'))}: is a symbolic link"
    with pytest.raises(CorruptCheckpointError, match=symlink):
        storage.read_into("d.bin", 0, [memoryview(bytearray(4))])
    with pytest.raises(CorruptCheckpointError, match=symlink):
        storage.read("d.bin")
    with pytest.raises(CorruptCheckpointError, match=symlink):
        storage.read_versioned("d.bin")


def test_local_writes_never_go_through_a_planted_link(tmp_path: Path) -> None:
    outside = tmp_path / "outside.bin"
    outside.write_bytes(b"precious")
    root = tmp_path / "root"
    for name in ("d.bin", "m.json", "n.json", "c.json"):
        _plant_link(root, name, outside)
    storage = open_storage(str(root))

    _write(storage, "d.bin", b"data")  # the link is replaced by the new file
    storage.put_atomic("m.json", b"meta", overwrite=True)
    with pytest.raises(FileExistsError):
        storage.put_atomic("n.json", b"meta", overwrite=False)
    with pytest.raises(FileExistsError):  # a link is never the version a writer read
        storage.put_atomic("c.json", b"meta", overwrite=True, if_match="0:0:0:0")

    assert outside.read_bytes() == b"precious"
    assert not (root / "d.bin").is_symlink() and (root / "d.bin").read_bytes() == b"data"
    assert not (root / "m.json").is_symlink() and (root / "m.json").read_bytes() == b"meta"
    assert (root / "n.json").is_symlink() and (root / "c.json").is_symlink()
    assert sorted(os.listdir(root)) == ["c.json", "d.bin", "m.json", "n.json"]


@pytest.mark.parametrize("linked", ["metadata.json", "data file"])
def test_a_checkpoint_file_that_is_a_symlink_is_refused(tmp_path: Path, linked: str) -> None:
    """A copy of the file, identical byte for byte, outside the checkpoint and linked to: the
    checkpoint would load, through the link, if links were followed."""
    d = tmp_path / "ckpt"
    src = {"w": torch.randn(5, 3)}
    meta, _ = Checkpointer().save(d, src)
    name = "metadata.json" if linked == "metadata.json" else next(iter(meta.data_files()))
    outside = tmp_path / "elsewhere" / name
    outside.parent.mkdir()
    os.replace(d / name, outside)
    os.symlink(outside, d / name)
    symlink = rf"{re.escape(str(d / name))}: is a symbolic link"
    with pytest.raises(CorruptCheckpointError, match=symlink):
        Checkpointer().load(d, {"w": torch.zeros(5, 3)})
    with pytest.raises(CorruptCheckpointError, match=symlink):
        if linked == "metadata.json":  # a save does not replace it either
            Checkpointer().save(d, {"w": torch.ones(5, 3)}, save_overwrite=True)
        else:
            verify(d)
    assert (d / name).is_symlink() and outside.exists()


def test_a_checkpoint_folder_that_is_a_symlink_is_fine(tmp_path: Path) -> None:
    (tmp_path / "real").mkdir()
    os.symlink(tmp_path / "real", tmp_path / "link")
    src = {"w": torch.randn(5, 3)}
    Checkpointer().save(tmp_path / "link", src)
    Checkpointer().save(tmp_path / "link", src, save_overwrite=True)
    out = Checkpointer().unshard(tmp_path / "link")
    assert torch.equal(_bytes(out["w"]), _bytes(src["w"]))


# --- write_file ------------------------------------------------------------------------------


def test_write_file_streams_parts_in_order(storage) -> None:
    parts = [PAYLOAD[:1], PAYLOAD[1:300], b"", PAYLOAD[300:]]
    _write(storage, "d.bin", *parts)
    assert storage.read("d.bin") == PAYLOAD
    assert storage.list() == ["d.bin"]


def test_write_file_accepts_tensor_memory(storage) -> None:
    t = torch.arange(10, dtype=torch.float64)
    with storage.write_file("t.bin") as w:
        w.write(memoryview(t.numpy()))
    got = torch.frombuffer(bytearray(storage.read("t.bin")), dtype=torch.float64)
    assert torch.equal(_bytes(got), _bytes(t))


def test_write_file_removes_the_partial_file_when_the_body_raises(storage) -> None:
    _write(storage, "other.bin", b"untouched")
    with pytest.raises(RuntimeError, match="boom"):
        with storage.write_file("d.bin") as w:
            w.write(memoryview(PAYLOAD))
            raise RuntimeError("boom")
    assert storage.list() == ["other.bin"]
    with pytest.raises(FileNotFoundError):
        storage.read("d.bin")
    with pytest.raises(CorruptCheckpointError, match="missing"):
        storage.read_into("d.bin", 0, [memoryview(bytearray(1))])
    assert storage.read("other.bin") == b"untouched"
    if _on_disk(storage) is not None:
        assert _on_disk(storage) == ["other.bin"]


def test_local_write_file_io_error_is_a_storage_error_and_removes_the_file(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    with pytest.raises(StorageError, match=r"(?s)d\.bin.*write failed"):
        with storage.write_file("d.bin") as w:
            w.write(memoryview(b"abc"))
            raise OSError(5, "Input/output error")
    assert os.listdir(tmp_path / "root") == []


def test_write_file_creates_the_root(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "c"
    storage = open_storage(str(root))
    assert storage.list() == []
    _write(storage, "d.bin", b"abc")
    assert (root / "d.bin").read_bytes() == b"abc"


# --- read_into -------------------------------------------------------------------------------


def test_read_with_a_limit_returns_a_file_up_to_it_and_refuses_a_larger_one_by_its_size(storage) -> None:
    _write(storage, "m.json", PAYLOAD)
    assert storage.read("m.json", limit=len(PAYLOAD)) == PAYLOAD
    assert storage.read("m.json", limit=None) == PAYLOAD
    with pytest.raises(CorruptCheckpointError) as e:
        storage.read("m.json", limit=len(PAYLOAD) - 1)
    where = f"{storage.url.rstrip('/')}/m.json" if not isinstance(storage, LocalStorage) else os.path.join(storage.root, "m.json")
    assert str(e.value) == f"{where}: holds 1024 bytes, more than the 1023 such a file may hold; refusing to read it"
    with pytest.raises(FileNotFoundError):
        storage.read("absent.json", limit=10)


def test_a_local_file_grown_sparse_to_a_terabyte_is_refused_without_reading_it(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path))
    with open(tmp_path / "metadata.json", "wb") as f:
        f.truncate(1 << 40)  # costs nothing to make; reading it whole would need a terabyte
    with pytest.raises(CorruptCheckpointError, match=r"metadata.json: holds 1099511627776 bytes, more than the 1073741824 "):
        storage.read("metadata.json", limit=1 << 30)
    with pytest.raises(CorruptCheckpointError, match=r"holds 1099511627776 bytes"):
        Checkpointer().unshard(str(tmp_path))  # the metadata reader of every load reads with that limit


def test_held_files_read_with_a_limit_as_every_storage_and_fall_through_to_their_base(tmp_path: Path) -> None:
    from shardsafe.storage import HeldFiles

    base = open_storage(str(tmp_path))
    _write(base, "on-disk.json", PAYLOAD)
    held = HeldFiles("memtier:test", base)
    held.add("received.json", bytearray(PAYLOAD[:100]))
    assert held.read("received.json", limit=100) == PAYLOAD[:100]
    with pytest.raises(CorruptCheckpointError, match=r"^memtier:test/received.json: holds 100 bytes, more than the 99 "):
        held.read("received.json", limit=99)
    assert held.read("on-disk.json", limit=1024) == PAYLOAD
    with pytest.raises(CorruptCheckpointError, match=r"on-disk.json: holds 1024 bytes, more than the 1000 "):
        held.read("on-disk.json", limit=1000)


def test_read_into_fills_several_buffers_in_order(storage) -> None:
    _write(storage, "d.bin", PAYLOAD)
    sizes = [3, 0, 100, 1, 250, 7]
    bufs = [bytearray(n) for n in sizes]
    storage.read_into("d.bin", 10, [memoryview(b) for b in bufs])
    pos = 10
    for n, b in zip(sizes, bufs):
        assert bytes(b) == PAYLOAD[pos : pos + n]
        pos += n


def test_read_into_exact_end_of_file(storage) -> None:
    _write(storage, "d.bin", PAYLOAD)
    buf = bytearray(24)
    storage.read_into("d.bin", len(PAYLOAD) - 24, [memoryview(buf)])
    assert bytes(buf) == PAYLOAD[-24:]


@pytest.mark.parametrize("offset", [0, 500, 1024])
@pytest.mark.parametrize("n_buffers", [1, 3])
def test_read_into_zero_bytes_inside_the_file_is_a_no_op(storage, offset: int, n_buffers: int) -> None:
    _write(storage, "d.bin", PAYLOAD)
    storage.read_into("d.bin", offset, [memoryview(bytearray(0)) for _ in range(n_buffers)])


def test_read_into_many_small_buffers(storage) -> None:
    """More buffers than one ``preadv`` call takes (IOV_MAX is 1024 on Linux)."""
    _write(storage, "d.bin", PAYLOAD * 3)
    bufs = [bytearray(1) for _ in range(3000)]
    storage.read_into("d.bin", 5, [memoryview(b) for b in bufs])
    assert b"".join(bufs) == (PAYLOAD * 3)[5:3005]


def test_read_into_tensor_memory(storage) -> None:
    src = torch.randn(4, 6)
    _write(storage, "t.bin", b"12345678", src.numpy().tobytes())
    dst = torch.zeros(4, 6)
    storage.read_into("t.bin", 8, [memoryview(dst.numpy()).cast("B")])
    assert torch.equal(_bytes(dst), _bytes(src))


@pytest.mark.parametrize(
    "offset, sizes",
    [(1000, [25]), (1024, [1]), (5000, [4]), (0, [1000, 100]), (1020, [4, 1])],
    ids=["crosses-end", "at-end", "far-past-end", "second-buffer-crosses", "second-buffer-past"],
)
def test_read_into_past_the_end_is_reported_as_truncated(storage, offset: int, sizes: list[int]) -> None:
    _write(storage, "d.bin", PAYLOAD)
    with pytest.raises(CorruptCheckpointError, match=r"(?s)d\.bin.*truncated.*1024 bytes"):
        storage.read_into("d.bin", offset, [memoryview(bytearray(n)) for n in sizes])


def test_read_into_missing_file_is_corrupt(storage) -> None:
    with pytest.raises(CorruptCheckpointError, match=r"(?s)gone\.safetensors.*missing"):
        storage.read_into("gone.safetensors", 0, [memoryview(bytearray(4))])


def test_read_into_after_close_reopens(storage) -> None:
    _write(storage, "d.bin", PAYLOAD)
    a = bytearray(4)
    storage.read_into("d.bin", 0, [memoryview(a)])
    storage.close()
    b = bytearray(4)
    storage.read_into("d.bin", 4, [memoryview(b)])
    assert bytes(a + b) == PAYLOAD[:8]


# --- read, list, delete ----------------------------------------------------------------------


def test_read_missing_file_is_file_not_found(storage) -> None:
    with pytest.raises(FileNotFoundError):
        storage.read("metadata.json")


def test_list_and_delete(storage) -> None:
    assert storage.list() == []
    _write(storage, "b.bin", b"b")
    storage.put_atomic("a.json", b"a", overwrite=False)
    assert storage.list() == ["a.json", "b.bin"]
    storage.delete("b.bin")
    storage.delete("b.bin")  # a missing file is not an error
    storage.delete("never-was.bin")
    assert storage.list() == ["a.json"]
    assert storage.read("a.json") == b"a"


def test_local_list_skips_folders_and_missing_root(tmp_path: Path) -> None:
    storage = open_storage(str(tmp_path / "root"))
    assert storage.list() == []
    (tmp_path / "root" / "sub").mkdir(parents=True)
    (tmp_path / "root" / "f.bin").write_bytes(b"f")
    assert storage.list() == ["f.bin"]


def test_local_root_that_is_a_file_is_a_storage_error(tmp_path: Path) -> None:
    (tmp_path / "plain").write_bytes(b"not a folder")
    with pytest.raises(StorageError, match="not a directory"):
        open_storage(str(tmp_path / "plain")).list()


# --- whole checkpoints through URLs ----------------------------------------------------------


def test_checkpoint_through_file_url(tmp_path: Path) -> None:
    src = {"w": torch.randn(5, 3), "step": 11}
    url = f"file://{tmp_path}/ckpt"
    meta, files = Checkpointer().save(url, src)
    (data_file,) = meta.data_files()
    assert sorted(os.listdir(tmp_path / "ckpt")) == sorted(["metadata.json", data_file])
    assert files == [f"{tmp_path}/ckpt/{data_file}"]
    for where in (url, str(tmp_path / "ckpt"), tmp_path / "ckpt"):
        target = {"w": torch.zeros(5, 3), "step": None}
        Checkpointer().load(where, target)
        assert torch.equal(_bytes(target["w"]), _bytes(src["w"]))
        assert target["step"] == 11


def test_checkpoint_through_memory_url(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    url = f"memory://ckpt-{uuid.uuid4().hex}"
    src = {"w": torch.randn(5, 3), "b": torch.arange(4, dtype=torch.int32)}
    meta, _ = Checkpointer().save(url, src)
    assert open_storage(url).list() == sorted(["metadata.json", *meta.data_files()])
    out = Checkpointer().unshard(url)
    assert set(out) == {"w", "b"}
    for k in src:
        assert torch.equal(_bytes(out[k]), _bytes(src[k]))
    assert os.listdir(tmp_path) == []  # nothing written to disk
