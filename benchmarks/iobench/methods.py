"""Every way the benchmark saves, loads and unshards a state: shardsafe, its peers, and the limit.

Each method is a function of ``(state, path)`` that every rank calls together. Saves are durable
for every method (files fsynced before the function returns: the peers that do not do it
themselves get an explicit ``fsync``). Loads fill the given state in place: peers that return
new tensors (``torch.load``, ``safetensors``) copy into it, as ``load_state_dict`` would.

The limit methods move the same bytes with nothing else: ``raw`` writes each rank's tensor bytes
back to back into one file and fsyncs it (``raw-mt``: with 4 threads at distinct offsets;
``raw-wb``: starting writeback every 16 MiB with ``sync_file_range``, as shardsafe does);
``preadv`` reads them back into the already-allocated tensors (``preadv-mt``: 4 threads);
``raw-copy`` copies the raw files into one (with writeback).
"""

from __future__ import annotations

import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch
import torch.distributed as dist

import shardsafe

# `import shardsafe` is lazy: load the save and load paths (pydantic & co., ~13 MiB) here, not
# inside the first timed call
import shardsafe.engine.loader  # noqa: F401
import shardsafe.engine.writer  # noqa: F401
from shardsafe.engine.buffers import byte_view
from shardsafe.storage.local import _sync_file_range as sync_file_range

from .states import locals_of

_BLOCK = 16 << 20
_THREADS = 4

SaveFn = Callable[[dict, str], None]
LoadFn = Callable[[dict, str], None]


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _fsync_path(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _rank_file(path: str, ext: str) -> str:
    return os.path.join(path, f"rank{_rank():05d}.{ext}")


def _views(state: dict) -> list[memoryview]:
    return [byte_view(t) for t in locals_of(state).values() if t.numel()]


# ---------------------------------------------------------------- save


def save_shardsafe(state: dict, path: str) -> None:
    shardsafe.Checkpointer().save(path, state, save_overwrite=True)


def _save_dcp(threads: int) -> SaveFn:
    def save(state: dict, path: str) -> None:
        import torch.distributed.checkpoint as dcp

        dcp.save(state, storage_writer=dcp.FileSystemWriter(path, thread_count=threads))

    return save


def save_torch(state: dict, path: str) -> None:
    os.makedirs(path, exist_ok=True)
    with open(_rank_file(path, "pt"), "wb") as f:
        torch.save(locals_of(state), f)
        f.flush()
        os.fsync(f.fileno())
    _fsync_path(path)


def save_safetensors(state: dict, path: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    name = _rank_file(path, "safetensors")
    save_file({k: v.contiguous() for k, v in locals_of(state).items()}, name)
    _fsync_path(name)
    _fsync_path(path)


def _save_raw(threads: int, writeback: int = 0) -> SaveFn:
    """Write the rank's tensor bytes back to back with ``threads`` threads, fsync. With
    ``writeback``, start writing back every that many bytes (``sync_file_range``), as
    shardsafe's local storage does, so the limit knows that trick too."""

    def save(state: dict, path: str) -> None:
        os.makedirs(path, exist_ok=True)
        name = _rank_file(path, "bin")
        fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            jobs, pos = [], 0
            for mv in _views(state):
                for s in range(0, mv.nbytes, _BLOCK):
                    part = mv[s : s + _BLOCK]
                    jobs.append((part, pos))
                    pos += part.nbytes
            if threads == 1:
                synced = 0
                for part, at in jobs:
                    _pwrite_all(fd, part, at)
                    if writeback and sync_file_range and at + part.nbytes - synced >= writeback:
                        sync_file_range(fd, synced, at + part.nbytes - synced)
                        synced = at + part.nbytes
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda j: _pwrite_all(fd, *j), jobs))
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_path(path)

    return save


def _pwrite_all(fd: int, mv: memoryview, at: int) -> None:
    while mv.nbytes:
        n = os.pwrite(fd, mv, at)
        mv, at = mv[n:], at + n


SAVES: dict[str, SaveFn] = {
    "shardsafe": save_shardsafe,
    "dcp": _save_dcp(1),  # FileSystemWriter defaults (thread_count=1)
    "dcp-t4": _save_dcp(_THREADS),
    "torch.save": save_torch,
    "safetensors": save_safetensors,
    "raw": _save_raw(1),
    "raw-mt": _save_raw(_THREADS),
    "raw-wb": _save_raw(1, 16 << 20),
}
LIMIT_SAVES = ("raw", "raw-mt", "raw-wb")
DCP_SAVES = ("dcp", "dcp-t4")

# ---------------------------------------------------------------- load (in place)


def load_shardsafe(state: dict, path: str) -> None:
    shardsafe.Checkpointer().load(path, state)


def load_dcp(state: dict, path: str) -> None:
    import torch.distributed.checkpoint as dcp

    dcp.load(state, storage_reader=dcp.FileSystemReader(path))


def load_torch_mmap(state: dict, path: str) -> None:
    got = torch.load(_rank_file(path, "pt"), mmap=True, weights_only=True)
    with torch.no_grad():
        for k, t in locals_of(state).items():
            t.copy_(got[k])
    del got


def load_safetensors(state: dict, path: str) -> None:
    from safetensors.torch import load_file

    got = load_file(_rank_file(path, "safetensors"))
    with torch.no_grad():
        for k, t in locals_of(state).items():
            t.copy_(got[k])
    del got


def _load_preadv(threads: int) -> LoadFn:
    """Fill the state's tensors with bytes read from the ``raw`` files under ``path``.

    Reads this rank's own file when it exists (same layout); for a resharding load it reads the
    same number of bytes from the source ranks' files in turn: the bound on moving them.
    """

    def load(state: dict, path: str) -> None:
        own = _rank_file(path, "bin")
        files = [own] if os.path.exists(own) else sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".bin"))
        fds = [os.open(f, os.O_RDONLY) for f in files]
        try:
            sizes = [os.fstat(fd).st_size for fd in fds]
            jobs, fi, pos = [], 0, 0
            for mv in _views(state):
                for s in range(0, mv.nbytes, _BLOCK):
                    part = mv[s : s + _BLOCK]
                    while part.nbytes:
                        if pos >= sizes[fi]:
                            fi, pos = (fi + 1) % len(fds), 0
                        n = min(part.nbytes, sizes[fi] - pos)
                        jobs.append((fds[fi], part[:n], pos))
                        part, pos = part[n:], pos + n
            if threads == 1:
                for j in jobs:
                    _pread_all(*j)
            else:
                with ThreadPoolExecutor(threads) as pool:
                    list(pool.map(lambda j: _pread_all(*j), jobs))
        finally:
            for fd in fds:
                os.close(fd)

    return load


def _pread_all(fd: int, mv: memoryview, at: int) -> None:
    while mv.nbytes:
        n = os.preadv(fd, [mv], at)
        if n == 0:
            raise EOFError(f"fd {fd}: short read at {at}")
        mv, at = mv[n:], at + n


LOADS: dict[str, tuple[LoadFn, str]] = {  # method -> (function, the save method whose files it reads)
    "shardsafe": (load_shardsafe, "shardsafe"),
    "dcp": (load_dcp, "dcp"),
    "torch.load-mmap": (load_torch_mmap, "torch.save"),
    "safetensors": (load_safetensors, "safetensors"),
    "preadv": (_load_preadv(1), "raw"),
    "preadv-mt": (_load_preadv(_THREADS), "raw"),
}
RESHARD_LOADS = ("shardsafe", "dcp", "preadv", "preadv-mt")
LIMIT_LOADS = ("preadv", "preadv-mt")

# ---------------------------------------------------------------- unshard to one file (one process)


def unshard_shardsafe(src: dict[str, str], out: str) -> None:
    shardsafe.unshard_to_safetensors(src["shardsafe"], out + ".safetensors", overwrite=True)


def unshard_shardsafe_inmem(src: dict[str, str], out: str) -> None:
    """The non-streaming way: the whole state in memory, then ``safetensors.save_file``."""
    from safetensors.torch import save_file

    full = shardsafe.Checkpointer().unshard(src["shardsafe"], no_dist=True)
    save_file({k: v for k, v in full.items() if isinstance(v, torch.Tensor)}, out + ".safetensors")
    _fsync_path(out + ".safetensors")


def unshard_dcp(src: dict[str, str], out: str) -> None:
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(src["dcp"], out + ".pt")
    _fsync_path(out + ".pt")


def unshard_raw(src: dict[str, str], out: str) -> None:
    """Copy the bytes of every ``raw`` rank file into one file through one buffer, starting
    writeback every 16 MiB, fsync."""
    buf = memoryview(bytearray(_BLOCK))
    synced = 0
    files = sorted(os.path.join(src["raw"], f) for f in os.listdir(src["raw"]) if f.endswith(".bin"))
    fd = os.open(out + ".bin", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        at = 0
        for name in files:
            rfd = os.open(name, os.O_RDONLY)
            try:
                pos = 0
                while True:
                    n = os.preadv(rfd, [buf], pos)
                    if n == 0:
                        break
                    _pwrite_all(fd, buf[:n], at)
                    pos, at = pos + n, at + n
                    if sync_file_range and at - synced >= _BLOCK:
                        sync_file_range(fd, synced, at - synced)
                        synced = at
            finally:
                os.close(rfd)
        os.fsync(fd)
    finally:
        os.close(fd)


UNSHARDS: dict[str, Callable[[dict[str, str], str], None]] = {
    "shardsafe": unshard_shardsafe,
    "shardsafe-inmem": unshard_shardsafe_inmem,
    "dcp_to_torch_save": unshard_dcp,
    "raw-copy": unshard_raw,
}
LIMIT_UNSHARDS = ("raw-copy",)
