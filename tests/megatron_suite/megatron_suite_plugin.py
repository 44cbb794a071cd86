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

import datetime
import json
import os
import sys
import types

import torch
import torch.distributed as dist

_IMPL = os.environ.get("MEGATRON_SUITE_IMPL", "megatron")
_OUT = os.environ.get("MEGATRON_SUITE_OUT")
_RANK = os.environ.get("RANK", "0")
_PG_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("MEGATRON_SUITE_PG_TIMEOUT", "180")))
_CPU = torch.device("cpu")


def _is_cuda(device) -> bool:
    if device is None:
        return False
    if isinstance(device, int) and not isinstance(device, bool):
        return True
    if isinstance(device, str):
        return device.startswith("cuda")
    if isinstance(device, torch.device):
        return device.type == "cuda"
    return False


def _cpu(device):
    return _CPU if _is_cuda(device) else device


def _wrap_factory(fn):
    def factory(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _cpu(kwargs["device"])
        kwargs.pop("pin_memory", None)
        return fn(*args, **kwargs)

    factory.__name__ = getattr(fn, "__name__", "factory")
    factory.__wrapped__ = fn
    return factory


for _name in (
    "empty", "zeros", "ones", "full", "rand", "randn", "randint", "randperm", "arange", "tensor",
    "as_tensor", "empty_like", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like", "empty_strided", "linspace", "eye", "normal",
):
    setattr(torch, _name, _wrap_factory(getattr(torch, _name)))

_tensor_to = torch.Tensor.to


def _to(self, *args, **kwargs):
    if args and _is_cuda(args[0]):
        args = (_CPU, *args[1:])
    if "device" in kwargs:
        kwargs["device"] = _cpu(kwargs["device"])
    return _tensor_to(self, *args, **kwargs)


def _tensor_cuda(self, device=None, non_blocking=False, memory_format=torch.preserve_format):
    return self


torch.Tensor.to = _to
torch.Tensor.cuda = _tensor_cuda
torch.Tensor.pin_memory = lambda self, *a, **k: self
torch.Tensor.is_pinned = lambda self, *a, **k: False

_module_to = torch.nn.Module.to


def _module_to_cpu(self, *args, **kwargs):
    if args and _is_cuda(args[0]):
        args = (_CPU, *args[1:])
    if "device" in kwargs:
        kwargs["device"] = _cpu(kwargs["device"])
    return _module_to(self, *args, **kwargs)


torch.nn.Module.to = _module_to_cpu
torch.nn.Module.cuda = lambda self, device=None: self

_cuda = torch.cuda
_cuda.set_device = lambda device: None
_cuda.current_device = lambda: 0
_cuda.device_count = lambda: int(os.environ.get("WORLD_SIZE", "1"))
_cuda.synchronize = lambda device=None: None
_cuda.memory_allocated = lambda device=None: 0
_cuda.max_memory_allocated = lambda device=None: 0
_cuda.memory_reserved = lambda device=None: 0
_cuda.empty_cache = lambda: None
_cuda.reset_peak_memory_stats = lambda device=None: None
_cuda.get_device_properties = lambda device=None: types.SimpleNamespace(
    total_memory=64 << 30, name="cpu", major=9, minor=0, multi_processor_count=1
)
_cuda.get_device_capability = lambda device=None: (9, 0)
_cuda.get_rng_state = lambda device="cuda": torch.get_rng_state()
_cuda.set_rng_state = lambda state, device="cuda": None
_cuda.manual_seed = lambda seed: torch.manual_seed(seed)
_cuda.manual_seed_all = lambda seed: torch.manual_seed(seed)


class _Stream:
    def __init__(self, *args, **kwargs):
        pass

    def synchronize(self):
        pass

    def wait_stream(self, other):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        return _Event()

    def query(self):
        return True


class _Event(_Stream):
    def record(self, stream=None):
        pass

    def elapsed_time(self, other):
        return 0.0


class _StreamContext:
    def __init__(self, stream=None):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


_cuda.Stream = _Stream
_cuda.Event = _Event
_cuda.stream = _StreamContext
_cuda.current_stream = lambda device=None: _Stream()
_cuda.default_stream = lambda device=None: _Stream()


def _gloo(backend):
    if backend is None:
        return None
    return "gloo" if "nccl" in str(backend) else backend


_init_process_group = dist.init_process_group


def _init_pg(*args, **kwargs):
    if args:
        args = (_gloo(args[0]), *args[1:])
    if "backend" in kwargs:
        kwargs["backend"] = _gloo(kwargs["backend"])
    kwargs.setdefault("timeout", _PG_TIMEOUT)
    kwargs.pop("device_id", None)
    return _init_process_group(*args, **kwargs)


_new_group = dist.new_group


def _new_group_gloo(*args, **kwargs):
    if len(args) >= 3:
        args = (args[0], args[1], _gloo(args[2]), *args[3:])
    if "backend" in kwargs:
        kwargs["backend"] = _gloo(kwargs["backend"])
    kwargs.pop("pg_options", None)
    kwargs.setdefault("timeout", _PG_TIMEOUT)
    return _new_group(*args, **kwargs)


dist.init_process_group = _init_pg
dist.distributed_c10d.init_process_group = _init_pg
dist.new_group = _new_group_gloo
dist.distributed_c10d.new_group = _new_group_gloo

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
