"""Other formats into a shardsafe checkpoint: a ``torch.save`` file, a Hugging Face safetensors model.

(A ``torch.distributed.checkpoint`` folder converts through :func:`shardsafe.dcp.convert`.)
Both save from one process, with no process group.
"""

from __future__ import annotations

import json
import mmap
import os
import pickle
from typing import Any

import torch

from ._args import check_arg, check_bool
from .checkpointer import Checkpointer
from .errors import CheckpointError, CorruptCheckpointError, PickleNotAllowedError, StorageError
from .storage import Location
from .storage.local import LocalStorage

__all__ = ["convert_hf", "convert_torch", "flatten_state"]


def flatten_state(obj: dict[str, Any], where: str) -> dict[str, Any]:
    """Nested dicts joined into ``a.b.c`` keys; other values as they are. Two ways to one key raise."""
    out: dict[str, Any] = {}

    def walk(d: dict, prefix: str) -> None:
        for k, v in d.items():
            if not isinstance(k, str):
                raise CheckpointError(f"{where}: key {prefix}{k!r} is not a string; shardsafe keys are strings")
            key = prefix + k
            if isinstance(v, dict) and v and all(isinstance(x, str) for x in v):
                walk(v, key + ".")
                continue
            if key in out:
                raise CheckpointError(f"{where}: key {key!r} is reached twice once nested dicts are joined with '.'; rename one")
            out[key] = v

    walk(obj, "")
    return out


def convert_torch(src: str | os.PathLike[str], dst: Location, *, overwrite: bool = False, allow_pickle: bool = False) -> dict[str, int]:
    """Save the state dict in the ``torch.save`` file ``src`` as a shardsafe checkpoint at ``dst``.

    The file is read with ``torch.load(weights_only=True)`` (memory-mapped when its format
    allows), so nothing but tensors, containers and plain values is ever unpickled. Nested
    dicts become ``a.b`` keys; tensors are stored as tensors, other values as JSON (or, with
    ``allow_pickle``, pickled when JSON cannot hold them). Returns ``tensors`` and ``values`` counts.
    """
    check_arg("convert_torch", "src", src, (str, os.PathLike))
    check_bool("convert_torch", "overwrite", overwrite)
    check_bool("convert_torch", "allow_pickle", allow_pickle)
    where = os.fspath(src)
    if not os.path.isfile(where):
        raise StorageError(f"{where}: no such file")
    try:
        try:
            obj = torch.load(where, map_location="cpu", weights_only=True, mmap=True)
        except RuntimeError as e:
            if "mmap" not in str(e):
                raise
            obj = torch.load(where, map_location="cpu", weights_only=True)  # the legacy format cannot be mapped
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise PickleNotAllowedError(
            f"{where}: torch.load(weights_only=True) refuses it ({first}); only files of tensors, containers and plain "
            "values convert (load it yourself if you trust it, and save with shardsafe.Checkpointer)"
        ) from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        raise CorruptCheckpointError(f"{where}: not a readable torch.save file: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise CheckpointError(f"{where}: holds a {type(obj).__name__}, not a state dict (a dict of names to tensors and values)")
    flat = flatten_state(obj, where)
    Checkpointer(allow_pickle=allow_pickle).save(dst, flat, save_overwrite=overwrite)
    tensors = sum(isinstance(v, torch.Tensor) for v in flat.values())
    return {"tensors": tensors, "values": len(flat) - tensors}


def convert_hf(src: Location, dst: Location, *, overwrite: bool = False) -> dict[str, int]:
    """Save the Hugging Face safetensors model at ``src`` (a ``.safetensors`` file, an index, or
    a folder holding them) as a shardsafe checkpoint at ``dst``, under the same tensor names.

    Local files are memory-mapped (pages come from the page cache, the process holds no copy);
    a model in an object store is read into memory whole. The files' ``__metadata__`` strings
    (but ``format``) are stored as values: decoded when they are JSON (as
    :func:`~shardsafe.unshard_to_safetensors` writes values), else as the strings. Returns ``tensors`` and ``values`` counts.
    """
    from .hf import open_hf_model

    check_bool("convert_hf", "overwrite", overwrite)
    hf = open_hf_model(src)
    state: dict[str, Any] = {}
    maps: list[mmap.mmap] = []
    try:
        if isinstance(hf.storage, LocalStorage):
            files: dict[str, mmap.mmap] = {}
            for key, tm in hf.tensors.items():
                ((file, (spec,)),) = tm.shard_spec_per_file.items()
                if file not in files:
                    with open(os.path.join(hf.storage.root, file), "rb") as f:
                        size = os.fstat(f.fileno()).st_size
                        files[file] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY) if size else None  # type: ignore[assignment]
                    maps.append(files[file])
                a, b = spec.byte_range
                if b > _size(files[file]):
                    raise CorruptCheckpointError(f"{hf.where}: {file} ends before tensor {key!r} (bytes [{a}, {b})); the file is truncated")
                if b > a:
                    t = torch.frombuffer(files[file], dtype=tm.torch_dtype, count=(b - a) // tm.torch_dtype.itemsize, offset=a)
                else:
                    t = torch.empty(0, dtype=tm.torch_dtype)
                state[key] = t.view(tm.shape)
        else:
            from .adapters import describe_state
            from .engine.bounds import check_files_hold
            from .engine.reader import Reader
            from .knobs import KNOBS

            check_files_hold(hf.storage, hf.tensors.items())
            with Reader(hf.storage, KNOBS) as reader:
                for key, tm in hf.tensors.items():
                    full = torch.empty(tm.shape, dtype=tm.torch_dtype)
                    (target,), _ = describe_state({key: full})
                    reader.load_tensor(tm, target)
                    state[key] = full
        values = {k: _value(v) for k, v in hf.metadata.items() if k != "format" and k not in state}
        state.update(values)
        Checkpointer().save(dst, state, save_overwrite=overwrite)
    finally:
        state.clear()
        for m in maps:
            if m is not None:
                try:
                    m.close()
                except BufferError:  # a tensor still refers to it; freed with the tensor
                    pass
    return {"tensors": len(hf.tensors), "values": len(values)}


def _value(text: str) -> Any:
    try:
        return json.loads(text)
    except ValueError:
        return text


def _size(m: mmap.mmap | None) -> int:
    return 0 if m is None else len(m)
