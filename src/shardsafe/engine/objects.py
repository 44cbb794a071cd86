"""Non-tensor values: JSON where they can be, pickle only when the caller opts in."""

from __future__ import annotations

import base64
import math
import pickle
from typing import Any

from ..errors import CheckpointError, PickleNotAllowedError
from ..format.strict_json import MAX_DEPTH

__all__ = ["decode_objects", "encode_objects", "is_json_value", "merge_rank_objects"]


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


def decode_objects(
    as_json: dict[str, Any], pickled: dict[str, str], keys: list[str] | None, *, allow_pickle: bool, where: str
) -> dict[str, Any]:
    """The stored values for ``keys`` (all when None). Unpickles only with ``allow_pickle``."""
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
            out[k] = as_json[k]
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
