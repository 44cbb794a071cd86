"""The main demo (``make demo``): FSDP2 training that crashes, resumes resharded, and exports.

1. ``torchrun`` on 2 CPU processes trains the Llama-style model of ``tiny_llama.py`` with FSDP2
   under a ``shardsafe.CheckpointManager``: every few steps one asynchronous checkpoint of the
   model, the AdamW state, the LR scheduler, the data position and the RNG state (which picks
   each step's batch), keeping the last two; then it dies abruptly (``os._exit``), as a crashed
   job would.
2. The job resumes on 1 process by ``restore()`` alone (the newest committed step, whatever
   world size wrote it), continues, crashes again.
3. It resumes the same way on 4 processes and finishes.
4. The final checkpoint is unsharded into one ``model.safetensors``, which plain ``safetensors``
   loads into an unwrapped model that gives the last run's loss.

Every resume re-runs steps that the crashed run had already done: their losses must match (the
batches come from the restored RNG, the learning rate from the restored scheduler), and the
table shows both. Run ``python examples/train_demo.py [--workdir DIR]``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
EVERY = 6  # checkpoint interval (steps)
# (processes, last step to run, crash after it?)
PHASES = [(2, 16, True), (1, 28, True), (4, 36, False)]
GLOBAL_BATCH, SEQ = 8, 64


def _cfg():
    from tiny_llama import LlamaConfig

    return LlamaConfig(vocab_size=4096, dim=256, n_layers=4, n_heads=8, n_kv_heads=4, ffn_dim=688, max_seq_len=SEQ)


def latest_checkpoint(root: str) -> tuple[int, str] | None:
    """The newest committed step under ``root`` and its directory (for the table and the export;
    the training processes only call ``restore()``)."""
    import shardsafe
    from shardsafe.manager import step_dir_name

    with shardsafe.CheckpointManager(root) as mgr:
        step = mgr.latest_step()
    return None if step is None else (step, os.path.join(root, step_dir_name(step)))


class DataPosition:
    """Where the data stream is: the next step to train (a stateful data loader would sit here)."""

    def __init__(self) -> None:
        self.step = 0

    def state_dict(self) -> dict:
        return {"step": self.step}

    def load_state_dict(self, state: dict) -> None:
        self.step = state["step"]


def worker(root: str, last_step: int, crash: bool, log_path: str) -> None:
    import torch
    import torch.distributed as dist
    from tiny_llama import Transformer, make_optimizer, parallelize, train

    import shardsafe
    from shardsafe.manager import step_dir_name

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)  # the same on every rank: each step's batch is drawn from it
    cfg = _cfg()
    model = parallelize(Transformer(cfg, seed=0), "fsdp2", dist.get_world_size())
    optim = make_optimizer(model, "adamw")
    sched = torch.optim.lr_scheduler.LambdaLR(optim, lambda s: min(1.0, (s + 1) / 8) * 0.97 ** s)  # warm-up, decay
    data = DataPosition()
    extra = {"sched": sched, "data": data, "rng": shardsafe.RNGState()}
    events = []
    mgr = shardsafe.CheckpointManager(root, save_interval=EVERY, keep_last=2)  # async saves by default
    t0 = time.perf_counter()
    restored = mgr.restore(model=model, optim=optim, extra=extra)  # the newest committed step, or None
    if restored is not None:
        took = time.perf_counter() - t0
        events.append({"event": "load", "step": restored, "s": took, "bytes": _size(os.path.join(root, step_dir_name(restored)))})
    while data.step < last_step:
        step = data.step
        batch_id = int(torch.randint(0, 1 << 20, ()))  # the data order comes from the RNG
        (loss,) = train(model, optim, cfg, range(batch_id, batch_id + 1), "fsdp2", global_batch=GLOBAL_BATCH, seq_len=SEQ)
        sched.step()
        data.step += 1
        events.append({"event": "loss", "step": step, "loss": loss, "batch": batch_id})
        t0 = time.perf_counter()
        if mgr.save(data.step, model, optim, extra=extra):  # returns once staged; commits in the background
            events.append({"event": "save", "step": data.step, "s": time.perf_counter() - t0})
        if rank == 0:
            with open(log_path, "w") as f:
                json.dump(events, f)
    if crash:
        os._exit(17)  # no cleanup, no barrier, a save perhaps in flight: as if the node died
    mgr.close()  # waits for the last commit
    dist.barrier()
    dist.destroy_process_group()


def _size(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _torchrun(nproc: int, args: list[str]) -> int:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={nproc}", f"--master-port={_free_port()}",
        "--master-addr=127.0.0.1", "--max-restarts=0", os.path.abspath(__file__), *args,
    ]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=HERE + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.run(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True).returncode


def export_and_check(root: str, final_batch: int, final_loss: float) -> dict:
    """Unshard the last checkpoint to one safetensors file; load it with plain safetensors."""
    import torch
    from safetensors.torch import load_file
    from tiny_llama import Transformer, batch, loss_fn

    import shardsafe

    step, path = latest_checkpoint(root)
    out = os.path.join(root, "model.safetensors")
    t0 = time.perf_counter()
    counts = shardsafe.unshard_to_safetensors(path, out, prefix="model.")
    took = time.perf_counter() - t0
    model = Transformer(_cfg(), seed=123)
    model.load_state_dict(load_file(out), strict=True)
    # the loss of the last trained step, recomputed from the exported weights, is lower than the
    # last run's loss at that step (which was taken before that step's update)
    x, y = batch(_cfg(), final_batch, batch_size=GLOBAL_BATCH, seq_len=SEQ)
    with torch.no_grad():
        loss = loss_fn(model(x), y).item()
    return {"step": step, "file": out, "bytes": os.path.getsize(out), "tensors": counts["tensors"], "s": took, "loss": loss, "before": final_loss}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--workdir", default=None, help="where the checkpoints and the export go, kept (make demo: demo-output); "
                    "default: a temporary directory, removed at the end")
    ap.add_argument("--_worker", nargs=4, metavar=("ROOT", "LAST", "CRASH", "LOG"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._worker:
        root, last, crash, log = args._worker
        worker(root, int(last), crash == "1", log)
        return 0

    sys.path.insert(0, HERE)
    work = args.workdir or tempfile.mkdtemp(prefix="shardsafe-demo-")
    root = os.path.join(work, "ckpt")
    os.makedirs(root, exist_ok=True)
    t_start = time.perf_counter()
    runs = []
    for i, (nproc, last, crash) in enumerate(PHASES):
        found = latest_checkpoint(root)
        log = os.path.join(work, f"run{i}.json")
        print(f"run {i}: {nproc} process(es), FSDP2, from step {found[0] if found else 0} to {last}"
              f"{', then crash' if crash else ''} ...", flush=True)
        rc = _torchrun(nproc, ["--_worker", root, str(last), "1" if crash else "0", log])
        if (rc != 0) != crash:
            print(f"run {i} exited with {rc}, expected {'a crash' if crash else 0}", file=sys.stderr)
            return 1
        with open(log) as f:
            runs.append((nproc, found[0] if found else 0, json.load(f), _size(latest_checkpoint(root)[1])))

    rows = []
    worst = 0.0
    for i, (nproc, start, events, ckpt_bytes) in enumerate(runs):
        losses = {e["step"]: e["loss"] for e in events if e["event"] == "loss"}
        load = next((e for e in events if e["event"] == "load"), None)
        saves = [e for e in events if e["event"] == "save"]
        before = {e["step"]: e["loss"] for e in runs[i - 1][2] if e["event"] == "loss"} if i else {}
        again = sorted(set(before) & set(losses))  # steps the crashed run did and this one redid
        diff = max((abs(losses[s] - before[s]) for s in again), default=0.0)
        worst = max(worst, diff)
        save_s = sum(e["s"] for e in saves) / max(len(saves), 1)
        save_b = ckpt_bytes
        rows.append([
            f"{i}", f"{nproc}", f"{start}", f"{min(losses)}-{max(losses)}",
            f"{losses[min(losses)]:.3f} -> {losses[max(losses)]:.3f}",
            f"{before[again[0]]:.5f} -> {losses[again[0]]:.5f} (step {again[0]})" if again else f"{losses[start]:.5f} (step {start})",
            f"{diff:.1e}" if again else "-",
            f"{save_b / 1e6:.1f} MB" if saves else "-",
            f"{save_s:.2f} s, {save_b / save_s / 1e9:.2f} GB/s" if saves else "-",
            f"{load['s']:.2f} s, {load['bytes'] / load['s'] / 1e9:.2f} GB/s" if load else "-",
        ])
    last_losses = {e["step"]: e for e in runs[-1][2] if e["event"] == "loss"}
    final_step = max(last_losses)
    export = export_and_check(root, last_losses[final_step]["batch"], last_losses[final_step]["loss"])
    head = ["run", "procs", "resumed from", "steps", "loss first -> last", "loss before -> after resume", "max |dloss| redone steps", "checkpoint", "save: blocked (mean)", "load"]
    widths = [max(len(h), *(len(r[j]) for r in rows)) for j, h in enumerate(head)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, widths)) + " |")
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for r in rows:
        print("| " + " | ".join(c.ljust(w) for c, w in zip(r, widths)) + " |")
    print()
    print(f"unshard: step {export['step']} -> {export['file']}: {export['tensors']} tensors, {export['bytes'] / 1e6:.1f} MB "
          f"in {export['s']:.2f} s; loaded with safetensors.torch.load_file into a plain model: loss at step {final_step} "
          f"{export['before']:.5f} before its update, {export['loss']:.5f} after")
    print(f"total {time.perf_counter() - t_start:.0f} s")
    ok = worst < 1e-4 and export["loss"] < export["before"]
    if args.workdir:
        print(f"kept: the checkpoints in {root}, the export in {export['file']}")
    else:
        shutil.rmtree(work, ignore_errors=True)
        print(f"removed {work} (the checkpoints and the export): pass --workdir DIR to keep them")
    print("OK: resumed runs repeat the crashed runs' losses; the export loads into a plain model" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
