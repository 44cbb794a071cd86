"""What the library logs to ``logging.getLogger("shardsafe")``: nothing at INFO or above for a save
or load that succeeds (Megatron-LM sets the root logger to INFO; a save must not print there), one
DEBUG summary line per save and load on the coordinator only, DEBUG detail on every rank (its share of the plan, whether the plan was
reused, what its load read), and the object-store client's retry policy when it is built."""

from __future__ import annotations

import logging
import re

import torch

import shardsafe
from shardsafe.storage import open_storage

from .helpers import run_ranks


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append((record.levelname, record.getMessage()))


def _save_twice_and_load(rank, ws, path):
    from torch.distributed.tensor import Shard, distribute_tensor, init_device_mesh

    handler = _Records()
    logger = logging.getLogger("shardsafe")
    logger.addHandler(handler)
    logger.setLevel(logging.DEBUG)
    mesh = init_device_mesh("cpu", (ws,))
    state = {"w": distribute_tensor(torch.arange(64.0).reshape(16, 4), mesh, [Shard(0)]), "step": 3}
    ckpt = shardsafe.Checkpointer()
    ckpt.save(path + "/a", state)
    ckpt.save(path + "/b", state)  # the same structure: the plan is reused
    target = {"w": distribute_tensor(torch.zeros(16, 4), mesh, [Shard(0)]), "step": None}
    ckpt.load(path + "/a", target)
    assert torch.equal(target["w"].full_tensor(), torch.arange(64.0).reshape(16, 4)) and target["step"] == 3
    logger.removeHandler(handler)
    return [(lvl, msg) for lvl, msg in handler.lines if msg.startswith(("save ", "load "))]


def test_a_summary_on_the_coordinator_only_and_debug_detail_on_every_rank_all_at_debug(tmp_path):
    path = str(tmp_path)
    got = run_ranks(2, _save_twice_and_load, path)
    rate = r"\d+\.\d\d s, \d+\.\d\d GB/s"
    for rank, lines in enumerate(got):
        assert [msg for lvl, msg in lines if lvl != "DEBUG"] == []
        info = [msg for lvl, msg in lines if re.search(r"GB/s$", msg)]  # the summaries
        debug = [msg for lvl, msg in lines if lvl == "DEBUG"]
        if rank == 0:
            assert len(info) == 3, info
            assert re.fullmatch(rf"save {re.escape(path)}/a: 1 tensors, 1 values, \d+ bytes from 2 rank\(s\), {rate}", info[0])
            assert re.fullmatch(rf"save {re.escape(path)}/b: 1 tensors, 1 values, \d+ bytes from 2 rank\(s\), {rate}", info[1])
            assert re.fullmatch(rf"load {re.escape(path)}/a: 2 targets, \d+ bytes read on the coordinator, {rate}", info[2])
        else:
            assert info == [], info  # one line per operation, from the coordinator
        plans = [m for m in debug if m.startswith("save ") and ": rank " in m]
        assert len(plans) == 2, debug
        first = rf"save {re.escape(path)}/a: rank {rank} of 2, plan \w+ \(new part\): writes 1 chunks of 1 tensors, \d+ bytes, to \S+\.safetensors"
        assert re.fullmatch(first, plans[0]), plans[0]
        assert re.fullmatch(rf"save {re.escape(path)}/b: rank {rank} of 2, plan \w+ \(reused\): writes 1 chunks of 1 tensors, .*", plans[1]), plans[1]
        loads = [m for m in debug if m.startswith("load ") and ": rank " in m]
        assert len(loads) == 1 and re.fullmatch(
            rf"load {re.escape(path)}/a: rank {rank} of 2 filled 1 tensors and 1 values, \d+ bytes read, \d+\.\d\d s", loads[0]
        ), loads


def test_an_object_store_client_logs_its_retry_policy(caplog):
    caplog.set_level(logging.DEBUG, logger="shardsafe")
    storage = open_storage(
        "s3://bucket/run/step1", endpoint="http://127.0.0.1:9", region="us-east-1",
        credentials={"aws_access_key_id": "fake", "aws_secret_access_key": "fake"},
    )
    del storage  # building the client is enough: nothing is requested
    lines = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG and "retries" in r.getMessage()]
    assert lines == [
        "s3://bucket/run/step1: s3 client, endpoint http://127.0.0.1:9, up to 10 retries within 180 s (backoff 0.1 s doubling to 15 s)"
    ]


def test_load_hf_safetensors_logs_one_debug_line(tmp_path, caplog):
    from safetensors.torch import save_file

    save_file({"weight": torch.arange(12.0).reshape(3, 4), "bias": torch.ones(3)}, str(tmp_path / "model.safetensors"))
    model = torch.nn.Linear(4, 3)
    caplog.set_level(logging.DEBUG, logger="shardsafe")
    shardsafe.load_hf_safetensors(tmp_path, model)
    assert torch.equal(model.weight.detach(), torch.arange(12.0).reshape(3, 4))
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.INFO] == []
    lines = [r.getMessage() for r in caplog.records if "GB/s" in r.getMessage()]
    assert len(lines) == 1 and re.fullmatch(
        rf"load_hf_safetensors {re.escape(str(tmp_path))}\S*: 2 tensors, 60 bytes read on rank 0, \d+\.\d\d s, \d+\.\d\d GB/s", lines[0]
    ), lines
