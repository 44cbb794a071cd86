"""pytest plugin loaded (``-p megatron_suite_plugin``) into each rank of Megatron-Core's own
``tests/unit_tests/dist_checkpointing`` run by ``run.py``.

It makes a CUDA-less machine look enough like Megatron's CI for those tests:

- CUDA calls go to the CPU: factory functions and ``Tensor.to``/``.cuda()``/``Module.cuda()`` given a
  CUDA device (``"cuda"``, ``"cuda:N"``, an int, a ``torch.device``) make CPU tensors;
  ``torch.cuda.set_device``/``synchronize``/``memory_allocated`` and friends answer as an idle device;
- NCCL process groups are gloo ones, with a collective timeout of ``MEGATRON_SUITE_PG_TIMEOUT`` seconds
  (a deadlock fails the file instead of hanging it for Megatron's 30 minutes);
- with ``MEGATRON_SUITE_IMPL=shardsafe``, :func:`shardsafe.megatron.install` makes ``shardsafe.megatron``
  the ``megatron.core.dist_checkpointing`` package before anything imports Megatron;
- each test's outcome is appended to ``$MEGATRON_SUITE_OUT/rank{RANK}.jsonl`` as it finishes, so a file
  killed on timeout still counts what ran;
- after each test the ranks compare outcomes (through a store of their own, on
  ``MEGATRON_SUITE_STORE_PORT``); when any rank failed, the process group is rebuilt, so that a test
  failing on some ranks only (which leaves the others' collectives out of step) does not fail every
  test after it. Megatron's CI stops at the first failure (``-x``); this runner counts them all.

Nothing here changes what a test asserts.
"""

from __future__ import annotations

import json
import os
import sys
import types

import torch.distributed as dist

_IMPL = os.environ.get("MEGATRON_SUITE_IMPL", "megatron")
_OUT = os.environ.get("MEGATRON_SUITE_OUT")
_RANK = os.environ.get("RANK", "0")
from megatron_suite_cpu import PG_TIMEOUT as _PG_TIMEOUT  # noqa: E402
from megatron_suite_cpu import init_process_group as _init_process_group  # noqa: E402 - the CPU mapping, applied on import

# Megatron's unit-test conftest downloads a data set from the network on first use; nothing here needs it.
_download = types.ModuleType("tests.test_utils.python_scripts.download_unit_tests_dataset")


def _offline(*args, **kwargs):
    raise RuntimeError("offline: the dist_checkpointing tests need no downloaded data")


_download.get_oldest_release_and_assets = _offline
sys.modules[_download.__name__] = _download

if _IMPL == "shardsafe":
    import shardsafe.megatron

    shardsafe.megatron.install()

# Without Transformer Engine, megatron.core.utils.is_te_min_version compares None with a version (a
# TypeError in Megatron's autouse fixture): report TE as version 0, i.e. older than anything asked for.
import megatron.core.utils as _mcore_utils  # noqa: E402 - after install(): it imports megatron.core
from packaging.version import Version as _Version  # noqa: E402

if _mcore_utils.get_te_version() is None:
    _mcore_utils._te_version = _Version("0")


_store = None
_test_idx = 0
_failed_here = False


def _suite_store():
    global _store
    if _store is None:
        _store = dist.TCPStore(
            os.environ.get("MASTER_ADDR", "127.0.0.1"),
            int(os.environ["MEGATRON_SUITE_STORE_PORT"]),
            int(os.environ["WORLD_SIZE"]),
            int(_RANK) == 0,
            timeout=_PG_TIMEOUT * 3,
        )
    return _store


def _resync_after(idx: int, failed: bool) -> None:
    """Wait until every rank finished test ``idx``; rebuild the process group if any failed."""
    if "MEGATRON_SUITE_STORE_PORT" not in os.environ:
        return
    store = _suite_store()
    world = int(os.environ["WORLD_SIZE"])
    store.set(f"t{idx}/r{_RANK}", "1" if failed else "0")
    keys = [f"t{idx}/r{r}" for r in range(world)]
    try:
        store.wait(keys)
    except Exception:  # noqa: BLE001 - a rank is gone: nothing more can run in step
        _record({"abort": f"a rank did not finish test #{idx}"})
        os._exit(3)
    if not any(store.get(k) == b"1" for k in keys) or not dist.is_initialized():
        return
    import megatron.core.parallel_state as ps

    try:
        ps.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - a broken model-parallel state is what we are replacing
        pass
    dist.destroy_process_group()
    prefix = dist.PrefixStore(f"resync{idx}", store)
    _init_process_group("gloo", store=prefix, rank=int(_RANK), world_size=world, timeout=_PG_TIMEOUT)


import pytest  # noqa: E402


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    global _test_idx, _failed_here
    _failed_here = False
    yield
    _resync_after(_test_idx, _failed_here)
    _test_idx += 1


def _record(entry: dict) -> None:
    if not _OUT:
        return
    with open(os.path.join(_OUT, f"rank{_RANK}.jsonl"), "a") as f:
        f.write(json.dumps(entry) + "\n")


def pytest_collection_finish(session):
    _record({"collected": [item.nodeid for item in session.items]})


def pytest_runtest_logreport(report):
    global _failed_here
    if report.outcome == "failed":
        _failed_here = True
    if report.when == "call" or report.outcome != "passed":
        entry = {"test": report.nodeid, "when": report.when, "outcome": report.outcome}
        if report.outcome == "failed":
            entry["error"] = (report.longreprtext or "")[-1500:]
        _record(entry)
