"""CheckpointManager: step directories, latest, retention, one-commit saves of model + optimizer +
extra state, bit-exact resume (RNG included), resume on other world sizes with FSDP2, cleanup of
uncommitted steps, preemption signals across ranks, and an S3 root (moto)."""

from __future__ import annotations

import logging
import math
import os
import random
import shutil
import signal
import struct
import sys
import uuid

import numpy as np
import pytest
import torch

import shardsafe
from shardsafe import (
    CheckpointError,
    CheckpointExistsError,
    CheckpointManager,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    MissingKeyError,
    RankMismatchError,
    RNGState,
    ShapeMismatchError,
    StorageError,
)
from shardsafe.dist import collective_counts
from shardsafe.storage import open_storage

from .distributed import run_ranks
from .servers import fresh

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "examples"))

pytestmark = pytest.mark.xdist_group("manager")


class Position:
    """A data position with tensor state and values JSON alone cannot hold."""

    def __init__(self, offset: int = 0) -> None:
        self.index = offset
        self.seen = torch.zeros(4, dtype=torch.int64)
        self.odd = {"inf": float("inf"), 3: (1.5, float("nan")), "$tag": np.int32(7), "arr": np.arange(3.0)}

    def advance(self, n: int) -> None:
        self.index += n
        self.seen[self.index % 4] += n
        self.odd["arr"] = self.odd["arr"] + n

    def state_dict(self) -> dict:
        return {"index": self.index, "seen": self.seen, "odd": self.odd}

    def load_state_dict(self, sd: dict) -> None:
        self.index, self.seen, self.odd = sd["index"], sd["seen"].clone(), sd["odd"]


def _draws() -> list:
    return [torch.rand(3).tolist(), random.random(), float(np.random.rand())]


def _seed(s: int) -> None:
    torch.manual_seed(s)
    random.seed(s)
    np.random.seed(s)


def _setup(seed: int = 0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    optim = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(optim, step_size=2, gamma=0.5)
    return model, optim, sched, Position()


def _train_step(model, optim, sched, pos, step: int) -> float:
    g = torch.Generator().manual_seed(step)
    x = torch.randn(5, 8, generator=g) + torch.rand(1)  # also consumes the global generator
    loss = model(x).square().mean()
    loss.backward()
    optim.step()
    optim.zero_grad()
    sched.step()
    pos.advance(5)
    return loss.item()


def _extra(sched, pos) -> dict:
    return {"sched": sched, "data": pos, "rng": RNGState()}


# --- single process -----------------------------------------------------------------------------------


def test_steps_latest_retention_and_what_is_on_disk(tmp_path) -> None:
    model, optim, sched, pos = _setup()
    with CheckpointManager(tmp_path, keep_last=2, keep_every=4, save_interval=2) as mgr:
        assert (mgr.latest_step(), mgr.all_steps()) == (None, [])
        saved = []
        for step in range(1, 12):
            _train_step(model, optim, sched, pos, step)
            assert mgr.should_save(step) == (step % 2 == 0)
            if mgr.save(step, model, optim, extra=_extra(sched, pos)):
                saved.append(step)
                assert step not in mgr.all_steps()  # in flight until a call waits for it
        assert saved == [2, 4, 6, 8, 10]
        mgr.wait_until_finished()
        # keep_last=2 keeps 8 and 10, keep_every=4 keeps 4 and 8; 2 and 6 are deleted after later commits
        assert mgr.all_steps() == [4, 8, 10] and mgr.latest_step() == 10
    assert sorted(os.listdir(tmp_path)) == ["step_00000004", "step_00000008", "step_00000010"]
    again = CheckpointManager(str(tmp_path))  # a new manager finds the same steps
    assert again.all_steps() == [4, 8, 10]
    assert not again.should_save(10) and again.should_save(11) is False
    again.close()


def test_retention_keeps_the_newest_and_the_step_just_saved(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path, keep_last=1, async_save=False) as mgr:
        mgr.save(10, model, force=True)
        mgr.save(5, model, force=True)  # an older step number: kept beside the newest until a newer commit
        assert mgr.all_steps() == [5, 10]
        mgr.save(11, model, force=True)
        assert mgr.all_steps() == [11]
    assert os.listdir(tmp_path) == ["step_00000011"]


def test_should_save_and_existing_steps(tmp_path) -> None:
    model, optim, sched, pos = _setup()
    mgr = CheckpointManager(tmp_path, save_interval=5, async_save=False)
    assert [s for s in range(12) if mgr.should_save(s)] == [0, 5, 10]
    assert mgr.save(3, model) is False and mgr.all_steps() == []
    assert mgr.save(3, model, force=True) is True and mgr.all_steps() == [3]  # synchronous: committed on return
    assert mgr.save(5, model) is True and mgr.save(5, model) is False  # a saved step is not saved again
    with pytest.raises(CheckpointExistsError, match=r"step_00000005: step 5 is already committed; a manager never replaces a step"):
        mgr.save(5, model, force=True)
    assert mgr.all_steps() == [3, 5]
    mgr.close()
    with pytest.raises(CheckpointError, match=r"CheckpointManager.save: the manager of .* is closed"):
        mgr.save(6, model)
    mgr.close()  # idempotent


def test_restore_is_bit_exact_latest_and_given_step(tmp_path) -> None:
    """Uninterrupted: 8 steps, drawing random numbers after each. Interrupted: a save at 3 and 6,
    then fresh objects (other seeds) restored from 6 and from 3: the same losses, parameters,
    optimizer and scheduler state, data position, and random numbers."""
    _seed(1)
    model, optim, sched, pos = _setup()
    losses, draws = [], []
    with CheckpointManager(tmp_path, save_interval=3) as mgr:
        for step in range(1, 9):
            losses.append(_train_step(model, optim, sched, pos, step))
            mgr.save(step, model, optim, extra=_extra(sched, pos))
            draws.append(_draws())
    final = [p.detach().clone() for p in model.parameters()]
    assert mgr.all_steps() == [3, 6]

    for start in (None, 3):
        _seed(99)
        model2, optim2, sched2, pos2 = _setup(seed=5)
        with CheckpointManager(tmp_path) as mgr2:
            got = mgr2.restore(start, model2, optim2, extra=_extra(sched2, pos2))
        k = 6 if start is None else 3
        assert got == k
        assert sched2.state_dict() == {**sched.state_dict(), "last_epoch": k, "_step_count": k + 1, "_last_lr": [1e-2 * 0.5 ** (k // 2)]}
        assert pos2.index == 5 * k and pos2.odd["$tag"] == np.int32(7) and type(pos2.odd["$tag"]) is np.int32
        assert math.isnan(pos2.odd[3][1]) and pos2.odd[3][0] == 1.5 and pos2.odd["inf"] == float("inf")
        assert pos2.odd["arr"].tolist() == [5.0 * k, 5.0 * k + 1, 5.0 * k + 2]
        assert draws[k - 1] == _draws()  # the numbers drawn right after step k, again
        for step in range(k + 1, 9):
            assert _train_step(model2, optim2, sched2, pos2, step) == losses[step - 1]
            assert _draws() == draws[step - 1]
        assert all(torch.equal(a, b) for a, b in zip(model2.parameters(), final))
        assert torch.equal(pos2.seen, pos.seen)


def test_restore_errors(tmp_path) -> None:
    model, optim, sched, pos = _setup()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        assert mgr.restore(model=model) is None  # nothing committed yet: nothing loaded
        mgr.save(2, model, optim, extra={"sched": sched}, force=True)
        with pytest.raises(IncompleteCheckpointError, match=r"step_00000004: no committed checkpoint of step 4 under .* \(committed steps: \[2\]\)"):
            mgr.restore(4, model)
        with pytest.raises(MissingKeyError, match=r"the checkpoint holds no extra state named 'data' \(it holds \['sched'\]\)"):
            mgr.restore(model=model, extra={"data": pos})
        with pytest.raises(CheckpointError, match=r"optim was given without its model"):
            mgr.restore(optim=optim)
        with pytest.raises(TypeError, match=r"extra\['data'\] is a list, which has no state_dict or load_state_dict\(\)"):
            mgr.save(3, model, extra={"data": []}, force=True)
        with pytest.raises(CheckpointError, match=r"extra\['bad'\].state_dict\(\)\['f'\]: a value of type function cannot be stored; .*\(nothing is pickled\)"):
            mgr.save(3, model, extra={"bad": _Holds(lambda: 0)}, force=True)
        with pytest.raises(TypeError, match=r"argument 'step' must be an int, got float 3.0"):
            mgr.save(3.0, model)
        with pytest.raises(CheckpointError, match=r"CheckpointManager.save: step must be >= 0, got -1"):
            mgr.save(-1, model)
        assert mgr.all_steps() == [2]
    with pytest.raises(CheckpointError, match=r"CheckpointManager: keep_last must be a positive integer or None, got 0"):
        CheckpointManager(tmp_path, keep_last=0)
    with pytest.raises(TypeError, match=r"argument 'save_interval' must be a int or None, got str '5'"):
        CheckpointManager(tmp_path, save_interval="5")
    with pytest.raises(TypeError, match=r"argument 'save_on_signal' must be a signal number"):
        CheckpointManager(tmp_path, save_on_signal="TERM")


def _first_data_byte(step_dir) -> None:
    """Flip the first byte of the first tensor's data in the step's (first) data file: its
    metadata.json still checks out, the damage is found when the bytes are read."""
    name = sorted(n for n in os.listdir(step_dir) if n.endswith(".safetensors"))[0]
    _first_data_byte_of(os.path.join(step_dir, name))


def _first_data_byte_of(path) -> None:
    with open(path, "r+b") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        f.seek(8 + n)
        b = f.read(1)
        f.seek(8 + n)
        f.write(bytes([b[0] ^ 0x5A]))


def _filled(model, step: int) -> dict:
    with torch.no_grad():
        for i, p in enumerate(model.parameters()):
            p.copy_(torch.arange(p.numel(), dtype=p.dtype).view(p.shape) * step + i)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_hand_made_damaged_and_half_deleted_steps_are_not_counted_and_never_kept_over_real_ones(tmp_path, caplog) -> None:
    """Issue 22 item 7: a step counts only when its metadata.json checks out against its own
    checksum and names no missing file; retention (keep_last=2) then deletes real step 1 only,
    never real steps to keep the hand-made ones, which it leaves in place."""
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, model, force=True)
        mgr.save(2, model, force=True)
    real = tmp_path / "step_00000002"
    made = tmp_path / "step_00000003"  # hand-made: any metadata.json
    made.mkdir()
    (made / "metadata.json").write_text("{}")
    edited = tmp_path / "step_00000004"  # a copy whose metadata.json was edited by hand (checksum not redone)
    shutil.copytree(real, edited)
    raw = (edited / "metadata.json").read_bytes()
    (edited / "metadata.json").write_bytes(raw.replace(b'"float32"', b'"float64"', 1))
    half = tmp_path / "step_00000005"  # half deleted by hand: a data file gone, metadata.json left
    shutil.copytree(real, half)
    data = [n for n in os.listdir(half) if n.endswith(".safetensors")]
    (half / data[0]).unlink()
    foreign = tmp_path / "step_00000007"  # Megatron-Core's own metadata.json: another library's checkpoint
    foreign.mkdir()
    (foreign / "metadata.json").write_text('{"sharded_backend": "torch_dist"}')
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        mgr = CheckpointManager(tmp_path, keep_last=2, async_save=False)
    assert mgr.all_steps() == [1, 2] and mgr.latest_step() == 2
    damaged = mgr.damaged_steps()
    assert sorted(damaged) == [3, 4, 5, 7]
    assert damaged[3] == f"{made}/metadata.json: invalid checkpoint metadata: format_version must be a positive integer, found None"
    assert damaged[4].startswith(f"{edited}/metadata.json: checksum mismatch: metadata_checksum says "), damaged[4]
    assert damaged[5] == f"{half}/metadata.json names data file(s) {data[0]}, which are missing"
    assert damaged[7].startswith(f"{foreign}/metadata.json: this is Megatron-Core's dist_checkpointing config"), damaged[7]
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    for step in (3, 4, 5, 7):
        assert (f"CheckpointManager: step {step} under {tmp_path} is not counted as committed: {damaged[step]} (left in "
                f"place; a save of step {step} replaces it)") in warned, warned
    assert not mgr.should_save(2) and mgr.should_save(4) is False  # no interval: only counted steps are "taken"
    mgr.save(6, model, force=True)
    assert mgr.all_steps() == [2, 6]  # step 1 went, not step 2 in favour of 3, 4 or 5
    assert sorted(os.listdir(tmp_path)) == [f"step_0000000{s}" for s in (2, 3, 4, 5, 6, 7)]
    mgr.close()


def test_restore_falls_back_to_the_newest_intact_step_and_says_which(tmp_path, caplog) -> None:
    """Issue 22 item 7: restore() of a newest step whose data is damaged restores the step
    before it, logs a WARNING naming both and returns the step it restored; restore(step) of
    the damaged step names it and the newest intact one; a save of that step replaces it."""
    model = torch.nn.Linear(4, 3)
    saved = {}
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        for step in (1, 2, 3):
            saved[step] = _filled(model, step)
            mgr.save(step, model, force=True)
    _first_data_byte(tmp_path / "step_00000003")
    target = torch.nn.Linear(4, 3)

    mgr = CheckpointManager(tmp_path, async_save=False)
    assert mgr.all_steps() == [1, 2, 3]  # its metadata.json checks out: the damage shows when the data is read
    with pytest.raises(CorruptCheckpointError) as raised:
        mgr.restore(3, target)
    msg = str(raised.value)
    assert msg.startswith(
        f"CheckpointManager.restore: step 3 under {tmp_path} is damaged; the newest committed step is 2: restore(step=2), or "
        "restore() for the newest that loads: key 'model.weight': checksum mismatch in chunk "
    ), msg
    assert mgr.all_steps() == [1, 2] and list(mgr.damaged_steps()) == [3]
    mgr.close()

    mgr = CheckpointManager(tmp_path, async_save=False)
    with caplog.at_level(logging.WARNING, logger="shardsafe"):
        assert mgr.restore(model=target) == 2
    assert all(torch.equal(v, saved[2][k]) for k, v in target.state_dict().items())
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith(
        f"CheckpointManager.restore: step 3 under {tmp_path} is damaged (key 'model.weight': checksum mismatch in chunk "
    ), warned
    assert warned[0].endswith("); restoring step 2, the newest older committed step, instead"), warned
    assert mgr.latest_step() == 2 and list(mgr.damaged_steps()) == [3]
    with pytest.raises(ShapeMismatchError):  # not damage: raised as it is, no other step tried
        mgr.restore(model=torch.nn.Linear(4, 5))
    assert mgr.all_steps() == [1, 2]
    # the run goes on from step 2 and saves step 3 again: the damaged directory is replaced
    saved[3] = _filled(model, 30)
    assert mgr.save(3, model, force=True)
    assert mgr.all_steps() == [1, 2, 3] and mgr.damaged_steps() == {}
    mgr.close()
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(model=target) == 3
    assert all(torch.equal(v, saved[3][k]) for k, v in target.state_dict().items())

    for step in (1, 2, 3):
        _first_data_byte(tmp_path / f"step_0000000{step}")
    with CheckpointManager(tmp_path) as mgr, pytest.raises(CorruptCheckpointError) as raised:
        mgr.restore(model=target)
    assert str(raised.value).startswith(
        f"CheckpointManager.restore: step 3, 2, 1 under {tmp_path} are damaged, and no older committed step is left to "
        "restore (damaged steps: [1, 2, 3]): "
    ), str(raised.value)


class _Holds:
    def __init__(self, value) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"f": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["f"]


def test_uncommitted_steps_are_removed_at_start_and_never_latest(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(5, model, force=True)
    crashed = tmp_path / "step_00000009"  # a save that died before its commit: data, no metadata.json
    crashed.mkdir()
    (crashed / "data-00000.safetensors").write_bytes(b"partial")
    (crashed / "metadata.json.tmp-1234").write_bytes(b"{")
    for other in ("step_9", "step_000000010", "notes", "step_00000011.bak"):  # not our names: left alone
        (tmp_path / other).mkdir()
    (tmp_path / "step_00000012").write_bytes(b"a file, not a directory")
    mgr = CheckpointManager(tmp_path)
    assert mgr.latest_step() == 5 and mgr.all_steps() == [5]
    assert sorted(os.listdir(tmp_path)) == ["notes", "step_000000010", "step_00000005", "step_00000011.bak", "step_00000012", "step_9"]
    mgr.close()


def test_a_failed_save_is_raised_once_and_the_manager_goes_on(tmp_path) -> None:
    """The step directory's place is taken by a file, so the save fails: the error comes from
    save() (synchronous engine) or from the next waiting call (background engine), once; the
    step is not listed, and the next save works."""
    model = torch.nn.Linear(2, 2)
    mgr = CheckpointManager(tmp_path, save_interval=1)
    (tmp_path / "step_00000001").write_bytes(b"in the way")
    with pytest.raises(StorageError, match=r"step_00000001"):
        mgr.save(1, model)
        mgr.wait_until_finished()
    mgr.wait_until_finished()  # reported once
    assert mgr.all_steps() == [] and mgr.save(2, model)
    mgr.close()
    assert mgr.all_steps() == [2]


def test_a_signal_requests_a_save_and_the_old_handler_comes_back(tmp_path) -> None:
    before = signal.getsignal(signal.SIGUSR1)
    calls = collective_counts()
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path, save_interval=100, save_on_signal=signal.SIGUSR1) as mgr:
        assert not mgr.should_save(1)
        os.kill(os.getpid(), signal.SIGUSR1)  # recorded, the process goes on
        assert mgr.should_save(1) and mgr.should_save(2) and mgr.signal_received  # until a save is made
        assert mgr.save(2, model)
        assert not mgr.should_save(3) and mgr.signal_received
    assert signal.getsignal(signal.SIGUSR1) is before
    assert collective_counts() == calls  # one process: no collective


def test_extra_names_and_values_are_checked(tmp_path) -> None:
    model = torch.nn.Linear(2, 2)
    with CheckpointManager(tmp_path) as mgr:
        with pytest.raises(CheckpointError, match=r"extra name 'a/b' must be non-empty, without '/'"):
            mgr.save(1, model, extra={"a/b": Position()}, force=True)
        with pytest.raises(CheckpointError, match=r"extra\['loop'\].state_dict\(\)\['f'\](\[0\])+: the state nests deeper than 60 levels"):
            loop: list = []
            loop.append(loop)
            mgr.save(1, model, extra={"loop": _Holds(loop)}, force=True)
        with pytest.raises(CheckpointError, match=r"a torch.distributed.tensor._api.DTensor|only dense"):
            mgr.save(1, model, extra={"sparse": _Holds(torch.eye(2).to_sparse())}, force=True)
        assert mgr.all_steps() == []


# --- distributed: FSDP2 resume on other world sizes -------------------------------------------------------


def _cfg():
    from tiny_llama import LlamaConfig

    return LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=172, max_seq_len=32)


class PerRank:
    """State that differs between ranks and is not RNG: a per-rank shard position."""

    def __init__(self, value: int) -> None:
        self.value = value

    def state_dict(self) -> dict:
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


K, AT = 6, 3  # steps, the step whose checkpoint the tails resume from


def _fsdp_run(rank, ws, root, restore_step, steps, seed):
    """Train ``steps`` with FSDP2, saving every AT steps; with ``restore_step`` (-1: the latest),
    resume by ``restore()`` alone first."""
    from tiny_llama import Transformer, make_optimizer, parallelize, train

    _seed(seed + rank)
    model = parallelize(Transformer(_cfg(), seed=0 if restore_step is None else 1), "fsdp2", ws)
    optim = make_optimizer(model, "adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0 / (1 + s))
    pos, per_rank = Position(), PerRank(1000 + rank)
    logs = _capture_warnings()
    out: dict = {"steps": {}, "at_save": {}}
    with CheckpointManager(root, save_interval=AT, keep_last=2) as mgr:
        if restore_step is not None:
            step = None if restore_step < 0 else restore_step
            if ws > 2:
                with pytest.raises(MissingKeyError, match=rf"extra\['per_rank'\] was saved per rank on 2 rank\(s\), with states that differ between ranks, so rank [23] of {ws} has no state to restore"):
                    mgr.restore(step, model=model, optim=optim, extra={"per_rank": per_rank})
            extra = {"sched": sched, "data": pos, "rng": RNGState()} | ({"per_rank": per_rank} if ws <= 2 else {})
            before = RNGState().state_dict()  # what a rank the save did not have keeps
            out["restored"] = mgr.restore(step, model=model, optim=optim, extra=extra)
            out["after_restore"] = {"draws": _draws(), "sched": sched.state_dict(), "pos": pos.index, "per_rank": per_rank.value}
            RNGState().load_state_dict(before)
            out["kept_draws"] = _draws()
        for step in steps:
            (loss,) = train(model, optim, _cfg(), range(step, step + 1), "fsdp2")
            sched.step()
            pos.advance(8)
            extra = {"sched": sched, "data": pos, "rng": RNGState(), "per_rank": per_rank}
            if mgr.save(step + 1, model, optim, extra=extra):
                out["at_save"][step + 1] = {"draws": _draws(), "sched": sched.state_dict(), "pos": pos.index}
            out["steps"][step] = loss
        mgr.wait_until_finished()
        out["all_steps"] = mgr.all_steps()
    out["warnings"] = logs
    return out


def _capture_warnings() -> list[str]:
    messages: list[str] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    logging.getLogger("shardsafe").addHandler(Keep(logging.WARNING))
    return messages


def test_fsdp2_resume_on_1_and_4_ranks_by_restore_alone(tmp_path) -> None:
    """FSDP2 on 2 ranks, uninterrupted, saves at steps 3 and 6. Resumed from step 3 on 1 rank
    (the latest, once step 6 is gone) and on 4 ranks (step 3 named), the losses are the
    uninterrupted run's to float32 rounding; scheduler and data position, equal on every rank,
    restore everywhere; per-rank state and RNG restore on the ranks that saved them, and a new
    rank keeps its own RNG (the saved ranks' differed) or, for other per-rank state, fails."""
    root = tmp_path / "full"
    full = run_ranks(2, _fsdp_run, str(root), None, range(0, K), 10)
    assert [f["all_steps"] for f in full] == [[AT, K]] * 2
    want_losses = torch.tensor([full[0]["steps"][s] for s in range(AT, K)])
    for ws, restore_step in ((1, -1), (4, AT)):
        copy = tmp_path / f"ws{ws}"
        shutil.copytree(root, copy)
        if restore_step < 0:
            shutil.rmtree(copy / "step_00000006")
        tail = run_ranks(ws, _fsdp_run, str(copy), restore_step, range(AT, K), 20)
        torch.testing.assert_close(torch.tensor([tail[0]["steps"][s] for s in range(AT, K)]), want_losses, rtol=1e-5, atol=0)
        for r, t in enumerate(tail):
            got, want = t["after_restore"], full[min(r, 1)]["at_save"][AT]
            assert t["restored"] == AT
            assert got["sched"] == want["sched"] and got["pos"] == want["pos"] == 8 * AT
            if r < 2:  # its own rank's state
                assert got["draws"] == want["draws"] and got["per_rank"] == 1000 + r
            else:
                assert got["draws"] == t["kept_draws"]
                assert any(f"rank {r} keeps its current RNGState for extra['rng']" in w for w in t["warnings"])
            assert t["all_steps"] == [AT, K]
        if ws == 1:
            assert any("extra['per_rank'] differs between the 2 saved ranks; restoring on 1 rank(s), the state of rank(s) [1] is not restored" in w for w in tail[0]["warnings"])


# --- distributed: signals -------------------------------------------------------------------------------


def _sharded_steps_run(rank, ws, root, phase):
    """Each rank's extra state is a row of its own, filled by step; ``phase`` "save" saves steps
    1-3, "restore" restores the latest and returns the step, the row read and the steps."""
    extra = {"row": _Holds(None)}
    with CheckpointManager(root, async_save=False) as mgr:
        if phase == "save":
            for step in (1, 2, 3):
                extra["row"].value = torch.full((4,), float(10 * step + rank))
                mgr.save(step, extra=extra, force=True)
            return None
        got = mgr.restore(extra=extra)
        return got, extra["row"].value.tolist(), mgr.all_steps(), sorted(mgr.damaged_steps())


def test_two_ranks_fall_back_together_when_only_one_rank_reads_damage(tmp_path) -> None:
    """Only rank 1's extra state of step 3 is damaged: rank 1 finds it, and both ranks restore
    step 2 together (the failure reaches rank 0 as the same class), each its own row."""
    run_ranks(2, _sharded_steps_run, str(tmp_path), "save")
    step3 = tmp_path / "step_00000003"
    files = sorted(n for n in os.listdir(step3) if n.endswith(".safetensors"))
    assert len(files) == 2  # one per rank
    _first_data_byte_of(step3 / files[1])
    got = run_ranks(2, _sharded_steps_run, str(tmp_path), "restore")
    assert got == [(2, [20.0] * 4, [1, 2], [3]), (2, [21.0] * 4, [1, 2], [3])]


def _signal_run(rank, ws, root, sender):
    model = torch.nn.Linear(2, 2)
    seen = []
    with CheckpointManager(root, save_interval=1000, save_on_signal=signal.SIGTERM) as mgr:
        for step in range(1, 6):
            if step == 3 and rank == sender:
                os.kill(os.getpid(), signal.SIGTERM)  # only this rank is told
            due = mgr.should_save(step)
            seen.append((due, mgr.signal_received))
            if mgr.save(step, model):
                assert due
        before = collective_counts()
        mgr.should_save(6)
        after = collective_counts()
        cost = {k: after[k] - before.get(k, 0) for k in after if after[k] != before.get(k, 0)}
    return seen, cost, mgr.all_steps()


@pytest.mark.parametrize("ws", [2, 4])
def test_a_signal_on_one_rank_saves_on_every_rank(tmp_path, ws) -> None:
    results = run_ranks(ws, _signal_run, str(tmp_path), ws - 1)
    for seen, cost, steps in results:
        assert seen == [(False, False), (False, False), (True, True), (False, True), (False, True)]
        assert cost == {"all_reduce": 1}  # one small collective per should_save
        assert steps == [3]


def _no_signal_run(rank, ws, root):
    with CheckpointManager(root, save_interval=2) as mgr:
        before = collective_counts()
        due = [mgr.should_save(s) for s in range(5)]
        local = collective_counts() == before
        with pytest.raises(RankMismatchError, match=r"CheckpointManager.save: step 1: every rank must pass the same extra names \(rank 0: \['a'\]; rank 1: \[\]\)"):
            mgr.save(1, extra={"a": PerRank(rank)} if rank == 0 else None, force=True)
        assert mgr.save(1, extra={"a": PerRank(rank)}, force=True) and mgr.all_steps() == []
        return due, local


def test_without_save_on_signal_should_save_runs_no_collective(tmp_path) -> None:
    """(And ranks passing different extra names are refused on every rank.)"""
    assert run_ranks(2, _no_signal_run, str(tmp_path)) == [([True, False, True, False, True], True)] * 2


# --- S3 -------------------------------------------------------------------------------------------------


def _s3_run(rank, ws, url, env, steps, restore):
    os.environ.update(env)
    _seed(rank)
    model, optim, sched, pos = _setup()
    with CheckpointManager(url, keep_last=2, save_interval=2) as mgr:
        found = mgr.all_steps()
        got = mgr.restore(model=model, optim=optim, extra=_extra(sched, pos)) if restore else None
        for step in steps:
            _train_step(model, optim, sched, pos, step)
            mgr.save(step, model, optim, extra=_extra(sched, pos))
    return found, got, mgr.all_steps(), [p.detach().clone().tolist() for p in model.parameters()], pos.index


@pytest.fixture
def s3():
    yield from fresh("s3")


def test_s3_root(s3) -> None:
    c = s3
    url = c.url()
    first = run_ranks(2, _s3_run, url, c.env, range(1, 8), False)
    assert [f[2] for f in first] == [[4, 6]] * 2
    crashed = open_storage(f"{url}/step_00000009", **c.options)  # a save that died before its commit
    with crashed.write_file("data-00000.safetensors") as w:
        w.write(memoryview(b"partial"))
    again = run_ranks(2, _s3_run, url, c.env, range(7, 9), True)
    for found, got, steps, _, index in again:
        assert (found, got, steps) == ([4, 6], 6, [6, 8])
        assert index == 5 * 8
    root = open_storage(url, **c.options)
    assert root.list_dirs() == ["step_00000006", "step_00000008"]
    # the 2-rank runs train the same data on every rank: the resumed parameters equal the uninterrupted ones
    full = run_ranks(1, _s3_run, c.url(), c.env, range(1, 9), False)
    assert again[0][3] == full[0][3]
    assert shardsafe.unshard_model_state(root.child("step_00000008"), no_dist=True)["0.weight"].tolist() == again[0][3][0]


def test_memory_root_and_a_storage_without_directories() -> None:
    model = torch.nn.Linear(2, 2)
    url = f"memory://manager-{uuid.uuid4().hex}"
    with CheckpointManager(url, keep_last=1, save_interval=1) as mgr:
        for step in range(3):
            mgr.save(step, model)
    assert open_storage(url).list_dirs() == ["step_00000002"]
    with CheckpointManager(url) as again:
        assert again.all_steps() == [2]

    class Flat:  # a Storage with no sub-directories to list
        url = "flat://x"

        def __getattr__(self, name):
            if name in ("write_file", "put_atomic", "read_into", "read", "list", "delete", "close"):
                return lambda *a, **k: None
            raise AttributeError(name)

    with pytest.raises(TypeError, match=r"argument 'root' must be a path, a URL or a storage that lists sub-directories"):
        CheckpointManager(Flat())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_cuda_model_and_cuda_rng_restore(tmp_path) -> None:
    torch.cuda.manual_seed_all(3)
    model = torch.nn.Linear(8, 8).cuda()
    optim = torch.optim.AdamW(model.parameters())
    model(torch.randn(4, 8, device="cuda")).sum().backward()
    optim.step()
    with CheckpointManager(tmp_path, async_save=False) as mgr:
        mgr.save(1, model, optim, extra={"rng": RNGState()}, force=True)
    want = torch.rand(5, device="cuda").cpu()
    torch.cuda.manual_seed_all(99)
    model2 = torch.nn.Linear(8, 8).cuda()
    optim2 = torch.optim.AdamW(model2.parameters())
    with CheckpointManager(tmp_path) as mgr:
        assert mgr.restore(model=model2, optim=optim2, extra={"rng": RNGState()}) == 1
    assert torch.equal(torch.rand(5, device="cuda").cpu(), want)
    assert model2.weight.is_cuda and torch.equal(model2.weight, model.weight)
