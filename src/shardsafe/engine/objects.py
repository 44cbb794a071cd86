"""Non-tensor values: JSON where they can be, pickle only when the caller opts in.

A JSON value may hold tagged objects, ``{"__shardsafe__": <tag>, ...}`` (``docs/format.md`` §13:
tuples, ``OrderedDict``, NaN and infinities, NumPy scalars...), the one encoding shardsafe uses
for Python values JSON lacks (:mod:`shardsafe.megatron._values`). :func:`encode_tagged` writes
them (``shardsafe.dcp``'s writer and ``convert``, Megatron's common state);
:func:`decode_objects` gives every reader the Python values back. A dict with the key
``__shardsafe__`` is therefore reserved in stored values.
"""

from __future__ import annotations

import base64
import math
import pickle
from typing import Any

from ..errors import CheckpointError, PickleNotAllowedError
from ..format.strict_json import MAX_DEPTH

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
    """Split values into JSON ones and (if allowed) pickled ones, base64-encoded."""
    as_json: dict[str, Any] = {}
    pickled: dict[str, str] = {}
    for key, v in objects.items():
        if is_json_value(v):
            as_json[key] = _copy_json(v)  # a snapshot: the caller may change its lists and dicts once a save returns
        elif allow_pickle:
            pickled[key] = base64.b64encode(pickle.dumps(v)).decode()
        else:
            raise PickleNotAllowedError(
                f"key {key!r}: a value of type {type(v).__name__} cannot be stored as JSON (JSON takes None, "
                f"bool, int, finite float, str, list and dict with str keys, nested at most {MAX_DEPTH} deep; tuples must "
                "become lists). "
                "Convert it, or pass allow_pickle=True to store it with pickle"
            )
    return as_json, pickled


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
