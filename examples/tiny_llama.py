"""A compact Llama-style transformer and the ways to parallelize it, for the demo, tests and benchmarks.

RMSNorm, rotary embeddings, grouped-query attention, SwiGLU MLP; random init from a config, nothing
downloaded. ``parallelize(model, kind, world_size)`` applies one of the wrappings shardsafe supports:
``plain``, ``ddp``, ``fsdp2``, ``hsdp``, ``tp``, ``fsdp2_tp`` (2-D mesh) and ``fsdp1``
(``use_orig_params=True``), on CPU with gloo.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["KINDS", "LlamaConfig", "Transformer", "batch", "data_parallel_coords", "loss_fn", "make_optimizer", "parallelize", "train"]

KINDS = ("plain", "ddp", "fsdp2", "hsdp", "tp", "fsdp2_tp", "fsdp1")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 512
    dim: int = 128
    n_layers: int = 2
    n_heads: int = 4
    n_kv_heads: int = 2
    ffn_dim: int = 344
    max_seq_len: int = 64
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    x1, x2 = x[..., ::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.head_dim = cfg.head_dim
        self.rep = cfg.n_heads // cfg.n_kv_heads
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        # head counts come from the (possibly tensor-parallel, local) projection widths
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _rope(q, cos, sin), _rope(k, cos, sin)
        k = k.repeat_interleave(self.rep, dim=2)
        v = v.repeat_interleave(self.rep, dim=2)
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class FeedForward(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)
        self.w2 = nn.Linear(cfg.ffn_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.ffn_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x), cos, sin)
        return x + self.feed_forward(self.ffn_norm(x))


class Transformer(nn.Module):
    def __init__(self, cfg: LlamaConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.tok_embeddings = nn.Embedding(cfg.vocab_size, cfg.dim)
        self.layers = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.output = nn.Linear(cfg.dim, cfg.vocab_size, bias=False)
        freqs = 1.0 / cfg.rope_theta ** (torch.arange(0, cfg.head_dim, 2).float() / cfg.head_dim)
        angles = torch.outer(torch.arange(cfg.max_seq_len).float(), freqs)[:, None, :]
        self.register_buffer("rope_cos", angles.cos(), persistent=False)  # derived: not saved
        self.register_buffer("rope_sin", angles.sin(), persistent=False)
        self.register_buffer("tokens_seen", torch.zeros((), dtype=torch.int64))  # persistent: saved
        g = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for name, p in self.named_parameters():
                if name.endswith("norm.weight"):
                    continue
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        s = tokens.shape[1]
        with torch.no_grad():
            self.tokens_seen.add_(tokens.numel())
        h = self.tok_embeddings(tokens)
        cos, sin = self.rope_cos[:s], self.rope_sin[:s]
        for layer in self.layers:
            h = layer(h, cos, sin)
        return self.output(self.norm(h))


def batch(cfg: LlamaConfig, step: int, batch_size: int = 4, seq_len: int = 32) -> tuple[torch.Tensor, torch.Tensor]:
    """The same (inputs, labels) for ``step`` in every process: learnable sequences, each a random
    start token followed by steps of a random stride (mod the vocabulary)."""
    g = torch.Generator().manual_seed(1000 + step)
    start = torch.randint(0, cfg.vocab_size, (batch_size, 1), generator=g)
    stride = torch.randint(1, 8, (batch_size, 1), generator=g)
    tokens = (start + stride * torch.arange(seq_len + 1)) % cfg.vocab_size
    return tokens[:, :-1], tokens[:, 1:]


def data_parallel_coords(kind: str, rank: int, world_size: int) -> tuple[int, int]:
    """``(dp_rank, dp_size)``: which slice of the global batch this rank trains on."""
    if kind in ("plain", "tp"):
        return 0, 1
    if kind == "fsdp2_tp":
        return rank // (world_size // 2), 2
    return rank, world_size


def train(model: nn.Module, optim: torch.optim.Optimizer, cfg: LlamaConfig, steps: range, kind: str, *, global_batch: int = 8, seq_len: int = 32, split_batch: bool = True) -> list[float]:
    """Train on steps ``steps``; returns the global-batch loss of each step (the same on every rank).

    With ``split_batch`` each data-parallel rank takes its slice of the global batch (real data
    parallelism); without, every rank trains on the whole batch.
    """
    import torch.distributed as dist

    distributed = dist.is_initialized()
    rank, ws = (dist.get_rank(), dist.get_world_size()) if distributed else (0, 1)
    dp_rank, dp_size = data_parallel_coords(kind, rank, ws) if split_batch else (0, 1)
    losses = []
    for step in steps:
        x, y = batch(cfg, step, batch_size=global_batch, seq_len=seq_len)
        per = global_batch // dp_size
        x, y = x[dp_rank * per : (dp_rank + 1) * per], y[dp_rank * per : (dp_rank + 1) * per]
        loss = loss_fn(model(x), y)
        loss.backward()
        optim.step()
        optim.zero_grad()
        report = loss.detach().clone()
        if distributed:
            dist.all_reduce(report)
            report /= ws
        losses.append(report.item())
    return losses


def loss_fn(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    if hasattr(logits, "full_tensor"):  # a DTensor output (not produced by the plans below, but be safe)
        logits = logits.full_tensor()
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1))


def make_optimizer(model: nn.Module, kind: str = "adamw") -> torch.optim.Optimizer:
    """Two param groups with different hyper-parameters: norms (no decay) and the rest."""
    no_decay = [p for n, p in model.named_parameters() if "norm" in n]
    decay = [p for n, p in model.named_parameters() if "norm" not in n]
    groups = [{"params": decay, "weight_decay": 0.1}, {"params": no_decay, "weight_decay": 0.0, "lr": 3e-3}]
    if kind == "adamw":
        return torch.optim.AdamW(groups, lr=1e-3, betas=(0.9, 0.95))
    if kind == "adam":
        return torch.optim.Adam(groups, lr=1e-3)
    if kind == "sgd":
        return torch.optim.SGD(groups, lr=1e-2, momentum=0.9)
    raise ValueError(f"unknown optimizer {kind!r}")


def parallelize(model: Transformer, kind: str, world_size: int) -> nn.Module:
    """Wrap ``model`` (already on CPU, same init on every rank) as ``kind`` over ``world_size`` ranks."""
    if kind == "plain":
        return model
    if kind == "ddp":
        from torch.nn.parallel import DistributedDataParallel

        return DistributedDataParallel(model)
    if kind in ("fsdp2", "hsdp"):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        if kind == "fsdp2":
            mesh = init_device_mesh("cpu", (world_size,))
        else:  # replicate over the outer dim, shard over the inner
            mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("replicate", "shard"))
        for layer in model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model
    if kind == "tp":
        from torch.distributed.device_mesh import init_device_mesh

        _apply_tp(model, init_device_mesh("cpu", (world_size,)))
        return model
    if kind == "fsdp2_tp":
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        mesh = init_device_mesh("cpu", (2, world_size // 2), mesh_dim_names=("dp", "tp"))
        _apply_tp(model, mesh["tp"])
        for layer in model.layers:
            fully_shard(layer, mesh=mesh["dp"])
        fully_shard(model, mesh=mesh["dp"])
        return model
    if kind == "fsdp1":
        from torch.distributed.fsdp import FullyShardedDataParallel
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy

        return FullyShardedDataParallel(
            model, auto_wrap_policy=ModuleWrapPolicy({Block}), use_orig_params=True, device_id=torch.device("cpu")
        )
    raise ValueError(f"unknown parallelism {kind!r}; one of {KINDS}")


def _apply_tp(model: Transformer, tp_mesh) -> None:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    plan = {
        "attention.wq": ColwiseParallel(),
        "attention.wk": ColwiseParallel(),
        "attention.wv": ColwiseParallel(),
        "attention.wo": RowwiseParallel(),
        "feed_forward.w1": ColwiseParallel(),
        "feed_forward.w3": ColwiseParallel(),
        "feed_forward.w2": RowwiseParallel(),
    }
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, plan)
