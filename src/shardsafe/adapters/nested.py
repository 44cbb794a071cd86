"""Nested state dicts and ``Stateful`` objects -> the flat state dict a checkpoint stores, and back.

``torch.distributed.checkpoint`` users write ``{"model": model_sd, "optim": optim_sd, "step": step}``
and pass objects such as an LR scheduler as values. The rules, on save and on load:

- a value with callable ``state_dict()`` and ``load_state_dict()`` that is not a tensor (a
  ``Stateful`` as DCP defines it: modules, optimizers, LR schedulers, data loaders...) stands for
  what its ``state_dict()`` returns (called once per save and per load; after a load, the
  object's ``load_state_dict`` gets the loaded state);
- a ``Mapping`` (dict, ``OrderedDict``...) that holds a tensor or a ``Stateful``, directly or
  through other mappings, is entered: its item ``k`` is stored under ``<key>.<str(k)>``, the key
  DCP's ``flatten_state_dict`` gives it (``optim.state.0.exp_avg``);
- anything else is a leaf: a tensor is stored as a tensor, any other value as one JSON value
  (tagged JSON where JSON lacks a type). A list is always a value (``optim.param_groups``),
  where DCP flattens a list that holds dicts or tensors further; a tensor in a list is refused.

A flat state dict (no mapping that holds tensors, no ``Stateful``) is stored exactly as it was
before nesting was supported. Loading, a target mapping that holds no tensor is entered when
the checkpoint stores keys under its key rather than its key itself (a fresh optimizer's empty
``state``), and is otherwise one value; so is a target list (``torch.distributed.checkpoint``,
through ``shardsafe.dcp.StorageWriter``, stores ``optim.param_groups.0.lr`` where ``Checkpointer``
stores ``optim.param_groups``: both load into the same target).
"""

from __future__ import annotations

from collections.abc import Callable, Container, Iterable, Mapping, MutableMapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ..errors import CheckpointError
from ..format.strict_json import MAX_DEPTH
from .sharded_tensor import ShardedTensor

__all__ = ["Targets", "flatten_state", "is_stateful", "load_targets"]


def is_stateful(v: Any) -> bool:
    """Whether ``v`` is saved through its ``state_dict()`` and loaded through its
    ``load_state_dict()`` (DCP's ``Stateful`` protocol; a class itself is not)."""
    return (
        not isinstance(v, (torch.Tensor, ShardedTensor, type))
        and callable(getattr(v, "state_dict", None))
        and callable(getattr(v, "load_state_dict", None))
    )


def _is_tensor(v: Any) -> bool:
    return isinstance(v, (torch.Tensor, ShardedTensor))


def _holds_state(m: Mapping, depth: int = 0) -> bool:
    """Whether mapping ``m`` holds a tensor or a ``Stateful``, directly or through mappings."""
    if depth > MAX_DEPTH:  # deeper than any stored value may nest (or it contains itself): a value, refused as one
        return False
    return any(_is_tensor(v) or is_stateful(v) or (isinstance(v, Mapping) and _holds_state(v, depth + 1)) for v in m.values())


def _needs_flattening(state_dict: dict[str, Any]) -> bool:
    for v in state_dict.values():
        if _is_tensor(v):
            continue
        if is_stateful(v) or (isinstance(v, Mapping) and _holds_state(v)):
            return True
    return False


def _key(path: tuple) -> str:
    return path[0] if len(path) == 1 else ".".join(map(str, path))


def _shown(path: tuple) -> str:
    return "state_dict" + "".join(f"[{p!r}]" for p in path)


def _check_top_key(path: tuple) -> None:
    if len(path) == 1 and not (isinstance(path[0], str) and path[0]):
        raise CheckpointError(f"state_dict keys must be non-empty strings, got {path[0]!r}")


def _deeper(path: tuple) -> None:
    if len(path) > MAX_DEPTH:
        raise CheckpointError(f"{_shown(path[:4])}...: nested dicts nest deeper than {MAX_DEPTH} levels (or contain themselves)")


def _call(key: str, obj: Any, method: str, *args: Any, what: str = "") -> Any:
    """``obj.method(*args)``, a user's ``Stateful`` method that may raise anything: named with its key."""
    try:
        return getattr(obj, method)(*args)
    except CheckpointError:
        raise
    except Exception as e:  # noqa: BLE001 - named with its key, the cause chained
        raise CheckpointError(f"key {key!r}: {type(obj).__qualname__}.{method}(){what} raised {type(e).__name__}: {e}") from e


def _state_of(obj: Any, path: tuple) -> Any:
    return _call(_key(path), obj, "state_dict")


def flatten_state(state_dict: dict[str, Any]) -> dict[str, Any]:
    """The flat state dict to store for ``state_dict`` (itself when nothing in it nests): nested
    mappings that hold tensors under dotted keys, ``Stateful`` values replaced by their
    ``state_dict()``. Two entries that flatten to one key raise ``CheckpointError``."""
    if not _needs_flattening(state_dict):
        return state_dict
    flat: dict[str, Any] = {}
    origin: dict[str, tuple] = {}  # key -> the path to its entry, with the caller's own keys (for messages)

    def visit(path: tuple, shown: tuple, v: Any) -> None:
        if not _is_tensor(v):
            if is_stateful(v):
                v = _state_of(v, path)
            if isinstance(v, Mapping) and _holds_state(v):
                _check_top_key(path)
                _deeper(path)
                for k, x in v.items():
                    visit((*path, str(k)), (*shown, k), x)
                return
        key = _key(path)
        if key in flat:
            raise CheckpointError(
                f"{_shown(origin[key])} and {_shown(shown)} are both stored under the key {key!r} (nested keys are joined "
                "with '.', as torch.distributed.checkpoint does); rename one of them"
            )
        flat[key] = v
        origin[key] = shown

    for k, v in state_dict.items():
        visit((k,), (k,), v)
    return flat


@dataclass
class Targets:
    """A (possibly nested) load target as the flat state dict to load, and how to give the
    loaded values back: each value into the mapping that held its target, then each
    ``Stateful``'s ``load_state_dict`` (inner ones first)."""

    flat: dict[str, Any]
    slots: dict[str, tuple[MutableMapping | list, Any]] | None = None  # None: flat is the caller's own dict
    statefuls: list[tuple[str, Any, list[Any]]] = field(default_factory=list)  # (key, object, [its state dict, once loaded])

    def apply(self, values: dict[str, Any]) -> None:
        """Put the loaded ``values`` (flat keys) in place and restore the ``Stateful`` objects."""
        if self.slots is None:
            self.flat.update(values)
            return
        for key, v in values.items():
            container, k = self.slots[key]
            container[k] = v
        for key, obj, state in self.statefuls:
            _call(key, obj, "load_state_dict", state[0], what=" of the loaded state")


def load_targets(
    state_dict: dict[str, Any], stored_values: Container[str], stored_keys: Callable[[], Iterable[str]]
) -> Targets:
    """``state_dict`` as flat load targets (see the module docstring). ``stored_values``: the
    keys the checkpoint holds as values; ``stored_keys()``: every key it holds,
    asked for only when a target mapping without tensors must be placed."""
    if not _needs_flattening(state_dict) and all(
        k in stored_values for k, v in state_dict.items() if isinstance(v, Mapping) or type(v) is list
    ):
        return Targets(state_dict)  # flat: every target is its own key
    out = Targets({}, {})
    prefixes: set[str] | None = None

    def stored_under(key: str) -> bool:
        nonlocal prefixes
        if prefixes is None:
            prefixes = set()
            for k in stored_keys():
                i = k.find(".")
                while i >= 0:
                    prefixes.add(k[:i])
                    i = k.find(".", i + 1)
        return key in prefixes

    def visit(container: MutableMapping | list, k: Any, path: tuple, v: Any) -> None:
        key = _key(path)
        if not _is_tensor(v):
            if is_stateful(v):
                state = [_state_of(v, path)]
                visit(state, 0, path, state[0])
                out.statefuls.append((key, v, state))
                return
            if isinstance(v, Mapping) and (_holds_state(v) or (key not in stored_values and stored_under(key))):
                _check_top_key(path)
                _deeper(path)
                for ik, x in list(v.items()):
                    visit(v, ik, (*path, str(ik)), x)
                return
            if type(v) is list and key not in stored_values and stored_under(key):  # as DCP flattened it (param groups)
                _deeper(path)
                for i, x in enumerate(v):
                    visit(v, i, (*path, str(i)), x)
                return
            if not isinstance(container, (MutableMapping, list)):
                raise CheckpointError(
                    f"key {key!r}: its target sits in a {type(container).__qualname__}, which cannot be changed; a load replaces "
                    "non-tensor values, so hold them in dicts"
                )
        if key in out.flat:
            raise CheckpointError(f"two entries of the load target are both the key {key!r} (nested keys are joined with '.'); rename one")
        out.flat[key] = v
        out.slots[key] = (container, k)  # type: ignore[index]

    for k, v in list(state_dict.items()):
        visit(state_dict, k, (k,), v)
    return out
