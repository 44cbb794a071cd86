"""The states the I/O benchmark checkpoints: what tensors, and each rank's piece of them.

A *spec* is a list of ``(key, global shape, dtype)``. Two specs:

- ``synthetic``: a realistic mix of sizes, 4 KiB to 64 MiB, bf16 and fp32, repeated until the
  requested total is reached (most bytes sit in the large tensors, most tensors are small);
- ``model``: the demo transformer (``examples/tiny_llama.py``) at a size scaled to the total,
  with its AdamW state (``exp_avg``, ``exp_avg_sq``, a 0-d ``step`` per parameter), keys under
  ``model.`` and ``optim.`` as the lead's API stores them.

Each rank holds every tensor of at least one dimension as a ``DTensor`` sharded on ``dim`` (0, or
1 for the resharding case; 1-D tensors stay on dim 0) over a 1-D mesh of all ranks, FSDP2-style;
0-d tensors are replicated plain tensors. Values are a function of the global element index, so
any layout can be checked after a load by comparing CRC32Cs.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from math import prod

import torch
from torch.distributed.tensor import DTensor, Shard

from shardsafe.format.checksum import crc32c
from shardsafe.format.geometry import chunk_bounds

Spec = list[tuple[str, tuple[int, ...], torch.dtype]]

_KiB, _MiB = 1 << 10, 1 << 20
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# one "layer" of the synthetic state: (shape, dtype), 4 KiB .. 64 MiB
_BLOCK: tuple[tuple[tuple[int, ...], torch.dtype], ...] = (
    ((4096, 8192), torch.bfloat16),  # 64 MiB
    ((2048, 4096), torch.float32),  # 32 MiB
    ((2048, 4096), torch.bfloat16),  # 16 MiB
    ((1024, 1024), torch.float32),  # 4 MiB
    ((512, 1024), torch.bfloat16),  # 1 MiB
    ((256, 256), torch.float32),  # 256 KiB
    ((128, 256), torch.bfloat16),  # 64 KiB
    ((64, 64), torch.float32),  # 16 KiB
    ((64, 64), torch.float32),
    ((2048,), torch.bfloat16),  # 4 KiB
    ((1024,), torch.float32),  # 4 KiB
    ((32, 64), torch.bfloat16),  # 4 KiB
)


def nbytes(spec: Spec) -> int:
    return sum(prod(shape) * dtype.itemsize for _, shape, dtype in spec)


def synthetic_spec(total: int) -> Spec:
    """Blocks of the mix above until ``total`` bytes; the last block is cut short."""
    spec: Spec = []
    size = 0
    layer = 0
    while size < total:
        for i, (shape, dtype) in enumerate(_BLOCK):
            n = prod(shape) * dtype.itemsize
            if size + n > total and n > 64 * _KiB:  # fill the remainder with the smaller tensors
                continue
            spec.append((f"layers.{layer}.t{i}", shape, dtype))
            size += n
            if size >= total:
                break
        layer += 1
    return spec


def _load_demo():
    path = os.path.join(_REPO, "examples", "tiny_llama.py")
    if not os.path.exists(path):
        return None
    try:
        mod_spec = importlib.util.spec_from_file_location("_bench_tiny_llama", path)
        mod = importlib.util.module_from_spec(mod_spec)
        sys.modules["_bench_tiny_llama"] = mod
        mod_spec.loader.exec_module(mod)  # type: ignore[union-attr]
        return mod
    except Exception:  # noqa: BLE001 - the demo is being written by someone else; fall back
        return None


def _llama_shapes(dim: int, layers: int, vocab: int, ffn: int, kv: int, heads: int) -> list[tuple[str, tuple[int, ...]]]:
    """The parameter shapes of a Llama-style model, for when the demo module is not there."""
    hd = dim // heads
    out = [("tok_embeddings.weight", (vocab, dim))]
    for i in range(layers):
        p = f"layers.{i}."
        out += [
            (p + "attention.wq.weight", (heads * hd, dim)),
            (p + "attention.wk.weight", (kv * hd, dim)),
            (p + "attention.wv.weight", (kv * hd, dim)),
            (p + "attention.wo.weight", (dim, heads * hd)),
            (p + "feed_forward.w1.weight", (ffn, dim)),
            (p + "feed_forward.w2.weight", (dim, ffn)),
            (p + "feed_forward.w3.weight", (ffn, dim)),
            (p + "attention_norm.weight", (dim,)),
            (p + "ffn_norm.weight", (dim,)),
        ]
    return out + [("norm.weight", (dim,)), ("output.weight", (vocab, dim))]


def model_spec(total: int) -> tuple[Spec, str]:
    """The demo transformer's state (fp32 parameters + AdamW state), sized to about ``total``.

    Returns the spec and a one-line description of the model used.
    """
    dim, heads, kv, ffn, vocab = 1024, 16, 4, 2816, 32000
    if total < 512 * _MiB:  # small runs: a smaller model, so that layers still repeat
        dim, heads, kv, ffn, vocab = 512, 8, 2, 1408, 16000
    if total < 128 * _MiB:
        dim, heads, kv, ffn, vocab = 256, 4, 2, 704, 8000
    demo = _load_demo()

    def shapes(layers: int) -> tuple[list[tuple[str, tuple[int, ...]]], str]:
        if demo is not None:
            cfg = demo.LlamaConfig(vocab_size=vocab, dim=dim, n_layers=layers, n_heads=heads, n_kv_heads=kv, ffn_dim=ffn)
            try:
                with torch.device("meta"):
                    model = demo.Transformer(cfg)
                sd = model.state_dict()
                return [(k, tuple(v.shape)) for k, v in sd.items()], f"examples/tiny_llama.py Transformer({cfg})"
            except Exception:  # noqa: BLE001 - fall back to the same shapes, built here
                pass
        return _llama_shapes(dim, layers, vocab, ffn, kv, heads), (
            f"Llama-style shapes (dim={dim}, layers={layers}, heads={heads}, kv_heads={kv}, ffn={ffn}, vocab={vocab})"
        )

    def build(layers: int) -> tuple[Spec, str]:
        params, desc = shapes(layers)
        spec: Spec = []
        for name, shape in params:
            spec.append((f"model.{name}", shape, torch.float32))
        for name, shape in params:
            if not shape:  # a 0-d buffer (a counter): no optimizer state
                continue
            spec.append((f"optim.state.{name}.exp_avg", shape, torch.float32))
            spec.append((f"optim.state.{name}.exp_avg_sq", shape, torch.float32))
            spec.append((f"optim.state.{name}.step", (), torch.float32))
        return spec, desc

    layers = 1
    while nbytes(build(layers + 1)[0]) <= total:
        layers += 1
    return build(layers)


def local_box(shape: tuple[int, ...], dim: int, world: int, rank: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Offsets and lengths of ``rank``'s piece of a tensor sharded on ``dim`` (torch.chunk semantics)."""
    if not shape:
        return (), ()
    d = dim if len(shape) > dim else 0
    start, n = chunk_bounds(shape[d], world, rank)
    off = [0] * len(shape)
    lens = list(shape)
    off[d], lens[d] = start, n
    return tuple(off), tuple(lens)


def _fill(t: torch.Tensor, key: str, shape: tuple[int, ...], off: tuple[int, ...]) -> None:
    """Element value = (global flat index + salt(key)) mod 251: exact in every dtype used here."""
    if t.numel() == 0:
        return
    salt = sum(key.encode()) % 251
    if not shape:
        t.fill_(salt)
        return
    strides = [prod(shape[i + 1 :]) for i in range(len(shape))]
    itype = torch.int32 if prod(shape) + 251 < 2**31 else torch.int64
    idx = torch.full((1,) * len(shape), salt + sum(o * s for o, s in zip(off, strides)), dtype=itype)
    for d, (n, s) in enumerate(zip(t.shape, strides)):
        view = [1] * len(shape)
        view[d] = n
        idx = idx + (torch.arange(n, dtype=itype) * s).view(view)
    t.copy_(idx.remainder_(251))


def build_state(spec: Spec, mesh, dim: int, *, fill: bool = True) -> dict[str, torch.Tensor]:
    """This rank's state: DTensors sharded on ``dim`` over ``mesh``, 0-d tensors replicated."""
    world, rank = mesh.size(), mesh.get_local_rank()
    state: dict[str, torch.Tensor] = {}
    for key, shape, dtype in spec:
        off, lens = local_box(shape, dim, world, rank)
        local = torch.empty(lens, dtype=dtype)
        if fill:
            _fill(local, key, shape, off)
        else:
            local.view(-1).view(torch.uint8).zero_()  # touch every page once
        if not shape:
            state[key] = local
            continue
        d = dim if len(shape) > dim else 0
        strides = tuple(prod(shape[i + 1 :]) for i in range(len(shape)))
        state[key] = DTensor.from_local(local, mesh, [Shard(d)], run_check=False, shape=torch.Size(shape), stride=strides)
    return state


def locals_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The local tensor of every value (a DTensor's local shard, else the tensor itself)."""
    return {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in state.items()}


def state_crc(state: dict[str, torch.Tensor]) -> int:
    """One CRC32C over the local bytes of every tensor, in key order."""
    crc = 0
    for t in locals_of(state).values():
        if t.numel():
            crc = crc32c(t.contiguous().view(-1).view(torch.uint8).numpy(), crc)
    return crc


def scribble(state: dict[str, torch.Tensor]) -> None:
    """Overwrite every local byte (so a load that skips something is caught by the CRC)."""
    for t in locals_of(state).values():
        if t.numel():
            t.view(-1).view(torch.uint8).fill_(0xA5)


def local_bytes(state: dict[str, torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in locals_of(state).values())
