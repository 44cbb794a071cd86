"""The memory tier of :class:`~shardsafe.CheckpointManager`: every step in the node's own RAM
(tier 0), copied to other nodes' RAM through the job's process group (tier 1), written from there
to the durable root every ``persist_every`` steps (tier 2); and the restore from whatever survives.

Layout of each node's memory directory (a tmpfs such as ``/dev/shm``; one per node, shared by the
node's ranks)::

    memory_dir/step_00001000/metadata.json          the step's commit, the same bytes on every node
    memory_dir/step_00001000/shard-r00003-<id>.safetensors   this node's ranks' files, and the copies it holds
    memory_dir/step_00001000/shard-r00002-<id>.safetensors.part   a copy being received
    memory_dir/step_00001000/memtier.json           which nodes hold which file, once all are copied
    memory_dir/.spare/                              the data files of the step last dropped, overwritten by the next step's

A step directory is an ordinary checkpoint (the reader, ``verify`` and the checksums work on it);
it holds every data file only where one node holds the whole step. ``metadata.json`` is sealed by
its own checksum and committed before any copy is, so "safe in memory" is recorded beside it in
``memtier.json`` rather than in it (a committed ``metadata.json`` is never rewritten).

Call order: as for the manager; a :class:`Stream` sends and receives the copies while the save's
background threads write tier 0 (on a gloo group of its own), and :meth:`MemoryTier.after_commit`
runs in the save's background thread on the background group, after the step's tier-0 commit,
on every rank, and commits them.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import mmap
import os
import shutil
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from .adapters import LocalTensor
from .dist import Comm, Sending, replication_comm
from .errors import CheckpointError, IncompleteCheckpointError
from .format.metadata import METADATA_FILENAME, StorageMetadata, sealed_data_files
from .planning.save_plan import data_file_rank
from .storage import HeldFiles, Storage, open_storage

__all__ = [
    "SAFE_FILENAME", "SPARE_DIRNAME", "MemoryTier", "RestoreReport", "SavedInMemory", "Stream", "Transfer", "default_memory_dir", "fetch_plan", "newest_complete_step",
    "node_of_this_process", "replica_nodes", "replication_plan",
]

log = logging.getLogger(__name__)

SAFE_FILENAME = "memtier.json"
_PART = ".part"  # a copy being received; renamed to its name once whole
_FAIL_FINISH: Callable[[str], None] | None = None  # tests: called before a received copy is renamed to its name
_BLOCK = 4 << 20  # bytes per message of a copy streamed while tier 0 writes it (a multiple of the page size)
_HEAD = 512  # a streamed copy's first message: the file's size (int64, -1: no file) and its name (UTF-8)
SPARE_DIRNAME = ".spare"  # a dropped step's data files, kept to write the next step's files into


@dataclass(frozen=True, slots=True)
class Transfer:
    """One file sent whole from group rank ``src`` to group rank ``dst``."""

    file: str
    size: int
    src: int
    dst: int


@dataclass(frozen=True, slots=True)
class SavedInMemory:
    """The outcome of one step's memory save (what its background handle returns)."""

    step: int
    safe: bool  # every rank's files are held on more than one node
    persisted: bool  # written to the durable root too


@dataclass(slots=True)
class RestoreReport:
    """Where :meth:`CheckpointManager.restore` found its step (``manager.last_restore``)."""

    step: int | None
    tier: str  # "memory", "durable", or "none" (nothing to restore)
    local_bytes: int = 0  # data-file bytes this rank read from its own node's memory directory
    peer_bytes: int = 0  # data-file bytes this rank received from other nodes
    why: str = ""  # why the durable tier was used, when it was
    files: dict[str, str] = field(default_factory=dict)  # file -> "local" or "rank <r>" (memory restores)


# --- placement: pure functions over small lists -------------------------------------------------


def default_memory_dir(root_url: str) -> str:
    """``memory_dir=True``: a directory under ``/dev/shm`` (RAM on Linux) named after the durable
    root, so two jobs with different roots on one node keep apart."""
    import hashlib

    return os.path.join("/dev/shm", f"shardsafe-{hashlib.sha256(root_url.encode()).hexdigest()[:16]}")


def node_of_this_process() -> str:
    """This process's node when the caller names none: torchrun's ``GROUP_RANK`` (the agent's
    node rank), else the host name."""
    return os.environ.get("GROUP_RANK") or socket.gethostname()


def replica_nodes(nodes: list[int], replicas: int, groups: list[list[int]] | None = None) -> dict[int, list[int]]:
    """For each node of ``nodes`` (every rank's node), the other nodes that hold copies of its
    ranks' files: the next ``replicas`` nodes in a ring over the node numbers, or, with
    ``groups``, in a ring over the nodes of its own group (every node in exactly one group).
    Fewer when there are not enough nodes (a ring of one node has no copy)."""
    distinct = sorted(set(nodes))
    if groups is None:
        rings = [distinct]
    else:
        seen: dict[int, int] = {}
        for i, g in enumerate(groups):
            for n in g:
                if n in seen:
                    raise CheckpointError(f"CheckpointManager: replica_groups: node {n} is in group {seen[n]} and in group {i}")
                seen[n] = i
        missing = [n for n in distinct if n not in seen]
        if missing:
            raise CheckpointError(
                f"CheckpointManager: replica_groups {groups} do not name node(s) {missing} of the job's nodes {distinct}; "
                "every node must be in one group"
            )
        rings = [sorted(n for n in g if n in set(distinct)) for g in groups]
    out: dict[int, list[int]] = {}
    for ring in rings:
        for i, n in enumerate(ring):
            out[n] = [ring[(i + k) % len(ring)] for k in range(1, min(replicas, len(ring) - 1) + 1)]
    return out


def _ranks_of(nodes: list[int]) -> dict[int, list[int]]:
    out: dict[int, list[int]] = {}
    for r, n in enumerate(nodes):
        out.setdefault(n, []).append(r)
    return out


def replication_plan(nodes: list[int], files: list[tuple[str, int] | None], targets: dict[int, list[int]]) -> list[Transfer]:
    """The copies of one step: rank ``r``'s file (``files[r]``: name and size, None when it wrote
    none) goes to each node of ``targets[nodes[r]]``, to the rank there with the same place among
    its node's ranks (modulo their number), so every rank sends and receives about as much."""
    ranks_of = _ranks_of(nodes)
    out = []
    for r, f in enumerate(files):
        if f is None:
            continue
        place = ranks_of[nodes[r]].index(r)
        for t in targets[nodes[r]]:
            receivers = ranks_of[t]
            out.append(Transfer(f[0], f[1], r, receivers[place % len(receivers)]))
    return out


def newest_complete_step(inventories: dict[int, dict[int, Any]], *, below: int | None = None) -> int | None:
    """The newest step whose ``metadata.json`` some node holds and whose every data file, at its
    committed size, some node holds (``inventories``: node -> step -> (named files and sizes or
    None, held files and sizes, safe))."""
    steps = sorted({s for inv in inventories.values() for s in inv}, reverse=True)
    for s in steps:
        if below is not None and s > below:
            continue
        if _holders(inventories, s) is not None:
            return s
    return None


def _holders(inventories: dict[int, dict[int, Any]], step: int) -> dict[str, list[int]] | None:
    """file -> nodes holding it whole, for a complete step; None when the step is not complete."""
    named = next((inv[step][0] for inv in inventories.values() if step in inv and inv[step][0] is not None), None)
    if named is None:
        return None
    out: dict[str, list[int]] = {name: [] for name in named}
    for node in sorted(inventories):
        held = inventories[node].get(step)
        if held is None:
            continue
        for name, size in held[1].items():
            if name in named and named[name] == size:
                out[name].append(node)
    return out if all(out.values()) else None


def fetch_plan(nodes: list[int], needs: list[list[str]], holders: dict[str, list[int]], sizes: dict[str, int]) -> list[Transfer]:
    """Who sends which file to whom: each rank's ``needs`` (files its node does not hold) come
    from a rank of a node that holds them, the one with the fewest bytes to send so far (ties:
    the lowest rank), so a restore spreads its sends over every surviving holder."""
    ranks_of = _ranks_of(nodes)
    load: dict[int, int] = {r: 0 for r in range(len(nodes))}
    out = []
    for dst, files in enumerate(needs):
        for f in files:
            senders = [r for n in holders[f] for r in ranks_of.get(n, ())]
            if not senders:
                raise IncompleteCheckpointError(f"memory tier: no surviving rank holds {f} (held by nodes {holders[f]})")
            src = min(senders, key=lambda r: (load[r], r))
            load[src] += sizes[f]
            out.append(Transfer(f, sizes[f], src, dst))
    return out


# --- the tier ------------------------------------------------------------------------------------


def _file_tensor(path: str, size: int) -> tuple[torch.Tensor, Any]:
    """The file at ``path`` as a uint8 tensor without copying it (a private mapping of the file
    in tmpfs), and the mapping to close afterwards."""
    with open(path, "rb") as f:
        got = os.fstat(f.fileno()).st_size
        if got != size:
            raise CheckpointError(f"{path}: memory tier file has {got} bytes, expected {size}")
        if size == 0:
            return torch.empty(0, dtype=torch.uint8), None
        mm = mmap.mmap(f.fileno(), size, access=mmap.ACCESS_COPY)
    return torch.frombuffer(mm, dtype=torch.uint8), mm


class _Receiving:
    """A file received straight into a new file of the node's memory directory (a shared
    mapping), under a ``.part`` name until :meth:`finish` renames it."""

    def __init__(self, path: str, size: int, reuse: Callable[[str], bool] | None = None) -> None:
        self.path = path
        self.part = path + _PART
        reused = reuse is not None and reuse(self.part)
        fd = os.open(self.part, os.O_RDWR | (0 if reused else os.O_CREAT | os.O_TRUNC), 0o644)
        try:
            os.ftruncate(fd, size)
            self.mm = _map_for_writing(fd, size, allocate=not reused) if size else None
        finally:
            os.close(fd)
        self.tensor = torch.frombuffer(self.mm, dtype=torch.uint8) if self.mm is not None else torch.empty(0, dtype=torch.uint8)

    def finish(self) -> None:
        self._close()
        if _FAIL_FINISH is not None:
            _FAIL_FINISH(self.path)
        os.replace(self.part, self.path)

    def abandon(self) -> None:
        """A copy that will not be committed: its ``.part`` file goes."""
        self._close()
        _unlink_quietly(self.part)

    def _close(self) -> None:
        self.tensor = None
        if self.mm is not None and not self.mm.closed:
            try:
                self.mm.close()
            except BufferError:  # still held by a failed transfer: left to the collector
                pass


def _map_for_writing(fd: int, size: int, *, allocate: bool) -> mmap.mmap:
    """A shared writable mapping of ``size`` bytes of ``fd``, its pages faulted in at once
    (``MAP_POPULATE``) rather than one fault per 4 KiB page as the transfer writes them; a new
    file's pages are allocated first, in one call (``allocate``)."""
    if allocate and hasattr(os, "posix_fallocate"):
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError as e:
            if e.errno not in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS):  # ENOSPC: the tmpfs is full
                raise
    populate = getattr(mmap, "MAP_POPULATE", 0)
    return mmap.mmap(fd, size, flags=mmap.MAP_SHARED | populate, prot=mmap.PROT_READ | mmap.PROT_WRITE)


class MemoryTier:
    """One rank's view of the memory tier: its node's directory and the job's placement.

    Created by every rank together (one all-gather of the node names, and the gloo group the
    copies travel on). ``node`` names this rank's node (ranks with the same name share
    ``memory_dir``); ``replicas`` copies of each file go to other nodes, placed by
    :func:`replica_nodes`.
    """

    def __init__(
        self, memory_dir: str, *, node: int | str | None, replicas: int, groups: list[list[int]] | None, comm: Comm, root_url: str,
        timeout_s: float,
    ) -> None:
        self.dir = os.path.abspath(os.fspath(memory_dir))
        os.makedirs(self.dir, exist_ok=True)
        self.root_url = root_url
        self.replicas = replicas
        name = node_of_this_process() if node is None else node
        names = comm.all_gather(lambda: name)
        comm.raise_failures(names)
        order = {n: i for i, n in enumerate(dict.fromkeys(names))}  # node numbers in order of their first rank
        self.nodes: list[int] = [n if isinstance(n, int) else order[n] for n in names]  # every group rank's node
        self.node = self.nodes[comm.rank]
        self.rank = comm.rank
        self.leader = self.nodes.index(self.node) == comm.rank  # the node's first rank writes its shared files
        self.targets = replica_nodes(self.nodes, replicas, groups)
        # who streams its file to whom, whatever each rank writes (a rank without a file says so)
        pairs = replication_plan(self.nodes, [("", 0)] * len(self.nodes), self.targets)
        self.send_to = [t.dst for t in pairs if t.src == comm.rank]
        self.recv_from = [t.src for t in pairs if t.dst == comm.rank]
        self.copies = replication_comm(comm, timeout_s=timeout_s)  # every rank is here: the group is made now
        if len(set(self.nodes)) > 1 and any(len(t) < replicas for t in self.targets.values()):
            log.warning(
                "CheckpointManager: replicas=%d but some nodes have only %s other node(s) to copy to", replicas,
                sorted({len(t) for t in self.targets.values()}),
            )

    # --- paths ---------------------------------------------------------------------------------

    def step_path(self, step_dir: str) -> str:
        return os.path.join(self.dir, step_dir)

    def step_storage(self, step_dir: str) -> Storage:
        """The node's directory of one step as a storage whose URL is the same on every rank
        (one save, one location: its files are named in one ``metadata.json``)."""
        storage = open_storage(self.step_path(step_dir))
        storage.url = f"memtier:{self.root_url.rstrip('/')}/{step_dir}"  # type: ignore[misc]
        if hasattr(storage, "reuse"):  # tier 0's own file written into a spare's pages
            storage.reuse = self.claim_spare  # type: ignore[attr-defined]
        return storage

    # --- spares: a dropped step's files, overwritten by the next step's -------------------------

    def claim_spare(self, path: str) -> bool:
        """Move one spare file of the node's pool to ``path`` (to be overwritten and cut to
        length); False when the pool is empty. Tmpfs allocates and zeroes a new file's pages
        at about the speed of a loopback transfer, so writing into a dropped step's pages
        halves the cost of a copy. The node's ranks claim concurrently: a rename is atomic."""
        pool = os.path.join(self.dir, SPARE_DIRNAME)
        try:
            names = sorted(os.listdir(pool))
        except FileNotFoundError:
            return False
        for name in names:
            try:
                os.rename(os.path.join(pool, name), path)
                return True
            except FileNotFoundError:  # another rank of the node took it
                continue
            except OSError as e:
                log.debug("memory tier: spare %s not usable: %s", name, e)
                return False
        return False

    def _refill_spares(self, step_dir: str, older: list[str]) -> None:
        """(Node leader, once ``step_dir`` is safe.) The pool becomes as many files as the node
        holds of ``step_dir`` (what the next step will write): the data files of the ``older``
        steps being dropped, else new files of the same sizes. Leftovers beyond that are removed."""
        pool = os.path.join(self.dir, SPARE_DIRNAME)
        os.makedirs(pool, exist_ok=True)
        try:
            want = sorted((e.stat().st_size for e in os.scandir(self.step_path(step_dir)) if _is_data(e.name)), reverse=True)
        except FileNotFoundError:
            want = []
        have = [os.path.join(pool, n) for n in os.listdir(pool)]
        for name in older:  # metadata.json first: what is left is never a complete step
            path = os.path.join(self.dir, name)
            _unlink_quietly(os.path.join(path, METADATA_FILENAME))
            try:
                entries = [e.name for e in os.scandir(path) if _is_data(e.name)]
            except FileNotFoundError:
                entries = []
            for e in entries:
                dst = os.path.join(pool, f"{name}-{e}")
                try:
                    os.rename(os.path.join(path, e), dst)
                    have.append(dst)
                except OSError:
                    pass
        for extra in have[len(want):]:
            _unlink_quietly(extra)
        for i in range(len(have), len(want)):  # the first steps: nothing dropped yet
            fd = os.open(os.path.join(pool, f"new-{i}"), os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o644)
            try:  # written, not fallocated: tmpfs zeroes a fallocated page on its first use, in the next step's copy
                zeros = memoryview(bytes(min(want[i], 1 << 20)))
                left = want[i]
                while left:
                    left -= os.write(fd, zeros[: min(left, zeros.nbytes)])
            except OSError as e:
                log.debug("memory tier: could not allocate a spare of %d bytes: %s", want[i], e)
                os.close(fd)
                _unlink_quietly(os.path.join(pool, f"new-{i}"))
                break
            os.close(fd)

    def clear_step(self, step_dir: str) -> None:
        """(Node leader.) Remove what the node holds of a step: a stale copy of a step saved again."""
        if self.leader:
            _remove_tree(self.step_path(step_dir))

    # --- save: after the tier-0 commit, in the background -----------------------------------------

    def stream(self, step_dir: str) -> Stream:
        """The copies of one step, streamed while tier 0 is written: the save's ``tee``, then
        :meth:`after_commit`'s."""
        return Stream(self, self.step_path(step_dir))

    def after_commit(
        self, side: Comm, step: int, step_dir: str, own: list[str], persist: Storage | None, stream: Stream,
    ) -> SavedInMemory:
        """Every rank, on the background group, once tier 0 committed: the step's ``metadata.json``
        to every node, the copies ``stream`` received (sent while tier 0 was written) checked
        against the step's files and committed, the safe record, then tier 2 (``persist``: the
        step's durable location, or None), then the node's older steps removed."""
        path = self.step_path(step_dir)
        times = [time.perf_counter()]
        mine = [os.path.basename(f) for f in own]
        try:
            raw = side.broadcast(lambda: _read(os.path.join(path, METADATA_FILENAME)))

            files = _rank_files(raw, f"{path}/{METADATA_FILENAME}", len(self.nodes))
            plan = replication_plan(self.nodes, files, self.targets)
            times.append(time.perf_counter())

            def commit() -> None:
                if self.leader and not os.path.exists(os.path.join(path, METADATA_FILENAME)):
                    os.makedirs(path, exist_ok=True)
                    _write_atomic(os.path.join(path, METADATA_FILENAME), raw)
                stream.commit([t for t in plan if t.dst == self.rank])

            # metadata.json on every node, and every copy received whole, as the step's files
            # say, and renamed on every node (a failure anywhere, a full tmpfs, fails every rank
            # here) before any node records the step safe
            side.check(commit)
        except BaseException:
            stream.failed()
            raise
        times.append(time.perf_counter())
        holders: dict[str, list[int]] = {}
        for r, f in enumerate(files):
            if f is not None:
                holders[f[0]] = [self.nodes[r]]
        for t in plan:
            holders[t.file].append(self.nodes[t.dst])
        safe = all(len(set(h)) > 1 for h in holders.values())
        record = json.dumps({"step": step, "safe": safe, "holders": {k: sorted(set(v)) for k, v in sorted(holders.items())}}).encode()
        # every node writes its record before any node drops an older step
        side.check(lambda: _write_atomic(os.path.join(path, SAFE_FILENAME), record) if self.leader else None)
        times.append(time.perf_counter())
        if persist is not None:
            _persist(side, path, mine, raw, persist)
        if self.leader:
            self._drop_older(step_dir)
        times.append(time.perf_counter())
        log.debug(
            "memory tier: step %d on rank %d: metadata to every node %.3f s, copies' end and commit %.3f s, safe record %.3f s, persist and "
            "cleanup %.3f s", step, self.rank, *(b - a for a, b in zip(times, times[1:])),
        )
        return SavedInMemory(step, safe, persist is not None)

    def _run_transfers(self, comm: Comm, plan: list[Transfer], path: str, held: HeldFiles) -> int:
        """(Restore.) Send whole files of the node's step directory ``path`` and receive them
        into ``held``, as ``plan`` says. Returns the bytes received."""
        sends, recvs, maps, receiving = [], [], [], []

        def post() -> None:
            for tag, t in enumerate(plan):
                if t.src == self.rank:
                    tensor, mm = _file_tensor(os.path.join(path, t.file), t.size)
                    sends.append((t.dst, tag, tensor))
                    maps.append(mm)
                if t.dst == self.rank:
                    buf = torch.empty(t.size, dtype=torch.uint8)
                    receiving.append((t.file, buf))
                    recvs.append((t.src, tag, buf))

        try:
            comm.check(post)  # a file that cannot be opened fails every rank before any transfer
            comm.exchange(sends, recvs)
        finally:
            sends.clear()  # the tensors over the mappings go before the mappings
            recvs.clear()
            for mm in maps:
                if mm is not None:
                    with contextlib.suppress(BufferError):  # still held by a failed transfer: left to the collector
                        mm.close()
        n = 0
        for name, buf in receiving:
            held.add(name, buf.numpy())
            n += buf.numel()
        return n

    def _drop_older(self, step_dir: str) -> None:
        """Drop the node's steps older than ``step_dir`` (now safe), their data files kept as
        the pool of spares the next step writes into."""
        older = [name for name in _step_dirs(self.dir) if name < step_dir]
        try:
            self._refill_spares(step_dir, older)
        except OSError as e:
            log.warning("memory tier: keeping spare files in %s failed: %s", self.dir, e)
        for name in older:
            _remove_tree(os.path.join(self.dir, name))

    def forget_after(self, step_dir: str) -> None:
        """(Node leader, once every rank has restored the step of ``step_dir``.) Remove the steps
        newer than it: they belong to a run the job went back from, and a later restore must
        never prefer them to what this run saves next."""
        if self.leader:
            for name in _step_dirs(self.dir):
                if name > step_dir:
                    _remove_tree(os.path.join(self.dir, name))

    # --- restore ----------------------------------------------------------------------------------

    def inventory(self) -> dict[int, tuple[dict[str, int] | None, dict[str, int], bool]]:
        """What this node holds: step -> (the files its ``metadata.json`` names, with their sizes,
        or None without one; the data files held whole, with their sizes; whether it is safe)."""
        out = {}
        for name in _step_dirs(self.dir):
            path = os.path.join(self.dir, name)
            try:
                files = {e.name: e.stat().st_size for e in os.scandir(path) if e.is_file() and not e.name.endswith(_PART)}
            except FileNotFoundError:
                continue
            named = None
            if METADATA_FILENAME in files:
                try:
                    named = _named_sizes(_read(os.path.join(path, METADATA_FILENAME)), os.path.join(path, METADATA_FILENAME))
                except (CheckpointError, OSError) as e:
                    log.warning("memory tier: %s/%s does not count: %s", path, METADATA_FILENAME, e)
            safe = False
            if SAFE_FILENAME in files:
                try:
                    safe = bool(json.loads(_read(os.path.join(path, SAFE_FILENAME))).get("safe"))
                except (ValueError, OSError):
                    safe = False
            data = {k: v for k, v in files.items() if k not in (METADATA_FILENAME, SAFE_FILENAME)}
            out[int(name[5:])] = (named, data, safe)
        return out

    def gather(self, comm: Comm) -> dict[int, dict[int, Any]]:
        """Every node's inventory (one all-gather; a node's first rank speaks for it)."""
        got = comm.all_gather(self.inventory)
        comm.raise_failures(got)
        out: dict[int, dict[int, Any]] = {}
        for r, inv in enumerate(got):
            out.setdefault(self.nodes[r], inv)
        return out

    def load(
        self, comm: Comm, step: int, step_dir: str, inventories: dict[int, dict[int, Any]],
        load: Callable[[Storage, Callable[[StorageMetadata, list[LocalTensor]], None]], None],
    ) -> RestoreReport:
        """Restore ``step`` from the nodes' memory: ``load(storage, fetch)`` runs the ordinary
        load from a storage holding this node's files and, once ``fetch`` has run, the files
        received from other nodes (every byte checked against its digests as it is read)."""
        holders = _holders(inventories, step)
        if holders is None:
            raise IncompleteCheckpointError(f"memory tier: step {step} is not held whole by the surviving nodes")
        named = next(inv[step][0] for inv in inventories.values() if step in inv and inv[step][0] is not None)
        path = self.step_path(step_dir)
        local = set(inventories.get(self.node, {}).get(step, (None, {}, False))[1])
        base = open_storage(path) if os.path.isdir(path) else None
        held = HeldFiles(f"memtier:{self.root_url.rstrip('/')}/{step_dir}", base)
        report = RestoreReport(step, "memory")
        meta_nodes = [n for n in sorted(inventories) if step in inventories[n] and inventories[n][step][0] is not None]
        if self.nodes[0] not in meta_nodes:  # the coordinator reads metadata.json: bring it one
            size = os.path.getsize(os.path.join(path, METADATA_FILENAME)) if self.node == meta_nodes[0] else 0
            sizes = comm.all_gather(lambda: size)
            comm.raise_failures(sizes)
            src = self.nodes.index(meta_nodes[0])
            self._run_transfers(comm, [Transfer(METADATA_FILENAME, max(sizes), src, 0)], path, held)

        def fetch(meta: StorageMetadata, targets: list[LocalTensor]) -> None:
            def needs() -> list[str]:
                wanted.update(_files_needed(meta, targets, named))
                return sorted(wanted - local)

            wanted: set[str] = set()
            asked = comm.all_gather(needs)
            comm.raise_failures(asked)
            plan = fetch_plan(self.nodes, asked, holders, named)
            report.peer_bytes = self._run_transfers(comm, plan, path, held)
            report.files = {t.file: f"rank {comm.global_ranks[t.src]}" for t in plan if t.dst == self.rank}
            report.files.update({f: "local" for f in sorted(wanted & local)})
            report.local_bytes = sum(named[f] for f in wanted & local)

        load(held, fetch)
        return report


class Stream:
    """One save's copies, made while tier 0 is written (the engine's ``FileTee``): this rank's
    file goes to its replica ranks (``send_to``) in blocks of ``_BLOCK`` bytes, each sent as soon
    as the file holds it, from a mapping of the file (the bytes are not read again); the copies
    of the ranks it holds copies of (``recv_from``) are received, by a thread of their own,
    straight into ``.part`` files of the node's step directory, renamed by :meth:`commit` once
    tier 0 committed and every copy is whole, removed by :meth:`failed` otherwise.

    Every rank that begins sends every block it announced, the rest as zeros if its write
    failed (the save then fails on every rank), so no receiver waits for bytes that never come.
    """

    def __init__(self, tier: MemoryTier, path: str) -> None:
        self._tier, self._comm, self._path = tier, tier.copies, path
        self._sending: Sending = self._comm.start_sends([])
        self._lock = threading.Lock()
        self._file: str | None = None
        self._size = -1
        self._next = 0  # the first block not sent yet
        self._fd: int | None = None
        self._maps: list[mmap.mmap] = []
        self._zeros: torch.Tensor | None = None
        self._receiving: dict[int, _Receiving] = {}  # sender -> its copy
        self._announced: dict[int, tuple[str, int]] = {}  # sender -> the file and size it announced
        self._receiver: threading.Thread | None = None
        self._errors: list[BaseException] = []
        self._done = False

    # --- the engine's FileTee: called by the save's threads ----------------------------------

    def begin(self, name: str | None, size: int) -> None:
        self._file, self._size = name, (size if name is not None else -1)
        try:
            heads = [_head(self._size, name or "") for _ in self._tier.send_to]
        except CheckpointError as e:  # announced as no file: the save fails at the commit of the copies
            self._errors.append(e)
            self._size = -1
            heads = [_head(-1, "") for _ in self._tier.send_to]
        for dst, head in zip(self._tier.send_to, heads):
            self._sending.add(dst, 0, head)
        if self._tier.recv_from:
            self._receiver = threading.Thread(target=self._receive, name="shardsafe-memtier-receive", daemon=True)
            self._receiver.start()

    def written(self, upto: int) -> None:
        with self._lock:
            count = _block_count(self._size)
            while self._next < count and min((self._next + 1) * _BLOCK, self._size) <= upto:
                a = self._next * _BLOCK
                self._send(self._next, a, min(a + _BLOCK, self._size))
                self._next += 1

    def end(self, ok: bool) -> None:
        with self._lock:
            count = _block_count(self._size)
            if ok and self._next < count:
                self._errors.append(CheckpointError(f"{self._path}/{self._file}: written whole, but only {self._next} of its {count} blocks were sent"))
            while self._next < count:  # the receivers wait for every block announced
                a = self._next * _BLOCK
                self._send_zeros(self._next, min(a + _BLOCK, self._size) - a)
                self._next += 1
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def failed(self) -> None:
        """The save failed: wait for the transfers to end, then remove every received copy."""
        try:
            self._wait()
        except BaseException as e:  # noqa: BLE001 - the save's own error is the one raised
            log.debug("memory tier: %s: the copies of a failed save ended with %s", self._path, e)
        self._abandon()

    # --- after tier 0 committed ----------------------------------------------------------------

    def commit(self, expected: list[Transfer]) -> int:
        """Wait until every copy is sent and received; check that this rank received exactly
        ``expected`` (the step's files); rename the copies to their names. The bytes received.
        On any failure every copy not yet renamed is removed, and the error raised."""
        try:
            self._wait()
            got = {src: f for src, f in self._announced.items() if f[1] >= 0}
            want = {t.src: (t.file, t.size) for t in expected}
            if got != want:
                raise CheckpointError(
                    f"memory tier: rank {self._tier.rank} received copies {_copies_text(got)}, but the step's files are "
                    f"{_copies_text(want)}"
                )
            n = 0
            for src in sorted(self._receiving):
                r = self._receiving[src]
                n += r.mm.size() if r.mm is not None else 0
                r.finish()
                del self._receiving[src]  # committed: no longer this save's to remove
            return n
        except BaseException:
            self._abandon()
            raise

    # --- internals ----------------------------------------------------------------------------

    def _send(self, index: int, a: int, b: int) -> None:
        try:
            if self._fd is None:
                self._fd = os.open(os.path.join(self._path, self._file or ""), os.O_RDWR)  # shared mapping: no copy of the pages
            mm = mmap.mmap(self._fd, b - a, flags=mmap.MAP_SHARED | getattr(mmap, "MAP_POPULATE", 0), prot=mmap.PROT_READ | mmap.PROT_WRITE, offset=a)
        except OSError as e:
            self._errors.append(CheckpointError(f"{self._path}/{self._file}: cannot map bytes {a}-{b} to send them: {e}"))
            self._send_zeros(index, b - a)
            return
        self._maps.append(mm)
        block = torch.frombuffer(mm, dtype=torch.uint8)
        for dst in self._tier.send_to:
            self._sending.add(dst, 1 + index, block[:])
        del block

    def _send_zeros(self, index: int, n: int) -> None:
        if self._zeros is None:
            self._zeros = torch.zeros(_BLOCK, dtype=torch.uint8)
        for dst in self._tier.send_to:
            self._sending.add(dst, 1 + index, self._zeros[:n])

    def _receive(self) -> None:
        """(Thread.) The senders' announcements, then every block of each, into a ``.part`` file
        (or, when that cannot be made, into scratch memory: a sender waits for its receives)."""
        try:
            heads = [(src, 0, torch.empty(_HEAD, dtype=torch.uint8)) for src in self._tier.recv_from]
            self._comm.exchange([], heads)
            recvs: list[tuple[int, int, torch.Tensor]] = []
            scratch: torch.Tensor | None = None
            for src, _, head in heads:
                size, name = _unhead(head)
                self._announced[src] = (name, size)
                if size < 0:
                    continue
                target: torch.Tensor | None = None
                try:
                    if os.path.basename(name) != name or not _is_data(name):
                        raise CheckpointError(f"memory tier: rank {src} announced a copy named {name!r}, not a data file name")
                    os.makedirs(self._path, exist_ok=True)
                    r = _Receiving(os.path.join(self._path, name), size, self._tier.claim_spare)
                    with self._lock:
                        self._receiving[src] = r
                    target = r.tensor
                except (OSError, CheckpointError) as e:
                    self._errors.append(e)
                for i, (a, b) in enumerate(_blocks(size)):
                    if target is None:
                        scratch = scratch if scratch is not None else torch.empty(_BLOCK, dtype=torch.uint8)
                        recvs.append((src, 1 + i, scratch[: b - a]))
                    else:
                        recvs.append((src, 1 + i, target[a:b]))
            self._comm.exchange([], recvs)
        except BaseException as e:  # noqa: BLE001 - raised by commit or failed, in the save's thread
            self._errors.append(e)

    def _wait(self) -> None:
        if not self._done:
            self._done = True
            try:
                self._sending.wait()
            except BaseException as e:  # noqa: BLE001 - raised below, after the receiver ended
                self._errors.append(e)
            if self._receiver is not None:
                self._receiver.join()
            for mm in self._maps:
                with contextlib.suppress(BufferError):
                    mm.close()
            self._maps.clear()
        if self._errors:
            raise self._errors[0]

    def _abandon(self) -> None:
        with self._lock:
            receiving, self._receiving = self._receiving, {}
        for r in receiving.values():
            r.abandon()


def _block_count(size: int) -> int:
    return -(-size // _BLOCK) if size > 0 else 0


def _blocks(size: int) -> list[tuple[int, int]]:
    return [(a, min(a + _BLOCK, size)) for a in range(0, max(size, 0), _BLOCK)]


def _head(size: int, name: str) -> torch.Tensor:
    raw = size.to_bytes(8, "little", signed=True) + name.encode()
    if len(raw) > _HEAD:
        raise CheckpointError(f"memory tier: the data file name {name!r} is too long to announce ({len(raw) - 8} bytes, at most {_HEAD - 8})")
    t = torch.zeros(_HEAD, dtype=torch.uint8)
    t[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
    return t


def _unhead(t: torch.Tensor) -> tuple[int, str]:
    raw = t.numpy().tobytes()
    return int.from_bytes(raw[:8], "little", signed=True), raw[8:].rstrip(b"\0").decode(errors="replace")


def _copies_text(copies: dict[int, tuple[str, int]]) -> str:
    return ", ".join(f"{name} ({size} bytes) from rank {src}" for src, (name, size) in sorted(copies.items())) or "none"


def _files_needed(meta: StorageMetadata, targets: list[LocalTensor], named: dict[str, int]) -> set[str]:
    """The data files holding a chunk that overlaps a piece of ``targets`` (every file named,
    for a metadata document without chunk tables)."""
    table = meta.file_table or []
    out: set[str] = set()
    for t in targets:
        tm = meta.tensors[t.key]
        idx = tm.overlapping([(off, lens) for off, lens, _ in t.pieces])
        if idx is None:
            return set(named)
        out.update(table[i].name for i in tm.files_of(idx))
    return out


def _persist(side: Comm, path: str, mine: list[str], raw: bytes, durable: Storage) -> None:
    """Tier 2: each rank copies its own files from the node's memory to ``durable`` (no staging:
    the bytes as they are, digests and all), then the coordinator commits the same
    ``metadata.json`` there, last."""

    def copy() -> None:
        for name in mine:
            with open(os.path.join(path, name), "rb", buffering=0) as f, durable.write_file(name) as w:
                buf = bytearray(8 << 20)
                view = memoryview(buf)
                while n := f.readinto(buf):
                    w.write(view[:n])

    side.check(copy)
    side.broadcast(lambda: durable.put_atomic(METADATA_FILENAME, raw, overwrite=False))


def _rank_files(raw: bytes, where: str, world: int) -> list[tuple[str, int] | None]:
    """Each rank's data file of a step and its size, from the step's ``metadata.json`` (None for
    a rank that wrote none)."""
    out: list[tuple[str, int] | None] = [None] * world
    for name, size in _named_sizes(raw, where).items():
        rank = data_file_rank(name)
        if rank is None or not 0 <= rank < world or size < 0:
            raise CheckpointError(f"{where}: data file {name} ({size} bytes) is not a file of one of this save's {world} ranks")
        out[rank] = (name, size)
    return out


def _named_sizes(raw: bytes, where: str) -> dict[str, int]:
    names = sealed_data_files(raw, where=where)  # checks the document's own checksum
    doc = json.loads(raw)
    table = doc.get("file_table") or []
    sizes = {f["name"]: f["size"] for f in table}
    files = doc.get("files") or {}
    sizes.update({k: v["size"] for k, v in files.items() if isinstance(v, dict) and "size" in v})
    return {n: sizes.get(n, -1) for n in names}


def _step_dirs(root: str) -> list[str]:
    try:
        names = os.listdir(root)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.startswith("step_") and n[5:].isdigit() and len(n) >= 13)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def _write_atomic(path: str, data: bytes) -> None:
    tmp = path + _PART
    with open(tmp, "wb") as f:
        f.write(data)
    os.replace(tmp, path)


def _is_data(name: str) -> bool:
    """A data file of a step directory (not metadata.json, memtier.json or a ``.part`` copy)."""
    return name.endswith(".safetensors")


def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


def _remove_tree(path: str) -> None:
    """Remove a step directory, ``metadata.json`` first (what is left is never a complete step)."""
    try:
        os.unlink(os.path.join(path, METADATA_FILENAME))
    except FileNotFoundError:
        pass
    except OSError as e:
        log.warning("memory tier: could not remove %s: %s", path, e)
        return
    shutil.rmtree(path, ignore_errors=True)
