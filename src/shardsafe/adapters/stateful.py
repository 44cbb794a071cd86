"""Objects with ``state_dict()`` / ``load_state_dict()`` (LR schedulers, data loaders,
:class:`shardsafe.RNGState`, user objects) -> flat checkpoint values, one set per rank, and back.

Stored keys, for the object named ``<name>`` as rank ``r`` of the save's process group holds it:

- ``extra.<name>.rank<r>``: a JSON value ``{"tensors": n, "state": ...}``, the state with each
  tensor replaced by a reference to its key (the encoding below);
- ``extra.<name>.rank<r>.<i>``: tensor ``i`` of that state (written by rank ``r`` alone).

Every object is stored per rank: state that is the same on every rank (a scheduler) costs a few
copies of a small value, and state that differs (RNG, a per-rank data position) needs no
declaration. A rank restores its own rank's state; see :func:`extra_targets` for a world size
that changed.

The state may hold ``None``, bool, int, str, float (also NaN and infinities), lists, tuples,
dicts (any keys of those kinds), tensors (dense, any device; restored on the CPU), NumPy arrays
and NumPy scalars, nested at most 60 deep. JSON holds the structure; a dict whose keys are not
all strings, or one with a key starting with ``$``, is written as ``{"$dict": [[key, value],
...]}``, so every object whose first key starts with ``$`` is one of these tags: ``$tensor``,
``$ndarray``, ``$numpy``, ``$tuple``, ``$float``, ``$dict``. Nothing is pickled.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..errors import CheckpointError, CorruptCheckpointError, MissingKeyError
from ..format.metadata import StorageMetadata

__all__ = ["EXTRA_PREFIX", "ExtraRestore", "check_extra", "decode_state", "encode_state", "extra_targets", "extra_values"]

log = logging.getLogger(__name__)

EXTRA_PREFIX = "extra."
_MAX_DEPTH = 60  # below the metadata reader's limit of 64, with room for the tags' own level


def _skeleton_key(name: str, rank: int) -> str:
    return f"{EXTRA_PREFIX}{name}.rank{rank}"


def _tensor_key(name: str, rank: int, i: int) -> str:
    return f"{EXTRA_PREFIX}{name}.rank{rank}.{i}"


# --- the encoding ------------------------------------------------------------------------------------


def encode_state(value: Any, where: str) -> tuple[Any, list[torch.Tensor]]:
    """``value`` as a JSON value, and the tensors it refers to by index (NumPy arrays as tensors
    sharing their memory). ``where`` names the value in messages (``extra['sched']``)."""
    tensors: list[torch.Tensor] = []

    def enc(v: Any, path: str, depth: int) -> Any:
        if depth > _MAX_DEPTH:
            raise CheckpointError(f"{path}: the state nests deeper than {_MAX_DEPTH} levels (or refers to itself); flatten it")
        t = type(v)
        if v is None or t in (bool, int, str):
            return v
        if t is float:
            return v if math.isfinite(v) else {"$float": repr(v)}  # 'nan', 'inf', '-inf'
        if t is list:
            return [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]
        if t is tuple:
            return {"$tuple": [enc(x, f"{path}[{i}]", depth + 1) for i, x in enumerate(v)]}
        if t is dict:
            if all(type(k) is str and not k.startswith("$") for k in v):
                return {k: enc(x, f"{path}[{k!r}]", depth + 1) for k, x in v.items()}
            return {"$dict": [[enc(k, f"{path} key {k!r}", depth + 2), enc(x, f"{path}[{k!r}]", depth + 2)] for k, x in v.items()]}
        if t in (torch.Tensor, torch.nn.Parameter):
            if v.layout != torch.strided:
                raise CheckpointError(f"{path}: only dense (strided) tensors can be saved, got layout {v.layout}")
            tensors.append(v.detach())
            return {"$tensor": len(tensors) - 1}
        if isinstance(v, torch.Tensor):
            raise CheckpointError(
                f"{path}: a {t.__module__}.{t.__qualname__} in the state of an extra object is refused: that state is stored "
                "per rank, as plain tensors; return a plain tensor (e.g. .full_tensor() or .to_local()) from state_dict()"
            )
        if t is np.ndarray:
            if v.dtype.hasobject:
                raise CheckpointError(f"{path}: a NumPy array of Python objects cannot be stored without pickle; convert it")
            tensors.append(torch.from_numpy(np.ascontiguousarray(v)))
            return {"$ndarray": len(tensors) - 1}
        if isinstance(v, np.generic) and not v.dtype.hasobject:
            return {"$numpy": [v.dtype.str, enc(v.item(), path, depth + 1)]}
        raise CheckpointError(
            f"{path}: a value of type {f'{t.__module__}.{t.__qualname__}'.removeprefix('builtins.')} cannot be stored; the state of an extra object may "
            "hold None, bool, int, float, str, list, tuple, dict, tensors and NumPy arrays and scalars (nothing is "
            "pickled): convert it in state_dict() and back in load_state_dict()"
        )

    return enc(value, where, 0), tensors


def decode_state(value: Any, tensors: list[torch.Tensor], where: str) -> Any:
    """The value :func:`encode_state` encoded, with ``tensors`` in place of its references."""

    def dec(v: Any) -> Any:
        if type(v) is list:
            return [dec(x) for x in v]
        if type(v) is not dict:
            return v
        tag = next(iter(v), None)
        if tag is None or not tag.startswith("$"):
            return {k: dec(x) for k, x in v.items()}
        body = v[tag]
        if tag == "$tuple":
            return tuple(dec(x) for x in body)
        if tag == "$dict":
            return {dec(k): dec(x) for k, x in body}
        if tag == "$float":
            return float(body)
        if tag == "$tensor":
            return tensors[body]
        if tag == "$ndarray":
            return tensors[body].numpy()
        if tag == "$numpy":
            return np.dtype(body[0]).type(dec(body[1]))
        raise KeyError(tag)

    try:
        return dec(value)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as e:
        raise CorruptCheckpointError(f"{where}: the stored state is not one shardsafe wrote ({type(e).__name__}: {e})") from None


# --- per-rank keys -----------------------------------------------------------------------------------


def extra_values(extra: dict[str, Any], rank: int) -> dict[str, Any]:
    """The flat checkpoint values of every object's ``state_dict()``, under rank ``rank``'s keys."""
    out: dict[str, Any] = {}
    for name, obj in extra.items():
        state, tensors = encode_state(obj.state_dict(), f"extra[{name!r}].state_dict()")
        out[_skeleton_key(name, rank)] = {"tensors": len(tensors), "state": state}
        out.update((_tensor_key(name, rank, i), t) for i, t in enumerate(tensors))
    return out


@dataclass
class ExtraRestore:
    """What one rank restores of one extra object: the stored rank it takes the state from
    (None: the object keeps its state) and the tensors to load for it."""

    name: str
    obj: Any
    source: int | None
    skeleton: Any = None
    targets: dict[str, torch.Tensor] = field(default_factory=dict)

    def apply(self, loaded: dict[str, Any], where: str) -> None:
        if self.source is None:
            return
        keys = [_tensor_key(self.name, self.source, i) for i in range(len(self.targets))]
        state = decode_state(self.skeleton["state"], [loaded[k] for k in keys], f"{where}: {_skeleton_key(self.name, self.source)}")
        self.obj.load_state_dict(state)


def extra_targets(
    meta: StorageMetadata, extra: dict[str, Any], rank: int, world_size: int, saved_world_size: int, where: str
) -> list[ExtraRestore]:
    """What rank ``rank`` of ``world_size`` restores of each object of ``extra``, from a save on
    ``saved_world_size`` ranks.

    Rank ``r`` takes the state rank ``r`` saved. A rank the save did not have (the world grew)
    takes the state every saved rank had, when they all had the same (compared by the JSON part
    and the stored tensors' shapes, dtypes and checksums); when they differ, an object whose
    class sets ``shardsafe_missing_rank = "keep"`` (:class:`shardsafe.RNGState`) keeps its
    current state (a warning says so), and any other raises ``MissingKeyError``. When the
    world shrank, the states of the ranks that are gone are not restored (a warning says so,
    unless every rank had the same).
    """
    out = []
    for name, obj in extra.items():
        first = _skeleton_key(name, 0)
        if first not in meta.objects:
            stored = sorted({k[len(EXTRA_PREFIX) :].rsplit(".rank", 1)[0] for k in meta.objects if k.startswith(EXTRA_PREFIX)})
            raise MissingKeyError(f"{where}: the checkpoint holds no extra state named {name!r} (it holds {stored or 'none'})")
        same = _all_equal(meta, name, saved_world_size, where)
        if rank < saved_world_size:
            source: int | None = rank
            if rank == 0 and world_size < saved_world_size and not same and _missing_rule(obj) == "error":
                log.warning(
                    "%s: extra[%r] differs between the %d saved ranks; restoring on %d rank(s), the state of rank(s) %s is "
                    "not restored", where, name, saved_world_size, world_size, list(range(world_size, saved_world_size)),
                )
        elif same:
            source = 0
        elif _missing_rule(obj) == "keep":
            log.warning(
                "%s: rank %d keeps its current %s for extra[%r]: the checkpoint was saved on %d rank(s) with different states, "
                "none of them this rank's", where, rank, type(obj).__name__, name, saved_world_size,
            )
            source = None
        else:
            raise MissingKeyError(
                f"{where}: extra[{name!r}] was saved per rank on {saved_world_size} rank(s), with states that differ between "
                f"ranks, so rank {rank} of {world_size} has no state to restore. Restore on at most {saved_world_size} ranks, "
                f"or leave {name!r} out of extra= and set it up yourself (a class that sets shardsafe_missing_rank = 'keep' "
                "keeps its state instead)"
            )
        item = ExtraRestore(name, obj, source)
        if source is not None:
            item.skeleton = _skeleton(meta, name, source, where)
            for i in range(item.skeleton["tensors"]):
                key = _tensor_key(name, source, i)
                tm = meta.tensors.get(key)
                if tm is None:
                    raise MissingKeyError(f"{where}: tensor {key!r} of extra[{name!r}] is not in the checkpoint")
                item.targets[key] = torch.empty(tm.shape, dtype=tm.torch_dtype)
        out.append(item)
    return out


def _missing_rule(obj: Any) -> str:
    rule = getattr(type(obj), "shardsafe_missing_rank", "error")
    return rule if rule in ("keep", "error") else "error"


def _skeleton(meta: StorageMetadata, name: str, rank: int, where: str) -> dict[str, Any]:
    key = _skeleton_key(name, rank)
    value = meta.objects.get(key)
    if value is None:
        raise MissingKeyError(f"{where}: the checkpoint lacks {key!r}, the state of extra[{name!r}] on rank {rank}")
    if not (isinstance(value, dict) and type(value.get("tensors")) is int and value["tensors"] >= 0 and "state" in value):
        raise CorruptCheckpointError(f"{where}: {key!r} is not the state of an extra object as shardsafe writes it")
    return value


def _all_equal(meta: StorageMetadata, name: str, saved_world_size: int, where: str) -> bool:
    """Whether every saved rank stored the same state for ``name`` (stored tensors compared by
    their checksums: equal bytes give equal checksums)."""
    signatures = set()
    for r in range(saved_world_size):
        skeleton = _skeleton(meta, name, r, where)
        tensors = []
        for i in range(skeleton["tensors"]):
            tm = meta.tensors.get(_tensor_key(name, r, i))
            if tm is None:
                return False
            chunks = sorted(
                (c.global_offset, c.local_shape, c.flattened_range, tm.chunk_sums(file, c).digests) for file, c in tm.chunks()
            )
            tensors.append((tuple(tm.shape), tm.dtype, tuple(chunks)))
        signatures.add((_canonical(skeleton["state"]), tuple(tensors)))
        if len(signatures) > 1:
            return False
    return True


def _type(v: Any) -> str:
    return type(v).__qualname__


def _canonical(value: Any) -> str:
    import json

    return json.dumps(value, sort_keys=True, separators=(",", ":"))


def check_extra(func: str, extra: Any) -> dict[str, Any]:
    """``extra`` as a dict of name -> object with ``state_dict`` and ``load_state_dict``, or ``TypeError``."""
    if extra is None:
        return {}
    if not isinstance(extra, dict):
        raise TypeError(f"{func}: argument 'extra' must be a dict of name -> object with state_dict()/load_state_dict(), got {type(extra).__name__}")
    for name, obj in extra.items():
        if type(name) is not str:
            raise TypeError(f"{func}: the names in 'extra' must be strings, got {_type(name)} {name!r}")
        if not name or any(c in name for c in "/\\\n"):
            raise CheckpointError(f"{func}: extra name {name!r} must be non-empty, without '/', '\\' or newlines (it becomes part of keys)")
        missing = [m for m in ("state_dict", "load_state_dict") if not callable(getattr(obj, m, None))]
        if missing:
            raise TypeError(
                f"{func}: extra[{name!r}] is a {type(obj).__qualname__}, which has no {' or '.join(missing)}(); every extra object "
                "needs both (wrap plain values in an object that has them)"
            )
    return extra

