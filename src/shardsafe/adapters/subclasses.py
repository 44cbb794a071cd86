"""Tensor subclasses: quantized tensors, low-bit optimizer states and float8 all-gather weights.

A traceable wrapper subclass (``__tensor_flatten__`` / ``__tensor_unflatten__``, the protocol
torchao and torch use) on the allow-list is stored as its inner tensors, each an ordinary
tensor under the key ``<key>#<inner name>`` with its own sharding, and one JSON record under
``<key>`` itself: the class by its import path, the outer shape and dtype, the flatten context
as typed JSON, and each inner tensor's geometry. Nothing is pickled.

An inner tensor's geometry is one of:

- **shared**: the same on every shard (a lookup table, a per-tensor statistic): stored once,
  like a replicated tensor;
- **blocked**: one element per block of ``k`` consecutive elements of the local tensor's
  flattened order (``k = 1``: elementwise codes; ``k = 2``: two 4-bit codes a byte; ``k = 256``:
  a scale per block). A block is a box of the outer tensor (``block``: ``[1, 256]`` is a row
  part, ``[4, 64]`` four rows of 64), so the inner tensor is stored as a grid of those boxes,
  sharded as the outer tensor is. A load into another layout reads codes and scales of its own
  boxes: it needs the same blocks, and cuts that fall on block edges; otherwise
  ``ShardingError`` names the key, the block and the cut. Nothing is dequantized unless asked.

A subclass that only changes how its tensor is all-gathered (torchao's float8 all-gather
weight) is stored as the high-precision tensor it wraps (``wraps``), so that the checkpoint
loads into a model without it and back.

Classes are named by import path and imported only from the allow-list
(:func:`register_tensor_subclass` extends it); a checkpoint never makes the reader import
anything else. Any other subclass is refused, naming the key and the class, inside a DTensor too.
"""

from __future__ import annotations

import dataclasses
import importlib
import math
import threading
from dataclasses import dataclass
from typing import Any

import torch

from ..errors import CheckpointError, CorruptCheckpointError, ShardingError
from ..format.dtypes import DTYPE_NAMES, dtype_name, torch_dtype
from ..format.values import TAG, decode_value, encode_value

__all__ = [
    "INNER_SEP", "RECORD_TAG", "SubclassRule", "allowed_tensor_subclasses", "as_plain", "class_path", "is_record",
    "register_tensor_subclass", "rule_for",
]

INNER_SEP = "#"
"""Between a subclass's key and an inner tensor's name: ``optim.state.w.exp_avg#codes``."""
RECORD_TAG = "tensor_subclass"


@dataclass(frozen=True)
class SubclassRule:
    """How one allow-listed subclass is stored.

    ``shared``: inner tensors that are the same on every shard (stored once). ``wraps``: the
    inner attribute holding the high-precision tensor of a subclass that only changes how it is
    all-gathered (stored as that tensor, no record). ``dequantize``: the method that returns the
    high-precision tensor (for ``dequantize=True`` loads and exports). ``context``: the import
    paths of the dataclasses and named tuples its flatten context may hold from modules other
    than its own (those of its own module are always allowed; an enum is the values codec's). ``refuse``: flatten-context
    entries ``(name, value)`` under which a value's inner tensors are in a layout of the class's
    own rather than blocks of the tensor (MX scales swizzled for a GPU kernel): refused on save."""

    path: str
    shared: tuple[str, ...] = ()
    wraps: str | None = None
    dequantize: str | None = "dequantize"
    context: tuple[str, ...] = ()
    refuse: tuple[tuple[str, Any], ...] = ()


_LOCK = threading.Lock()
_RULES: dict[str, SubclassRule] = {
    r.path: r
    for r in (
        SubclassRule("torchao.optim.subclass_8bit.OptimState8bit", shared=("qmap",)),
        SubclassRule("torchao.optim.subclass_4bit.OptimState4bit", shared=("qmap",)),
        SubclassRule("torchao.optim.subclass_fp8.OptimStateFp8"),
        SubclassRule(
            "torchao.quantization.quantize_.workflows.nf4.nf4_tensor.NF4Tensor",
            shared=("nf4", "scaler_mean"), dequantize="get_original_weight",
        ),
        SubclassRule("torchao.dtypes.nf4tensor.NF4Tensor", shared=("nf4", "scaler_mean"), dequantize="get_original_weight"),
        SubclassRule("torchao.float8.fsdp_utils.WeightWithDynamicFloat8CastTensor", wraps="_tensor", dequantize=None),
        SubclassRule("torchao.float8.fsdp_utils.WeightWithDelayedFloat8CastTensor", wraps="_tensor", dequantize=None),
        SubclassRule("torchao.float8.fsdp_utils.WeightWithStaticFloat8CastTensor", wraps="_tensor", dequantize=None),
        # float8 weights with a scale per row, per block or per tensor (quantize_'s float8 configs)
        SubclassRule("torchao.quantization.Float8Tensor", context=(
            "torchao.float8.inference.Float8MMConfig",
            "torchao.quantization.quantize_.workflows.float8.float8_tensor.QuantizeTensorToFloat8Kwargs",
            "torchao.quantization.granularity.PerRow",
            "torchao.quantization.granularity.PerTensor",
            "torchao.quantization.granularity.PerBlock",
        )),
        # MXFP8: float8 codes and a float8_e8m0fnu scale per block of 32 along the last dimension
        SubclassRule("torchao.prototype.mx_formats.mx_tensor.MXTensor", refuse=(("is_swizzled_scales", True),)),
    )
}


def class_path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


def register_tensor_subclass(
    cls: type | str, *, shared: tuple[str, ...] = (), wraps: str | None = None, dequantize: str | None = "dequantize",
    context: tuple[str, ...] = (),
) -> None:
    """Put a traceable wrapper subclass on the allow-list (by class or import path). ``shared``:
    inner tensors equal on every shard; ``wraps``: the attribute to store instead (a subclass that
    only changes how it is all-gathered); ``dequantize``: the method giving the high precision;
    ``context``: import paths of the dataclasses and named tuples its context holds from elsewhere."""
    path = cls if isinstance(cls, str) else class_path(cls)
    if not isinstance(cls, str) and not (hasattr(cls, "__tensor_flatten__") and hasattr(cls, "__tensor_unflatten__")):
        raise CheckpointError(
            f"{path} has no __tensor_flatten__/__tensor_unflatten__: only traceable wrapper subclasses can be registered"
        )
    with _LOCK:
        _RULES[path] = SubclassRule(path, tuple(shared), wraps, dequantize, tuple(context))


def allowed_tensor_subclasses() -> list[str]:
    """The import paths of the subclasses shardsafe stores (the allow-list)."""
    return sorted(_RULES)


def rule_for(cls: type) -> SubclassRule | None:
    return _RULES.get(class_path(cls))


def is_record(value: Any) -> bool:
    return isinstance(value, dict) and value.get(TAG) == RECORD_TAG


def refuse_unknown(key: str, cls: type, inside: str = "") -> ShardingError:
    return ShardingError(
        f"key {key!r}: a {class_path(cls)}{inside} is a torch.Tensor subclass shardsafe does not know, so it cannot "
        "tell how the tensor is sharded; taking it for a replicated tensor could store one rank's part as the whole. "
        "Pass a plain tensor, a DTensor or a shardsafe.ShardedTensor describing its part, or, for a traceable wrapper "
        "subclass (__tensor_flatten__), put it on the allow-list with shardsafe.register_tensor_subclass"
    )


# --- geometry -------------------------------------------------------------------------------------


def block_shape(key: str, name: str, local: tuple[int, ...], k: int) -> tuple[int, ...]:
    """The box of the local tensor (shape ``local``) that ``k`` consecutive elements of its
    flattened order fill: trailing dimensions whole, then part of one; or ``ShardingError``."""
    block = [1] * len(local)
    rest = k
    for d in range(len(local) - 1, -1, -1):
        if rest == 1:
            break
        if rest % local[d] == 0:
            block[d] = local[d]
            rest //= local[d]
        elif local[d] % rest == 0:
            block[d] = rest
            rest = 1
        else:
            break
    if rest != 1:
        raise ShardingError(
            f"key {key!r}: inner tensor {name!r} has one element per {k} elements of the local tensor of shape "
            f"{list(local)}, which are not a box of it; shardsafe stores blocks that are boxes"
        )
    return tuple(block)


def _geometry(key: str, name: str, inner: torch.Tensor, local: tuple[int, ...]) -> tuple[tuple[int, ...], str]:
    """``(block, form)`` of a blocked inner tensor (one element per ``k`` of the local tensor): ``form`` is ``outer`` (shaped like the
    local tensor), ``flat`` (1-D) or ``grid`` (one element per block along each dimension: the grid itself)."""
    numel = math.prod(local)
    if inner.numel() == 0 or numel % inner.numel() != 0:
        raise ShardingError(
            f"key {key!r}: inner tensor {name!r} holds {inner.numel()} elements for a local tensor of {numel}; "
            "shardsafe stores inner tensors with one element per block of the local tensor, or shared ones"
        )
    k = numel // inner.numel()
    if tuple(inner.shape) == local:
        form = "outer"
    elif inner.dim() == 1:
        form = "flat"
    elif inner.dim() == len(local) and all(n % g == 0 for n, g in zip(local, inner.shape)):
        return tuple(n // g for n, g in zip(local, inner.shape)), "grid"  # a scale per row, per block, per tensor
    else:
        raise ShardingError(
            f"key {key!r}: inner tensor {name!r} has shape {list(inner.shape)}, neither the local tensor's "
            f"{list(local)}, nor 1-D, nor a grid of blocks of it; shardsafe does not know how it is laid out"
        )
    return block_shape(key, name, local, k), form


def _cut_error(key: str, name: str, block: tuple[int, ...], offset: tuple[int, ...], size: tuple[int, ...], shape: tuple[int, ...]) -> ShardingError | None:
    for d, b in enumerate(block):
        if shape[d] % b:
            return ShardingError(
                f"key {key!r}: inner tensor {name!r} holds blocks of {list(block)} elements, which do not tile the "
                f"global shape {list(shape)} along dimension {d}"
            )
        for cut in (offset[d], offset[d] + size[d]):
            if cut % b:
                return ShardingError(
                    f"key {key!r}: this layout cuts dimension {d} at {cut}, inside a block of {b} (blocks of "
                    f"{list(block)} elements, {math.prod(block)} a block, for inner tensor {name!r}): quantized "
                    "state reshards only where cuts fall on block edges; load it in a layout whose cuts do, or pass "
                    "dequantize=True to load the high-precision values"
                )
    return None


# --- the flatten context as JSON --------------------------------------------------------------------


def _ctx_json(key: str, ctx: Any, local: tuple[int, ...]) -> Any:
    """The flatten context as typed JSON, with the local shape and its contiguous strides as
    markers (so that every shard, and any layout, has the same context)."""
    strides = _contiguous(local)

    def walk(v: Any) -> Any:
        if isinstance(v, torch.Size) and tuple(v) == local:
            return {"$outer": "shape"}
        if type(v) is tuple and v == strides and len(v) == len(local) and local:
            return {"$outer": "strides"}
        if isinstance(v, torch.device):  # where it lives is the target's business
            return {"$outer": "device"}
        if dataclasses.is_dataclass(v) and not isinstance(v, type):
            return {"$class": class_path(type(v)), "fields": {f.name: walk(getattr(v, f.name)) for f in dataclasses.fields(v)}}
        if isinstance(v, tuple) and hasattr(type(v), "_fields"):  # a named tuple
            return {"$class": class_path(type(v)), "fields": {f: walk(getattr(v, f)) for f in type(v)._fields}}
        if isinstance(v, dict):
            return {k: walk(x) for k, x in v.items()}
        if isinstance(v, (list, tuple)) and type(v) in (list, tuple):
            return type(v)(walk(x) for x in v)
        return v

    return encode_value(walk(ctx), where=f"key {key!r}: the flatten context", allow_pickle=False, opt_in="")


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for n in reversed(shape):
        out.append(acc)
        acc *= n
    return tuple(reversed(out))


def _context_classes() -> tuple[set[str], set[str]]:
    """The modules of the allow-listed classes, and the other classes their contexts may hold."""
    with _LOCK:
        rules = list(_RULES.values())
    return {r.path.rpartition(".")[0] for r in rules}, {p for r in rules for p in r.context}


def _ctx_value(key: str, doc: Any, shape: tuple[int, ...], device: torch.device) -> Any:
    """The flatten context for a tensor of ``shape``, from its JSON."""
    raw = decode_value(doc, where=f"key {key!r}: the flatten context", allow_pickle=False, opt_in="")
    modules, classes = _context_classes()

    def walk(v: Any) -> Any:
        if isinstance(v, dict):
            if v.keys() == {"$outer"}:
                return {"shape": torch.Size(shape), "strides": _contiguous(shape), "device": device}.get(v["$outer"])
            if v.keys() == {"$class", "fields"}:
                path = v["$class"]
                if not isinstance(path, str) or (path.rpartition(".")[0] not in modules and path not in classes):
                    raise CheckpointError(
                        f"key {key!r}: the flatten context names class {path!r}, which is neither in the module of an "
                        "allow-listed subclass nor in its rule's context classes; shardsafe imports no other class"
                    )
                cls = _import(key, path)
                fields = v["fields"]
                named_tuple = isinstance(cls, type) and issubclass(cls, tuple) and hasattr(cls, "_fields")
                if not ((isinstance(cls, type) and dataclasses.is_dataclass(cls)) or named_tuple) or not isinstance(fields, dict):
                    raise CheckpointError(f"key {key!r}: the flatten context names {path!r}, which is not a dataclass or a named tuple")
                try:
                    return cls(**{k: walk(x) for k, x in fields.items()})
                except TypeError as e:
                    raise CorruptCheckpointError(f"key {key!r}: the flatten context's {path} cannot be built: {e}") from None
            return {k: walk(x) for k, x in v.items()}
        if type(v) in (list, tuple):
            return type(v)(walk(x) for x in v)
        return v

    return walk(raw)


def _import(key: str, path: str) -> Any:
    module, _, name = path.rpartition(".")
    try:
        obj: Any = importlib.import_module(module)
        for part in name.split("."):
            obj = getattr(obj, part)
    except (ImportError, AttributeError) as e:
        raise CheckpointError(f"key {key!r}: cannot import {path} ({e}); install the package that defines it") from None
    return obj


# --- describing a subclass value ------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Inner:
    """One inner tensor of a subclass value as this rank holds it."""

    name: str
    key: str
    tensor: torch.Tensor  # shaped as stored: the grid of blocks (blocked), or as is (shared)
    shape: tuple[int, ...]  # its global shape
    offset: tuple[int, ...] | None  # where this rank's grid sits in it; None: shared


@dataclass(frozen=True, slots=True)
class Described:
    """A subclass value: its inner tensors and the record that stands for it."""

    key: str
    inners: list[Inner]
    record: dict[str, Any]


def unwrap(key: str, value: torch.Tensor) -> torch.Tensor | None:
    """The tensor a float8 all-gather wrapper stands for (None: ``value`` is not one)."""
    rule = rule_for(type(value))
    if rule is None or rule.wraps is None:
        return None
    inner = getattr(value, rule.wraps, None)
    if not isinstance(inner, torch.Tensor):
        raise ShardingError(f"key {key!r}: {class_path(type(value))} holds no tensor in {rule.wraps!r}")
    return inner


def as_plain(key: str, t: torch.Tensor) -> torch.Tensor | None:
    """``t`` itself if it is a plain tensor (or a Parameter), the tensor it wraps if it is a float8
    all-gather weight, else None: a subclass whose bytes are not the tensor's."""
    return t if type(t) in (torch.Tensor, torch.nn.Parameter) else unwrap(key, t)


def describe_subclass(
    key: str, value: torch.Tensor, shape: tuple[int, ...], offset: tuple[int, ...], dtype: torch.dtype
) -> Described:
    """The inner tensors of ``value`` (this rank's local tensor of a global tensor of ``shape``,
    at ``offset``) and the record that stands for it. ``ShardingError`` for a class off the
    allow-list or an inner tensor shardsafe cannot lay out."""
    cls = type(value)
    rule = rule_for(cls)
    if rule is None:
        raise refuse_unknown(key, cls)
    local = tuple(value.shape)
    names, ctx = value.__tensor_flatten__()
    for name, bad in rule.refuse:
        if isinstance(ctx, dict) and name in ctx and ctx[name] == bad:
            raise ShardingError(
                f"key {key!r}: a {rule.path} with {name}={bad!r} holds its inner tensors in a layout of its own, not as "
                "blocks of the tensor, so shardsafe cannot store or reshard them; save it before that layout is applied"
            )
    inners: list[Inner] = []
    doc: dict[str, Any] = {}
    for name in names:
        t = getattr(value, name)
        if type(t) is not torch.Tensor:
            raise ShardingError(
                f"key {key!r}: inner tensor {name!r} of {class_path(cls)} is a {class_path(type(t))}; shardsafe stores "
                "subclasses whose inner tensors are plain tensors"
            )
        t = t.detach()
        ikey = f"{key}{INNER_SEP}{name}"
        if name in rule.shared:
            inners.append(Inner(name, ikey, t, tuple(t.shape), None))
            doc[name] = {"key": ikey, "shared": True, "dtype": dtype_name(t.dtype, key=ikey), "shape": list(t.shape)}
            continue
        block, form = _geometry(key, name, t, local)
        problem = _cut_error(key, name, block, offset, local, shape)
        if problem is not None:
            raise problem
        grid = tuple(n // b for n, b in zip(local, block))
        if not t.is_contiguous():
            raise ShardingError(f"key {key!r}: inner tensor {name!r} is not contiguous; shardsafe reads and writes it in place")
        inners.append(Inner(
            name, ikey, t.view(grid), tuple(n // b for n, b in zip(shape, block)),
            tuple(o // b for o, b in zip(offset, block)),
        ))
        doc[name] = {"key": ikey, "block": list(block), "form": form, "dtype": dtype_name(t.dtype, key=ikey)}
    record = {
        TAG: RECORD_TAG, "class": rule.path, "shape": list(shape), "dtype": dtype_name(dtype, key=key),
        "ctx": _ctx_json(key, ctx, local), "inner": doc,
    }
    return Described(key, inners, record)


def check_record(where: str, key: str, stored: Any, target: dict[str, Any]) -> None:
    """The stored record of ``key`` (``stored``: a record, or what else ``objects`` holds there)
    agrees with the one a target subclass would write: same class, shape, dtype, context, inner
    tensors and blocks; or an error naming what differs."""
    if not is_record(stored):
        raise CheckpointError(
            f"{where}: key {key!r}: the target is a {target['class']}, the checkpoint holds "
            f"{'a plain tensor' if stored is None else 'a value'} under that key; load it into a plain tensor"
        )
    valid_record(where, key, stored)
    for field, what in (("class", "class"), ("shape", "global shape"), ("dtype", "dtype"), ("ctx", "flatten context")):
        if stored[field] != target[field]:
            err = ShardingError if field != "class" else CheckpointError
            raise err(
                f"{where}: key {key!r}: the checkpoint holds a {stored['class']} with {what} {stored[field]!r}, the "
                f"target's is {target[field]!r}; load it into the same kind of tensor (or pass dequantize=True for "
                "its high-precision values)"
            )
    if set(stored["inner"]) != set(target["inner"]):
        raise CorruptCheckpointError(
            f"{where}: key {key!r}: the checkpoint's {stored['class']} has inner tensors {sorted(stored['inner'])}, the "
            f"target's {sorted(target['inner'])}"
        )
    for name, t in target["inner"].items():
        s = stored["inner"][name]
        if s.get("block") != t.get("block"):
            raise ShardingError(
                f"{where}: key {key!r}: inner tensor {name!r} was saved with blocks of {s.get('block')} elements, the "
                f"target has blocks of {t.get('block')} (its local shape gives other blocks): quantized state reshards "
                "only into the same blocks; pass dequantize=True to load the high-precision values"
            )


def _ints(v: Any, *, positive: bool) -> bool:
    return isinstance(v, list) and all(type(x) is int and (x > 0 if positive else x >= 0) for x in v)


def valid_record(where: str, key: str, v: Any) -> dict[str, Any]:
    """``v``, the stored record of ``key``, if it is well formed; else ``CorruptCheckpointError``
    naming what is wrong. Inner tensors must be stored under ``<key>#<name>``."""

    def bad(what: str) -> CorruptCheckpointError:
        return CorruptCheckpointError(f"{where}: key {key!r}: the tensor subclass record {what}")

    if not is_record(v):
        raise bad("is not an object tagged tensor_subclass")
    if not isinstance(v.get("class"), str) or not v["class"]:
        raise bad(f"names no class ({v.get('class')!r})")
    if not _ints(v.get("shape"), positive=False) or len(v["shape"]) > 64:
        raise bad(f"has shape {v.get('shape')!r}; expected a list of at most 64 non-negative integers")
    if v.get("dtype") not in DTYPE_NAMES:
        raise bad(f"has dtype {v.get('dtype')!r}, which safetensors does not store")
    inner = v.get("inner")
    if not isinstance(inner, dict) or not inner:
        raise bad("names no inner tensors")
    for name, doc in inner.items():
        if not isinstance(doc, dict) or doc.get("key") != f"{key}{INNER_SEP}{name}":
            raise bad(f"stores inner tensor {name!r} as {doc!r}; expected it under {key + INNER_SEP + name!r}")
        if doc.get("dtype") not in DTYPE_NAMES:
            raise bad(f"gives inner tensor {name!r} dtype {doc.get('dtype')!r}, which safetensors does not store")
        if doc.get("shared") is True:
            if not _ints(doc.get("shape"), positive=False) or len(doc["shape"]) > 64:
                raise bad(f"gives shared inner tensor {name!r} shape {doc.get('shape')!r}")
            continue
        block = doc.get("block")
        if not _ints(block, positive=True) or len(block) != len(v["shape"]):
            raise bad(f"gives inner tensor {name!r} blocks {block!r}; expected {len(v['shape'])} positive integers")
        if doc.get("form") not in ("outer", "flat", "grid") or (doc["form"] == "outer" and any(b != 1 for b in block)):
            raise bad(f"gives inner tensor {name!r} form {doc.get('form')!r} with blocks {block}")
    return v


def inner_keys(objects: dict[str, Any], where: str) -> dict[str, str]:
    """Inner-tensor key -> its subclass's key, for every record in ``objects`` (each checked:
    ``CorruptCheckpointError`` for a damaged one)."""
    out = {}
    for key, v in objects.items():
        if is_record(v):
            for doc in valid_record(where, key, v)["inner"].values():
                out[doc["key"]] = key
    return out


# --- building a subclass value from a record ------------------------------------------------------


def allocate(where: str, key: str, record: dict[str, Any], shape: tuple[int, ...] | None = None, device: Any = "cpu") -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """A new value of the recorded class, of ``shape`` (default: the whole tensor), whose inner
    tensors (returned by name, shaped as stored) are zeros to be filled by a load. Imports the
    class only if it is on the allow-list."""
    valid_record(where, key, record)
    path = record["class"]
    if path not in _RULES:
        raise CheckpointError(
            f"{where}: key {key!r} holds a {path!r}, which is not on the allow-list of tensor subclasses "
            f"({', '.join(allowed_tensor_subclasses())}); add it with shardsafe.register_tensor_subclass"
        )
    shape = tuple(record["shape"]) if shape is None else shape
    cls = _import(key, path)
    ctx = _ctx_value(key, record["ctx"], shape, torch.device(device))
    inner: dict[str, torch.Tensor] = {}
    grids: dict[str, torch.Tensor] = {}
    for name, doc in record["inner"].items():
        dtype = torch_dtype(doc["dtype"])
        if doc.get("shared"):
            inner[name] = grids[name] = torch.zeros(doc["shape"], dtype=dtype, device=device)
            continue
        block = tuple(doc["block"])
        if len(block) != len(shape) or any(n % b for n, b in zip(shape, block)):
            raise ShardingError(
                f"{where}: key {key!r}: inner tensor {name!r} was saved with blocks of {list(block)} elements, which do "
                f"not tile this rank's local shape {list(shape)}: quantized state reshards only where cuts fall on "
                "block edges; pass dequantize=True to load the high-precision values"
            )
        grid = tuple(n // b for n, b in zip(shape, block))
        g = torch.zeros(grid, dtype=dtype, device=device)
        grids[name] = g
        inner[name] = g.view(shape) if doc["form"] == "outer" else g if doc["form"] == "grid" else g.view(-1)
    try:
        value = cls.__tensor_unflatten__(inner, ctx, torch.Size(shape), _contiguous(shape))
    except Exception as e:  # the class's own checks of a stored context and inner tensors
        raise CorruptCheckpointError(
            f"{where}: key {key!r}: {path}.__tensor_unflatten__ refused the stored context and inner tensors "
            f"({type(e).__name__}: {e})"
        ) from None
    return value, grids


def dequantized(where: str, key: str, value: torch.Tensor) -> torch.Tensor:
    """The high-precision tensor of a subclass value, by its rule's method."""
    rule = rule_for(type(value))
    if rule is None or rule.dequantize is None:
        raise CheckpointError(f"{where}: key {key!r}: shardsafe knows no way to dequantize a {class_path(type(value))}")
    out = getattr(value, rule.dequantize)()
    return out.reshape(value.shape).to(value.dtype)


def check_whole(where: str, key: str, record: dict[str, Any]) -> None:
    """A value of the whole tensor can be built from the stored blocks: each block's elements
    are consecutive in the whole tensor's flattened order too (blocks of whole trailing rows, or
    of part of the last dimension); otherwise ``ShardingError``."""
    shape = record["shape"]
    for name, doc in record["inner"].items():
        if doc.get("shared") or doc["form"] == "grid":  # a grid is indexed by block, in any layout
            continue
        block = doc["block"]
        first = next((d for d, b in enumerate(block) if b > 1), len(block))
        if any(block[d] != shape[d] for d in range(first + 1, len(block))):
            raise ShardingError(
                f"{where}: key {key!r}: inner tensor {name!r} was saved with blocks of {block} elements, which are not "
                f"consecutive in the flattened whole tensor of shape {shape} (the save cut a trailing dimension); "
                "shardsafe cannot build the whole tensor from them, so cannot dequantize it: load it into the layout "
                "it was saved in"
            )


def stored_tensor_keys(tensors: Any, objects: dict[str, Any], where: str) -> list[str]:
    """The keys a checkpoint stores tensors under, as a state dict has them: a subclass's key,
    not its inner tensors' keys."""
    inner = inner_keys(objects, where)
    return [k for k in tensors if k not in inner] + [k for k, v in objects.items() if is_record(v)]
