"""Nested dict and list helpers, as in ``megatron.core.dist_checkpointing.dict_utils``.

Every function walks nested dicts and lists; any other value (tuples included) is a leaf.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TypeVar

import torch

from .core import CheckpointingException

__all__ = [
    "diff",
    "dict_list_map_inplace",
    "dict_list_map_outplace",
    "dict_map",
    "dict_map_with_key",
    "extract_matching_values",
    "inspect_types",
    "map_reduce",
    "merge",
    "nested_items_iter",
    "nested_values",
]

U = TypeVar("U")
V = TypeVar("V")


def extract_matching_values(
    x: dict | list, predicate: Callable[[Any], bool], return_lists_as_dicts: bool = False
) -> tuple[dict | list, dict | list]:
    """Split ``x`` into the leaves ``predicate`` accepts and the rest, both keeping the nesting.

    A container whose leaves all match is absent from the second result (an empty container
    stays there). With ``return_lists_as_dicts`` a list becomes a dict keyed by the indices of
    the elements it keeps, so that the original positions can be restored.
    """
    if isinstance(x, dict):
        matching: dict | list = {}
        rest: dict | list = {}
        for k, v in x.items():
            if isinstance(v, (dict, list)):
                m, r = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    matching[k] = m  # type: ignore[index]
                if r or not v:
                    rest[k] = r  # type: ignore[index]
            elif predicate(v):
                matching[k] = v  # type: ignore[index]
            else:
                rest[k] = v  # type: ignore[index]
        return matching, rest
    if isinstance(x, list):
        matching = {} if return_lists_as_dicts else []
        rest = {} if return_lists_as_dicts else []

        def put(target: dict | list, i: int, v: Any) -> None:
            if return_lists_as_dicts:
                target[i] = v  # type: ignore[index]
            else:
                target.append(v)  # type: ignore[union-attr]

        for i, v in enumerate(x):
            if isinstance(v, (dict, list)) and v:
                m, r = extract_matching_values(v, predicate, return_lists_as_dicts)
                if m:
                    put(matching, i, m)
                if r:
                    put(rest, i, r)
            else:
                put(matching if predicate(v) else rest, i, v)
        return matching, rest
    raise CheckpointingException(f"extract_matching_values: the top level must be a dict or a list, got {type(x).__name__}")


def diff(x1: Any, x2: Any, prefix: tuple = ()) -> tuple[list, list, list]:
    """Recursive difference of two nested values.

    Returns the key paths only in ``x1``, those only in ``x2``, and ``(path, type1, type2)`` for
    values present in both that differ (tensors of one shape compare element by element, by
    value, whatever their dtypes, as Megatron-Core's ``diff`` does; values of different types
    always differ).
    """
    only_left: list = []
    only_right: list = []
    mismatch: list = []
    if isinstance(x1, dict) and isinstance(x2, dict):
        only_left = [prefix + (k,) for k in x1.keys() - x2.keys()]
        only_right = [prefix + (k,) for k in x2.keys() - x1.keys()]
        for k in x1.keys() & x2.keys():
            left, right, mis = diff(x1[k], x2[k], prefix + (k,))
            only_left += left
            only_right += right
            mismatch += mis
        return only_left, only_right, mismatch
    if isinstance(x1, (list, tuple)) and type(x1) is type(x2):
        only_left = [prefix + (i,) for i in range(len(x2), len(x1))]
        only_right = [prefix + (i,) for i in range(len(x1), len(x2))]
        for i, (a, b) in enumerate(zip(x1, x2)):
            left, right, mis = diff(a, b, prefix + (i,))
            only_left += left
            only_right += right
            mismatch += mis
        return only_left, only_right, mismatch
    if not _equal(x1, x2):
        mismatch.append((prefix, type(x1), type(x2)))
    return only_left, only_right, mismatch


def _equal(a: Any, b: Any) -> bool:
    if type(a) is not type(b):
        return False
    if isinstance(a, torch.Tensor):  # element values, as Megatron-Core compares them: an int64 3 equals a float32 3.0
        return a.shape == b.shape and bool(torch.all(a.cpu() == b.cpu()))
    if hasattr(a, "replica_id") and hasattr(a, "data"):  # sharded objects and tensors: compare their data
        return not any(diff(a.data, b.data))
    try:
        return bool(a == b)
    except Exception:  # noqa: BLE001 - e.g. numpy arrays of other shapes: not equal
        return False


def inspect_types(x: Any, prefix: tuple = (), indent: int = 4) -> None:
    """Print the types of a nested value, one line per leaf (a debugging aid)."""
    pad = " " * indent * len(prefix)
    if isinstance(x, dict):
        print()
        for k, v in x.items():
            print(f"{pad}> {k}: ", end="")
            inspect_types(v, prefix + (k,), indent)
    elif isinstance(x, list):
        print()
        for i, v in enumerate(x):
            print(f"{pad}- {i}: ", end="")
            inspect_types(v, prefix + (i,), indent)
    elif isinstance(x, torch.Tensor):
        print(f"Tensor of shape {x.shape}")
    else:
        try:
            text = str(x)
        except Exception:  # noqa: BLE001 - a broken __str__ must not stop the listing
            text = "<no string repr>"
        print(f"[{type(x)}]: {text[:30] + '... (truncated)' if len(text) > 30 else text}")


def nested_values(x: dict | list) -> Iterator[Any]:
    """The leaves of ``x``, depth first."""
    for v in x.values() if isinstance(x, dict) else x:
        if isinstance(v, (dict, list)):
            yield from nested_values(v)
        else:
            yield v


def nested_items_iter(x: dict | list) -> Iterator[tuple[dict | list, Any, Any]]:
    """``(container, key, leaf)`` for every leaf of ``x``, depth first."""
    for k, v in x.items() if isinstance(x, dict) else enumerate(x):
        if isinstance(v, (dict, list)):
            yield from nested_items_iter(v)
        else:
            yield x, k, v


def dict_map(f: Callable[[Any], Any], d: dict) -> None:
    """Replace every leaf ``v`` of ``d`` by ``f(v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(v)


def dict_map_with_key(f: Callable[[Any, Any], Any], d: dict) -> None:
    """Replace every leaf ``v`` under key ``k`` of ``d`` by ``f(k, v)``, in place."""
    for container, k, v in nested_items_iter(d):
        container[k] = f(k, v)


def dict_list_map_inplace(f: Callable[[U], V], x: dict | list | U) -> dict | list | V:
    """Replace every leaf of ``x`` by ``f(leaf)`` in place; returns ``x`` (``f(x)`` for a leaf)."""
    if isinstance(x, dict):
        for k, v in x.items():
            x[k] = dict_list_map_inplace(f, v)
        return x
    if isinstance(x, list):
        x[:] = [dict_list_map_inplace(f, v) for v in x]
        return x
    return f(x)


def dict_list_map_outplace(f: Callable[[U], V], x: dict | list | U) -> dict | list | V:
    """A copy of the nesting of ``x`` with every leaf replaced by ``f(leaf)``."""
    if isinstance(x, dict):
        return {k: dict_list_map_outplace(f, v) for k, v in x.items()}
    if isinstance(x, list):
        return [dict_list_map_outplace(f, v) for v in x]
    return f(x)


def merge(x1: dict | list, x2: dict | list, key: tuple = ()) -> dict | list:
    """Merge ``x2`` into ``x1`` recursively, in place; returns ``x1``.

    Keys of ``x2`` missing from ``x1`` are added; lists merge element by element and must have
    the same length; two leaves under one key are an error naming the key path.
    """
    if isinstance(x1, dict) and isinstance(x2, dict):
        for k, v in x2.items():
            x1[k] = merge(x1[k], v, key + (k,)) if k in x1 else v
        return x1
    if isinstance(x1, list) and isinstance(x2, list):
        if len(x1) != len(x2):
            raise CheckpointingException(
                f"cannot merge two lists of different lengths ({len(x1)} and {len(x2)}) at key path {key}"
            )
        for i, v in enumerate(x2):
            x1[i] = merge(x1[i], v, key + (i,))
        return x1
    raise CheckpointingException(
        f"cannot merge two values at key path {key}: {type(x1).__name__} and {type(x2).__name__} "
        "(only dicts and lists merge)"
    )


def map_reduce(
    xs: Iterable[Any],
    key_fn: Callable[[Any], Any] = lambda x: x,
    value_fn: Callable[[Any], Any] = lambda x: x,
    reduce_fn: Callable[[list], Any] = lambda x: x,
) -> dict:
    """Group ``value_fn(x)`` by ``key_fn(x)``, then reduce each group (``more_itertools.map_reduce``)."""
    groups: defaultdict[Any, list] = defaultdict(list)
    for x in xs:
        groups[key_fn(x)].append(value_fn(x))
    return {k: reduce_fn(v) for k, v in groups.items()}
