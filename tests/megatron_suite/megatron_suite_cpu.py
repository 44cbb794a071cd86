"""CUDA calls on the CPU and NCCL process groups as gloo ones, for Megatron-Core's tests on a
machine without GPUs (see ``megatron_suite_plugin``). Imported by each rank's pytest plugin, and by
``sitecustomize`` in every other Python process the ranks start (Megatron's asynchronous saves spawn
worker processes), so the mapping holds there too. Importing it twice does nothing more."""

from __future__ import annotations

import datetime
import os
import types

import torch
import torch.distributed as dist

PG_TIMEOUT = datetime.timedelta(seconds=float(os.environ.get("MEGATRON_SUITE_PG_TIMEOUT", "180")))
_PG_TIMEOUT = PG_TIMEOUT
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
# the "device" generator is the CPU's: seeded directly (torch.manual_seed itself calls
# torch.cuda.manual_seed_all, so calling it back from here recursed without end)
_cuda.manual_seed = lambda seed: torch.default_generator.manual_seed(int(seed))
_cuda.manual_seed_all = lambda seed: torch.default_generator.manual_seed(int(seed))


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


init_process_group = _init_process_group = dist.init_process_group


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

