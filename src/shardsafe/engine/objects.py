"""Non-tensor values: JSON where they can be, pickle only when the caller opts in.

A JSON value may hold tagged objects, ``{"__shardsafe__": <tag>, ...}`` (``docs/format.md`` §13:
tuples, ``OrderedDict``, NaN and infinities, NumPy scalars...), the one encoding shardsafe uses
for Python values JSON lacks (:mod:`shardsafe.megatron._values`). :func:`encode_objects` writes
them for ``Checkpointer`` (a value JSON holds as it is stays plain JSON), :func:`encode_tagged`
for ``shardsafe.dcp``'s writer and ``convert`` (Megatron's common state is tagged by its strategy);
:func:`decode_objects` gives every reader the Python values back. A dict with the key
``__shardsafe__`` is therefore reserved in stored values.
"""

from __future__ import annotations

import base64
import functools
import math
import pickle
from typing import Any

import torch

from ..errors import CheckpointError, PickleNotAllowedError
from ..format.strict_json import MAX_DEPTH, nesting_exceeds

__all__ = ["TAG", "decode_objects", "encode_objects", "encode_tagged", "has_tag", "is_json_value", "merge_rank_objects"]

TAG = "__shardsafe__"
"""The key that marks a tagged object inside a stored JSON value (see the module docstring)."""


def is_json_value(v: Any, _depth: int = 0) -> bool:
    """True when ``v`` round-trips through JSON unchanged (no tuples, no NaN, str dict keys) and
    lists and dicts nest at most ``MAX_DEPTH`` deep (what a reader of the metadata accepts)."""
    t = type(v)
    if v is None or t in (bool, int, str):
        return True
    if t is float:
        return math.isfinite(v)
    if t in (list, dict) and _depth == MAX_DEPTH:
        return False
    if t is list:
        return all(is_json_value(x, _depth + 1) for x in v)
    if t is dict:
        return all(type(k) is str and is_json_value(x, _depth + 1) for k, x in v.items())
    return False


def _copy_json(v: Any) -> Any:
    t = type(v)
    if t is list:
        return [_copy_json(x) for x in v]
    if t is dict:
        return {k: _copy_json(x) for k, x in v.items()}
    return v  # None, bool, int, float, str: immutable


def encode_objects(objects: dict[str, Any], *, allow_pickle: bool) -> tuple[dict[str, Any], dict[str, str]]:
    """Split values into JSON ones and (if allowed) pickled ones, base64-encoded: what
    ``Checkpointer`` stores.

    A JSON value is stored exactly as given (a copy), whatever it holds (a dict with the key
    ``TAG`` too: ``shardsafe.lightning`` and ``shardsafe.megatron`` pass values they tagged
    themselves). A value JSON cannot hold is stored as tagged JSON (tuples, ``OrderedDict``,
    NaN and infinities, NumPy scalars, sets, bytes...). A value with a part the tags cannot
    express is pickled whole if ``allow_pickle``; otherwise ``PickleNotAllowedError`` names that
    part by its path (``optim.param_groups[0].betas``), and says to put a tensor in a dict (where
    it is stored as a tensor) rather than to pickle it.
    """
    as_json: dict[str, Any] = {}
    pickled: dict[str, str] = {}
    for key, v in objects.items():
        if is_json_value(v):
            as_json[key] = _copy_json(v)  # a snapshot: the caller may change its lists and dicts once a save returns
            continue
        try:
            as_json[key] = _encode_value(key, v)
        except PickleNotAllowedError:
            if not allow_pickle:
                raise
            pickled[key] = base64.b64encode(pickle.dumps(v)).decode()
    return as_json, pickled


def _element(key: str, path: tuple) -> str:
    """``key`` and the path to an element inside its value: ``.name`` for a string dict key,
    ``[i]`` for a list or tuple index (and any other dict key, by its repr)."""
    parts = [key]
    for p in path:
        parts.append(f".{p}" if type(p) is str else f"[{p}]" if type(p) is int else f"[{p!r}]")
    return "".join(parts)


_TAGGED_KINDS = (
    "None, bool, int, float (NaN and infinities too), str, list, tuple, dict (any keys), OrderedDict, set, bytes, "
    "argparse.Namespace, enums, torch dtypes, devices and Sizes, NumPy scalars and arrays"
)


def _encode_value(key: str, v: Any) -> Any:
    """``v`` as tagged JSON, or ``PickleNotAllowedError`` naming the first part that has no
    tagged form (the caller pickles the whole value instead, when allowed)."""
    encoder = _value_encoder()(key)
    try:
        out = encoder.encode(v, ())
    except PickleNotAllowedError:
        raise
    except CheckpointError as e:  # contains itself
        raise PickleNotAllowedError(f"{e}; convert it, or pass allow_pickle=True to store it with pickle") from None
    if nesting_exceeds(out, MAX_DEPTH):
        raise PickleNotAllowedError(
            f"key {key!r}: values may be nested at most {MAX_DEPTH} deep (lists, dicts and tuples, once encoded as "
            "tagged JSON); flatten it, or pass allow_pickle=True to store it with pickle"
        )
    return out


@functools.cache
def _value_encoder() -> type:
    """The tagged-JSON encoder (:mod:`shardsafe.megatron._values`, imported on first use: the
    integrations import this module) with ``Checkpointer``'s refusals: no tensor inside a value
    (a tensor belongs in a dict of the state, where it is stored as a tensor, sharded or not),
    no array larger than ``INLINE_BYTES``, and messages that name the element's path."""
    from ..megatron._values import INLINE_BYTES, _Encoder

    class ValueEncoder(_Encoder):
        def __init__(self, key: str) -> None:
            super().__init__(f"key {key!r}", False, "")
            self.key = key

        def encode(self, v: Any, path: tuple) -> Any:
            if len(path) > MAX_DEPTH:  # before recursion runs out: the encoded depth is checked afterwards
                raise PickleNotAllowedError(
                    f"key {self.key!r}: values may be nested at most {MAX_DEPTH} deep; flatten it, or pass allow_pickle=True "
                    "to store it with pickle"
                )
            return super().encode(v, path)

        def _tensor(self, v: Any, path: tuple) -> Any:
            raise PickleNotAllowedError(
                f"{_element(self.key, path)!r} is a {type(v).__module__}.{type(v).__qualname__} inside a list, tuple or "
                "other value, which cannot be stored: a tensor is stored (sharded or not, checksummed, in the data files) when it is a "
                "value of the state dict or of a dict nested in it (nested dicts are stored under dotted keys), and lists "
                "and tuples are stored as JSON. Put the tensors in a dict, keyed by name or by str(index)"
            )

        def _other(self, v: Any, path: tuple) -> Any:
            if isinstance(v, torch.Tensor):
                return self._tensor(v, path)
            t = type(v)
            raise PickleNotAllowedError(
                f"{_element(self.key, path)!r} is a {f'{t.__module__}.{t.__qualname__}'.removeprefix('builtins.')}, which "
                f"has no JSON form (shardsafe stores {_TAGGED_KINDS}). Convert it, or pass allow_pickle=True to store "
                f"{self.key!r} with pickle"
            )

        def _sized(self, path: tuple, nbytes: int, doc: dict) -> Any:
            if nbytes > INLINE_BYTES:
                raise PickleNotAllowedError(
                    f"{_element(self.key, path)!r} is a NumPy array of {nbytes} bytes inside a value; at most {INLINE_BYTES} "
                    "are stored inline. Store it as a tensor (torch.from_numpy) under a key of its own"
                )
            return doc

    return ValueEncoder


def encode_tagged(objects: dict[str, Any], *, allow_pickle: bool, opt_in: str) -> tuple[dict[str, Any], dict[str, str]]:
    """Like :func:`encode_objects`, but a value JSON cannot hold is stored as tagged JSON where
    the tags can express it (a tuple, an ``OrderedDict``, NaN...), not pickled. Only a value with
    a part the tags cannot express is pickled, and only if ``allow_pickle``; otherwise
    ``PickleNotAllowedError`` names the key path of that part and ends with ``opt_in``."""
    from ..megatron._values import encode_value

    as_json: dict[str, Any] = {}
    pickled: dict[str, str] = {}
    for key, v in objects.items():
        if is_json_value(v) and not has_tag(v):
            as_json[key] = _copy_json(v)
            continue
        try:
            as_json[key] = encode_value(v, where=f"key {key!r}", allow_pickle=False, opt_in=opt_in)
        except PickleNotAllowedError:
            if not allow_pickle:
                raise
            pickled[key] = base64.b64encode(pickle.dumps(v)).decode()
        except CheckpointError as e:  # nested too deep, or contains itself
            raise PickleNotAllowedError(f"{e}; {opt_in}") from None
    return as_json, pickled


def has_tag(v: Any) -> bool:
    """True when the JSON value ``v`` holds a tagged object (a dict with the key ``TAG``)."""
    t = type(v)
    if t is list:
        return any(has_tag(x) for x in v)
    if t is dict:
        return TAG in v or any(has_tag(x) for x in v.values())
    return False


def decode_objects(
    as_json: dict[str, Any], pickled: dict[str, str], keys: list[str] | None, *, allow_pickle: bool, where: str,
    opt_in: str = "pass allow_pickle=True",
) -> dict[str, Any]:
    """The stored values for ``keys`` (all when None), tagged values decoded. Unpickles only with
    ``allow_pickle``; ``opt_in`` says how the caller opts in."""
    wanted = list(as_json) + list(pickled) if keys is None else keys
    needs_pickle = [k for k in wanted if k in pickled]
    if needs_pickle and not allow_pickle:
        raise PickleNotAllowedError(
            f"{where}: values {needs_pickle} were stored with pickle; loading them can run arbitrary code. "
            "Pass allow_pickle=True only if you trust this checkpoint"
        )
    out: dict[str, Any] = {}
    for k in wanted:
        if k in as_json:
            v = as_json[k]
            if has_tag(v):
                from ..megatron._values import decode_value

                v = decode_value(v, where=f"{where}: key {k!r}", allow_pickle=allow_pickle, opt_in=opt_in)
            out[k] = v
        elif k in pickled:
            out[k] = pickle.loads(base64.b64decode(pickled[k]))
    return out


def merge_rank_objects(per_rank: list[tuple[dict[str, Any], dict[str, str]]]) -> tuple[dict[str, Any], dict[str, str]]:
    """One set of values from every rank's; a key whose value differs between ranks is an error."""
    merged: tuple[dict[str, Any], dict[str, str]] = ({}, {})
    first_rank: dict[str, int] = {}
    for rank, parts in enumerate(per_rank):
        for values, into in zip(parts, merged):
            for key, v in values.items():
                if key in first_rank and (key not in into or into[key] != v):
                    raise CheckpointError(
                        f"non-tensor value {key!r} differs between rank {first_rank[key]} and rank {rank}; "
                        "store per-rank values under per-rank keys"
                    )
                first_rank.setdefault(key, rank)
                into[key] = v
    return merged
