"""Non-tensor values between DCP and shardsafe.

DCP hands a storage writer each non-tensor leaf of the (flattened) state dict as the bytes of
``torch.save(value)``. shardsafe stores values as JSON (or, where the caller opted in, pickled):
:func:`value_of` gets the value back without running foreign code, and
:func:`~shardsafe.format.values.encode_objects` decides how it is stored.

Loading, DCP asks for the leaves of its *target* state dict by dotted key
(``optim.param_groups.0.lr``), where a shardsafe checkpoint written by ``Checkpointer`` or
``save_model_and_optim_state`` may hold the whole container under one key
(``optim.param_groups``). :func:`dcp_leaves` lists a stored value's leaves the way DCP's
``flatten_state_dict`` would, so such checkpoints load through DCP too.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Iterator
from typing import Any

import torch

from ..errors import CorruptCheckpointError, PickleNotAllowedError
from ..format.values import TAG

__all__ = ["dcp_leaves", "get_path", "torch_saved", "value_of"]

Path = tuple[str | int, ...]


def dcp_leaves(key: str, value: Any) -> Iterator[tuple[str, Path]]:
    """``(dotted key, path inside value)`` of each leaf of ``value`` as DCP flattens a state dict:
    dicts are entered (not a tagged object, which stands for one Python value), lists only when
    they hold a dict or a list that is entered itself."""

    def terminal(v: Any) -> bool:
        if isinstance(v, dict):
            return TAG in v
        if isinstance(v, list):
            return not any(isinstance(x, (dict, list)) and not terminal(x) for x in v)
        return True

    def walk(path: Path, v: Any) -> Iterator[tuple[str, Path]]:
        if isinstance(v, dict) and TAG not in v:
            for k, x in v.items():
                yield from walk((*path, str(k)), x)
        elif terminal(v):
            yield ".".join(map(str, (key, *path))), path
        else:
            for i, x in enumerate(v):
                yield from walk((*path, i), x)

    yield from walk((), value)


def get_path(value: Any, path: Path) -> Any:
    for p in path:
        value = value[p]
    return value


def torch_saved(value: Any) -> io.BytesIO:
    """``value`` as DCP's planners expect a non-tensor value: the bytes of ``torch.save``."""
    buf = io.BytesIO()
    torch.save(value, buf)
    buf.seek(0)
    return buf


def value_of(data: Any, key: str, *, allow_pickle: bool) -> Any:
    """The value behind the bytes a DCP save planner resolved for ``key`` (``torch.save`` of it):
    read with torch's allowlisted unpickler, or with the full one only if ``allow_pickle``."""
    raw = data.getvalue() if isinstance(data, io.BytesIO) else data
    if not isinstance(raw, (bytes, bytearray, memoryview)):
        raise CorruptCheckpointError(f"key {key!r}: the save planner resolved a {type(data).__name__}, not a BytesIO")
    try:
        return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        if not allow_pickle:
            raise PickleNotAllowedError(
                f"key {key!r}: the value pickles classes torch's safe loader refuses ({str(e).splitlines()[0][:200]}), so "
                "it cannot be stored as JSON. Convert it, or pass allow_pickle=True to shardsafe.dcp.StorageWriter to "
                "store it with pickle"
            ) from None
    return torch.load(io.BytesIO(raw), map_location="cpu", weights_only=False)
