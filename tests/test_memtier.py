"""The memory tier of CheckpointManager (issue 24): every step in the node's RAM directory (tier
0), copies on other nodes through the process group (tier 1), the durable root every
``persist_every`` steps (tier 2), and restores from the survivors' memory into another world size.

Nodes are simulated: each rank is given a node number and its node's own memory directory;
"losing a node" is ending its processes (every run ends its ranks) and deleting its directory.
"""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch
from torch import nn

from shardsafe import CheckpointManager, verify
from shardsafe.errors import CheckpointError, RankMismatchError
from shardsafe.memtier import (
    SAFE_FILENAME,
    SPARE_DIRNAME,
    Transfer,
    default_memory_dir,
    fetch_plan,
    newest_complete_step,
    replica_nodes,
    replication_plan,
)

from .helpers import assert_bits, full_tensor, run_ranks

SHAPES = {"w": (16, 12), "b": (10,), "e": (7, 3)}  # b and e split unevenly over 3 and 4 ranks


class Sharded(nn.Module):
    """Parameters sharded on dim 0 over every rank (FSDP2's layout), set to known values per step."""

    def __init__(self, ws: int) -> None:
        super().__init__()
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        mesh = init_device_mesh("cpu", (ws,))
        for k, shape in SHAPES.items():
            self.register_parameter(k, nn.Parameter(distribute_tensor(torch.zeros(shape), mesh, [Shard(0)], src_data_rank=None)))

    def set_step(self, step: int) -> None:
        with torch.no_grad():
            for k in SHAPES:
                p = getattr(self, k)
                full = _value(k, step)
                local = p.to_local()
                lo = p.device_mesh.get_local_rank() * ((full.shape[0] + p.device_mesh.size() - 1) // p.device_mesh.size())
                local.copy_(full[lo : lo + local.shape[0]])

    def fulls(self) -> dict[str, torch.Tensor]:
        return {k: getattr(self, k).full_tensor() for k in SHAPES}


def _value(key: str, step: int) -> torch.Tensor:
    return full_tensor(f"{key}@{step}", SHAPES[key])


def _check_step(fulls: dict[str, torch.Tensor], step: int) -> None:
    for k, t in fulls.items():
        assert_bits(t, _value(k, step), f"{k} at step {step}")


def _mgr(tmp: str, root: str, node: int, **kw) -> CheckpointManager:
    return CheckpointManager(root, memory_dir=os.path.join(tmp, f"node{node}"), node=node, **kw)


def _train(rank, ws, tmp, root, nodes, steps, persist_every):
    """Save ``steps`` on nodes ``nodes[rank]``; returns each step's safe record on this node."""
    model = Sharded(ws)
    with _mgr(tmp, root, nodes[rank], persist_every=persist_every) as mgr:
        for s in steps:
            model.set_step(s)
            assert mgr.save(s, model)
        mgr.wait_until_finished()
        durable = mgr.all_steps()
    path = os.path.join(tmp, f"node{nodes[rank]}")
    held = sorted(n for n in os.listdir(path) if n != SPARE_DIRNAME)
    with open(os.path.join(path, held[-1], SAFE_FILENAME)) as f:
        record = json.load(f)
    spares = sorted(os.path.getsize(os.path.join(path, SPARE_DIRNAME, n)) for n in os.listdir(os.path.join(path, SPARE_DIRNAME)))
    kept = sorted(os.path.getsize(os.path.join(path, held[-1], n)) for n in os.listdir(os.path.join(path, held[-1])) if n.endswith(".safetensors"))
    return {"durable": durable, "held": held, "record": record, "spares": spares, "kept": kept}


def _restore(rank, ws, tmp, root, nodes):
    model = Sharded(ws)
    with _mgr(tmp, root, nodes[rank]) as mgr:
        step = mgr.restore(model=model)
        report = mgr.last_restore
    fulls = model.fulls()
    if step is not None:
        _check_step(fulls, step)  # here: tensors sent back through the queue outlive their process badly
    return {"step": step, "tier": report.tier, "peer": report.peer_bytes, "local": report.local_bytes, "why": report.why}


def _lose(tmp, node: int) -> None:
    shutil.rmtree(os.path.join(tmp, f"node{node}"))


def _drop_durable_data(root) -> None:
    """Delete the durable tier's data files (metadata stays): a restore that reads one fails."""
    for d in os.listdir(root):
        for f in os.listdir(os.path.join(root, d)):
            if f.endswith(".safetensors"):
                os.unlink(os.path.join(root, d, f))


def test_four_nodes_lose_one_restore_on_two_from_peers_memory(tmp_path) -> None:
    """4 nodes of one rank, replicas=1 (a ring): each step is safe in memory (every file on two
    nodes) and only the newest stays. Node 3 lost: the survivors 0 and 2 restore the newest step
    into 2 ranks bit-exact, taking what they lack from each other, with the durable tier's data
    files deleted (0 bytes read there)."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    out = run_ranks(4, _train, tmp, root, [0, 1, 2, 3], [1, 2, 3], 2)
    for o in out:
        assert o["durable"] == [2]
        assert o["held"] == ["step_00000003"]
        # the dropped step's files are kept to write the next step into: as many, as large
        assert len(o["kept"]) == 2 and o["spares"] == o["kept"]
        assert o["record"]["step"] == 3 and o["record"]["safe"] is True
        assert sorted(map(tuple, o["record"]["holders"].values())) == [(0, 1), (0, 3), (1, 2), (2, 3)]
    _lose(tmp, 3)
    _lose(tmp, 1)  # node 1 is not restarted either: the survivors are 0 and 2
    _drop_durable_data(root)
    got = run_ranks(2, _restore, tmp, root, [0, 2])
    for g in got:
        assert (g["step"], g["tier"], g["why"]) == (3, "memory", "")
        assert g["peer"] > 0 and g["local"] > 0


def _train_failing_copy(rank, ws, tmp, root):
    """3 nodes of one rank save steps 1-3; at step 3 the copy of rank 1's file on node 2 fails
    after it was received, before it is committed. Returns what each node holds afterwards."""
    from shardsafe import memtier

    def fail(path: str) -> None:
        if rank == 2 and "step_00000003" in path and "shard-r00001" in path:
            raise OSError(28, "No space left on device (injected)")

    memtier._FAIL_FINISH = fail
    model = Sharded(ws)
    error = None
    with _mgr(tmp, root, rank, persist_every=100) as mgr:
        for s in (1, 2, 3):
            model.set_step(s)
            assert mgr.save(s, model)
        try:
            mgr.wait_until_finished()
        except CheckpointError as e:
            error = str(e)
    path = os.path.join(tmp, f"node{rank}")
    held = {d: sorted(os.listdir(os.path.join(path, d))) for d in os.listdir(path) if d != SPARE_DIRNAME}
    with open(os.path.join(path, "step_00000002", SAFE_FILENAME)) as f:
        record = json.load(f)
    return {"error": error, "held": held, "record2": record}


def test_a_copy_failing_mid_step_leaves_the_previous_safe_step_restorable(tmp_path) -> None:
    """A copy of step 3 that fails on one node fails step 3's save on every rank (no rank waits
    for the others), marks step 3 safe on no node, keeps step 2 (safe) on every node, and
    leaves no part file. Node 1 lost: its file of step 3 exists nowhere else, so the survivors
    restore step 2 from memory, bit-exact."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    out = run_ranks(3, _train_failing_copy, tmp, root)
    for o in out:
        assert o["error"] is not None and "injected" in o["error"]
        assert sorted(o["held"]) == ["step_00000002", "step_00000003"]
        assert SAFE_FILENAME in o["held"]["step_00000002"] and SAFE_FILENAME not in o["held"]["step_00000003"]
        assert not [f for files in o["held"].values() for f in files if f.endswith(".part")]
        assert o["record2"]["safe"] is True and o["record2"]["step"] == 2
    assert not [f for f in out[2]["held"]["step_00000003"] if "shard-r00001" in f]  # the failed copy is gone
    _lose(tmp, 1)
    got = run_ranks(2, _restore, tmp, root, [0, 2])
    for g in got:
        assert (g["step"], g["tier"]) == (2, "memory"), g


def test_two_nodes_of_two_ranks_lose_one_restore_on_three_ranks(tmp_path) -> None:
    """2 nodes of 2 ranks: node 1 lost, node 0 alone holds every file (its own and node 1's
    copies); a job of 3 ranks, two on node 0 and the first on a new, empty node 3, restores
    from node 0's memory (the first rank receives metadata.json and its files from there),
    nothing from the durable tier."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    out = run_ranks(4, _train, tmp, root, [0, 0, 1, 1], [0, 1], 100)
    assert all(o["durable"] == [0] for o in out)
    _lose(tmp, 1)
    _drop_durable_data(root)
    got = run_ranks(3, _restore, tmp, root, [3, 0, 0])
    assert [(g["step"], g["tier"]) for g in got] == [(1, "memory")] * 3
    assert got[0]["peer"] > 0 and got[0]["local"] == 0
    assert got[1]["peer"] == got[2]["peer"] == 0 and got[1]["local"] > 0


def test_memory_incomplete_falls_back_to_durable_and_says_why(tmp_path) -> None:
    """Nodes 2 and 3 lost together: rank 2's file was only there, so memory holds no complete
    step; the restore reads the durable tier's newest step (2) and says why."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    run_ranks(4, _train, tmp, root, [0, 1, 2, 3], [1, 2, 3], 2)
    _lose(tmp, 2)
    _lose(tmp, 3)
    got = run_ranks(2, _restore, tmp, root, [0, 1])
    for g in got:
        assert (g["step"], g["tier"], g["peer"]) == (2, "durable", 0)
        assert g["why"] == "the surviving nodes' memory does not hold any step whole (steps seen in memory: [3])"


def test_restart_on_the_same_node_finds_tier_0(tmp_path) -> None:
    """One node, one rank: nothing durable (persist_every not reached); a new process on the
    same node restores the newest step from the node's memory directory."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    out = run_ranks(1, _train, tmp, root, [0], [5, 6], 100)
    assert out[0]["durable"] == [] and out[0]["held"] == ["step_00000006"]
    assert out[0]["record"]["safe"] is False  # one node: no copy elsewhere
    (g,) = run_ranks(1, _restore, tmp, root, [0])
    assert (g["step"], g["tier"], g["peer"]) == (6, "memory", 0) and g["local"] > 0


def _flip_data_byte(path: str) -> None:
    """XOR a byte of the first chunk of the safetensors file at ``path`` (after its header)."""
    with open(path, "r+b") as f:
        n = int.from_bytes(f.read(8), "little")
        f.seek(8 + n + 1)
        b = f.read(1)
        f.seek(8 + n + 1)
        f.write(bytes([b[0] ^ 0x5A]))


def test_a_damaged_byte_in_memory_is_caught_and_the_durable_tier_restores(tmp_path) -> None:
    """Every byte read from memory is checked: one flipped byte in a file both copies of which
    are damaged makes the restore fall back to the durable tier, every rank together, saying why."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    run_ranks(2, _train, tmp, root, [0, 1], [1, 2, 3], 2)
    for node in (0, 1):
        d = os.path.join(tmp, f"node{node}", "step_00000003")
        (name,) = [f for f in os.listdir(d) if f.startswith("shard-r00000-")]
        _flip_data_byte(os.path.join(d, name))
    got = run_ranks(2, _restore, tmp, root, [0, 1])
    for g in got:
        assert (g["step"], g["tier"]) == (2, "durable")
        assert g["why"].startswith("restoring step 3 from memory failed: "), g["why"]
        assert "checksum mismatch" in g["why"] or "corrupt" in g["why"].lower(), g["why"]


def _signal_run(rank, ws, tmp, root):
    import signal

    model = Sharded(ws)
    with _mgr(tmp, root, 0, persist_every=100, save_on_signal=signal.SIGTERM) as mgr:
        for s in (1, 2, 3):
            model.set_step(s)
            mgr.save(s, model)
            if s == 1:
                os.kill(os.getpid(), signal.SIGTERM)  # the preemption notice: the next save goes to the durable root too
        mgr.wait_until_finished()
        return mgr.all_steps(), mgr.signal_received


def test_sigterm_persists_the_next_step_from_memory(tmp_path) -> None:
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    ((steps, received),) = run_ranks(1, _signal_run, tmp, root)
    assert (steps, received) == ([2], True)
    files = sorted(os.listdir(os.path.join(root, "step_00000002")))
    assert files[0] == "metadata.json" and len(files) == 2 and files[1].startswith("shard-r00000-"), files
    # tier 0 and tier 2 hold the same bytes, and the ordinary verify checks either
    mem = os.path.join(tmp, "node0", "step_00000003")
    for d in (os.path.join(root, "step_00000002"), mem):
        report = verify(d)
        assert report.ok and report.files == 1 and report.chunks == len(SHAPES), (d, report)
    assert sorted(os.listdir(mem)) == sorted(["metadata.json", SAFE_FILENAME, *[f for f in os.listdir(mem) if f.startswith("shard-")]])


def _back_run(rank, ws, tmp, root):
    model = Sharded(ws)
    with _mgr(tmp, root, 0, persist_every=2) as mgr:
        for s in (1, 2, 3, 4, 5):
            model.set_step(s)
            mgr.save(s, model)
    with _mgr(tmp, root, 0, persist_every=2) as mgr:
        step = mgr.restore(2, model=model)
        _check_step(model.fulls(), 2)
        held = sorted(n for n in os.listdir(os.path.join(tmp, "node0")) if n != SPARE_DIRNAME)
        return step, mgr.last_restore.tier, mgr.last_restore.why, held


def test_going_back_to_an_older_step_forgets_the_newer_ones_in_memory(tmp_path) -> None:
    """restore(2) when memory holds step 5: step 2 comes from the durable tier, and step 5 leaves
    memory, so that a crash after saving step 3 again never restores the abandoned run's step 5."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    ((step, tier, why, held),) = run_ranks(1, _back_run, tmp, root)
    assert (step, tier, held) == (2, "durable", [])
    assert why == "the surviving nodes' memory does not hold step 2 whole (steps seen in memory: [5])"


def _bytes_of(model, optim) -> dict[str, bytes]:
    """Every parameter and momentum buffer, whole, as bytes (plain values cross process bounds)."""
    out = {}
    for name, p in model.named_parameters():
        out[name] = p.detach().full_tensor().numpy().tobytes()
        out[f"{name}.momentum"] = optim.state[p]["momentum_buffer"].full_tensor().numpy().tobytes()
    return out


def _optim_run(rank, ws, tmp, root, nodes, phase):
    model = Sharded(ws)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=1, gamma=0.5)
    with _mgr(tmp, root, nodes[rank], persist_every=100, replica_groups=[[0, 1], [2, 3]] if len(set(nodes)) == 4 else None) as mgr:
        if phase == "train":
            for s in (1, 2):
                model.set_step(s)
                for p in model.parameters():
                    p.grad = torch.ones_like(p) * s
                optim.step()
                sched.step()
                mgr.save(s, model, optim, extra={"sched": sched})
            mgr.wait_until_finished()
            return _bytes_of(model, optim), sched.state_dict()["last_epoch"]
        step = mgr.restore(model=model, optim=optim, extra={"sched": sched})
        return step, mgr.last_restore.tier, mgr.last_restore.peer_bytes, _bytes_of(model, optim), sched.state_dict()["last_epoch"]


def test_model_optimizer_and_extra_state_from_peers_memory_with_replica_groups(tmp_path) -> None:
    """4 nodes in replica groups [[0, 1], [2, 3]]: model, SGD momentum and an LR scheduler saved
    at steps 1 and 2; nodes 1 and 3 lost (one per group); 3 ranks on nodes 0 and 2 restore all of
    it bit-exact from memory, receiving from the other node what theirs lacks."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    saved = run_ranks(4, _optim_run, tmp, root, [0, 1, 2, 3], "train")
    want, epoch = saved[0]
    assert epoch == 2 and all(s == saved[0] for s in saved)
    _lose(tmp, 1)
    _lose(tmp, 3)
    got = run_ranks(3, _optim_run, tmp, root, [0, 0, 2], "restore")
    # rows 6-11 of w go to the second rank, on node 0: rows 8-11 were rank 2's, held on node 2 only
    assert got[1][2] > 0
    for step, tier, _peer, values, last_epoch in got:
        assert (step, tier, last_epoch) == (2, "memory", 2)
        assert values.keys() == want.keys()
        for k in want:
            assert values[k] == want[k], k


# --- placement and planning: pure functions ------------------------------------------------------


def test_replica_placement_ring_and_groups() -> None:
    assert replica_nodes([0, 0, 1, 1, 2, 2], 1) == {0: [1], 1: [2], 2: [0]}
    assert replica_nodes([0, 1, 2], 2) == {0: [1, 2], 1: [2, 0], 2: [0, 1]}
    assert replica_nodes([0], 1) == {0: []}
    assert replica_nodes([0, 1, 2, 3], 1, [[0, 1], [2, 3]]) == {0: [1], 1: [0], 2: [3], 3: [2]}
    with pytest.raises(CheckpointError) as e:
        replica_nodes([0, 1, 2], 1, [[0, 1]])
    assert str(e.value) == (
        "CheckpointManager: replica_groups [[0, 1]] do not name node(s) [2] of the job's nodes [0, 1, 2]; every node must be in one group"
    )
    with pytest.raises(CheckpointError) as e:
        replica_nodes([0, 1], 1, [[0, 1], [1]])
    assert str(e.value) == "CheckpointManager: replica_groups: node 1 is in group 0 and in group 1"


def test_replication_and_fetch_plans() -> None:
    nodes = [0, 0, 1, 1]
    files = [("a", 10), ("b", 20), None, ("d", 40)]
    plan = replication_plan(nodes, files, replica_nodes(nodes, 1))
    assert plan == [Transfer("a", 10, 0, 2), Transfer("b", 20, 1, 3), Transfer("d", 40, 3, 1)]
    # the fetches go to the holder with the least to send so far
    holders = {"a": [0, 1], "b": [0, 1]}
    sizes = {"a": 10, "b": 20}
    assert fetch_plan([0, 1, 2], [[], [], ["a", "b"]], holders, sizes) == [Transfer("a", 10, 0, 2), Transfer("b", 20, 1, 2)]


def test_newest_complete_step_needs_every_file_whole() -> None:
    named = {"a": 10, "b": 20}
    inv = {
        0: {4: (named, {"a": 10}, True), 5: (named, {"a": 10}, False)},
        1: {4: (None, {"b": 20}, True), 5: (None, {"b": 19}, False)},  # step 5's b is cut short
    }
    assert newest_complete_step(inv) == 4
    assert newest_complete_step(inv, below=3) is None


def test_memory_dir_true_is_a_directory_under_dev_shm_named_after_root(tmp_path) -> None:
    root = str(tmp_path / "d")
    want = default_memory_dir(os.path.abspath(root))
    assert os.path.dirname(want) == "/dev/shm" and os.path.basename(want).startswith("shardsafe-")
    try:
        model = torch.nn.Linear(3, 2)
        with CheckpointManager(root, memory_dir=True) as mgr:
            assert mgr.save(7, model)
        assert sorted(os.listdir(want)) == [SPARE_DIRNAME, "step_00000007"]
        with CheckpointManager(root, memory_dir=True) as mgr:
            assert mgr.restore(model=model) == 7 and mgr.last_restore.tier == "memory"
    finally:
        shutil.rmtree(want, ignore_errors=True)




# --- the copies stream while tier 0 is written ---------------------------------------------------


def _copy_before_commit(rank, ws, tmp, root):
    """2 nodes of one rank, step 1. Rank 0's writing thread, with its file complete, waits (in
    its progress callback, before any commit) until rank 1 has found, in its own node's
    directory, a whole copy of that file under a .part name; rank 1's, once its own file and
    rank 0's are complete, waits for that copy."""
    import time
    from datetime import timedelta

    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    step0 = os.path.join(tmp, "node0", "step_00000001")
    step1 = os.path.join(tmp, "node1", "step_00000001")
    seen: list[str] = []

    def progress(done: int, total: int) -> None:
        if done < total or seen:
            return
        seen.append("done")
        if rank == 0:
            store.set("test: rank 0 wrote its file", "1")
            store.wait(["test: rank 1 holds rank 0's file"], timedelta(seconds=60))
            return
        store.wait(["test: rank 0 wrote its file"], timedelta(seconds=60))
        (name,) = [f for f in os.listdir(step0) if f.startswith("shard-r00000-") and f.endswith(".safetensors")]
        with open(os.path.join(step0, name), "rb") as f:
            want = f.read()
        deadline = time.monotonic() + 60
        while True:
            try:
                with open(os.path.join(step1, name + ".part"), "rb") as f:
                    if f.read() == want:
                        break
            except FileNotFoundError:
                pass
            assert time.monotonic() < deadline, f"no whole copy of {name} on node 1 before the commit"
            time.sleep(0.01)
        assert "metadata.json" not in os.listdir(step0)  # tier 0 has not committed
        seen.append(name)
        store.set("test: rank 1 holds rank 0's file", "1")

    model = Sharded(ws)
    model.set_step(1)
    with _mgr(tmp, root, rank, persist_every=100) as mgr:
        assert mgr.save(1, model, progress=progress)
        mgr.wait_until_finished()
    return seen, _safe(tmp, rank, 1), sorted(os.listdir(step1 if rank == 1 else step0))


def test_a_copy_is_received_while_tier_0_is_written_and_committed_after(tmp_path) -> None:
    """The copy of rank 0's file reaches node 1 (as a .part file, bit for bit) before tier 0
    commits, and is renamed once it has: the copies no longer wait for the commit to start."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    (seen0, safe0, _), (seen1, safe1, held1) = run_ranks(2, _copy_before_commit, tmp, root)
    assert seen0 == ["done"] and seen1[0] == "done" and seen1[1].startswith("shard-r00000-")
    assert (safe0, safe1) == (True, True)
    assert seen1[1] in held1 and not [f for f in held1 if f.endswith(".part")], held1


def _write_failing_mid_file(rank, ws, tmp, root):
    """3 nodes of one rank, 4 MiB per rank (several blocks): at step 2 rank 1's write fails half
    way through its file (its progress callback raises), while its copy streams to node 2."""
    big = {k: torch.randn(1 << 20) for k in ("x", "y")}  # 8 MiB of this rank's own
    torch.manual_seed(rank)

    def progress(done: int, total: int) -> None:
        if rank == 1 and 0 < done < total and done >= total // 2:
            raise OSError(5, "Input/output error (injected)")

    model = Sharded(ws)
    error = None
    with _mgr(tmp, root, rank, persist_every=100) as mgr:
        for s in (1, 2, 3):
            model.set_step(s)
            assert mgr.save(s, model, extra={"big": _Tensors(big)}, progress=progress if s == 2 else None)
            try:
                mgr.wait_until_finished()
            except CheckpointError as e:
                error = (s, str(e))
    path = os.path.join(tmp, f"node{rank}")
    parts = [f for dp, _, fs in os.walk(path) for f in fs if f.endswith(".part")]
    return error, parts, _safe(tmp, rank, 2), _safe(tmp, rank, 3)


class _Tensors:
    def __init__(self, d: dict) -> None:
        self.d = d

    def state_dict(self) -> dict:
        return dict(self.d)

    def load_state_dict(self, sd: dict) -> None:
        self.d = dict(sd)


def test_a_write_failing_mid_file_fails_every_rank_and_leaves_no_part_file(tmp_path) -> None:
    """Rank 1's tier-0 write fails half way through its file at step 2: the blocks it cannot
    send go as zeros (node 2 waits for every block announced), step 2 fails on every rank with
    rank 1's error, no .part file is left on any node, and step 3 saves and is safe."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    for error, parts, safe2, safe3 in run_ranks(3, _write_failing_mid_file, tmp, root):
        assert error is not None and error[0] == 2 and "Input/output error (injected)" in error[1], error
        assert parts == [] and safe2 is None and safe3 is True


# --- the caller's thread: no collective -------------------------------------------------------------


class _Count:
    """A stateful extra object; ``fail`` makes its state_dict() raise (a broken object on one rank)."""

    def __init__(self, n: int, fail: bool = False) -> None:
        self.n, self.fail = n, fail

    def state_dict(self) -> dict:
        if self.fail:
            raise ValueError("state_dict broke (injected)")
        return {"n": self.n}

    def load_state_dict(self, sd: dict) -> None:
        self.n = sd["n"]


def _safe(tmp: str, node: int, step: int) -> bool | None:
    path = os.path.join(tmp, f"node{node}", f"step_{step:08d}", SAFE_FILENAME)
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)["safe"]


def _save_before_the_others_call(rank, ws, tmp, root):
    """Rank 0's save(1) returns before rank 1 has called save at all (rank 1 waits, through the
    store, for rank 0 to say it returned): the caller's thread meets no other rank."""
    import dataclasses
    from datetime import timedelta

    import torch.distributed as dist

    from shardsafe.knobs import KNOBS

    store = dist.distributed_c10d._get_default_store()
    model = Sharded(ws)
    model.set_step(1)
    with _mgr(tmp, root, rank, persist_every=100, knobs=dataclasses.replace(KNOBS, collective_timeout_s=20)) as mgr:
        if rank == 0:
            assert mgr.save(1, model)
            store.set("test: rank 0's save returned", "1")
        else:
            store.wait(["test: rank 0's save returned"], timedelta(seconds=40))
            assert mgr.save(1, model)
        mgr.wait_until_finished()
    return _safe(tmp, rank, 1)


def test_save_returns_before_the_other_ranks_call_it(tmp_path) -> None:
    """With the memory tier, save() runs no collective in the caller's thread (the check-in and
    the comparison of extra names happen in the background save's first gather): rank 0's save
    returns while rank 1 has not called save yet, and the step is then safe on both nodes."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    assert run_ranks(2, _save_before_the_others_call, tmp, root) == [True, True]


def _different_extra_names(rank, ws, tmp, root):
    model = Sharded(ws)
    with _mgr(tmp, root, rank, persist_every=100) as mgr:
        model.set_step(1)
        assert mgr.save(1, model, extra={"a": _Count(rank)} if rank == 0 else None)  # returns: checked in the background
        with pytest.raises(RankMismatchError) as e:
            mgr.wait_until_finished()
        d = os.path.join(tmp, f"node{rank}", "step_00000001")
        held1 = sorted(os.listdir(d)) if os.path.isdir(d) else []
        model.set_step(2)
        assert mgr.save(2, model, extra={"a": _Count(rank)})
        mgr.wait_until_finished()
    return str(e.value), held1, _safe(tmp, rank, 2)


def test_different_extra_names_fail_every_rank_before_anything_commits(tmp_path) -> None:
    """Ranks passing different extra names: every rank raises RankMismatchError naming them (at
    the next call that waits for the save), no tier-0 metadata.json is written, and the next
    step saves and is safe."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    out = run_ranks(2, _different_extra_names, tmp, root)
    want = "CheckpointManager.save: step 1: every rank must pass the same extra names (rank 0: ['a']; rank 1: [])"
    for message, held1, safe2 in out:
        assert message == f"1 rank(s) failed: rank 0: RankMismatchError: {want}"
        assert "metadata.json" not in held1, held1
        assert safe2 is True


def _broken_extra_on_rank_1(rank, ws, tmp, root):
    from shardsafe.errors import CollectiveError

    model = Sharded(ws)
    with _mgr(tmp, root, rank, persist_every=100) as mgr:
        model.set_step(1)
        if rank == 1:
            with pytest.raises(ValueError, match=r"state_dict broke \(injected\)"):
                mgr.save(1, model, extra={"c": _Count(rank, fail=True)})
            error = None
        else:
            assert mgr.save(1, model, extra={"c": _Count(rank)})
            with pytest.raises(CollectiveError) as e:
                mgr.wait_until_finished()
            error = str(e.value)
        model.set_step(2)
        assert mgr.save(2, model, extra={"c": _Count(rank)})
        mgr.wait_until_finished()
    return error, os.path.exists(os.path.join(tmp, f"node{rank}", "step_00000001", "metadata.json")), _safe(tmp, rank, 2)


def test_an_extra_object_failing_on_one_rank_fails_the_others_at_once(tmp_path) -> None:
    """An extra object whose state_dict() raises on rank 1: rank 1's save raises it; rank 0's
    save has returned and its background check-in fails at once with rank 1's reason (no wait
    for the timeout); nothing of step 1 commits, and step 2 saves and is safe."""
    tmp, root = str(tmp_path / "mem"), str(tmp_path / "durable")
    (error0, meta0, safe0), (error1, meta1, safe1) = run_ranks(2, _broken_extra_on_rank_1, tmp, root)
    assert error1 is None
    assert error0 == (
        "shardsafe.CheckpointManager.save: rank 1 gave up this call before checking in, so it cannot complete: "
        "ValueError: state_dict broke (injected)"
    )
    assert (meta0, meta1) == (False, False) and (safe0, safe1) == (True, True)


# --- bad input -------------------------------------------------------------------------------------


def test_bad_arguments(tmp_path) -> None:
    root = str(tmp_path / "d")
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(root, memory_dir=str(tmp_path / "m"), replicas=-1)
    assert str(e.value) == "CheckpointManager: replicas must be >= 0 (copies of each step on other nodes), got -1"
    with pytest.raises(TypeError) as e:
        CheckpointManager(root, memory_dir=str(tmp_path / "m"), replicas=True)
    assert str(e.value) == "CheckpointManager: argument 'replicas' must be an int, got bool True"
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(root, memory_dir="s3://bucket/x")
    assert str(e.value) == "CheckpointManager: memory_dir must be a local directory (a tmpfs such as /dev/shm/...), got the URL 's3://bucket/x'"
    with pytest.raises(CheckpointError) as e:
        CheckpointManager(root, memory_dir=str(tmp_path / "m"), persist_every=0)
    assert str(e.value) == "CheckpointManager: persist_every must be a positive integer or None, got 0"
    with pytest.raises(TypeError) as e:
        CheckpointManager(root, memory_dir=False)
    assert str(e.value) == (
        "CheckpointManager: argument 'memory_dir' must be a local path (a tmpfs such as /dev/shm/...), True (a directory under "
        "/dev/shm named after root) or None, got bool False"
    )
    with pytest.raises(TypeError) as e:
        CheckpointManager(root, memory_dir=str(tmp_path / "m"), node=1.5)
    assert str(e.value) == "CheckpointManager: argument 'node' must be an int, a str or None, got float 1.5"


def test_a_spare_larger_or_smaller_than_the_new_file_is_overwritten_and_cut_to_length(tmp_path) -> None:
    """Tier 0's write and a received copy go into the pool's files: the result holds exactly the
    new bytes (a spare longer than them is cut, a shorter one grows), and the pool empties."""
    from shardsafe.memtier import _Receiving
    from shardsafe.storage import open_storage

    pool = tmp_path / SPARE_DIRNAME
    pool.mkdir()
    (pool / "a").write_bytes(b"\xff" * 5000)
    (pool / "b").write_bytes(b"\xee" * 10)

    def claim(path: str) -> bool:
        names = sorted(os.listdir(pool))
        if not names:
            return False
        os.rename(pool / names[0], path)
        return True

    storage = open_storage(str(tmp_path / "step"))
    storage.reuse = claim
    new = bytes(range(256)) * 7
    with storage.write_file("x.safetensors") as w:
        w.write(memoryview(new[:1000]))
        w.write(memoryview(new[1000:]))
    assert (tmp_path / "step" / "x.safetensors").read_bytes() == new  # 1792 bytes from a 5000-byte spare
    r = _Receiving(str(tmp_path / "step" / "y.safetensors"), 300, claim)  # from the 10-byte spare
    r.tensor.copy_(torch.arange(300, dtype=torch.int32).to(torch.uint8))
    r.finish()
    assert (tmp_path / "step" / "y.safetensors").read_bytes() == bytes(i % 256 for i in range(300))
    assert os.listdir(pool) == []
    r = _Receiving(str(tmp_path / "step" / "z.safetensors"), 64, claim)  # the pool is empty: a new file
    r.tensor.fill_(7)
    r.finish()
    assert (tmp_path / "step" / "z.safetensors").read_bytes() == b"\x07" * 64
