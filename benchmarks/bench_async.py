"""Async save: how long a save blocks the training loop, how much a save in flight slows a
training step, and how long until the checkpoint is durable; shardsafe against torch DCP's async
save and against the memcpy limit, interleaved in one run.

Usage::

    python benchmarks/bench_async.py [--mib-per-rank 256] [--reps 5] [--world-sizes 2,4]
        [--methods NAME,...] [--mlp W,H,B] [--threads N] [--quick] [--dir /tmp/shardsafe-bench-async] [--out benchmarks/results]
        [--update-docs] [--from-json PATH]

For each world size, one process per rank (gloo on a free port) holds an FSDP2-style training
state of about ``--mib-per-rank`` MiB per rank: a Llama-style model's fp32 parameters and AdamW
state (:func:`training_spec`; 256 MiB per rank gives 372 tensors on 2 ranks, 912 on 4) as
``DTensor``s sharded on dim 0 over all ranks, 0-d ``step`` tensors replicated. Every method below
saves once first (buffers allocated, DCP's checkpoint process started: reported apart as "first
save"), then ``--reps`` times, in an order rotated every repetition:

- ``memcpy`` (the limit): the rank's local tensor bytes copied into preallocated, already
  touched memory, reused from save to save;
- ``shardsafe-async``: ``Checkpointer().async_save(dir, state)``, one ``Checkpointer`` kept for the
  whole run as a training loop would; ``shardsafe-sync``: ``Checkpointer().save``;
- ``dcp-sync``: ``dcp.save`` with a ``FileSystemWriter`` at its defaults;
- ``dcp-thread``: ``dcp.async_save`` at its defaults (thread executor; the ``FileSystemWriter``
  stages, allocating fresh CPU memory every save);
- ``dcp-thread-cached``: the same with ``FileSystemWriter(cache_staged_state_dict=True)`` kept
  from save to save (its staging buffers are reused); it allocates them pinned, so it runs only
  where CUDA is available and is left out otherwise;
- ``dcp-stager``: a ``DefaultStager`` kept from save to save (cached staging storages, reused),
  staging in the caller's thread;
- ``dcp-stager-async``: the same with ``use_async_staging=True``: ``async_save`` returns at once
  and stages in a thread; the caller may change the tensors only once its staging future is
  done, so that is where its blocked time ends;
- ``dcp-process``: ``AsyncCheckpointerType.PROCESS`` with a ``DefaultStager`` in shared memory
  (the checkpoint process is started by the first save and kept).

Pinned memory and non-blocking copies need CUDA (DCP ignores ``use_pinned_memory`` without it),
so on a CPU machine those options are the ones above.

Measured, per method and repetition (a time is the slowest rank's):

- **blocked**: from the call until the caller may change every tensor (``async_save`` returns;
  for ``dcp-stager-async``, its staging future completes); for a synchronous save, the whole save;
- **durable**: from the call until committed (``AsyncSave.wait()`` / the DCP future's result
  returns), the caller doing nothing else; the same call again with training running beside it
  gives **durable, training**;
- **training step**: a small MLP (forward, backward, AdamW step; 20-50 ms here) stepped
  continuously from the moment the async save returns until it commits: the mean time of the
  steps that began before the commit, against the same steps with no save in flight (``no-save``,
  a peer in the rotation). Ranks train independently (no collective per step); the slowest rank
  is reported, as a synchronous training job would wait for it;
- **training lost**: what the save cost the training loop in all: the blocked time plus, for an
  async save, the time its overlapped steps took beyond the rank's median ``no-save`` step (a
  method that finishes fast but slows steps a lot is compared fairly with one that slows them
  a little for longer).

Each save writes into a directory removed (by rank 0, outside the clock) before the save, so no
checkpoint piles up in the page cache; every save fsyncs its files (DCP's ``sync_files=True``).
Peak RSS beyond the state is the rank's high-water mark during the durable run (staging buffers
a method already holds from an earlier save are not counted again); "held" is what the rank's
RSS grew by over the method's first save, once committed: the buffers it keeps from save to save
(``dcp-process``'s own process is counted in neither).

Prints a markdown table and, per world size, one line::

    ASYNC ws<N> blocked_s=... memcpy_s=... dcp_best=<method> dcp_best_blocked_s=...
        blocked_vs_memcpy=...x blocked_vs_dcp_best=...x step_ms=... step_slowdown=...%
        overlapped_steps=... dcp_step_slowdown=...% durable_s=... sync_s=... durable_vs_sync=...x
        lost_s=... dcp_min_lost=<method> dcp_min_lost_s=...

followed by a ``TARGETS ws<N>`` line against the targets of the async-save work (blocked <= 1.2x
memcpy and <= 0.5x DCP's best blocked time; step slowdown <= 10%; durable <= 1.2x our synchronous
save). Writes ``async.json`` and ``async.md`` to ``--out``; ``--update-docs`` puts the table into
``docs/benchmarks.md``. ``--quick`` is a smoke run (8 MiB per rank, 3 repetitions).
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import shutil
import sys
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict, dataclass
from statistics import median
from typing import Any

from iobench.harness import PeakRSS, _rss, run_ranks_collect, trim_heap
from iobench.report import machine, replace_section

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
_MiB = 1 << 20

# name -> kind: "limit", "async" (a save in the background), "sync"
METHODS: dict[str, str] = {
    "memcpy": "limit",
    "shardsafe-async": "async",
    "shardsafe-sync": "sync",
    "dcp-sync": "sync",
    "dcp-thread": "async",
    "dcp-thread-cached": "async",
    "dcp-stager": "async",
    "dcp-stager-async": "async",
    "dcp-process": "async",
}
CUDA_ONLY = ("dcp-thread-cached",)  # FileSystemWriter's staging cache is pinned memory: needs CUDA
OURS, OURS_SYNC = "shardsafe-async", "shardsafe-sync"
BASELINE = "no-save"  # training steps with nothing in flight
TARGETS = dict(blocked_vs_memcpy=1.2, blocked_vs_dcp_best=0.5, step_slowdown=10.0, durable_vs_sync=1.2)
BEGIN, END = "<!-- bench-async:begin -->", "<!-- bench-async:end -->"


@dataclass(frozen=True)
class Config:
    root: str  # scratch directory for the checkpoints
    mib_per_rank: float
    reps: int
    methods: tuple[str, ...]
    baseline_steps: int  # steps of the no-save peer per repetition
    mlp: tuple[int, int, int]  # (width, hidden, batch) of the training step
    threads: int | None = None  # torch threads per rank; None: cores // world size, at least 1


# ---------------------------------------------------------------- the state


# (dim, heads, kv_heads, ffn, vocab) of Llama-style models, smallest first
_LADDER = ((64, 2, 1, 176, 2000), (128, 4, 2, 352, 4000), (256, 4, 2, 704, 8000), (512, 8, 2, 1408, 16000),
           (1024, 16, 4, 2816, 32000), (2048, 16, 4, 5632, 32000))


def training_spec(total: int) -> tuple[list, str]:
    """A Llama-style model's fp32 parameters and AdamW state (``exp_avg``, ``exp_avg_sq``, a 0-d
    ``step`` per parameter) of at most ``total`` bytes (at least one layer): the widest model of
    the ladder that fits four layers, with as many layers as fit."""
    import torch
    from iobench.states import _llama_shapes, nbytes

    def build(dims: tuple[int, ...], layers: int) -> list:
        dim, heads, kv, ffn, vocab = dims
        params = _llama_shapes(dim, layers, vocab, ffn, kv, heads)
        spec = [(f"model.{name}", shape, torch.float32) for name, shape in params]
        for name, shape in params:
            spec += [(f"optim.state.{name}.exp_avg", shape, torch.float32), (f"optim.state.{name}.exp_avg_sq", shape, torch.float32),
                     (f"optim.state.{name}.step", (), torch.float32)]
        return spec

    dims = next((d for d in reversed(_LADDER) if nbytes(build(d, 4)) <= total), _LADDER[0])
    layers = 1
    while nbytes(build(dims, layers + 1)) <= total:
        layers += 1
    spec = build(dims, layers)
    return spec, f"Llama-style dim={dims[0]} layers={layers} vocab={dims[4]} + AdamW, {len(spec)} tensors, {nbytes(spec) / _MiB:.0f} MiB"


# ---------------------------------------------------------------- one rank


class Trainer:
    """A small MLP trained on a fixed random batch: the CPU work a save in flight competes with."""

    def __init__(self, width: int, hidden: int, batch: int, seed: int) -> None:
        import torch

        g = torch.Generator().manual_seed(seed)
        self.model = torch.nn.Sequential(torch.nn.Linear(width, hidden), torch.nn.GELU(), torch.nn.Linear(hidden, width))
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-4)
        self.x = torch.randn(batch, width, generator=g)
        self.y = torch.randn(batch, width, generator=g)

    def step(self) -> None:
        import torch

        loss = torch.nn.functional.mse_loss(self.model(self.x), self.y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()


Started = tuple["Future[Any] | None", "Future[Any] | None"]  # (staged, committed); None: already done


class Methods:
    """Every method as ``start(path) -> (staged, committed)``: the call returns when the method
    returns; ``staged`` (if not None) completes when the tensors may change, ``committed`` (if
    not None) when the checkpoint is durable. State each method keeps from save to save (our
    ``Checkpointer``, DCP's stagers and cached writer, the memcpy buffer) lives here."""

    def __init__(self, state: dict) -> None:
        import torch
        import torch.distributed.checkpoint as dcp
        from iobench.states import locals_of
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        import shardsafe

        self.state = state
        self.dcp = dcp
        self._local = [t.reshape(-1).view(torch.uint8) for t in locals_of(state).values() if t.numel()]
        total = sum(t.numel() for t in self._local)
        self._dst = torch.empty(total, dtype=torch.uint8)
        self._dst.fill_(0)  # touched: no first-touch page faults inside the clock
        self._ours_async = shardsafe.Checkpointer()
        self._ours_sync = shardsafe.Checkpointer()
        self._cached_writer: Any = None
        off = dict(use_pinned_memory=False, use_non_blocking_copy=False)  # both need CUDA
        self._stager = DefaultStager(StagingOptions(use_shared_memory=False, use_async_staging=False, **off))
        self._stager_async = DefaultStager(StagingOptions(use_shared_memory=False, use_async_staging=True, **off))
        self._stager_shm = DefaultStager(StagingOptions(use_shared_memory=True, use_async_staging=False, **off))
        self.start: dict[str, Callable[[str], Started]] = {
            "memcpy": self._memcpy,
            "shardsafe-async": self._shardsafe_async,
            "shardsafe-sync": self._shardsafe_sync,
            "dcp-sync": self._dcp_sync,
            "dcp-thread": self._dcp_thread,
            "dcp-thread-cached": self._dcp_thread_cached,
            "dcp-stager": self._dcp_stager,
            "dcp-stager-async": self._dcp_stager_async,
            "dcp-process": self._dcp_process,
        }

    def _memcpy(self, path: str) -> Started:
        at = 0
        for t in self._local:
            self._dst[at : at + t.numel()].copy_(t)
            at += t.numel()
        return None, None

    def _shardsafe_async(self, path: str) -> Started:
        h = self._ours_async.async_save(path, self.state)
        return h.staged, h.committed

    def _shardsafe_sync(self, path: str) -> Started:
        self._ours_sync.save(path, self.state)
        return None, None

    def _writer(self, path: str) -> Any:
        return self.dcp.FileSystemWriter(path)

    def _dcp_sync(self, path: str) -> Started:
        self.dcp.save(self.state, storage_writer=self._writer(path))
        return None, None

    def _dcp_thread(self, path: str) -> Started:
        return None, self.dcp.async_save(self.state, storage_writer=self._writer(path))

    def _dcp_thread_cached(self, path: str) -> Started:
        if self._cached_writer is None:  # kept: its staged state dict is the cache
            self._cached_writer = self.dcp.FileSystemWriter(path, cache_staged_state_dict=True)
        return None, self.dcp.async_save(self.state, checkpoint_id=path, storage_writer=self._cached_writer)

    def _dcp_stager(self, path: str) -> Started:
        return None, self.dcp.async_save(self.state, storage_writer=self._writer(path), async_stager=self._stager)

    def _dcp_stager_async(self, path: str) -> Started:
        r = self.dcp.async_save(self.state, storage_writer=self._writer(path), async_stager=self._stager_async)
        return r.staging_completion, r.upload_completion

    def _dcp_process(self, path: str) -> Started:
        from torch.distributed.checkpoint.state_dict_saver import AsyncCheckpointerType

        return None, self.dcp.async_save(self.state, storage_writer=self._writer(path), async_stager=self._stager_shm,
                                         async_checkpointer_type=AsyncCheckpointerType.PROCESS)

    def close(self) -> None:
        from torch.distributed.checkpoint import _async_process_executor as pe

        for s in (self._stager, self._stager_async, self._stager_shm):
            s.close()
        proc, pe._CHECKPOINT_PROCESS = pe._CHECKPOINT_PROCESS, None
        if proc is not None:  # DCP stops its checkpoint process only in __del__, giving it 5 s
            child = proc._save_process
            if child.is_alive():
                proc._send(pe._CheckpointSaveProcessControlOpts.TERMINATE)
                child.join(timeout=60)
            if child.is_alive():
                child.kill()
                child.join()


def _run_rank(rank: int, world: int, port: int, cfg: Config) -> list[dict]:
    import torch
    import torch.distributed as dist
    from iobench.states import build_state, local_bytes
    from torch.distributed.device_mesh import init_device_mesh

    threads = cfg.threads or max(1, (os.cpu_count() or 1) // world)
    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"  # where DCP's checkpoint process finds its store
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    records: list[dict] = []
    methods = None
    try:
        mesh = init_device_mesh("cpu", (world,))
        spec, _ = training_spec(int(cfg.mib_per_rank * _MiB * world))
        state = build_state(spec, mesh, 0)
        methods = Methods(state)
        trainer = Trainer(*cfg.mlp, seed=rank)
        for _ in range(3):
            trainer.step()
        peak = PeakRSS()
        base = dict(world=world, rank=rank, state_bytes=local_bytes(state), threads=threads)

        def fresh(path: str) -> None:
            gc.collect(1)
            trim_heap()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()

        def call(m: str, path: str) -> tuple[float, float, Future | None]:
            """Start method ``m``; returns (call time, blocked seconds, committed future)."""
            t0 = time.perf_counter()
            staged, committed = methods.start[m](path)
            if staged is not None:
                staged.result()
            return t0, time.perf_counter() - t0, committed

        def durable_run(m: str, rep: int) -> None:
            path = os.path.join(cfg.root, f"ws{world}", m)
            fresh(path)
            before = _rss()
            with peak:
                t0, blocked, committed = call(m, path)
                if committed is not None:
                    committed.result()
                durable = time.perf_counter() - t0
            held = None
            if rep < 0:  # what the method keeps from save to save (staging buffers)
                gc.collect(1)
                trim_heap()
                held = _rss() - before
            records.append(dict(base, method=m, run="durable", rep=rep, blocked_s=blocked,
                                durable_s=None if METHODS[m] == "limit" else durable, extra_rss=peak.extra, held_rss=held))
            if rank == 0:
                print(f"  ws{world} rep {rep:2} {m:18} blocked {blocked:8.4f} s  durable {durable:7.3f} s",
                      file=sys.stderr, flush=True)

        def training_run(m: str, rep: int) -> None:
            path = os.path.join(cfg.root, f"ws{world}", m)
            fresh(path)
            t0, blocked, committed = call(m, path)
            at: list[float] = []
            if committed is not None:
                committed.add_done_callback(lambda _f: at.append(time.perf_counter()))
            steps = []
            while committed is not None and not committed.done():
                s = time.perf_counter()
                trainer.step()
                steps.append((s, time.perf_counter()))
            if committed is not None:
                committed.result()
            commit = at[0] if at else time.perf_counter()
            during = [e - s for s, e in steps if s < commit]
            records.append(dict(base, method=m, run="training", rep=rep, blocked_s=blocked, durable_s=commit - t0,
                                step_s=sum(during) / len(during) if during else None, steps=len(during)))
            dist.barrier()

        def baseline_run(rep: int) -> None:
            dist.barrier()
            ts = []
            for _ in range(cfg.baseline_steps):
                s = time.perf_counter()
                trainer.step()
                ts.append(time.perf_counter() - s)
            records.append(dict(base, method=BASELINE, run="training", rep=rep, step_s=sum(ts) / len(ts), steps=len(ts)))
            dist.barrier()

        order = (*cfg.methods, BASELINE)
        for rep in range(-1, cfg.reps):  # rep -1: every method's first save (allocations, process start)
            k = max(rep, 0) % len(order)
            for m in order[k:] + order[:k]:
                if m == BASELINE:
                    if rep >= 0:
                        baseline_run(rep)
                    continue
                durable_run(m, rep)
                if rep >= 0 and METHODS[m] == "async":
                    training_run(m, rep)
        fresh(os.path.join(cfg.root, f"ws{world}"))
    finally:
        if methods is not None:
            methods.close()
        dist.destroy_process_group()
    return records


def run_world(cfg: Config, world: int, timeout: float = 3600.0) -> list[dict]:
    """Every method at one world size; returns every rank's records."""
    return run_ranks_collect(_run_rank, world, cfg, timeout=timeout, daemon=False, join_s=60)


# ---------------------------------------------------------------- summary


def merge_ranks(records: list[dict]) -> list[dict]:
    """One record per (world, method, run, rep): the slowest rank's times, the fewest steps."""
    merged: dict[tuple, dict] = {}
    for r in records:
        key = (r["world"], r["method"], r["run"], r["rep"])
        m = merged.setdefault(key, {k: v for k, v in r.items() if k != "rank"})
        for f in ("blocked_s", "durable_s", "step_s", "extra_rss", "held_rss", "state_bytes"):
            if r.get(f) is not None:
                m[f] = max(m[f], r[f]) if m.get(f) is not None else r[f]
        if "steps" in r:
            m["steps"] = min(m["steps"], r["steps"])
    return list(merged.values())


def _med(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return median(vals) if vals else None


def training_lost(records: list[dict]) -> list[dict]:
    """Per (world, method, rep), the slowest rank's training time lost to the save: the blocked
    time plus, for an async save, what the steps in flight took beyond the rank's median step
    with no save in flight (for a synchronous save or the memcpy, the blocked time alone)."""
    base: dict[tuple[int, int], float] = {}
    for (world, rank) in {(r["world"], r["rank"]) for r in records}:
        steps = [r["step_s"] for r in records if (r["world"], r["rank"], r["method"]) == (world, rank, BASELINE)]
        if steps:
            base[world, rank] = median(steps)
    lost: dict[tuple, float] = {}
    for r in records:
        if r["rep"] < 0 or r["method"] == BASELINE or r["run"] != ("training" if METHODS[r["method"]] == "async" else "durable"):
            continue
        extra = 0.0
        if r.get("steps") and (r["world"], r["rank"]) in base:
            extra = r["steps"] * (r["step_s"] - base[r["world"], r["rank"]])
        key = (r["world"], r["method"], r["rep"])
        lost[key] = max(lost.get(key, 0.0), r["blocked_s"] + extra)
    return [dict(world=w, method=m, rep=rep, lost_s=v) for (w, m, rep), v in lost.items()]


def summarize(records: list[dict]) -> dict[int, dict[str, dict]]:
    """Per world size and method: medians over the timed repetitions, spread, first save."""
    out: dict[int, dict[str, dict]] = {}
    merged = merge_ranks(records)
    lost = training_lost(records)
    for world in sorted({r["world"] for r in merged}):
        rows: dict[str, dict] = {}
        for m in [*METHODS, BASELINE]:
            rs = [r for r in merged if r["world"] == world and r["method"] == m]
            if not rs:
                continue
            dur = [r for r in rs if r["run"] == "durable" and r["rep"] >= 0]
            first = [r for r in rs if r["run"] == "durable" and r["rep"] < 0]
            train = [r for r in rs if r["run"] == "training"]
            blocked = sorted(r["blocked_s"] for r in dur)
            rows[m] = dict(
                kind=METHODS.get(m, "baseline"),
                n=len(blocked) or len(train),
                blocked_s=_med(blocked), blocked_min=blocked[0] if blocked else None, blocked_max=blocked[-1] if blocked else None,
                first_blocked_s=first[0]["blocked_s"] if first else None,
                durable_s=_med([r["durable_s"] for r in dur]),
                durable_training_s=_med([r.get("durable_s") for r in train]) if m != BASELINE else None,
                step_s=_med([r.get("step_s") for r in train]),
                steps=_med([r.get("steps") for r in train]),
                extra_rss=_med([r.get("extra_rss") for r in dur]),
                held_rss=first[0].get("held_rss") if first else None,
                lost_s=_med([r["lost_s"] for r in lost if (r["world"], r["method"]) == (world, m)]),
                state_bytes=max(r["state_bytes"] for r in rs),
            )
        base = rows.get(BASELINE, {}).get("step_s")
        for row in rows.values():
            row["slowdown_pct"] = None
            if row["kind"] == "async":  # no step overlapped the save: nothing was slowed
                row["slowdown_pct"] = 100.0 * (row["step_s"] / base - 1.0) if row["step_s"] and base else 0.0
        out[world] = rows
    return out


def ratio_lines(summary: dict[int, dict[str, dict]]) -> list[str]:
    """The ``ASYNC`` and ``TARGETS`` lines, one pair per world size with both our methods, the
    memcpy limit and at least one DCP async method measured."""
    lines = []
    for world, rows in summary.items():
        dcp = {m: r for m, r in rows.items() if m.startswith("dcp-") and r["kind"] == "async"}
        if not (OURS in rows and OURS_SYNC in rows and "memcpy" in rows and dcp):
            continue
        ours, best = rows[OURS], min(dcp, key=lambda m: dcp[m]["blocked_s"])
        least = min((m for m in rows if m.startswith("dcp-")), key=lambda m: rows[m]["lost_s"])
        thread = dcp.get("dcp-thread", dcp[best])
        v = dict(
            blocked_vs_memcpy=ours["blocked_s"] / rows["memcpy"]["blocked_s"],
            blocked_vs_dcp_best=ours["blocked_s"] / dcp[best]["blocked_s"],
            step_slowdown=ours["slowdown_pct"],
            durable_vs_sync=ours["durable_s"] / rows[OURS_SYNC]["durable_s"],
        )
        lines.append(
            f"ASYNC ws{world} blocked_s={ours['blocked_s']:.4g} memcpy_s={rows['memcpy']['blocked_s']:.4g} dcp_best={best} "
            f"dcp_best_blocked_s={dcp[best]['blocked_s']:.4g} blocked_vs_memcpy={v['blocked_vs_memcpy']:.2f}x "
            f"blocked_vs_dcp_best={v['blocked_vs_dcp_best']:.2f}x step_ms={rows[BASELINE]['step_s'] * 1e3:.1f} "
            f"step_slowdown={v['step_slowdown']:.1f}% overlapped_steps={ours['steps'] or 0:g} "
            f"dcp_step_slowdown={thread['slowdown_pct']:.1f}% durable_s={ours['durable_s']:.4g} "
            f"sync_s={rows[OURS_SYNC]['durable_s']:.4g} durable_vs_sync={v['durable_vs_sync']:.2f}x "
            f"lost_s={ours['lost_s']:.4g} dcp_min_lost={least} dcp_min_lost_s={rows[least]['lost_s']:.4g}"
        )
        lines.append(f"TARGETS ws{world} " + " ".join(
            f"{k}<={t:g}{'%' if k == 'step_slowdown' else 'x'}:{'ok' if v[k] <= t else 'MISS'}" for k, t in TARGETS.items()))
    return lines


def _f(v: float | None, fmt: str) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else format(v, fmt)


def markdown(summary: dict[int, dict[str, dict]], info: dict, config: dict) -> str:
    head = (
        f"{info['date']}, {info['cpu']}, {info['cores']} cores, {info['memory_gib']} GiB, torch {info['torch']}, "
        f"commit {info['commit']}; {config['mib_per_rank']:g} MiB per rank, {config['reps']} repetitions (medians), "
        f"training step: MLP {config['mlp']}, {config['elapsed_s']:.0f} s in all. State: "
        + "; ".join(f"ws{w}: {d}" for w, d in config["states"].items()) + ".\n\n"
        "| ws | method | blocked s (min–max) | first save blocked s | durable s | durable s, training | step ms | step slowdown | steps overlapped | training lost s | peak extra RSS MiB | held MiB |\n"
        "|---|---|---|---|---|---|---|---|---|---|---|---|\n"
    )
    body = []
    for world, rows in summary.items():
        for m, r in rows.items():
            blocked = "-" if r["blocked_s"] is None else f"{r['blocked_s']:.4f} ({r['blocked_min']:.4f}–{r['blocked_max']:.4f})"
            body.append(
                f"| {world} | {m} | {blocked} | {_f(r['first_blocked_s'], '.4f')} | {_f(r['durable_s'], '.4f')} "
                f"| {_f(r['durable_training_s'], '.4f')} | {_f(r['step_s'] and r['step_s'] * 1e3, '.1f')} "
                f"| {_f(r['slowdown_pct'], '+.1f')}{'%' if r['slowdown_pct'] is not None else ''} | {_f(r['steps'], 'g')} "
                f"| {_f(r['lost_s'], '.4f')} "
                f"| {_f(r['extra_rss'] and r['extra_rss'] / _MiB, '.1f')} | {_f(r['held_rss'] and r['held_rss'] / _MiB, '.1f')} |"
            )
    lines = ratio_lines(summary)
    return head + "\n".join(body) + ("\n\n```\n" + "\n".join(lines) + "\n```\n" if lines else "\n")


def update_docs(doc: str, table: str) -> None:
    """Replace the generated part of the async section of ``doc`` (between its markers)."""
    replace_section(doc, BEGIN, END, table)


# ---------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib-per-rank", type=float, default=None, help="training state per rank (default 256, --quick 8)")
    ap.add_argument("--reps", type=int, default=None, help="timed repetitions of every method (default 5, --quick 3)")
    ap.add_argument("--world-sizes", default="2,4")
    ap.add_argument("--methods", default=None, help="comma-separated subset of: " + ", ".join(METHODS)
                    + " (default: all that run here; " + ", ".join(CUDA_ONLY) + " needs CUDA)")
    ap.add_argument("--mlp", default="512,2048,128", help="width,hidden,batch of the training step's MLP")
    ap.add_argument("--threads", type=int, default=None, help="torch threads per rank (default: cores // world size)")
    ap.add_argument("--quick", action="store_true", help="a smoke run: 8 MiB per rank, 3 repetitions")
    ap.add_argument("--dir", default="/tmp/shardsafe-bench-async", help="scratch directory for the checkpoints (emptied)")
    ap.add_argument("--out", default=os.path.join(_REPO, "benchmarks", "results"))
    ap.add_argument("--update-docs", action="store_true", help="write the table into docs/benchmarks.md")
    ap.add_argument("--from-json", metavar="PATH", help="only redo the outputs from an earlier run's async.json")
    args = ap.parse_args(argv)
    if args.from_json:
        with open(args.from_json) as f:
            old = json.load(f)
        return _outputs(args, old["records"], old["machine"], old["config"])
    if args.methods is None:
        import torch

        methods = tuple(m for m in METHODS if m not in CUDA_ONLY or torch.cuda.is_available())
    else:
        methods = tuple(m for m in args.methods.split(",") if m)
    mib = args.mib_per_rank if args.mib_per_rank is not None else (8.0 if args.quick else 256.0)
    reps = args.reps if args.reps is not None else (3 if args.quick else 5)
    mlp = tuple(int(x) for x in args.mlp.split(","))
    worlds = tuple(int(w) for w in args.world_sizes.split(",") if w)
    if set(methods) - set(METHODS) or reps < 1 or mib <= 0 or len(mlp) != 3 or not worlds or min(worlds) < 1:
        ap.error(f"bad --methods {sorted(set(methods) - set(METHODS))}, --reps {reps}, --mib-per-rank {mib}, --mlp or --world-sizes")
    cfg = Config(root=args.dir, mib_per_rank=mib, reps=reps, methods=methods,
                 baseline_steps=6 if args.quick else 15, mlp=mlp, threads=args.threads)  # type: ignore[arg-type]

    shutil.rmtree(cfg.root, ignore_errors=True)
    os.makedirs(cfg.root)
    t0 = time.time()
    records: list[dict] = []
    try:
        for world in worlds:
            print(f"world size {world} ... ({time.time() - t0:.0f} s)", file=sys.stderr, flush=True)
            records += run_world(cfg, world)
    finally:
        shutil.rmtree(cfg.root, ignore_errors=True)
    config = dict(asdict(cfg), world_sizes=worlds, elapsed_s=round(time.time() - t0, 1),
                  states={w: training_spec(int(mib * _MiB * w))[1] for w in worlds})
    return _outputs(args, records, machine(), config)


def _outputs(args: argparse.Namespace, records: list[dict], info: dict, config: dict) -> int:
    summary = summarize(records)
    table = markdown(summary, info, config)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "async.json"), "w") as f:
        json.dump(dict(machine=info, config=config, records=records, summary={str(k): v for k, v in summary.items()}), f, indent=1)
    with open(os.path.join(args.out, "async.md"), "w") as f:
        f.write(table)
    if args.update_docs:
        update_docs(os.path.join(_REPO, "docs", "benchmarks.md"), table)
    print(table)
    print(f"\n{config['elapsed_s']:.0f} s; raw results in {args.out}/async.json", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
