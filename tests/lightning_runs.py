"""Real Lightning ``Trainer`` runs on gloo ranks (the module's caller spawns them with
``tests.helpers.run_ranks``): the model and the fit the Lightning tests resume and compare."""

from __future__ import annotations

import os

import torch

import shardsafe.lightning

__all__ = ["GLOBAL_BATCH", "fit", "fits", "net"]

GLOBAL_BATCH = 8


def net():
    import lightning as L
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    class Net(L.LightningModule):
        def __init__(self, fsdp: bool) -> None:
            super().__init__()
            self.fsdp = fsdp
            self.losses: list[float] = []
            torch.manual_seed(0)
            self.net = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))

        def configure_model(self) -> None:
            if self.fsdp:
                from torch.distributed.fsdp import fully_shard

                mesh = self.device_mesh["data_parallel"]
                fully_shard(self.net[0], mesh=mesh)
                fully_shard(self.net[2], mesh=mesh)
                fully_shard(self.net, mesh=mesh)

        def training_step(self, batch, idx):
            x, y = batch
            loss = (self.net(x) - y).square().mean()
            self.losses.append(loss.item())
            return loss

        def configure_optimizers(self):
            opt = torch.optim.AdamW(self.parameters(), lr=1e-2, betas=(0.8, 0.95))
            sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
            return [opt], [{"scheduler": sched, "interval": "step"}]

        def train_dataloader(self):
            g = torch.Generator().manual_seed(1)
            x, y = torch.randn(16, 8, generator=g), torch.randn(16, 4, generator=g)  # 2 steps an epoch
            return DataLoader(TensorDataset(x, y), batch_size=GLOBAL_BATCH // self.trainer.world_size, shuffle=False)

    return Net


def fit(rank, ws, kind, ckpt_dir, max_steps, ckpt_path, truth_path=None):
    """``trainer.fit`` on this rank; returns its losses, the final global step and epoch."""
    import lightning as L
    from lightning.pytorch.callbacks import ModelCheckpoint

    os.environ.update(LOCAL_RANK=str(rank), NODE_RANK="0", WORLD_SIZE=str(ws))
    if kind == "fsdp":
        strategy = shardsafe.lightning.ModelParallelStrategy(data_parallel_size=ws, tensor_parallel_size=1)
    elif kind == "lightning-fsdp":  # Lightning's own: DCP files and meta.pt
        from lightning.pytorch.strategies import ModelParallelStrategy

        strategy = ModelParallelStrategy(data_parallel_size=ws, tensor_parallel_size=1)
    else:
        strategy = shardsafe.lightning.DDPStrategy()
    model = net()(fsdp=kind != "ddp")
    trainer = L.Trainer(
        accelerator="cpu", devices=ws, strategy=strategy, max_steps=max_steps, logger=False, enable_progress_bar=False,
        enable_model_summary=False, num_sanity_val_steps=0,
        callbacks=[ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=2, save_top_k=-1, save_last=True)],
    )
    trainer.fit(model, ckpt_path=ckpt_path)
    if truth_path is not None:
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
        msd, osd = get_state_dict(model, trainer.optimizers[0], options=opts)
        if rank == 0:
            torch.save({"model": msd, "optim": osd}, truth_path)
    return model.losses, trainer.global_step, trainer.current_epoch


def fits(rank, ws, *runs):
    """:func:`fit` with each of ``runs``' arguments in turn, in these ranks (a run may resume from
    a checkpoint an earlier one wrote): one spawn, and one import of Lightning, for all of them.
    Each run builds its own model, optimizer and Trainer."""
    return [fit(rank, ws, *args) for args in runs]
