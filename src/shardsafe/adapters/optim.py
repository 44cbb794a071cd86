"""Optimizers -> flat state keyed by parameter name, and back, in place.

Stored keys (never integer ids, never pickle):

- ``optim.state.<param fqn>.<state name>``: a tensor with the parameter's sharding (``exp_avg``,
  ``momentum_buffer``...), a replicated scalar tensor (``step``), or a JSON value;
- ``optim.param_groups``: a JSON list, one dict per group, its hyper-parameters and ``params``
  as a list of parameter names. A checkpoint that ``torch.distributed.checkpoint`` wrote (through
  ``shardsafe.dcp.StorageWriter``, or converted) holds the same groups flattened the way DCP
  flattens a state dict, ``optim.param_groups.<i>.<field>``, tuples as tagged JSON:
  :func:`stored_param_groups` reads either.

Loading needs no state in the target optimizer: missing state tensors are allocated once, with the
parameter's sharding and the stored dtype, filled in place, and handed to the optimizer's own
``load_state_dict`` (which keeps them: same dtype and device, no copy).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError, ShapeMismatchError, ShardingError
from ..format.dtypes import torch_dtype
from ..format.metadata import StorageMetadata
from ..format.values import decode_objects
from .keys import CLASS_KEY, GROUPS_KEY, STATE_PREFIX
from .modules import ParamInfo
from .subclasses import allocate, class_path, inner_keys, is_record, valid_record

__all__ = [
    "CLASS_KEY", "GROUPS_KEY", "STATE_PREFIX", "check_param_groups", "optim_state", "optim_targets", "split_state_key",
    "dotted_param_groups", "stored_param_groups",
]



def _class_name(optim: torch.optim.Optimizer) -> str:
    return f"{type(optim).__module__}.{type(optim).__qualname__}"


def _named(optim: torch.optim.Optimizer, params: list[ParamInfo]) -> list[list[tuple[ParamInfo, torch.Tensor]]]:
    by_id = {id(p.tensor): p for p in params}
    groups = []
    for gi, group in enumerate(optim.param_groups):
        named = []
        for p in group["params"]:
            info = by_id.get(id(p))
            if info is None:
                raise CheckpointError(
                    f"optimizer param group {gi} holds a parameter of shape {list(p.shape)} that is not a parameter "
                    "of the model: pass the model the optimizer was built for"
                )
            named.append((info, p))
        groups.append(named)
    return groups


def _param_shape(info: ParamInfo) -> tuple[int, ...]:
    return info.flat[0] if info.flat is not None else tuple(info.tensor.shape)


def optim_state(optim: torch.optim.Optimizer, params: list[ParamInfo]) -> dict[str, Any]:
    """The optimizer's state and param groups as flat checkpoint values (views, no copies)."""
    out: dict[str, Any] = {}
    groups = []
    for group, named in zip(optim.param_groups, _named(optim, params)):
        for info, p in named:
            for name, value in optim.state.get(p, {}).items():
                key = f"{STATE_PREFIX}{info.fqn}.{name}"
                if not isinstance(value, torch.Tensor):
                    out[key] = value
                elif value.dim() == 0 and type(value) is torch.Tensor:
                    out[key] = value  # a replicated scalar such as Adam's step
                elif tuple(value.shape) == tuple(p.shape):
                    if not info.holds_nothing:
                        out[key] = info.sharded(key, value)
                else:
                    raise ShardingError(
                        f"optimizer state {name!r} of parameter {info.fqn!r} has shape {list(value.shape)}; only "
                        f"scalars and tensors shaped like the parameter ({list(p.shape)}) can be saved by name"
                    )
        hp = {k: _hp_to_json(v) for k, v in group.items() if k != "params"}
        hp["params"] = [info.fqn for info, _ in named]
        groups.append(hp)
    out[GROUPS_KEY] = groups
    out[CLASS_KEY] = _class_name(optim)
    return out


def split_state_key(key: str, fqns: set[str] | None) -> tuple[str, str]:
    """``optim.state.<fqn>.<name>`` -> ``(fqn, name)``, preferring a known ``fqn``."""
    rest = key[len(STATE_PREFIX):]
    if fqns is not None:
        pos = rest.rfind(".")
        while pos > 0:
            if rest[:pos] in fqns:
                return rest[:pos], rest[pos + 1 :]
            pos = rest.rfind(".", 0, pos)
    fqn, _, name = rest.rpartition(".")
    return fqn, name


def optim_targets(
    optim: torch.optim.Optimizer, params: list[ParamInfo], meta: StorageMetadata, where: str, *, strict: bool,
    dequantize: bool = False,
) -> tuple[dict[str, Any], Callable[[dict[str, Any]], None]]:
    """Targets to fill from ``meta`` and a function that hands them (once filled) to ``optim``.

    State stored as a tensor subclass (torchao's low-bit optimizer states) loads into the
    optimizer's own state of that class, or into new state of that class, laid out like the
    parameter; with ``dequantize``, into plain state of its high-precision dtype."""
    named = _named(optim, params)
    groups = stored_param_groups(meta, where)
    if groups is None:
        raise CheckpointError(f"{where}: no optimizer state in the checkpoint (no {GROUPS_KEY!r}); was it saved with an optimizer?")
    stored_groups = check_param_groups(groups, where, current=optim.param_groups)
    stored_class = meta.objects.get(CLASS_KEY)
    if strict and stored_class is not None and stored_class != _class_name(optim):
        raise CheckpointError(
            f"{where}: the checkpoint holds the state of a {stored_class} optimizer, the target is a "
            f"{_class_name(optim)}; its state and hyper-parameters would not fit (pass validate=False to load it anyway)"
        )
    _check_groups(stored_groups, [[i.fqn for i, _ in g] for g in named], where, strict=strict)
    fqns = {info.fqn for g in named for info, _ in g}
    stored: dict[str, dict[str, str]] = {}  # fqn -> state name -> key
    inner = inner_keys(meta.objects, where)
    for key in [*meta.tensors, *meta.objects, *meta.pickled_objects]:
        if key.startswith(STATE_PREFIX) and key not in inner:
            fqn, name = split_state_key(key, fqns)
            if fqn not in fqns:
                if strict:
                    raise CheckpointError(
                        f"{where}: checkpoint holds optimizer state {key!r} for parameter {fqn!r}, which the "
                        "optimizer does not hold (pass validate=False to ignore it)"
                    )
                continue
            stored.setdefault(fqn, {})[name] = key

    targets: dict[str, Any] = {}
    new_state: list[list[dict[str, Any]]] = []
    for named_group in named:
        group_state = []
        for info, p in named_group:
            current = optim.state.get(p, {})
            st: dict[str, Any] = {}
            if info.holds_nothing:
                group_state.append(st)  # FSDP1 keeps no state for a parameter with no part on this rank
                continue
            for name, key in stored.get(info.fqn, {}).items():
                tm = meta.tensors.get(key)
                if tm is None and is_record(record := meta.objects.get(key)):
                    st[name] = t = _subclass_target(current.get(name), record, info, p, key, where, dequantize)
                    targets[key] = info.sharded(key, t)
                    continue
                if tm is None:  # a JSON value
                    st[name] = None
                    targets[key] = None
                    continue
                st[name] = t = _target(current.get(name), tm.shape, tm.torch_dtype, info, p, key, where)
                targets[key] = t if t.dim() == 0 and type(t) is torch.Tensor else info.sharded(key, t)
            group_state.append(st)
        new_state.append(group_state)

    def apply(loaded: dict[str, Any]) -> None:
        state: dict[int, dict[str, Any]] = {}
        groups = []
        idx = 0
        for gi, (named_group, group_state) in enumerate(zip(named, new_state)):
            ids = []
            for (info, _), st in zip(named_group, group_state):
                for name, key in stored.get(info.fqn, {}).items() if st else ():
                    if st[name] is None:
                        st[name] = loaded[key]
                if st:
                    state[idx] = st
                ids.append(idx)
                idx += 1
            current = optim.param_groups[gi]
            g = {k: _hp_from_json(v, current.get(k)) for k, v in stored_groups[gi].items() if k != "params"}
            g["params"] = ids
            groups.append(g)
        optim.load_state_dict({"state": state, "param_groups": groups})

    return targets, apply


def stored_param_groups(meta: StorageMetadata, where: str) -> list[Any] | None:
    """The stored ``optim.param_groups`` (None if there are none): the one JSON list
    ``save_model_and_optim_state`` writes, or the groups rebuilt from the keys
    ``optim.param_groups.<i>.<field>`` of a checkpoint DCP wrote (tagged values decoded)."""
    if GROUPS_KEY in meta.objects:
        return decode_objects(meta.objects, {}, [GROUPS_KEY], allow_pickle=False, where=where)[GROUPS_KEY]
    prefix = GROUPS_KEY + "."
    keys = [k for k in [*meta.objects, *meta.pickled_objects, *meta.tensors] if k.startswith(prefix)]
    for key in keys:
        if key not in meta.objects:
            kind = "with pickle" if key in meta.pickled_objects else "as a tensor"
            raise CheckpointError(
                f"{where}: optimizer hyper-parameter {key!r} is stored {kind}; load_model_and_optim_state restores "
                "JSON values only. Load it with Checkpointer (allow_pickle=True for a pickled value) and set it yourself"
            )
    return dotted_param_groups(decode_objects(meta.objects, {}, keys, allow_pickle=False, where=where), prefix, where)


def dotted_param_groups(values: dict[str, Any], prefix: str, where: str) -> list[dict[str, Any]] | None:
    """Param groups from values keyed ``<prefix><group index>.<field>`` (as DCP flattens them);
    None when there are none."""
    found: dict[int, dict[str, Any]] = {}
    for key, value in values.items():
        index, _, field = key[len(prefix) :].partition(".")
        if not key.startswith(prefix) or not index.isdigit() or not field:
            raise CorruptCheckpointError(f"{where}: key {key!r} is not {prefix}<group index>.<field>")
        found.setdefault(int(index), {})[field] = value
    if not found:
        return None
    if sorted(found) != list(range(len(found))):
        raise CorruptCheckpointError(f"{where}: optimizer param groups {sorted(found)} are stored; expected 0..{len(found) - 1}")
    return [found[i] for i in range(len(found))]


def _target(current: Any, shape: tuple[int, ...], dtype: torch.dtype, info: ParamInfo, p: torch.Tensor, key: str, where: str) -> torch.Tensor:
    """The tensor to load ``key`` into: the optimizer's own if it fits, else a new one like ``p``."""
    if shape == ():
        if isinstance(current, torch.Tensor) and type(current) is torch.Tensor and current.dim() == 0 and current.dtype == dtype:
            return current
        return torch.empty((), dtype=dtype)
    if shape != _param_shape(info):
        raise ShapeMismatchError(
            f"{where}: key {key!r}: checkpoint holds optimizer state of shape {list(shape)} for parameter "
            f"{info.fqn!r} of shape {list(_param_shape(info))}; only scalars and parameter-shaped state load by name"
        )
    if (
        isinstance(current, torch.Tensor)
        and type(current) is type(p.data)
        and current.shape == p.shape
        and current.dtype == dtype
    ):
        return current
    return torch.empty_like(p.detach(), dtype=dtype)


def _subclass_target(
    current: Any, record: dict[str, Any], info: ParamInfo, p: torch.Tensor, key: str, where: str, dequantize: bool
) -> torch.Tensor:
    """The tensor to load the subclass state ``key`` into: the optimizer's own if it is of the
    stored class, else a new one of that class laid out like ``p`` (plain, of the stored
    dtype, with ``dequantize``)."""
    valid_record(where, key, record)
    if tuple(record["shape"]) != _param_shape(info):
        raise ShapeMismatchError(
            f"{where}: key {key!r}: checkpoint holds optimizer state of shape {record['shape']} for parameter "
            f"{info.fqn!r} of shape {list(_param_shape(info))}"
        )
    local = getattr(current, "_local_tensor", current)
    if local is not None and class_path(type(local)) == record["class"]:
        return current
    if dequantize:
        return torch.empty_like(p.detach(), dtype=torch_dtype(record["dtype"]))
    if info.flat is not None:
        raise ShardingError(
            f"{where}: key {key!r} holds a {record['class']}; a flat-sharded (FSDP1) parameter cannot hold it. Pass "
            "dequantize=True to load its high-precision values"
        )
    plocal = getattr(p, "_local_tensor", p)
    value, _ = allocate(where, key, record, tuple(plocal.shape), plocal.device)
    if plocal is p:
        return value
    return type(p).from_local(value, p.device_mesh, p.placements, run_check=False, shape=p.shape, stride=p.stride())


def check_param_groups(groups: Any, where: str, *, current: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """``groups`` (the stored ``optim.param_groups``) if it is well formed, else
    ``CorruptCheckpointError`` naming the group index and the field: a list of objects, each
    with ``params``, a list of non-empty parameter names that no other group lists. With
    ``current`` (the target optimizer's param groups), a hyper-parameter that the optimizer
    keeps as a tensor must be stored as a number, and one it keeps as a tuple as a list."""
    if not isinstance(groups, list):
        raise CorruptCheckpointError(f"{where}: {GROUPS_KEY!r} must be a list of param groups, found {_kind(groups)}")
    owner: dict[str, int] = {}
    for gi, group in enumerate(groups):
        field = f"{GROUPS_KEY!r} group {gi}"
        if not isinstance(group, dict):
            raise CorruptCheckpointError(f"{where}: {field} must be an object of hyper-parameters and 'params', found {_kind(group)}")
        params = group.get("params")
        if not isinstance(params, list) or not all(isinstance(p, str) and p for p in params):
            raise CorruptCheckpointError(f"{where}: {field}, field 'params' must be a list of parameter names, found {_kind(params)}")
        for name in params:
            if name in owner:
                again = "twice" if owner[name] == gi else f"and so does group {owner[name]}"
                raise CorruptCheckpointError(f"{where}: {field}, field 'params' lists parameter {name!r} {again}")
            owner[name] = gi
        for key, value in group.items() if current is not None and gi < len(current) else ():
            mine = current[gi].get(key)  # type: ignore[index]
            if isinstance(mine, torch.Tensor) and (type(value) not in (int, float) or mine.numel() != 1):
                raise CorruptCheckpointError(
                    f"{where}: {field}, field {key!r}: the optimizer holds a tensor of {mine.numel()} element(s) there, "
                    f"the checkpoint {_kind(value)}; only one number can be restored into it"
                )
            if isinstance(mine, tuple) and not isinstance(value, (list, tuple)):
                raise CorruptCheckpointError(f"{where}: {field}, field {key!r}: the optimizer holds a tuple there, the checkpoint {_kind(value)}")
    return groups


def _kind(value: Any) -> str:
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"the number {value!r}"
    return "nothing" if value is None else f"a {type(value).__name__}"


def _check_groups(stored: list, current: list[list[str]], where: str, *, strict: bool) -> None:
    """Each group of the optimizer must hold the parameters of the checkpoint's group of the same
    index; parameters only in the checkpoint's group are refused only when ``strict``."""
    if len(stored) != len(current):
        raise CheckpointError(
            f"{where}: checkpoint has {len(stored)} optimizer param group(s), the optimizer has {len(current)}"
        )
    for gi, (s, c) in enumerate(zip(stored, current)):
        saved = set(s.get("params", [])) if isinstance(s, dict) else set()
        missing, extra = sorted(set(c) - saved), sorted(saved - set(c))
        if missing or (extra and strict):
            raise CheckpointError(
                f"{where}: optimizer param group {gi} differs from the checkpoint's: parameters only in the "
                f"optimizer {missing[:5]}{'...' if len(missing) > 5 else ''}, only in the checkpoint "
                f"{extra[:5]}{'...' if len(extra) > 5 else ''}"
                + ("" if missing else " (pass validate=False to ignore parameters only in the checkpoint)")
            )


def _hp_to_json(value: Any) -> Any:
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        return value.item()  # a tensor learning rate: restored into the optimizer's own tensor
    if isinstance(value, tuple):
        return [_hp_to_json(v) for v in value]
    return value


def _hp_from_json(value: Any, current: Any) -> Any:
    if isinstance(current, torch.Tensor):
        return torch.tensor(value, dtype=current.dtype, device=current.device).reshape(current.shape)
    if isinstance(current, tuple) and isinstance(value, list):
        return tuple(value)
    return value
