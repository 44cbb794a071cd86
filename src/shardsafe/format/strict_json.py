"""The one JSON reader for everything shardsafe parses from a checkpoint (``metadata.json`` and
data-file headers): RFC 8259 JSON and nothing looser.

Refused, with a ``ValueError`` that says why (callers name the file): bytes that are not UTF-8,
a byte order mark, ``NaN`` / ``Infinity`` and numbers too large for a finite float, an object
that holds a key twice (readers would disagree about its value), and nesting deep enough to
exhaust the parser's recursion. Callers bound the nesting of the parts that may hold any value
with :func:`nesting_exceeds` (stored values nest at most :data:`MAX_DEPTH` deep, so that no later
reader or writer of them runs out of recursion either).
"""

from __future__ import annotations

import codecs
import json
import math
from typing import Any

__all__ = ["MAX_DEPTH", "loads", "nesting_exceeds"]

MAX_DEPTH = 64
"""Deepest nesting of arrays and objects in a stored value (``objects`` of ``metadata.json``)."""


def loads(raw: bytes) -> Any:
    """Parse ``raw``, or raise ``ValueError`` saying what is wrong with it."""
    if raw.startswith(codecs.BOM_UTF8):
        raise ValueError("it starts with a UTF-8 byte order mark, which JSON text must not have")
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8: {e}") from None
    try:
        doc = json.loads(text, parse_constant=_no_constant, parse_float=_finite_float, object_pairs_hook=_unique_keys)
    except RecursionError:
        raise ValueError(f"arrays and objects nest too deep to parse (at most {MAX_DEPTH} levels are allowed in a value)") from None
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON: {e}") from None
    return doc


def nesting_exceeds(value: Any, limit: int) -> bool:
    """True when lists and dicts in ``value`` nest deeper than ``limit`` (a bare 1 is depth 0,
    ``[1]`` depth 1). Iterative: safe for any depth."""
    stack = [(value, 0)]
    while stack:
        v, depth = stack.pop()
        t = type(v)
        if t is dict:
            children: Any = v.values()
        elif t is list:
            children = v
        else:
            continue
        if depth == limit:
            return True
        stack.extend((c, depth + 1) for c in children if type(c) in (dict, list))
    return False


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"number {text[:40]} does not fit a finite float")
    return value


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    out = dict(pairs)
    if len(out) != len(pairs):
        seen: set[str] = set()
        dup = next(k for k, _ in pairs if k in seen or seen.add(k))  # type: ignore[func-returns-value]
        raise ValueError(f"key {dup!r} appears twice in one object")
    return out
